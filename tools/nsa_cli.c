/* nsa_cli.c -- the one tool of the project: `nsa demo | check | bench | version`.
 *
 *   demo   NSA forward + backward on a realistic synthetic input: time per branch op, the
 *          whole forward/backward, dense causal attention for comparison, the fraction of
 *          keys each query reads, and sampled rows against the float64 reference.
 *   check  the random correctness sweep of tests/kit/sweep.c for a given time or case count.
 *   bench  per-op and whole-NSA timings over several lengths, as a table and/or JSON;
 *          --branches: CUDA-event timings of the whole forward / backward and of each branch.
 *
 * It calls the library only through nsa.h. Every buffer the library touches is "backend
 * memory" (devmem_* of tests/kit/devmem.h): host memory on the CPU, device memory for CUDA.
 * The sweep, the float64 reference and the harness come from the test kit (tests/kit).
 * Errors: a library status prints its detail (nsa_last_error_detail) and nsa_status_string
 * and exits 1; a bad command line prints
 * the usage and exits 2. */
#define _POSIX_C_SOURCE 200809L

#include "nsa.h"
#include "dtype.h" /* src/dtype.h: the library's f16 / bf16 conversions */
#include "harness.h"
#include "ref.h"
#include "sweep.h"
#include "devmem.h"
#include "hashlog.h"
#include "variant.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef NSA_WITH_CUDA
#include <cuda_runtime_api.h> /* bench --branches: CUDA events and the device's name */
#endif

/* ==== errors ========================================================================= */

/* Set while `nsa check` runs: its last line must be the counts, even when it dies. */
static int g_check_running = 0;

static void fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "nsa: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    if (g_check_running) printf("%ld passed, %ld failed\n", g_tests_passed, g_tests_failed + 1);
    exit(1);
}

/* Every library call goes through here, right after it (the detail is the last call's): a
 * tool may exit, the library never does. */
static void need(nsa_status st, const char *what)
{
    if (st == NSA_STATUS_SUCCESS) return;
    const char *detail = nsa_last_error_detail();
    if (detail[0]) fail("%s: %s (%s, status %d)", what, detail, nsa_status_string(st), (int)st);
    fail("%s: %s (status %d)", what, nsa_status_string(st), (int)st);
}

static void *host_alloc(size_t bytes, const char *what)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) fail("out of host memory allocating %zu bytes for %s", bytes, what);
    return p;
}

