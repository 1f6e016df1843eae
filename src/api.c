/* api.c -- the public entry points of nsa.h that are not kernels: versions, status
 * strings, tensor views, configuration helpers, contexts, and the one dispatch place
 * (validate -> workspace check -> backend) shared by every operation. */
#include "internal.h"
#include "rules.h"
#include "cpu/cpu.h"
#ifdef NSA_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NSA_STR2(x) #x
#define NSA_STR(x) NSA_STR2(x)

int nsa_version_number(void) { return NSA_VERSION_NUMBER; }

const char *nsa_version_string(void)
{
    return NSA_STR(NSA_VERSION_MAJOR) "." NSA_STR(NSA_VERSION_MINOR) "." NSA_STR(NSA_VERSION_PATCH);
}

const char *nsa_status_string(nsa_status status)
{
    switch (status) {
    case NSA_STATUS_SUCCESS: return "success";
    case NSA_STATUS_NULL_POINTER: return "a required pointer (context, args, or tensor data) is NULL";
    case NSA_STATUS_BAD_RANK: return "a tensor has the wrong rank";
    case NSA_STATUS_BAD_SHAPE: return "a tensor's shape disagrees with the other arguments";
    case NSA_STATUS_BAD_STRIDE: return "a tensor's last-dim stride is not 1, or a stride is negative";
    case NSA_STATUS_BAD_DTYPE: return "a tensor's dtype is not allowed here";
    case NSA_STATUS_BAD_GQA: return "query heads HQ are not a multiple of kv heads H";
    case NSA_STATUS_BAD_CMP_STRIDE: return "cmp_stride d must be >= 1 and divide cmp_len l";
    case NSA_STATUS_BAD_CMP_LEN: return "cmp_len l must be >= 1 and <= slc_block l'";
    case NSA_STATUS_BAD_SLC_BLOCK: return "cmp_stride d must divide slc_block l'";
    case NSA_STATUS_BAD_TOPK: return "slc_topk n must be >= 1 and >= n_init + n_local (both >= 0)";
    case NSA_STATUS_BAD_WINDOW: return "window must be >= 1 (attention windows >= -1)";
    case NSA_STATUS_BAD_SCALE: return "scale must be finite and >= 0 (0 = 1/sqrt(DK))";
    case NSA_STATUS_BAD_CU_SEQLENS: return "cu_seqlens must start at 0, be non-decreasing, end at T, with B == 1";
    case NSA_STATUS_SIZE_OVERFLOW: return "a tensor's element count or offset overflows int64";
    case NSA_STATUS_WORKSPACE_TOO_SMALL: return "workspace smaller than the *_workspace_size() answer";
    case NSA_STATUS_BACKEND_UNAVAILABLE: return "backend not compiled in, or no device present";
    case NSA_STATUS_NOT_SUPPORTED: return "valid request not supported by this backend";
    case NSA_STATUS_OUT_OF_MEMORY: return "host memory allocation failed";
    case NSA_STATUS_DEVICE_ERROR: return "the device runtime reported an error";
    case NSA_STATUS_BAD_ARGUMENT: return "invalid argument";
    case NSA_STATUS_MISSING_OUTPUT: return "a required output tensor is absent";
    case NSA_STATUS_BAD_SOFTCAP: return "softcap must be finite and >= 0 (0 = off)";
    case NSA_STATUS_BAD_DROPOUT: return "dropout_p must be in [0, 1)";
    }
    return "unknown status";
}

size_t nsa_dtype_size(nsa_dtype dtype)
{
    switch (dtype) {
    case NSA_DTYPE_F32: return 4;
    case NSA_DTYPE_F16: return 2;
    case NSA_DTYPE_BF16: return 2;
    case NSA_DTYPE_I32: return 4;
    case NSA_DTYPE_U8: return 1;
    }
    return 0;
}

nsa_tensor nsa_tensor_make(void *data, nsa_dtype dtype, int32_t rank, const int64_t *shape)
{
    nsa_tensor t;
    memset(&t, 0, sizeof t);
    if (rank < 1 || rank > NSA_MAX_RANK || !shape) return t;
    t.data = data;
    t.dtype = dtype;
    t.rank = rank;
    int64_t stride = 1;
    for (int i = rank - 1; i >= 0; i--) {
        t.shape[i] = shape[i];
        t.stride[i] = stride;
        stride *= shape[i] > 0 ? shape[i] : 1;
    }
    return t;
}

