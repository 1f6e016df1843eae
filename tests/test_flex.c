/* test_flex.c -- block-sparse attention with mods (spec 14) on the CPU against a float64
 * reference that materialises the visible, modified score matrix from the block lists and C
 * versions of the mods: FlexAttention's example mods (causal, sliding window, prefix-LM,
 * document masking, ALiBi, softcap, a relative-position bias table, scores sent to -inf), random
 * block masks with partial and full blocks and broadcast batch / head dims, Tq != Tk, odd
 * lengths, GQA, dk != dv; then bad block masks and mods, refused by name with nothing written. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flex_route.h" /* the dense route's switch and count */
#include "harness.h"
#include "nsa.h"
#include "sweep.h" /* sweep_memory: the device's memory hooks (test_flex_on) */

enum { FB = 2, FHQ = 4, FH = 2, FDK = 12, FDV = 10, QBLK = 8, KBLK = 16 };

static int32_t g_doc[64], g_docs[64]; /* ids that come back; one run per id */
static float g_slope[FHQ], g_rel[FHQ][41];

typedef int (*mask_ref)(int64_t b, int64_t h, int64_t q, int64_t k);
typedef double (*score_ref)(double s, int64_t b, int64_t h, int64_t q, int64_t k);

static int m_causal(int64_t b, int64_t h, int64_t q, int64_t k) { (void)b, (void)h; return q >= k; }
static int m_window(int64_t b, int64_t h, int64_t q, int64_t k) { (void)b, (void)h; return q >= k && q - k < 10; }
static int m_prefix(int64_t b, int64_t h, int64_t q, int64_t k) { (void)b, (void)h; return k < 7 || q >= k; }
static int m_doc(int64_t b, int64_t h, int64_t q, int64_t k) { (void)h; return g_doc[q + b] == g_doc[k + b]; }
static int m_docs(int64_t b, int64_t h, int64_t q, int64_t k) { (void)b, (void)h; return g_docs[q] == g_docs[k]; }
static int m_docs_causal(int64_t b, int64_t h, int64_t q, int64_t k) { return m_docs(b, h, q, k) && q >= k; }
static int m_strict(int64_t b, int64_t h, int64_t q, int64_t k) { (void)b, (void)h; return q > k; }
static int m_band(int64_t b, int64_t h, int64_t q, int64_t k) { (void)b, (void)h; return llabs(q - k) <= 6; }
static int m_prefix_strict(int64_t b, int64_t h, int64_t q, int64_t k) { (void)b, (void)h; return k < 7 || q > k; }
static double s_alibi(double s, int64_t b, int64_t h, int64_t q, int64_t k) { (void)b; return s - g_slope[h] * (double)llabs(q - k); }
static double s_softcap(double s, int64_t b, int64_t h, int64_t q, int64_t k) { (void)b, (void)h, (void)q, (void)k; return 3.0 * tanh(s / 3.0); }
static double s_rel(double s, int64_t b, int64_t h, int64_t q, int64_t k)
{
    (void)b;
    int64_t i = q - k + 20;
    i = i < 0 ? 0 : i > 40 ? 40 : i;
    return s + g_rel[h][i];
}
static double s_hide(double s, int64_t b, int64_t h, int64_t q, int64_t k)
{
    (void)b, (void)h;
    return (k % 3 == 0 || q == 5) ? -INFINITY : s * 2.0;
}

/* The score_mod's derivative in the product u, and its one tensor read (capture index, element,
 * derivative; capture -1: none) at a pair. */
typedef double (*dscore_ref)(double u, int64_t b, int64_t h, int64_t q, int64_t k);
typedef int (*dcap_ref)(int64_t b, int64_t h, int64_t q, int64_t k, int64_t *elem, double *deriv);

static double d_one(double u, int64_t b, int64_t h, int64_t q, int64_t k) { (void)u, (void)b, (void)h, (void)q, (void)k; return 1.0; }
static double d_two(double u, int64_t b, int64_t h, int64_t q, int64_t k) { (void)u, (void)b, (void)h, (void)q, (void)k; return 2.0; }
static double d_softcap(double u, int64_t b, int64_t h, int64_t q, int64_t k)
{
    (void)b, (void)h, (void)q, (void)k;
    const double t = tanh(u / 3.0);
    return 1.0 - t * t;
}
static int c_alibi(int64_t b, int64_t h, int64_t q, int64_t k, int64_t *elem, double *deriv)
{
    (void)b;
    *elem = h, *deriv = -(double)llabs(q - k);
    return 1; /* slope */
}
static int c_rel(int64_t b, int64_t h, int64_t q, int64_t k, int64_t *elem, double *deriv)
{
    (void)b;
    int64_t i = q - k + 20;
    i = i < 0 ? 0 : i > 40 ? 40 : i;
    *elem = h * 41 + i, *deriv = 1.0;
    return 2; /* rel */
}

typedef struct flex_case {
    const char *name;
    const char *mask_text, *score_text;
    mask_ref mask;
    score_ref score;
    int blocks;      /* 0: no block mask; 1: random partial / full lists; 2: nsa_create_block_mask's from the mask_mod;
                        3: that one less a needed block; 4: that one with a partial block listed as full */
    int64_t Tq, Tk;
    int bm, hm;      /* block-mask batch and head dims: 1 or full */
    dscore_ref dscore; /* NULL: the identity */
    dcap_ref dcap;     /* NULL: no tensor gradient */
    int64_t B;         /* 0: FB */
    int route;         /* the dense route: 0 not checked, 1 taken by the forward and the backward, 2 by neither */
} flex_case;

static double rnd_u(test_rng *r) { return rng_uniform(r) * 2.0 - 1.0; }

/* A random block mask: each (b, h, query block) lists each key block as partial, full or not. */
typedef struct bmask {
    int32_t *num, *idx, *fnum, *fidx;
    int64_t nqb, nkb, Bm, Hm;
} bmask;

static void bmask_make(bmask *m, test_rng *r, int64_t Bm, int64_t Hm, int64_t nqb, int64_t nkb)
{
    m->Bm = Bm, m->Hm = Hm, m->nqb = nqb, m->nkb = nkb;
    const size_t rows = (size_t)(Bm * Hm * nqb);
    m->num = (int32_t *)calloc(rows, 4), m->fnum = (int32_t *)calloc(rows, 4);
    m->idx = (int32_t *)calloc(rows * (size_t)nkb + 1, 4), m->fidx = (int32_t *)calloc(rows * (size_t)nkb + 1, 4);
    for (size_t row = 0; row < rows; row++) {
        int32_t order[64];
        for (int64_t j = 0; j < nkb; j++) order[j] = (int32_t)j;
        for (int64_t j = nkb - 1; j > 0; j--) { /* listed in a shuffled order */
            const int64_t x = rng_int(r, 0, j);
            const int32_t t = order[j];
            order[j] = order[x], order[x] = t;
        }
        for (int64_t e = 0; e < nkb; e++) {
            const int kind = (int)rng_int(r, 0, 2); /* 0 absent, 1 partial, 2 full */
            if (kind == 1) m->idx[row * (size_t)nkb + (size_t)m->num[row]++] = order[e];
            if (kind == 2) m->fidx[row * (size_t)nkb + (size_t)m->fnum[row]++] = order[e];
        }
        for (int64_t e = m->num[row]; e < nkb; e++) m->idx[row * (size_t)nkb + (size_t)e] = 777; /* past the count: never read */
    }
}

static void bmask_free(bmask *m) { free(m->num), free(m->idx), free(m->fnum), free(m->fidx); }

/* Is key block j of (b, h, query block qb) listed: 0 no, 1 partial, 2 full. */
static int listed(const bmask *m, int64_t b, int64_t h, int64_t qb, int64_t j)
{
    const size_t row = (size_t)((((m->Bm == 1 ? 0 : b) * m->Hm) + (m->Hm == 1 ? 0 : h)) * m->nqb + qb);
    for (int32_t e = 0; e < m->num[row]; e++)
        if (m->idx[row * (size_t)m->nkb + (size_t)e] == j) return 1;
    for (int32_t e = 0; e < m->fnum[row]; e++)
        if (m->fidx[row * (size_t)m->nkb + (size_t)e] == j) return 2;
    return 0;
}