static double clock_s(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double now_s(void) { return clock_s(CLOCK_MONOTONIC); }
/* CPU seconds of all our threads: against wall time it shows whether we had the cores. */
static double cpu_s(void) { return clock_s(CLOCK_PROCESS_CPUTIME_ID); }

static const char *backend_name(nsa_backend be) { return be == NSA_BACKEND_CUDA ? "cuda" : "cpu"; }


/* ==== backend memory ==================================================================
 * Every buffer the library touches: tests/kit/devmem.h (host memory on the CPU, device memory
 * on CUDA); its failures end the run through fail(). */

static void devmem_failed(const char *reason) { fail("%s", reason); }

/* ==== tensors in backend memory ======================================================= */

typedef struct tbuf {
    void *mem;        /* backend memory holding n elements of dtype */
    nsa_dtype dtype;
    int64_t n;
    int aliased;      /* mem is the caller's host array (CPU, f32): not ours to free */
} tbuf;

static size_t tbuf_bytes(nsa_dtype dt, int64_t n)
{
    const size_t es = nsa_dtype_size(dt);
    if (n < 0 || (uint64_t)n > SIZE_MAX / es) fail("tensor of %lld elements does not fit in memory", (long long)n);
    return (size_t)n * es;
}

static void tbuf_alloc(tbuf *b, nsa_backend be, nsa_dtype dt, int64_t n, const char *what)
{
    b->dtype = dt;
    b->n = n;
    b->aliased = 0;
    b->mem = devmem_alloc(be, tbuf_bytes(dt, n), what);
}

/* Stores host values vals[n] in dtype and rounds vals in place to what was stored, so the
 * reference reads exactly the backend's inputs. On the CPU an f32 tensor is vals itself. */
static void tbuf_from_host(tbuf *b, nsa_backend be, nsa_dtype dt, float *vals, int64_t n, const char *what)
{
    if (be == NSA_BACKEND_CPU && dt == NSA_DTYPE_F32) {
        b->mem = vals, b->dtype = dt, b->n = n, b->aliased = 1;
        return;
    }
    tbuf_alloc(b, be, dt, n, what);
    const size_t bytes = tbuf_bytes(dt, n);
    void *stage = be == NSA_BACKEND_CPU ? b->mem : host_alloc(bytes, what);
    if (dt == NSA_DTYPE_F32) {
        memcpy(stage, vals, bytes);
    } else {
        uint16_t *s = (uint16_t *)stage;
        for (int64_t i = 0; i < n; i++) {
            s[i] = dt == NSA_DTYPE_BF16 ? nsa_f32_to_bf16(vals[i]) : nsa_f32_to_f16(vals[i]);
            vals[i] = dt == NSA_DTYPE_BF16 ? nsa_bf16_to_f32(s[i]) : nsa_f16_to_f32(s[i]);
        }
    }
    devmem_upload(be, b->mem, stage, bytes);
    if (stage != b->mem) free(stage);
}

/* dst[count] = elements [first, first + count) of the tensor as f32 (host). */
static void tbuf_range_to_host_f32(const tbuf *b, nsa_backend be, int64_t first, int64_t count, float *dst)
{
    const size_t es = nsa_dtype_size(b->dtype);
    const char *src = (const char *)b->mem + (size_t)first * es;
    if (b->dtype == NSA_DTYPE_F32) {
        devmem_download(be, dst, src, (size_t)count * es);
        return;
    }
    uint16_t *s = (uint16_t *)host_alloc((size_t)count * es, "a download");
    devmem_download(be, s, src, (size_t)count * es);
    for (int64_t i = 0; i < count; i++) dst[i] = b->dtype == NSA_DTYPE_BF16 ? nsa_bf16_to_f32(s[i]) : nsa_f16_to_f32(s[i]);
    free(s);
}

static void tbuf_free(tbuf *b, nsa_backend be)
{
    if (b->mem && !b->aliased) devmem_free(be, b->mem);
    memset(b, 0, sizeof *b);
}

/* ==== the problem: sizes, buffers, and every call built once ========================== */

enum { BR_CMP, BR_SLC, BR_SWA, NBRANCH };

typedef struct problem {
    nsa_backend backend;
    nsa_context *ctx;
    int64_t B, T, HQ, H, DK, DV, Nc, n;
    nsa_dtype dtype;
    nsa_config cfg;
    int with_bwd, with_dense;
    /* host values of the inputs, as stored (the reference reads these) */
    float *hq, *hk, *hv, *hg[NBRANCH], *hdout;
    /* backend tensors; shapes in the comments of nsa.h */
    tbuf q, k, v, kc, vc, g[NBRANCH], o, ob[NBRANCH], lse[NBRANCH], idx, od, lsed;
    tbuf dout, dq, dk, dv, dkc, dvc, dg[NBRANCH];
    tbuf seqlens; /* [B] I32: the decode step's cached tokens (T each) */
    void *ws;
    size_t ws_bytes;
    /* the calls */
    nsa_compress_args ck, cv;
    nsa_cmp_attn_args cmp;
    nsa_select_args sel;
    nsa_slc_attn_args slc;
    nsa_attention_args swa, dense;
    nsa_gate_args gate;
    nsa_forward_args fwd;
    nsa_cmp_attn_bwd_args cmp_b;
    nsa_slc_attn_bwd_args slc_b;
    nsa_attention_bwd_args swa_b, dense_b;
    nsa_backward_args bwd;
    nsa_step_args step;
} problem;

typedef struct problem_opts {
    nsa_backend backend;
    int threads;
    int64_t T, HQ, H, DK, DV;
    nsa_dtype dtype;
    nsa_config cfg;
    int with_bwd, with_dense;
    uint64_t seed;
} problem_opts;

static int64_t mul3(int64_t a, int64_t b, int64_t c)
{
    if (a < 0 || b < 0 || c < 0) fail("negative size");
    if (a && b > INT64_MAX / a) fail("problem too large");
    const int64_t ab = a * b;
    if (ab && c > INT64_MAX / ab) fail("problem too large");
    return ab * c;
}

static float *random_normal(test_rng *r, int64_t n, const char *what)
{
    float *x = (float *)host_alloc(tbuf_bytes(NSA_DTYPE_F32, n), what);
    for (int64_t i = 0; i < n; i++) x[i] = (float)rng_normal(r);
    return x;
}

/* Gates as the paper makes them, sigmoid(MLP): strictly inside (0, 1). */
static float *random_gates(test_rng *r, int64_t n)
{
    float *x = random_normal(r, n, "gates");
    for (int64_t i = 0; i < n; i++) x[i] = 1.0f / (1.0f + expf(-x[i]));
    return x;
}

static nsa_tensor t4(const tbuf *b, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    return nsa_tensor_4d(b->mem, b->dtype, d0, d1, d2, d3);
}

static nsa_tensor t3(const tbuf *b, int64_t d0, int64_t d1, int64_t d2)
{
    return nsa_tensor_3d(b->mem, b->dtype, d0, d1, d2);
}

static void alloc_buffers(problem *p)
{
    const nsa_backend be = p->backend;
    const nsa_dtype dt = p->dtype;
    const int64_t rows = mul3(p->B, p->T, 1), nq = mul3(rows, p->HQ, p->DK), no = mul3(rows, p->HQ, p->DV);
    const int64_t nrow = mul3(rows, p->HQ, 1), nkc = mul3(p->B * p->Nc, p->H, p->DK), nvc = mul3(p->B * p->Nc, p->H, p->DV);
    tbuf_alloc(&p->kc, be, dt, nkc, "k_cmp");
    tbuf_alloc(&p->vc, be, dt, nvc, "v_cmp");
    tbuf_alloc(&p->o, be, dt, no, "o");
    for (int b = 0; b < NBRANCH; b++) {
        tbuf_alloc(&p->ob[b], be, dt, no, "branch outputs");
        tbuf_alloc(&p->lse[b], be, NSA_DTYPE_F32, nrow, "branch lse");
    }
    tbuf_alloc(&p->idx, be, NSA_DTYPE_I32, mul3(rows, p->H, p->n), "block_indices");
    tbuf_alloc(&p->seqlens, be, NSA_DTYPE_I32, p->B, "seqlens");
    {
        int32_t *lens = (int32_t *)host_alloc(tbuf_bytes(NSA_DTYPE_I32, p->B), "seqlens (host)");
        for (int64_t b = 0; b < p->B; b++) lens[b] = (int32_t)p->T;
        devmem_upload(be, p->seqlens.mem, lens, tbuf_bytes(NSA_DTYPE_I32, p->B));
        free(lens);
    }
    if (p->with_dense) {
        tbuf_alloc(&p->od, be, dt, no, "dense o");
        tbuf_alloc(&p->lsed, be, NSA_DTYPE_F32, nrow, "dense lse");
    }
    if (!p->with_bwd) return;
    tbuf_alloc(&p->dq, be, dt, nq, "dq");
    tbuf_alloc(&p->dk, be, dt, mul3(rows, p->H, p->DK), "dk");
    tbuf_alloc(&p->dv, be, dt, mul3(rows, p->H, p->DV), "dv");
    tbuf_alloc(&p->dkc, be, dt, nkc, "dk_cmp");
    tbuf_alloc(&p->dvc, be, dt, nvc, "dv_cmp");
    for (int b = 0; b < NBRANCH; b++) tbuf_alloc(&p->dg[b], be, dt, nrow, "gate gradients");
}

static void fill_inputs(problem *p, uint64_t seed)
{
    const nsa_backend be = p->backend;
    const int64_t rows = mul3(p->B, p->T, 1);
    test_rng r = {seed};
    p->hq = random_normal(&r, mul3(rows, p->HQ, p->DK), "q");
    p->hk = random_normal(&r, mul3(rows, p->H, p->DK), "k");
    p->hv = random_normal(&r, mul3(rows, p->H, p->DV), "v");
    tbuf_from_host(&p->q, be, p->dtype, p->hq, mul3(rows, p->HQ, p->DK), "q");
    tbuf_from_host(&p->k, be, p->dtype, p->hk, mul3(rows, p->H, p->DK), "k");
    tbuf_from_host(&p->v, be, p->dtype, p->hv, mul3(rows, p->H, p->DV), "v");
    for (int b = 0; b < NBRANCH; b++) {
        p->hg[b] = random_gates(&r, mul3(rows, p->HQ, 1));
        tbuf_from_host(&p->g[b], be, p->dtype, p->hg[b], mul3(rows, p->HQ, 1), "gates");
    }
    if (p->with_bwd) {
        p->hdout = random_normal(&r, mul3(rows, p->HQ, p->DV), "dout");
        tbuf_from_host(&p->dout, be, p->dtype, p->hdout, mul3(rows, p->HQ, p->DV), "dout");
    }
}

/* The branch ops write into the same buffers nsa_forward saves to: same values, and the
 * branch backward ops then read a consistent forward. */
static void build_forward_calls(problem *p)
{
    const int64_t B = p->B, T = p->T, HQ = p->HQ, H = p->H, DK = p->DK, DV = p->DV, Nc = p->Nc;
    const nsa_tensor q = t4(&p->q, B, T, HQ, DK), k = t4(&p->k, B, T, H, DK), v = t4(&p->v, B, T, H, DV);
    const nsa_tensor kc = t4(&p->kc, B, Nc, H, DK), vc = t4(&p->vc, B, Nc, H, DV);
    const nsa_tensor idx = t4(&p->idx, B, T, H, p->n);
    nsa_tensor ob[NBRANCH], lse[NBRANCH], g[NBRANCH];
    for (int b = 0; b < NBRANCH; b++) {
        ob[b] = t4(&p->ob[b], B, T, HQ, DV);
        lse[b] = t3(&p->lse[b], B, T, HQ);
        g[b] = t3(&p->g[b], B, T, HQ);
    }
    p->ck = (nsa_compress_args){.x = k, .x_cmp = kc, .config = p->cfg};
    p->cv = (nsa_compress_args){.x = v, .x_cmp = vc, .config = p->cfg};
    p->cmp = (nsa_cmp_attn_args){.q = q, .k_cmp = kc, .v_cmp = vc, .o = ob[BR_CMP], .lse = lse[BR_CMP], .config = p->cfg};
    /* lse from the compressed attention spares the selection recomputing it, as in the paper */
    p->sel = (nsa_select_args){.q = q, .k_cmp = kc, .lse_cmp = lse[BR_CMP], .block_indices = idx, .config = p->cfg};
    p->slc = (nsa_slc_attn_args){.q = q, .k = k, .v = v, .block_indices = idx, .o = ob[BR_SLC], .lse = lse[BR_SLC],
                                 .config = p->cfg};
    p->swa = (nsa_attention_args){.q = q, .k = k, .v = v, .o = ob[BR_SWA], .lse = lse[BR_SWA], .scale = p->cfg.scale,
                                  .causal = 1, .window_left = p->cfg.window - 1, .window_right = 0};
    p->gate = (nsa_gate_args){.o_cmp = ob[BR_CMP], .o_slc = ob[BR_SLC], .o_swa = ob[BR_SWA], .g_cmp = g[BR_CMP],
                              .g_slc = g[BR_SLC], .g_swa = g[BR_SWA], .o = t4(&p->o, B, T, HQ, DV)};
    p->fwd = (nsa_forward_args){.q = q, .k = k, .v = v, .g_cmp = g[BR_CMP], .g_slc = g[BR_SLC], .g_swa = g[BR_SWA],
                                .o = t4(&p->o, B, T, HQ, DV), .config = p->cfg};
    p->fwd.saved = (nsa_saved){.block_indices = idx, .o_cmp = ob[BR_CMP], .o_slc = ob[BR_SLC], .o_swa = ob[BR_SWA],
                               .lse_cmp = lse[BR_CMP], .lse_slc = lse[BR_SLC], .lse_swa = lse[BR_SWA]};
    if (p->with_dense)
        p->dense = (nsa_attention_args){.q = q, .k = k, .v = v, .o = t4(&p->od, B, T, HQ, DV), .lse = t3(&p->lsed, B, T, HQ),
                                        .scale = p->cfg.scale, .causal = 1, .window_left = -1, .window_right = 0};
}

/* Row T - 1 of a [B, T, X, D] (or [B, T, X]) tensor as a [B, 1, X, D] view: the decode step's
 * query and gates, the last token of each sequence. */
static nsa_tensor last_row(nsa_tensor t)
{
    const int64_t step = t.stride[1];
    t.data = (char *)t.data + (size_t)((t.shape[1] - 1) * step) * nsa_dtype_size(t.dtype);
    t.shape[1] = 1;
    return t;
}

/* One decode step: the last token of every sequence against its whole prefix, the problem's
 * k, v as contiguous caches and the compressed k, v (OP_COMPRESS) as the caller-kept
 * compressed cache; no append. */
static void build_decode_call(problem *p)
{
    const int64_t B = p->B, T = p->T, HQ = p->HQ, H = p->H, DK = p->DK, DV = p->DV, Nc = p->Nc;
    nsa_step_args *s = &p->step;
    memset(s, 0, sizeof *s);
    if (T < 1) return;
    s->q = last_row(t4(&p->q, B, T, HQ, DK));
    s->seqlens = nsa_tensor_make(p->seqlens.mem, NSA_DTYPE_I32, 1, (int64_t[]){B});
    s->cache.k = t4(&p->k, B, T, H, DK), s->cache.v = t4(&p->v, B, T, H, DV);
    s->cmp_cache.k = t4(&p->kc, B, Nc, H, DK), s->cmp_cache.v = t4(&p->vc, B, Nc, H, DV);
    s->cmp_by_caller = 1;
    s->g_cmp = last_row(t3(&p->g[BR_CMP], B, T, HQ)), s->g_slc = last_row(t3(&p->g[BR_SLC], B, T, HQ));
    s->g_swa = last_row(t3(&p->g[BR_SWA], B, T, HQ));
    s->o = t4(&p->o, B, 1, HQ, DV);
    s->config = p->cfg;
}

static void build_backward_calls(problem *p)
{
    const int64_t B = p->B, T = p->T, HQ = p->HQ, H = p->H, DK = p->DK, DV = p->DV, Nc = p->Nc;
    const nsa_tensor dout = t4(&p->dout, B, T, HQ, DV), dq = t4(&p->dq, B, T, HQ, DK);
    const nsa_tensor dk = t4(&p->dk, B, T, H, DK), dv = t4(&p->dv, B, T, H, DV);
    p->cmp_b = (nsa_cmp_attn_bwd_args){.fwd = p->cmp, .dout = dout, .dq = dq, .dk_cmp = t4(&p->dkc, B, Nc, H, DK),
                                       .dv_cmp = t4(&p->dvc, B, Nc, H, DV)};
    p->slc_b = (nsa_slc_attn_bwd_args){.fwd = p->slc, .dout = dout, .dq = dq, .dk = dk, .dv = dv};
    p->swa_b = (nsa_attention_bwd_args){.fwd = p->swa, .dout = dout, .dq = dq, .dk = dk, .dv = dv};
    if (p->with_dense) p->dense_b = (nsa_attention_bwd_args){.fwd = p->dense, .dout = dout, .dq = dq, .dk = dk, .dv = dv};
    p->bwd = (nsa_backward_args){.fwd = p->fwd, .dout = dout, .dq = dq, .dk = dk, .dv = dv,
                                 .dg_cmp = t3(&p->dg[BR_CMP], B, T, HQ), .dg_slc = t3(&p->dg[BR_SLC], B, T, HQ),
                                 .dg_swa = t3(&p->dg[BR_SWA], B, T, HQ)};
}

/* ==== the operations this tool times ================================================== */

typedef enum op_id {
    OP_COMPRESS, OP_CMP_ATTN, OP_SELECT, OP_SLC_ATTN, OP_SWA, OP_GATE, OP_FORWARD, OP_DENSE,
    OP_CMP_ATTN_BWD, OP_SLC_ATTN_BWD, OP_SWA_BWD, OP_BACKWARD, OP_DENSE_BWD, OP_DECODE, OP_COUNT
} op_id;

static const struct op_info {
    const char *name;   /* short name in tables and JSON */
    const char *call;   /* the library call(s) */
    int bwd, dense;
} OPS[OP_COUNT] = {
    [OP_COMPRESS] = {"compress", "nsa_compress (k and v)", 0, 0},
    [OP_CMP_ATTN] = {"cmp_attn", "nsa_cmp_attn", 0, 0},
    [OP_SELECT] = {"select", "nsa_select", 0, 0},
    [OP_SLC_ATTN] = {"slc_attn", "nsa_slc_attn", 0, 0},
    [OP_SWA] = {"window", "nsa_attention (causal, window w)", 0, 0},
    [OP_GATE] = {"gate", "nsa_gate", 0, 0},
    [OP_FORWARD] = {"forward", "nsa_forward", 0, 0},
    [OP_DENSE] = {"dense", "nsa_attention (causal, no window)", 0, 1},
    [OP_CMP_ATTN_BWD] = {"cmp_attn_bwd", "nsa_cmp_attn_bwd", 1, 0},
    [OP_SLC_ATTN_BWD] = {"slc_attn_bwd", "nsa_slc_attn_bwd", 1, 0},
    [OP_SWA_BWD] = {"window_bwd", "nsa_attention_bwd (causal, window w)", 1, 0},
    [OP_BACKWARD] = {"backward", "nsa_backward", 1, 0},
    [OP_DENSE_BWD] = {"dense_bwd", "nsa_attention_bwd (causal, no window)", 1, 1},
    [OP_DECODE] = {"decode", "nsa_step (one new token per sequence against T cached ones)", 0, 0},
};

#define OPBIT(id) (1u << (id))
/* What an op reads that other ops write: they run first (untimed when not asked for). */
static const unsigned OP_NEEDS[OP_COUNT] = {
    [OP_CMP_ATTN] = OPBIT(OP_COMPRESS),
    [OP_SELECT] = OPBIT(OP_COMPRESS) | OPBIT(OP_CMP_ATTN),
    [OP_SLC_ATTN] = OPBIT(OP_COMPRESS) | OPBIT(OP_CMP_ATTN) | OPBIT(OP_SELECT),
    [OP_GATE] = OPBIT(OP_COMPRESS) | OPBIT(OP_CMP_ATTN) | OPBIT(OP_SELECT) | OPBIT(OP_SLC_ATTN) | OPBIT(OP_SWA),
    [OP_CMP_ATTN_BWD] = OPBIT(OP_COMPRESS) | OPBIT(OP_CMP_ATTN),
    [OP_SLC_ATTN_BWD] = OPBIT(OP_COMPRESS) | OPBIT(OP_CMP_ATTN) | OPBIT(OP_SELECT) | OPBIT(OP_SLC_ATTN),
    [OP_SWA_BWD] = OPBIT(OP_SWA),
    [OP_BACKWARD] = OPBIT(OP_FORWARD),
    [OP_DENSE_BWD] = OPBIT(OP_DENSE),
    [OP_DECODE] = OPBIT(OP_COMPRESS),
};
/* --op groups: the flash-attention core alone (nsa_attention, dense and windowed), and NSA's own ops */
#define OPS_ATTENTION (OPBIT(OP_SWA) | OPBIT(OP_DENSE) | OPBIT(OP_SWA_BWD) | OPBIT(OP_DENSE_BWD))
#define OPS_NSA                                                                                                        \
    (OPBIT(OP_COMPRESS) | OPBIT(OP_CMP_ATTN) | OPBIT(OP_SELECT) | OPBIT(OP_SLC_ATTN) | OPBIT(OP_SWA) | OPBIT(OP_GATE) | \
     OPBIT(OP_FORWARD) | OPBIT(OP_CMP_ATTN_BWD) | OPBIT(OP_SLC_ATTN_BWD) | OPBIT(OP_SWA_BWD) | OPBIT(OP_BACKWARD))

static int op_enabled(const problem *p, op_id id) { return (!OPS[id].bwd || p->with_bwd) && (!OPS[id].dense || p->with_dense); }

static nsa_status op_workspace(problem *p, op_id id, size_t *bytes)
{
    nsa_context *c = p->ctx;
    switch (id) {
    case OP_COMPRESS: {
        size_t a = 0, b = 0;
        nsa_status st = nsa_compress_workspace_size(c, &p->ck, &a);
        if (st == NSA_STATUS_SUCCESS) st = nsa_compress_workspace_size(c, &p->cv, &b);
        *bytes = a > b ? a : b;
        return st;
    }
    case OP_CMP_ATTN: return nsa_cmp_attn_workspace_size(c, &p->cmp, bytes);
    case OP_SELECT: return nsa_select_workspace_size(c, &p->sel, bytes);
    case OP_SLC_ATTN: return nsa_slc_attn_workspace_size(c, &p->slc, bytes);
    case OP_SWA: return nsa_attention_workspace_size(c, &p->swa, bytes);
    case OP_GATE: return nsa_gate_workspace_size(c, &p->gate, bytes);
    case OP_FORWARD: return nsa_forward_workspace_size(c, &p->fwd, bytes);
    case OP_DENSE: return nsa_attention_workspace_size(c, &p->dense, bytes);
    case OP_CMP_ATTN_BWD: return nsa_cmp_attn_bwd_workspace_size(c, &p->cmp_b, bytes);
    case OP_SLC_ATTN_BWD: return nsa_slc_attn_bwd_workspace_size(c, &p->slc_b, bytes);
    case OP_SWA_BWD: return nsa_attention_bwd_workspace_size(c, &p->swa_b, bytes);
    case OP_BACKWARD: return nsa_backward_workspace_size(c, &p->bwd, bytes);
    case OP_DENSE_BWD: return nsa_attention_bwd_workspace_size(c, &p->dense_b, bytes);
    case OP_DECODE: return nsa_step_workspace_size(c, &p->step, bytes);
    case OP_COUNT: break;
    }
    return NSA_STATUS_BAD_ARGUMENT;
}

static nsa_status op_call(problem *p, op_id id)
{
    nsa_context *c = p->ctx;
    void *w = p->ws;
    const size_t n = p->ws_bytes;
    switch (id) {
    case OP_COMPRESS: {
        nsa_status st = nsa_compress(c, &p->ck, w, n);
        return st == NSA_STATUS_SUCCESS ? nsa_compress(c, &p->cv, w, n) : st;
    }
    case OP_CMP_ATTN: return nsa_cmp_attn(c, &p->cmp, w, n);
    case OP_SELECT: return nsa_select(c, &p->sel, w, n);
    case OP_SLC_ATTN: return nsa_slc_attn(c, &p->slc, w, n);
    case OP_SWA: return nsa_attention(c, &p->swa, w, n);
    case OP_GATE: return nsa_gate(c, &p->gate, w, n);
    case OP_FORWARD: return nsa_forward(c, &p->fwd, w, n);
    case OP_DENSE: return nsa_attention(c, &p->dense, w, n);
    case OP_CMP_ATTN_BWD: return nsa_cmp_attn_bwd(c, &p->cmp_b, w, n);
    case OP_SLC_ATTN_BWD: return nsa_slc_attn_bwd(c, &p->slc_b, w, n);
    case OP_SWA_BWD: return nsa_attention_bwd(c, &p->swa_b, w, n);
    case OP_BACKWARD: return nsa_backward(c, &p->bwd, w, n);
    case OP_DENSE_BWD: return nsa_attention_bwd(c, &p->dense_b, w, n);
    case OP_DECODE: return nsa_step(c, &p->step, w, n);
    case OP_COUNT: break;
    }
    return NSA_STATUS_BAD_ARGUMENT;
}

/* One run of an op, synchronised; @return its wall time in seconds. */
static double op_run(problem *p, op_id id)
{
    const double t0 = now_s();
    need(op_call(p, id), OPS[id].call);
    devmem_sync(p->backend);
    return now_s() - t0;
}

/* One workspace for every op: the largest of their size queries. */
static void alloc_workspace(problem *p)
{
    size_t most = 0;
    for (int id = 0; id < OP_COUNT; id++) {
        if (!op_enabled(p, (op_id)id)) continue;
        size_t b = 0;
        need(op_workspace(p, (op_id)id, &b), OPS[id].call);
        if (b > most) most = b;
    }
    p->ws_bytes = most;
    p->ws = most ? devmem_alloc(p->backend, most, "the workspace") : NULL;
}

static void problem_init(problem *p, const problem_opts *o)
{
    memset(p, 0, sizeof *p);
    p->backend = o->backend;
    p->B = 1, p->T = o->T, p->HQ = o->HQ, p->H = o->H, p->DK = o->DK, p->DV = o->DV;
    p->dtype = o->dtype;
    p->cfg = o->cfg;
    p->with_bwd = o->with_bwd;
    p->with_dense = o->with_dense;
    need(nsa_config_validate(&p->cfg), "the configuration");
    p->Nc = nsa_num_cmp_blocks(&p->cfg, p->T);
    p->n = p->cfg.slc_topk;
    nsa_context_desc d = {.backend = o->backend, .num_threads = o->threads};
    need(nsa_context_create(&p->ctx, &d), "creating the context");
    fill_inputs(p, o->seed);
    alloc_buffers(p);
    build_forward_calls(p);
    build_decode_call(p);
    if (p->with_bwd) build_backward_calls(p);
    alloc_workspace(p);
}

static void problem_free(problem *p)
{
    const nsa_backend be = p->backend;
    tbuf *all[] = {&p->q, &p->k, &p->v, &p->kc, &p->vc, &p->o, &p->idx, &p->od, &p->lsed, &p->dout, &p->dq,
                   &p->dk, &p->dv, &p->dkc, &p->dvc, &p->seqlens};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tbuf_free(all[i], be);
    for (int b = 0; b < NBRANCH; b++) {
        tbuf_free(&p->g[b], be), tbuf_free(&p->ob[b], be), tbuf_free(&p->lse[b], be), tbuf_free(&p->dg[b], be);
        free(p->hg[b]);
    }
    free(p->hq), free(p->hk), free(p->hv), free(p->hdout);
    if (p->ws) devmem_free(be, p->ws);
    nsa_context_destroy(p->ctx);
    memset(p, 0, sizeof *p);
}

/* ==== counting: keys read and FLOPs =================================================== */

/* Compressed blocks query t sees (spec 2: block i visible iff i*d + l - 1 <= t). */
static int64_t cmp_visible(const nsa_config *c, int64_t t, int64_t Nc)
{
    const int64_t v = t + 1 >= c->cmp_len ? (t + 1 - c->cmp_len) / c->cmp_stride + 1 : 0;
    return v < Nc ? v : Nc;
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Distinct key tokens s < below, s <= t, in the usable blocks of one selection row (spec 4:
 * -1 and out-of-range entries skipped, duplicates once). below = t + 1 counts all of them. */
static int64_t slc_row_tokens(const int32_t *row, int64_t m, int64_t t, int64_t T, int64_t lp, int64_t below)
{
    const int64_t nb = (T + lp - 1) / lp;
    int64_t tokens = 0;
    for (int64_t e = 0; e < m; e++) {
        const int64_t j = row[e];
        if (j < 0 || j >= nb) continue;
        int dup = 0;
        for (int64_t f = 0; f < e && !dup; f++) dup = row[f] == row[e];
        if (dup) continue;
        const int64_t lo = j * lp, hi = min64(min64((j + 1) * lp, t + 1), below);
        tokens += max64(0, hi - lo);
    }
    return tokens;
}

/* (query head, key) pairs each branch scores, summed over every query: the FLOP basis. */
typedef struct work {
    double cmp, slc, swa, dense;
} work;

/* idx NULL: the selection is not known yet, w.slc stays 0. */
static work count_work(const problem *p, const int32_t *idx)
{
    work w = {0, 0, 0, 0};
    const int64_t G = p->HQ / p->H;
    for (int64_t t = 0; t < p->T; t++) {
        w.cmp += (double)(cmp_visible(&p->cfg, t, p->Nc) * p->HQ);
        w.swa += (double)(min64(t + 1, p->cfg.window) * p->HQ);
        w.dense += (double)((t + 1) * p->HQ);
        for (int64_t h = 0; idx && h < p->H; h++)
            w.slc += (double)(slc_row_tokens(idx + (t * p->H + h) * p->n, p->n, t, p->T, p->cfg.slc_block, t + 1) * G);
    }
    const double B = (double)p->B;
    w.cmp *= B, w.slc *= B, w.swa *= B, w.dense *= B;
    return w;
}

/* FLOPs of one op. Attention: 2*DK + 2*DV per (query head, key) pair forward (QK^T and PV),
 * 2.5x that backward (recompute S, dP, dS K, dS^T Q, P^T dO: the FlashAttention-2 count).
 * Selection: the scores q.k_cmp it ranks, 2*DK per pair. Compression: l adds per output
 * element; gating: 5 per output element. nsa_forward/backward: the sum of their parts. */
static double op_flops(const problem *p, const work *w, op_id id)
{
    const double fa = (double)(2 * p->DK + 2 * p->DV), rows = (double)(p->B * p->T * p->HQ);
    const double compress = (double)(p->B * p->Nc * p->H * (p->DK + p->DV) * p->cfg.cmp_len);
    const double gate = 5.0 * rows * (double)p->DV;
    switch (id) {
    case OP_COMPRESS: return compress;
    case OP_CMP_ATTN: return w->cmp * fa;
    case OP_SELECT: return w->cmp * 2.0 * (double)p->DK;
    case OP_SLC_ATTN: return w->slc * fa;
    case OP_SWA: return w->swa * fa;
    case OP_GATE: return gate;
    case OP_FORWARD: return compress + (w->cmp + w->slc + w->swa) * fa + gate;
    case OP_DENSE: return w->dense * fa;
    case OP_CMP_ATTN_BWD: return 2.5 * w->cmp * fa;
    case OP_SLC_ATTN_BWD: return 2.5 * w->slc * fa;
    case OP_SWA_BWD: return 2.5 * w->swa * fa;
    case OP_BACKWARD: return compress + 2.5 * (w->cmp + w->slc + w->swa) * fa + 2.0 * gate;
    case OP_DENSE_BWD: return 2.5 * w->dense * fa;
    case OP_DECODE: { /* the last query's keys: visible compressed rows, n selected blocks, the window */
        const int64_t t = p->T - 1, nv = cmp_visible(&p->cfg, t, p->Nc);
        const double keys = (double)(nv + min64(p->n * p->cfg.slc_block, p->T) + min64(p->cfg.window, p->T));
        return (double)(p->B * p->HQ) * keys * fa;
    }
    case OP_COUNT: break;
    }
    return 0.0;
}

/* Keys a query reads, as a fraction of dense causal attention's t + 1: distinct tokens of
 * the selected blocks and the window, plus 1 per visible compressed block. Averaged over
 * the kv heads (selection is per kv head). */
static double keys_fraction(const problem *p, const int32_t *idx, int64_t t)
{
    const int64_t win_lo = max64(0, t - p->cfg.window + 1);
    double sum = 0.0;
    for (int64_t h = 0; h < p->H; h++) {
        const int64_t slc_outside_window = slc_row_tokens(idx + (t * p->H + h) * p->n, p->n, t, p->T, p->cfg.slc_block, win_lo);
        sum += (double)(slc_outside_window + (t + 1 - win_lo) + cmp_visible(&p->cfg, t, p->Nc));
    }
    return sum / (double)p->H / (double)(t + 1);
}

static int32_t *download_indices(const problem *p)
{
    int32_t *idx = (int32_t *)host_alloc(tbuf_bytes(NSA_DTYPE_I32, p->idx.n), "block_indices (host)");
    devmem_download(p->backend, idx, p->idx.mem, tbuf_bytes(NSA_DTYPE_I32, p->idx.n));
    return idx;
}

/* ==== command-line parsing ============================================================ */

/* The help of each command (`nsa <command> --help` prints its own; `nsa --help` all of them). */
static const char *HELP_DEMO =
    "  nsa demo  [--backend cpu|cuda] [--T N] [--HQ N] [--H N] [--reps N] [--threads N] [--seed N]\n"
    "            [--rows N] [--no-dense]\n"
    "      NSA forward + backward on random input, paper config, B=1, D=128 (CUDA: bf16, HQ=64,\n"
    "      H=4, T=65536, the median of 3 calls after a warm-up; CPU: f32, HQ=16, H=1, T=4096,\n"
    "      one call): time per branch, the whole forward and backward, dense causal attention\n"
    "      on the same input (CPU: its forward only) and NSA's speed-up over it, keys read per\n"
    "      query, and sampled rows against the float64 reference.\n";
static const char *HELP_CHECK =
    "  nsa check [--seed N] [--minutes M] [--cases N] [--backend cpu|cuda] [--threads N] [-v]\n"
    "            [--op NAME] [--hash-out FILE] [--hash-cmp FILE] [--variant KEY=VALUE]...\n"
    "            [--nonfinite]\n"
    "      random correctness sweep against the float64 reference (default 1 minute);\n"
    "      the last line is \"N passed, N failed\"; exit code 0 iff nothing failed.\n"
    "      --cases N (>= 1): exactly N cases (with --minutes too: whichever ends first).\n"
    "      --op: only that op's checks (nsa_forward, nsa_backward, nsa_attention,\n"
    "      nsa_slc_attn_bwd, ...: the names in the checks' messages). --hash-out: a hash of\n"
    "      every checked output per case, to FILE; --hash-cmp: the first cases whose hashes\n"
    "      differ from FILE's, then \"N identical, M differ\" (not a failure). --variant:\n"
    "      set in the environment before the context exists (e.g. NSA_CUDA_WGMMA=0).\n"
    "      --nonfinite: NaN / inf planted in each op's inputs; the non-finite outputs must\n"
    "      be exactly the reference's.\n";
static const char *HELP_BENCH =
    "  nsa bench [--T 8192,16384,32768] [--config paper|fla] [--HQ 16] [--H 1]\n"
    "            [--D 128 | --DK 128 --DV 128] [--dtype f32|bf16|f16] [--threads N]\n"
    "            [--backend cpu|cuda] [--reps N] [--no-dense] [--bwd] [--json FILE]\n"
    "            [--op LIST]\n"
    "      per-op and whole-NSA times (median of --reps runs after a warm-up, default 5),\n"
    "      GFLOP/s, and dense causal attention / NSA forward. --op times only the listed\n"
    "      ops (names as in the table, or the groups attention = window, dense and their\n"
    "      backwards, nsa = NSA's ops); what they read runs first, untimed. decode: one\n"
    "      inference step (nsa_step) of the last token against the T cached ones.\n"
    "  nsa bench --branches [--T 8192,16384,32768,65536] [--config paper|fla] [--HQ 64]\n"
    "            [--H 4] [--D 128 | --DK 128 --DV 128] [--dtype bf16|f16 | --f16] [--reps 10]\n"
    "            [--profile] [--backend cuda|cpu] [--threads N]\n"
    "      the whole NSA forward and backward, and each branch alone (the other gates\n"
    "      absent), every gate on: median ms of --reps calls after 2 warm-ups, by CUDA\n"
    "      events (the CPU: wall clock), one row per length. --profile runs one forward +\n"
    "      backward at the first length and stops (for ncu). The former nsa_gpu_bench.\n";
static const char *HELP_VERSION =
    "  nsa version      library version and the backends present\n";
static const char *HELP_FOOT =
    "\nSizes accept a k suffix (16k = 16384). Exit codes: 0 success, 1 failure, 2 bad usage.\n";

/* The whole help, or one command's (cmd: its name; NULL or unknown: every command). */
static void print_help(FILE *f, const char *cmd)
{
    static const struct { const char *name, **text; } cmds[] = {
        {"demo", &HELP_DEMO}, {"check", &HELP_CHECK}, {"bench", &HELP_BENCH}, {"version", &HELP_VERSION}};
    for (size_t c = 0; cmd && c < sizeof cmds / sizeof cmds[0]; c++)
        if (!strcmp(cmd, cmds[c].name)) {
            fprintf(f, "usage: nsa %s [options]\n\n%s%s", cmd, *cmds[c].text, HELP_FOOT);
            return;
        }
    fprintf(f, "usage: nsa <command> [options]\n\n%s%s%s%s  nsa --help       this text; nsa <command> --help: that command's\n%s",
            HELP_DEMO, HELP_CHECK, HELP_BENCH, HELP_VERSION, HELP_FOOT);
}

static void usage_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "nsa: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n\n");
    print_help(stderr, NULL);
    va_end(ap);
    exit(2);
}

