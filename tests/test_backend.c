/* test_backend.c -- the CPU backend against the float64 reference: the spec's edge cases
 * one by one (group "backend"), then a fixed-seed random sweep (group "sweep"; see
 * tests/kit/sweep.c for the tolerance rule). */
#define _DEFAULT_SOURCE /* mmap flags MAP_ANONYMOUS, MAP_NORESERVE */
#include <sys/mman.h>

#include "harness.h"
#include "ref.h"
#include "sweep.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A fully specified case: every field set, so nothing is drawn at random. */
static sweep_case edge(int64_t B, int64_t T, int64_t HQ, int64_t H, int64_t DK, int64_t DV, nsa_dtype dt)
{
    sweep_case c;
    memset(&c, 0, sizeof c);
    c.B = B, c.T = T, c.HQ = HQ, c.H = H, c.DK = DK, c.DV = DV, c.dtype = dt;
    c.cfg = nsa_config_default();
    c.gates = 7;
    return c;
}

static void test_edge_cases(nsa_context *ctx)
{
    uint64_t seed = 1000;
    sweep_case c;
    /* T = 1 */
    c = edge(1, 1, 4, 2, 16, 16, NSA_DTYPE_F32);
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    /* T < l: no compressed block anywhere (o_cmp = 0, lse = -inf, no NaN) */
    c = edge(2, 20, 4, 1, 16, 8, NSA_DTYPE_BF16);
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    /* n larger than the candidates everywhere (T = 200, l' = 64: at most 4 blocks) */
    c = edge(1, 200, 2, 1, 32, 32, NSA_DTYPE_F32);
    c.cfg.slc_topk = 16;
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    /* all-equal scores: q = 0, the tie rule decides every selection */
    c = edge(1, 300, 4, 2, 16, 16, NSA_DTYPE_F32);
    c.cfg.cmp_len = c.cfg.cmp_stride = c.cfg.slc_block = 16;
    c.cfg.slc_topk = 4;
    c.zero_q = 1;
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    /* varlen with empty and length-1 sequences, paper config */
    c = edge(1, 0, 4, 1, 16, 16, NSA_DTYPE_BF16);
    c.varlen = 1, c.num_seqs = 5;
    c.lens[0] = 0, c.lens[1] = 1, c.lens[2] = 150, c.lens[3] = 0, c.lens[4] = 77;
    c.T = 228;
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    /* strided views of every kind, both layouts, G = 16, DK != DV */
    c = edge(2, 65, 16, 1, 192 / 4, 128 / 4, NSA_DTYPE_BF16);
    c.strided = 1;
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    c.strided = 2;
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    /* fla's configuration l = d = l' = 64 with caller compression and caller selection */
    c = edge(1, 300, 2, 2, 32, 32, NSA_DTYPE_F32);
    c.cfg.cmp_len = c.cfg.cmp_stride = c.cfg.slc_block = 64;
    c.own_cmp = 1, c.own_idx = 1, c.sep_slc = 1, c.sep_swa = 1;
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    /* full head dims of the paper: 128/128 and 192/128, f16 storage */
    c = edge(1, 130, 2, 1, 128, 128, NSA_DTYPE_F16);
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    c = edge(1, 130, 2, 2, 192, 128, NSA_DTYPE_BF16);
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
}

static void test_finite_differences(nsa_context *ctx);
static void test_int64_offsets(nsa_context *ctx);

/* got [n] (f32) against the float64 reference: the same NaN / inf elements, the rest close. */
static void check_nonfinite_rows(const char *what, const float *got, const double *want, int64_t n)
{
    long bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const int gn = !isfinite(got[i]), wn = !isfinite(want[i]);
        bad += gn != wn || (!gn && fabs(got[i] - want[i]) > 1e-4 * (1.0 + fabs(want[i])));
    }
    char msg[160];
    snprintf(msg, sizeof msg, "%s: %ld of %lld elements differ from the reference in value or finiteness", what, bad,
             (long long)n);
    CHECK_MSG(bad == 0, msg);
}