static void run_case(nsa_context *ctx, const flex_case *c, test_rng *r)
{
    const int64_t B = c->B ? c->B : FB, Tq = c->Tq, Tk = c->Tk, G = FHQ / FH, nqb = (Tq + QBLK - 1) / QBLK, nkb = (Tk + KBLK - 1) / KBLK;
    float *q = (float *)malloc(sizeof(float) * (size_t)(B * Tq * FHQ * FDK + 1));
    float *k = (float *)malloc(sizeof(float) * (size_t)(B * Tk * FH * FDK + 1));
    float *v = (float *)malloc(sizeof(float) * (size_t)(B * Tk * FH * FDV + 1));
    float *o = (float *)malloc(sizeof(float) * (size_t)(B * Tq * FHQ * FDV + 1));
    float *lse = (float *)malloc(sizeof(float) * (size_t)(B * Tq * FHQ + 1));
    for (int64_t i = 0; i < B * Tq * FHQ * FDK; i++) q[i] = (float)rnd_u(r);
    for (int64_t i = 0; i < B * Tk * FH * FDK; i++) k[i] = (float)rnd_u(r);
    for (int64_t i = 0; i < B * Tk * FH * FDV; i++) v[i] = (float)rnd_u(r);
    bmask m;
    bmask_make(&m, r, c->bm, c->hm, nqb, nkb);
    const int64_t dsl = 64;
    const nsa_mod_tensor tens[] = {
        {"doc", nsa_tensor_make(g_doc, NSA_DTYPE_I32, 1, &dsl)},
        {"slope", nsa_tensor_make(g_slope, NSA_DTYPE_F32, 1, (int64_t[]){FHQ})},
        {"rel", nsa_tensor_make(g_rel, NSA_DTYPE_F32, 2, (int64_t[]){FHQ, 41})},
        {"docs", nsa_tensor_make(g_docs, NSA_DTYPE_I32, 1, &dsl)},
    };
    nsa_mod *mm = NULL, *sm = NULL;
    if (c->mask_text) CHECK_STATUS(nsa_mod_create(&mm, NSA_MOD_MASK, c->mask_text, tens, 4), NSA_STATUS_SUCCESS);
    if (c->score_text) CHECK_STATUS(nsa_mod_create(&sm, NSA_MOD_SCORE, c->score_text, tens, 4), NSA_STATUS_SUCCESS);
    if (c->blocks >= 2) { /* the exact lists of the mask_mod, as FlexAttention's create_block_mask makes them */
        nsa_block_mask bm = {QBLK, KBLK, nsa_tensor_3d(m.num, NSA_DTYPE_I32, c->bm, c->hm, nqb),
                             nsa_tensor_4d(m.idx, NSA_DTYPE_I32, c->bm, c->hm, nqb, nkb),
                             nsa_tensor_3d(m.fnum, NSA_DTYPE_I32, c->bm, c->hm, nqb),
                             nsa_tensor_4d(m.fidx, NSA_DTYPE_I32, c->bm, c->hm, nqb, nkb)};
        CHECK_STATUS(nsa_create_block_mask(mm, Tq, Tk, &bm), NSA_STATUS_SUCCESS);
        const int64_t row = nqb / 2; /* a middle query block of (b, h) = (0, 0) */
        if (c->blocks == 3) { /* drop a block some pair of it is visible in: the lists no longer cover the mod */
            if (m.num[row] > 0) m.num[row]--;
            else if (m.fnum[row] > 0) m.fnum[row]--;
        }
        if (c->blocks == 4 && m.num[row] > 0) { /* a partial block listed as full: its hidden pairs become visible */
            m.fidx[row * nkb + m.fnum[row]++] = m.idx[row * nkb + --m.num[row]];
        }
    }
    nsa_flex_args a;
    memset(&a, 0, sizeof a);
    a.q = nsa_tensor_4d(q, NSA_DTYPE_F32, B, Tq, FHQ, FDK);
    a.k = nsa_tensor_4d(k, NSA_DTYPE_F32, B, Tk, FH, FDK);
    a.v = nsa_tensor_4d(v, NSA_DTYPE_F32, B, Tk, FH, FDV);
    a.o = nsa_tensor_4d(o, NSA_DTYPE_F32, B, Tq, FHQ, FDV);
    a.lse = nsa_tensor_3d(lse, NSA_DTYPE_F32, B, Tq, FHQ);
    a.block_mask.q_block = QBLK, a.block_mask.kv_block = KBLK;
    if (c->blocks) {
        a.block_mask.kv_num_blocks = nsa_tensor_3d(m.num, NSA_DTYPE_I32, c->bm, c->hm, nqb);
        a.block_mask.kv_indices = nsa_tensor_4d(m.idx, NSA_DTYPE_I32, c->bm, c->hm, nqb, nkb);
        a.block_mask.full_kv_num_blocks = nsa_tensor_3d(m.fnum, NSA_DTYPE_I32, c->bm, c->hm, nqb);
        a.block_mask.full_kv_indices = nsa_tensor_4d(m.fidx, NSA_DTYPE_I32, c->bm, c->hm, nqb, nkb);
    }
    a.mask_mod = mm, a.score_mod = sm, a.scale = 0.4f;
    size_t need = 0;
    const long routed0 = flex_route_taken();
    CHECK_STATUS(nsa_flex_attention_workspace_size(ctx, &a, &need), NSA_STATUS_SUCCESS);
    void *ws = malloc(need ? need : 1);
    CHECK_STATUS(nsa_flex_attention(ctx, &a, ws, need), NSA_STATUS_SUCCESS);
    free(ws);
    const long routed_fwd = flex_route_taken() - routed0;
    double worst = 0.0;
    long empty = 0, lse_bad = 0;
    double *s = (double *)malloc(sizeof(double) * (size_t)Tk);
    for (int64_t b = 0; b < B; b++)
        for (int64_t hq = 0; hq < FHQ; hq++)
            for (int64_t i = 0; i < Tq; i++) {
                double mx = -INFINITY;
                for (int64_t j = 0; j < Tk; j++) {
                    const int l = c->blocks ? listed(&m, b, hq, i / QBLK, j / KBLK) : 1;
                    s[j] = -INFINITY;
                    if (!l || (l == 1 && c->mask && !c->mask(b, hq, i, j))) continue;
                    double d = 0.0;
                    for (int64_t e = 0; e < FDK; e++)
                        d += (double)q[((b * Tq + i) * FHQ + hq) * FDK + e] * (double)k[((b * Tk + j) * FH + hq / G) * FDK + e];
                    d *= 0.4;
                    s[j] = c->score ? c->score(d, b, hq, i, j) : d;
                    mx = s[j] > mx ? s[j] : mx;
                }
                double den = 0.0, acc[FDV] = {0};
                if (mx > -INFINITY)
                    for (int64_t j = 0; j < Tk; j++) {
                        const double w = exp(s[j] - mx);
                        den += w;
                        for (int64_t e = 0; e < FDV; e++) acc[e] += w * (double)v[((b * Tk + j) * FH + hq / G) * FDV + e];
                    }
                const float *orow = o + ((b * Tq + i) * FHQ + hq) * FDV;
                for (int64_t e = 0; e < FDV; e++) {
                    const double want = den > 0.0 ? acc[e] / den : 0.0, d = fabs((double)orow[e] - want);
                    worst = d > worst || d != d ? d : worst;
                }
                const float got_lse = lse[(b * Tq + i) * FHQ + hq];
                if (den > 0.0) {
                    const double d = fabs((double)got_lse - (mx + log(den)));
                    worst = d > worst || d != d ? d : worst;
                } else {
                    empty++;
                    lse_bad += got_lse != -INFINITY;
                }
            }
    char msg[300];
    snprintf(msg, sizeof msg, "flex, %s: worst |o, lse - float64| %.3g, %ld empty rows, %ld empty rows without lse -inf", c->name,
             worst, empty, lse_bad);
    CHECK_MSG(worst <= 2e-5 && lse_bad == 0, msg);
    if (g_tests_verbose) printf("  %s\n", msg);

    /* the backward: dq, dk, dv and the score_mod's tensor gradients against the float64 chain rule */
    const size_t nq = (size_t)(B * Tq * FHQ), nk = (size_t)(B * Tk * FH);
    float *dout = (float *)malloc(sizeof(float) * (nq * FDV + 1)), *dq = (float *)malloc(sizeof(float) * (nq * FDK + 1));
    float *dk = (float *)malloc(sizeof(float) * (nk * FDK + 1)), *dv = (float *)malloc(sizeof(float) * (nk * FDV + 1));
    double *rq = (double *)calloc(nq * FDK + 1, sizeof(double)), *rk = (double *)calloc(nk * FDK + 1, sizeof(double));
    double *rv = (double *)calloc(nk * FDV + 1, sizeof(double)), rcap[3][FHQ * 41];
    float dslope[FHQ], drel[FHQ][41];
    memset(rcap, 0, sizeof rcap);
    for (size_t e = 0; e < nq * FDV; e++) dout[e] = (float)rnd_u(r);
    nsa_flex_bwd_args g;
    memset(&g, 0, sizeof g);
    g.fwd = a;
    g.dout = nsa_tensor_4d(dout, NSA_DTYPE_F32, B, Tq, FHQ, FDV);
    g.dq = nsa_tensor_4d(dq, NSA_DTYPE_F32, B, Tq, FHQ, FDK);
    g.dk = nsa_tensor_4d(dk, NSA_DTYPE_F32, B, Tk, FH, FDK);
    g.dv = nsa_tensor_4d(dv, NSA_DTYPE_F32, B, Tk, FH, FDV);
    const int want_dt = sm && c->route != 1; /* (a tensor gradient asked keeps the engine) */
    if (want_dt) {
        g.dscore_tensors[1] = nsa_tensor_make(dslope, NSA_DTYPE_F32, 1, (int64_t[]){FHQ});
        g.dscore_tensors[2] = nsa_tensor_make(drel, NSA_DTYPE_F32, 2, (int64_t[]){FHQ, 41});
    }
    CHECK_STATUS(nsa_flex_attention_bwd_workspace_size(ctx, &g, &need), NSA_STATUS_SUCCESS);
    ws = malloc(need ? need : 1);
    const long routed1 = flex_route_taken();
    CHECK_STATUS(nsa_flex_attention_bwd(ctx, &g, ws, need), NSA_STATUS_SUCCESS);
    free(ws);
    if (c->route) { /* which path each call took */
        const long want = c->route == 1 && flex_route_enabled();
        snprintf(msg, sizeof msg, "flex, %s: the dense route taken by the forward %ld, the backward %ld (want %ld)", c->name,
                 routed_fwd, flex_route_taken() - routed1, want);
        CHECK_MSG(routed_fwd == want && flex_route_taken() - routed1 == want, msg);
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t hq = 0; hq < FHQ; hq++)
            for (int64_t i = 0; i < Tq; i++) {
                double mx = -INFINITY, den = 0.0, u[64], P[64], o_row[FDV] = {0}, D = 0.0;
                for (int64_t j = 0; j < Tk; j++) {
                    const int l = c->blocks ? listed(&m, b, hq, i / QBLK, j / KBLK) : 1;
                    s[j] = -INFINITY;
                    if (!l || (l == 1 && c->mask && !c->mask(b, hq, i, j))) continue;
                    double d = 0.0;
                    for (int64_t e = 0; e < FDK; e++)
                        d += (double)q[((b * Tq + i) * FHQ + hq) * FDK + e] * (double)k[((b * Tk + j) * FH + hq / G) * FDK + e];
                    u[j] = d * 0.4;
                    s[j] = c->score ? c->score(u[j], b, hq, i, j) : u[j];
                    mx = s[j] > mx ? s[j] : mx;
                }
                if (mx == -INFINITY) continue;
                for (int64_t j = 0; j < Tk; j++) den += (P[j] = exp(s[j] - mx));
                for (int64_t j = 0; j < Tk; j++) {
                    P[j] /= den;
                    for (int64_t e = 0; e < FDV; e++) o_row[e] += P[j] * (double)v[((b * Tk + j) * FH + hq / G) * FDV + e];
                }
                const float *dor = dout + ((b * Tq + i) * FHQ + hq) * FDV;
                for (int64_t e = 0; e < FDV; e++) D += (double)dor[e] * o_row[e];
                for (int64_t j = 0; j < Tk; j++) {
                    if (P[j] == 0.0) continue;
                    const int64_t kv = (b * Tk + j) * FH + hq / G;
                    double dP = 0.0;
                    for (int64_t e = 0; e < FDV; e++) dP += (double)dor[e] * (double)v[kv * FDV + e], rv[kv * FDV + e] += P[j] * dor[e];
                    const double dS = P[j] * (dP - D);
                    const double dU = dS * (c->dscore ? c->dscore(u[j], b, hq, i, j) : 1.0);
                    for (int64_t e = 0; e < FDK; e++) {
                        rq[((b * Tq + i) * FHQ + hq) * FDK + e] += dU * 0.4 * (double)k[kv * FDK + e];
                        rk[kv * FDK + e] += dU * 0.4 * (double)q[((b * Tq + i) * FHQ + hq) * FDK + e];
                    }
                    int64_t elem;
                    double deriv;
                    if (c->dcap) {
                        const int ci = c->dcap(b, hq, i, j, &elem, &deriv);
                        rcap[ci][elem] += dS * deriv;
                    }
                }
            }
    double gworst = 0.0, gmax = 1.0;
    const struct { const float *x; const double *y; size_t n; } cmp[] = {{dq, rq, nq * FDK}, {dk, rk, nk * FDK}, {dv, rv, nk * FDV}};
    for (int t = 0; t < 3; t++)
        for (size_t e = 0; e < cmp[t].n; e++) {
            const double d = fabs((double)cmp[t].x[e] - cmp[t].y[e]);
            gworst = d > gworst || d != d ? d : gworst;
            gmax = fabs(cmp[t].y[e]) > gmax ? fabs(cmp[t].y[e]) : gmax;
        }
    if (want_dt) {
        for (int e = 0; e < FHQ; e++) {
            const double d = fabs((double)dslope[e] - rcap[1][e]);
            gworst = d > gworst || d != d ? d : gworst;
        }
        for (int e = 0; e < FHQ * 41; e++) {
            const double d = fabs((double)(&drel[0][0])[e] - rcap[2][e]);
            gworst = d > gworst || d != d ? d : gworst;
        }
    }
    snprintf(msg, sizeof msg, "flex backward, %s: worst |dq, dk, dv, dtensors - float64| %.3g (largest gradient %.3g)", c->name,
             gworst, gmax);
    CHECK_MSG(gworst <= 2e-5 * gmax, msg);
    if (g_tests_verbose) printf("  %s\n", msg);
    if (c->dcap == c_alibi) { /* the slope gradient by central differences of the library's own forward */
        double loss[2];
        const float keep = g_slope[1], eps = 3e-3f;
        for (int side = 0; side < 2; side++) {
            g_slope[1] = keep + (side ? eps : -eps);
            CHECK_STATUS(nsa_flex_attention_workspace_size(ctx, &a, &need), NSA_STATUS_SUCCESS);
            ws = malloc(need ? need : 1);
            CHECK_STATUS(nsa_flex_attention(ctx, &a, ws, need), NSA_STATUS_SUCCESS);
            free(ws);
            loss[side] = 0.0;
            for (size_t e = 0; e < nq * FDV; e++) loss[side] += (double)o[e] * (double)dout[e];
        }
        g_slope[1] = keep;
        const double fd = (loss[1] - loss[0]) / (2.0 * eps);
        snprintf(msg, sizeof msg, "flex, %s: dslope[1] %.6g, central differences %.6g", c->name, (double)dslope[1], fd);
        CHECK_MSG(fabs(fd - dslope[1]) <= 2e-3 * (1.0 + fabs(fd)), msg);
        if (g_tests_verbose) printf("  %s\n", msg);
    }
    free(dout), free(dq), free(dk), free(dv), free(rq), free(rk), free(rv);
    nsa_mod_destroy(mm), nsa_mod_destroy(sm);
    bmask_free(&m);
    free(s), free(q), free(k), free(v), free(o), free(lse);
}

