/* api.c -- the public entry points of nsa.h that are not kernels: versions, status
 * strings, tensor views, configuration helpers, contexts, and the one dispatch place
 * (validate -> workspace check -> backend) shared by every operation. */
#include "internal.h"
#include "flex_route.h"
#include "rules.h"
#include "cpu/cpu.h"
#ifdef NSA_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
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
    case NSA_STATUS_BAD_CMP_STRIDE: return "cmp_stride d must be in [1, INT32_MAX] and divide cmp_len l";
    case NSA_STATUS_BAD_CMP_LEN: return "cmp_len l must be in [1, INT32_MAX] and <= slc_block l'";
    case NSA_STATUS_BAD_SLC_BLOCK: return "slc_block l' must be <= INT32_MAX and a multiple of cmp_stride d";
    case NSA_STATUS_BAD_TOPK: return "slc_topk n must be in [1, INT32_MAX] and >= n_init + n_local (both in [0, INT32_MAX])";
    case NSA_STATUS_BAD_WINDOW: return "window must be >= 1 (attention windows >= -1)";
    case NSA_STATUS_BAD_SCALE: return "scale must be finite and >= 0 (0 = 1/sqrt(DK))";
    case NSA_STATUS_BAD_CU_SEQLENS: return "cu_seqlens must start at 0, be non-decreasing, end at T, with B == 1";
    case NSA_STATUS_SIZE_OVERFLOW: return "a tensor's element count or offset overflows int64, or the workspace size overflows size_t";
    case NSA_STATUS_WORKSPACE_TOO_SMALL: return "workspace smaller than the *_workspace_size() answer";
    case NSA_STATUS_BACKEND_UNAVAILABLE: return "backend not compiled in, or no device present";
    case NSA_STATUS_NOT_SUPPORTED: return "valid request not supported by this backend";
    case NSA_STATUS_OUT_OF_MEMORY: return "host memory allocation failed";
    case NSA_STATUS_DEVICE_ERROR: return "the device runtime reported an error";
    case NSA_STATUS_BAD_ARGUMENT: return "invalid argument";
    case NSA_STATUS_MISSING_OUTPUT: return "a required output tensor is absent";
    case NSA_STATUS_BAD_SOFTCAP: return "softcap must be finite and >= 0 (0 = off)";
    case NSA_STATUS_BAD_DROPOUT: return "dropout_p must be in [0, 1)";
    case NSA_STATUS_BAD_EXPRESSION: return "a mask_mod / score_mod expression is not valid";
    }
    return "unknown status";
}

/* ---- the detail of the last failure --------------------------------------------------- */

/* Per thread, so that concurrent calls on different threads (one context each, or none) never
 * see each other's detail; it holds a diagnostic only, never anything a result depends on. */
static _Thread_local char tls_detail[NSA_DETAIL_BYTES];

const char *nsa_last_error_detail(void) { return tls_detail; }

void nsa_detail_clear(void) { tls_detail[0] = '\0'; }

nsa_status nsa_fail(nsa_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_detail, sizeof tls_detail, fmt, ap);
    va_end(ap);
    return status;
}

const char *nsa_shape_text(const nsa_tensor *t, char *buf, size_t size)
{
    size_t at = 0;
    const int rank = t->rank < 0 ? 0 : t->rank > NSA_MAX_RANK ? NSA_MAX_RANK : t->rank;
    at += (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < rank && at < size; i++)
        at += (size_t)snprintf(buf + at, size - at, "%s%" PRId64, i ? ", " : "", t->shape[i]);
    if (at < size) snprintf(buf + at, size - at, "]");
    return buf;
}

/* The end of a public call: a success leaves no detail behind (a backend's sizing pass may
 * have noted one it then did not return). */