/* A row's first key block whose visible scores are all -inf, followed by finite ones: dense
 * softmax gives those keys weight exp(-inf - max) = 0 and the row is finite; only a row with
 * no finite score is NaN. The online softmax once took exp(-inf - -inf) = NaN in that first
 * block (found by the non-finite sweep: selected attention with one-token blocks). */
static void test_neg_inf_first_block(nsa_context *ctx)
{
    test_rng r = {77};
    /* selected attention, one-token blocks, query t selects {0, t}: key 0 scores -inf for head 0
     * (q . k = +1 * -inf), +inf for head 1 (NaN row, as dense) */
    {
        enum { T = 6, HQ = 2, D = 16 };
        float q[T * HQ * D], k[T * D], v[T * D], o[T * HQ * D], lse[T * HQ];
        int32_t idx[T * 2];
        double qd[T * HQ * D], kd[T * D], vd[T * D], od[T * HQ * D], ld[T * HQ];
        for (int i = 0; i < T * HQ * D; i++) q[i] = (float)rng_normal(&r);
        for (int i = 0; i < T * D; i++) k[i] = (float)rng_normal(&r), v[i] = (float)rng_normal(&r);
        k[0] = -INFINITY;
        for (int t = 0; t < T; t++) {
            q[(t * HQ + 0) * D] = 1.0f, q[(t * HQ + 1) * D] = -1.0f;
            idx[t * 2] = 0, idx[t * 2 + 1] = t > 0 ? t : -1;
        }
        for (int i = 0; i < T * HQ * D; i++) qd[i] = q[i];
        for (int i = 0; i < T * D; i++) kd[i] = k[i], vd[i] = v[i];
        nsa_slc_attn_args a;
        memset(&a, 0, sizeof a);
        a.q = nsa_tensor_make(q, NSA_DTYPE_F32, 4, (int64_t[]){1, T, HQ, D});
        a.k = nsa_tensor_make(k, NSA_DTYPE_F32, 4, (int64_t[]){1, T, 1, D});
        a.v = nsa_tensor_make(v, NSA_DTYPE_F32, 4, (int64_t[]){1, T, 1, D});
        a.block_indices = nsa_tensor_make(idx, NSA_DTYPE_I32, 4, (int64_t[]){1, T, 1, 2});
        a.o = nsa_tensor_make(o, NSA_DTYPE_F32, 4, (int64_t[]){1, T, HQ, D});
        a.lse = nsa_tensor_make(lse, NSA_DTYPE_F32, 3, (int64_t[]){1, T, HQ});
        a.config = nsa_config_default();
        a.config.cmp_len = a.config.cmp_stride = a.config.slc_block = 1;
        a.config.slc_topk = 2, a.config.n_init = 0, a.config.n_local = 1;
        size_t need = 0;
        CHECK_STATUS(nsa_slc_attn_workspace_size(ctx, &a, &need), NSA_STATUS_SUCCESS);
        void *ws = malloc(need > 0 ? need : 1);
        CHECK_STATUS(nsa_slc_attn(ctx, &a, ws, need), NSA_STATUS_SUCCESS);
        free(ws);
        const ref_dims d = {T, HQ, 1, D, D};
        ref_slc_attn(&a.config, 1.0 / sqrt((double)D), d, qd, kd, vd, idx, 2, NULL, od, ld);
        check_nonfinite_rows("selected attention o, key 0 at -inf first", o, od, T * HQ * D);
        check_nonfinite_rows("selected attention lse, key 0 at -inf first", lse, ld, T * HQ);
        CHECK(isfinite(o[(3 * HQ + 0) * D]) && isnan(o[(3 * HQ + 1) * D])); /* the two rows the case is about */
    }
    /* dense causal attention over 80 keys: keys 0 .. 63 (the first 64-key block) score -inf for
     * every query, through the plain path and through the options' path (a zero bias) */
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        enum { T = 80, D = 16 };
        static float q[T * D], k[T * D], v[T * D], o[T * D], lse[T], bias[T * T];
        static double qd[T * D], kd[T * D], vd[T * D], od[T * D], ld[T];
        for (int i = 0; i < T * D; i++)
            q[i] = (float)rng_normal(&r), k[i] = (float)rng_normal(&r), v[i] = (float)rng_normal(&r);
        for (int t = 0; t < T; t++) {
            q[t * D] = 1.0f;
            if (t < 64) k[t * D] = -INFINITY;
        }
        for (int i = 0; i < T * D; i++) qd[i] = q[i], kd[i] = k[i], vd[i] = v[i];
        nsa_attention_args a;
        memset(&a, 0, sizeof a);
        a.q = nsa_tensor_make(q, NSA_DTYPE_F32, 4, (int64_t[]){1, T, 1, D});
        a.k = nsa_tensor_make(k, NSA_DTYPE_F32, 4, (int64_t[]){1, T, 1, D});
        a.v = nsa_tensor_make(v, NSA_DTYPE_F32, 4, (int64_t[]){1, T, 1, D});
        a.o = nsa_tensor_make(o, NSA_DTYPE_F32, 4, (int64_t[]){1, T, 1, D});
        a.lse = nsa_tensor_make(lse, NSA_DTYPE_F32, 3, (int64_t[]){1, T, 1});
        a.causal = 1, a.window_left = -1, a.window_right = -1;
        if (with_bias) a.bias = nsa_tensor_make(bias, NSA_DTYPE_F32, 4, (int64_t[]){1, 1, T, T});
        size_t need = 0;
        CHECK_STATUS(nsa_attention_workspace_size(ctx, &a, &need), NSA_STATUS_SUCCESS);
        void *ws = malloc(need > 0 ? need : 1);
        CHECK_STATUS(nsa_attention(ctx, &a, ws, need), NSA_STATUS_SUCCESS);
        free(ws);
        const ref_dims d = {T, 1, 1, D, D};
        ref_attention(1.0 / sqrt((double)D), 1, -1, -1, d, qd, kd, vd, od, ld);
        check_nonfinite_rows(with_bias ? "attention (bias) o, keys 0..63 at -inf" : "attention o, keys 0..63 at -inf", o, od,
                             T * D);
        check_nonfinite_rows(with_bias ? "attention (bias) lse" : "attention lse", lse, ld, T);
        CHECK(isnan(o[10 * D]) && isfinite(o[70 * D])); /* rows with and without a finite score */
    }
}