/* Walks argv[first..]: `--name value` and `--name=value` both work. */
typedef struct args {
    int argc, i;
    char **argv;
    const char *value;
} args;

static int arg_is(args *a, const char *name)
{
    return !strcmp(a->argv[a->i], name);
}

/* @return nonzero when the current argument is option `name`; a->value is its value. */
static int arg_opt(args *a, const char *name)
{
    const char *s = a->argv[a->i];
    const size_t n = strlen(name);
    if (strncmp(s, name, n) != 0) return 0;
    if (s[n] == '=') {
        a->value = s + n + 1;
        return 1;
    }
    if (s[n] != '\0') return 0;
    if (a->i + 1 >= a->argc) usage_error("option %s needs a value", name);
    a->value = a->argv[++a->i];
    return 1;
}

static int64_t parse_int(const char *s, const char *name, int64_t lo, int64_t hi)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end != s && (*end == 'k' || *end == 'K') && v <= INT64_MAX / 1024) v *= 1024, end++;
    if (errno || end == s || *end != '\0' || v < lo || v > hi)
        usage_error("%s: expected an integer in [%lld, %lld], got '%s'", name, (long long)lo, (long long)hi, s);
    return v;
}

/* A seed: any 64-bit value, so that a case seed the sweep prints can be given back. */
static uint64_t parse_seed(const char *s)
{
    char *end = NULL;
    errno = 0;
    const unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end != '\0' || *s == '-') usage_error("--seed: expected an integer in [0, 2^64), got '%s'", s);
    return (uint64_t)v;
}