static nsa_status done(nsa_status st)
{
    if (st == NSA_STATUS_SUCCESS) nsa_detail_clear();
    return st;
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

const char *nsa_dtype_name(nsa_dtype dtype)
{
    switch (dtype) {
    case NSA_DTYPE_F32: return "f32";
    case NSA_DTYPE_F16: return "f16";
    case NSA_DTYPE_BF16: return "bf16";
    case NSA_DTYPE_I32: return "i32";
    case NSA_DTYPE_U8: return "u8";
    }
    return "unknown";
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
    if (!config || config->cmp_stride < 1 || config->cmp_len < 1 || T < 0) return 0;
    return nsa_rule_num_cmp(T, config->cmp_len, config->cmp_stride);
}

int64_t nsa_num_slc_blocks(const nsa_config *config, int64_t T)
{
    if (!config || config->slc_block < 1 || T < 0) return 0;
    return nsa_rule_num_slc(T, config->slc_block);
}

nsa_status nsa_cmp_offsets(const nsa_config *config, const int32_t *cu_seqlens, int64_t num_seqs, int64_t *cu_cmp)
{
    nsa_detail_clear();
    if (!config) return nsa_fail(NSA_STATUS_NULL_POINTER, "config is NULL");
    if (!cu_seqlens) return nsa_fail(NSA_STATUS_NULL_POINTER, "cu_seqlens is NULL");
    if (!cu_cmp) return nsa_fail(NSA_STATUS_NULL_POINTER, "cu_cmp is NULL");
    nsa_status st = nsa_config_check(config, "config");
    if (st != NSA_STATUS_SUCCESS) return st;
    if (num_seqs < 0) return nsa_fail(NSA_STATUS_BAD_CU_SEQLENS, "num_seqs: %" PRId64 " is negative", num_seqs);
    if (cu_seqlens[0] != 0)
        return nsa_fail(NSA_STATUS_BAD_CU_SEQLENS, "cu_seqlens: cu_seqlens[0] is %d, must be 0", (int)cu_seqlens[0]);
    for (int64_t s = 0; s < num_seqs; s++)
        if (cu_seqlens[s + 1] < cu_seqlens[s])
            return nsa_fail(NSA_STATUS_BAD_CU_SEQLENS, "cu_seqlens: cu_seqlens[%" PRId64 "] = %d < cu_seqlens[%" PRId64 "] = %d (must not decrease)",
                            s + 1, (int)cu_seqlens[s + 1], s, (int)cu_seqlens[s]);
    cu_cmp[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        cu_cmp[s + 1] =
            cu_cmp[s] + nsa_rule_num_cmp(cu_seqlens[s + 1] - cu_seqlens[s], config->cmp_len, config->cmp_stride);
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
    nsa_detail_clear();
    if (!ctx) return nsa_fail(NSA_STATUS_NULL_POINTER, "ctx is NULL");
    *ctx = NULL;
    if (!desc) return nsa_fail(NSA_STATUS_NULL_POINTER, "desc is NULL");
    if (desc->backend != NSA_BACKEND_CPU && desc->backend != NSA_BACKEND_CUDA)
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "desc.backend: %d is not a backend (CPU 0, CUDA 1)", (int)desc->backend);
    if (desc->num_threads < 0)
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "desc.num_threads: %d is negative (0 = OpenMP default)", (int)desc->num_threads);
    if (desc->device < 0) return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "desc.device: %d is negative", (int)desc->device);
    if (!nsa_backend_available(desc->backend)) {
#ifdef NSA_WITH_CUDA
        return nsa_fail(NSA_STATUS_BACKEND_UNAVAILABLE, "desc.backend: CUDA is compiled in but no CUDA device is present");
#else
        return nsa_fail(NSA_STATUS_BACKEND_UNAVAILABLE, "desc.backend: CUDA is not compiled in (built with NSA_CUDA=0)");
#endif
    }
    nsa_context *c = (nsa_context *)calloc(1, sizeof *c);
    if (!c) return nsa_fail(NSA_STATUS_OUT_OF_MEMORY, "ctx: allocating the context (%zu bytes) failed", sizeof *c);
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
    nsa_detail_clear();
    if (!ctx) return nsa_fail(NSA_STATUS_NULL_POINTER, "ctx is NULL");
    ctx->stream = stream;
    return NSA_STATUS_SUCCESS;
}

nsa_backend nsa_context_backend(const nsa_context *ctx) { return ctx ? ctx->backend : NSA_BACKEND_CPU; }

void nsa_context_destroy(nsa_context *ctx)
{
#ifdef NSA_WITH_CUDA
    if (ctx && ctx->flex_cache) nsa_cuda_flex_cache_free(ctx->flex_cache);
    if (ctx && ctx->cp_state) nsa_cuda_cp_state_free(ctx->cp_state);
#endif
    free(ctx);
}

/* ---- the one dispatch place ---------------------------------------------------------- */

/* The operations of nsa.h, in its order. */
typedef enum op_id {
    OP_COMPRESS,
    OP_COMPRESS_BWD,
    OP_CMP_ATTN,
    OP_CMP_ATTN_BWD,
    OP_SELECT,
    OP_SLC_ATTN,
    OP_SLC_ATTN_BWD,
    OP_ATTENTION,
    OP_ATTENTION_BWD,
    OP_GATE,
    OP_GATE_BWD,
    OP_FORWARD,
    OP_BACKWARD,
    OP_STEP,
    OP_ATTENTION_STEP,
    OP_FLEX,
    OP_FLEX_BWD,
} op_id;

/* One call: the op and its args (a pointer to that op's own args struct). */
typedef struct op_call {
    op_id op;
    const void *args;
} op_call;

static nsa_status op_validate(op_call c, nsa_problem *p)
{
    switch (c.op) {
    case OP_COMPRESS: return nsa_validate_compress((const nsa_compress_args *)c.args, p);
    case OP_COMPRESS_BWD: return nsa_validate_compress_bwd((const nsa_compress_bwd_args *)c.args, p);
    case OP_CMP_ATTN: return nsa_validate_cmp_attn((const nsa_cmp_attn_args *)c.args, p);
    case OP_CMP_ATTN_BWD: return nsa_validate_cmp_attn_bwd((const nsa_cmp_attn_bwd_args *)c.args, p);
    case OP_SELECT: return nsa_validate_select((const nsa_select_args *)c.args, p);
    case OP_SLC_ATTN: return nsa_validate_slc_attn((const nsa_slc_attn_args *)c.args, p);
    case OP_SLC_ATTN_BWD: return nsa_validate_slc_attn_bwd((const nsa_slc_attn_bwd_args *)c.args, p);
    case OP_ATTENTION: return nsa_validate_attention((const nsa_attention_args *)c.args, p);
    case OP_ATTENTION_BWD: return nsa_validate_attention_bwd((const nsa_attention_bwd_args *)c.args, p);
    case OP_GATE: return nsa_validate_gate((const nsa_gate_args *)c.args, p);
    case OP_GATE_BWD: return nsa_validate_gate_bwd((const nsa_gate_bwd_args *)c.args, p);
    case OP_FORWARD: return nsa_validate_forward((const nsa_forward_args *)c.args, p);
    case OP_BACKWARD: return nsa_validate_backward((const nsa_backward_args *)c.args, p);
    case OP_STEP: return nsa_validate_step((const nsa_step_args *)c.args, p);
    case OP_ATTENTION_STEP: return nsa_validate_attention_step((const nsa_attention_step_args *)c.args, p);
    case OP_FLEX: return nsa_validate_flex((const nsa_flex_args *)c.args, p);
    case OP_FLEX_BWD: return nsa_validate_flex_bwd((const nsa_flex_bwd_args *)c.args, p);
    }
    return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "op: unknown operation %d", (int)c.op);
}

