/* test_safety.c -- calls that pass validation stay inside their workspace and their outputs.
 * Each case reproduces a memory-safety finding of fuzzing the C API on the CPU backend: the
 * workspace is exactly the size the library asked for, followed by a guard region that must
 * come back untouched, and absent outputs must not be written through. Sizes too big for
 * size_t are refused (NSA_STATUS_SIZE_OVERFLOW) before anything is written. */
#include "harness.h"
#include "nsa.h"
#include "cpu/common.h" /* the CPU backend's workspace arena */
#include "size.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { GUARD = 4096 };

static nsa_context *one_thread_cpu(void)
{
    nsa_context *ctx = NULL;
    /* one worker: its scratch is the last in the workspace, so an overrun reaches the guard */
    nsa_context_desc d = {.backend = NSA_BACKEND_CPU, .num_threads = 1};
    CHECK_STATUS(nsa_context_create(&ctx, &d), NSA_STATUS_SUCCESS);
    return ctx;
}

static nsa_tensor f32_tensor(test_rng *r, int rank, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < rank; i++) n *= shape[i];
    float *x = (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = (float)rng_normal(r);
    return nsa_tensor_make(x, NSA_DTYPE_F32, rank, shape);
}

/* workspace of `bytes` followed by a guard of 0xAB bytes */
static unsigned char *guarded(size_t bytes)
{
    unsigned char *w = (unsigned char *)malloc(bytes + GUARD);
    memset(w + bytes, 0xAB, GUARD);
    return w;
}

static int guard_intact(const unsigned char *w, size_t bytes)
{
    for (size_t i = 0; i < GUARD; i++)
        if (w[bytes + i] != 0xAB) return 0;
    return 1;
}

/* Selected attention forward and backward, every block selected, with the workspace guard. */
static void slc_case(int64_t T, int64_t HQ, int64_t H, int64_t D, int64_t slc_block, const char *what)
{
    test_rng r = {(uint64_t)(T * 131 + HQ * 7 + D)};
    nsa_context *ctx = one_thread_cpu();
    nsa_slc_attn_args a;
    memset(&a, 0, sizeof a);
    a.config = nsa_config_default();
    a.config.slc_block = slc_block;
    const int64_t m = 4, sq[4] = {1, T, HQ, D}, sk[4] = {1, T, H, D}, si[4] = {1, T, H, m}, sl[3] = {1, T, HQ};
    a.q = f32_tensor(&r, 4, sq), a.k = f32_tensor(&r, 4, sk), a.v = f32_tensor(&r, 4, sk);
    a.o = f32_tensor(&r, 4, sq), a.lse = f32_tensor(&r, 3, sl);
    int32_t *idx = (int32_t *)malloc((size_t)(T * H * m) * sizeof(int32_t));
    for (int64_t i = 0; i < T * H * m; i++) idx[i] = (int32_t)(i % m); /* blocks 0..3, usable where started */
    a.block_indices = nsa_tensor_make(idx, NSA_DTYPE_I32, 4, si);
    size_t bytes = 0;
    nsa_status st = nsa_slc_attn_workspace_size(ctx, &a, &bytes);
    CHECK_MSG(st == NSA_STATUS_SUCCESS, what);
    if (st == NSA_STATUS_SUCCESS) {
        unsigned char *w = guarded(bytes);
        CHECK_STATUS(nsa_slc_attn(ctx, &a, w, bytes), NSA_STATUS_SUCCESS);
        CHECK_MSG(guard_intact(w, bytes), what);
        free(w);
    }
    nsa_slc_attn_bwd_args b;
    memset(&b, 0, sizeof b);
    b.fwd = a;
    b.dout = f32_tensor(&r, 4, sq), b.dq = f32_tensor(&r, 4, sq), b.dk = f32_tensor(&r, 4, sk), b.dv = f32_tensor(&r, 4, sk);
    st = nsa_slc_attn_bwd_workspace_size(ctx, &b, &bytes);
    CHECK_MSG(st == NSA_STATUS_SUCCESS, what);
    if (st == NSA_STATUS_SUCCESS) {
        unsigned char *w = guarded(bytes);
        CHECK_STATUS(nsa_slc_attn_bwd(ctx, &b, w, bytes), NSA_STATUS_SUCCESS);
        CHECK_MSG(guard_intact(w, bytes), what);
        free(w);
    }
    free(a.q.data), free(a.k.data), free(a.v.data), free(a.o.data), free(a.lse.data), free(idx);
    free(b.dout.data), free(b.dq.data), free(b.dk.data), free(b.dv.data);
    nsa_context_destroy(ctx);
}