void test_backend_all(void)
{
    nsa_context *ctx = harness_cpu_context(0);
    CHECK(ctx != NULL);
    if (!ctx) return;
    test_edge_cases(ctx);
    test_neg_inf_first_block(ctx);
    test_finite_differences(ctx);
    test_int64_offsets(ctx);
    nsa_context_destroy(ctx);
}

/* The fixed-seed random sweep: a group of its own, with a progress line every ~10 s. */
void test_backend_sweep_all(void)
{
    sweep_opts o;
    memset(&o, 0, sizeof o);
    o.seed = 20261122;
    o.max_cases = 60;
    o.backend = NSA_BACKEND_CPU;
    o.verbose = g_tests_verbose ? 2 : 1;
    o.label = "sweep";
    sweep_run(&o);
}

/* The sweep's non-finite mode (sweep_set_nonfinite): NaN / inf planted in each op's inputs
 * must reach exactly the outputs the reference says, and nothing else. Short shapes keep the
 * group to a few seconds. */
void test_backend_nonfinite_all(void)
{
    sweep_opts o;
    memset(&o, 0, sizeof o);
    o.seed = 20260611;
    o.max_cases = 40;
    o.max_T = 64;
    o.backend = NSA_BACKEND_CPU;
    o.verbose = g_tests_verbose ? 2 : 1;
    o.label = "nonfinite";
    o.nonfinite = 1;
    o.threads = 1; /* tiny shapes: thread start-up would cost more than the work */
    sweep_run(&o);
}

