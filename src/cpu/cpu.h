/* cpu.h -- the CPU backend: one workspace-size function and one run function per op.
 * They receive arguments already validated by validate.c (p holds the derived sizes). */
#ifndef NSA_CPU_H
#define NSA_CPU_H

#include "../internal.h"

#define NSA_CPU_OP(op, args_t)                                                                   \
    size_t nsa_cpu_##op##_workspace(const nsa_context *ctx, const nsa_problem *p, const args_t *a); \
    nsa_status nsa_cpu_##op(const nsa_context *ctx, const nsa_problem *p, const args_t *a, void *ws);

NSA_CPU_OP(compress, nsa_compress_args)
NSA_CPU_OP(compress_bwd, nsa_compress_bwd_args)
NSA_CPU_OP(cmp_attn, nsa_cmp_attn_args)
NSA_CPU_OP(cmp_attn_bwd, nsa_cmp_attn_bwd_args)
NSA_CPU_OP(select, nsa_select_args)
NSA_CPU_OP(slc_attn, nsa_slc_attn_args)
NSA_CPU_OP(slc_attn_bwd, nsa_slc_attn_bwd_args)
NSA_CPU_OP(attention, nsa_attention_args)
NSA_CPU_OP(attention_bwd, nsa_attention_bwd_args)
NSA_CPU_OP(gate, nsa_gate_args)
NSA_CPU_OP(gate_bwd, nsa_gate_bwd_args)
NSA_CPU_OP(forward, nsa_forward_args)
NSA_CPU_OP(backward, nsa_backward_args)

#undef NSA_CPU_OP

#endif