/* The backend's workspace need for a validated call. */
static size_t op_workspace(const nsa_context *ctx, const nsa_problem *p, op_call c)
{
#ifdef NSA_WITH_CUDA
    if (ctx->backend == NSA_BACKEND_CUDA) {
        switch (c.op) {
        case OP_COMPRESS: return nsa_cuda_compress_workspace(ctx, p, (const nsa_compress_args *)c.args);
        case OP_COMPRESS_BWD: return nsa_cuda_compress_bwd_workspace(ctx, p, (const nsa_compress_bwd_args *)c.args);
        case OP_CMP_ATTN: return nsa_cuda_cmp_attn_workspace(ctx, p, (const nsa_cmp_attn_args *)c.args);
        case OP_CMP_ATTN_BWD: return nsa_cuda_cmp_attn_bwd_workspace(ctx, p, (const nsa_cmp_attn_bwd_args *)c.args);
        case OP_SELECT: return nsa_cuda_select_workspace(ctx, p, (const nsa_select_args *)c.args);
        case OP_SLC_ATTN: return nsa_cuda_slc_attn_workspace(ctx, p, (const nsa_slc_attn_args *)c.args);
        case OP_SLC_ATTN_BWD: return nsa_cuda_slc_attn_bwd_workspace(ctx, p, (const nsa_slc_attn_bwd_args *)c.args);
        case OP_ATTENTION: return nsa_cuda_attention_workspace(ctx, p, (const nsa_attention_args *)c.args);
        case OP_ATTENTION_BWD: return nsa_cuda_attention_bwd_workspace(ctx, p, (const nsa_attention_bwd_args *)c.args);
        case OP_GATE: return nsa_cuda_gate_workspace(ctx, p, (const nsa_gate_args *)c.args);
        case OP_GATE_BWD: return nsa_cuda_gate_bwd_workspace(ctx, p, (const nsa_gate_bwd_args *)c.args);
        case OP_FORWARD: return nsa_cuda_forward_workspace(ctx, p, (const nsa_forward_args *)c.args);
        case OP_BACKWARD: return nsa_cuda_backward_workspace(ctx, p, (const nsa_backward_args *)c.args);
        case OP_STEP: return nsa_cuda_step_workspace(ctx, p, (const nsa_step_args *)c.args);
        case OP_ATTENTION_STEP: return nsa_cuda_attention_step_workspace(ctx, p, (const nsa_attention_step_args *)c.args);
        case OP_FLEX: return nsa_cuda_flex_workspace(ctx, p, (const nsa_flex_args *)c.args);
        case OP_FLEX_BWD: return nsa_cuda_flex_bwd_workspace(ctx, p, (const nsa_flex_bwd_args *)c.args);
        }
        return 0;
    }
#endif
    switch (c.op) {
    case OP_COMPRESS: return nsa_cpu_compress_workspace(ctx, p, (const nsa_compress_args *)c.args);
    case OP_COMPRESS_BWD: return nsa_cpu_compress_bwd_workspace(ctx, p, (const nsa_compress_bwd_args *)c.args);
    case OP_CMP_ATTN: return nsa_cpu_cmp_attn_workspace(ctx, p, (const nsa_cmp_attn_args *)c.args);
    case OP_CMP_ATTN_BWD: return nsa_cpu_cmp_attn_bwd_workspace(ctx, p, (const nsa_cmp_attn_bwd_args *)c.args);
    case OP_SELECT: return nsa_cpu_select_workspace(ctx, p, (const nsa_select_args *)c.args);
    case OP_SLC_ATTN: return nsa_cpu_slc_attn_workspace(ctx, p, (const nsa_slc_attn_args *)c.args);
    case OP_SLC_ATTN_BWD: return nsa_cpu_slc_attn_bwd_workspace(ctx, p, (const nsa_slc_attn_bwd_args *)c.args);
    case OP_ATTENTION: return nsa_cpu_attention_workspace(ctx, p, (const nsa_attention_args *)c.args);
    case OP_ATTENTION_BWD: return nsa_cpu_attention_bwd_workspace(ctx, p, (const nsa_attention_bwd_args *)c.args);
    case OP_GATE: return nsa_cpu_gate_workspace(ctx, p, (const nsa_gate_args *)c.args);
    case OP_GATE_BWD: return nsa_cpu_gate_bwd_workspace(ctx, p, (const nsa_gate_bwd_args *)c.args);
    case OP_FORWARD: return nsa_cpu_forward_workspace(ctx, p, (const nsa_forward_args *)c.args);
    case OP_BACKWARD: return nsa_cpu_backward_workspace(ctx, p, (const nsa_backward_args *)c.args);
    case OP_STEP: return nsa_cpu_step_workspace(ctx, p, (const nsa_step_args *)c.args);
    case OP_ATTENTION_STEP: return nsa_cpu_attention_step_workspace(ctx, p, (const nsa_attention_step_args *)c.args);
    case OP_FLEX: return nsa_cpu_flex_workspace(ctx, p, (const nsa_flex_args *)c.args);
    case OP_FLEX_BWD: return nsa_cpu_flex_bwd_workspace(ctx, p, (const nsa_flex_bwd_args *)c.args);
    }
    return 0;
}