/* ---- finite differences on the backend itself ------------------------------------------ */
/* loss = sum(o * w) for fixed random w; d loss / d x from nsa_backward must match the
 * central difference of nsa_forward (f32, tiny shape). The selection keeps every candidate
 * (n >= blocks), so a perturbation cannot flip it and the loss is smooth. */

typedef struct fd_problem {
    int64_t T, HQ, H, DK, DV, Nc;
    nsa_config cfg;
    float *q, *k, *v, *kc, *vc, *g[3];
    float *o, *so[3], *sl[3], *w;
    int32_t *idx;
    nsa_forward_args fa;
} fd_problem;

static float *fd_rand(test_rng *r, int64_t n, double lo, double hi)
{
    float *x = (float *)malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = (float)(lo + (hi - lo) * rng_uniform(r));
    return x;
}

static double fd_loss(nsa_context *ctx, fd_problem *f)
{
    size_t need = 0;
    nsa_forward_workspace_size(ctx, &f->fa, &need);
    void *ws = malloc(need > 0 ? need : 1);
    nsa_status st = nsa_forward(ctx, &f->fa, ws, need);
    free(ws);
    if (st != NSA_STATUS_SUCCESS) return NAN;
    double loss = 0;
    for (int64_t i = 0; i < f->T * f->HQ * f->DV; i++) loss += (double)f->o[i] * f->w[i];
    return loss;
}

