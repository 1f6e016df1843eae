/* cp/cp.cu -- context parallelism over NCCL (nsa.h section 10, spec 15): each rank's query
 * chunks through the public nsa_forward / nsa_backward (spec 0.3), with the K / V all-gather
 * before them and the dK / dV exchange after the backward. The collectives run on a second
 * stream the context owns, ordered against the context's stream by events, so that they overlap
 * the chunk calls (NSA_CUDA_CP_OVERLAP=0: everything on the context's stream, the same bits).
 * NCCL is loaded at run time (dlopen), so the library builds and runs without it; only the
 * handful of entry points used here are declared, with the types of NCCL's stable C ABI. */
#include "../cuda_backend.h"
#include "../../internal.h"
#include "../../size.h"
#include "../prim/mma_sync.cuh" /* ld_any, st_any */
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
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

static nsa_status cuda_fail(cudaError_t e, const char *what)
{
    return nsa_fail(NSA_STATUS_DEVICE_ERROR, "device: %s failed: %s", what, cudaGetErrorString(e));
}

static nsa_status nccl_fail(nccl_result e, const char *what)
{
    return nsa_fail(NSA_STATUS_DEVICE_ERROR, "comm: %s failed: %s", what, g_nccl.error_string(e));
}

/* ---- the context's communication stream and events, made by its first overlapped call ----- */
/* One event per hand-over between the two streams, in the order a call makes them. */
enum { EV_READY, EV_FIRST, EV_SECOND, EV_LATER_PART, EV_FIRST_PART, EV_EXCHANGED, EV_END, CP_EVENTS };
typedef struct cp_state {
    int device;
    cudaStream_t ms;
    cudaEvent_t ev[CP_EVENTS];
} cp_state;

/* a context may be used from several threads: the first calls of two of them must not both
 * make its stream */
static pthread_mutex_t g_state_lock = PTHREAD_MUTEX_INITIALIZER;

extern "C" void nsa_cuda_cp_state_free(void *state)
{
    cp_state *s = (cp_state *)state;
    if (!s) return;
    int prev = 0;
    const int had = cudaGetDevice(&prev) == cudaSuccess;
    cudaSetDevice(s->device);
    for (int i = 0; i < CP_EVENTS; i++)
        if (s->ev[i]) cudaEventDestroy(s->ev[i]);
    if (s->ms) cudaStreamDestroy(s->ms); /* its queued work still completes */
    if (had) cudaSetDevice(prev);
    cudaGetLastError(); /* leave no error behind for the caller's own checks */
    free(s);
}

/* The context's state; ctx->device is current. */
static nsa_status cp_state_get(nsa_context *ctx, cp_state **out)
{
    pthread_mutex_lock(&g_state_lock);
    cp_state *s = (cp_state *)ctx->cp_state;
    if (s) {
        pthread_mutex_unlock(&g_state_lock);
        *out = s;
        return NSA_STATUS_SUCCESS;
    }
    s = (cp_state *)calloc(1, sizeof *s);
    if (!s) {
        pthread_mutex_unlock(&g_state_lock);
        return nsa_fail(NSA_STATUS_OUT_OF_MEMORY, "ctx: no memory for the communication stream's record");
    }
    s->device = ctx->device;
    /* the greatest priority: the collectives' blocks go first when the chunk calls' kernels
     * leave an SM, rather than after every block those have queued; non-blocking: the legacy
     * default stream (a context's stream NULL) would otherwise serialise the two */
    int least = 0, greatest = 0;
    cudaError_t e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    const char *what = "cudaDeviceGetStreamPriorityRange";
    if (e == cudaSuccess) {
        e = cudaStreamCreateWithPriority(&s->ms, cudaStreamNonBlocking, greatest);
        what = "cudaStreamCreateWithPriority (the communication stream)";
    }
    for (int i = 0; i < CP_EVENTS && e == cudaSuccess; i++) {
        e = cudaEventCreateWithFlags(&s->ev[i], cudaEventDisableTiming);
        what = "cudaEventCreateWithFlags (the streams' events)";
    }
    if (e != cudaSuccess) {
        const nsa_status st = cuda_fail(e, what);
        nsa_cuda_cp_state_free(s);
        pthread_mutex_unlock(&g_state_lock);
        return st;
    }
    ctx->cp_state = s;
    pthread_mutex_unlock(&g_state_lock);
    *out = s;
    return NSA_STATUS_SUCCESS;
}