/* The tensors the cases' mods read: document ids, ALiBi slopes, a relative-bias table. */
static void fill_mod_tables(void)
{
    for (int i = 0; i < 64; i++) g_doc[i] = (i * 7 / 23) % 4, g_docs[i] = 9 - i / 11; /* (runs of 11, ids falling) */
    for (int h = 0; h < FHQ; h++) {
        g_slope[h] = 1.0f / (float)(1 << (h + 1));
        for (int j = 0; j < 41; j++) g_rel[h][j] = (float)((j * 5 + h) % 11 - 5) * 0.1f;
    }
}

static void test_flex_equals_reference(nsa_context *ctx)
{
    test_rng r = {20261128};
    fill_mod_tables();
    const flex_case cases[] = {
        {"causal mask_mod, no block mask", "q_idx >= kv_idx", NULL, m_causal, NULL, 0, 37, 37, 1, 1, NULL, NULL, 0, 0},
        {"sliding window 10", "q_idx >= kv_idx && q_idx - kv_idx < 10", NULL, m_window, NULL, 0, 45, 45, 1, 1, NULL, NULL, 0, 0},
        {"prefix-LM, Tq != Tk", "kv_idx < 7 || q_idx >= kv_idx", NULL, m_prefix, NULL, 0, 29, 45, 1, 1, NULL, NULL, 0, 0},
        {"documents + ALiBi, random blocks", "doc[q_idx + b] == doc[kv_idx + b]", "score - slope[h] * abs(q_idx - kv_idx)",
         m_doc, s_alibi, 1, 37, 45, FB, FHQ, d_one, c_alibi, 0, 0},
        {"softcap, random blocks broadcast over b", NULL, "3.0 * tanh(score / 3.0)", NULL, s_softcap, 1, 40, 33, 1, FHQ, d_softcap,
         NULL, 0, 0},
        {"relative bias table (clamped), blocks broadcast over h", "q_idx >= kv_idx", "score + rel[h, q_idx - kv_idx + 20]",
         m_causal, s_rel, 1, 45, 45, FB, 1, d_one, c_rel, 0, 0},
        {"scores sent to -inf, empty rows", NULL, "where(kv_idx % 3 == 0 || q_idx == 5, -exp(1000.0), score * 2)", NULL, s_hide, 1,
         23, 30, 1, 1, d_two, NULL, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(ctx, &cases[i], &r);
}

/* The dense route (spec 14): mods that are nsa_attention options, with block masks that visit
 * what they see, run on the attention kernels -- each case twice, route on and off, both against
 * the float64 reference, the path each call took counted; near misses keep the engine. */
static void test_flex_dense_route(nsa_context *ctx)
{
    fill_mod_tables();
    const flex_case cases[] = {
        {"route: causal, create_block_mask's lists", "q_idx >= kv_idx", NULL, m_causal, NULL, 2, 45, 45, 1, 1, NULL, NULL, 0, 1},
        {"route: window 10 as FlexAttention writes it, lists per (b, h)", "(q_idx >= kv_idx) & ((q_idx - kv_idx) < 10)", NULL,
         m_window, NULL, 2, 45, 45, FB, FHQ, NULL, NULL, 0, 1},
        {"route: window 10, the other operand order", "kv_idx <= q_idx && kv_idx - q_idx > -10", NULL, m_window, NULL, 2, 37, 37, 1,
         1, NULL, NULL, 0, 1},
        {"route: both sides, abs(q_idx - kv_idx) <= 6, no block mask", "abs(q_idx - kv_idx) <= 6", NULL, m_band, NULL, 0, 41, 41, 1,
         1, NULL, NULL, 0, 1},
        {"route: documents (one run each), causal", "(docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)", NULL, m_docs_causal, NULL,
         2, 50, 50, 1, 1, NULL, NULL, 1, 1},
        {"route: documents, both directions, no block mask", "docs[kv_idx] == docs[q_idx]", NULL, m_docs, NULL, 0, 43, 43, 1, 1,
         NULL, NULL, 1, 1},
        {"route: softcap, causal lists", "q_idx >= kv_idx", "3.0 * tanh(score / 3.0)", m_causal, s_softcap, 2, 40, 40, 1, 1,
         d_softcap, NULL, 0, 1},
        {"route: softcap with int constants, no mask", NULL, "tanh(score / 3) * 3", NULL, s_softcap, 0, 33, 33, 1, 1, d_softcap,
         NULL, 0, 1},
        {"no route: a needed block dropped", "q_idx >= kv_idx", NULL, m_causal, NULL, 3, 45, 45, 1, 1, NULL, NULL, 0, 2},
        {"no route: a partial block listed as full", "q_idx >= kv_idx", NULL, m_causal, NULL, 4, 45, 45, 1, 1, NULL, NULL, 0, 2},
        {"no route: document ids that come back", "doc[q_idx] == doc[kv_idx]", NULL, m_doc, NULL, 0, 40, 40, 1, 1, NULL, NULL, 1,
         2},
        {"no route: documents with B = 2", "docs[q_idx] == docs[kv_idx]", NULL, m_docs, NULL, 0, 40, 40, 1, 1, NULL, NULL, 2, 2},
        {"no route: Tq != Tk", "q_idx >= kv_idx", NULL, m_causal, NULL, 2, 29, 45, 1, 1, NULL, NULL, 0, 2},
        {"no route: q_idx > kv_idx", "q_idx > kv_idx", NULL, m_strict, NULL, 2, 37, 37, 1, 1, NULL, NULL, 0, 2},
        {"no route: prefix-LM (its lists from the rows' intervals)", "kv_idx < 7 || q_idx >= kv_idx", NULL, m_prefix, NULL, 2, 37,
         37, 1, 1, NULL, NULL, 0, 2},
    };
    const int was = flex_route_enabled();
    flex_route_set_enabled(1);
    { /* which mods the route takes without lists: options (2: with a document mask, given its runs) */
        static const struct { const char *mask, *score; int want; } forms[] = {
            {NULL, NULL, 1},
            {"q_idx >= kv_idx", NULL, 1},
            {"(q_idx >= kv_idx) & ((q_idx - kv_idx) < 10)", "3.0 * tanh(score / 3.0)", 1},
            {"abs(q_idx - kv_idx) <= 6", NULL, 1},
            {"(docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)", NULL, 2}, /* (with the ids' runs) */
            {"kv_idx < 7 || q_idx >= kv_idx", NULL, 0},                       /* prefix-LM: no option */
            {"q_idx > kv_idx", NULL, 0},
            {"q_idx >= kv_idx", "score - slope[h] * abs(q_idx - kv_idx)", 0},
        };
        int32_t docs[4] = {0, 0, 1, 1};
        float slope[FHQ] = {0.5f, 0.25f, 0.125f, 0.0625f};
        const nsa_mod_tensor tens[] = {{"docs", nsa_tensor_make(docs, NSA_DTYPE_I32, 1, (int64_t[]){4})},
                                       {"slope", nsa_tensor_make(slope, NSA_DTYPE_F32, 1, (int64_t[]){FHQ})}};
        for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
            nsa_mod *mm = NULL, *sm = NULL;
            if (forms[i].mask) CHECK_STATUS(nsa_mod_create(&mm, NSA_MOD_MASK, forms[i].mask, tens, 2), NSA_STATUS_SUCCESS);
            if (forms[i].score) CHECK_STATUS(nsa_mod_create(&sm, NSA_MOD_SCORE, forms[i].score, tens, 2), NSA_STATUS_SUCCESS);
            char msg[200];
            snprintf(msg, sizeof msg, "nsa_flex_route_without_lists(%s, %s) is %d", forms[i].mask ? forms[i].mask : "NULL",
                     forms[i].score ? forms[i].score : "NULL", forms[i].want);
            CHECK_MSG(nsa_flex_route_without_lists(mm, sm) == forms[i].want, msg);
            flex_route_set_enabled(0);
            CHECK_MSG(nsa_flex_route_without_lists(mm, sm) == 0, "nsa_flex_route_without_lists: 0 with the route off");
            flex_route_set_enabled(1);
            nsa_mod_destroy(mm), nsa_mod_destroy(sm);
        }
    }
    { /* a document mask given its runs (doc_runs, from nsa_flex_doc_runs): the route takes them instead of
         reading the ids, and computes what it computes from the ids, bit for bit */
        enum { T = 50 };
        const int64_t dsl = 64;
        const nsa_mod_tensor tens[] = {{"doc", nsa_tensor_make(g_doc, NSA_DTYPE_I32, 1, &dsl)},
                                       {"docs", nsa_tensor_make(g_docs, NSA_DTYPE_I32, 1, &dsl)}};
        nsa_mod *mm = NULL, *ret = NULL, *plain = NULL;
        CHECK_STATUS(nsa_mod_create(&mm, NSA_MOD_MASK, "(docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)", tens, 2),
                     NSA_STATUS_SUCCESS);
        CHECK_STATUS(nsa_mod_create(&ret, NSA_MOD_MASK, "doc[q_idx] == doc[kv_idx]", tens, 2), NSA_STATUS_SUCCESS);
        CHECK_STATUS(nsa_mod_create(&plain, NSA_MOD_MASK, "q_idx >= kv_idx", tens, 2), NSA_STATUS_SUCCESS);
        int32_t runs[T + 1], ids = -1;
        CHECK(nsa_flex_doc_runs(mm, T, runs, &ids) == 5 && ids == 1);
        CHECK(runs[0] == 0 && runs[1] == 11 && runs[4] == 44 && runs[5] == T);
        CHECK(nsa_flex_doc_runs(ret, T, runs, NULL) == 0);   /* ids that come back: no runs */
        CHECK(nsa_flex_doc_runs(plain, T, runs, NULL) == 0); /* no document mask */
        CHECK(nsa_flex_doc_runs(mm, 65, runs, NULL) == 0);   /* fewer ids than rows */
        CHECK(nsa_flex_doc_runs(mm, T, runs, NULL) == 5);
        static float q[T * FHQ * FDK], k[T * FH * FDK], v[T * FH * FDV], o[2][T * FHQ * FDV];
        test_rng r = {17};
        for (int i = 0; i < T * FHQ * FDK; i++) q[i] = (float)rnd_u(&r);
        for (int i = 0; i < T * FH * FDK; i++) k[i] = (float)rnd_u(&r);
        for (int i = 0; i < T * FH * FDV; i++) v[i] = (float)rnd_u(&r);
        nsa_flex_args a;
        memset(&a, 0, sizeof a);
        a.q = nsa_tensor_4d(q, NSA_DTYPE_F32, 1, T, FHQ, FDK), a.k = nsa_tensor_4d(k, NSA_DTYPE_F32, 1, T, FH, FDK);
        a.v = nsa_tensor_4d(v, NSA_DTYPE_F32, 1, T, FH, FDV);
        a.block_mask.q_block = QBLK, a.block_mask.kv_block = KBLK, a.mask_mod = mm;
        for (int given = 0; given < 2; given++) {
            a.o = nsa_tensor_4d(o[given], NSA_DTYPE_F32, 1, T, FHQ, FDV);
            a.doc_runs = given ? runs : NULL, a.num_doc_runs = given ? 5 : 0;
            size_t need = 0;
            CHECK_STATUS(nsa_flex_attention_workspace_size(ctx, &a, &need), NSA_STATUS_SUCCESS);
            void *ws = malloc(need ? need : 1);
            const long before = flex_route_taken();
            CHECK_STATUS(nsa_flex_attention(ctx, &a, ws, need), NSA_STATUS_SUCCESS);
            CHECK(flex_route_taken() - before == 1);
            free(ws);
        }
        CHECK_MSG(memcmp(o[0], o[1], sizeof o[0]) == 0, "flex: the route with doc_runs computes what it computes from the ids");
        nsa_mod_destroy(mm), nsa_mod_destroy(ret), nsa_mod_destroy(plain);
    }
    { /* an infinite q keeps the engine without a softcap (a row of -inf scores is empty there, NaN in dense
         attention) and takes the route with one (every score finite or NaN, the same either way) */
        enum { T = 24 };
        static float q[T * FHQ * FDK], k[T * FH * FDK], v[T * FH * FDV], o[T * FHQ * FDV];
        test_rng r = {5};
        for (int i = 0; i < T * FHQ * FDK; i++) q[i] = (float)rnd_u(&r);
        for (int i = 0; i < T * FH * FDK; i++) k[i] = (float)rnd_u(&r);
        for (int i = 0; i < T * FH * FDV; i++) v[i] = (float)rnd_u(&r);
        q[5 * FHQ * FDK + 3] = INFINITY;
        static float big[T * FHQ * FDK]; /* finite, but scale * DK * max|q| * max|k| past FLT_MAX / 4 */
        memcpy(big, q, sizeof big);
        big[5 * FHQ * FDK + 3] = 1e38f;
        nsa_mod *mm = NULL, *sm = NULL;
        CHECK_STATUS(nsa_mod_create(&mm, NSA_MOD_MASK, "q_idx >= kv_idx", NULL, 0), NSA_STATUS_SUCCESS);
        CHECK_STATUS(nsa_mod_create(&sm, NSA_MOD_SCORE, "2.0 * tanh(score / 2.0)", NULL, 0), NSA_STATUS_SUCCESS);
        nsa_flex_args a;
        memset(&a, 0, sizeof a);
        a.q = nsa_tensor_4d(q, NSA_DTYPE_F32, 1, T, FHQ, FDK), a.k = nsa_tensor_4d(k, NSA_DTYPE_F32, 1, T, FH, FDK);
        a.v = nsa_tensor_4d(v, NSA_DTYPE_F32, 1, T, FH, FDV), a.o = nsa_tensor_4d(o, NSA_DTYPE_F32, 1, T, FHQ, FDV);
        a.block_mask.q_block = QBLK, a.block_mask.kv_block = KBLK, a.mask_mod = mm;
        for (int form = 0; form < 4; form++) { /* infinite / huge q, without / with the softcap */
            const int with_cap = form & 1;
            a.score_mod = with_cap ? sm : NULL;
            a.q.data = form < 2 ? (void *)q : (void *)big;
            size_t need = 0;
            CHECK_STATUS(nsa_flex_attention_workspace_size(ctx, &a, &need), NSA_STATUS_SUCCESS);
            void *ws = malloc(need ? need : 1);
            const long before = flex_route_taken();
            CHECK_STATUS(nsa_flex_attention(ctx, &a, ws, need), NSA_STATUS_SUCCESS);
            CHECK(flex_route_taken() - before == with_cap);
            free(ws);
        }
        a.q.data = q;
        nsa_mod_destroy(mm), nsa_mod_destroy(sm);
    }
    { /* block lists whose four tensors broadcast differently: the counts shared by every head, the
         indices per head, head 1 listing a later block instead of the diagonal one -- declined,
         so the output is the engine's bit for bit */
        enum { T = 32, NQB = T / QBLK, NKB = T / KBLK };
        static float q[T * FHQ * FDK], k[T * FH * FDK], v[T * FH * FDV], o[2][T * FHQ * FDV];
        test_rng r = {9};
        for (int i = 0; i < T * FHQ * FDK; i++) q[i] = (float)rnd_u(&r);
        for (int i = 0; i < T * FH * FDK; i++) k[i] = (float)rnd_u(&r);
        for (int i = 0; i < T * FH * FDV; i++) v[i] = (float)rnd_u(&r);
        int32_t num[NQB], idx[FHQ][NQB][NKB];
        for (int i = 0; i < NQB; i++) {
            num[i] = (int32_t)(i * QBLK / KBLK + 1); /* the causal blocks, all partial */
            for (int h = 0; h < FHQ; h++)
                for (int j = 0; j < NKB; j++) idx[h][i][j] = j < num[i] ? j : -1;
        }
        idx[1][0][0] = 1; /* head 1, query block 0: the future block instead of the diagonal one */
        nsa_mod *mm = NULL;
        CHECK_STATUS(nsa_mod_create(&mm, NSA_MOD_MASK, "q_idx >= kv_idx", NULL, 0), NSA_STATUS_SUCCESS);
        nsa_flex_args a;
        memset(&a, 0, sizeof a);
        a.q = nsa_tensor_4d(q, NSA_DTYPE_F32, 1, T, FHQ, FDK), a.k = nsa_tensor_4d(k, NSA_DTYPE_F32, 1, T, FH, FDK);
        a.v = nsa_tensor_4d(v, NSA_DTYPE_F32, 1, T, FH, FDV);
        a.block_mask.q_block = QBLK, a.block_mask.kv_block = KBLK, a.mask_mod = mm;
        a.block_mask.kv_num_blocks = nsa_tensor_3d(num, NSA_DTYPE_I32, 1, 1, NQB);
        a.block_mask.kv_indices = nsa_tensor_4d(idx, NSA_DTYPE_I32, 1, FHQ, NQB, NKB);
        const long before = flex_route_taken();
        for (int on = 1; on >= 0; on--) {
            flex_route_set_enabled(on);
            a.o = nsa_tensor_4d(o[on], NSA_DTYPE_F32, 1, T, FHQ, FDV);
            size_t need = 0;
            CHECK_STATUS(nsa_flex_attention_workspace_size(ctx, &a, &need), NSA_STATUS_SUCCESS);
            void *ws = malloc(need ? need : 1);
            CHECK_STATUS(nsa_flex_attention(ctx, &a, ws, need), NSA_STATUS_SUCCESS);
            free(ws);
        }
        CHECK(flex_route_taken() == before);
        CHECK(memcmp(o[0], o[1], sizeof o[0]) == 0);
        nsa_mod_destroy(mm);
    }
    for (int on = 1; on >= 0; on--) {
        flex_route_set_enabled(on);
        test_rng r = {20261127};
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(ctx, &cases[i], &r);
    }
    flex_route_set_enabled(was);
}

/* Bad block masks and mods: the status, the detail naming the argument, o untouched. */
static void test_flex_refuses(nsa_context *ctx)
{
    float q[FB * 9 * FHQ * FDK] = {0}, k[FB * 20 * FH * FDK] = {0}, v[FB * 20 * FH * FDV] = {0}, o[FB * 9 * FHQ * FDV];
    int32_t num[2] = {1, 1}, idx[2 * 2] = {0, 1, 1, 0}, fnum[2] = {1, 0}, fidx[2 * 2] = {1, 0, 0, 0};
    nsa_mod *sm = NULL, *mm = NULL;
    CHECK_STATUS(nsa_mod_create(&sm, NSA_MOD_SCORE, "score * 2", NULL, 0), NSA_STATUS_SUCCESS);
    CHECK_STATUS(nsa_mod_create(&mm, NSA_MOD_MASK, "q_idx >= kv_idx", NULL, 0), NSA_STATUS_SUCCESS);
    nsa_flex_args base;
    memset(&base, 0, sizeof base);
    base.q = nsa_tensor_4d(q, NSA_DTYPE_F32, FB, 9, FHQ, FDK);
    base.k = nsa_tensor_4d(k, NSA_DTYPE_F32, FB, 20, FH, FDK);
    base.v = nsa_tensor_4d(v, NSA_DTYPE_F32, FB, 20, FH, FDV);
    base.o = nsa_tensor_4d(o, NSA_DTYPE_F32, FB, 9, FHQ, FDV);
    base.block_mask.q_block = QBLK, base.block_mask.kv_block = KBLK; /* 2 query blocks, 2 key blocks */
    base.block_mask.kv_num_blocks = nsa_tensor_3d(num, NSA_DTYPE_I32, 1, 1, 2);
    base.block_mask.kv_indices = nsa_tensor_4d(idx, NSA_DTYPE_I32, 1, 1, 2, 2);
    base.block_mask.full_kv_num_blocks = nsa_tensor_3d(fnum, NSA_DTYPE_I32, 1, 1, 2);
    base.block_mask.full_kv_indices = nsa_tensor_4d(fidx, NSA_DTYPE_I32, 1, 1, 2, 2);
    size_t need = 0;
    CHECK_STATUS(nsa_flex_attention_workspace_size(ctx, &base, &need), NSA_STATUS_SUCCESS);
    void *ws = malloc(need + 4096);
    CHECK_STATUS(nsa_flex_attention(ctx, &base, ws, need), NSA_STATUS_SUCCESS); /* the base case is valid */
    struct {
        int what;
        nsa_status want;
        const char *arg;
    } cases[] = {
        {0, NSA_STATUS_BAD_ARGUMENT, "block_mask.kv_num_blocks[0, 0, 1]: 3"},
        {1, NSA_STATUS_BAD_ARGUMENT, "block_mask.kv_num_blocks[0, 0, 0]: -1"},
        {2, NSA_STATUS_BAD_ARGUMENT, "block_mask.kv_indices[0, 0, 0, 0]: key block 2 outside [0, 2)"},
        {3, NSA_STATUS_BAD_ARGUMENT, "block_mask.full_kv_indices[0, 0, 0, 0]: key block 0 listed twice"},
        {4, NSA_STATUS_BAD_SHAPE, "block_mask.kv_num_blocks: dim 2 (query blocks) is 2"},
        {5, NSA_STATUS_BAD_ARGUMENT, "mask_mod: a score_mod"},
        {6, NSA_STATUS_BAD_ARGUMENT, "block_mask.kv_num_blocks: given without block_mask.kv_indices"},
        {7, NSA_STATUS_BAD_ARGUMENT, "block_mask.q_block: 0"},
        {8, NSA_STATUS_BAD_DTYPE, "block_mask.kv_indices"},
        {9, NSA_STATUS_BAD_SHAPE, "block_mask.kv_num_blocks: dim 0 (B or 1) is 3"},
        {10, NSA_STATUS_BAD_ARGUMENT, "score_mod: a mask_mod"},
        {11, NSA_STATUS_BAD_ARGUMENT, "num_doc_runs: 2 without doc_runs"},
        {12, NSA_STATUS_BAD_ARGUMENT, "num_doc_runs: 10, must be in [1, Tq = 9]"},
        {13, NSA_STATUS_BAD_ARGUMENT, "doc_runs: the bounds run from 0 to 8, must run from 0 to Tq = 9"},
        {14, NSA_STATUS_BAD_ARGUMENT, "doc_runs[2]: 4 after 5, the bounds must increase"},
    };
    static const int32_t runs_short[] = {0, 5, 8}, runs_down[] = {0, 5, 4, 9};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        nsa_flex_args a = base;
        int32_t save_num[2], save_idx[4], save_fidx[4];
        memcpy(save_num, num, sizeof num), memcpy(save_idx, idx, sizeof idx), memcpy(save_fidx, fidx, sizeof fidx);
        switch (cases[ci].what) {
        case 0: num[1] = 3; break;
        case 1: num[0] = -1; break;
        case 2: idx[0] = 2; break;
        case 3: fidx[0] = 0; break; /* block 0 partial and full for query block 0 */
        case 4: a.q.shape[1] = a.o.shape[1] = 17; break;
        case 5: a.mask_mod = sm; break;
        case 6: memset(&a.block_mask.kv_indices, 0, sizeof a.block_mask.kv_indices); break;
        case 7: a.block_mask.q_block = 0; break;
        case 8: a.block_mask.kv_indices.dtype = NSA_DTYPE_F32; break;
        case 9: a.block_mask.kv_num_blocks.shape[0] = 3; break;
        case 10: a.score_mod = mm; break;
        case 11: a.num_doc_runs = 2; break;
        case 12: a.doc_runs = runs_down, a.num_doc_runs = 10; break;
        case 13: a.doc_runs = runs_short, a.num_doc_runs = 2; break;
        case 14: a.doc_runs = runs_down, a.num_doc_runs = 3; break;
        }
        for (size_t e = 0; e < sizeof o / sizeof o[0]; e++) o[e] = 7.0f;
        CHECK_STATUS(nsa_flex_attention(ctx, &a, ws, need + 4096), cases[ci].want);
        CHECK_DETAIL(cases[ci].arg);
        int kept = 1;
        for (size_t e = 0; e < sizeof o / sizeof o[0]; e++) kept &= o[e] == 7.0f;
        CHECK_MSG(kept, "a refused flex call wrote o");
        memcpy(num, save_num, sizeof num), memcpy(idx, save_idx, sizeof idx), memcpy(fidx, save_fidx, sizeof fidx);
    }
    /* an empty batch: counts broadcast over the batch (dim 0 of 1) beside index lists of batch
     * size 0, which hold nothing to read (here a stray 99, which a read would refuse as a key
     * block outside the keys): the call succeeds and reads no list */
    {
        int32_t stray[1] = {99};
        nsa_flex_args a = base;
        a.q.shape[0] = a.k.shape[0] = a.v.shape[0] = a.o.shape[0] = 0;
        a.block_mask.kv_indices = nsa_tensor_4d(stray, NSA_DTYPE_I32, 0, 1, 2, 2);
        memset(&a.block_mask.full_kv_num_blocks, 0, sizeof a.block_mask.full_kv_num_blocks);
        memset(&a.block_mask.full_kv_indices, 0, sizeof a.block_mask.full_kv_indices);
        size_t need0 = 0;
        CHECK_STATUS(nsa_flex_attention_workspace_size(ctx, &a, &need0), NSA_STATUS_SUCCESS);
        CHECK_STATUS(nsa_flex_attention(ctx, &a, ws, need + 4096), NSA_STATUS_SUCCESS);
    }
    free(ws);
    nsa_mod_destroy(sm), nsa_mod_destroy(mm);
    nsa_mod *bad = (nsa_mod *)1;
    CHECK_STATUS(nsa_mod_create(&bad, NSA_MOD_MASK, "q_idx >= kvidx", NULL, 0), NSA_STATUS_BAD_EXPRESSION);
    CHECK_DETAIL("mask_mod:10: unknown name 'kvidx'");
    CHECK(bad == NULL);
    CHECK_STATUS(nsa_mod_create(&bad, (nsa_mod_kind)5, "q_idx >= kv_idx", NULL, 0), NSA_STATUS_BAD_ARGUMENT);
    CHECK_DETAIL("kind");
}