static void test_finite_differences(nsa_context *ctx)
{
    test_rng r = {77};
    fd_problem f;
    memset(&f, 0, sizeof f);
    f.T = 13, f.HQ = 4, f.H = 2, f.DK = 6, f.DV = 5;
    f.cfg = nsa_config_default();
    f.cfg.cmp_len = 4, f.cfg.cmp_stride = 2, f.cfg.slc_block = 8, f.cfg.slc_topk = 3, f.cfg.n_init = 1, f.cfg.n_local = 1;
    f.cfg.window = 5;
    f.Nc = nsa_num_cmp_blocks(&f.cfg, f.T);
    const int64_t T = f.T, HQ = f.HQ, H = f.H, DK = f.DK, DV = f.DV;
    f.q = fd_rand(&r, T * HQ * DK, -1, 1), f.k = fd_rand(&r, T * H * DK, -1, 1), f.v = fd_rand(&r, T * H * DV, -1, 1);
    f.w = fd_rand(&r, T * HQ * DV, -1, 1);
    f.o = fd_rand(&r, T * HQ * DV, 0, 0);
    f.idx = (int32_t *)malloc((size_t)(T * H * f.cfg.slc_topk) * sizeof(int32_t));
    nsa_forward_args *a = &f.fa;
    a->q = nsa_tensor_4d(f.q, NSA_DTYPE_F32, 1, T, HQ, DK);
    a->k = nsa_tensor_4d(f.k, NSA_DTYPE_F32, 1, T, H, DK);
    a->v = nsa_tensor_4d(f.v, NSA_DTYPE_F32, 1, T, H, DV);
    nsa_tensor *gt[3] = {&a->g_cmp, &a->g_slc, &a->g_swa};
    nsa_tensor *st[3] = {&a->saved.o_cmp, &a->saved.o_slc, &a->saved.o_swa};
    nsa_tensor *lt[3] = {&a->saved.lse_cmp, &a->saved.lse_slc, &a->saved.lse_swa};
    for (int b = 0; b < 3; b++) {
        f.g[b] = fd_rand(&r, T * HQ, 0.2, 1);
        f.so[b] = fd_rand(&r, T * HQ * DV, 0, 0);
        f.sl[b] = fd_rand(&r, T * HQ, 0, 0);
        *gt[b] = nsa_tensor_3d(f.g[b], NSA_DTYPE_F32, 1, T, HQ);
        *st[b] = nsa_tensor_4d(f.so[b], NSA_DTYPE_F32, 1, T, HQ, DV);
        *lt[b] = nsa_tensor_3d(f.sl[b], NSA_DTYPE_F32, 1, T, HQ);
    }
    a->saved.block_indices = nsa_tensor_4d(f.idx, NSA_DTYPE_I32, 1, T, H, f.cfg.slc_topk);
    a->o = nsa_tensor_4d(f.o, NSA_DTYPE_F32, 1, T, HQ, DV);
    a->config = f.cfg;
    /* the backward's gradients at the unperturbed point */
    fd_loss(ctx, &f);
    nsa_backward_args b;
    memset(&b, 0, sizeof b);
    b.fwd = *a;
    float *dq = fd_rand(&r, T * HQ * DK, 0, 0), *dk = fd_rand(&r, T * H * DK, 0, 0), *dv = fd_rand(&r, T * H * DV, 0, 0);
    float *dg[3];
    b.dout = nsa_tensor_4d(f.w, NSA_DTYPE_F32, 1, T, HQ, DV);
    b.dq = nsa_tensor_4d(dq, NSA_DTYPE_F32, 1, T, HQ, DK);
    b.dk = nsa_tensor_4d(dk, NSA_DTYPE_F32, 1, T, H, DK);
    b.dv = nsa_tensor_4d(dv, NSA_DTYPE_F32, 1, T, H, DV);
    nsa_tensor *dgt[3] = {&b.dg_cmp, &b.dg_slc, &b.dg_swa};
    for (int x = 0; x < 3; x++) {
        dg[x] = fd_rand(&r, T * HQ, 0, 0);
        *dgt[x] = nsa_tensor_3d(dg[x], NSA_DTYPE_F32, 1, T, HQ);
    }
    size_t need = 0;
    CHECK_STATUS(nsa_backward_workspace_size(ctx, &b, &need), NSA_STATUS_SUCCESS);
    void *ws = malloc(need > 0 ? need : 1);
    CHECK_STATUS(nsa_backward(ctx, &b, ws, need), NSA_STATUS_SUCCESS);
    free(ws);
    struct { const char *name; float *x, *grad; int64_t n; } in[] = {
        {"q", f.q, dq, T * HQ * DK}, {"k", f.k, dk, T * H * DK}, {"v", f.v, dv, T * H * DV},
        {"g_cmp", f.g[0], dg[0], T * HQ}, {"g_slc", f.g[1], dg[1], T * HQ}, {"g_swa", f.g[2], dg[2], T * HQ},
    };
    const float h = 1e-2f;
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++) {
        double worst = 0, scale = 1e-3;
        for (int64_t e = 0; e < in[i].n; e++) scale = fmax(scale, fabs(in[i].grad[e]));
        for (int64_t e = 0; e < in[i].n; e++) {
            const float x0 = in[i].x[e];
            in[i].x[e] = x0 + h;
            double lp = fd_loss(ctx, &f);
            in[i].x[e] = x0 - h;
            double lm = fd_loss(ctx, &f);
            in[i].x[e] = x0;
            double fd = (lp - lm) / (2.0 * h);
            worst = fmax(worst, fabs(fd - in[i].grad[e]) / scale);
        }
        char msg[200];
        snprintf(msg, sizeof msg, "d loss / d %s: worst relative difference %.3g", in[i].name, worst);
        /* f32 forward noise ~1e-7 / h plus O(h^2) curvature: 2e-3 separates that from a bug */
        CHECK_MSG(worst < 2e-3, msg);
    }
    free(f.q), free(f.k), free(f.v), free(f.w), free(f.o), free(f.idx), free(dq), free(dk), free(dv);
    for (int x = 0; x < 3; x++) free(f.g[x]), free(f.so[x]), free(f.sl[x]), free(dg[x]);
}

/* ---- int64 offsets -------------------------------------------------------------------------- */
/* Batch 1 of every tensor starts 2^31 + 1021 elements after batch 0 (an 8 GiB jump in f32):
 * the same problem must give bitwise the results of a contiguous copy. The big buffers are
 * sparse mappings (MAP_NORESERVE), so only the touched pages cost memory. */

