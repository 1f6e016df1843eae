/* cp/cp.cu -- context parallelism over NCCL (nsa.h section 10, spec 15): each rank's query
 * chunks through the public nsa_forward / nsa_backward (spec 0.3), with the K / V all-gather
 * before them and the dK / dV exchange after the backward. NCCL is loaded at run time (dlopen),
 * so the library builds and runs without it; only the handful of entry points used here are
 * declared, with the types of NCCL's stable C ABI. */
#include "../cuda_backend.h"
#include "../../internal.h"
#include "../../size.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* ---- NCCL, loaded once ------------------------------------------------------------------- */
typedef int nccl_result;           /* ncclSuccess == 0 */
enum { NCCL_UINT8 = 1 };           /* ncclUint8: bytes moved as they are */
typedef struct nccl_api {
    int loaded;                    /* 1 loaded, -1 not found */
    nccl_result (*all_gather)(const void *, void *, size_t, int, void *, cudaStream_t);
    nccl_result (*send)(const void *, size_t, int, int, void *, cudaStream_t);
    nccl_result (*recv)(void *, size_t, int, int, void *, cudaStream_t);
    nccl_result (*group_start)(void);
    nccl_result (*group_end)(void);
    nccl_result (*count)(void *, int *);
    nccl_result (*user_rank)(void *, int *);
    const char *(*error_string)(nccl_result);
} nccl_api;

static nccl_api g_nccl;
static pthread_once_t g_nccl_once = PTHREAD_ONCE_INIT;

static void nccl_load(void)
{
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    g_nccl.loaded = -1;
    if (!h) return;
    *(void **)&g_nccl.all_gather = dlsym(h, "ncclAllGather");
    *(void **)&g_nccl.send = dlsym(h, "ncclSend");
    *(void **)&g_nccl.recv = dlsym(h, "ncclRecv");
    *(void **)&g_nccl.group_start = dlsym(h, "ncclGroupStart");
    *(void **)&g_nccl.group_end = dlsym(h, "ncclGroupEnd");
    *(void **)&g_nccl.count = dlsym(h, "ncclCommCount");
    *(void **)&g_nccl.user_rank = dlsym(h, "ncclCommUserRank");
    *(void **)&g_nccl.error_string = dlsym(h, "ncclGetErrorString");
    if (g_nccl.all_gather && g_nccl.send && g_nccl.recv && g_nccl.group_start && g_nccl.group_end && g_nccl.count &&
        g_nccl.user_rank && g_nccl.error_string)
        g_nccl.loaded = 1;
}

extern "C" int nsa_cuda_cp_available(void)
{
    pthread_once(&g_nccl_once, nccl_load);
    return g_nccl.loaded == 1;
}

/* ---- the layout (spec 15) ----------------------------------------------------------------- */
static int64_t chunk_lo(int64_t c, int64_t T, int64_t P) { return c * T / (2 * P); }

/* ---- element-wise kernels: Y += X over a batch of row prefixes, and the owners' ordered sum -- */
__device__ __forceinline__ float cp_ld(const void *p, int dt, int64_t i)
{
    if (dt == NSA_DTYPE_F32) return ((const float *)p)[i];
    const unsigned short u = ((const unsigned short *)p)[i];
    if (dt == NSA_DTYPE_BF16) return __uint_as_float((unsigned)u << 16);
    return __half2float(__ushort_as_half(u));
}

__device__ __forceinline__ void cp_st(void *p, int dt, int64_t i, float v)
{
    if (dt == NSA_DTYPE_F32) ((float *)p)[i] = v;
    else if (dt == NSA_DTYPE_BF16) ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
    else ((__half *)p)[i] = __float2half_rn(v);
}

/* y[b * stride + i] += x[b * stride + i], i < n, for each of B batch entries */
__global__ void cp_add_kernel(void *y, const void *x, int dt, int64_t B, int64_t stride, int64_t n)
{
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < B * n; k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = (k / n) * stride + k % n;
        cp_st(y, dt, i, cp_ld(y, dt, i) + cp_ld(x, dt, i));
    }
}

/* out[b, r, e] (strides s0, s1; e < W contiguous) = sum over p < P, in order, of
 * piece[p][b, r, e] (pieces [P][B][Lmax][W]) */
__global__ void cp_sum_kernel(void *out, int dt, int64_t s0, int64_t s1, const void *pieces, int64_t P, int64_t B,
                              int64_t Lmax, int64_t L, int64_t W)
{
    const int64_t n = B * L * W;
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t e = k % W, r = (k / W) % L, b = k / (W * L);
        float acc = 0.0f;
        for (int64_t p = 0; p < P; p++) acc += cp_ld(pieces, dt, ((p * B + b) * Lmax + r) * W + e);
        cp_st(out, dt, b * s0 + r * s1 + e, acc);
    }
}

