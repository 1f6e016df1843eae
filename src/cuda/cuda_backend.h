/* cuda_backend.h -- the CUDA backend as api.c sees it: one workspace-size function and one
 * run function per op, plus availability and context set-up. Plain C declarations (api.c is
 * C11); the definitions live in src/cuda/ *.cu with C linkage. Arguments arrive validated
 * (validate.c); tensors hold DEVICE pointers, cu_seqlens stays a HOST pointer, the
 * workspace is device memory, and every launch goes on ctx->stream (context parallelism's
 * collectives: on a stream of the context's own, which events order against it). */
#ifndef NSA_CUDA_BACKEND_H
#define NSA_CUDA_BACKEND_H

#include "../internal.h"

#ifdef __cplusplus
extern "C" {
#endif
#include "../flex_route.h" /* (C declarations, expr.h's among them) */

/* @return nonzero when the CUDA runtime sees at least one device (0, quietly, without a
 *         driver or a GPU). */
int nsa_cuda_available(void);
/* Selects ctx->device. @return SUCCESS, BAD_ARGUMENT (no such ordinal) or DEVICE_ERROR. */
nsa_status nsa_cuda_context_init(nsa_context *ctx);

size_t nsa_cuda_compress_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_args *a);
nsa_status nsa_cuda_compress(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_args *a, void *ws);
size_t nsa_cuda_compress_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_bwd_args *a);
nsa_status nsa_cuda_compress_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_bwd_args *a,
                                 void *ws);
size_t nsa_cuda_cmp_attn_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_args *a);
nsa_status nsa_cuda_cmp_attn(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_args *a, void *ws);
size_t nsa_cuda_cmp_attn_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_bwd_args *a);
nsa_status nsa_cuda_cmp_attn_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_bwd_args *a,
                                 void *ws);
size_t nsa_cuda_select_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_select_args *a);
nsa_status nsa_cuda_select(const nsa_context *ctx, const nsa_problem *p, const nsa_select_args *a, void *ws);
size_t nsa_cuda_slc_attn_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_args *a);
nsa_status nsa_cuda_slc_attn(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_args *a, void *ws);
size_t nsa_cuda_slc_attn_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_bwd_args *a);
nsa_status nsa_cuda_slc_attn_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_bwd_args *a,
                                 void *ws);
size_t nsa_cuda_attention_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_args *a);
nsa_status nsa_cuda_attention(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_args *a, void *ws);
size_t nsa_cuda_attention_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_bwd_args *a);
nsa_status nsa_cuda_attention_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_bwd_args *a,
                                  void *ws);
size_t nsa_cuda_gate_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_args *a);
nsa_status nsa_cuda_gate(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_args *a, void *ws);
size_t nsa_cuda_gate_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_bwd_args *a);
nsa_status nsa_cuda_gate_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_bwd_args *a, void *ws);
size_t nsa_cuda_forward_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_forward_args *a);
nsa_status nsa_cuda_forward(const nsa_context *ctx, const nsa_problem *p, const nsa_forward_args *a, void *ws);
size_t nsa_cuda_backward_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_backward_args *a);
nsa_status nsa_cuda_backward(const nsa_context *ctx, const nsa_problem *p, const nsa_backward_args *a, void *ws);
size_t nsa_cuda_step_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_step_args *a);
nsa_status nsa_cuda_step(const nsa_context *ctx, const nsa_problem *p, const nsa_step_args *a, void *ws);
size_t nsa_cuda_flex_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_args *a);
nsa_status nsa_cuda_flex(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_args *a, void *ws);
size_t nsa_cuda_flex_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_bwd_args *a);
nsa_status nsa_cuda_flex_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_bwd_args *a, void *ws);
/* The dense route's inputs (flex_route.h): the block lists and the document ids in host memory,
 * q and k scanned for non-finite values when the route needs it; ws holds at least 256 bytes. */
nsa_status nsa_cuda_flex_route_read(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_args *a, const flex_route *r,
                                    void *ws, flex_route_host *h);
void *nsa_cuda_flex_cache_new(void);
void nsa_cuda_flex_cache_free(void *cache);
/* The generated kernel of (mask, score, elem 0 f32 / 1 f16 / 2 bf16) compiled by NVRTC for a
 * compute capability, no GPU needed: its cubin's bytes and the compile time. */
nsa_status nsa_cuda_flex_compile_check(const nsa_mod *mask, const nsa_mod *score, int elem, int bwd, int major, int minor,
                                       size_t *cubin_bytes, double *seconds);
size_t nsa_cuda_attention_step_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_step_args *a);
nsa_status nsa_cuda_attention_step(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_step_args *a, void *ws);
/* Context parallelism over NCCL (cp/cp.cu): whether NCCL loaded; one forward (ba NULL) or
 * backward, checked once, then sized into *need (need non-NULL: nothing runs) or, need NULL, the
 * workspace checked (WORKSPACE_TOO_SMALL, NULL_POINTER) and the call run; the context's
 * communication stream and events freed (NULL: nothing). */
int nsa_cuda_cp_available(void);
nsa_status nsa_cuda_cp_run(nsa_context *ctx, const nsa_cp_args *a, const nsa_cp_bwd_args *ba, void *ws, size_t ws_bytes,
                           size_t *need);
void nsa_cuda_cp_state_free(void *state);

#ifdef __cplusplus
}
#endif

#endif