/* ---- the layout (spec 15) ----------------------------------------------------------------- */
static int64_t chunk_lo(int64_t c, int64_t T, int64_t P) { return c * T / (2 * P); }

/* Rank p's chunk k (k 0: chunk p, its first; k 1: chunk 2P-1-p): positions [lo, lo + n), rows
 * [at, at + n) of p's part. The one place a chunk's position and its local row are derived:
 * the chunk calls, the gather and the exchanges all read them here. */
typedef struct cp_chunk {
    int64_t lo, n, at;
} cp_chunk;

static cp_chunk chunk_of(int64_t T, int64_t P, int64_t p, int k)
{
    const int64_t c = k ? 2 * P - 1 - p : p;
    cp_chunk x;
    x.lo = chunk_lo(c, T, P);
    x.n = chunk_lo(c + 1, T, P) - x.lo;
    x.at = k ? chunk_lo(p + 1, T, P) - chunk_lo(p, T, P) : 0;
    return x;
}

/* ---- the owners' ordered sum ---------------------------------------------------------------- */
/* out[b, i, e] (strides s0, s1; e < W contiguous), local rows i < L: the later chunks' pieces
 * x[q] ([B][xrows][W], xs elements apart) for q < nx in rank order, then, for i < n0, the first
 * chunks' pieces f[q] ([B][frows][W], fs elements apart) for f0 <= q < nf in rank order; f32
 * accumulation, one rounding to out's dtype (the pieces': validation makes dk / dv k's dtype). */
typedef struct cp_sum_params {
    void *out;
    int dt;
    int64_t s0, s1, B, L, W, n0;
    const void *x;
    int64_t xs, xrows, nx;
    const void *f;
    int64_t fs, frows, f0, nf;
} cp_sum_params;

__global__ void cp_sum_kernel(const cp_sum_params p)
{
    const int64_t n = p.B * p.L * p.W;
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t e = k % p.W, i = (k / p.W) % p.L, b = k / (p.W * p.L);
        float acc = 0.0f;
        for (int64_t q = 0; q < p.nx; q++) acc += ld_any(p.x, p.dt, q * p.xs + (b * p.xrows + i) * p.W + e);
        if (i < p.n0)
            for (int64_t q = p.f0; q < p.nf; q++) acc += ld_any(p.f, p.dt, q * p.fs + (b * p.frows + i) * p.W + e);
        st_any(p.out, p.dt, b * p.s0 + i * p.s1 + e, acc);
    }
}

static unsigned cp_grid(int64_t n) { return (unsigned)(n / 256 + 1 < 4096 ? n / 256 + 1 : 4096); }

/* ---- one call ----------------------------------------------------------------------------- */
/* One call's sizes: P ranks, this rank r, T positions (Th = the first half, chunks 0..P-1 = the
 * ranks' first chunks), B sequences of L local rows (Lmax: the longest rank's; cmax: the longest
 * chunk), H kv heads of DK / DV, es bytes an element, rk / rv bytes a K / V row; gpiece / xpiece
 * the bytes of a packed K + V piece of cmax / Lmax rows; the compute stream (the context's: the
 * chunk calls) and the communication stream (the same without overlap), the events, the
 * communicator. */
typedef struct cp_run {
    cudaStream_t cs, ms;
    const cudaEvent_t *ev;
    void *comm;
    int64_t P, r, T, Th, B, L, Lmax, cmax, H, DK, DV;
    size_t es, rk, rv, gpiece, xpiece;
} cp_run;

/* A pair of row-major K and V buffers of `rows` rows a batch entry ([B, rows, H, DK] at k, the
 * same of DV at v): a whole-sequence pair (rows = T) or one packed piece (K's rows, then V's). */
typedef struct cp_kv {
    char *k, *v;
    int64_t rows;
} cp_kv;

static cp_kv piece_at(const cp_run *c, char *base, int64_t rows)
{
    cp_kv x = {base, base + (size_t)(c->B * rows) * c->rk, rows};
    return x;
}

/* rows [from, from + n) of every batch entry of src to rows [to, to + n) of dst, K and V: a copy
 * a batch entry (a 2-D copy's pitch, T rows of a whole sequence, may pass the device's limit) */