/* The backend's run of a validated call with enough workspace. */
static nsa_status backend_run(const nsa_context *ctx, const nsa_problem *p, op_call c, void *ws)
{
#ifdef NSA_WITH_CUDA
    if (ctx->backend == NSA_BACKEND_CUDA) {
        switch (c.op) {
        case OP_COMPRESS: return nsa_cuda_compress(ctx, p, (const nsa_compress_args *)c.args, ws);
        case OP_COMPRESS_BWD: return nsa_cuda_compress_bwd(ctx, p, (const nsa_compress_bwd_args *)c.args, ws);
        case OP_CMP_ATTN: return nsa_cuda_cmp_attn(ctx, p, (const nsa_cmp_attn_args *)c.args, ws);
        case OP_CMP_ATTN_BWD: return nsa_cuda_cmp_attn_bwd(ctx, p, (const nsa_cmp_attn_bwd_args *)c.args, ws);
        case OP_SELECT: return nsa_cuda_select(ctx, p, (const nsa_select_args *)c.args, ws);
        case OP_SLC_ATTN: return nsa_cuda_slc_attn(ctx, p, (const nsa_slc_attn_args *)c.args, ws);
        case OP_SLC_ATTN_BWD: return nsa_cuda_slc_attn_bwd(ctx, p, (const nsa_slc_attn_bwd_args *)c.args, ws);
        case OP_ATTENTION: return nsa_cuda_attention(ctx, p, (const nsa_attention_args *)c.args, ws);
        case OP_ATTENTION_BWD: return nsa_cuda_attention_bwd(ctx, p, (const nsa_attention_bwd_args *)c.args, ws);
        case OP_GATE: return nsa_cuda_gate(ctx, p, (const nsa_gate_args *)c.args, ws);
        case OP_GATE_BWD: return nsa_cuda_gate_bwd(ctx, p, (const nsa_gate_bwd_args *)c.args, ws);
        case OP_FORWARD: return nsa_cuda_forward(ctx, p, (const nsa_forward_args *)c.args, ws);
        case OP_BACKWARD: return nsa_cuda_backward(ctx, p, (const nsa_backward_args *)c.args, ws);
        case OP_STEP: return nsa_cuda_step(ctx, p, (const nsa_step_args *)c.args, ws);
        case OP_ATTENTION_STEP: return nsa_cuda_attention_step(ctx, p, (const nsa_attention_step_args *)c.args, ws);
        case OP_FLEX: return nsa_cuda_flex(ctx, p, (const nsa_flex_args *)c.args, ws);
        case OP_FLEX_BWD: return nsa_cuda_flex_bwd(ctx, p, (const nsa_flex_bwd_args *)c.args, ws);
        }
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "op: unknown operation %d", (int)c.op);
    }
#endif
    switch (c.op) {
    case OP_COMPRESS: return nsa_cpu_compress(ctx, p, (const nsa_compress_args *)c.args, ws);
    case OP_COMPRESS_BWD: return nsa_cpu_compress_bwd(ctx, p, (const nsa_compress_bwd_args *)c.args, ws);
    case OP_CMP_ATTN: return nsa_cpu_cmp_attn(ctx, p, (const nsa_cmp_attn_args *)c.args, ws);
    case OP_CMP_ATTN_BWD: return nsa_cpu_cmp_attn_bwd(ctx, p, (const nsa_cmp_attn_bwd_args *)c.args, ws);
    case OP_SELECT: return nsa_cpu_select(ctx, p, (const nsa_select_args *)c.args, ws);
    case OP_SLC_ATTN: return nsa_cpu_slc_attn(ctx, p, (const nsa_slc_attn_args *)c.args, ws);
    case OP_SLC_ATTN_BWD: return nsa_cpu_slc_attn_bwd(ctx, p, (const nsa_slc_attn_bwd_args *)c.args, ws);
    case OP_ATTENTION: return nsa_cpu_attention(ctx, p, (const nsa_attention_args *)c.args, ws);
    case OP_ATTENTION_BWD: return nsa_cpu_attention_bwd(ctx, p, (const nsa_attention_bwd_args *)c.args, ws);
    case OP_GATE: return nsa_cpu_gate(ctx, p, (const nsa_gate_args *)c.args, ws);
    case OP_GATE_BWD: return nsa_cpu_gate_bwd(ctx, p, (const nsa_gate_bwd_args *)c.args, ws);
    case OP_FORWARD: return nsa_cpu_forward(ctx, p, (const nsa_forward_args *)c.args, ws);
    case OP_BACKWARD: return nsa_cpu_backward(ctx, p, (const nsa_backward_args *)c.args, ws);
    case OP_STEP: return nsa_cpu_step(ctx, p, (const nsa_step_args *)c.args, ws);
    case OP_ATTENTION_STEP: return nsa_cpu_attention_step(ctx, p, (const nsa_attention_step_args *)c.args, ws);
    case OP_FLEX: return nsa_cpu_flex(ctx, p, (const nsa_flex_args *)c.args, ws);
    case OP_FLEX_BWD: return nsa_cpu_flex_bwd(ctx, p, (const nsa_flex_bwd_args *)c.args, ws);
    }
    return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "op: unknown operation %d", (int)c.op);
}

/* ---- block-sparse attention's dense route (flex_route.h, spec 14) ---------------------------- */
/* A flex call whose mods are attention options, whose block mask visits what they see and whose
 * scores cannot overflow (flex_route.h) runs as nsa_attention / nsa_attention_bwd on
 * the same backend, in the same workspace: the attention's own need first, then (a forward
 * without lse) a scratch lse. Whether the lists and document ids allow it is known only at run
 * time, so a query sizes the workspace for both paths. */

enum { ROUTE_ALIGN = 256 };