/* Absent output (data NULL) whose own shape is not empty, where the call's dims make the
 * output empty: rejected, never written through. */
static void absent_output_case(void)
{
    test_rng r = {5};
    nsa_context *ctx = one_thread_cpu();
    nsa_compress_args a;
    memset(&a, 0, sizeof a);
    a.config = nsa_config_default(); /* l = 32: T = 3 has no compressed block */
    const int64_t sx[4] = {1, 3, 1, 4}, sc[4] = {1, 5, 1, 4}, sc0[4] = {1, 0, 1, 4};
    a.x = f32_tensor(&r, 4, sx);
    a.x_cmp = nsa_tensor_make(NULL, NSA_DTYPE_F32, 4, sc);
    size_t bytes = 0;
    CHECK_STATUS(nsa_compress_workspace_size(ctx, &a, &bytes), NSA_STATUS_NULL_POINTER);
    CHECK_DETAIL("x_cmp");
    CHECK_STATUS(nsa_compress(ctx, &a, NULL, 0), NSA_STATUS_NULL_POINTER);
    CHECK_DETAIL("x_cmp");
    a.x_cmp = nsa_tensor_make(NULL, NSA_DTYPE_F32, 4, sc0); /* an empty absent output is fine */
    CHECK_STATUS(nsa_compress_workspace_size(ctx, &a, &bytes), NSA_STATUS_SUCCESS);
    free(a.x.data);
    nsa_context_destroy(ctx);
}

/* Block counts with extreme (valid or invalid) configurations: no overflow, the documented value. */
static void block_count_case(void)
{
    nsa_config c = nsa_config_default();
    c.cmp_len = 1, c.cmp_stride = 1, c.slc_block = INT64_MAX, c.slc_topk = 1, c.n_init = 0, c.n_local = 0, c.window = 1;
    CHECK_STATUS(nsa_config_validate(&c), NSA_STATUS_BAD_SLC_BLOCK); /* past int32; the counting helpers still cope */
    CHECK_DETAIL("config.slc_block");
    CHECK(nsa_num_slc_blocks(&c, 11) == 1 && nsa_num_slc_blocks(&c, 0) == 0);
    CHECK(nsa_num_slc_blocks(&c, INT64_MAX) == 1);
    c.slc_block = INT32_MAX;
    CHECK_STATUS(nsa_config_validate(&c), NSA_STATUS_SUCCESS);
    CHECK(nsa_num_slc_blocks(&c, INT64_MAX) == ((int64_t)1 << 32) + 3); /* ceil((2^63 - 1) / (2^31 - 1)) */
    c.cmp_len = INT64_MIN, c.cmp_stride = 3; /* invalid: no blocks, and no overflow computing that */
    CHECK(nsa_num_cmp_blocks(&c, 9) == 0);
    /* the selection's workspace query with the largest valid block (it counted blocks as T + l' - 1) */
    test_rng r = {11};
    nsa_context *ctx = one_thread_cpu();
    nsa_select_args a;
    memset(&a, 0, sizeof a);
    a.config = nsa_config_default();
    a.config.cmp_len = 1, a.config.cmp_stride = 1, a.config.slc_block = INT32_MAX, a.config.slc_topk = 1;
    a.config.n_init = 0, a.config.n_local = 0, a.config.window = 1;
    const int64_t sq[4] = {1, 11, 2, 4}, sk[4] = {1, 11, 1, 4}, si[4] = {1, 11, 1, 1};
    a.q = f32_tensor(&r, 4, sq), a.k_cmp = f32_tensor(&r, 4, sk);
    int32_t idx[11];
    a.block_indices = nsa_tensor_make(idx, NSA_DTYPE_I32, 4, si);
    size_t bytes = 0;
    CHECK_STATUS(nsa_select_workspace_size(ctx, &a, &bytes), NSA_STATUS_SUCCESS);
    unsigned char *w = guarded(bytes);
    CHECK_STATUS(nsa_select(ctx, &a, w, bytes), NSA_STATUS_SUCCESS);
    CHECK(guard_intact(w, bytes));
    for (int i = 0; i < 11; i++) CHECK(idx[i] == 0); /* one block: the forced / only choice */
    free(w), free(a.q.data), free(a.k_cmp.data);
    nsa_context_destroy(ctx);
}