/* The backward's own refusals: tensor gradients of a score_mod's tensors only, of float ones,
 * shaped like them, in f32; lse required. */
static void test_flex_bwd_refuses(nsa_context *ctx)
{
    float q[1 * 8 * 2 * 4] = {0}, k[1 * 8 * 1 * 4] = {0}, v[1 * 8 * 1 * 4] = {0}, o[1 * 8 * 2 * 4] = {0}, lse[1 * 8 * 2] = {0};
    float dq[64], dk[32], dv[32], dout[64] = {0}, slope[2] = {0.5f, 0.25f}, dsl[3];
    int32_t doc[8] = {0};
    const nsa_mod_tensor tens[] = {{"slope", nsa_tensor_make(slope, NSA_DTYPE_F32, 1, (int64_t[]){2})},
                                   {"doc", nsa_tensor_make(doc, NSA_DTYPE_I32, 1, (int64_t[]){8})}};
    nsa_mod *sm = NULL;
    CHECK_STATUS(nsa_mod_create(&sm, NSA_MOD_SCORE, "score - slope[h] * doc[q_idx]", tens, 2), NSA_STATUS_SUCCESS);
    nsa_flex_bwd_args g;
    memset(&g, 0, sizeof g);
    g.fwd.q = nsa_tensor_4d(q, NSA_DTYPE_F32, 1, 8, 2, 4);
    g.fwd.k = nsa_tensor_4d(k, NSA_DTYPE_F32, 1, 8, 1, 4);
    g.fwd.v = nsa_tensor_4d(v, NSA_DTYPE_F32, 1, 8, 1, 4);
    g.fwd.o = nsa_tensor_4d(o, NSA_DTYPE_F32, 1, 8, 2, 4);
    g.fwd.lse = nsa_tensor_3d(lse, NSA_DTYPE_F32, 1, 8, 2);
    g.fwd.block_mask.q_block = g.fwd.block_mask.kv_block = 4;
    g.fwd.score_mod = sm;
    g.dout = nsa_tensor_4d(dout, NSA_DTYPE_F32, 1, 8, 2, 4);
    g.dq = nsa_tensor_4d(dq, NSA_DTYPE_F32, 1, 8, 2, 4);
    g.dk = nsa_tensor_4d(dk, NSA_DTYPE_F32, 1, 8, 1, 4);
    g.dv = nsa_tensor_4d(dv, NSA_DTYPE_F32, 1, 8, 1, 4);
    g.dscore_tensors[0] = nsa_tensor_make(dsl, NSA_DTYPE_F32, 1, (int64_t[]){2});
    size_t need = 0;
    CHECK_STATUS(nsa_flex_attention_bwd_workspace_size(ctx, &g, &need), NSA_STATUS_SUCCESS);
    nsa_flex_bwd_args x = g;
    x.dscore_tensors[0].shape[0] = 3;
    CHECK_STATUS(nsa_flex_attention_bwd_workspace_size(ctx, &x, &need), NSA_STATUS_BAD_SHAPE);
    CHECK_DETAIL("dscore_tensors[0]: dim 0 is 3, the tensor 'slope' has 2");
    x = g;
    x.dscore_tensors[1] = nsa_tensor_make(dsl, NSA_DTYPE_F32, 1, (int64_t[]){8});
    CHECK_STATUS(nsa_flex_attention_bwd_workspace_size(ctx, &x, &need), NSA_STATUS_BAD_ARGUMENT);
    CHECK_DETAIL("dscore_tensors[1]: the score_mod's tensor 'doc' is i32");
    x = g;
    x.dscore_tensors[2] = x.dscore_tensors[0];
    CHECK_STATUS(nsa_flex_attention_bwd_workspace_size(ctx, &x, &need), NSA_STATUS_BAD_ARGUMENT);
    CHECK_DETAIL("dscore_tensors[2]: given, but the score_mod has 2 tensors");
    x = g;
    x.dscore_tensors[0].dtype = NSA_DTYPE_BF16;
    CHECK_STATUS(nsa_flex_attention_bwd_workspace_size(ctx, &x, &need), NSA_STATUS_BAD_DTYPE);
    CHECK_DETAIL("dscore_tensors[0]: bf16, must be f32");
    x = g;
    memset(&x.fwd.lse, 0, sizeof x.fwd.lse);
    CHECK_STATUS(nsa_flex_attention_bwd_workspace_size(ctx, &x, &need), NSA_STATUS_NULL_POINTER);
    CHECK_DETAIL("fwd.lse");
    nsa_mod_destroy(sm);
}