static size_t route_align(size_t n) { return nsa_size_add(n, ROUTE_ALIGN - 1) / ROUTE_ALIGN * ROUTE_ALIGN; }

static const nsa_flex_args *flex_fwd_of(op_call c)
{
    return c.op == OP_FLEX_BWD ? &((const nsa_flex_bwd_args *)c.args)->fwd : (const nsa_flex_args *)c.args;
}

int nsa_flex_route_without_lists(const nsa_mod *mask_mod, const nsa_mod *score_mod)
{
    expr_attention m;
    /* (prefix-LM: no option) */
    if (!flex_route_enabled() || !expr_as_attention(mask_mod, score_mod, &m) || m.prefix > 0) return 0;
    return m.doc < 0 ? 1 : 2;
}

int64_t nsa_flex_doc_runs(const nsa_mod *mask_mod, int64_t T, int32_t *runs, int32_t *ids_tensor)
{
    expr_attention m;
    if (!mask_mod || !runs || T < 1 || T > INT32_MAX || !expr_as_attention(mask_mod, NULL, &m) || m.prefix > 0 || m.doc < 0)
        return 0;
    const nsa_tensor *d = expr_capture_tensor(mask_mod, m.doc);
    if (d->rank != 1 || d->shape[0] < T) return 0;
    int32_t *ids = (int32_t *)malloc((size_t)T * sizeof(int32_t));
    if (!ids) return -1;
    flex_route_gather_doc(d, T, ids);
    const int64_t n = flex_route_doc_runs(ids, T, runs);
    free(ids);
    if (n > 0 && ids_tensor) *ids_tensor = m.doc;
    return n;
}

/* The route's plan: the mods and shapes allow it, and a backward asks no tensor gradient. */
static int route_plan(const nsa_context *ctx, op_call c, const nsa_problem *p, flex_route *r)
{
    if (c.op != OP_FLEX && c.op != OP_FLEX_BWD) return 0;
    /* CUDA's attention and engine both take head dims up to 256; beyond, the engine refuses the
       call (NOT_SUPPORTED) before it reads the lists, and so does the route by not planning */
    if (ctx->backend == NSA_BACKEND_CUDA && (p->DK > 256 || p->DV > 256)) return 0;
    if (c.op == OP_FLEX_BWD)
        for (int t = 0; t < NSA_MOD_MAX_TENSORS; t++)
            if (nsa_present(&((const nsa_flex_bwd_args *)c.args)->dscore_tensors[t])) return 0;
    return flex_route_plan(flex_fwd_of(c), p, r);
}

/* The attention call of the route (args in *fa / *ba), lse a scratch at `scratch` in a forward
 * without one. @return the op_call, or one with args NULL when the mapped call is refused. */
static op_call route_call(op_call c, const nsa_problem *p, const flex_route *r, const int32_t *cu, int64_t nseq, void *scratch,
                          nsa_attention_args *fa, nsa_attention_bwd_args *ba, nsa_problem *p2)
{
    const nsa_flex_args *a = flex_fwd_of(c);
    nsa_tensor lse = a->lse;
    if (!nsa_present(&lse)) lse = nsa_tensor_make(scratch, NSA_DTYPE_F32, 3, (int64_t[]){p->B, p->T, p->HQ});
    op_call out = {OP_ATTENTION, fa};
    flex_route_args(r, a, &lse, cu, nseq, fa);
    if (c.op == OP_FLEX_BWD) {
        const nsa_flex_bwd_args *fb = (const nsa_flex_bwd_args *)c.args;
        memset(ba, 0, sizeof *ba);
        ba->fwd = *fa, ba->dout = fb->dout, ba->dq = fb->dq, ba->dk = fb->dk, ba->dv = fb->dv;
        out = (op_call){OP_ATTENTION_BWD, ba};
    }
    if (op_validate(out, p2) != NSA_STATUS_SUCCESS) out.args = NULL;
    p2->flex_rows = 1; /* (a row of all -inf scores stays empty, as in the engine) */
    return out;
}

static size_t op_workspace(const nsa_context *ctx, const nsa_problem *p, op_call c);

/* The route's need (0: no route): the attention's, for the caller's document runs, or over the
 * runs' extremes (one document, T of them) when the runs are not known yet, then the scratch lse. */
static size_t route_need(const nsa_context *ctx, op_call c, const nsa_problem *p, const flex_route *r)
{
    static float dummy[ROUTE_ALIGN / sizeof(float)]; /* a scratch lse's address in a query: never read */
    const int64_t T = p->T;
    const nsa_flex_args *fa0 = flex_fwd_of(c);
    /* the document runs each sizing takes: none; the caller's (validated); or, unknown yet, both
     * extremes (one document, T of them) */
    int32_t one[2] = {0, (int32_t)T}, *each = NULL;
    const int32_t *runs[2] = {NULL, NULL};
    int64_t nruns[2] = {0, 0};
    int forms = 1;
    if (r->doc && fa0->doc_runs) {
        runs[0] = fa0->doc_runs, nruns[0] = fa0->num_doc_runs;
    } else if (r->doc) {
        each = (int32_t *)malloc((size_t)(T + 1) * sizeof(int32_t));
        if (!each) return 0;
        for (int64_t i = 0; i <= T; i++) each[i] = (int32_t)i;
        runs[0] = one, nruns[0] = 1, runs[1] = each, nruns[1] = T, forms = 2;
    }
    size_t need = 0;
    for (int form = 0; form < forms; form++) {
        nsa_attention_args fa;
        nsa_attention_bwd_args ba;
        nsa_problem p2;
        const op_call ac = route_call(c, p, r, runs[form], nruns[form], dummy, &fa, &ba, &p2);
        const size_t n = ac.args ? op_workspace(ctx, &p2, ac) : SIZE_MAX;
        if (n == SIZE_MAX) {
            free(each);
            nsa_detail_clear(); /* (a refused mapping: the engine's path, no route) */
            return 0;
        }
        need = n > need ? n : need;
    }
    free(each);
    if (c.op == OP_FLEX && !nsa_present(&flex_fwd_of(c)->lse))
        need = nsa_size_add(route_align(need), nsa_size_mul(nsa_size_elems(p->B, p->T, p->HQ, 1), sizeof(float)));
    return need > ROUTE_ALIGN ? need : ROUTE_ALIGN;
}