static cudaError_t copy_rows(const cp_run *c, cp_kv dst, int64_t to, cp_kv src, int64_t from, int64_t n)
{
    cudaError_t e = cudaSuccess;
    for (int64_t b = 0; b < c->B && n > 0 && e == cudaSuccess; b++) {
        e = cudaMemcpyAsync(dst.k + (size_t)(b * dst.rows + to) * c->rk, src.k + (size_t)(b * src.rows + from) * c->rk,
                            (size_t)n * c->rk, cudaMemcpyDeviceToDevice, c->ms);
        if (e == cudaSuccess)
            e = cudaMemcpyAsync(dst.v + (size_t)(b * dst.rows + to) * c->rv, src.v + (size_t)(b * src.rows + from) * c->rv,
                                (size_t)n * c->rv, cudaMemcpyDeviceToDevice, c->ms);
    }
    return e;
}

/* The walk of the gather and the exchanges, on the communication stream: for each rank p in
 * [p0, p1), its chunks in `which` (bit k: chunk k of chunk_of), between their positions in the
 * whole-sequence pair w and p's piece (`piece` bytes apart from pieces, prows rows a batch
 * entry): at the chunk's local row when both travel, else from row 0. */
static nsa_status walk(const cp_run *c, int64_t p0, int64_t p1, int which, cp_kv w, char *pieces, size_t piece, int64_t prows,
                       int to_whole, const char *what)
{
    for (int64_t p = p0; p < p1; p++) {
        const cp_kv x = piece_at(c, pieces + (size_t)p * piece, prows);
        for (int k = 0; k < 2; k++) {
            if (!(which >> k & 1)) continue;
            const cp_chunk ch = chunk_of(c->T, c->P, p, k);
            const int64_t at = which == 3 ? ch.at : 0;
            const cudaError_t e = to_whole ? copy_rows(c, w, ch.lo, x, at, ch.n) : copy_rows(c, x, at, w, ch.lo, ch.n);
            if (e != cudaSuccess) return cuda_fail(e, what);
        }
    }
    return NSA_STATUS_SUCCESS;
}

/* Hand-over between the streams: `ev` recorded on `from`, waited for on `to`; nothing when the
 * two are one stream (overlap off). */
static nsa_status signal_ev(const cp_run *c, cudaStream_t from, int ev, const char *what)
{
    if (c->ms == c->cs) return NSA_STATUS_SUCCESS;
    const cudaError_t e = cudaEventRecord(c->ev[ev], from);
    return e == cudaSuccess ? NSA_STATUS_SUCCESS : cuda_fail(e, what);
}

static nsa_status wait_ev(const cp_run *c, cudaStream_t to, int ev, const char *what)
{
    if (c->ms == c->cs) return NSA_STATUS_SUCCESS;
    const cudaError_t e = cudaStreamWaitEvent(to, c->ev[ev], 0);
    return e == cudaSuccess ? NSA_STATUS_SUCCESS : cuda_fail(e, what);
}

/* Phase k of the K / V all-gather, on the communication stream: every rank's chunk k (0: the
 * first chunks, positions [0, Th); 1: the second chunks, [Th, T)) into the whole-sequence pair
 * kv. This rank's rows packed to send (one piece of cmax rows, padded: all-gather moves equal
 * sizes), gathered into recv (P pieces), each copied to its positions. Phase 1 writes only rows
 * the first chunks' calls never read, so the compute stream may run them meanwhile. */