/* create_block_mask from a document + causal mask_mod: the lists as an independent count of
 * the visible pairs of each block gives them, and attention through them equals attention with
 * the mask_mod alone over every block (within rounding: full blocks are summed after partial). */
static void test_create_block_mask(nsa_context *ctx)
{
    enum { TQ = 37, TK = 45, NQB = (TQ + QBLK - 1) / QBLK, NKB = (TK + KBLK - 1) / KBLK };
    const int64_t dsl = 64;
    const nsa_mod_tensor tens[] = {{"doc", nsa_tensor_make(g_doc, NSA_DTYPE_I32, 1, &dsl)}};
    nsa_mod *mm = NULL;
    CHECK_STATUS(nsa_mod_create(&mm, NSA_MOD_MASK, "q_idx >= kv_idx && doc[q_idx + b] == doc[kv_idx + b]", tens, 1),
                 NSA_STATUS_SUCCESS);
    int32_t num[FB][NQB], idx[FB][NQB][NKB], fnum[FB][NQB], fidx[FB][NQB][NKB];
    nsa_block_mask bm;
    memset(&bm, 0, sizeof bm);
    bm.q_block = QBLK, bm.kv_block = KBLK;
    bm.kv_num_blocks = nsa_tensor_3d(num, NSA_DTYPE_I32, FB, 1, NQB);
    bm.kv_indices = nsa_tensor_4d(idx, NSA_DTYPE_I32, FB, 1, NQB, NKB);
    bm.full_kv_num_blocks = nsa_tensor_3d(fnum, NSA_DTYPE_I32, FB, 1, NQB);
    bm.full_kv_indices = nsa_tensor_4d(fidx, NSA_DTYPE_I32, FB, 1, NQB, NKB);
    CHECK_STATUS(nsa_create_block_mask(mm, TQ, TK, &bm), NSA_STATUS_SUCCESS);
    long bad = 0;
    for (int b = 0; b < FB; b++)
        for (int qb = 0; qb < NQB; qb++) {
            int n = 0, nf = 0;
            for (int j = 0; j < NKB; j++) {
                int vis = 0, all = 0;
                for (int i = qb * QBLK; i < (qb + 1) * QBLK && i < TQ; i++)
                    for (int k = j * KBLK; k < (j + 1) * KBLK && k < TK; k++) vis += m_causal(b, 0, i, k) && m_doc(b, 0, i, k), all++;
                if (vis == all) bad += fidx[b][qb][nf++] != j;
                else if (vis) bad += idx[b][qb][n++] != j;
            }
            bad += num[b][qb] != n || fnum[b][qb] != nf;
            for (int e = n; e < NKB; e++) bad += idx[b][qb][e] != -1;
        }
    CHECK_MSG(bad == 0, "create_block_mask: lists differ from the visible pairs' count");
    /* attention through the lists equals attention with the mask_mod over every block */
    test_rng r = {5};
    static float q[FB * TQ * FHQ * FDK], k[FB * TK * FH * FDK], v[FB * TK * FH * FDV], o1[FB * TQ * FHQ * FDV], o2[FB * TQ * FHQ * FDV];
    for (size_t e = 0; e < sizeof q / sizeof q[0]; e++) q[e] = (float)rnd_u(&r);
    for (size_t e = 0; e < sizeof k / sizeof k[0]; e++) k[e] = (float)rnd_u(&r);
    for (size_t e = 0; e < sizeof v / sizeof v[0]; e++) v[e] = (float)rnd_u(&r);
    nsa_flex_args a;
    memset(&a, 0, sizeof a);
    a.q = nsa_tensor_4d(q, NSA_DTYPE_F32, FB, TQ, FHQ, FDK);
    a.k = nsa_tensor_4d(k, NSA_DTYPE_F32, FB, TK, FH, FDK);
    a.v = nsa_tensor_4d(v, NSA_DTYPE_F32, FB, TK, FH, FDV);
    a.mask_mod = mm;
    a.block_mask = bm;
    double worst = 0.0;
    for (int pass = 0; pass < 2; pass++) {
        a.o = nsa_tensor_4d(pass ? o2 : o1, NSA_DTYPE_F32, FB, TQ, FHQ, FDV);
        if (pass) { /* no lists: every block partial */
            memset(&a.block_mask, 0, sizeof a.block_mask);
            a.block_mask.q_block = QBLK, a.block_mask.kv_block = KBLK;
        }
        size_t need = 0;
        CHECK_STATUS(nsa_flex_attention_workspace_size(ctx, &a, &need), NSA_STATUS_SUCCESS);
        void *ws = malloc(need ? need : 1);
        CHECK_STATUS(nsa_flex_attention(ctx, &a, ws, need), NSA_STATUS_SUCCESS);
        free(ws);
    }
    for (size_t e = 0; e < sizeof o1 / sizeof o1[0]; e++) worst = fabs((double)o1[e] - o2[e]) > worst ? fabs((double)o1[e] - o2[e]) : worst;
    char msg[160];
    snprintf(msg, sizeof msg, "create_block_mask: sparse vs dense-masked attention differ by %.3g", worst);
    CHECK_MSG(worst <= 1e-6, msg);
    bm.kv_indices.shape[3] = NKB + 1;
    CHECK_STATUS(nsa_create_block_mask(mm, TQ, TK, &bm), NSA_STATUS_BAD_SHAPE);
    CHECK_DETAIL("mask->kv_indices: dim 3 is 4, must be 3");
    bm.kv_indices.shape[3] = NKB;
    const int64_t keep = bm.kv_indices.stride[0];
    bm.kv_indices.stride[0] = INT64_MAX; /* an output whose last offset overflows: refused, nothing written */
    num[0][0] = -7;
    CHECK_STATUS(nsa_create_block_mask(mm, TQ, TK, &bm), NSA_STATUS_SIZE_OVERFLOW);
    CHECK_DETAIL("mask->kv_indices");
    CHECK(num[0][0] == -7);
    bm.kv_indices.stride[0] = keep;
    nsa_mod_destroy(mm);
}