static nsa_status backend_run(const nsa_context *ctx, const nsa_problem *p, op_call c, void *ws);

/* Runs the route when the call's data allow it and the attention's workspace for them fits the
 * caller's (*taken), else leaves everything untouched. */
static nsa_status route_run(const nsa_context *ctx, op_call c, const nsa_problem *p, const flex_route *r, void *ws,
                            size_t ws_bytes, int *taken)
{
    *taken = 0;
    const nsa_flex_args *a = flex_fwd_of(c);
    flex_route_host h;
    memset(&h, 0, sizeof h);
    nsa_status st;
#ifdef NSA_WITH_CUDA
    if (ctx->backend == NSA_BACKEND_CUDA) st = nsa_cuda_flex_route_read(ctx, p, a, r, ws, &h);
    else
#endif
        st = flex_route_host_cpu(a, p, r, &h);
    if (st == NSA_STATUS_OUT_OF_MEMORY) { /* the decision's host buffers: without them, the engine's path */
        nsa_detail_clear();
        st = NSA_STATUS_SUCCESS;
        h.decline = 1;
    }
    if (r->doc && a->doc_runs) h.runs = a->doc_runs, h.nruns = a->num_doc_runs;
    nsa_flex_args hl = *a; /* the lists' contents, checked as the engine checks them: a bad list is refused either way */
    hl.block_mask = h.lists;
    if (st == NSA_STATUS_SUCCESS && !h.decline) st = nsa_flex_lists_check(&hl, p); /* (declined: the lists are not here) */
    int32_t *cu = st == NSA_STATUS_SUCCESS && r->doc ? (int32_t *)malloc((size_t)(p->T + 1) * sizeof(int32_t)) : NULL;
    int64_t nseq = 0;
    const int go = st == NSA_STATUS_SUCCESS && (!r->doc || cu) && flex_route_decide(r, &h, p, cu, &nseq) == 1;
    flex_route_host_free(&h);
    if (st != NSA_STATUS_SUCCESS || !go) {
        free(cu);
        return st;
    }
    /* the scratch lse after the attention's own workspace (route_need's layout) */
    nsa_attention_args fa;
    nsa_attention_bwd_args ba;
    nsa_problem p2;
    op_call ac = route_call(c, p, r, cu, nseq, ws, &fa, &ba, &p2);
    const size_t own = ac.args ? op_workspace(ctx, &p2, ac) : SIZE_MAX;
    if (ac.args && c.op == OP_FLEX && !nsa_present(&a->lse)) {
        const size_t lse_bytes = nsa_size_mul(nsa_size_elems(p->B, p->T, p->HQ, 1), sizeof(float));
        ac = nsa_size_add(route_align(own), lse_bytes) <= ws_bytes
                 ? route_call(c, p, r, cu, nseq, (char *)ws + route_align(own), &fa, &ba, &p2)
                 : (op_call){OP_ATTENTION, NULL};
    } else if (own > ws_bytes) { /* (the query sized the documents' extremes: these runs need more) */
        ac.args = NULL;
    }
    if (ac.args) {
        st = backend_run(ctx, &p2, ac, ws);
        *taken = st != NSA_STATUS_NOT_SUPPORTED; /* (a backend that cannot take the mapped call: the engine's path) */
        if (*taken) flex_route_note_taken();
    }
    if (!*taken) {
        nsa_detail_clear();
        st = NSA_STATUS_SUCCESS;
    }
    free(cu);
    return st;
}

/* The workspace of a validated call: the backend's, and for a flex call that may take the dense
 * route, that route's if larger. */
static size_t op_need(const nsa_context *ctx, const nsa_problem *p, op_call c)
{
    const size_t own = op_workspace(ctx, p, c);
    flex_route r;
    if (own == SIZE_MAX || !route_plan(ctx, c, p, &r)) return own;
    const size_t route = route_need(ctx, c, p, &r);
    return route > own ? route : own;
}

static nsa_status op_run(const nsa_context *ctx, const nsa_problem *p, op_call c, void *ws, size_t ws_bytes)
{
    flex_route r;
    if (route_plan(ctx, c, p, &r)) {
        int taken = 0;
        const nsa_status st = route_run(ctx, c, p, &r, ws, ws_bytes, &taken);
        if (st != NSA_STATUS_SUCCESS || taken) return st;
    }
    return backend_run(ctx, p, c, ws);
}

/* Both halves of every public op: validate everything (once), size the workspace, then
 * either report the size (query: *bytes) or check the caller's workspace and run. The
 * backend functions get a validated nsa_problem and never see bad input, nor a workspace
 * need that overflowed. */
typedef enum op_mode { OP_QUERY, OP_RUN } op_mode;

/* A call without heads (HQ = H = 0, e.g. a shard that holds none) has nothing to compute: its
 * outputs are empty, except a step's per-sequence errors (the steps run: their checks of
 * lengths and pages still apply) and a dbias broadcast over the heads (Hb = 1), the sum over no
 * heads: zeros. */