/* The saturating size arithmetic every size goes through: overflow gives SIZE_MAX, and
 * SIZE_MAX survives every later step, so one check at the end sees it. */
static void size_helpers_case(void)
{
    const size_t half = SIZE_MAX / 2 + 1; /* 2^63 on 64-bit hosts */
    CHECK(nsa_size_mul(3, 5) == 15 && nsa_size_mul(0, SIZE_MAX - 1) == 0 && nsa_size_mul(SIZE_MAX - 1, 1) == SIZE_MAX - 1);
    CHECK(nsa_size_mul(half, 2) == SIZE_MAX && nsa_size_mul(2, half) == SIZE_MAX);
    CHECK(nsa_size_mul(half - 1, 2) == SIZE_MAX - 1);
    CHECK(nsa_size_mul(SIZE_MAX, 0) == SIZE_MAX && nsa_size_mul(0, SIZE_MAX) == SIZE_MAX); /* sticky, even times 0 */
    CHECK(nsa_size_add(1, 2) == 3 && nsa_size_add(SIZE_MAX - 1, 0) == SIZE_MAX - 1);
    CHECK(nsa_size_add(half, half) == SIZE_MAX && nsa_size_add(SIZE_MAX, 0) == SIZE_MAX);
    CHECK(nsa_size_add(half, half - 1) == SIZE_MAX); /* exactly SIZE_MAX reads as overflowed too */
    CHECK(nsa_size_align(0, 64) == 0 && nsa_size_align(1, 64) == 64 && nsa_size_align(64, 64) == 64);
    CHECK(nsa_size_align(SIZE_MAX - 10, 64) == SIZE_MAX && nsa_size_align(SIZE_MAX, 256) == SIZE_MAX);
    CHECK(nsa_size_of(0) == 0 && nsa_size_of(7) == 7 && nsa_size_of(-1) == SIZE_MAX && nsa_size_of(INT64_MIN) == SIZE_MAX);
    CHECK(nsa_size_of(INT64_MAX) == (SIZE_MAX > (uint64_t)INT64_MAX ? (size_t)INT64_MAX : SIZE_MAX));
}

/* ---- workspaces too big for size_t ---------------------------------------------------------
 * Shapes whose element counts and offsets fit int64 (so they pass validation) but whose
 * workspace does not fit size_t. The views all point at one small sentinel buffer: nothing
 * reads tensor data before the workspace is known, and a call that fails must not write. */
static uint32_t g_sentinel[256];

static nsa_tensor huge_view(nsa_dtype dt, int rank, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    const int64_t shape[4] = {d0, d1, d2, d3};
    return nsa_tensor_make(g_sentinel, dt, rank, shape);
}

static void sentinel_fill(void) { memset(g_sentinel, 0xA5, sizeof g_sentinel); }

static int sentinel_intact(void)
{
    for (size_t i = 0; i < sizeof g_sentinel / sizeof g_sentinel[0]; i++)
        if (g_sentinel[i] != 0xA5A5A5A5u) return 0;
    return 1;
}