nsa_tensor nsa_tensor_3d(void *data, nsa_dtype dtype, int64_t d0, int64_t d1, int64_t d2)
{
    const int64_t shape[3] = {d0, d1, d2};
    return nsa_tensor_make(data, dtype, 3, shape);
}

nsa_tensor nsa_tensor_4d(void *data, nsa_dtype dtype, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    const int64_t shape[4] = {d0, d1, d2, d3};
    return nsa_tensor_make(data, dtype, 4, shape);
}

nsa_config nsa_config_default(void)
{
    nsa_config c;
    memset(&c, 0, sizeof c);
    c.cmp_len = 32;
    c.cmp_stride = 16;
    c.slc_block = 64;
    c.slc_topk = 16;
    c.n_init = 1;
    c.n_local = 2;
    c.window = 512;
    c.scale = 0.0f;
    return c;
}

int64_t nsa_num_cmp_blocks(const nsa_config *config, int64_t T)
{
    if (!config || config->cmp_stride < 1 || T < 0) return 0;
    return nsa_rule_num_cmp(T, config->cmp_len, config->cmp_stride);
}

int64_t nsa_num_slc_blocks(const nsa_config *config, int64_t T)
{
    if (!config || config->slc_block < 1 || T < 0) return 0;
    return nsa_rule_num_slc(T, config->slc_block);
}