static unsigned cp_grid(int64_t n) { return (unsigned)(n / 256 + 1 < 4096 ? n / 256 + 1 : 4096); }

/* ---- one call ----------------------------------------------------------------------------- */
/* One call's sizes: P ranks, this rank r, T positions, B sequences of L local rows (Lmax: the
 * longest rank's), H kv heads of DK / DV, es bytes an element; its stream and communicator. */
typedef struct cp_run {
    cudaStream_t st;
    void *comm;
    int64_t P, r, T, B, L, Lmax, H, DK, DV;
    size_t es;
} cp_run;

static nsa_status cuda_fail(cudaError_t e, const char *what)
{
    return nsa_fail(NSA_STATUS_DEVICE_ERROR, "device: %s failed: %s", what, cudaGetErrorString(e));
}

static nsa_status nccl_fail(nccl_result e, const char *what)
{
    return nsa_fail(NSA_STATUS_DEVICE_ERROR, "comm: %s failed: %s", what, g_nccl.error_string(e));
}

/* rows [row, row + n) of a [B, R, ...] view */
static nsa_tensor rows_of(const nsa_tensor *t, int64_t row, int64_t n)
{
    nsa_tensor v = *t;
    if (!v.data) return v;
    v.data = (char *)v.data + (size_t)(row * t->stride[1]) * nsa_dtype_size(t->dtype);
    v.shape[1] = n;
    return v;
}

/* a [B, R, H, D] view of a contiguous whole-sequence buffer's first R rows (T rows a batch entry) */
static nsa_tensor prefix_of(void *base, nsa_dtype dt, int64_t B, int64_t T, int64_t R, int64_t H, int64_t D)
{
    nsa_tensor v = nsa_tensor_4d(base, dt, B, R, H, D);
    v.stride[0] = T * H * D;
    return v;
}

/* The whole sequence's rows of x (this rank's [B, L, H, D] part, row-contiguous) into full
 * [B, T, H, D]: the parts padded to Lmax rows and all-gathered into recv, then each rank's two
 * chunks copied to their positions. */
static nsa_status gather_rows(const cp_run *c, const nsa_tensor *x, int64_t D, char *send, char *recv, char *full)
{
    const size_t row = (size_t)(c->H * D) * c->es;
    cudaError_t e = cudaSuccess;
    for (int64_t b = 0; b < c->B && e == cudaSuccess && c->L > 0; b++)
        e = cudaMemcpy2DAsync(send + (size_t)(b * c->Lmax) * row, row, (const char *)x->data + (size_t)(b * x->stride[0]) * c->es,
                              (size_t)x->stride[1] * c->es, row, (size_t)c->L, cudaMemcpyDeviceToDevice, c->st);
    if (e != cudaSuccess) return cuda_fail(e, "cudaMemcpy2DAsync (K / V into the all-gather buffer)");
    const nccl_result ne = g_nccl.all_gather(send, recv, (size_t)(c->B * c->Lmax) * row, NCCL_UINT8, c->comm, c->st);
    if (ne != 0) return nccl_fail(ne, "ncclAllGather (K / V)");
    for (int64_t p = 0; p < c->P; p++) {
        const int64_t cs[2] = {p, 2 * c->P - 1 - p};
        int64_t at = 0; /* row within p's part */
        for (int k = 0; k < 2; k++) {
            const int64_t lo = chunk_lo(cs[k], c->T, c->P), n = chunk_lo(cs[k] + 1, c->T, c->P) - lo;
            for (int64_t b = 0; b < c->B && n > 0; b++) {
                e = cudaMemcpyAsync(full + (size_t)(b * c->T + lo) * row, recv + (size_t)((p * c->B + b) * c->Lmax + at) * row,
                                    (size_t)n * row, cudaMemcpyDeviceToDevice, c->st);
                if (e != cudaSuccess) return cuda_fail(e, "cudaMemcpyAsync (a gathered chunk)");
            }
            at += n;
        }
    }
    return NSA_STATUS_SUCCESS;
}

/* The owners' rows of a whole-sequence key-side gradient partial y [B, T, H, D] (this rank's):
 * each rank's rows packed to send[p], exchanged (grouped send / receive), and the pieces received
 * summed in rank order into out, this rank's [B, L, H, D] rows. */