static nsa_status gather_phase(const cp_run *c, const nsa_forward_args *f, int k, cp_kv kv, char *send, char *recv)
{
    const cp_chunk mine = chunk_of(c->T, c->P, c->r, k);
    const cp_kv s = piece_at(c, send, c->cmax);
    cudaError_t e = cudaSuccess;
    /* (a single row: its pitch never read, and a view's stride of it may be anything) */
    const size_t kp = mine.n > 1 ? (size_t)f->k.stride[1] * c->es : c->rk;
    const size_t vp = mine.n > 1 ? (size_t)f->v.stride[1] * c->es : c->rv;
    for (int64_t b = 0; b < c->B && mine.n > 0 && e == cudaSuccess; b++) {
        const size_t ko = (size_t)(b * f->k.stride[0] + mine.at * f->k.stride[1]) * c->es;
        const size_t vo = (size_t)(b * f->v.stride[0] + mine.at * f->v.stride[1]) * c->es;
        e = cudaMemcpy2DAsync(s.k + (size_t)(b * c->cmax) * c->rk, c->rk, (const char *)f->k.data + ko, kp, c->rk,
                              (size_t)mine.n, cudaMemcpyDeviceToDevice, c->ms);
        if (e == cudaSuccess)
            e = cudaMemcpy2DAsync(s.v + (size_t)(b * c->cmax) * c->rv, c->rv, (const char *)f->v.data + vo, vp, c->rv,
                                  (size_t)mine.n, cudaMemcpyDeviceToDevice, c->ms);
    }
    if (e != cudaSuccess) return cuda_fail(e, "cudaMemcpy2DAsync (this rank's K / V chunk into the all-gather buffer)");
    if (c->gpiece > 0) { /* the same on every rank: the sizes are the whole call's */
        const nccl_result ne = g_nccl.all_gather(send, recv, c->gpiece, NCCL_UINT8, c->comm, c->ms);
        if (ne != 0)
            return nccl_fail(ne, k ? "ncclAllGather (K / V, the second chunks)" : "ncclAllGather (K / V, the first chunks)");
    }
    return walk(c, 0, c->P, k ? 2 : 1, kv, recv, c->gpiece, c->cmax, 1, "cudaMemcpyAsync (a gathered K / V chunk)");
}

/* The later chunks' partials (y: [B, T] rows, zero past the chunk's keys) to their owners, on the
 * communication stream: rank p's rows (both its chunks, in its local order) packed to piece p of
 * send, the piece of every rank q received into piece q of recv (grouped send / receive). */
static nsa_status exchange_later(const cp_run *c, cp_kv y, char *send, char *recv)
{
    nsa_status st =
        walk(c, 0, c->P, 3, y, send, c->xpiece, c->Lmax, 0, "cudaMemcpyAsync (a later-chunk gradient piece to send)");
    if (st != NSA_STATUS_SUCCESS || c->xpiece == 0) return st;
    nccl_result ne = g_nccl.group_start();
    for (int64_t p = 0; p < c->P && ne == 0; p++) {
        ne = g_nccl.send(send + (size_t)p * c->xpiece, c->xpiece, NCCL_UINT8, (int)p, c->comm, c->ms);
        if (ne == 0) ne = g_nccl.recv(recv + (size_t)p * c->xpiece, c->xpiece, NCCL_UINT8, (int)p, c->comm, c->ms);
    }
    const nccl_result ge = g_nccl.group_end();
    if (ne != 0) return nccl_fail(ne, "ncclSend / ncclRecv (the later chunks' dK / dV to their owners)");
    if (ge != 0) return nccl_fail(ge, "ncclGroupEnd (the later chunks' dK / dV to their owners)");
    return NSA_STATUS_SUCCESS;
}

/* The first chunks' partials (y: [B, Th] rows, the first half: rank q's first chunk reads keys
 * [0, end of chunk q) only) to their owners: owner p's rows are its first chunk, which rank q's
 * partial reaches iff p <= q. So rank q sends pieces (cmax rows) to p = 0..q and owner p receives
 * from q = p..P-1, into piece q of recv: the pieces the owners' sum reads, and no rows of zeros. */
static nsa_status exchange_first(const cp_run *c, cp_kv y, char *send, char *recv)
{
    nsa_status st =
        walk(c, 0, c->r + 1, 1, y, send, c->gpiece, c->cmax, 0, "cudaMemcpyAsync (a first-chunk gradient piece to send)");
    if (st != NSA_STATUS_SUCCESS || c->gpiece == 0) return st;
    nccl_result ne = g_nccl.group_start();
    for (int64_t p = 0; p <= c->r && ne == 0; p++)
        ne = g_nccl.send(send + (size_t)p * c->gpiece, c->gpiece, NCCL_UINT8, (int)p, c->comm, c->ms);
    for (int64_t q = c->r; q < c->P && ne == 0; q++)
        ne = g_nccl.recv(recv + (size_t)q * c->gpiece, c->gpiece, NCCL_UINT8, (int)q, c->comm, c->ms);
    const nccl_result ge = g_nccl.group_end();
    if (ne != 0) return nccl_fail(ne, "ncclSend / ncclRecv (the first chunks' dK / dV to their owners)");
    if (ge != 0) return nccl_fail(ge, "ncclGroupEnd (the first chunks' dK / dV to their owners)");
    return NSA_STATUS_SUCCESS;
}