/* The query and the op (with no workspace, and with a small one) all refuse, writing nothing. */
#define EXPECT_SIZE_OVERFLOW(query, op, args, what)                                                       \
    do {                                                                                                  \
        size_t bytes_ = 12345;                                                                            \
        unsigned char small_[256];                                                                        \
        sentinel_fill();                                                                                  \
        harness_check_status(query(ctx, (args), &bytes_), NSA_STATUS_SIZE_OVERFLOW, __FILE__, __LINE__, what); \
        CHECK_DETAIL("workspace");                                                                        \
        CHECK_MSG(bytes_ == 12345, what);                                                                 \
        harness_check_status(op(ctx, (args), NULL, 0), NSA_STATUS_SIZE_OVERFLOW, __FILE__, __LINE__, what); \
        CHECK_DETAIL("workspace");                                                                        \
        harness_check_status(op(ctx, (args), small_, sizeof small_), NSA_STATUS_SIZE_OVERFLOW, __FILE__, __LINE__, what); \
        CHECK_DETAIL("workspace");                                                                        \
        CHECK_MSG(sentinel_intact(), what);                                                               \
    } while (0)

static void workspace_overflow_case(void)
{
    nsa_context *ctx = one_thread_cpu();
    /* selected attention, bf16: k and v are 2^61 elements (2^62 bytes), their fp32 panels
     * 2^63 bytes each, and the two together 2^64 */
    {
        const int64_t T = (int64_t)1 << 31, D = (int64_t)1 << 30;
        nsa_slc_attn_args a;
        memset(&a, 0, sizeof a);
        a.config = nsa_config_default();
        a.q = huge_view(NSA_DTYPE_BF16, 4, 1, T, 1, D), a.k = a.q, a.v = a.q, a.o = a.q;
        a.lse = huge_view(NSA_DTYPE_F32, 3, 1, T, 1, 0);
        a.block_indices = huge_view(NSA_DTYPE_I32, 4, 1, T, 1, 1);
        EXPECT_SIZE_OVERFLOW(nsa_slc_attn_workspace_size, nsa_slc_attn, &a, "slc_attn: K and V panels of 2^63 bytes");
        nsa_slc_attn_bwd_args b;
        memset(&b, 0, sizeof b);
        b.fwd = a;
        b.dout = a.q, b.dq = a.q, b.dk = a.q, b.dv = a.q;
        EXPECT_SIZE_OVERFLOW(nsa_slc_attn_bwd_workspace_size, nsa_slc_attn_bwd, &b, "slc_attn_bwd: K and V panels of 2^63 bytes");
    }
    /* compressed attention with l = d = 1: a tile's score row holds every one of the
     * 2^58 compressed keys, 64 rows x 2^58 x 4 bytes = 2^66 (it wrapped to 0) */
    {
        const int64_t T = (int64_t)1 << 58;
        nsa_cmp_attn_args a;
        memset(&a, 0, sizeof a);
        a.config = nsa_config_default();
        a.config.cmp_len = a.config.cmp_stride = 1;
        a.q = huge_view(NSA_DTYPE_F32, 4, 1, T, 1, 1), a.k_cmp = a.q, a.v_cmp = a.q, a.o = a.q;
        a.lse = huge_view(NSA_DTYPE_F32, 3, 1, T, 1, 0);
        EXPECT_SIZE_OVERFLOW(nsa_cmp_attn_workspace_size, nsa_cmp_attn, &a, "cmp_attn: score rows of 2^66 bytes");
    }
    nsa_context_destroy(ctx);
    /* per-thread scratch of 2^42 bytes (score rows of 2^34 / 16 compressed keys) times 2^31 - 1 threads */
    {
        nsa_context_desc d = {.backend = NSA_BACKEND_CPU, .num_threads = INT32_MAX};
        CHECK_STATUS(nsa_context_create(&ctx, &d), NSA_STATUS_SUCCESS);
        const int64_t T = (int64_t)1 << 34, Nc = nsa_num_cmp_blocks(&(nsa_config){.cmp_len = 32, .cmp_stride = 16}, T);
        nsa_cmp_attn_args a;
        memset(&a, 0, sizeof a);
        a.config = nsa_config_default();
        a.q = huge_view(NSA_DTYPE_F32, 4, 1, T, 1, 1), a.o = a.q;
        a.k_cmp = huge_view(NSA_DTYPE_F32, 4, 1, Nc, 1, 1), a.v_cmp = a.k_cmp;
        a.lse = huge_view(NSA_DTYPE_F32, 3, 1, T, 1, 0);
        EXPECT_SIZE_OVERFLOW(nsa_cmp_attn_workspace_size, nsa_cmp_attn, &a, "cmp_attn: scratch times 2^31 - 1 threads");
        nsa_context_destroy(ctx);
    }
    /* a head dimension past int (the CPU tile's row length): 2^31 bf16 elements per row */
    {
        ctx = one_thread_cpu();
        const int64_t D = (int64_t)1 << 31;
        nsa_slc_attn_args a;
        memset(&a, 0, sizeof a);
        a.config = nsa_config_default();
        a.q = huge_view(NSA_DTYPE_BF16, 4, 1, 1, 1, D), a.k = a.q, a.v = a.q, a.o = a.q;
        a.lse = huge_view(NSA_DTYPE_F32, 3, 1, 1, 1, 0);
        a.block_indices = huge_view(NSA_DTYPE_I32, 4, 1, 1, 1, 1);
        EXPECT_SIZE_OVERFLOW(nsa_slc_attn_workspace_size, nsa_slc_attn, &a, "slc_attn: head dim 2^31");
        nsa_context_destroy(ctx);
    }
}