static double parse_double(const char *s, const char *name, double lo, double hi)
{
    char *end = NULL;
    errno = 0;
    const double v = strtod(s, &end);
    if (errno || end == s || *end != '\0' || !(v >= lo && v <= hi)) usage_error("%s: expected a number in [%g, %g], got '%s'", name, lo, hi, s);
    return v;
}

static nsa_backend parse_backend(const char *s)
{
    if (!strcmp(s, "cpu")) return NSA_BACKEND_CPU;
    if (!strcmp(s, "cuda")) return NSA_BACKEND_CUDA;
    usage_error("--backend: expected cpu or cuda, got '%s'", s);
    return NSA_BACKEND_CPU;
}

static nsa_dtype parse_dtype(const char *s)
{
    if (!strcmp(s, "f32")) return NSA_DTYPE_F32;
    if (!strcmp(s, "bf16")) return NSA_DTYPE_BF16;
    if (!strcmp(s, "f16")) return NSA_DTYPE_F16;
    usage_error("--dtype: expected f32, bf16 or f16, got '%s'", s);
    return NSA_DTYPE_F32;
}

/* The best backend present: CUDA when it is compiled in and sees a device. */
static nsa_backend best_backend(void) { return nsa_backend_available(NSA_BACKEND_CUDA) ? NSA_BACKEND_CUDA : NSA_BACKEND_CPU; }

/* A named backend that is absent is an error, not a silent fallback. */
static void require_backend(nsa_backend be)
{
    if (nsa_backend_available(be)) return;
    /* a context creation says why (not compiled in, or no device) */
    nsa_context *ctx = NULL;
    nsa_context_desc d = {.backend = be};
    const nsa_status st = nsa_context_create(&ctx, &d);
    nsa_context_destroy(ctx);
    need(st != NSA_STATUS_SUCCESS ? st : NSA_STATUS_BACKEND_UNAVAILABLE, backend_name(be));
}

/* The CPU's own precision is f32; the GPU's fast path is bf16 (its f32 path is the slow scalar kernels). */
static nsa_dtype default_dtype(nsa_backend be) { return be == NSA_BACKEND_CUDA ? NSA_DTYPE_BF16 : NSA_DTYPE_F32; }

static int threads_used(int requested)
{
#ifdef _OPENMP
    return requested > 0 ? requested : omp_get_max_threads();
#else
    (void)requested;
    return 1;
#endif
}

/* "cpu (2 threads)" or "cuda (device 0)": threads only matter to the CPU backend. */
static const char *backend_desc(nsa_backend be, int threads)
{
    static char buf[64];
    if (be == NSA_BACKEND_CUDA) snprintf(buf, sizeof buf, "cuda (device 0)");
    else snprintf(buf, sizeof buf, "cpu (%d threads)", threads_used(threads));
    return buf;
}

