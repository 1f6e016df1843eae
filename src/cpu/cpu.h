/* cpu.h -- the CPU backend: one workspace-size function and one run function per op.
 * They receive arguments already validated by validate.c (p holds the derived sizes). */
#ifndef NSA_CPU_H
#define NSA_CPU_H

#include "../internal.h"

size_t nsa_cpu_compress_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_args *a);
nsa_status nsa_cpu_compress(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_args *a, void *ws);
size_t nsa_cpu_compress_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_bwd_args *a);
nsa_status nsa_cpu_compress_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_bwd_args *a, void *ws);
size_t nsa_cpu_cmp_attn_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_args *a);
nsa_status nsa_cpu_cmp_attn(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_args *a, void *ws);
size_t nsa_cpu_cmp_attn_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_bwd_args *a);
nsa_status nsa_cpu_cmp_attn_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_bwd_args *a, void *ws);
size_t nsa_cpu_select_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_select_args *a);
nsa_status nsa_cpu_select(const nsa_context *ctx, const nsa_problem *p, const nsa_select_args *a, void *ws);
size_t nsa_cpu_slc_attn_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_args *a);
nsa_status nsa_cpu_slc_attn(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_args *a, void *ws);
size_t nsa_cpu_slc_attn_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_bwd_args *a);
nsa_status nsa_cpu_slc_attn_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_bwd_args *a, void *ws);
size_t nsa_cpu_attention_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_args *a);
nsa_status nsa_cpu_attention(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_args *a, void *ws);
size_t nsa_cpu_attention_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_bwd_args *a);
nsa_status nsa_cpu_attention_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_bwd_args *a,
                                 void *ws);
size_t nsa_cpu_gate_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_args *a);
nsa_status nsa_cpu_gate(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_args *a, void *ws);
size_t nsa_cpu_gate_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_bwd_args *a);
nsa_status nsa_cpu_gate_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_bwd_args *a, void *ws);
size_t nsa_cpu_forward_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_forward_args *a);
nsa_status nsa_cpu_forward(const nsa_context *ctx, const nsa_problem *p, const nsa_forward_args *a, void *ws);
size_t nsa_cpu_backward_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_backward_args *a);
nsa_status nsa_cpu_backward(const nsa_context *ctx, const nsa_problem *p, const nsa_backward_args *a, void *ws);
size_t nsa_cpu_step_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_step_args *a);
nsa_status nsa_cpu_step(const nsa_context *ctx, const nsa_problem *p, const nsa_step_args *a, void *ws);
size_t nsa_cpu_flex_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_args *a);
nsa_status nsa_cpu_flex(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_args *a, void *ws);
size_t nsa_cpu_flex_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_bwd_args *a);
nsa_status nsa_cpu_flex_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_bwd_args *a, void *ws);
size_t nsa_cpu_attention_step_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_step_args *a);
nsa_status nsa_cpu_attention_step(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_step_args *a, void *ws);

#endif