/* The CPU backend's workspace arena: a take that overflows leaves `used` at SIZE_MAX for
 * good, so the sizing pass reports the overflow however many takes follow. */
static void arena_case(void)
{
    ws_arena a = {NULL, 0};
    CHECK(ws_take(&a, 10) == NULL && a.used == 10);
    ws_take_n(&a, 3, 8);
    CHECK(a.used == 64 + 24);
    ws_take_2d(&a, 2, 3, 4);
    CHECK(a.used == 128 + 24);
    ws_take_2d(&a, SIZE_MAX / 8, 3, 4); /* the product overflows, not any single factor */
    CHECK(a.used == SIZE_MAX);
    ws_take(&a, 0);
    ws_take_n(&a, 0, 4);
    CHECK(a.used == SIZE_MAX);
    CHECK(ws_region_bytes(&a) == SIZE_MAX);
    ws_arena b = {NULL, SIZE_MAX - 10};
    ws_take(&b, 1); /* the alignment itself passes SIZE_MAX */
    CHECK(b.used == SIZE_MAX);
    ws_arena c = {NULL, 0};
    ws_fail(&c);
    ws_take(&c, 1);
    CHECK(c.used == SIZE_MAX);
    unsigned char buf[256];
    ws_arena live = {(char *)buf, 0};
    CHECK(ws_take(&live, 8) == buf && ws_take(&live, 8) == buf + 64);
    CHECK(ws_take_n(&live, SIZE_MAX / 2, 4) == NULL); /* never a pointer past an overflow */
}

/* ---- windows of any length -----------------------------------------------------------------
 * A window longer than the sequence is the whole prefix, however long: INT64_MAX must give the
 * unbounded result bit for bit (under UBSan: no `t - w + 1` on the way). */
enum { WB = 2, WHQ = 4, WH = 2, WD = 8 };