static void print_config(const problem *p)
{
    const nsa_config *c = &p->cfg;
    printf("  config  l=%lld d=%lld l'=%lld n=%lld (init %lld, local %lld) w=%lld\n", (long long)c->cmp_len,
           (long long)c->cmp_stride, (long long)c->slc_block, (long long)c->slc_topk, (long long)c->n_init,
           (long long)c->n_local, (long long)c->window);
    printf("  shape   B=%lld T=%lld HQ=%lld H=%lld DK=%lld DV=%lld %s\n", (long long)p->B, (long long)p->T,
           (long long)p->HQ, (long long)p->H, (long long)p->DK, (long long)p->DV, nsa_dtype_name(p->dtype));
}

/* ==== nsa demo ======================================================================== */

/* Max |o - ref| over nrows rows spread over T (first and last included), and max |ref|
 * there. The reference gets the backend's own selection, so this checks the attention math,
 * not near-tie ranking. */
static void demo_accuracy(const problem *p, const int32_t *idx, int64_t nrows, double *max_err, double *max_ref)
{
    const int64_t nq = p->T * p->HQ * p->DK, nk = p->T * p->H * p->DK, nv = p->T * p->H * p->DV, nr = p->T * p->HQ;
    /* q and o only at the sampled rows (the reference reads q[t] of the row it computes, K/V
     * everywhere): calloc'd pages that are never touched cost nothing, which keeps the check
     * to seconds at 1M tokens, where a full double copy of q is 17 GB */
    double *q = (double *)calloc((size_t)nq, sizeof(double));
    if (!q) fail("out of host memory allocating the reference q");
    double *k = (double *)host_alloc((size_t)nk * sizeof(double), "reference k");
    double *v = (double *)host_alloc((size_t)nv * sizeof(double), "reference v");
    double *g[NBRANCH];
    for (int64_t i = 0; i < nk; i++) k[i] = p->hk[i];
    for (int64_t i = 0; i < nv; i++) v[i] = p->hv[i];
    for (int b = 0; b < NBRANCH; b++) {
        g[b] = (double *)host_alloc((size_t)nr * sizeof(double), "reference gates");
        for (int64_t i = 0; i < nr; i++) g[b][i] = p->hg[b][i];
    }
    if (nrows > p->T) nrows = p->T;
    int64_t *rows = (int64_t *)host_alloc((size_t)nrows * sizeof(int64_t), "sampled rows");
    for (int64_t r = 0; r < nrows; r++) rows[r] = nrows > 1 ? (p->T - 1) * r / (nrows - 1) : p->T - 1;
    const int64_t qrow = p->HQ * p->DK;
    for (int64_t r = 0; r < nrows; r++)
        for (int64_t i = 0; i < qrow; i++) q[rows[r] * qrow + i] = p->hq[rows[r] * qrow + i];
    const ref_nsa_inputs in = {.q = q, .k = k, .v = v, .g_cmp = g[BR_CMP], .g_slc = g[BR_SLC], .g_swa = g[BR_SWA],
                               .block_indices = idx, .m = p->n};
    const ref_dims dims = {p->T, p->HQ, p->H, p->DK, p->DV};
    const double scale = p->cfg.scale > 0 ? p->cfg.scale : 1.0 / sqrt((double)p->DK);
    const int64_t row_len = p->HQ * p->DV;
    double *want = (double *)host_alloc((size_t)(nrows * row_len) * sizeof(double), "reference rows");
    ref_nsa_forward_rows(&p->cfg, scale, dims, &in, rows, nrows, want);
    float *o = (float *)host_alloc((size_t)(nrows * row_len) * sizeof(float), "o rows (host)");
    for (int64_t r = 0; r < nrows; r++) tbuf_range_to_host_f32(&p->o, p->backend, rows[r] * row_len, row_len, o + r * row_len);
    *max_err = 0.0, *max_ref = 0.0;
    for (int64_t r = 0; r < nrows; r++)
        for (int64_t e = 0; e < row_len; e++) {
            const double got = o[r * row_len + e], ref = want[r * row_len + e];
            const double err = fabs(got - ref);
            if (!(err <= *max_err)) *max_err = err; /* NaN sticks */
            if (fabs(ref) > *max_ref) *max_ref = fabs(ref);
        }
    free(o), free(want), free(q), free(k), free(v), free(rows);
    for (int b = 0; b < NBRANCH; b++) free(g[b]);
}

/* The error a correct kernel stays under, relative to max |o|: fp32 accumulation for f32;
 * for 16-bit storage, the rounding of the branch outputs and of o itself. */
static double demo_tolerance(nsa_dtype dt)
{
    return dt == NSA_DTYPE_BF16 ? 2e-2 : dt == NSA_DTYPE_F16 ? 4e-3 : 1e-4;
}

/* An op's time: `warm` untimed calls (first-call costs: module loading, planning, caches),
 * then the median of `reps` timed ones. */
static double op_time(problem *p, op_id id, int warm, int reps)
{
    double t[16];
    if (reps > 16) reps = 16;
    for (int i = 0; i < warm; i++) op_run(p, id);
    for (int i = 0; i < reps; i++) t[i] = op_run(p, id);
    for (int i = 1; i < reps; i++) /* insertion sort: a handful of values */
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            const double x = t[j];
            t[j] = t[j - 1], t[j - 1] = x;
        }
    return t[reps / 2];
}

static int cmd_demo(int argc, char **argv)
{
    problem_opts o = {.backend = best_backend(), .T = 0, .HQ = 0, .H = 0, .DK = 128, .DV = 128,
                      .cfg = nsa_config_default(), .with_bwd = 1, .with_dense = 1, .seed = 1};
    int named_backend = 0, reps = 0;
    int64_t nrows = 16;
    args a = {argc, 2, argv, NULL};
    for (; a.i < argc; a.i++) {
        if (arg_opt(&a, "--backend")) o.backend = parse_backend(a.value), named_backend = 1;
        else if (arg_opt(&a, "--T")) o.T = parse_int(a.value, "--T", 1, INT32_MAX);
        else if (arg_opt(&a, "--HQ")) o.HQ = parse_int(a.value, "--HQ", 1, 1 << 16);
        else if (arg_opt(&a, "--H")) o.H = parse_int(a.value, "--H", 1, 1 << 16);
        else if (arg_opt(&a, "--reps")) reps = (int)parse_int(a.value, "--reps", 1, 16);
        else if (arg_opt(&a, "--rows")) nrows = parse_int(a.value, "--rows", 1, 1 << 20);
        else if (arg_is(&a, "--no-dense")) o.with_dense = 0;
        else if (arg_opt(&a, "--threads")) o.threads = (int)parse_int(a.value, "--threads", 0, 4096);
        else if (arg_opt(&a, "--seed")) o.seed = parse_seed(a.value);
        else usage_error("demo: unknown option '%s'", argv[a.i]);
    }
    if (named_backend) require_backend(o.backend);
    o.dtype = default_dtype(o.backend);
    /* The first impression: on a GPU the paper's heads at a length where NSA pays (64k tokens:
     * ~15 GB), timed after a warm-up; on the CPU 16 heads at 4k, one timed call each (no
     * first-call costs to speak of): 44 s on 2 cores (8k took 112 s; 4 heads at 8k show less of
     * NSA's advantage, as the selected branch shares its blocks among fewer heads). */
    const int gpu = o.backend == NSA_BACKEND_CUDA;
    if (!o.T) o.T = gpu ? 65536 : 4096;
    if (!o.HQ) o.HQ = gpu ? 64 : 16;
    if (!o.H) o.H = o.HQ % 4 == 0 && gpu ? 4 : 1;
    if (o.HQ % o.H) usage_error("demo: --HQ %lld is not a multiple of --H %lld", (long long)o.HQ, (long long)o.H);
    const int warm = gpu ? 1 : 0;
    if (!reps) reps = gpu ? 3 : 1;

    problem p;
    problem_init(&p, &o);
    printf("nsa demo: NSA forward + backward, backend %s, library %s\n", backend_desc(p.backend, o.threads),
           nsa_version_string());
    print_config(&p);
    printf("  times: median of %d call%s%s\n", reps, reps > 1 ? "s" : "", warm ? " after a warm-up call" : "");
    fflush(stdout);

    /* The branch ops one by one, in pipeline order (each reads the previous ones' outputs). */
    static const struct { op_id id; const char *branch; } steps[] = {
        {OP_COMPRESS, "compression"},   {OP_CMP_ATTN, "compressed attention"}, {OP_SELECT, "  + selection"},
        {OP_SLC_ATTN, "selected attention"}, {OP_SWA, "sliding window"},   {OP_GATE, "gating"},
    };
    double sum = 0.0;
    printf("\n  %-22s %-36s %10s\n", "forward, by branch", "call", "ms");
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
        const double t = op_time(&p, steps[i].id, warm, reps);
        sum += t;
        printf("  %-22s %-36s %10.2f\n", steps[i].branch, OPS[steps[i].id].call, 1e3 * t);
        fflush(stdout);
    }
    printf("  %-22s %-36s %10.2f\n", "sum of the ops", "", 1e3 * sum);
    const double fwd = op_time(&p, OP_FORWARD, warm, reps);
    printf("\n  %-22s %-36s %10.2f\n", "NSA forward", OPS[OP_FORWARD].call, 1e3 * fwd);
    fflush(stdout);
    const double bwd = op_time(&p, OP_BACKWARD, warm, reps);
    printf("  %-22s %-36s %10.2f\n", "NSA backward", OPS[OP_BACKWARD].call, 1e3 * bwd);
    fflush(stdout);
    if (o.with_dense) {
        const double dense = op_time(&p, OP_DENSE, warm, reps);
        printf("  %-22s %-36s %10.2f\n", "dense causal forward", OPS[OP_DENSE].call, 1e3 * dense);
        fflush(stdout);
        if (gpu) { /* (the CPU's dense backward at 8k would take minutes) */
            const double dense_b = op_time(&p, OP_DENSE_BWD, warm, reps);
            printf("  %-22s %-36s %10.2f\n", "dense causal backward", OPS[OP_DENSE_BWD].call, 1e3 * dense_b);
            printf("\n  speed-up of NSA over dense causal attention at T = %lld: forward %.2fx, backward %.2fx,\n"
                   "    forward + backward %.2fx\n",
                   (long long)p.T, dense / fwd, dense_b / bwd, (dense + dense_b) / (fwd + bwd));
        } else {
            printf("\n  speed-up of the NSA forward over dense causal attention at T = %lld: %.2fx\n", (long long)p.T,
                   dense / fwd);
        }
    }

    int32_t *idx = download_indices(&p);
    double mean = 0.0;
    for (int64_t t = 0; t < p.T; t++) mean += keys_fraction(&p, idx, t);
    mean /= (double)p.T;
    printf("\n  keys read per query / (t+1) of dense causal (selected + window tokens, 1 per compressed block):\n");
    printf("    mean over queries %.4f, last query (t=%lld) %.4f\n", mean, (long long)(p.T - 1),
           keys_fraction(&p, idx, p.T - 1));

    double err = 0.0, mx = 0.0;
    demo_accuracy(&p, idx, nrows, &err, &mx);
    const double rel = mx > 0 ? err / mx : err, tol = demo_tolerance(p.dtype);
    const int ok = rel <= tol;
    printf("\n  accuracy: %lld rows vs the float64 reference (backend's selection): max |o - ref| = %.3g,\n",
           (long long)(nrows < p.T ? nrows : p.T), err);
    printf("    %.3g of max |o| = %.3g (tolerance %.0e): %s\n", rel, mx, tol, ok ? "ok" : "TOO LARGE");
    free(idx);
    problem_free(&p);
    return ok ? 0 : 1;
}