static void *sparse_alloc(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void test_int64_offsets(nsa_context *ctx)
{
    const int64_t B = 2, T = 70, HQ = 4, H = 2, D = 16, jump = ((int64_t)1 << 31) + 1021;
    const int64_t rowsQ = T * HQ * D, rowsK = T * H * D, rowsL = T * HQ;
    const size_t big = (size_t)(jump + rowsQ) * sizeof(float);
    struct { float *big, *small; int64_t per; int64_t shape[4]; int rank; } t[8];
    const int64_t shapes[8][4] = {{B, T, HQ, D}, {B, T, H, D}, {B, T, H, D}, {B, T, HQ, D},
                                  {B, T, HQ, 0}, {B, T, HQ, 0}, {B, T, HQ, D}, {B, T, HQ, 0}};
    const int64_t per[8] = {rowsQ, rowsK, rowsK, rowsQ, rowsL, rowsL, rowsQ, rowsL};
    test_rng r = {4242};
    int ok_alloc = 1;
    for (int i = 0; i < 8; i++) {
        t[i].per = per[i];
        t[i].rank = shapes[i][3] ? 4 : 3;
        memcpy(t[i].shape, shapes[i], sizeof t[i].shape);
        t[i].big = (float *)sparse_alloc(big);
        t[i].small = (float *)calloc((size_t)(B * per[i]), sizeof(float));
        if (!t[i].big || !t[i].small) ok_alloc = 0;
    }
    CHECK_MSG(ok_alloc, "could not map the sparse buffers");
    if (!ok_alloc) return;
    for (int i = 0; i < 8; i++)
        for (int64_t b = 0; b < B; b++)
            for (int64_t e = 0; e < per[i]; e++) {
                float v = i < 3 || i == 5 ? (float)rng_normal(&r) : 0.0f; /* q, k, v inputs; gate */
                if (i == 5) v = (float)(0.2 + 0.8 * rng_uniform(&r));
                t[i].small[b * per[i] + e] = v;
                t[i].big[b * jump + e] = v;
            }
    /* views: 0 q, 1 k, 2 v, 3 o, 4 lse, 5 gate, 6 saved o_swa, 7 (unused) */
    nsa_tensor vb[8], vs[8];
    for (int i = 0; i < 8; i++) {
        vs[i] = nsa_tensor_make(t[i].small, NSA_DTYPE_F32, t[i].rank, t[i].shape);
        vb[i] = nsa_tensor_make(t[i].big, NSA_DTYPE_F32, t[i].rank, t[i].shape);
        vb[i].stride[0] = jump;
    }
    for (int pass = 0; pass < 2; pass++) {
        nsa_tensor *v = pass ? vb : vs;
        nsa_forward_args a;
        memset(&a, 0, sizeof a);
        a.q = v[0], a.k = v[1], a.v = v[2], a.o = v[3], a.g_swa = v[5], a.saved.o_swa = v[6], a.saved.lse_swa = v[4];
        a.config = nsa_config_default();
        a.config.window = 9;
        size_t need = 0;
        CHECK_STATUS(nsa_forward_workspace_size(ctx, &a, &need), NSA_STATUS_SUCCESS);
        void *ws = malloc(need);
        CHECK_STATUS(nsa_forward(ctx, &a, ws, need), NSA_STATUS_SUCCESS);
        free(ws);
    }
    int same = 1;
    for (int i = 3; i < 7; i++)
        for (int64_t b = 0; b < B && same; b++)
            same = !memcmp(t[i].small + b * per[i], t[i].big + b * jump, (size_t)per[i] * sizeof(float));
    CHECK_MSG(same, "results differ when batch 1 lies 2^31 elements past batch 0");
    for (int i = 0; i < 8; i++) {
        munmap(t[i].big, big);
        free(t[i].small);
    }
}