/* Everything an attention forward and backward writes, one after the other. */
static float *attention_outputs(nsa_context *ctx, const float *in, int64_t Tq, int64_t Tk, int causal, int64_t wl,
                                int64_t wr, size_t *count)
{
    const size_t nq = (size_t)(WB * Tq * WHQ * WD), nk = (size_t)(WB * Tk * WH * WD), nl = (size_t)(WB * Tq * WHQ);
    *count = 2 * nq + nl + 2 * nk; /* o, lse, dq, dk, dv (DK = DV) */
    float *out = (float *)calloc(*count, sizeof(float));
    float *o = out, *lse = o + nq, *dq = lse + nl, *dk = dq + nq, *dv = dk + nk;
    const float *q = in, *k = q + nq, *v = k + nk, *dout = v + nk;
    nsa_attention_bwd_args b;
    memset(&b, 0, sizeof b);
    nsa_attention_args *a = &b.fwd;
    a->q = nsa_tensor_4d((void *)q, NSA_DTYPE_F32, WB, Tq, WHQ, WD);
    a->k = nsa_tensor_4d((void *)k, NSA_DTYPE_F32, WB, Tk, WH, WD);
    a->v = nsa_tensor_4d((void *)v, NSA_DTYPE_F32, WB, Tk, WH, WD);
    a->o = nsa_tensor_4d(o, NSA_DTYPE_F32, WB, Tq, WHQ, WD);
    a->lse = nsa_tensor_3d(lse, NSA_DTYPE_F32, WB, Tq, WHQ);
    a->causal = causal, a->window_left = wl, a->window_right = wr;
    b.dout = nsa_tensor_4d((void *)dout, NSA_DTYPE_F32, WB, Tq, WHQ, WD);
    b.dq = nsa_tensor_4d(dq, NSA_DTYPE_F32, WB, Tq, WHQ, WD);
    b.dk = nsa_tensor_4d(dk, NSA_DTYPE_F32, WB, Tk, WH, WD);
    b.dv = nsa_tensor_4d(dv, NSA_DTYPE_F32, WB, Tk, WH, WD);
    size_t bytes = 0, bbytes = 0;
    CHECK_STATUS(nsa_attention_workspace_size(ctx, a, &bytes), NSA_STATUS_SUCCESS);
    CHECK_STATUS(nsa_attention_bwd_workspace_size(ctx, &b, &bbytes), NSA_STATUS_SUCCESS);
    void *ws = malloc(bytes > bbytes ? bytes : bbytes);
    CHECK_STATUS(nsa_attention(ctx, a, ws, bytes), NSA_STATUS_SUCCESS);
    CHECK_STATUS(nsa_attention_bwd(ctx, &b, ws, bbytes), NSA_STATUS_SUCCESS);
    free(ws);
    return out;
}

static void huge_attention_window_case(nsa_context *ctx, const float *in, int64_t Tq, int64_t Tk, int causal)
{
    static const int64_t huge[] = {INT64_MAX, INT64_MAX - 1, (int64_t)1 << 62};
    size_t n = 0, m = 0;
    float *want = attention_outputs(ctx, in, Tq, Tk, causal, -1, -1, &n);
    for (size_t i = 0; i < sizeof huge / sizeof huge[0]; i++) {
        float *got = attention_outputs(ctx, in, Tq, Tk, causal, huge[i], huge[i], &m);
        CHECK_MSG(m == n && memcmp(got, want, n * sizeof(float)) == 0, "attention window_left/right huge == unbounded");
        free(got);
        got = attention_outputs(ctx, in, Tq, Tk, causal, huge[i], -1, &m);
        CHECK_MSG(memcmp(got, want, n * sizeof(float)) == 0, "attention window_left huge == unbounded");
        free(got);
        got = attention_outputs(ctx, in, Tq, Tk, causal, -1, huge[i], &m);
        CHECK_MSG(memcmp(got, want, n * sizeof(float)) == 0, "attention window_right huge == unbounded");
        free(got);
    }
    free(want);
}