static int no_heads(op_call c, const nsa_problem *p)
{
    return p->HQ == 0 && p->H == 0 && c.op != OP_STEP && c.op != OP_ATTENTION_STEP;
}

static nsa_status run_no_heads(const nsa_context *ctx, op_call c)
{
    if (c.op != OP_ATTENTION_BWD) return NSA_STATUS_SUCCESS;
    const nsa_tensor *db = &((const nsa_attention_bwd_args *)c.args)->dbias;
    int64_t n = 1;
    for (int d = 0; d < 4; d++) n *= db->shape[d] > 0 ? db->shape[d] : 0;
    if (!nsa_present(db) || n == 0) return NSA_STATUS_SUCCESS;
    if (ctx->backend != NSA_BACKEND_CPU)
        return nsa_fail(NSA_STATUS_NOT_SUPPORTED, "dbias: a call without heads (HQ = 0) with a broadcast bias: the "
                                                  "CUDA backend does not write its zeros; give no dbias");
    const size_t es = nsa_dtype_size(db->dtype);
    for (int64_t i0 = 0; i0 < db->shape[0]; i0++) /* 0 is all-zero bits in every float dtype */
        for (int64_t i1 = 0; i1 < db->shape[1]; i1++)
            for (int64_t i2 = 0; i2 < db->shape[2]; i2++)
                for (int64_t i3 = 0; i3 < db->shape[3]; i3++)
                    memset((char *)db->data +
                               (i0 * db->stride[0] + i1 * db->stride[1] + i2 * db->stride[2] + i3 * db->stride[3]) * (int64_t)es,
                           0, es);
    return NSA_STATUS_SUCCESS;
}

