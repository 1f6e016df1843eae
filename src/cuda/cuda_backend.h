/* cuda_backend.h -- the CUDA backend as api.c sees it: one workspace-size function and one
 * run function per op, plus availability and context set-up. Plain C declarations (api.c is
 * C11); the definitions live in src/cuda/ *.cu with C linkage. Arguments arrive validated
 * (validate.c); tensors hold DEVICE pointers, cu_seqlens stays a HOST pointer, the
 * workspace is device memory, and every launch goes on ctx->stream. */
#ifndef NSA_CUDA_BACKEND_H
#define NSA_CUDA_BACKEND_H

#include "../internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* @return nonzero when the CUDA runtime sees at least one device (0, quietly, without a
 *         driver or a GPU). */
int nsa_cuda_available(void);
/* Selects ctx->device. @return SUCCESS, BAD_ARGUMENT (no such ordinal) or DEVICE_ERROR. */
nsa_status nsa_cuda_context_init(nsa_context *ctx);

#define NSA_CUDA_OP(op, args_t)                                                                       \
    size_t nsa_cuda_##op##_workspace(const nsa_context *ctx, const nsa_problem *p, const args_t *a); \
    nsa_status nsa_cuda_##op(const nsa_context *ctx, const nsa_problem *p, const args_t *a, void *ws);

NSA_CUDA_OP(compress, nsa_compress_args)
NSA_CUDA_OP(compress_bwd, nsa_compress_bwd_args)
NSA_CUDA_OP(cmp_attn, nsa_cmp_attn_args)
NSA_CUDA_OP(cmp_attn_bwd, nsa_cmp_attn_bwd_args)
NSA_CUDA_OP(select, nsa_select_args)
NSA_CUDA_OP(slc_attn, nsa_slc_attn_args)
NSA_CUDA_OP(slc_attn_bwd, nsa_slc_attn_bwd_args)
NSA_CUDA_OP(attention, nsa_attention_args)
NSA_CUDA_OP(attention_bwd, nsa_attention_bwd_args)
NSA_CUDA_OP(gate, nsa_gate_args)
NSA_CUDA_OP(gate_bwd, nsa_gate_bwd_args)
NSA_CUDA_OP(forward, nsa_forward_args)
NSA_CUDA_OP(backward, nsa_backward_args)

#undef NSA_CUDA_OP

#ifdef __cplusplus
}
#endif

#endif