/* ==== nsa check ======================================================================= */

static int cmd_check(int argc, char **argv)
{
    sweep_opts o = {.seed = (uint64_t)time(NULL), .minutes = 1.0, .backend = best_backend(), .verbose = 1, .label = "check"};
    int named_backend = 0, named_minutes = 0;
    const char *hash_out = NULL, *hash_cmp = NULL;
    args a = {argc, 2, argv, NULL};
    for (; a.i < argc; a.i++) {
        if (arg_opt(&a, "--seed")) o.seed = parse_seed(a.value);
        else if (arg_opt(&a, "--op")) {
            if (sweep_set_op(a.value) != 0) {
                char names[400] = "";
                for (int i = 0; sweep_op_names[i]; i++) strcat(strcat(names, i ? ", " : ""), sweep_op_names[i]);
                usage_error("check --op: unknown op '%s' (ops: %s)", a.value, names);
            }
            o.op = a.value;
        }
        else if (arg_opt(&a, "--hash-out")) hash_out = a.value;
        else if (arg_opt(&a, "--hash-cmp")) hash_cmp = a.value;
        else if (arg_opt(&a, "--variant")) {
            if (variant_set(a.value) != 0) usage_error("--variant: expected KEY=VALUE, got '%s'", a.value);
        }
        else if (arg_is(&a, "--nonfinite")) o.nonfinite = 1;
        else if (arg_opt(&a, "--minutes")) o.minutes = parse_double(a.value, "--minutes", 0.0, 1e6), named_minutes = 1;
        else if (arg_opt(&a, "--cases")) o.max_cases = (long)parse_int(a.value, "--cases", 1, INT32_MAX);
        else if (arg_opt(&a, "--backend")) o.backend = parse_backend(a.value), named_backend = 1;
        else if (arg_opt(&a, "--threads")) o.threads = (int)parse_int(a.value, "--threads", 0, 4096);
        else if (arg_is(&a, "-v")) o.verbose = 2;
        else usage_error("check: unknown option '%s'", argv[a.i]);
    }
    if (named_backend) require_backend(o.backend);
    /* --cases alone means exactly that many cases, however long they take */
    if (o.max_cases > 0 && !named_minutes) o.minutes = 0.0;
    if (o.max_cases == 0 && o.minutes <= 0.0) usage_error("check: --minutes 0 needs --cases N");
    g_tests_verbose = o.verbose > 1;
    printf("nsa check: backend %s, seed %llu, ", backend_name(o.backend), (unsigned long long)o.seed);
    if (o.max_cases) printf("%ld cases%s", o.max_cases, o.minutes > 0 ? " or " : "");
    if (o.minutes > 0) printf("%g minutes", o.minutes);
    printf(" (reproduce with --seed %llu)\n", (unsigned long long)o.seed);
    char variants[1024];
    variant_describe(variants, sizeof variants);
    if (o.op || strcmp(variants, "none")) printf("  op %s; variants: %s\n", o.op ? o.op : "all", variants);
    if (o.nonfinite) printf("  non-finite mode: NaN / inf planted in each op's inputs\n");
    fflush(stdout);
    hashlog *base = NULL;
    if (hash_cmp && !(base = hashlog_read(hash_cmp))) fail("cannot read %s: %s", hash_cmp, strerror(errno));
    if (hash_out || hash_cmp) o.hashes = hashlog_new();
    g_check_running = 1;
    sweep_run(&o);
    if (hash_out && hashlog_write(o.hashes, hash_out) != 0) fail("cannot write %s: %s", hash_out, strerror(errno));
    if (hash_cmp) hashlog_compare(o.hashes, base, stdout, 10);
    g_check_running = 0;
    hashlog_free(o.hashes);
    hashlog_free(base);
    printf("%ld passed, %ld failed\n", g_tests_passed, g_tests_failed);
    return g_tests_failed == 0 ? 0 : 1;
}

/* ==== nsa bench ======================================================================= */

enum { MAX_LENGTHS = 32 };
/* A warm-up this long is itself a fair measurement (cold caches are noise next to it) and
 * counts as the first run; without an explicit --reps, repeats stop after BUDGET_S. */
static const double LONG_RUN_S = 2.0, BUDGET_S = 20.0;

typedef struct bench_opts {
    problem_opts prob;
    const char *config_name;
    int64_t lengths[MAX_LENGTHS];
    int nlengths;
    int reps, reps_given;
    const char *json;
    unsigned ops; /* --op: the ops to time (0: every enabled op) */
} bench_opts;

typedef struct measurement {
    op_id id;
    double ms, gflops;
    double cpu_util;  /* CPU time / (wall time * threads): well below 1 = cores shared or idle; CPU backend only */
    int runs;
} measurement;

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static measurement measure(problem *p, op_id id, const bench_opts *o)
{
    double s[64];
    int runs = 0;
    const int reps = o->reps < 64 ? o->reps : 64;
    const double w0 = now_s(), c0 = cpu_s();
    const double warm = op_run(p, id), t0 = now_s();
    if (warm >= LONG_RUN_S) s[runs++] = warm;
    while (runs < reps && (o->reps_given || runs == 0 || now_s() - t0 < BUDGET_S)) s[runs++] = op_run(p, id);
    const double util = p->backend == NSA_BACKEND_CPU ? (cpu_s() - c0) / ((now_s() - w0) * threads_used(o->prob.threads)) : -1.0;
    qsort(s, (size_t)runs, sizeof s[0], cmp_double);
    const double med = runs % 2 ? s[runs / 2] : 0.5 * (s[runs / 2 - 1] + s[runs / 2]);
    measurement m = {id, 1e3 * med, 0.0, util, runs};
    return m;
}

static void parse_lengths(bench_opts *o, const char *s)
{
    o->nlengths = 0;
    char buf[512];
    if (strlen(s) >= sizeof buf) usage_error("--T: list too long");
    strcpy(buf, s);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        if (o->nlengths == MAX_LENGTHS) usage_error("--T: at most %d lengths", MAX_LENGTHS);
        o->lengths[o->nlengths++] = parse_int(tok, "--T", 1, INT32_MAX);
    }
    if (o->nlengths == 0) usage_error("--T: no length given");
}

/* "window,dense_bwd", "attention", "nsa": a mask of op ids */
static unsigned parse_ops(const char *list)
{
    unsigned mask = 0;
    char buf[512];
    if (strlen(list) >= sizeof buf) usage_error("--op: list too long");
    strcpy(buf, list);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        if (!strcmp(tok, "attention")) {
            mask |= OPS_ATTENTION;
            continue;
        }
        if (!strcmp(tok, "nsa")) {
            mask |= OPS_NSA;
            continue;
        }
        int found = 0;
        for (int id = 0; id < OP_COUNT; id++)
            if (!strcmp(tok, OPS[id].name)) mask |= OPBIT(id), found = 1;
        if (!found) usage_error("--op: unknown op '%s' (ops: the names of the bench table, attention, nsa)", tok);
    }
    return mask;
}

static void parse_bench(bench_opts *o, int argc, char **argv)
{
    int named_backend = 0, named_dtype = 0;
    args a = {argc, 2, argv, NULL};
    for (; a.i < argc; a.i++) {
        if (arg_opt(&a, "--T")) parse_lengths(o, a.value);
        else if (arg_opt(&a, "--config")) {
            o->config_name = a.value;
            if (!strcmp(a.value, "fla")) o->prob.cfg.cmp_len = o->prob.cfg.cmp_stride = o->prob.cfg.slc_block = 64;
            else if (!strcmp(a.value, "paper")) o->prob.cfg = nsa_config_default();
            else usage_error("--config: expected paper or fla, got '%s'", a.value);
        }
        else if (arg_opt(&a, "--HQ")) o->prob.HQ = parse_int(a.value, "--HQ", 1, 4096);
        else if (arg_opt(&a, "--H")) o->prob.H = parse_int(a.value, "--H", 1, 4096);
        else if (arg_opt(&a, "--D")) o->prob.DK = o->prob.DV = parse_int(a.value, "--D", 1, 4096);
        else if (arg_opt(&a, "--DK")) o->prob.DK = parse_int(a.value, "--DK", 1, 4096);
        else if (arg_opt(&a, "--DV")) o->prob.DV = parse_int(a.value, "--DV", 1, 4096);
        else if (arg_opt(&a, "--dtype")) o->prob.dtype = parse_dtype(a.value), named_dtype = 1;
        else if (arg_opt(&a, "--threads")) o->prob.threads = (int)parse_int(a.value, "--threads", 0, 4096);
        else if (arg_opt(&a, "--backend")) o->prob.backend = parse_backend(a.value), named_backend = 1;
        else if (arg_opt(&a, "--reps")) o->reps = (int)parse_int(a.value, "--reps", 1, 64), o->reps_given = 1;
        else if (arg_opt(&a, "--json")) o->json = a.value;
        else if (arg_opt(&a, "--seed")) o->prob.seed = parse_seed(a.value);
        else if (arg_is(&a, "--no-dense")) o->prob.with_dense = 0;
        else if (arg_is(&a, "--bwd")) o->prob.with_bwd = 1;
        else if (arg_opt(&a, "--op")) o->ops |= parse_ops(a.value);
        else usage_error("bench: unknown option '%s'", argv[a.i]);
    }
    /* asked-for backward or dense ops switch their families on */
    for (int id = 0; id < OP_COUNT; id++)
        if (o->ops & OPBIT(id)) {
            if (OPS[id].bwd) o->prob.with_bwd = 1;
            if (OPS[id].dense) o->prob.with_dense = 1;
        }
    if (o->prob.HQ % o->prob.H != 0) usage_error("--HQ must be a multiple of --H");
    if (named_backend) require_backend(o->prob.backend);
    if (!named_dtype) o->prob.dtype = default_dtype(o->prob.backend);
}

static void json_row(FILE *f, int *first, const bench_opts *o, const problem *p, const measurement *m)
{
    const int cpu = p->backend == NSA_BACKEND_CPU;
    fprintf(f, "%s\n  {\"impl\":\"%s\",\"backend\":\"%s\",\"config\":\"%s\",\"T\":%lld,\"pass\":\"%s\",\"op\":\"%s\","
               "\"ms\":%.4f,\"gflops\":%.3f,\"runs\":%d,\"HQ\":%lld,\"H\":%lld,\"DK\":%lld,\"DV\":%lld,\"dtype\":\"%s\"",
            *first ? "" : ",", OPS[m->id].dense ? "dense" : "nsa", backend_name(p->backend), o->config_name,
            (long long)p->T, OPS[m->id].bwd ? "bwd" : "fwd", OPS[m->id].name, m->ms, m->gflops, m->runs,
            (long long)p->HQ, (long long)p->H, (long long)p->DK, (long long)p->DV, nsa_dtype_name(p->dtype));
    if (cpu) fprintf(f, ",\"threads\":%d,\"cpu_util\":%.3f", threads_used(o->prob.threads), m->cpu_util);
    fprintf(f, "}");
    *first = 0;
}