/* rows [from, to) of every batch entry of the pair y zeroed, on the compute stream */
static nsa_status zero_rows(const cp_run *c, cp_kv y, int64_t from, int64_t to)
{
    cudaError_t e = cudaSuccess;
    for (int64_t b = 0; b < c->B && to > from && e == cudaSuccess; b++) {
        e = cudaMemsetAsync(y.k + (size_t)(b * y.rows + from) * c->rk, 0, (size_t)(to - from) * c->rk, c->cs);
        if (e == cudaSuccess) e = cudaMemsetAsync(y.v + (size_t)(b * y.rows + from) * c->rv, 0, (size_t)(to - from) * c->rv, c->cs);
    }
    return e == cudaSuccess ? NSA_STATUS_SUCCESS : cuda_fail(e, "cudaMemsetAsync (the rows a gradient partial never gets)");
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

/* a [B, R, H, D] view of a contiguous buffer's first R rows (T rows a batch entry) */
static nsa_tensor prefix_of(void *base, nsa_dtype dt, int64_t B, int64_t T, int64_t R, int64_t H, int64_t D)
{
    nsa_tensor v = nsa_tensor_4d(base, dt, B, R, H, D);
    v.stride[0] = T * H * D;
    return v;
}

/* A local K / V (or dK / dV) view whose rows the copies take whole: [B, L, H, D], stride[2] == D. */
static nsa_status row_contiguous(const nsa_tensor *t, const char *name)
{
    if (t->shape[2] > 1 && t->stride[2] != t->shape[3])
        return nsa_fail(NSA_STATUS_NOT_SUPPORTED, "%s: stride[2] is %" PRId64 ", context parallelism takes rows of H x D "
                        "contiguous elements (stride[2] == D = %" PRId64 ")", name, t->stride[2], t->shape[3]);
    return NSA_STATUS_SUCCESS;
}

/* The workspace's buffers (whole-sequence K / V; the collectives' send and receive buffers; the
 * backward's two partials a side) and the chunk calls' args over them. */
typedef struct cp_bufs {
    cp_kv kv, later, first; /* [B, T] K / V; the later chunk's partial [B, T]; the first's [B, Th] */
    char *send, *recv, *recv_first;
} cp_bufs;

/* Forward: phase 0 of the gather, then phase 1, on the communication stream; chunk r (keys
 * [0, end of chunk r): the first chunks of ranks 0..r) once phase 0 is in, chunk 2P-1-r once
 * phase 1 is. */
static nsa_status run_forward(nsa_context *ctx, const cp_run *c, const nsa_forward_args *f, const cp_bufs *w,
                              const nsa_forward_args cf[2], const int64_t nrows[2], void *cw, size_t cws)
{
    nsa_status st;
    if ((st = gather_phase(c, f, 0, w->kv, w->send, w->recv)) != NSA_STATUS_SUCCESS ||
        (st = signal_ev(c, c->ms, EV_FIRST, "cudaEventRecord (the first chunks gathered)")) != NSA_STATUS_SUCCESS ||
        (st = gather_phase(c, f, 1, w->kv, w->send, w->recv)) != NSA_STATUS_SUCCESS ||
        (st = signal_ev(c, c->ms, EV_SECOND, "cudaEventRecord (the second chunks gathered)")) != NSA_STATUS_SUCCESS ||
        (st = wait_ev(c, c->cs, EV_FIRST, "cudaStreamWaitEvent (the first chunks gathered)")) != NSA_STATUS_SUCCESS)
        return st;
    if (nrows[0] > 0 && (st = nsa_forward(ctx, &cf[0], cw, cws)) != NSA_STATUS_SUCCESS) return st;
    if ((st = wait_ev(c, c->cs, EV_SECOND, "cudaStreamWaitEvent (the second chunks gathered)")) != NSA_STATUS_SUCCESS) return st;
    if (nrows[1] > 0 && (st = nsa_forward(ctx, &cf[1], cw, cws)) != NSA_STATUS_SUCCESS) return st;
    return NSA_STATUS_SUCCESS;
}

/* Backward: the whole gather; the later chunk's backward, whose partial then goes to its owners
 * on the communication stream while the first chunk's backward runs; that partial's first half
 * after it; the owners' sum (later pieces in rank order, then first pieces in rank order). */
static nsa_status run_backward(nsa_context *ctx, const cp_run *c, const nsa_forward_args *f, const nsa_cp_bwd_args *ba,
                               const cp_bufs *w, const nsa_backward_args cb[2], const int64_t nrows[2], void *cw, size_t cws)
{
    const cp_chunk c0 = chunk_of(c->T, c->P, c->r, 0), c1 = chunk_of(c->T, c->P, c->r, 1);
    nsa_status st;
    if ((st = gather_phase(c, f, 0, w->kv, w->send, w->recv)) != NSA_STATUS_SUCCESS ||
        (st = gather_phase(c, f, 1, w->kv, w->send, w->recv)) != NSA_STATUS_SUCCESS ||
        (st = signal_ev(c, c->ms, EV_SECOND, "cudaEventRecord (K / V gathered)")) != NSA_STATUS_SUCCESS ||
        (st = wait_ev(c, c->cs, EV_SECOND, "cudaStreamWaitEvent (K / V gathered)")) != NSA_STATUS_SUCCESS)
        return st;
    /* the chunk calls write their keys' rows [0, end) whole; the rows past them, or all of a
     * partial whose chunk is empty (no call), are zeros that travel */
    if ((st = zero_rows(c, w->later, nrows[1] > 0 ? c1.lo + c1.n : 0, c->T)) != NSA_STATUS_SUCCESS ||
        (nrows[0] == 0 && (st = zero_rows(c, w->first, 0, c->Th)) != NSA_STATUS_SUCCESS))
        return st;
    if (nrows[1] > 0 && (st = nsa_backward(ctx, &cb[1], cw, cws)) != NSA_STATUS_SUCCESS) return st;
    if ((st = signal_ev(c, c->cs, EV_LATER_PART, "cudaEventRecord (the later chunk's partial)")) != NSA_STATUS_SUCCESS ||
        (st = wait_ev(c, c->ms, EV_LATER_PART, "cudaStreamWaitEvent (the later chunk's partial)")) != NSA_STATUS_SUCCESS ||
        (st = exchange_later(c, w->later, w->send, w->recv)) != NSA_STATUS_SUCCESS)
        return st;
    if (nrows[0] > 0 && (st = nsa_backward(ctx, &cb[0], cw, cws)) != NSA_STATUS_SUCCESS) return st;
    if ((st = signal_ev(c, c->cs, EV_FIRST_PART, "cudaEventRecord (the first chunk's partial)")) != NSA_STATUS_SUCCESS ||
        (st = wait_ev(c, c->ms, EV_FIRST_PART, "cudaStreamWaitEvent (the first chunk's partial)")) != NSA_STATUS_SUCCESS ||
        (st = exchange_first(c, w->first, w->send, w->recv_first)) != NSA_STATUS_SUCCESS ||
        (st = signal_ev(c, c->ms, EV_EXCHANGED, "cudaEventRecord (dK / dV exchanged)")) != NSA_STATUS_SUCCESS ||
        (st = wait_ev(c, c->cs, EV_EXCHANGED, "cudaStreamWaitEvent (dK / dV exchanged)")) != NSA_STATUS_SUCCESS)
        return st;
    const nsa_tensor *out[2] = {&ba->dk, &ba->dv};
    const int64_t D[2] = {c->DK, c->DV};
    for (int s = 0; s < 2; s++) { /* K's part of each piece, then V's */
        cp_sum_params p;
        memset(&p, 0, sizeof p);
        p.out = out[s]->data, p.dt = (int)out[s]->dtype, p.s0 = out[s]->stride[0], p.s1 = out[s]->stride[1];
        p.B = c->B, p.L = c->L, p.W = c->H * D[s], p.n0 = c0.n;
        p.x = s ? piece_at(c, w->recv, c->Lmax).v : w->recv;
        p.xs = (int64_t)(c->xpiece / c->es), p.xrows = c->Lmax, p.nx = c->P;
        p.f = s ? piece_at(c, w->recv_first, c->cmax).v : w->recv_first;
        p.fs = (int64_t)(c->gpiece / c->es), p.frows = c->cmax, p.f0 = c->r, p.nf = c->P;
        const int64_t n = p.B * p.L * p.W;
        if (n <= 0) continue;
        cp_sum_kernel<<<cp_grid(n), 256, 0, c->cs>>>(p);
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return cuda_fail(e, "cp_sum_kernel");
    }
    return NSA_STATUS_SUCCESS;
}

static size_t size_max2(size_t a, size_t b) { return a > b ? a : b; }

/* bytes of [B, rows, H, D] elements, saturating */
static size_t bytes_of(const cp_run *c, int64_t rows, int64_t D)
{
    return nsa_size_mul(nsa_size_elems(c->B, rows, c->H, D), c->es);
}

/* Checks, sizes (need non-NULL: the bytes into *need, nothing run) or checks the workspace and
 * runs: one pass, so the call is validated once. */
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
    c.cs = c.ms = (cudaStream_t)ctx->stream, c.comm = a->comm;
    c.P = P, c.r = r, c.T = a->seq_len;
    c.B = f->q.shape[0], c.L = f->q.shape[1], c.H = f->k.shape[2], c.DK = f->k.shape[3];
    c.DV = f->v.shape[3];
    c.es = nsa_dtype_size(f->q.dtype);
    const int64_t want = nsa_cp_local_length(c.T, r, P);
    if (c.L != want)
        return nsa_fail(NSA_STATUS_BAD_SHAPE, "%slocal.q: dim 1 is %" PRId64 ", rank %d of %d holds %" PRId64 " of seq_len %" PRId64
                        " positions (spec 15)", pre, c.L, r, P, want, c.T);
    c.Th = chunk_lo(P, c.T, P);
    for (int64_t p = 0; p < P; p++) {
        const int64_t l = nsa_cp_local_length(c.T, p, P);
        c.Lmax = l > c.Lmax ? l : c.Lmax;
        for (int k = 0; k < 2; k++) {
            const int64_t n = chunk_of(c.T, P, p, k).n;
            c.cmax = n > c.cmax ? n : c.cmax;
        }
    }
    c.rk = (size_t)(c.H * c.DK) * c.es, c.rv = (size_t)(c.H * c.DV) * c.es;

    /* workspace: whole K and V; the collectives' send and receive buffers (the gather's: one piece
     * of cmax rows and P of them; the backward's exchanges reuse them on the same stream after the
     * gather, P pieces of Lmax rows each way, and the first chunks' pieces arrive in their own P
     * pieces of cmax rows, as the owners' sum reads both); the backward's later-chunk partials
     * (T rows) and first-chunk partials (Th rows); then the chunk calls' */
    const size_t kb = bytes_of(&c, c.T, c.DK), vb = bytes_of(&c, c.T, c.DV);
    const size_t kh = bytes_of(&c, c.Th, c.DK), vh = bytes_of(&c, c.Th, c.DV);
    c.gpiece = nsa_size_add(bytes_of(&c, c.cmax, c.DK), bytes_of(&c, c.cmax, c.DV));
    c.xpiece = nsa_size_add(bytes_of(&c, c.Lmax, c.DK), bytes_of(&c, c.Lmax, c.DV));
    const size_t xall = ba ? nsa_size_mul(c.xpiece, (size_t)P) : 0;
    enum { W_K, W_V, W_SEND, W_RECV, W_RECV_FIRST, W_LATER_K, W_LATER_V, W_FIRST_K, W_FIRST_V, W_N };
    size_t off[W_N + 1], at = 0;
    const size_t sizes[W_N] = {kb, vb, size_max2(c.gpiece, xall), size_max2(nsa_size_mul(c.gpiece, (size_t)P), xall),
                               ba ? nsa_size_mul(c.gpiece, (size_t)P) : 0, ba ? kb : 0, ba ? vb : 0, ba ? kh : 0, ba ? vh : 0};
    for (int i = 0; i < W_N; i++) off[i] = at, at = nsa_size_align(nsa_size_add(at, sizes[i]), 256);
    off[W_N] = at;
    /* sizing: any non-NULL address, never read (a run without a workspace stops below) */
    char *base = ws ? (char *)ws : (char *)(uintptr_t)256;
    cp_bufs w;
    w.kv.k = base + off[W_K], w.kv.v = base + off[W_V], w.kv.rows = c.T;
    w.send = base + off[W_SEND], w.recv = base + off[W_RECV], w.recv_first = base + off[W_RECV_FIRST];
    w.later.k = base + off[W_LATER_K], w.later.v = base + off[W_LATER_V], w.later.rows = c.T;
    w.first.k = base + off[W_FIRST_K], w.first.v = base + off[W_FIRST_V], w.first.rows = c.Th;

    /* the two chunk calls' args: rows [at, at + n) of the local part, keys [0, end) */
    nsa_forward_args cf[2];
    nsa_backward_args cb[2];
    int64_t nrows[2];
    size_t chunk_ws = 0;
    for (int k = 0; k < 2; k++) {
        const cp_chunk ch = chunk_of(c.T, P, r, k);
        const int64_t row = ch.at, n = ch.n, end = ch.lo + ch.n;
        nrows[k] = n;
        nsa_forward_args x = *f;
        x.q = rows_of(&f->q, row, n);
        x.k = prefix_of(w.kv.k, f->k.dtype, c.B, c.T, end, c.H, c.DK);
        x.v = prefix_of(w.kv.v, f->v.dtype, c.B, c.T, end, c.H, c.DV);
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
            /* the first chunk's keys end by Th: its partial is the first half's rows */
            const cp_kv y = k ? w.later : w.first;
            nsa_backward_args g;
            memset(&g, 0, sizeof g);
            g.fwd = x;
            g.dout = rows_of(&ba->dout, row, n), g.dq = rows_of(&ba->dq, row, n);
            g.dk = prefix_of(y.k, f->k.dtype, c.B, y.rows, end, c.H, c.DK);
            g.dv = prefix_of(y.v, f->v.dtype, c.B, y.rows, end, c.H, c.DV);
            g.dg_cmp = rows_of(&ba->dg_cmp, row, n), g.dg_slc = rows_of(&ba->dg_slc, row, n);
            g.dg_swa = rows_of(&ba->dg_swa, row, n);
            cb[k] = g;
            if (n > 0) st = nsa_backward_workspace_size(ctx, &g, &wk);
        } else if (n > 0) {
            st = nsa_forward_workspace_size(ctx, &x, &wk);
        }
        if (st != NSA_STATUS_SUCCESS) return st;
        chunk_ws = wk > chunk_ws ? wk : chunk_ws;
    }
    const size_t total = nsa_size_add(off[W_N], chunk_ws);
    if (total == SIZE_MAX)
        return nsa_fail(NSA_STATUS_SIZE_OVERFLOW, "workspace: the bytes of a context-parallel call overflow size_t");
    if (need) {
        *need = total;
        return NSA_STATUS_SUCCESS;
    }
    if (ws_bytes < total)
        return nsa_fail(NSA_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes: %zu < %zu needed", ws_bytes, total);
    if (total > 0 && !ws) return nsa_fail(NSA_STATUS_NULL_POINTER, "workspace: NULL but %zu bytes are needed", total);

    cudaError_t e = cudaSetDevice(ctx->device);
    if (e != cudaSuccess) return cuda_fail(e, "cudaSetDevice");
    if (ctx->cuda.cp_overlap) {
        cp_state *s = NULL;
        if ((st = cp_state_get(ctx, &s)) != NSA_STATUS_SUCCESS) return st;
        c.ms = s->ms, c.ev = s->ev;
    }
    /* the communication stream starts after what the context's stream has queued (the inputs,
     * an earlier call's use of the workspace) */
    if ((st = signal_ev(&c, c.cs, EV_READY, "cudaEventRecord (the inputs ready)")) != NSA_STATUS_SUCCESS ||
        (st = wait_ev(&c, c.ms, EV_READY, "cudaStreamWaitEvent (the inputs ready)")) != NSA_STATUS_SUCCESS)
        return st;
    void *cw = base + off[W_N];
    st = ba ? run_backward(ctx, &c, f, ba, &w, cb, nrows, cw, chunk_ws) : run_forward(ctx, &c, f, &w, cf, nrows, cw, chunk_ws);
    /* the context's stream ends after everything the communication stream queued, failure or
     * not: the call is stream-ordered on it like every other call (and a capture joins back) */
    if (c.ms != c.cs) {
        e = cudaEventRecord(c.ev[EV_END], c.ms);
        if (e == cudaSuccess) e = cudaStreamWaitEvent(c.cs, c.ev[EV_END], 0);
        if (e != cudaSuccess && st == NSA_STATUS_SUCCESS)
            st = cuda_fail(e, "cudaEventRecord / cudaStreamWaitEvent (the call's end)");
    }
    return st;
}