/* nsa_create_block_mask's lists for mods that are attention options come from each row's key
 * interval, not from evaluating every pair: they must be the lists every pair's evaluation gives
 * (a brute force here), for odd lengths and block sizes, and documents whose ids come back
 * (evaluated pair by pair) as well as one run each. */
static void test_create_block_mask_intervals(void)
{
    fill_mod_tables();
    const int64_t dsl = 64;
    const nsa_mod_tensor tens[] = {{"doc", nsa_tensor_make(g_doc, NSA_DTYPE_I32, 1, &dsl)},
                                   {"docs", nsa_tensor_make(g_docs, NSA_DTYPE_I32, 1, &dsl)}};
    static const struct { const char *text; mask_ref ref; } mods[] = {
        {"q_idx >= kv_idx", m_causal}, {"(q_idx >= kv_idx) & ((q_idx - kv_idx) < 10)", m_window},
        {"abs(q_idx - kv_idx) <= 6", m_band}, {"docs[q_idx] == docs[kv_idx]", m_docs},
        {"(docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)", m_docs_causal}, {"doc[q_idx] == doc[kv_idx]", m_doc},
        {"q_idx > kv_idx", m_strict}, {"(kv_idx < 7) | (q_idx >= kv_idx)", m_prefix}, {"q_idx >= kv_idx || 7 > kv_idx", m_prefix},
        {"kv_idx <= 6 || q_idx >= kv_idx", m_prefix}, {"kv_idx < 7 || q_idx > kv_idx", m_prefix_strict}};
    static const int64_t sizes[][3] = {{45, 8, 16}, {37, 5, 3}, {50, 16, 16}, {23, 1, 7}};
    long bad = 0, cases = 0;
    for (size_t mi = 0; mi < sizeof mods / sizeof mods[0]; mi++)
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            const int64_t T = sizes[si][0], qb = sizes[si][1], kb = sizes[si][2], nqb = (T + qb - 1) / qb, nkb = (T + kb - 1) / kb;
            nsa_mod *mm = NULL;
            CHECK_STATUS(nsa_mod_create(&mm, NSA_MOD_MASK, mods[mi].text, tens, 2), NSA_STATUS_SUCCESS);
            int32_t *num = (int32_t *)malloc(4 * (size_t)nqb), *fnum = (int32_t *)malloc(4 * (size_t)nqb);
            int32_t *idx = (int32_t *)malloc(4 * (size_t)(nqb * nkb)), *fidx = (int32_t *)malloc(4 * (size_t)(nqb * nkb));
            nsa_block_mask bm = {qb, kb, nsa_tensor_3d(num, NSA_DTYPE_I32, 1, 1, nqb), nsa_tensor_4d(idx, NSA_DTYPE_I32, 1, 1, nqb, nkb),
                                 nsa_tensor_3d(fnum, NSA_DTYPE_I32, 1, 1, nqb), nsa_tensor_4d(fidx, NSA_DTYPE_I32, 1, 1, nqb, nkb)};
            CHECK_STATUS(nsa_create_block_mask(mm, T, T, &bm), NSA_STATUS_SUCCESS);
            for (int64_t i = 0; i < nqb; i++) {
                int32_t n = 0, nf = 0;
                for (int64_t j = 0; j < nkb; j++) {
                    int64_t seen = 0, all = 0;
                    for (int64_t r = i * qb; r < (i + 1) * qb && r < T; r++)
                        for (int64_t c = j * kb; c < (j + 1) * kb && c < T; c++) seen += mods[mi].ref(0, 0, r, c), all++;
                    if (seen == all) bad += nf >= fnum[i] || fidx[i * nkb + nf++] != j;
                    else if (seen) bad += n >= num[i] || idx[i * nkb + n++] != j;
                }
                bad += n != num[i] || nf != fnum[i];
                for (int64_t e = n; e < nkb; e++) bad += idx[i * nkb + e] != -1;
                for (int64_t e = nf; e < nkb; e++) bad += fidx[i * nkb + e] != -1;
            }
            cases++;
            free(num), free(fnum), free(idx), free(fidx);
            nsa_mod_destroy(mm);
        }
    char msg[160];
    snprintf(msg, sizeof msg, "create_block_mask, %ld mods x sizes: %ld list entries differ from every pair's evaluation", cases, bad);
    CHECK_MSG(bad == 0, msg);
    if (g_tests_verbose) printf("  %s\n", msg);
}

/* The CUDA backend's generated kernels (src/cuda/flex/flex.cu), forward and backward, compile
 * with NVRTC for sm_80 and sm_90a, for every element type, with and without mods -- no GPU
 * needed; the compile times are what a new mod costs on first use. A weak reference: absent
 * from a CPU-only build. */
__attribute__((weak)) nsa_status nsa_cuda_flex_compile_check(const nsa_mod *mask, const nsa_mod *score, int elem, int bwd,
                                                             int major, int minor, size_t *cubin_bytes, double *seconds);

static void test_cuda_kernels_compile(void)
{
    if (!nsa_cuda_flex_compile_check) {
        printf("  flex: a CPU-only build: the CUDA kernel compile check is skipped\n");
        return;
    }
    const int64_t dsl = 64;
    const nsa_mod_tensor tens[] = {{"doc", nsa_tensor_make(g_doc, NSA_DTYPE_I32, 1, &dsl)},
                                   {"rel", nsa_tensor_make(g_rel, NSA_DTYPE_F32, 2, (int64_t[]){FHQ, 41})}};
    nsa_mod *mm = NULL, *sm = NULL;
    CHECK_STATUS(nsa_mod_create(&mm, NSA_MOD_MASK, "q_idx >= kv_idx && doc[q_idx] == doc[kv_idx]", tens, 2), NSA_STATUS_SUCCESS);
    CHECK_STATUS(nsa_mod_create(&sm, NSA_MOD_SCORE, "where(q_idx - kv_idx < 8, score + rel[h, q_idx - kv_idx + 20], "
                                                    "3.0 * tanh(score / 3.0)) // 1.0 % 7.0", tens, 2),
                 NSA_STATUS_SUCCESS);
    double worst[2] = {0.0, 0.0};
    int compiled = 0;
    for (int arch = 0; arch < 2; arch++)
        for (int elem = 0; elem < 3; elem++)
            for (int mods = 0; mods < 2; mods++)
                for (int bwd = 0; bwd < 2; bwd++) {
                size_t bytes = 0;
                double secs = 0.0;
                const nsa_status st = nsa_cuda_flex_compile_check(mods ? mm : NULL, mods ? sm : NULL, elem, bwd, arch ? 9 : 8, 0,
                                                                  &bytes, &secs);
                if (st == NSA_STATUS_NOT_SUPPORTED && strstr(nsa_last_error_detail(), "not found")) {
                    printf("  flex: NVRTC is not installed here: the CUDA kernel compile check is skipped\n");
                    goto done;
                }
                char msg[400];
                snprintf(msg, sizeof msg, "flex %s kernels (sm_%d0, elem %d, mods %d): %s", bwd ? "backward" : "forward",
                         arch ? 9 : 8, elem, mods, nsa_last_error_detail());
                CHECK_MSG(st == NSA_STATUS_SUCCESS && bytes > 0, msg);
                worst[bwd] = secs > worst[bwd] ? secs : worst[bwd];
                compiled++;
            }
    if (g_tests_verbose)
        printf("  flex: %d sources compiled by NVRTC, the slowest forward in %.2f s, backward in %.2f s\n", compiled, worst[0],
               worst[1]);
    CHECK_MSG(worst[0] < 10.0 && worst[1] < 10.0, "flex: an NVRTC compile took over 10 s");
done:
    nsa_mod_destroy(mm), nsa_mod_destroy(sm);
}

void test_flex_all(void)
{
    nsa_context_desc d;
    memset(&d, 0, sizeof d);
    d.backend = NSA_BACKEND_CPU;
    nsa_context *ctx = NULL;
    CHECK_STATUS(nsa_context_create(&ctx, &d), NSA_STATUS_SUCCESS);
    if (!ctx) return;
    test_flex_equals_reference(ctx);
    test_flex_dense_route(ctx);
    test_flex_refuses(ctx);
    test_flex_bwd_refuses(ctx);
    test_create_block_mask(ctx);
    test_create_block_mask_intervals();
    test_cuda_kernels_compile();
    nsa_context_destroy(ctx);
}

/* ---- on the device: the CUDA forward against the CPU's on the same inputs -------------------- */
static void *dev_copy(const sweep_memory *mem, const void *host, size_t bytes)
{
    void *d = mem->alloc(bytes ? bytes : 1);
    if (bytes) mem->upload(d, host, bytes);
    return d;
}

/* One case on both backends (f32): CUDA o and lse equal the CPU's within fp32 rounding; then the
 * backward on both (dq, dk, dv and the slope / rel tables' gradients), twice on the device with
 * the same bits (deterministic). */