/* The whole NSA's sliding branch, forward and backward: everything it writes. */
static float *swa_outputs(nsa_context *ctx, const float *in, int64_t T, int64_t window, size_t *count)
{
    const size_t nq = (size_t)(WB * T * WHQ * WD), nk = (size_t)(WB * T * WH * WD), nl = (size_t)(WB * T * WHQ);
    *count = 3 * nq + 2 * nl + 2 * nk; /* o, o_swa, lse_swa, dq, dk, dv, dg_swa */
    float *out = (float *)calloc(*count, sizeof(float));
    float *o = out, *o_swa = o + nq, *lse = o_swa + nq, *dq = lse + nl, *dk = dq + nq, *dv = dk + nk, *dg = dv + nk;
    const float *q = in, *k = q + nq, *v = k + nk, *dout = v + nk, *g = dout + nq;
    nsa_backward_args b;
    memset(&b, 0, sizeof b);
    nsa_forward_args *a = &b.fwd;
    a->config = nsa_config_default();
    a->config.window = window;
    a->q = nsa_tensor_4d((void *)q, NSA_DTYPE_F32, WB, T, WHQ, WD);
    a->k = nsa_tensor_4d((void *)k, NSA_DTYPE_F32, WB, T, WH, WD);
    a->v = nsa_tensor_4d((void *)v, NSA_DTYPE_F32, WB, T, WH, WD);
    a->g_swa = nsa_tensor_3d((void *)g, NSA_DTYPE_F32, WB, T, WHQ);
    a->o = nsa_tensor_4d(o, NSA_DTYPE_F32, WB, T, WHQ, WD);
    a->saved.o_swa = nsa_tensor_4d(o_swa, NSA_DTYPE_F32, WB, T, WHQ, WD);
    a->saved.lse_swa = nsa_tensor_3d(lse, NSA_DTYPE_F32, WB, T, WHQ);
    b.dout = nsa_tensor_4d((void *)dout, NSA_DTYPE_F32, WB, T, WHQ, WD);
    b.dq = nsa_tensor_4d(dq, NSA_DTYPE_F32, WB, T, WHQ, WD);
    b.dk = nsa_tensor_4d(dk, NSA_DTYPE_F32, WB, T, WH, WD);
    b.dv = nsa_tensor_4d(dv, NSA_DTYPE_F32, WB, T, WH, WD);
    b.dg_swa = nsa_tensor_3d(dg, NSA_DTYPE_F32, WB, T, WHQ);
    size_t bytes = 0, bbytes = 0;
    CHECK_STATUS(nsa_forward_workspace_size(ctx, a, &bytes), NSA_STATUS_SUCCESS);
    CHECK_STATUS(nsa_backward_workspace_size(ctx, &b, &bbytes), NSA_STATUS_SUCCESS);
    void *ws = malloc(bytes > bbytes ? bytes : bbytes);
    CHECK_STATUS(nsa_forward(ctx, a, ws, bytes), NSA_STATUS_SUCCESS);
    CHECK_STATUS(nsa_backward(ctx, &b, ws, bbytes), NSA_STATUS_SUCCESS);
    free(ws);
    return out;
}

static void huge_window_case(void)
{
    nsa_context *ctx = one_thread_cpu();
    test_rng r = {77};
    const int64_t T = 45, n = 8 * WB * T * WHQ * WD; /* room for every input of both cases */
    float *in = (float *)malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) in[i] = (float)rng_normal(&r);

    /* the fast window path (Tq == Tk) and the general one (Tq != Tk, bottom-right aligned) */
    for (int causal = 0; causal < 2; causal++) {
        huge_attention_window_case(ctx, in, T, T, causal);
        huge_attention_window_case(ctx, in, 37, T, causal);
        huge_attention_window_case(ctx, in, T, 37, causal);
    }
    /* the sliding branch: a window of INT64_MAX is one of T, the whole prefix */
    size_t cw = 0, ch = 0;
    float *want = swa_outputs(ctx, in, T, T, &cw);
    static const int64_t huge[] = {INT64_MAX, INT64_MAX - 1, (int64_t)1 << 62, T + 1};
    for (size_t i = 0; i < sizeof huge / sizeof huge[0]; i++) {
        float *got = swa_outputs(ctx, in, T, huge[i], &ch);
        CHECK_MSG(ch == cw && memcmp(got, want, cw * sizeof(float)) == 0, "window huge == window T (sliding branch)");
        free(got);
    }
    free(want), free(in);
    nsa_context_destroy(ctx);
}

void test_safety_all(void)
{
    size_helpers_case();
    arena_case();
    block_count_case();
    /* the per-thread scratch holds G lse values, not only DV floats: 128 query heads per kv head */
    slc_case(8, 128, 1, 4, 64, "slc_attn G = 128, DV = 4 stays inside its workspace");
    slc_case(9, 64, 2, 8, 32, "slc_attn G = 32, DV = 8 stays inside its workspace");
    /* a selection block far longer than the sequence: scores sized by T, not by l' */
    slc_case(8, 2, 1, 4, (int64_t)INT32_MAX / 16 * 16, "slc_attn slc_block = 2^31 - 16 stays inside its workspace");
    slc_case(40, 4, 2, 8, (int64_t)1 << 30, "slc_attn slc_block = 2^30 stays inside its workspace");
    absent_output_case();
    workspace_overflow_case();
    huge_window_case();
}