/* Every op at one length, in pipeline order; rows appear as they are measured. */
static void bench_length(const bench_opts *o, int64_t T, FILE *json, int *first, double *fwd_ms, double *dense_ms)
{
    problem_opts po = o->prob;
    po.T = T;
    fprintf(stderr, "bench: T=%lld: building the problem...\n", (long long)T);
    problem p;
    problem_init(&p, &po);
    work w = count_work(&p, NULL);
    *fwd_ms = *dense_ms = 0.0;
    /* timed: the --op ops (else all enabled); run untimed first: what they read */
    unsigned timed = 0, needed = 0;
    for (int id = 0; id < OP_COUNT; id++)
        if (op_enabled(&p, (op_id)id) && (!o->ops || (o->ops & OPBIT(id)))) timed |= OPBIT(id), needed |= OP_NEEDS[id];
    for (int id = 0; id < OP_COUNT; id++) {
        if (!(timed & OPBIT(id)) && (needed & OPBIT(id))) {
            fprintf(stderr, "bench: T=%lld: %s (input of a timed op, untimed) ...\n", (long long)T, OPS[id].call);
            op_run(&p, (op_id)id);
            if (id == OP_SELECT) {
                int32_t *idx = download_indices(&p);
                w = count_work(&p, idx);
                free(idx);
            }
        }
        if (!(timed & OPBIT(id))) continue;
        fprintf(stderr, "bench: T=%lld: %s ...\n", (long long)T, OPS[id].call);
        measurement m = measure(&p, (op_id)id, o);
        if (id == OP_SELECT) { /* the selection fixes the selected branch's work (op order matters) */
            int32_t *idx = download_indices(&p);
            w = count_work(&p, idx);
            free(idx);
        }
        m.gflops = op_flops(&p, &w, m.id) / (m.ms * 1e6);
        if (id == OP_FORWARD) *fwd_ms = m.ms;
        if (id == OP_DENSE) *dense_ms = m.ms;
        printf("%8lld  %-4s %-14s %12.2f %10.2f %5d", (long long)T, OPS[id].bwd ? "bwd" : "fwd", OPS[id].name, m.ms,
               m.gflops, m.runs);
        if (m.cpu_util >= 0) printf(" %5.0f", 100.0 * m.cpu_util);
        printf("\n");
        fflush(stdout);
        if (json) json_row(json, first, o, &p, &m);
    }
    problem_free(&p);
}

/* Other processes on the machine skew every timing: say how busy it was. */
static void print_loadavg(const char *when)
{
    char buf[128] = "";
    FILE *f = fopen("/proc/loadavg", "r");
    if (f && fgets(buf, sizeof buf, f)) {
        buf[strcspn(buf, "\n")] = 0;
        printf("%s: %s\n", when, buf);
    }
    if (f) fclose(f);
}

/* ==== nsa bench --branches ============================================================
 * The whole NSA forward and backward, and each branch alone (the other gates absent; the
 * selected branch alone reads the full forward's selection as caller indices), every branch
 * gated on, the default mean-pooled compression. Per length: the median of --reps timed
 * calls after 2 warm-ups, by CUDA events on the GPU (the wall clock on the CPU). Inputs are
 * random, never zeros. The output is the former build/nsa_gpu_bench's, line for line: the
 * scripts under scripts/ and the logs under bench/results read it. */

typedef struct branches_opts {
    nsa_backend backend;
    int threads;
    int64_t lengths[MAX_LENGTHS];
    int nlengths;
    int64_t HQ, H, DK, DV;
    nsa_dtype dtype;
    int fla, reps, profile;
} branches_opts;

/* A pool of random values (normal * scale + shift) tiled with shifting offsets into n
 * elements of 16-bit storage: cheap to make, never zero, and no two rows of a tensor alike. */
static void *branches_random(nsa_backend be, int64_t n, float scale, float shift, nsa_dtype dt, uint64_t seed)
{
    const int64_t pool_n = 1 << 22;
    uint16_t *pool = (uint16_t *)host_alloc((size_t)pool_n * 2, "random pool");
    uint16_t *host = (uint16_t *)host_alloc((size_t)(n > 0 ? n : 1) * 2, "random input");
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < pool_n; i++) {
        float acc = 0; /* Irwin-Hall: sum of 4 uniforms, centred: ~normal */
        for (int k = 0; k < 4; k++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            acc += (float)(s >> 40) * (1.0f / 16777216.0f);
        }
        const float x = (acc - 2.0f) * 1.7320508f * scale + shift;
        pool[i] = dt == NSA_DTYPE_BF16 ? nsa_f32_to_bf16(x) : nsa_f32_to_f16(x);
    }
    for (int64_t i = 0; i < n;) {
        const int64_t off = (i * 7919 + 13) % (pool_n / 2), m = n - i < pool_n / 2 ? n - i : pool_n / 2;
        memcpy(host + i, pool + off, (size_t)m * 2);
        i += m;
    }
    void *d = devmem_alloc(be, (size_t)(n > 0 ? n : 1) * 2, "a random input");
    devmem_upload(be, d, host, (size_t)n * 2);
    free(pool);
    free(host);
    return d;
}

static void *branches_zeros(nsa_backend be, size_t bytes)
{
    void *d = devmem_alloc(be, bytes ? bytes : 1, "an output");
    devmem_zero(be, d, bytes ? bytes : 1);
    return d;
}

static nsa_status branches_call(nsa_context *c, int bwd, const void *a, void *w, size_t n)
{
    return bwd ? nsa_backward(c, (const nsa_backward_args *)a, w, n) : nsa_forward(c, (const nsa_forward_args *)a, w, n);
}

/* Median ms of reps calls, after 2 warm-ups: CUDA events on the GPU, the wall clock on the CPU. */
static double branches_time_ms(nsa_context *ctx, nsa_backend be, int bwd, const void *args, void *ws, size_t wsb, int reps)
{
    for (int i = 0; i < 2; i++) need(branches_call(ctx, bwd, args, ws, wsb), "warm-up call");
    devmem_sync(be);
    double t[64];
    if (reps > 64) reps = 64;
#ifdef NSA_WITH_CUDA
    if (be == NSA_BACKEND_CUDA) {
        cudaEvent_t e0, e1;
        if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess) fail("cannot create CUDA events");
        for (int i = 0; i < reps; i++) {
            cudaEventRecord(e0, 0);
            need(branches_call(ctx, bwd, args, ws, wsb), "timed call");
            cudaEventRecord(e1, 0);
            float ms = 0.0f;
            if (cudaEventSynchronize(e1) != cudaSuccess || cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess)
                fail("the device reported an error during a timed call");
            t[i] = ms;
        }
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
    }
#endif
    if (be != NSA_BACKEND_CUDA)
        for (int i = 0; i < reps; i++) {
            const double t0 = now_s();
            need(branches_call(ctx, bwd, args, ws, wsb), "timed call");
            t[i] = 1e3 * (now_s() - t0);
        }
    qsort(t, (size_t)reps, sizeof t[0], cmp_double);
    return t[reps / 2];
}

/* "NVIDIA H100 80GB HBM3 (132 SMs)" on the GPU, "cpu (N threads)" on the CPU. */
static void branches_device(nsa_backend be, int threads, char *buf, size_t n)
{
#ifdef NSA_WITH_CUDA
    struct cudaDeviceProp prop;
    if (be == NSA_BACKEND_CUDA) {
        if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) fail("cannot read the device properties");
        snprintf(buf, n, "%s (%d SMs)", prop.name, prop.multiProcessorCount);
        return;
    }
#endif
    (void)be;
    snprintf(buf, n, "cpu (%d threads)", threads_used(threads));
}

/* One length: every buffer, the full calls and the branch-alone ones, then the timings. @return
 * 0, or 1 after --profile's single forward + backward. */
static int branches_length(const branches_opts *o, nsa_context *ctx, const nsa_config *cfg, int64_t T)
{
    const nsa_backend be = o->backend;
    const nsa_dtype dt = o->dtype;
    const int64_t HQ = o->HQ, H = o->H, DK = o->DK, DV = o->DV, n = cfg->slc_topk;
    void *q = branches_random(be, T * HQ * DK, 1.0f, 0.0f, dt, 1), *k = branches_random(be, T * H * DK, 1.0f, 0.0f, dt, 2);
    void *v = branches_random(be, T * H * DV, 1.0f, 0.0f, dt, 3), *dout = branches_random(be, T * HQ * DV, 1.0f, 0.0f, dt, 4);
    void *gt[3], *so[3], *sl[3], *dg[3];
    for (int x = 0; x < 3; x++) gt[x] = branches_random(be, T * HQ, 0.2f, 0.5f, dt, 5 + (uint64_t)x);
    for (int x = 0; x < 3; x++) {
        so[x] = branches_zeros(be, (size_t)(T * HQ * DV) * 2);
        sl[x] = branches_zeros(be, (size_t)(T * HQ) * 4);
        dg[x] = branches_zeros(be, (size_t)(T * HQ) * 2);
    }
    void *idx = branches_zeros(be, (size_t)(T * H * n) * 4), *out = branches_zeros(be, (size_t)(T * HQ * DV) * 2);
    void *dq = branches_zeros(be, (size_t)(T * HQ * DK) * 2), *dk = branches_zeros(be, (size_t)(T * H * DK) * 2);
    void *dv = branches_zeros(be, (size_t)(T * H * DV) * 2);

    nsa_forward_args f;
    memset(&f, 0, sizeof f);
    f.q = nsa_tensor_4d(q, dt, 1, T, HQ, DK);
    f.k = nsa_tensor_4d(k, dt, 1, T, H, DK);
    f.v = nsa_tensor_4d(v, dt, 1, T, H, DV);
    f.g_cmp = nsa_tensor_3d(gt[0], dt, 1, T, HQ);
    f.g_slc = nsa_tensor_3d(gt[1], dt, 1, T, HQ);
    f.g_swa = nsa_tensor_3d(gt[2], dt, 1, T, HQ);
    f.o = nsa_tensor_4d(out, dt, 1, T, HQ, DV);
    f.saved.block_indices = nsa_tensor_4d(idx, NSA_DTYPE_I32, 1, T, H, n);
    f.saved.o_cmp = nsa_tensor_4d(so[0], dt, 1, T, HQ, DV);
    f.saved.o_slc = nsa_tensor_4d(so[1], dt, 1, T, HQ, DV);
    f.saved.o_swa = nsa_tensor_4d(so[2], dt, 1, T, HQ, DV);
    f.saved.lse_cmp = nsa_tensor_3d(sl[0], NSA_DTYPE_F32, 1, T, HQ);
    f.saved.lse_slc = nsa_tensor_3d(sl[1], NSA_DTYPE_F32, 1, T, HQ);
    f.saved.lse_swa = nsa_tensor_3d(sl[2], NSA_DTYPE_F32, 1, T, HQ);
    f.config = *cfg;
    nsa_backward_args b;
    memset(&b, 0, sizeof b);
    b.fwd = f;
    b.dout = nsa_tensor_4d(dout, dt, 1, T, HQ, DV);
    b.dq = nsa_tensor_4d(dq, dt, 1, T, HQ, DK);
    b.dk = nsa_tensor_4d(dk, dt, 1, T, H, DK);
    b.dv = nsa_tensor_4d(dv, dt, 1, T, H, DV);
    b.dg_cmp = nsa_tensor_3d(dg[0], dt, 1, T, HQ);
    b.dg_slc = nsa_tensor_3d(dg[1], dt, 1, T, HQ);
    b.dg_swa = nsa_tensor_3d(dg[2], dt, 1, T, HQ);

    /* one branch alone: the other gates absent; the selected branch reads the full forward's
     * selection as caller indices */
    nsa_forward_args fb[3];
    nsa_backward_args bb[3];
    for (int x = 0; x < 3; x++) {
        fb[x] = f;
        nsa_tensor *gs[3] = {&fb[x].g_cmp, &fb[x].g_slc, &fb[x].g_swa};
        for (int y = 0; y < 3; y++)
            if (y != x) memset(gs[y], 0, sizeof(nsa_tensor));
        if (x == 1) {
            fb[x].block_indices = f.saved.block_indices;
            memset(&fb[x].saved.block_indices, 0, sizeof(nsa_tensor));
        }
        bb[x] = b;
        bb[x].fwd = fb[x];
        nsa_tensor *dgs[3] = {&bb[x].dg_cmp, &bb[x].dg_slc, &bb[x].dg_swa};
        for (int y = 0; y < 3; y++)
            if (y != x) memset(dgs[y], 0, sizeof(nsa_tensor));
    }

    size_t wsb = 0, w = 0;
    need(nsa_forward_workspace_size(ctx, &f, &w), "forward workspace"), wsb = w > wsb ? w : wsb;
    need(nsa_backward_workspace_size(ctx, &b, &w), "backward workspace"), wsb = w > wsb ? w : wsb;
    for (int x = 0; x < 3; x++) {
        need(nsa_forward_workspace_size(ctx, &fb[x], &w), "forward workspace"), wsb = w > wsb ? w : wsb;
        need(nsa_backward_workspace_size(ctx, &bb[x], &w), "backward workspace"), wsb = w > wsb ? w : wsb;
    }
    void *ws = branches_zeros(be, wsb);
    int profiled = 0;
    if (o->profile) {
        need(nsa_forward(ctx, &f, ws, wsb), "forward");
        need(nsa_backward(ctx, &b, ws, wsb), "backward");
        devmem_sync(be);
        printf("%8lld profiled one forward + backward\n", (long long)T);
        profiled = 1;
    } else {
        const double tf = branches_time_ms(ctx, be, 0, &f, ws, wsb, o->reps);
        const double tb = branches_time_ms(ctx, be, 1, &b, ws, wsb, o->reps);
        double tfb[3], tbb[3];
        for (int x = 0; x < 3; x++) {
            tfb[x] = branches_time_ms(ctx, be, 0, &fb[x], ws, wsb, o->reps);
            tbb[x] = branches_time_ms(ctx, be, 1, &bb[x], ws, wsb, o->reps);
        }
        printf("%8lld %9.3f %9.3f | %9.3f %9.3f %9.3f | %9.3f %9.3f %9.3f   ws %.2f GB\n", (long long)T, tf, tb, tfb[0],
               tfb[1], tfb[2], tbb[0], tbb[1], tbb[2], (double)wsb / 1e9);
    }
    fflush(stdout);
    void *all[] = {q, k, v, dout, gt[0], gt[1], gt[2], so[0], so[1], so[2], sl[0], sl[1], sl[2], dg[0], dg[1], dg[2],
                   idx, out, dq, dk, dv, ws};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) devmem_free(be, all[i]);
    return profiled;
}