static void flex_device_case(nsa_context *cpu, nsa_context *gpu, const sweep_memory *mem, const flex_case *c, test_rng *r)
{
    const int64_t B = c->B ? c->B : FB, Tq = c->Tq, Tk = c->Tk, nqb = (Tq + QBLK - 1) / QBLK, nkb = (Tk + KBLK - 1) / KBLK;
    const size_t nq = (size_t)(B * Tq * FHQ), nk = (size_t)(B * Tk * FH);
    float *q = (float *)malloc(4 * (nq * FDK + 1)), *k = (float *)malloc(4 * (nk * FDK + 1)), *v = (float *)malloc(4 * (nk * FDV + 1));
    float *o[2], *lse[2];
    for (int x = 0; x < 2; x++) o[x] = (float *)malloc(4 * (nq * FDV + 1)), lse[x] = (float *)malloc(4 * (nq + 1));
    for (size_t e = 0; e < nq * FDK; e++) q[e] = (float)rnd_u(r);
    for (size_t e = 0; e < nk * FDK; e++) k[e] = (float)rnd_u(r);
    for (size_t e = 0; e < nk * FDV; e++) v[e] = (float)rnd_u(r);
    float *dout = (float *)malloc(4 * (nq * FDV + 1)), *dq[3], *dk[3], *dv[3], dt[3][FHQ + FHQ * 41];
    for (size_t e = 0; e < nq * FDV; e++) dout[e] = (float)rnd_u(r);
    for (int x = 0; x < 3; x++)
        dq[x] = (float *)malloc(4 * (nq * FDK + 1)), dk[x] = (float *)malloc(4 * (nk * FDK + 1)), dv[x] = (float *)malloc(4 * (nk * FDV + 1));
    bmask m;
    bmask_make(&m, r, c->bm, c->hm, nqb, nkb);
    if (c->blocks >= 2) { /* the mask_mod's own lists (host tensors) */
        const int64_t dsl = 64;
        const nsa_mod_tensor host_tens[] = {{"docs", nsa_tensor_make(g_docs, NSA_DTYPE_I32, 1, &dsl)}};
        nsa_mod *hm = NULL;
        CHECK_STATUS(nsa_mod_create(&hm, NSA_MOD_MASK, c->mask_text, host_tens, 1), NSA_STATUS_SUCCESS);
        nsa_block_mask bm = {QBLK, KBLK, nsa_tensor_3d(m.num, NSA_DTYPE_I32, c->bm, c->hm, nqb),
                             nsa_tensor_4d(m.idx, NSA_DTYPE_I32, c->bm, c->hm, nqb, nkb),
                             nsa_tensor_3d(m.fnum, NSA_DTYPE_I32, c->bm, c->hm, nqb),
                             nsa_tensor_4d(m.fidx, NSA_DTYPE_I32, c->bm, c->hm, nqb, nkb)};
        CHECK_STATUS(nsa_create_block_mask(hm, Tq, Tk, &bm), NSA_STATUS_SUCCESS);
        nsa_mod_destroy(hm);
    }
    const size_t rows = (size_t)(c->bm * c->hm * nqb);
    void *dev[32] = {0};
    int nd = 0;
    for (int side = 0; side < 2; side++) { /* 0: CPU, host memory; 1: CUDA, device copies */
        const int on_dev = side == 1;
#define PLACE(ptr, bytes) (on_dev ? (dev[nd++] = dev_copy(mem, (ptr), (bytes))) : (void *)(ptr))
        const int64_t dsl = 64;
        const nsa_mod_tensor tens[] = {
            {"doc", nsa_tensor_make(PLACE(g_doc, sizeof g_doc), NSA_DTYPE_I32, 1, &dsl)},
            {"slope", nsa_tensor_make(PLACE(g_slope, sizeof g_slope), NSA_DTYPE_F32, 1, (int64_t[]){FHQ})},
            {"rel", nsa_tensor_make(PLACE(g_rel, sizeof g_rel), NSA_DTYPE_F32, 2, (int64_t[]){FHQ, 41})},
            {"docs", nsa_tensor_make(PLACE(g_docs, sizeof g_docs), NSA_DTYPE_I32, 1, &dsl)},
        };
        nsa_mod *mm = NULL, *sm = NULL;
        if (c->mask_text) CHECK_STATUS(nsa_mod_create(&mm, NSA_MOD_MASK, c->mask_text, tens, 4), NSA_STATUS_SUCCESS);
        if (c->score_text) CHECK_STATUS(nsa_mod_create(&sm, NSA_MOD_SCORE, c->score_text, tens, 4), NSA_STATUS_SUCCESS);
        nsa_flex_args a;
        memset(&a, 0, sizeof a);
        a.q = nsa_tensor_4d(PLACE(q, 4 * nq * FDK), NSA_DTYPE_F32, B, Tq, FHQ, FDK);
        a.k = nsa_tensor_4d(PLACE(k, 4 * nk * FDK), NSA_DTYPE_F32, B, Tk, FH, FDK);
        a.v = nsa_tensor_4d(PLACE(v, 4 * nk * FDV), NSA_DTYPE_F32, B, Tk, FH, FDV);
        void *od = on_dev ? (dev[nd++] = mem->alloc(4 * nq * FDV)) : o[0], *ld = on_dev ? (dev[nd++] = mem->alloc(4 * nq)) : lse[0];
        a.o = nsa_tensor_4d(od, NSA_DTYPE_F32, B, Tq, FHQ, FDV);
        a.lse = nsa_tensor_3d(ld, NSA_DTYPE_F32, B, Tq, FHQ);
        a.block_mask.q_block = QBLK, a.block_mask.kv_block = KBLK;
        if (c->blocks) {
            a.block_mask.kv_num_blocks = nsa_tensor_3d(PLACE(m.num, 4 * rows), NSA_DTYPE_I32, c->bm, c->hm, nqb);
            a.block_mask.kv_indices = nsa_tensor_4d(PLACE(m.idx, 4 * rows * (size_t)nkb), NSA_DTYPE_I32, c->bm, c->hm, nqb, nkb);
            a.block_mask.full_kv_num_blocks = nsa_tensor_3d(PLACE(m.fnum, 4 * rows), NSA_DTYPE_I32, c->bm, c->hm, nqb);
            a.block_mask.full_kv_indices = nsa_tensor_4d(PLACE(m.fidx, 4 * rows * (size_t)nkb), NSA_DTYPE_I32, c->bm, c->hm, nqb, nkb);
        }
#undef PLACE
        a.mask_mod = mm, a.score_mod = sm, a.scale = 0.4f;
        nsa_context *ctx = on_dev ? gpu : cpu;
        size_t need = 0;
        CHECK_STATUS(nsa_flex_attention_workspace_size(ctx, &a, &need), NSA_STATUS_SUCCESS);
        void *ws = on_dev ? mem->alloc(need ? need : 1) : malloc(need ? need : 1);
        const long routed0 = flex_route_taken();
        const nsa_status st = nsa_flex_attention(ctx, &a, ws, need);
        char msg[300];
        snprintf(msg, sizeof msg, "flex on %s, %s: %s", on_dev ? "CUDA" : "CPU", c->name, nsa_last_error_detail());
        CHECK_MSG(st == NSA_STATUS_SUCCESS, msg);
        if (c->route) { /* the forward's path, on each backend */
            snprintf(msg, sizeof msg, "flex on %s, %s: the dense route taken %ld times, want %d", on_dev ? "CUDA" : "CPU", c->name,
                     flex_route_taken() - routed0, c->route == 1 && flex_route_enabled());
            CHECK_MSG(flex_route_taken() - routed0 == (c->route == 1 && flex_route_enabled()), msg);
        }
        if (on_dev) {
            mem->download(o[1], od, 4 * nq * FDV), mem->download(lse[1], ld, 4 * nq);
            mem->release(ws);
        } else {
            free(ws);
        }
        /* the backward: on the device twice (x = 1, 2), to see the same bits */
        for (int x = on_dev; x <= 2 * on_dev; x++) {
            nsa_flex_bwd_args g;
            memset(&g, 0, sizeof g);
            g.fwd = a;
            g.dout = nsa_tensor_4d(on_dev ? (dev[nd++] = dev_copy(mem, dout, 4 * nq * FDV)) : dout, NSA_DTYPE_F32, B, Tq, FHQ, FDV);
            void *gq = on_dev ? (dev[nd++] = mem->alloc(4 * nq * FDK)) : dq[0], *gk = on_dev ? (dev[nd++] = mem->alloc(4 * nk * FDK)) : dk[0];
            void *gv = on_dev ? (dev[nd++] = mem->alloc(4 * nk * FDV)) : dv[0], *gt = on_dev ? (dev[nd++] = mem->alloc(sizeof dt[0])) : dt[0];
            g.dq = nsa_tensor_4d(gq, NSA_DTYPE_F32, B, Tq, FHQ, FDK);
            g.dk = nsa_tensor_4d(gk, NSA_DTYPE_F32, B, Tk, FH, FDK);
            g.dv = nsa_tensor_4d(gv, NSA_DTYPE_F32, B, Tk, FH, FDV);
            if (sm) {
                g.dscore_tensors[1] = nsa_tensor_make(gt, NSA_DTYPE_F32, 1, (int64_t[]){FHQ});
                g.dscore_tensors[2] = nsa_tensor_make((float *)gt + FHQ, NSA_DTYPE_F32, 2, (int64_t[]){FHQ, 41});
            } else {
                memset(dt[x], 0, sizeof dt[x]);
            }
            CHECK_STATUS(nsa_flex_attention_bwd_workspace_size(ctx, &g, &need), NSA_STATUS_SUCCESS);
            ws = on_dev ? mem->alloc(need ? need : 1) : malloc(need ? need : 1);
            const nsa_status bst = nsa_flex_attention_bwd(ctx, &g, ws, need);
            snprintf(msg, sizeof msg, "flex backward on %s, %s: %s", on_dev ? "CUDA" : "CPU", c->name, nsa_last_error_detail());
            CHECK_MSG(bst == NSA_STATUS_SUCCESS, msg);
            if (on_dev) {
                mem->download(dq[x], gq, 4 * nq * FDK), mem->download(dk[x], gk, 4 * nk * FDK), mem->download(dv[x], gv, 4 * nk * FDV);
                if (sm) mem->download(dt[x], gt, sizeof dt[x]);
                mem->release(ws);
            } else {
                free(ws);
            }
        }
        nsa_mod_destroy(mm), nsa_mod_destroy(sm);
    }
    for (int i = 0; i < nd; i++) mem->release(dev[i]);
    double worst = 0.0;
    for (size_t e = 0; e < nq * FDV; e++) worst = fabs((double)o[0][e] - o[1][e]) > worst || o[1][e] != o[1][e] ? fabs((double)o[0][e] - o[1][e]) : worst;
    for (size_t e = 0; e < nq; e++)
        if (!(lse[0][e] == lse[1][e])) worst = fabs((double)lse[0][e] - lse[1][e]) > worst || lse[1][e] != lse[1][e] ? fabs((double)lse[0][e] - lse[1][e]) : worst;
    char msg[300];
    snprintf(msg, sizeof msg, "flex CUDA vs CPU, %s: worst |o, lse| difference %.3g", c->name, worst);
    CHECK_MSG(worst <= 1e-5, msg);
    if (g_tests_verbose) printf("  %s\n", msg);
    /* the gradients: CUDA against the CPU within fp32 rounding of the largest; the two CUDA runs bit for bit */
    const struct { float *const *x; size_t n; } grads[] = {{dq, nq * FDK}, {dk, nk * FDK}, {dv, nk * FDV}};
    double gworst = 0.0, gmax = 1.0;
    int same = 1;
    for (int t = 0; t < 4; t++) {
        const size_t n = t < 3 ? grads[t].n : sizeof dt[0] / sizeof(float);
        const float *x0 = t < 3 ? grads[t].x[0] : dt[0], *x1 = t < 3 ? grads[t].x[1] : dt[1], *x2 = t < 3 ? grads[t].x[2] : dt[2];
        for (size_t e = 0; e < n; e++) {
            const double d = fabs((double)x0[e] - x1[e]);
            gworst = d > gworst || d != d ? d : gworst;
            gmax = fabs(x0[e]) > gmax ? fabs(x0[e]) : gmax;
            same &= !memcmp(&x1[e], &x2[e], sizeof(float));
        }
    }
    snprintf(msg, sizeof msg, "flex backward CUDA vs CPU, %s: worst |dq, dk, dv, dtensors| difference %.3g (largest %.3g)%s", c->name,
             gworst, gmax, same ? "" : ", two CUDA runs differ");
    CHECK_MSG(gworst <= 2e-5 * gmax && same, msg);
    if (g_tests_verbose) printf("  %s\n", msg);
    bmask_free(&m);
    free(q), free(k), free(v), free(dout);
    for (int x = 0; x < 2; x++) free(o[x]), free(lse[x]);
    for (int x = 0; x < 3; x++) free(dq[x]), free(dk[x]), free(dv[x]);
}

/* Whether two outputs agree where non-finite values are concerned -- NaN at the same elements,
 * the same infinities -- and elsewhere within tol of the larger of 1 and the reference's size. */
static int same_nonfinite_close(const float *ref, const float *got, size_t n, double tol, double *worst)
{
    int ok = 1;
    for (size_t e = 0; e < n; e++) {
        if (isnan(ref[e]) || isnan(got[e]) || isinf(ref[e]) || isinf(got[e])) {
            ok &= isnan(ref[e]) ? isnan(got[e]) != 0 : ref[e] == got[e];
            continue;
        }
        const double d = fabs((double)ref[e] - got[e]) / fmax(1.0, fabs((double)ref[e]));
        *worst = d > *worst ? d : *worst;
        ok &= d <= tol;
    }
    return ok;
}

/* The dense route with scores that reach infinity (spec 14): on CUDA the route is taken whatever
 * the magnitudes of q and k, and the attention kernels keep a row whose scores are all -inf empty
 * (o = 0, lse = -inf, no gradient) as the engine does; rows of +inf scores are NaN on both. The
 * CPU, which scans q and k and keeps the engine for these inputs, is the reference: the same
 * non-finite elements in o, lse, dq, dk and dv, the rest within fp32 rounding. */