nsa_status nsa_cmp_offsets(const nsa_config *config, const int32_t *cu_seqlens, int64_t num_seqs, int64_t *cu_cmp)
{
    if (!config || !cu_seqlens || !cu_cmp) return NSA_STATUS_NULL_POINTER;
    nsa_status st = nsa_config_validate(config);
    if (st != NSA_STATUS_SUCCESS) return st;
    if (num_seqs < 0 || cu_seqlens[0] != 0) return NSA_STATUS_BAD_CU_SEQLENS;
    for (int64_t s = 0; s < num_seqs; s++)
        if (cu_seqlens[s + 1] < cu_seqlens[s]) return NSA_STATUS_BAD_CU_SEQLENS;
    cu_cmp[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        cu_cmp[s + 1] = cu_cmp[s] + nsa_rule_num_cmp(cu_seqlens[s + 1] - cu_seqlens[s], config->cmp_len, config->cmp_stride);
    return NSA_STATUS_SUCCESS;
}

/* ---- contexts ---------------------------------------------------------------------- */

int nsa_backend_available(nsa_backend backend)
{
    switch (backend) {
    case NSA_BACKEND_CPU: return 1;
    case NSA_BACKEND_CUDA:
#ifdef NSA_WITH_CUDA
        return nsa_cuda_available();
#else
        return 0;
#endif
    }
    return 0;
}

nsa_status nsa_context_create(nsa_context **ctx, const nsa_context_desc *desc)
{
    if (!ctx) return NSA_STATUS_NULL_POINTER;
    *ctx = NULL;
    if (!desc) return NSA_STATUS_NULL_POINTER;
    if (desc->backend != NSA_BACKEND_CPU && desc->backend != NSA_BACKEND_CUDA) return NSA_STATUS_BAD_ARGUMENT;
    if (desc->num_threads < 0 || desc->device < 0) return NSA_STATUS_BAD_ARGUMENT;
    if (!nsa_backend_available(desc->backend)) return NSA_STATUS_BACKEND_UNAVAILABLE;
    nsa_context *c = (nsa_context *)calloc(1, sizeof *c);
    if (!c) return NSA_STATUS_OUT_OF_MEMORY;
    c->backend = desc->backend;
    c->num_threads = desc->num_threads;
    c->device = desc->device;
    c->stream = desc->stream;
#ifdef NSA_WITH_CUDA
    if (c->backend == NSA_BACKEND_CUDA) {
        nsa_status st = nsa_cuda_context_init(c);
        if (st != NSA_STATUS_SUCCESS) {
            free(c);
            return st;
        }
    }
#endif
    *ctx = c;
    return NSA_STATUS_SUCCESS;
}

nsa_status nsa_context_set_stream(nsa_context *ctx, void *stream)
{
    if (!ctx) return NSA_STATUS_NULL_POINTER;
    ctx->stream = stream;
    return NSA_STATUS_SUCCESS;
}

nsa_backend nsa_context_backend(const nsa_context *ctx) { return ctx ? ctx->backend : NSA_BACKEND_CPU; }

void nsa_context_destroy(nsa_context *ctx) { free(ctx); }

/* ---- the one dispatch place ---------------------------------------------------------- */

#ifdef NSA_WITH_CUDA
#define NSA_CUDA_WS(op, ctx, p, a) \
    if ((ctx)->backend == NSA_BACKEND_CUDA) return nsa_cuda_##op##_workspace((ctx), (p), (a))
#define NSA_CUDA_RUN(op, ctx, p, a, ws) \
    if ((ctx)->backend == NSA_BACKEND_CUDA) return nsa_cuda_##op((ctx), (p), (a), (ws))
#else
#define NSA_CUDA_WS(op, ctx, p, a) (void)0
#define NSA_CUDA_RUN(op, ctx, p, a, ws) (void)0
#endif

/* Every public op: validate everything (once), then the workspace, then run. The backend
 * functions get a validated nsa_problem and never see bad input. */
#define NSA_DEFINE_OP(op, args_t)                                                                        \
    static size_t op##_need(const nsa_context *ctx, const nsa_problem *p, const args_t *args)           \
    {                                                                                                    \
        NSA_CUDA_WS(op, ctx, p, args);                                                                   \
        return nsa_cpu_##op##_workspace(ctx, p, args);                                                   \
    }                                                                                                    \
    nsa_status nsa_##op##_workspace_size(nsa_context *ctx, const args_t *args, size_t *bytes)            \
    {                                                                                                    \
        if (!ctx || !args || !bytes) return NSA_STATUS_NULL_POINTER;                                     \
        nsa_problem p;                                                                                   \
        nsa_status st = nsa_validate_##op(args, &p);                                                     \
        if (st != NSA_STATUS_SUCCESS) return st;                                                         \
        *bytes = op##_need(ctx, &p, args);                                                               \
        return NSA_STATUS_SUCCESS;                                                                       \
    }                                                                                                    \
    nsa_status nsa_##op(nsa_context *ctx, const args_t *args, void *workspace, size_t workspace_bytes)   \
    {                                                                                                    \
        if (!ctx || !args) return NSA_STATUS_NULL_POINTER;                                               \
        nsa_problem p;                                                                                   \
        nsa_status st = nsa_validate_##op(args, &p);                                                     \
        if (st != NSA_STATUS_SUCCESS) return st;                                                         \
        const size_t need = op##_need(ctx, &p, args);                                                    \
        if (workspace_bytes < need) return NSA_STATUS_WORKSPACE_TOO_SMALL;                               \
        if (need > 0 && !workspace) return NSA_STATUS_NULL_POINTER;                                      \
        NSA_CUDA_RUN(op, ctx, &p, args, workspace);                                                      \
        return nsa_cpu_##op(ctx, &p, args, workspace);                                                   \
    }

NSA_DEFINE_OP(compress, nsa_compress_args)
NSA_DEFINE_OP(compress_bwd, nsa_compress_bwd_args)
NSA_DEFINE_OP(cmp_attn, nsa_cmp_attn_args)
NSA_DEFINE_OP(cmp_attn_bwd, nsa_cmp_attn_bwd_args)
NSA_DEFINE_OP(select, nsa_select_args)
NSA_DEFINE_OP(slc_attn, nsa_slc_attn_args)
NSA_DEFINE_OP(slc_attn_bwd, nsa_slc_attn_bwd_args)
NSA_DEFINE_OP(attention, nsa_attention_args)
NSA_DEFINE_OP(attention_bwd, nsa_attention_bwd_args)
NSA_DEFINE_OP(gate, nsa_gate_args)
NSA_DEFINE_OP(gate_bwd, nsa_gate_bwd_args)
NSA_DEFINE_OP(forward, nsa_forward_args)
NSA_DEFINE_OP(backward, nsa_backward_args)