static nsa_status op_dispatch(nsa_context *ctx, op_call c, op_mode mode, size_t *bytes, void *workspace,
                              size_t workspace_bytes)
{
    nsa_detail_clear();
    if (!ctx) return nsa_fail(NSA_STATUS_NULL_POINTER, "ctx is NULL");
    if (!c.args) return nsa_fail(NSA_STATUS_NULL_POINTER, "args is NULL");
    if (mode == OP_QUERY && !bytes) return nsa_fail(NSA_STATUS_NULL_POINTER, "bytes is NULL");
    nsa_problem p;
    nsa_status st = op_validate(c, &p);
    if (st != NSA_STATUS_SUCCESS) return st;
    const int empty = no_heads(c, &p);
    const size_t need = empty ? 0 : op_need(ctx, &p, c);
    /* the backends size with size.h's saturating arithmetic: SIZE_MAX is a need that
     * overflowed somewhere on the way, refused here for every op and both backends */
    if (need == SIZE_MAX)
        return nsa_fail(NSA_STATUS_SIZE_OVERFLOW, "workspace: the bytes this call needs overflow size_t "
                                                  "(B %" PRId64 ", T %" PRId64 ", HQ %" PRId64 ")", p.B, p.T, p.HQ);
    if (mode == OP_QUERY) {
        *bytes = need;
        return done(NSA_STATUS_SUCCESS);
    }
    if (workspace_bytes < need)
        return nsa_fail(NSA_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes: %zu < %zu needed", workspace_bytes, need);
    if (need > 0 && !workspace)
        return nsa_fail(NSA_STATUS_NULL_POINTER, "workspace: NULL but %zu bytes are needed", need);
    return done(empty ? run_no_heads(ctx, c) : op_run(ctx, &p, c, workspace, workspace_bytes));
}

/* ---- the public ops: each a query and a call through op_dispatch ----------------------- */

nsa_status nsa_compress_workspace_size(nsa_context *ctx, const nsa_compress_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_COMPRESS, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_compress(nsa_context *ctx, const nsa_compress_args *args, void *workspace, size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_COMPRESS, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_compress_bwd_workspace_size(nsa_context *ctx, const nsa_compress_bwd_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_COMPRESS_BWD, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_compress_bwd(nsa_context *ctx, const nsa_compress_bwd_args *args, void *workspace,
                            size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_COMPRESS_BWD, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_cmp_attn_workspace_size(nsa_context *ctx, const nsa_cmp_attn_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_CMP_ATTN, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_cmp_attn(nsa_context *ctx, const nsa_cmp_attn_args *args, void *workspace, size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_CMP_ATTN, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_cmp_attn_bwd_workspace_size(nsa_context *ctx, const nsa_cmp_attn_bwd_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_CMP_ATTN_BWD, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_cmp_attn_bwd(nsa_context *ctx, const nsa_cmp_attn_bwd_args *args, void *workspace,
                            size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_CMP_ATTN_BWD, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_select_workspace_size(nsa_context *ctx, const nsa_select_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_SELECT, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_select(nsa_context *ctx, const nsa_select_args *args, void *workspace, size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_SELECT, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_slc_attn_workspace_size(nsa_context *ctx, const nsa_slc_attn_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_SLC_ATTN, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_slc_attn(nsa_context *ctx, const nsa_slc_attn_args *args, void *workspace, size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_SLC_ATTN, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_slc_attn_bwd_workspace_size(nsa_context *ctx, const nsa_slc_attn_bwd_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_SLC_ATTN_BWD, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_slc_attn_bwd(nsa_context *ctx, const nsa_slc_attn_bwd_args *args, void *workspace,
                            size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_SLC_ATTN_BWD, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_attention_workspace_size(nsa_context *ctx, const nsa_attention_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_ATTENTION, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_attention(nsa_context *ctx, const nsa_attention_args *args, void *workspace, size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_ATTENTION, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_attention_bwd_workspace_size(nsa_context *ctx, const nsa_attention_bwd_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_ATTENTION_BWD, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_attention_bwd(nsa_context *ctx, const nsa_attention_bwd_args *args, void *workspace,
                             size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_ATTENTION_BWD, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_gate_workspace_size(nsa_context *ctx, const nsa_gate_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_GATE, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_gate(nsa_context *ctx, const nsa_gate_args *args, void *workspace, size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_GATE, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_gate_bwd_workspace_size(nsa_context *ctx, const nsa_gate_bwd_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_GATE_BWD, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_gate_bwd(nsa_context *ctx, const nsa_gate_bwd_args *args, void *workspace, size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_GATE_BWD, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_forward_workspace_size(nsa_context *ctx, const nsa_forward_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_FORWARD, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_forward(nsa_context *ctx, const nsa_forward_args *args, void *workspace, size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_FORWARD, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_backward_workspace_size(nsa_context *ctx, const nsa_backward_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_BACKWARD, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_backward(nsa_context *ctx, const nsa_backward_args *args, void *workspace, size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_BACKWARD, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_step_workspace_size(nsa_context *ctx, const nsa_step_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_STEP, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_step(nsa_context *ctx, const nsa_step_args *args, void *workspace, size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_STEP, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_attention_step_workspace_size(nsa_context *ctx, const nsa_attention_step_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_ATTENTION_STEP, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_attention_step(nsa_context *ctx, const nsa_attention_step_args *args, void *workspace, size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_ATTENTION_STEP, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_flex_attention_workspace_size(nsa_context *ctx, const nsa_flex_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_FLEX, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_flex_attention(nsa_context *ctx, const nsa_flex_args *args, void *workspace, size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_FLEX, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_flex_attention_bwd_workspace_size(nsa_context *ctx, const nsa_flex_bwd_args *args, size_t *bytes)
{
    return op_dispatch(ctx, (op_call){OP_FLEX_BWD, args}, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_flex_attention_bwd(nsa_context *ctx, const nsa_flex_bwd_args *args, void *workspace, size_t workspace_bytes)
{
    return op_dispatch(ctx, (op_call){OP_FLEX_BWD, args}, OP_RUN, NULL, workspace, workspace_bytes);
}

/* ---- context parallelism over NCCL (nsa.h section 10): the CUDA backend's cuda/cp/cp.cu ---- */

int64_t nsa_cp_local_length(int64_t seq_len, int64_t rank, int64_t world)
{
    if (world < 1 || rank < 0 || rank >= world || seq_len < 0 || seq_len > INT64_MAX / (2 * world)) return -1;
    /* chunk c holds positions [c T / 2P, (c + 1) T / 2P); rank r the chunks r and 2P - 1 - r */
    const int64_t P2 = 2 * world, c1 = P2 - 1 - rank;
    return ((rank + 1) * seq_len / P2 - rank * seq_len / P2) + ((c1 + 1) * seq_len / P2 - c1 * seq_len / P2);
}

int nsa_cp_available(void)
{
#ifdef NSA_WITH_CUDA
    return nsa_backend_available(NSA_BACKEND_CUDA) && nsa_cuda_cp_available();
#else
    return 0;
#endif
}

/* Both halves of the two context-parallel calls: the common checks, then one pass of the CUDA
 * backend, which validates, sizes and either reports the size or checks the workspace and runs
 * (the sizes come from the communicator, so the checks of op_dispatch live there). */
static nsa_status cp_dispatch(nsa_context *ctx, const nsa_cp_args *a, const nsa_cp_bwd_args *ba, op_mode mode,
                              size_t *bytes, void *workspace, size_t workspace_bytes)
{
    nsa_detail_clear();
    if (!ctx) return nsa_fail(NSA_STATUS_NULL_POINTER, "ctx is NULL");
    if (!a) return nsa_fail(NSA_STATUS_NULL_POINTER, "args is NULL");
    if (mode == OP_QUERY && !bytes) return nsa_fail(NSA_STATUS_NULL_POINTER, "bytes is NULL");
    if (ctx->backend != NSA_BACKEND_CUDA)
        return nsa_fail(NSA_STATUS_NOT_SUPPORTED, "ctx: context parallelism over NCCL runs on the CUDA backend");
#ifdef NSA_WITH_CUDA
    if (mode == OP_QUERY) return done(nsa_cuda_cp_run(ctx, a, ba, NULL, 0, bytes));
    return done(nsa_cuda_cp_run(ctx, a, ba, workspace, workspace_bytes, NULL));
#else
    (void)ba, (void)workspace, (void)workspace_bytes;
    return nsa_fail(NSA_STATUS_BACKEND_UNAVAILABLE, "ctx: the library was built without the CUDA backend");
#endif
}

nsa_status nsa_cp_forward_workspace_size(nsa_context *ctx, const nsa_cp_args *args, size_t *bytes)
{
    return cp_dispatch(ctx, args, NULL, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_cp_forward(nsa_context *ctx, const nsa_cp_args *args, void *workspace, size_t workspace_bytes)
{
    return cp_dispatch(ctx, args, NULL, OP_RUN, NULL, workspace, workspace_bytes);
}

nsa_status nsa_cp_backward_workspace_size(nsa_context *ctx, const nsa_cp_bwd_args *args, size_t *bytes)
{
    return cp_dispatch(ctx, args ? &args->fwd : NULL, args, OP_QUERY, bytes, NULL, 0);
}

nsa_status nsa_cp_backward(nsa_context *ctx, const nsa_cp_bwd_args *args, void *workspace, size_t workspace_bytes)
{
    return cp_dispatch(ctx, args ? &args->fwd : NULL, args, OP_RUN, NULL, workspace, workspace_bytes);
}