static nsa_status scatter_sum(const cp_run *c, const char *y, int64_t D, char *send, char *recv, const nsa_tensor *out)
{
    const size_t row = (size_t)(c->H * D) * c->es, piece = (size_t)(c->B * c->Lmax) * row;
    cudaError_t e = cudaSuccess;
    for (int64_t p = 0; p < c->P; p++) {
        const int64_t cs[2] = {p, 2 * c->P - 1 - p};
        int64_t at = 0;
        for (int k = 0; k < 2; k++) {
            const int64_t lo = chunk_lo(cs[k], c->T, c->P), n = chunk_lo(cs[k] + 1, c->T, c->P) - lo;
            for (int64_t b = 0; b < c->B && n > 0 && e == cudaSuccess; b++)
                e = cudaMemcpyAsync(send + (size_t)p * piece + (size_t)(b * c->Lmax + at) * row, y + (size_t)(b * c->T + lo) * row,
                                    (size_t)n * row, cudaMemcpyDeviceToDevice, c->st);
            at += n;
        }
    }
    if (e != cudaSuccess) return cuda_fail(e, "cudaMemcpyAsync (a gradient chunk to send)");
    nccl_result ne = g_nccl.group_start();
    for (int64_t p = 0; p < c->P && ne == 0; p++) {
        ne = g_nccl.send(send + (size_t)p * piece, piece, NCCL_UINT8, (int)p, c->comm, c->st);
        if (ne == 0) ne = g_nccl.recv(recv + (size_t)p * piece, piece, NCCL_UINT8, (int)p, c->comm, c->st);
    }
    const nccl_result ge = g_nccl.group_end();
    if (ne != 0) return nccl_fail(ne, "ncclSend / ncclRecv (dK / dV to their owners)");
    if (ge != 0) return nccl_fail(ge, "ncclGroupEnd (dK / dV to their owners)");
    const int64_t n = c->B * c->L * c->H * D;
    if (n > 0) {
        cp_sum_kernel<<<cp_grid(n), 256, 0, c->st>>>(out->data, (int)out->dtype, out->stride[0], out->stride[1], recv, c->P, c->B,
                                                    c->Lmax, c->L, c->H * D);
        if ((e = cudaGetLastError()) != cudaSuccess) return cuda_fail(e, "cp_sum_kernel");
    }
    return NSA_STATUS_SUCCESS;
}

/* A local K / V (or dK / dV) view whose rows the copies take whole: [B, L, H, D], stride[2] == D. */
static nsa_status row_contiguous(const nsa_tensor *t, const char *name)
{
    if (t->shape[2] > 1 && t->stride[2] != t->shape[3])
        return nsa_fail(NSA_STATUS_NOT_SUPPORTED, "%s: stride[2] is %" PRId64 ", context parallelism takes rows of H x D "
                        "contiguous elements (stride[2] == D = %" PRId64 ")", name, t->stride[2], t->shape[3]);
    return NSA_STATUS_SUCCESS;
}