static void flex_device_overflowing_scores(nsa_context *cpu, nsa_context *gpu, const sweep_memory *mem)
{
    enum { T = 24 };
    const size_t nq = (size_t)T * FHQ, nk = (size_t)T * FH;
    float *q = (float *)malloc(4 * nq * FDK), *k = (float *)malloc(4 * nk * FDK), *v = (float *)malloc(4 * nk * FDV);
    float *dout = (float *)malloc(4 * nq * FDV), *out[2][5];
    const size_t sizes[5] = {nq * FDV, nq, nq * FDK, nk * FDK, nk * FDV}; /* o, lse, dq, dk, dv */
    for (int x = 0; x < 2; x++)
        for (int t = 0; t < 5; t++) out[x][t] = (float *)malloc(4 * sizes[t]);
    test_rng r = {271};
    for (size_t e = 0; e < nq * FDK; e++) q[e] = (float)rnd_u(&r);
    for (size_t e = 0; e < nk * FDK; e++) k[e] = 0.1f + (float)fabs(rnd_u(&r)); /* positive: the signs of q decide */
    for (size_t e = 0; e < nk * FDV; e++) v[e] = (float)rnd_u(&r);
    for (size_t e = 0; e < nq * FDV; e++) dout[e] = (float)rnd_u(&r);
    for (int d = 0; d < FDK; d++) {
        q[(5 * FHQ + 0) * FDK + d] = -3e38f; /* finite; every score of row 5, head 0 overflows to -inf: empty */
        q[(9 * FHQ + 1) * FDK + d] = 3e38f;  /* +inf scores: NaN */
    }
    q[(7 * FHQ + 2) * FDK + 4] = -INFINITY; /* an infinite element: -inf scores, empty */
    nsa_mod *mm = NULL;
    CHECK_STATUS(nsa_mod_create(&mm, NSA_MOD_MASK, "q_idx >= kv_idx", NULL, 0), NSA_STATUS_SUCCESS);
    const int was = flex_route_enabled();
    flex_route_set_enabled(1);
    for (int on_dev = 0; on_dev <= 1; on_dev++) {
        nsa_context *ctx = on_dev ? gpu : cpu;
        void *dev[10];
        int nd = 0;
#define PLACE(p, bytes) (on_dev ? (dev[nd++] = dev_copy(mem, p, bytes)) : (void *)(p))
#define OUT(t) (on_dev ? (dev[nd++] = mem->alloc(4 * sizes[t])) : (void *)out[0][t])
        nsa_flex_bwd_args g;
        memset(&g, 0, sizeof g);
        nsa_flex_args *a = &g.fwd;
        a->q = nsa_tensor_4d(PLACE(q, 4 * nq * FDK), NSA_DTYPE_F32, 1, T, FHQ, FDK);
        a->k = nsa_tensor_4d(PLACE(k, 4 * nk * FDK), NSA_DTYPE_F32, 1, T, FH, FDK);
        a->v = nsa_tensor_4d(PLACE(v, 4 * nk * FDV), NSA_DTYPE_F32, 1, T, FH, FDV);
        a->o = nsa_tensor_4d(OUT(0), NSA_DTYPE_F32, 1, T, FHQ, FDV);
        a->lse = nsa_tensor_3d(OUT(1), NSA_DTYPE_F32, 1, T, FHQ);
        a->block_mask.q_block = QBLK, a->block_mask.kv_block = KBLK, a->mask_mod = mm;
        g.dout = nsa_tensor_4d(PLACE(dout, 4 * nq * FDV), NSA_DTYPE_F32, 1, T, FHQ, FDV);
        g.dq = nsa_tensor_4d(OUT(2), NSA_DTYPE_F32, 1, T, FHQ, FDK);
        g.dk = nsa_tensor_4d(OUT(3), NSA_DTYPE_F32, 1, T, FH, FDK);
        g.dv = nsa_tensor_4d(OUT(4), NSA_DTYPE_F32, 1, T, FH, FDV);
#undef PLACE
#undef OUT
        size_t need = 0, bneed = 0;
        CHECK_STATUS(nsa_flex_attention_workspace_size(ctx, a, &need), NSA_STATUS_SUCCESS);
        CHECK_STATUS(nsa_flex_attention_bwd_workspace_size(ctx, &g, &bneed), NSA_STATUS_SUCCESS);
        need = need > bneed ? need : bneed;
        void *ws = on_dev ? mem->alloc(need ? need : 1) : malloc(need ? need : 1);
        const long before = flex_route_taken();
        CHECK_STATUS(nsa_flex_attention(ctx, a, ws, need), NSA_STATUS_SUCCESS);
        CHECK_STATUS(nsa_flex_attention_bwd(ctx, &g, ws, need), NSA_STATUS_SUCCESS);
        char msg[200];
        snprintf(msg, sizeof msg, "flex, overflowing scores on %s: the dense route taken %ld times, want %d",
                 on_dev ? "CUDA" : "CPU", flex_route_taken() - before, on_dev ? 2 : 0);
        CHECK_MSG(flex_route_taken() - before == (on_dev ? 2 : 0), msg);
        if (on_dev) {
            for (int t = 0; t < 5; t++) mem->download(out[1][t], (t == 0 ? a->o : t == 1 ? a->lse : t == 2 ? g.dq : t == 3 ? g.dk : g.dv).data, 4 * sizes[t]);
            mem->release(ws);
            for (int i = 0; i < nd; i++) mem->release(dev[i]);
        } else {
            free(ws);
        }
    }
    flex_route_set_enabled(was);
    /* the rows the inputs make: empty, NaN, empty */
    CHECK(out[0][1][5 * FHQ + 0] == -INFINITY && out[0][1][7 * FHQ + 2] == -INFINITY && isnan(out[0][1][9 * FHQ + 1]));
    static const char *names[5] = {"o", "lse", "dq", "dk", "dv"};
    for (int t = 0; t < 5; t++) {
        double worst = 0.0;
        const int ok = same_nonfinite_close(out[0][t], out[1][t], sizes[t], 2e-5, &worst);
        char msg[200];
        snprintf(msg, sizeof msg, "flex, overflowing scores: CUDA's %s against the CPU's (non-finite elements alike, worst %.3g)",
                 names[t], worst);
        CHECK_MSG(ok, msg);
    }
    nsa_mod_destroy(mm);
    free(q), free(k), free(v), free(dout);
    for (int x = 0; x < 2; x++)
        for (int t = 0; t < 5; t++) free(out[x][t]);
}

/* A mod whose tensor is host memory, on the CUDA backend: refused (BAD_ARGUMENT, naming the
 * tensor) before any write, where the kernel would have faulted. */
static void flex_host_tensor_refused(nsa_context *gpu, const sweep_memory *mem)
{
    const int64_t T = 8, n = 64;
    const size_t nq = (size_t)(T * FHQ), nk = (size_t)(T * FH);
    const float sentinel = 12345.0f;
    float *zeros = (float *)calloc(nq * FDK + nk * FDV + 1, 4), *back = (float *)malloc(4 * (nq * FDV + 1));
    float *fill = (float *)malloc(4 * (nq * FDV + 1));
    for (size_t e = 0; e < nq * FDV; e++) fill[e] = sentinel;
    void *q = dev_copy(mem, zeros, 4 * nq * FDK), *k = dev_copy(mem, zeros, 4 * nk * FDK), *v = dev_copy(mem, zeros, 4 * nk * FDV);
    void *o = dev_copy(mem, fill, 4 * nq * FDV);
    const nsa_mod_tensor tens[] = {{"doc", nsa_tensor_make(g_doc, NSA_DTYPE_I32, 1, &n)}}; /* host memory */
    nsa_mod *mm = NULL;
    CHECK_STATUS(nsa_mod_create(&mm, NSA_MOD_MASK, "doc[q_idx] == doc[kv_idx]", tens, 1), NSA_STATUS_SUCCESS);
    nsa_flex_args a;
    memset(&a, 0, sizeof a);
    a.q = nsa_tensor_4d(q, NSA_DTYPE_F32, 1, T, FHQ, FDK);
    a.k = nsa_tensor_4d(k, NSA_DTYPE_F32, 1, T, FH, FDK);
    a.v = nsa_tensor_4d(v, NSA_DTYPE_F32, 1, T, FH, FDV);
    a.o = nsa_tensor_4d(o, NSA_DTYPE_F32, 1, T, FHQ, FDV);
    a.block_mask.q_block = QBLK, a.block_mask.kv_block = KBLK;
    a.mask_mod = mm;
    size_t need = 0;
    CHECK_STATUS(nsa_flex_attention_workspace_size(gpu, &a, &need), NSA_STATUS_SUCCESS);
    void *ws = mem->alloc(need ? need : 1);
    CHECK_STATUS(nsa_flex_attention(gpu, &a, ws, need), NSA_STATUS_BAD_ARGUMENT);
    CHECK_MSG(strstr(nsa_last_error_detail(), "mask_mod") && strstr(nsa_last_error_detail(), "'doc'"),
              "flex: the refusal of a host tensor names the mod and the tensor");
    mem->download(back, o, 4 * nq * FDV);
    int same = 1;
    for (size_t e = 0; e < nq * FDV; e++) same &= back[e] == sentinel;
    CHECK_MSG(same, "flex: a refused call leaves o untouched");
    nsa_mod_destroy(mm);
    mem->release(ws), mem->release(q), mem->release(k), mem->release(v), mem->release(o);
    free(zeros), free(back), free(fill);
}

void test_flex_on(nsa_backend be, const sweep_memory *mem)
{
    if (be == NSA_BACKEND_CPU || !mem) {
        test_flex_all();
        return;
    }
    nsa_context_desc d;
    memset(&d, 0, sizeof d);
    nsa_context *cpu = NULL, *gpu = NULL;
    CHECK_STATUS(nsa_context_create(&cpu, &d), NSA_STATUS_SUCCESS);
    d.backend = be;
    CHECK_STATUS(nsa_context_create(&gpu, &d), NSA_STATUS_SUCCESS);
    if (cpu && gpu) {
        test_rng r = {20261129};
        fill_mod_tables();
        const flex_case cases[] = {
            {"causal, no block mask", "q_idx >= kv_idx", NULL, NULL, NULL, 0, 37, 37, 1, 1, NULL, NULL, 0, 0},
            {"documents + ALiBi, random blocks", "doc[q_idx + b] == doc[kv_idx + b]", "score - slope[h] * abs(q_idx - kv_idx)",
             NULL, NULL, 1, 37, 45, FB, FHQ, NULL, NULL, 0, 0},
            {"relative bias, blocks broadcast over h", "q_idx >= kv_idx", "score + rel[h, q_idx - kv_idx + 20]", NULL, NULL, 1, 45,
             45, FB, 1, NULL, NULL, 0, 0},
            {"scores to -inf, empty rows", NULL, "where(kv_idx % 3 == 0 || q_idx == 5, -exp(1000.0), score * 2)", NULL, NULL, 1,
             23, 30, 1, 1, NULL, NULL, 0, 0},
            {"route: causal, create_block_mask's lists", "q_idx >= kv_idx", NULL, NULL, NULL, 2, 45, 45, 1, 1, NULL, NULL, 0, 1},
            {"route: window 10, lists per (b, h)", "(q_idx >= kv_idx) & ((q_idx - kv_idx) < 10)", NULL, NULL, NULL, 2, 45, 45, FB,
             FHQ, NULL, NULL, 0, 1},
            {"route: documents, causal", "(docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)", NULL, NULL, NULL, 2, 50, 50, 1, 1,
             NULL, NULL, 1, 1},
            {"route: softcap, no mask", NULL, "3.0 * tanh(score / 3.0)", NULL, NULL, 0, 33, 33, 1, 1, NULL, NULL, 0, 1},
        };
        /* each case on both paths of the dense route (the engine's kernels for the routed mods too) */
        const int was = flex_route_enabled();
        for (int on = 1; on >= 0; on--) {
            flex_route_set_enabled(on);
            for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) flex_device_case(cpu, gpu, mem, &cases[i], &r);
        }
        flex_route_set_enabled(was);
        flex_device_overflowing_scores(cpu, gpu, mem);
        flex_host_tensor_refused(gpu, mem);
    }
    nsa_context_destroy(gpu);
    nsa_context_destroy(cpu);
}