static int cmd_bench_branches(int argc, char **argv)
{
    branches_opts o = {.backend = NSA_BACKEND_CUDA, .lengths = {8192, 16384, 32768, 65536}, .nlengths = 4,
                       .HQ = 64, .H = 4, .DK = 128, .DV = 128, .dtype = NSA_DTYPE_BF16, .reps = 10};
    args a = {argc, 2, argv, NULL};
    for (; a.i < argc; a.i++) {
        if (arg_is(&a, "--branches")) continue;
        else if (arg_opt(&a, "--T")) {
            bench_opts lengths;
            parse_lengths(&lengths, a.value);
            memcpy(o.lengths, lengths.lengths, sizeof o.lengths);
            o.nlengths = lengths.nlengths;
        } else if (arg_opt(&a, "--config")) {
            if (strcmp(a.value, "paper") && strcmp(a.value, "fla")) usage_error("--config: expected paper or fla, got '%s'", a.value);
            o.fla = !strcmp(a.value, "fla");
        }
        else if (arg_opt(&a, "--HQ")) o.HQ = parse_int(a.value, "--HQ", 1, 4096);
        else if (arg_opt(&a, "--H")) o.H = parse_int(a.value, "--H", 1, 4096);
        else if (arg_opt(&a, "--D")) o.DK = o.DV = parse_int(a.value, "--D", 1, 4096);
        else if (arg_opt(&a, "--DK")) o.DK = parse_int(a.value, "--DK", 1, 4096);
        else if (arg_opt(&a, "--DV")) o.DV = parse_int(a.value, "--DV", 1, 4096);
        else if (arg_opt(&a, "--dtype")) {
            o.dtype = parse_dtype(a.value);
            if (o.dtype == NSA_DTYPE_F32) usage_error("bench --branches: --dtype takes bf16 or f16");
        }
        else if (arg_is(&a, "--f16")) o.dtype = NSA_DTYPE_F16;
        else if (arg_opt(&a, "--reps")) o.reps = (int)parse_int(a.value, "--reps", 1, 64);
        else if (arg_is(&a, "--profile")) o.profile = 1; /* one forward + backward, for ncu */
        else if (arg_opt(&a, "--backend")) o.backend = parse_backend(a.value);
        else if (arg_opt(&a, "--threads")) o.threads = (int)parse_int(a.value, "--threads", 0, 4096);
        else usage_error("bench --branches: unknown option '%s'", argv[a.i]);
    }
    if (o.HQ % o.H != 0) usage_error("--HQ must be a multiple of --H");
    require_backend(o.backend);
    nsa_config cfg = nsa_config_default();
    if (o.fla) cfg.cmp_len = cfg.cmp_stride = cfg.slc_block = 64;
    char dev[300];
    branches_device(o.backend, o.threads, dev, sizeof dev);
    printf("gpu_bench: %s, %s, HQ=%lld H=%lld DK=%lld DV=%lld, config %s (l=%lld d=%lld l'=%lld n=%lld w=%lld), "
           "median of %d\n",
           dev, nsa_dtype_name(o.dtype), (long long)o.HQ, (long long)o.H, (long long)o.DK, (long long)o.DV,
           o.fla ? "fla" : "paper", (long long)cfg.cmp_len, (long long)cfg.cmp_stride, (long long)cfg.slc_block,
           (long long)cfg.slc_topk, (long long)cfg.window, o.reps);
    nsa_context *ctx = NULL;
    nsa_context_desc d = {.backend = o.backend, .num_threads = o.threads};
    need(nsa_context_create(&ctx, &d), "creating the context");
    printf("%8s %9s %9s | %9s %9s %9s | %9s %9s %9s  (ms)\n", "T", "fwd", "bwd", "fwd_cmp", "fwd_slc", "fwd_swa",
           "bwd_cmp", "bwd_slc", "bwd_swa");
    for (int i = 0; i < o.nlengths; i++)
        if (branches_length(&o, ctx, &cfg, o.lengths[i])) break;
    nsa_context_destroy(ctx);
    return 0;
}

static int cmd_bench(int argc, char **argv)
{
    for (int i = 2; i < argc; i++)
        if (!strcmp(argv[i], "--branches")) return cmd_bench_branches(argc, argv);
    bench_opts o = {.prob = {.backend = best_backend(), .HQ = 16, .H = 1, .DK = 128, .DV = 128,
                             .cfg = nsa_config_default(), .with_dense = 1, .seed = 1},
                    .config_name = "paper", .lengths = {8192, 16384, 32768}, .nlengths = 3, .reps = 5};
    parse_bench(&o, argc, argv);
    FILE *json = NULL;
    if (o.json && !(json = fopen(o.json, "w"))) fail("cannot write %s: %s", o.json, strerror(errno));
    if (json) fprintf(json, "[");
    int first = 1;

    problem_opts *po = &o.prob;
    printf("nsa bench: backend %s, config %s (l=%lld d=%lld l'=%lld n=%lld w=%lld), HQ=%lld H=%lld "
           "DK=%lld DV=%lld %s, B=1\n",
           backend_desc(po->backend, po->threads), o.config_name, (long long)po->cfg.cmp_len,
           (long long)po->cfg.cmp_stride, (long long)po->cfg.slc_block, (long long)po->cfg.slc_topk,
           (long long)po->cfg.window, (long long)po->HQ, (long long)po->H, (long long)po->DK, (long long)po->DV,
           nsa_dtype_name(po->dtype));
    printf("median of up to %d runs after a warm-up%s; GFLOP/s from the visible (query head, key) pairs\n", o.reps,
           o.reps_given ? "" : " (repeats stop after 20 s)");
    const int cpu = po->backend == NSA_BACKEND_CPU;
    if (cpu) printf("cpu%%: our CPU time / (wall time x threads); well below 100 means the cores were shared or idle\n");
    print_loadavg("load average before");
    printf("%8s  %-4s %-14s %12s %10s %5s %s\n", "T", "pass", "op", "ms", "GFLOP/s", "runs", cpu ? " cpu%" : "");
    double fwd[MAX_LENGTHS], dense[MAX_LENGTHS];
    for (int i = 0; i < o.nlengths; i++) bench_length(&o, o.lengths[i], json, &first, &fwd[i], &dense[i]);

    printf("\n");
    for (int i = 0; i < o.nlengths; i++) {
        if (fwd[i] <= 0 && dense[i] <= 0) continue; /* --op without either */
        printf("T=%-7lld", (long long)o.lengths[i]);
        if (fwd[i] > 0) printf(" nsa_forward %10.2f ms", fwd[i]);
        if (dense[i] > 0) printf("   dense causal %10.2f ms", dense[i]);
        if (fwd[i] > 0 && dense[i] > 0) printf("   dense / nsa_forward = %.2fx", dense[i] / fwd[i]);
        if (i > 0 && fwd[i] > 0 && fwd[i - 1] > 0)
            printf("   nsa_forward(T) / nsa_forward(%lld) = %.2f", (long long)o.lengths[i - 1], fwd[i] / fwd[i - 1]);
        printf("\n");
    }
    print_loadavg("load average after");
    if (json) {
        fprintf(json, "\n]\n");
        if (fclose(json) != 0) fail("cannot write %s", o.json);
    }
    return 0;
}

/* ==== nsa version / main ============================================================== */

static int cmd_version(int argc, char **argv)
{
    (void)argv;
    if (argc > 2) usage_error("version takes no options");
    printf("nsa %s (header %d.%d.%d)\n", nsa_version_string(), NSA_VERSION_MAJOR, NSA_VERSION_MINOR, NSA_VERSION_PATCH);
    printf("backends: cpu%s\n", nsa_backend_available(NSA_BACKEND_CUDA) ? ", cuda" : " (cuda not available)");
    return 0;
}

int main(int argc, char **argv)
{
    /* line-buffered even into a file: a run cut off by a time limit still shows how far it got */
    setvbuf(stdout, NULL, _IOLBF, 0);
    devmem_set_fail(devmem_failed);
    if (argc < 2) usage_error("no command given");
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        print_help(stdout, argc > 2 ? argv[2] : NULL); /* nsa help <command>: that command's */
        return 0;
    }
    for (int i = 2; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            print_help(stdout, cmd);
            return 0;
        }
    if (!strcmp(cmd, "demo")) return cmd_demo(argc, argv);
    if (!strcmp(cmd, "check")) return cmd_check(argc, argv);
    if (!strcmp(cmd, "bench")) return cmd_bench(argc, argv);
    if (!strcmp(cmd, "version") || !strcmp(cmd, "--version")) return cmd_version(argc, argv);
    usage_error("unknown command '%s'", cmd);
    return 2;
}