extern "C" nsa_status nsa_cuda_cp_run(nsa_context *ctx, const nsa_cp_args *a, const nsa_cp_bwd_args *ba, void *ws,
                                      size_t ws_bytes, size_t *need)
{
    const nsa_forward_args *f = &a->local;
    const char *pre = ba ? "fwd." : "";
    if (!a->comm) return nsa_fail(NSA_STATUS_NULL_POINTER, "%scomm is NULL", pre);
    if (a->seq_len < 0) return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%sseq_len: %" PRId64 " is negative", pre, a->seq_len);
    if (!nsa_cuda_cp_available())
        return nsa_fail(NSA_STATUS_BACKEND_UNAVAILABLE, "%scomm: NCCL (libnccl.so.2) could not be loaded", pre);
    if (f->varlen.cu_seqlens || nsa_present(&f->k_cmp) || nsa_present(&f->block_indices) || nsa_present(&f->k_slc) ||
        nsa_present(&f->k_swa))
        return nsa_fail(NSA_STATUS_NOT_SUPPORTED, "%slocal: context parallelism takes no varlen, k_cmp / v_cmp, "
                        "block_indices or separate branch K / V", pre);
    /* the local call, validated as whole sequences of L rows (its own detail on failure) */
    size_t local_ws = 0;
    nsa_status st;
    if (ba) {
        nsa_backward_args lb;
        memset(&lb, 0, sizeof lb);
        lb.fwd = *f, lb.dout = ba->dout, lb.dq = ba->dq, lb.dk = ba->dk, lb.dv = ba->dv;
        lb.dg_cmp = ba->dg_cmp, lb.dg_slc = ba->dg_slc, lb.dg_swa = ba->dg_swa;
        st = nsa_backward_workspace_size(ctx, &lb, &local_ws);
    } else {
        st = nsa_forward_workspace_size(ctx, f, &local_ws);
    }
    if (st != NSA_STATUS_SUCCESS) return st;
    if ((st = row_contiguous(&f->k, ba ? "fwd.local.k" : "local.k")) != NSA_STATUS_SUCCESS ||
        (st = row_contiguous(&f->v, ba ? "fwd.local.v" : "local.v")) != NSA_STATUS_SUCCESS ||
        (ba && (st = row_contiguous(&ba->dk, "dk")) != NSA_STATUS_SUCCESS) ||
        (ba && (st = row_contiguous(&ba->dv, "dv")) != NSA_STATUS_SUCCESS))
        return st;
    int P = 0, r = 0;
    nccl_result ne = g_nccl.count(a->comm, &P);
    if (ne == 0) ne = g_nccl.user_rank(a->comm, &r);
    if (ne != 0) return nccl_fail(ne, "ncclCommCount / ncclCommUserRank");

    cp_run c;
    memset(&c, 0, sizeof c);
    c.st = (cudaStream_t)ctx->stream, c.comm = a->comm;
    c.P = P, c.r = r, c.T = a->seq_len;
    c.B = f->q.shape[0], c.L = f->q.shape[1], c.H = f->k.shape[2], c.DK = f->k.shape[3];
    c.DV = f->v.shape[3];
    c.es = nsa_dtype_size(f->q.dtype);
    const int64_t want = nsa_cp_local_length(c.T, r, P);
    if (c.L != want)
        return nsa_fail(NSA_STATUS_BAD_SHAPE, "%slocal.q: dim 1 is %" PRId64 ", rank %d of %d holds %" PRId64 " of seq_len %" PRId64
                        " positions (spec 15)", pre, c.L, r, P, want, c.T);
    for (int64_t p = 0; p < P; p++) {
        const int64_t l = nsa_cp_local_length(c.T, p, P);
        c.Lmax = l > c.Lmax ? l : c.Lmax;
    }

    /* workspace: whole K and V, the all-gather's send / receive (P pieces, reused by the
     * backward's exchange), the backward's two gradient partials a side, then the chunk calls' */
    const int64_t D = c.DK > c.DV ? c.DK : c.DV;
    const size_t kb = nsa_size_mul(nsa_size_elems(c.B, c.T, c.H, c.DK), c.es), vb = nsa_size_mul(nsa_size_elems(c.B, c.T, c.H, c.DV), c.es);
    const size_t piece = nsa_size_mul(nsa_size_elems(c.B, c.Lmax, c.H, D), c.es);
    size_t off[9], at = 0;
    const size_t sizes[8] = {kb, vb, nsa_size_mul(piece, (size_t)P), nsa_size_mul(piece, (size_t)P),
                             ba ? kb : 0, ba ? kb : 0, ba ? vb : 0, ba ? vb : 0};
    for (int i = 0; i < 8; i++) off[i] = at, at = nsa_size_align(nsa_size_add(at, sizes[i]), 256);
    off[8] = at;
    char *w = (char *)ws;
    char *base = w ? w : (char *)(uintptr_t)256; /* sizing: any non-NULL address, never read */
    char *Kf = base + off[0], *Vf = base + off[1], *sendb = base + off[2], *recvb = base + off[3];
    char *dKx = base + off[4], *dKy = base + off[5], *dVx = base + off[6], *dVy = base + off[7];

    /* the two chunk calls' args (rows [row, row + n) of the local part, keys [0, end)) */
    const int64_t cs[2] = {r, 2 * (int64_t)P - 1 - r};
    nsa_forward_args cf[2];
    nsa_backward_args cb[2];
    int64_t nrows[2];
    size_t chunk_ws = 0;
    int64_t row = 0;
    for (int k = 0; k < 2; k++) {
        const int64_t lo = chunk_lo(cs[k], c.T, P), end = chunk_lo(cs[k] + 1, c.T, P), n = end - lo;
        nrows[k] = n;
        nsa_forward_args x = *f;
        x.q = rows_of(&f->q, row, n);
        x.k = prefix_of(Kf, f->k.dtype, c.B, c.T, end, c.H, c.DK);
        x.v = prefix_of(Vf, f->v.dtype, c.B, c.T, end, c.H, c.DV);
        x.g_cmp = rows_of(&f->g_cmp, row, n), x.g_slc = rows_of(&f->g_slc, row, n), x.g_swa = rows_of(&f->g_swa, row, n);
        x.o = rows_of(&f->o, row, n);
        x.saved.block_indices = rows_of(&f->saved.block_indices, row, n);
        x.saved.o_cmp = rows_of(&f->saved.o_cmp, row, n), x.saved.o_slc = rows_of(&f->saved.o_slc, row, n);
        x.saved.o_swa = rows_of(&f->saved.o_swa, row, n);
        x.saved.lse_cmp = rows_of(&f->saved.lse_cmp, row, n), x.saved.lse_slc = rows_of(&f->saved.lse_slc, row, n);
        x.saved.lse_swa = rows_of(&f->saved.lse_swa, row, n);
        cf[k] = x;
        size_t wk = 0;
        if (ba) {
            nsa_backward_args y;
            memset(&y, 0, sizeof y);
            y.fwd = x;
            y.dout = rows_of(&ba->dout, row, n), y.dq = rows_of(&ba->dq, row, n);
            y.dk = prefix_of(k == 0 ? dKx : dKy, f->k.dtype, c.B, c.T, end, c.H, c.DK);
            y.dv = prefix_of(k == 0 ? dVx : dVy, f->v.dtype, c.B, c.T, end, c.H, c.DV);
            y.dg_cmp = rows_of(&ba->dg_cmp, row, n), y.dg_slc = rows_of(&ba->dg_slc, row, n);
            y.dg_swa = rows_of(&ba->dg_swa, row, n);
            cb[k] = y;
            if (n > 0) st = nsa_backward_workspace_size(ctx, &y, &wk);
        } else if (n > 0) {
            st = nsa_forward_workspace_size(ctx, &x, &wk);
        }
        if (st != NSA_STATUS_SUCCESS) return st;
        chunk_ws = wk > chunk_ws ? wk : chunk_ws;
        row += n;
    }
    const size_t total = nsa_size_add(off[8], chunk_ws);
    if (total == SIZE_MAX)
        return nsa_fail(NSA_STATUS_SIZE_OVERFLOW, "workspace: the bytes of a context-parallel call overflow size_t");
    if (need) *need = total;
    if (!w) return NSA_STATUS_SUCCESS;
    if (ws_bytes < total)
        return nsa_fail(NSA_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes: %zu < %zu needed", ws_bytes, total);
    char *chunk_w = w + off[8];
    cudaError_t e = cudaSetDevice(ctx->device);
    if (e != cudaSuccess) return cuda_fail(e, "cudaSetDevice");

    if ((st = gather_rows(&c, &f->k, c.DK, sendb, recvb, Kf)) != NSA_STATUS_SUCCESS ||
        (st = gather_rows(&c, &f->v, c.DV, sendb, recvb, Vf)) != NSA_STATUS_SUCCESS)
        return st;
    if (!ba) {
        for (int k = 0; k < 2; k++)
            if (nrows[k] > 0 && (st = nsa_forward(ctx, &cf[k], chunk_w, chunk_ws)) != NSA_STATUS_SUCCESS) return st;
        return NSA_STATUS_SUCCESS;
    }
    e = cudaMemsetAsync(dKy, 0, kb, c.st);
    if (e == cudaSuccess) e = cudaMemsetAsync(dVy, 0, vb, c.st);
    if (e != cudaSuccess) return cuda_fail(e, "cudaMemsetAsync (the gradient partials)");
    for (int k = 0; k < 2; k++)
        if (nrows[k] > 0 && (st = nsa_backward(ctx, &cb[k], chunk_w, chunk_ws)) != NSA_STATUS_SUCCESS) return st;
    /* the first chunk ends first: its partials are added into the second's (rows it reaches) */
    const int64_t end0 = chunk_lo(cs[0] + 1, c.T, P);
    if (nrows[0] > 0) {
        const int64_t nk = end0 * c.H * c.DK, nv = end0 * c.H * c.DV;
        cp_add_kernel<<<cp_grid(c.B * nk), 256, 0, c.st>>>(dKy, dKx, (int)f->k.dtype, c.B, c.T * c.H * c.DK, nk);
        cp_add_kernel<<<cp_grid(c.B * nv), 256, 0, c.st>>>(dVy, dVx, (int)f->v.dtype, c.B, c.T * c.H * c.DV, nv);
        if ((e = cudaGetLastError()) != cudaSuccess) return cuda_fail(e, "cp_add_kernel");
    }
    if ((st = scatter_sum(&c, dKy, c.DK, sendb, recvb, &ba->dk)) != NSA_STATUS_SUCCESS ||
        (st = scatter_sum(&c, dVy, c.DV, sendb, recvb, &ba->dv)) != NSA_STATUS_SUCCESS)
        return st;
    return NSA_STATUS_SUCCESS;
}
