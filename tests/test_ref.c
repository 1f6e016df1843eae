/* test_ref.c -- checks of the float64 reference itself (tests/kit/ref.c).
 *
 * Every backend is judged against ref.c, so ref.c is judged here against things it cannot
 * share a bug with: central finite differences for every backward, the spec's own numbers
 * (the 1,2,2,2,1 overlap weights, l = d = l' giving p_cmp), small textbook re-derivations
 * written differently (ranges instead of predicates), hand-derived edge cases (ties, -1
 * padding, T < l, T = 1), and the row-sampled forward against the dense one.
 * Each check prints its seed and shape when it fails. */
#include "harness.h"
#include "ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void test_ref_all(void);

/* ------------------------------------------------------------------------------------ */
/* Helpers                                                                               */
/* ------------------------------------------------------------------------------------ */

/* Zeroed doubles [n]; n = 0 still gives a valid pointer. */
static double *vec(int64_t n)
{
    double *p = calloc(n > 0 ? (size_t)n : 1, sizeof(double));
    if (!p) abort();
    return p;
}

static int32_t *ivec(int64_t n)
{
    int32_t *p = calloc(n > 0 ? (size_t)n : 1, sizeof(int32_t));
    if (!p) abort();
    return p;
}

static void fill_normal(test_rng *r, double *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) x[i] = rng_normal(r);
}

static void fill_uniform(test_rng *r, double *x, int64_t n, double lo, double hi)
{
    for (int64_t i = 0; i < n; i++) x[i] = lo + (hi - lo) * rng_uniform(r);
}

static void fill_const(double *x, int64_t n, double value)
{
    for (int64_t i = 0; i < n; i++) x[i] = value;
}

/* max |x| over [n]; a NaN anywhere makes the answer NaN, so comparisons against it fail. */
static double max_abs(const double *x, int64_t n)
{
    double m = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double a = fabs(x[i]);
        if (isnan(a)) return a;
        if (a > m) m = a;
    }
    return m;
}

/* max |a - b| over [n], NaN-propagating like max_abs. */
static double max_diff(const double *a, const double *b, int64_t n)
{
    double m = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs(a[i] - b[i]);
        if (isnan(e)) return e;
        if (e > m) m = e;
    }
    return m;
}

static int all_finite(const double *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

static double dotv(const double *a, const double *b, int64_t n)
{
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Outputs are compared relative to their own size, floored at 1 (values are O(1)). */
static int close_rel(const double *got, const double *want, int64_t n, double tol)
{
    double m = max_abs(want, n);
    return max_diff(got, want, n) <= tol * (m > 1.0 ? m : 1.0);
}

/* The brief's tiny configuration: every rule has room to bite at T = 37. */
static nsa_config tiny_config(void)
{
    nsa_config c;
    memset(&c, 0, sizeof c);
    c.cmp_len = 4;
    c.cmp_stride = 2;
    c.slc_block = 8;
    c.slc_topk = 3;
    c.n_init = 1;
    c.n_local = 1;
    c.window = 5;
    return c;
}

/* The paper's proportions (l = 2d, l' = 2l, two local blocks) at a size T ~ 300 can afford. */
static nsa_config paperish_config(void)
{
    nsa_config c;
    memset(&c, 0, sizeof c);
    c.cmp_len = 16;
    c.cmp_stride = 8;
    c.slc_block = 32;
    c.slc_topk = 4;
    c.n_init = 1;
    c.n_local = 2;
    c.window = 64;
    return c;
}

static ref_dims dims(int64_t T, int64_t H, int64_t G, int64_t DK, int64_t DV)
{
    ref_dims d = {T, H * G, H, DK, DV};
    return d;
}

static int64_t nblocks(const nsa_config *c, int64_t T) { return (T + c->slc_block - 1) / c->slc_block; }

/* Test-side textbook attention row, written independently of ref.c: keys s with vis[s];
 * key s is k + s*ks [DK], value v + s*vs [DV] -> o [DV], p [Tk] (optional).
 * @return log sum exp of the visible scores, -INFINITY when none. */
static double brute_row(double scale, int64_t DK, int64_t DV, const double *q, const double *k, int64_t ks,
                        const double *v, int64_t vs, int64_t Tk, const unsigned char *vis, double *o, double *p)
{
    double mx = -INFINITY;
    for (int64_t s = 0; s < Tk; s++)
        if (vis[s]) mx = fmax(mx, scale * dotv(q, k + s * ks, DK));
    for (int64_t e = 0; e < DV; e++) o[e] = 0.0;
    if (p)
        for (int64_t s = 0; s < Tk; s++) p[s] = 0.0;
    if (mx == -INFINITY) return -INFINITY;
    double z = 0.0;
    for (int64_t s = 0; s < Tk; s++)
        if (vis[s]) z += exp(scale * dotv(q, k + s * ks, DK) - mx);
    for (int64_t s = 0; s < Tk; s++) {
        if (!vis[s]) continue;
        double w = exp(scale * dotv(q, k + s * ks, DK) - mx) / z;
        if (p) p[s] = w;
        for (int64_t e = 0; e < DV; e++) o[e] += w * v[s * vs + e];
    }
    return mx + log(z);
}

/* ------------------------------------------------------------------------------------ */
/* Finite differences                                                                    */
/* ------------------------------------------------------------------------------------ */

typedef double (*loss_fn)(void *ctx);

/* (f(x + h u) - f(x - h u)) / 2h, h = 1e-6, for u the unit vector e_i (i >= 0) or the
 * dense unit vector u [n] (i < 0); x [n] is restored bit for bit afterwards. */
static double central_diff(loss_fn f, void *ctx, double *x, int64_t n, int64_t i, const double *u)
{
    const double h = 1e-6;
    double lp, lm;
    if (i >= 0) {
        const double save = x[i];
        x[i] = save + h;
        lp = f(ctx);
        x[i] = save - h;
        lm = f(ctx);
        x[i] = save;
    } else {
        double *x0 = vec(n);
        memcpy(x0, x, (size_t)n * sizeof(double));
        for (int64_t e = 0; e < n; e++) x[e] = x0[e] + h * u[e];
        lp = f(ctx);
        for (int64_t e = 0; e < n; e++) x[e] = x0[e] - h * u[e];
        lm = f(ctx);
        memcpy(x, x0, (size_t)n * sizeof(double));
        free(x0);
    }
    return (lp - lm) / (2.0 * h);
}

/* Central finite differences of the loss f against the analytic grad [n] of x [n].
 * budget = 0: every element. budget > 0 (large pipeline cases, where one loss costs a whole
 * forward): 4 random unit directions u over the whole tensor (fd against <grad, u>) plus
 * `budget` random elements, drawn from r. Passes when every |fd - grad| <= 1e-6 *
 * max(max |grad|, 1e-2). When skip is given, the loss sets *skip at a perturbation where
 * it is not differentiable (a selection flip); that probe is left out, and leaving out
 * more than 1 in 10 fails. */
static void fd_check(const char *what, const char *info, loss_fn f, void *ctx, double *x, int64_t n,
                     const double *grad, int *skip, int64_t budget, test_rng *r)
{
    const int64_t ndir = budget > 0 && budget < n ? 4 : 0;
    const int64_t nel = ndir ? budget : n;
    double worst = 0.0, gmax = max_abs(grad, n);
    int64_t worst_i = -1, skipped = 0;
    if (n == 0) return;
    double *u = vec(n);
    for (int64_t probe = 0; probe < ndir + nel; probe++) {
        double fd, an;
        int64_t i;
        if (probe < ndir) {
            double norm = 0.0;
            fill_normal(r, u, n);
            for (int64_t e = 0; e < n; e++) norm += u[e] * u[e];
            for (int64_t e = 0; e < n; e++) u[e] /= sqrt(norm);
            i = -1 - probe;
            fd = central_diff(f, ctx, x, n, -1, u);
            an = dotv(grad, u, n);
        } else {
            i = ndir ? rng_int(r, 0, n - 1) : probe;
            fd = central_diff(f, ctx, x, n, i, NULL);
            an = grad[i];
        }
        if (skip && *skip) {
            *skip = 0;
            skipped++;
            continue;
        }
        double err = fabs(fd - an);
        if (!(err <= worst) && !isnan(worst)) {  /* a NaN, once seen, stays the worst */
            worst = err;
            worst_i = i;
        }
    }
    free(u);
    char msg[320];
    snprintf(msg, sizeof msg,
             "fd %s [%s]: max|fd-grad| %.3g at %lld (<0: direction), max|grad| %.3g, skipped %lld/%lld", what, info,
             worst, (long long)worst_i, gmax, (long long)skipped, (long long)(ndir + nel));
    CHECK_MSG(worst <= 1e-6 * (gmax > 1e-2 ? gmax : 1e-2) && skipped * 10 <= ndir + nel, msg);
}

/* ------------------------------------------------------------------------------------ */
/* Spec 1: compression                                                                   */
/* ------------------------------------------------------------------------------------ */

typedef struct compress_ctx {
    const nsa_config *c;
    int64_t T, H, D;
    const double *x, *dy;
} compress_ctx;

static double loss_compress(void *pv)
{
    const compress_ctx *p = pv;
    int64_t n = ref_num_cmp(p->c, p->T) * p->H * p->D;
    double *y = vec(n);
    ref_compress(p->c, p->T, p->H, p->D, p->x, y);
    double L = dotv(y, p->dy, n);
    free(y);
    return L;
}


/* Nc by hand, the pooled values of a ramp, and fd of the pooling for T in {1, 5, 37}. */
static void test_compress(void)
{
    static const struct { int64_t l, d, T, Nc; } table[] = {
        {4, 2, 0, 0},     {4, 2, 3, 0},     {4, 2, 4, 1},     {4, 2, 5, 1},      {4, 2, 6, 2},     {4, 2, 37, 17},
        {32, 16, 31, 0},  {32, 16, 32, 1},  {32, 16, 47, 1},  {32, 16, 48, 2},   {32, 16, 64, 3},  {64, 64, 200, 3}};
    nsa_config c = tiny_config();
    char msg[200];
    for (size_t k = 0; k < sizeof table / sizeof table[0]; k++) {
        nsa_config ck = c;
        ck.cmp_len = table[k].l;
        ck.cmp_stride = table[k].d;
        int64_t got = ref_num_cmp(&ck, table[k].T);
        snprintf(msg, sizeof msg, "l=%lld d=%lld T=%lld: Nc %lld, want %lld", (long long)table[k].l,
                 (long long)table[k].d, (long long)table[k].T, (long long)got, (long long)table[k].Nc);
        CHECK_MSG(got == table[k].Nc, msg);
    }

    /* A ramp in t pools to the block's middle position: mean(i*d .. i*d + l - 1). */
    {
        const int64_t T = 37, H = 2, D = 3, Nc = ref_num_cmp(&c, T);
        double *x = vec(T * H * D), *y = vec(Nc * H * D), *want = vec(Nc * H * D);
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t e = 0; e < D; e++) x[(t * H + h) * D + e] = 10.0 * (double)t + (double)h + 0.1 * (double)e;
        for (int64_t i = 0; i < Nc; i++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t e = 0; e < D; e++)
                    want[(i * H + h) * D + e] =
                        10.0 * ((double)(i * c.cmp_stride) + (double)(c.cmp_len - 1) / 2.0) + (double)h + 0.1 * (double)e;
        ref_compress(&c, T, H, D, x, y);
        CHECK_MSG(close_rel(y, want, Nc * H * D, 1e-13), "ramp pooling, tiny config T=37");
        free(x);
        free(y);
        free(want);
    }

    static const int64_t Ts[] = {1, 5, 37};
    for (int dd = 0; dd < 2; dd++)
        for (size_t ti = 0; ti < 3; ti++) {
            nsa_config ck = c;
            ck.cmp_stride = dd ? 4 : 2;  /* overlapping (d < l) and disjoint (d = l) blocks */
            const int64_t T = Ts[ti], H = 2, D = 3, Nc = ref_num_cmp(&ck, T);
            uint64_t seed = 100 + (uint64_t)(10 * T + dd);
            test_rng r = {seed};
            double *x = vec(T * H * D), *dy = vec(Nc * H * D), *dx = vec(T * H * D);
            fill_normal(&r, x, T * H * D);
            fill_normal(&r, dy, Nc * H * D);
            ref_compress_bwd(&ck, T, H, D, dy, dx);
            compress_ctx ctx = {&ck, T, H, D, x, dy};
            snprintf(msg, sizeof msg, "seed=%llu T=%lld l=4 d=%lld", (unsigned long long)seed, (long long)T,
                     (long long)ck.cmp_stride);
            fd_check("compress dx", msg, loss_compress, &ctx, x, T * H * D, dx, NULL, 0, NULL);
            free(x);
            free(dy);
            free(dx);
        }
}

/* lse rows agree: both -inf, or within tol relative to max(1, |want|). */
static int lse_close(const double *got, const double *want, int64_t n, double tol)
{
    for (int64_t i = 0; i < n; i++) {
        if (want[i] == -INFINITY) {
            if (got[i] != -INFINITY) return 0;
        } else if (!(fabs(got[i] - want[i]) <= tol * fmax(1.0, fabs(want[i])))) {
            return 0;
        }
    }
    return 1;
}

/* ------------------------------------------------------------------------------------ */
/* Spec 2: compressed attention                                                          */
/* ------------------------------------------------------------------------------------ */

typedef struct cmp_attn_ctx {
    const nsa_config *c;
    double scale;
    ref_dims d;
    int64_t Nc;
    const double *q, *kc, *vc, *dout;
} cmp_attn_ctx;

static double loss_cmp_attn(void *pv)
{
    const cmp_attn_ctx *p = pv;
    const int64_t NO = p->d.T * p->d.HQ * p->d.DV;
    double *o = vec(NO), *lse = vec(p->d.T * p->d.HQ);
    ref_cmp_attn(p->c, p->scale, p->d, p->Nc, p->q, p->kc, p->vc, o, lse);
    double L = dotv(o, p->dout, NO);
    free(o);
    free(lse);
    return L;
}

/* Against a textbook row over the first nvis = floor((t - l + 1) / d) + 1 blocks, the
 * empty rows (t < l - 1: o = 0, lse = -inf, dq = 0) and fd of q, k_cmp, v_cmp. */
static void test_cmp_attn(void)
{
    nsa_config c = tiny_config();
    static const int64_t Ts[] = {1, 5, 37};
    char msg[200];
    for (size_t ti = 0; ti < 3; ti++)
        for (int64_t G = 1; G <= 2; G++) {
            const int64_t T = Ts[ti];
            const ref_dims d = dims(T, 2, G, 6, 4);
            const int64_t Nc = ref_num_cmp(&c, T), NQ = T * d.HQ * d.DK, NO = T * d.HQ * d.DV;
            const int64_t NKC = Nc * d.H * d.DK, NVC = Nc * d.H * d.DV;
            const double scale = 1.0 / sqrt((double)d.DK);
            const uint64_t seed = 200 + (uint64_t)(10 * T + G);
            test_rng r = {seed};
            double *q = vec(NQ), *kc = vec(NKC), *vc = vec(NVC), *dout = vec(NO);
            double *o = vec(NO), *lse = vec(T * d.HQ), *ob = vec(NO), *lseb = vec(T * d.HQ);
            double *dq = vec(NQ), *dkc = vec(NKC), *dvc = vec(NVC);
            unsigned char *vis = calloc((size_t)Nc + 1, 1);
            fill_normal(&r, q, NQ);
            fill_normal(&r, kc, NKC);
            fill_normal(&r, vc, NVC);
            fill_normal(&r, dout, NO);
            snprintf(msg, sizeof msg, "seed=%llu T=%lld G=%lld", (unsigned long long)seed, (long long)T, (long long)G);

            ref_cmp_attn(&c, scale, d, Nc, q, kc, vc, o, lse);
            int64_t empty_rows = 0;
            for (int64_t t = 0; t < T; t++) {
                int64_t nvis = t >= c.cmp_len - 1 ? (t - c.cmp_len + 1) / c.cmp_stride + 1 : 0;
                if (nvis > Nc) nvis = Nc;
                if (nvis == 0) empty_rows++;
                for (int64_t i = 0; i < Nc; i++) vis[i] = (unsigned char)(i < nvis);
                for (int64_t hq = 0; hq < d.HQ; hq++) {
                    const int64_t h = hq / G;
                    lseb[t * d.HQ + hq] = brute_row(scale, d.DK, d.DV, q + (t * d.HQ + hq) * d.DK, kc + h * d.DK,
                                                    d.H * d.DK, vc + h * d.DV, d.H * d.DV, Nc, vis,
                                                    ob + (t * d.HQ + hq) * d.DV, NULL);
                }
            }
            CHECK_MSG(close_rel(o, ob, NO, 1e-12), msg);
            CHECK_MSG(lse_close(lse, lseb, T * d.HQ, 1e-12), msg);

            ref_cmp_attn_bwd(&c, scale, d, Nc, q, kc, vc, dout, NULL, dq, dkc, dvc);
            /* Rows that see no block: exactly zero output and dq, -inf lse, never NaN. */
            const int64_t ne = T < c.cmp_len - 1 ? T : c.cmp_len - 1;
            int empty_ok = 1;
            for (int64_t t = 0; t < ne; t++)
                for (int64_t hq = 0; hq < d.HQ; hq++) {
                    if (lse[t * d.HQ + hq] != -INFINITY) empty_ok = 0;
                    if (max_abs(o + (t * d.HQ + hq) * d.DV, d.DV) != 0.0) empty_ok = 0;
                    if (max_abs(dq + (t * d.HQ + hq) * d.DK, d.DK) != 0.0) empty_ok = 0;
                }
            CHECK_MSG(empty_ok && empty_rows == ne, msg);
            CHECK_MSG(all_finite(o, NO) && all_finite(dq, NQ) && all_finite(dkc, NKC) && all_finite(dvc, NVC), msg);

            cmp_attn_ctx ctx = {&c, scale, d, Nc, q, kc, vc, dout};
            fd_check("cmp_attn dq", msg, loss_cmp_attn, &ctx, q, NQ, dq, NULL, 0, NULL);
            fd_check("cmp_attn dk_cmp", msg, loss_cmp_attn, &ctx, kc, NKC, dkc, NULL, 0, NULL);
            fd_check("cmp_attn dv_cmp", msg, loss_cmp_attn, &ctx, vc, NVC, dvc, NULL, 0, NULL);
            free(q);
            free(kc);
            free(vc);
            free(dout);
            free(o);
            free(lse);
            free(ob);
            free(lseb);
            free(dq);
            free(dkc);
            free(dvc);
            free(vis);
        }
}

/* ------------------------------------------------------------------------------------ */
/* Spec 4: selected attention                                                            */
/* ------------------------------------------------------------------------------------ */

typedef struct slc_ctx {
    const nsa_config *c;
    double scale;
    ref_dims d;
    const double *q, *k, *v;
    const int32_t *idx;
    int64_t m;
    const int32_t *counts;
    const double *dout;
} slc_ctx;

static double loss_slc(void *pv)
{
    const slc_ctx *p = pv;
    const int64_t NO = p->d.T * p->d.HQ * p->d.DV;
    double *o = vec(NO), *lse = vec(p->d.T * p->d.HQ);
    ref_slc_attn(p->c, p->scale, p->d, p->q, p->k, p->v, p->idx, p->m, p->counts, o, lse);
    double L = dotv(o, p->dout, NO);
    free(o);
    free(lse);
    return L;
}

/* Messy caller indices (-1, out of range, duplicates, counts outside [0, m]) against a
 * token-by-token membership test; every block selected against causal attention; fd. */
static void test_slc_attn(void)
{
    nsa_config c = tiny_config();
    static const int64_t Ts[] = {1, 5, 37};
    char msg[200];
    for (size_t ti = 0; ti < 3; ti++)
        for (int64_t G = 1; G <= 2; G++)
            for (int use_counts = 0; use_counts < 2; use_counts++) {
                const int64_t T = Ts[ti], m = 4, nb = nblocks(&c, T);
                const ref_dims d = dims(T, 2, G, 6, 4);
                const int64_t NQ = T * d.HQ * d.DK, NO = T * d.HQ * d.DV, NK = T * d.H * d.DK, NV = T * d.H * d.DV;
                const double scale = 1.0 / sqrt((double)d.DK);
                const uint64_t seed = 300 + (uint64_t)(100 * T + 10 * G + use_counts);
                test_rng r = {seed};
                double *q = vec(NQ), *k = vec(NK), *v = vec(NV), *dout = vec(NO);
                double *o = vec(NO), *lse = vec(T * d.HQ), *ob = vec(NO), *lseb = vec(T * d.HQ);
                double *dq = vec(NQ), *dk = vec(NK), *dv = vec(NV);
                int32_t *idx = ivec(T * d.H * m), *counts = ivec(T * d.H), *all = ivec(T * d.H * nb);
                unsigned char *vis = calloc((size_t)T, 1);
                fill_normal(&r, q, NQ);
                fill_normal(&r, k, NK);
                fill_normal(&r, v, NV);
                fill_normal(&r, dout, NO);
                for (int64_t i = 0; i < T * d.H * m; i++) idx[i] = (int32_t)rng_int(&r, -2, nb + 1);
                for (int64_t i = 0; i < T * d.H; i++) counts[i] = (int32_t)rng_int(&r, -1, m + 1);
                const int32_t *cnts = use_counts ? counts : NULL;
                snprintf(msg, sizeof msg, "seed=%llu T=%lld G=%lld counts=%d", (unsigned long long)seed, (long long)T,
                         (long long)G, use_counts);

                ref_slc_attn(&c, scale, d, q, k, v, idx, m, cnts, o, lse);
                for (int64_t t = 0; t < T; t++)
                    for (int64_t h = 0; h < d.H; h++) {
                        int64_t cnt = m;
                        if (cnts) cnt = counts[t * d.H + h] < 0 ? 0 : (counts[t * d.H + h] > m ? m : counts[t * d.H + h]);
                        for (int64_t s = 0; s < T; s++) {
                            vis[s] = 0;
                            for (int64_t e = 0; e < cnt && s <= t; e++)
                                if (idx[(t * d.H + h) * m + e] == s / c.slc_block) vis[s] = 1;
                        }
                        for (int64_t g = 0; g < G; g++) {
                            const int64_t hq = h * G + g;
                            lseb[t * d.HQ + hq] = brute_row(scale, d.DK, d.DV, q + (t * d.HQ + hq) * d.DK, k + h * d.DK,
                                                            d.H * d.DK, v + h * d.DV, d.H * d.DV, T, vis,
                                                            ob + (t * d.HQ + hq) * d.DV, NULL);
                        }
                    }
                CHECK_MSG(close_rel(o, ob, NO, 1e-12), msg);
                CHECK_MSG(lse_close(lse, lseb, T * d.HQ, 1e-12), msg);
                CHECK_MSG(all_finite(o, NO), msg);

                /* Selecting every block is plain causal attention. */
                for (int64_t th = 0; th < T * d.H; th++)
                    for (int64_t j = 0; j < nb; j++) all[th * nb + j] = (int32_t)j;
                ref_slc_attn(&c, scale, d, q, k, v, all, nb, NULL, o, lse);
                ref_attention(scale, 1, -1, -1, d, q, k, v, ob, lseb);
                CHECK_MSG(close_rel(o, ob, NO, 1e-12) && lse_close(lse, lseb, T * d.HQ, 1e-12), msg);

                ref_slc_attn_bwd(&c, scale, d, q, k, v, idx, m, cnts, dout, NULL, dq, dk, dv);
                slc_ctx ctx = {&c, scale, d, q, k, v, idx, m, cnts, dout};
                fd_check("slc_attn dq", msg, loss_slc, &ctx, q, NQ, dq, NULL, 0, NULL);
                fd_check("slc_attn dk", msg, loss_slc, &ctx, k, NK, dk, NULL, 0, NULL);
                fd_check("slc_attn dv", msg, loss_slc, &ctx, v, NV, dv, NULL, 0, NULL);
                free(q);
                free(k);
                free(v);
                free(dout);
                free(o);
                free(lse);
                free(ob);
                free(lseb);
                free(dq);
                free(dk);
                free(dv);
                free(idx);
                free(counts);
                free(all);
                free(vis);
            }
}

/* ------------------------------------------------------------------------------------ */
/* Spec 5: windowed attention                                                            */
/* ------------------------------------------------------------------------------------ */

typedef struct attn_ctx {
    double scale;
    int causal;
    int64_t wl, wr;
    ref_dims d;
    const double *q, *k, *v, *dout;
} attn_ctx;

static double loss_attn(void *pv)
{
    const attn_ctx *p = pv;
    const int64_t NO = p->d.T * p->d.HQ * p->d.DV;
    double *o = vec(NO), *lse = vec(p->d.T * p->d.HQ);
    ref_attention(p->scale, p->causal, p->wl, p->wr, p->d, p->q, p->k, p->v, o, lse);
    double L = dotv(o, p->dout, NO);
    free(o);
    free(lse);
    return L;
}

/* Every window case against a textbook row over the key range [lo, hi]; a one-key window
 * returns v[t] itself; fd for causal + window and non-causal with both windows. */
static void test_attention(void)
{
    static const struct { int causal; int64_t wl, wr; int fd; } cases[] = {
        {1, 3, 7, 1}, {0, 2, 1, 1}, {1, -1, -1, 0}, {1, 0, -1, 0}, {0, -1, -1, 0}, {0, -1, 2, 0}, {0, 3, -1, 0},
        {0, 0, 0, 0}};
    static const int64_t Ts[] = {1, 5, 37};
    char msg[200];
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (size_t ti = 0; ti < 3; ti++)
            for (int64_t G = 1; G <= 2; G++) {
                const int causal = cases[ci].causal;
                const int64_t wl = cases[ci].wl, wr = cases[ci].wr, T = Ts[ti];
                const ref_dims d = dims(T, 2, G, 6, 4);
                const int64_t NQ = T * d.HQ * d.DK, NO = T * d.HQ * d.DV, NK = T * d.H * d.DK, NV = T * d.H * d.DV;
                const double scale = 1.0 / sqrt((double)d.DK);
                const uint64_t seed = 400 + (uint64_t)(1000 * ci + 10 * T + G);
                test_rng r = {seed};
                double *q = vec(NQ), *k = vec(NK), *v = vec(NV), *dout = vec(NO);
                double *o = vec(NO), *lse = vec(T * d.HQ), *ob = vec(NO), *lseb = vec(T * d.HQ);
                unsigned char *vis = calloc((size_t)T, 1);
                fill_normal(&r, q, NQ);
                fill_normal(&r, k, NK);
                fill_normal(&r, v, NV);
                fill_normal(&r, dout, NO);
                snprintf(msg, sizeof msg, "seed=%llu T=%lld G=%lld causal=%d wl=%lld wr=%lld", (unsigned long long)seed,
                         (long long)T, (long long)G, causal, (long long)wl, (long long)wr);

                ref_attention(scale, causal, wl, wr, d, q, k, v, o, lse);
                int one_key_ok = 1;
                for (int64_t t = 0; t < T; t++) {
                    int64_t lo = wl < 0 ? 0 : (t - wl > 0 ? t - wl : 0);
                    int64_t hi = causal ? t : (wr < 0 ? T - 1 : (t + wr < T - 1 ? t + wr : T - 1));
                    for (int64_t s = 0; s < T; s++) vis[s] = (unsigned char)(s >= lo && s <= hi);
                    for (int64_t hq = 0; hq < d.HQ; hq++) {
                        const int64_t h = hq / G;
                        lseb[t * d.HQ + hq] = brute_row(scale, d.DK, d.DV, q + (t * d.HQ + hq) * d.DK, k + h * d.DK,
                                                        d.H * d.DK, v + h * d.DV, d.H * d.DV, T, vis,
                                                        ob + (t * d.HQ + hq) * d.DV, NULL);
                        if (lo == hi && max_diff(o + (t * d.HQ + hq) * d.DV, v + (t * d.H + h) * d.DV, d.DV) > 1e-15)
                            one_key_ok = 0;
                    }
                }
                CHECK_MSG(close_rel(o, ob, NO, 1e-12) && lse_close(lse, lseb, T * d.HQ, 1e-12), msg);
                CHECK_MSG(one_key_ok, msg);

                if (cases[ci].fd) {
                    double *dq = vec(NQ), *dk = vec(NK), *dv = vec(NV);
                    ref_attention_bwd(scale, causal, wl, wr, d, q, k, v, dout, NULL, dq, dk, dv);
                    attn_ctx ctx = {scale, causal, wl, wr, d, q, k, v, dout};
                    fd_check("attention dq", msg, loss_attn, &ctx, q, NQ, dq, NULL, 0, NULL);
                    fd_check("attention dk", msg, loss_attn, &ctx, k, NK, dk, NULL, 0, NULL);
                    fd_check("attention dv", msg, loss_attn, &ctx, v, NV, dv, NULL, 0, NULL);
                    free(dq);
                    free(dk);
                    free(dv);
                }
                free(q);
                free(k);
                free(v);
                free(dout);
                free(o);
                free(lse);
                free(ob);
                free(lseb);
                free(vis);
            }
}

/* ------------------------------------------------------------------------------------ */
/* Spec 3: importance and selection                                                      */
/* ------------------------------------------------------------------------------------ */

/* The spec's worked example: l=32, d=16, l'=64. One-hot compressed keys and a query of
 * 1000 times one of them put p_cmp = 1 exactly on block i0 (the rest underflow to 0), so
 * imp[t, h, :] = G * ov(i0, :) / d, which the spec gives as 1,2,2,2,1 on j for
 * i0 = 4j-1 .. 4j+3 (and the remainder, 1, on j-1 for i0 = 4j-1 and on j+1 for 4j+3). */
static void test_select_worked_example(void)
{
    nsa_config c = paperish_config();
    c.cmp_len = 32;
    c.cmp_stride = 16;
    c.slc_block = 64;
    c.slc_topk = 16;
    const int64_t T = 320, G = 2, j = 2, nb = 5;
    const int64_t Nc = ref_num_cmp(&c, T);  /* 19 */
    const ref_dims d = dims(T, 1, G, Nc, 1);
    static const double w[5] = {1, 2, 2, 2, 1};
    double *q = vec(T * d.HQ * d.DK), *kc = vec(Nc * d.DK), *imp = vec(T * nb), *want = vec(nb);
    int32_t *idx = ivec(T * c.slc_topk);
    char msg[200];
    CHECK(Nc == 19 && nblocks(&c, T) == nb);
    for (int64_t i = 0; i < Nc; i++) kc[i * d.DK + i] = 1.0;
    double measured[5];
    for (int64_t r = 0; r < 5; r++) {
        const int64_t i0 = 4 * j - 1 + r;
        memset(q, 0, (size_t)(T * d.HQ * d.DK) * sizeof(double));
        for (int64_t th = 0; th < T * d.HQ; th++) q[th * d.DK + i0] = 1000.0;
        ref_select(&c, 1.0, d, Nc, q, kc, idx, imp);
        for (int64_t jj = 0; jj < nb; jj++) want[jj] = 0.0;
        want[j] = (double)G * w[r];
        if (r == 0) want[j - 1] = (double)G;
        if (r == 4) want[j + 1] = (double)G;
        int ok = 1;
        for (int64_t t = i0 * c.cmp_stride + c.cmp_len - 1; t < T; t++)
            if (max_diff(imp + t * nb, want, nb) > 1e-12) ok = 0;
        measured[r] = imp[(T - 1) * nb + j] / (double)G;
        snprintf(msg, sizeof msg, "worked example i0=%lld: imp[T-1] = %g %g %g %g %g", (long long)i0, imp[(T - 1) * nb],
                 imp[(T - 1) * nb + 1], imp[(T - 1) * nb + 2], imp[(T - 1) * nb + 3], imp[(T - 1) * nb + 4]);
        CHECK_MSG(ok, msg);
    }
    snprintf(msg, sizeof msg, "weights on j=2: %g %g %g %g %g, want 1 2 2 2 1", measured[0], measured[1], measured[2],
             measured[3], measured[4]);
    CHECK_MSG(max_diff(measured, w, 5) <= 1e-12, msg);
    free(q);
    free(kc);
    free(imp);
    free(want);
    free(idx);
}

/* l = d = l': importance is p_cmp itself, summed over the group (p_cmp derived here). */
static void test_select_equal_blocks(void)
{
    nsa_config c = tiny_config();
    c.cmp_len = c.cmp_stride = c.slc_block = 8;
    const int64_t T = 37, G = 2;
    const ref_dims d = dims(T, 2, G, 5, 1);
    const int64_t Nc = ref_num_cmp(&c, T), nb = nblocks(&c, T), NQ = T * d.HQ * d.DK;
    const double scale = 1.0 / sqrt((double)d.DK);
    const uint64_t seed = 500;
    test_rng r = {seed};
    double *q = vec(NQ), *kc = vec(Nc * d.H * d.DK), *imp = vec(T * d.H * nb), *want = vec(T * d.H * nb);
    double *p = vec(Nc), o1;
    int32_t *idx = ivec(T * d.H * c.slc_topk);
    unsigned char *vis = calloc((size_t)Nc, 1);
    fill_normal(&r, q, NQ);
    fill_normal(&r, kc, Nc * d.H * d.DK);
    ref_select(&c, scale, d, Nc, q, kc, idx, imp);
    for (int64_t t = 0; t < T; t++)
        for (int64_t hq = 0; hq < d.HQ; hq++) {
            const int64_t h = hq / G;
            for (int64_t i = 0; i < Nc; i++) vis[i] = (unsigned char)(8 * i + 7 <= t);
            /* brute_row with DV = 0: only the probabilities are wanted. */
            brute_row(scale, d.DK, 0, q + (t * d.HQ + hq) * d.DK, kc + h * d.DK, d.H * d.DK, kc, 0, Nc, vis, &o1, p);
            for (int64_t i = 0; i < Nc; i++) want[(t * d.H + h) * nb + i] += p[i];
        }
    char msg[120];
    snprintf(msg, sizeof msg, "l=d=l'=8 seed=%llu T=37 G=2: imp != sum_g p_cmp", (unsigned long long)seed);
    CHECK_MSG(max_diff(imp, want, T * d.H * nb) <= 1e-12, msg);
    free(q);
    free(kc);
    free(imp);
    free(want);
    free(p);
    free(idx);
    free(vis);
}

/* What any correct selection satisfies, checked on random inputs against its own imp:
 * min(n, cur+1) kept, ascending, then -1; forced blocks kept; every kept non-forced block
 * outranks every dropped one (higher imp, or equal imp and lower index); imp = 0 beyond
 * cur; sum_j imp = G * l / d once a block is visible (p_cmp sums to 1, each block spreads
 * l/d over the selection blocks), else 0. */
static void check_select_properties(const nsa_config *c, int64_t T, int64_t G, uint64_t seed)
{
    const ref_dims d = dims(T, 2, G, 6, 1);
    const int64_t Nc = ref_num_cmp(c, T), nb = nblocks(c, T), n = c->slc_topk, lp = c->slc_block;
    const double scale = 1.0 / sqrt((double)d.DK);
    if (nb > 64) {  /* in_row below holds 64 blocks */
        CHECK_MSG(nb <= 64, "check_select_properties: more than 64 selection blocks");
        return;
    }
    test_rng r = {seed};
    double *q = vec(T * d.HQ * d.DK), *kc = vec(Nc * d.H * d.DK), *imp = vec(T * d.H * nb);
    int32_t *idx = ivec(T * d.H * n);
    fill_normal(&r, q, T * d.HQ * d.DK);
    fill_normal(&r, kc, Nc * d.H * d.DK);
    for (int64_t i = 0; i < T * d.HQ * d.DK; i++) q[i] *= 3.0;  /* peaked p_cmp: importance varies */
    ref_select(c, scale, d, Nc, q, kc, idx, imp);
    long bad_shape = 0, bad_forced = 0, bad_rank = 0, bad_imp = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < d.H; h++) {
            const int32_t *row = idx + (t * d.H + h) * n;
            const double *im = imp + (t * d.H + h) * nb;
            const int64_t cur = t / lp, kept = n < cur + 1 ? n : cur + 1;
            unsigned char in_row[64] = {0};  /* nb <= 64 in every call below */
            for (int64_t e = 0; e < n; e++) {
                if (e < kept) {
                    if (row[e] < 0 || row[e] > cur || (e > 0 && row[e] <= row[e - 1])) bad_shape++;
                    else in_row[row[e]] = 1;
                } else if (row[e] != -1) {
                    bad_shape++;
                }
            }
            for (int64_t j = 0; j <= cur; j++) {
                const int forced = j < c->n_init || j > cur - c->n_local;
                if (forced && !in_row[j]) bad_forced++;
                if (forced || in_row[j]) continue;
                for (int64_t e = 0; e < kept; e++) {  /* j dropped: every kept non-forced one beats it */
                    const int64_t js = row[e];
                    if (js < 0 || js >= nb || js < c->n_init || js > cur - c->n_local) continue;
                    if (!(im[js] > im[j] || (im[js] == im[j] && js < j))) bad_rank++;
                }
            }
            double sum = 0.0;
            for (int64_t j = 0; j < nb; j++) {
                if (im[j] < 0.0 || (j > cur && im[j] != 0.0)) bad_imp++;
                sum += im[j];
            }
            const double want = t >= c->cmp_len - 1 ? (double)(G * c->cmp_len) / (double)c->cmp_stride : 0.0;
            if (!(fabs(sum - want) <= 1e-12 * (1.0 + want))) bad_imp++;
        }
    char msg[200];
    snprintf(msg, sizeof msg, "seed=%llu T=%lld G=%lld l=%lld d=%lld l'=%lld n=%lld: shape %ld forced %ld rank %ld imp %ld",
             (unsigned long long)seed, (long long)T, (long long)G, (long long)c->cmp_len, (long long)c->cmp_stride,
             (long long)lp, (long long)n, bad_shape, bad_forced, bad_rank, bad_imp);
    CHECK_MSG(bad_shape == 0, msg);
    CHECK_MSG(bad_forced == 0, msg);
    CHECK_MSG(bad_rank == 0, msg);
    CHECK_MSG(bad_imp == 0, msg);
    free(q);
    free(kc);
    free(imp);
    free(idx);
}

/* q = 0 with l = d = l' makes every visible block equally important, so after the forced
 * ones the lowest indices win; rows with fewer than n candidates end in -1. The expected
 * rows are built here by hand from the rule. */
static void check_select_ties(int64_t n_local, uint64_t seed)
{
    nsa_config c = tiny_config();
    c.cmp_len = c.cmp_stride = c.slc_block = 4;
    c.slc_topk = 4;
    c.n_init = 1;
    c.n_local = n_local;
    const int64_t T = 37, G = 2, n = c.slc_topk;
    const ref_dims d = dims(T, 2, G, 3, 1);
    const int64_t Nc = ref_num_cmp(&c, T);
    test_rng r = {seed};
    double *q = vec(T * d.HQ * d.DK), *kc = vec(Nc * d.H * d.DK);
    int32_t *idx = ivec(T * d.H * n), *want = ivec(T * d.H * n);
    fill_normal(&r, kc, Nc * d.H * d.DK);
    ref_select(&c, 0.5, d, Nc, q, kc, idx, NULL);
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < d.H; h++) {
            int32_t *w = want + (t * d.H + h) * n;
            const int64_t cur = t / c.slc_block;
            unsigned char take[64] = {0};
            int64_t taken = 0;
            for (int64_t j = 0; j <= cur; j++)
                if (j < c.n_init || j > cur - c.n_local) {
                    take[j] = 1;
                    taken++;
                }
            for (int64_t j = 0; j <= cur && taken < n; j++)
                if (!take[j]) {
                    take[j] = 1;
                    taken++;
                }
            int64_t e = 0;
            for (int64_t j = 0; j <= cur; j++)
                if (take[j]) w[e++] = (int32_t)j;
            for (; e < n; e++) w[e] = -1;
        }
    int64_t bad = 0;  /* the first row (t * H + h) that differs */
    while (bad < T * d.H && memcmp(idx + bad * n, want + bad * n, (size_t)n * sizeof(int32_t)) == 0) bad++;
    const int64_t shown = bad < T * d.H ? bad : 0;
    const int32_t *gr = idx + shown * n, *wr = want + shown * n;
    char msg[200];
    snprintf(msg, sizeof msg, "ties q=0 l=d=l'=4 n=4 n_local=%lld seed=%llu: t=%lld h=%lld got %d %d %d %d want %d %d %d %d",
             (long long)n_local, (unsigned long long)seed, (long long)(shown / d.H), (long long)(shown % d.H), gr[0],
             gr[1], gr[2], gr[3], wr[0], wr[1], wr[2], wr[3]);
    CHECK_MSG(bad == T * d.H, msg);
    /* t = 0 has one candidate: [0, -1, -1, -1]. t = 36 (cur 9): 0 and the n_local last are
     * forced, the lowest fill the rest: [0, 1, 2, 9] or [0, 1, 8, 9]. */
    const int32_t *last = idx + (36 * d.H + 1) * n;
    CHECK_MSG(idx[0] == 0 && idx[1] == -1 && idx[2] == -1 && idx[3] == -1, msg);
    CHECK_MSG(last[0] == 0 && last[1] == 1 && last[2] == (n_local == 1 ? 2 : 8) && last[3] == 9, msg);
    free(q);
    free(kc);
    free(idx);
    free(want);
}

static void test_select(void)
{
    nsa_config tiny = tiny_config(), paper = paperish_config();
    test_select_worked_example();
    test_select_equal_blocks();
    check_select_properties(&tiny, 37, 1, 601);
    check_select_properties(&tiny, 37, 2, 602);
    check_select_properties(&tiny, 5, 2, 603);
    check_select_properties(&paper, 300, 2, 604);
    check_select_ties(1, 611);
    check_select_ties(2, 612);
}

/* ------------------------------------------------------------------------------------ */
/* Spec 6: the whole pipeline                                                            */
/* ------------------------------------------------------------------------------------ */

/* Which optional inputs a pipeline case passes. Without an IDX flag the selection is
 * computed by the reference itself. */
enum {
    P_SEP_SLC = 1,      /* k_slc, v_slc */
    P_SEP_SWA = 2,      /* k_swa, v_swa */
    P_OWN_CMP = 4,      /* k_cmp, v_cmp */
    P_G_CMP = 8,
    P_G_SLC = 16,
    P_G_SWA = 32,
    P_GATES = P_G_CMP | P_G_SLC | P_G_SWA,
    P_IDX_FIXED = 64,   /* the reference's own selection, frozen and passed back in */
    P_IDX_MESSY = 128   /* random caller indices with -1, out of range, duplicates, counts */
};

/* Every tensor a pipeline call may take, all filled. */
typedef struct pipe_data {
    ref_dims d;
    int64_t Nc, nb, m;
    double *q, *k, *v, *ks, *vs, *kw, *vw, *kc, *vc, *gc, *gs, *gw, *dout;
    int32_t *idx, *counts;
} pipe_data;

static pipe_data pipe_data_make(test_rng *r, const nsa_config *c, ref_dims d, int64_t m)
{
    pipe_data p;
    const int64_t T = d.T, NK = T * d.H * d.DK, NV = T * d.H * d.DV;
    p.d = d;
    p.Nc = ref_num_cmp(c, T);
    p.nb = nblocks(c, T);
    p.m = m;
    p.q = vec(T * d.HQ * d.DK);
    p.k = vec(NK);
    p.v = vec(NV);
    p.ks = vec(NK);
    p.vs = vec(NV);
    p.kw = vec(NK);
    p.vw = vec(NV);
    p.kc = vec(p.Nc * d.H * d.DK);
    p.vc = vec(p.Nc * d.H * d.DV);
    p.gc = vec(T * d.HQ);
    p.gs = vec(T * d.HQ);
    p.gw = vec(T * d.HQ);
    p.dout = vec(T * d.HQ * d.DV);
    p.idx = ivec(T * d.H * m);
    p.counts = ivec(T * d.H);
    fill_normal(r, p.q, T * d.HQ * d.DK);
    fill_normal(r, p.k, NK);
    fill_normal(r, p.v, NV);
    fill_normal(r, p.ks, NK);
    fill_normal(r, p.vs, NV);
    fill_normal(r, p.kw, NK);
    fill_normal(r, p.vw, NV);
    fill_normal(r, p.kc, p.Nc * d.H * d.DK);
    fill_normal(r, p.vc, p.Nc * d.H * d.DV);
    fill_uniform(r, p.gc, T * d.HQ, 0.2, 1.0);  /* sigmoid-like gates */
    fill_uniform(r, p.gs, T * d.HQ, 0.2, 1.0);
    fill_uniform(r, p.gw, T * d.HQ, 0.2, 1.0);
    fill_normal(r, p.dout, T * d.HQ * d.DV);
    for (int64_t i = 0; i < T * d.H * m; i++) p.idx[i] = (int32_t)rng_int(r, -2, p.nb + 1);
    for (int64_t i = 0; i < T * d.H; i++) p.counts[i] = (int32_t)rng_int(r, -1, m + 1);
    return p;
}

static void pipe_data_free(pipe_data *p)
{
    double *all[] = {p->q, p->k, p->v, p->ks, p->vs, p->kw, p->vw, p->kc, p->vc, p->gc, p->gs, p->gw, p->dout};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
    free(p->idx);
    free(p->counts);
}

/* The inputs of one case: only what `flags` names (P_IDX_FIXED is filled in later). */
static ref_nsa_inputs pipe_inputs(const pipe_data *p, unsigned flags)
{
    ref_nsa_inputs in;
    memset(&in, 0, sizeof in);
    in.q = p->q;
    in.k = p->k;
    in.v = p->v;
    if (flags & P_SEP_SLC) {
        in.k_slc = p->ks;
        in.v_slc = p->vs;
    }
    if (flags & P_SEP_SWA) {
        in.k_swa = p->kw;
        in.v_swa = p->vw;
    }
    if (flags & P_OWN_CMP) {
        in.k_cmp = p->kc;
        in.v_cmp = p->vc;
    }
    in.g_cmp = (flags & P_G_CMP) ? p->gc : NULL;
    in.g_slc = (flags & P_G_SLC) ? p->gs : NULL;
    in.g_swa = (flags & P_G_SWA) ? p->gw : NULL;
    if (flags & P_IDX_MESSY) {
        in.block_indices = p->idx;
        in.m = p->m;
        in.block_counts = p->counts;
    }
    return in;
}

typedef struct pipe_ctx {
    const nsa_config *c;
    double scale;
    ref_dims d;
    ref_nsa_inputs in;
    const double *dout;
    const int32_t *base_idx;  /* the unperturbed computed selection, or NULL (indices given) */
    int64_t width;
    int flipped;              /* set when a perturbation changed the computed selection */
} pipe_ctx;

static double loss_pipe(void *pv)
{
    pipe_ctx *p = pv;
    const int64_t NO = p->d.T * p->d.HQ * p->d.DV, NI = p->d.T * p->d.H * p->width;
    double *o = vec(NO);
    int32_t *used = p->base_idx ? ivec(NI) : NULL;
    ref_nsa_forward(p->c, p->scale, p->d, &p->in, o, NULL, NULL, NULL, used);
    if (used && memcmp(used, p->base_idx, (size_t)NI * sizeof(int32_t)) != 0) p->flipped = 1;
    double L = dotv(o, p->dout, NO);
    free(o);
    free(used);
    return L;
}

/* fd of every input a case passes against ref_nsa_backward; every gradient of an input the
 * case does not pass (or of a disabled gate) must come back as zeros over the sentinel. */
static void pipeline_fd_case(const nsa_config *c, int64_t T, int64_t G, unsigned flags, uint64_t seed)
{
    const ref_dims d = dims(T, 2, G, 6, 4);
    const double scale = 1.0 / sqrt((double)d.DK);
    test_rng r = {seed};
    pipe_data p = pipe_data_make(&r, c, d, 4);
    ref_nsa_inputs in = pipe_inputs(&p, flags);
    const int64_t H = d.H, Nc = p.Nc, NQ = T * d.HQ * d.DK, NK = T * H * d.DK, NV = T * H * d.DV;
    const int64_t NKC = Nc * H * d.DK, NVC = Nc * H * d.DV, NG = T * d.HQ;
    const int64_t width = in.block_indices ? in.m : c->slc_topk;
    int32_t *base = ivec(T * H * width);
    double *o = vec(T * d.HQ * d.DV);
    ref_nsa_forward(c, scale, d, &in, o, NULL, NULL, NULL, base);
    if (flags & P_IDX_MESSY) {  /* the caller's indices are reported back unchanged */
        char m1[160];
        snprintf(m1, sizeof m1, "block_indices_used != caller's, seed=%llu T=%lld", (unsigned long long)seed, (long long)T);
        CHECK_MSG(memcmp(base, p.idx, (size_t)(T * H * width) * sizeof(int32_t)) == 0, m1);
    }
    if (flags & P_IDX_FIXED) {
        in.block_indices = base;
        in.m = width;
    }
    const int computed = in.block_indices == NULL;

    /* Every gradient is asked for and pre-filled, so "not written" cannot pass as zero. */
    const int64_t sizes[12] = {NQ, NK, NV, NK, NV, NK, NV, NKC, NVC, NG, NG, NG};
    double *gbuf[12];
    for (int i = 0; i < 12; i++) {
        gbuf[i] = vec(sizes[i]);
        fill_const(gbuf[i], sizes[i], 777.0);
    }
    ref_nsa_grads g = {gbuf[0], gbuf[1], gbuf[2], gbuf[3], gbuf[4], gbuf[5],
                       gbuf[6], gbuf[7], gbuf[8], gbuf[9], gbuf[10], gbuf[11]};
    ref_nsa_backward(c, scale, d, &in, p.dout, &g);

    char msg[200];
    snprintf(msg, sizeof msg, "pipeline seed=%llu T=%lld G=%lld flags=0x%x", (unsigned long long)seed, (long long)T,
             (long long)G, flags);
    pipe_ctx ctx = {c, scale, d, in, p.dout, computed ? base : NULL, width, 0};
    int *skip = computed ? &ctx.flipped : NULL;
    /* Every element up to T = 5; at T = 37 a forward is dear, so directions + a sample. */
    const int64_t budget = T > 5 ? 24 : 0;
    /* Each optional input: fd when passed, else its gradient must be zeros. */
    struct { const char *name; double *x; int passed; } opt[9] = {
        {"dk_slc", p.ks, in.k_slc != NULL}, {"dv_slc", p.vs, in.v_slc != NULL},
        {"dk_swa", p.kw, in.k_swa != NULL}, {"dv_swa", p.vw, in.v_swa != NULL},
        {"dk_cmp", p.kc, in.k_cmp != NULL}, {"dv_cmp", p.vc, in.v_cmp != NULL},
        {"dg_cmp", p.gc, in.g_cmp != NULL}, {"dg_slc", p.gs, in.g_slc != NULL},
        {"dg_swa", p.gw, in.g_swa != NULL}};
    fd_check("dq", msg, loss_pipe, &ctx, p.q, NQ, g.dq, skip, budget, &r);
    fd_check("dk", msg, loss_pipe, &ctx, p.k, NK, g.dk, skip, budget, &r);
    fd_check("dv", msg, loss_pipe, &ctx, p.v, NV, g.dv, skip, budget, &r);
    for (int i = 0; i < 9; i++) {
        if (opt[i].passed) {
            fd_check(opt[i].name, msg, loss_pipe, &ctx, opt[i].x, sizes[3 + i], gbuf[3 + i], skip, budget, &r);
        } else {
            char m2[260];
            snprintf(m2, sizeof m2, "%s not zero [%s]", opt[i].name, msg);
            CHECK_MSG(max_abs(gbuf[3 + i], sizes[3 + i]) == 0.0, m2);
        }
    }
    for (int i = 0; i < 12; i++) free(gbuf[i]);
    free(base);
    free(o);
    pipe_data_free(&p);
}

static void test_pipeline_fd(void)
{
    static const unsigned cases[] = {
        P_GATES | P_IDX_FIXED,                                      /* defaults: dk, dv get all three */
        P_GATES | P_SEP_SLC | P_SEP_SWA | P_OWN_CMP | P_IDX_MESSY,  /* every input separate */
        P_GATES,                                                    /* computed selection, flip-checked */
        P_G_CMP | P_G_SWA | P_SEP_SLC | P_OWN_CMP,                  /* selection branch off */
        P_G_SLC | P_OWN_CMP,      /* selection from the caller's k_cmp, which gets no gradient */
        P_G_SLC | P_G_SWA | P_SEP_SWA};
    static const int64_t Ts[] = {1, 5, 37};
    nsa_config c = tiny_config();
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (size_t ti = 0; ti < 3; ti++)
            for (int64_t G = 1; G <= 2; G++)
                pipeline_fd_case(&c, Ts[ti], G, cases[ci], 700 + (uint64_t)(1000 * ci + 10 * Ts[ti] + G));
}

/* Each branch alone with gate 1 is its op: the window branch is causal attention over
 * [t - w + 1, t] (checked against a textbook row over that range, so w - 1 is pinned
 * here, not taken from ref.c), the cmp branch is cmp attention over mean-pooled k, v, and
 * the selection branch is selected attention over ref_select's indices; with all three
 * gates o is the gated sum of the branch outputs it reports. */
static void test_branches(void)
{
    nsa_config c = tiny_config();
    const int64_t T = 37, G = 2;
    const ref_dims d = dims(T, 2, G, 6, 4);
    const int64_t NO = T * d.HQ * d.DV, Nc = ref_num_cmp(&c, T), n = c.slc_topk;
    const double scale = 1.0 / sqrt((double)d.DK);
    const uint64_t seed = 850;
    test_rng r = {seed};
    pipe_data p = pipe_data_make(&r, &c, d, 4);
    double *o = vec(NO), *want = vec(NO), *lse = vec(T * d.HQ), *kc = vec(Nc * d.H * d.DK), *vc = vec(Nc * d.H * d.DV);
    double *oc = vec(NO), *os = vec(NO), *ow = vec(NO);
    int32_t *idx = ivec(T * d.H * n);
    unsigned char *vis = calloc((size_t)T, 1);
    char msg[160];

    ref_nsa_inputs in = pipe_inputs(&p, P_G_SWA);
    fill_const(p.gw, T * d.HQ, 1.0);
    ref_nsa_forward(&c, scale, d, &in, o, NULL, NULL, NULL, NULL);
    for (int64_t t = 0; t < T; t++) {
        for (int64_t s = 0; s < T; s++) vis[s] = (unsigned char)(s <= t && s >= t - c.window + 1);
        for (int64_t hq = 0; hq < d.HQ; hq++)
            brute_row(scale, d.DK, d.DV, p.q + (t * d.HQ + hq) * d.DK, p.k + (hq / G) * d.DK, d.H * d.DK,
                      p.v + (hq / G) * d.DV, d.H * d.DV, T, vis, want + (t * d.HQ + hq) * d.DV, NULL);
    }
    snprintf(msg, sizeof msg, "window branch != attention over [t-w+1, t], seed=%llu w=%lld", (unsigned long long)seed,
             (long long)c.window);
    CHECK_MSG(close_rel(o, want, NO, 1e-12), msg);

    in = pipe_inputs(&p, P_G_CMP);
    fill_const(p.gc, T * d.HQ, 1.0);
    ref_nsa_forward(&c, scale, d, &in, o, NULL, NULL, NULL, NULL);
    ref_compress(&c, T, d.H, d.DK, p.k, kc);
    ref_compress(&c, T, d.H, d.DV, p.v, vc);
    ref_cmp_attn(&c, scale, d, Nc, p.q, kc, vc, want, lse);
    snprintf(msg, sizeof msg, "cmp branch != cmp attention over pooled k, v, seed=%llu", (unsigned long long)seed);
    CHECK_MSG(close_rel(o, want, NO, 1e-12), msg);

    in = pipe_inputs(&p, P_G_SLC);
    fill_const(p.gs, T * d.HQ, 1.0);
    ref_nsa_forward(&c, scale, d, &in, o, NULL, NULL, NULL, NULL);
    ref_select(&c, scale, d, Nc, p.q, kc, idx, NULL);
    ref_slc_attn(&c, scale, d, p.q, p.k, p.v, idx, n, NULL, want, lse);
    snprintf(msg, sizeof msg, "slc branch != slc attention over ref_select, seed=%llu", (unsigned long long)seed);
    CHECK_MSG(close_rel(o, want, NO, 1e-12), msg);

    fill_uniform(&r, p.gc, T * d.HQ, -1.0, 1.0);
    fill_uniform(&r, p.gs, T * d.HQ, -1.0, 1.0);
    fill_uniform(&r, p.gw, T * d.HQ, -1.0, 1.0);
    in = pipe_inputs(&p, P_GATES);
    ref_nsa_forward(&c, scale, d, &in, o, oc, os, ow, NULL);
    for (int64_t i = 0; i < NO; i++) {
        const int64_t row = i / d.DV;
        want[i] = p.gc[row] * oc[i] + p.gs[row] * os[i] + p.gw[row] * ow[i];
    }
    snprintf(msg, sizeof msg, "o != gated sum of the branch outputs, seed=%llu", (unsigned long long)seed);
    CHECK_MSG(close_rel(o, want, NO, 1e-13), msg);
    /* A disabled branch reports zeros. */
    fill_const(os, NO, 5.0);
    in = pipe_inputs(&p, P_G_CMP | P_G_SWA);
    ref_nsa_forward(&c, scale, d, &in, o, oc, os, ow, NULL);
    CHECK_MSG(max_abs(os, NO) == 0.0, "disabled selection branch: o_slc not zeros");

    double *bufs[] = {o, want, lse, kc, vc, oc, os, ow};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(idx);
    free(vis);
    pipe_data_free(&p);
}

/* T < l (no compressed block anywhere) and T = 1: the cmp branch is exactly zero with
 * lse = -inf, nothing is NaN, and the other branches see only what they should. */
static void test_short_sequences(void)
{
    nsa_config c = tiny_config();
    static const int64_t Ts[] = {1, 3};
    char msg[160];
    for (size_t ti = 0; ti < 2; ti++) {
        const int64_t T = Ts[ti], G = 2;
        const ref_dims d = dims(T, 2, G, 6, 4);
        const double scale = 1.0 / sqrt((double)d.DK);
        const uint64_t seed = 800 + (uint64_t)T;
        test_rng r = {seed};
        pipe_data p = pipe_data_make(&r, &c, d, 4);
        ref_nsa_inputs in = pipe_inputs(&p, P_GATES);
        const int64_t NO = T * d.HQ * d.DV, NQ = T * d.HQ * d.DK, NK = T * d.H * d.DK, NV = T * d.H * d.DV;
        const int64_t n = c.slc_topk;
        double *o = vec(NO), *oc = vec(NO), *os = vec(NO), *ow = vec(NO), *lse = vec(T * d.HQ);
        int32_t *used = ivec(T * d.H * n);
        snprintf(msg, sizeof msg, "seed=%llu T=%lld (l=4, Nc=%lld)", (unsigned long long)seed, (long long)T,
                 (long long)p.Nc);
        CHECK_MSG(p.Nc == 0, msg);
        fill_const(oc, NO, 5.0);  /* the branch output must come back as zeros, not untouched */
        ref_nsa_forward(&c, scale, d, &in, o, oc, os, ow, used);
        CHECK_MSG(max_abs(oc, NO) == 0.0, msg);
        fill_const(oc, NO, 5.0);
        fill_const(lse, T * d.HQ, 5.0);
        ref_cmp_attn(&c, scale, d, 0, p.q, p.kc, p.vc, oc, lse);
        int lse_ok = 1;
        for (int64_t i = 0; i < T * d.HQ; i++) lse_ok &= lse[i] == -INFINITY;
        CHECK_MSG(lse_ok && max_abs(oc, NO) == 0.0, msg);
        CHECK_MSG(all_finite(o, NO) && all_finite(os, NO) && all_finite(ow, NO), msg);
        /* Every row's only candidate block is 0 (T <= l'), so the selection is [0, -1, -1]. */
        int sel_ok = 1;
        for (int64_t th = 0; th < T * d.H; th++)
            sel_ok &= used[th * n] == 0 && used[th * n + 1] == -1 && used[th * n + 2] == -1;
        CHECK_MSG(sel_ok, msg);
        /* Selection (block 0, causal) and window (w = 5 >= T) both see keys 0..t. */
        double *full = vec(NO);
        ref_attention(scale, 1, -1, -1, d, p.q, p.k, p.v, full, lse);
        CHECK_MSG(close_rel(os, full, NO, 1e-13) && close_rel(ow, full, NO, 1e-13), msg);
        if (T == 1) {
            int one_ok = 1;  /* one key: the output is v[0] itself */
            for (int64_t hq = 0; hq < d.HQ; hq++) one_ok &= max_diff(os + hq * d.DV, p.v + (hq / G) * d.DV, d.DV) <= 1e-15;
            CHECK_MSG(one_ok, msg);
        }
        /* Backward: finite, zero dg_cmp, and the same dq as with the cmp branch switched off. */
        double *dq = vec(NQ), *dk = vec(NK), *dv = vec(NV), *dgc = vec(T * d.HQ), *dgs = vec(T * d.HQ);
        double *dgw = vec(T * d.HQ), *dq2 = vec(NQ), *dk2 = vec(NK), *dv2 = vec(NV);
        fill_const(dgc, T * d.HQ, 777.0);
        ref_nsa_grads g;
        memset(&g, 0, sizeof g);
        g.dq = dq;
        g.dk = dk;
        g.dv = dv;
        g.dg_cmp = dgc;
        g.dg_slc = dgs;
        g.dg_swa = dgw;
        ref_nsa_backward(&c, scale, d, &in, p.dout, &g);
        CHECK_MSG(all_finite(dq, NQ) && all_finite(dk, NK) && all_finite(dv, NV) && all_finite(dgs, T * d.HQ) &&
                      all_finite(dgw, T * d.HQ) && max_abs(dgc, T * d.HQ) == 0.0,
                  msg);
        in.g_cmp = NULL;
        memset(&g, 0, sizeof g);
        g.dq = dq2;
        g.dk = dk2;
        g.dv = dv2;
        ref_nsa_backward(&c, scale, d, &in, p.dout, &g);
        CHECK_MSG(max_diff(dq, dq2, NQ) == 0.0 && max_diff(dk, dk2, NK) == 0.0 && max_diff(dv, dv2, NV) == 0.0, msg);
        double *bufs[] = {o, oc, os, ow, lse, full, dq, dk, dv, dgc, dgs, dgw, dq2, dk2, dv2};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
        free(used);
        pipe_data_free(&p);
    }
}

/* ref_nsa_forward_rows against ref_nsa_forward on sampled rows (T = 300, paper-like
 * proportions), including the block edges and the rows before the first compressed block. */
static void test_forward_rows(void)
{
    static const unsigned cases[] = {P_GATES, P_GATES | P_SEP_SLC | P_SEP_SWA | P_OWN_CMP | P_IDX_MESSY, P_G_SLC,
                                     P_G_CMP | P_G_SWA, P_G_SLC | P_OWN_CMP};
    nsa_config c = paperish_config();
    const int64_t T = 300, G = 2;
    const ref_dims d = dims(T, 2, G, 12, 8);
    const double scale = 1.0 / sqrt((double)d.DK);
    int64_t rows[20] = {0, 1, 14, 15, 16, 31, 32, 63, 64, 65, 150, 255, 256, 298, 299};
    const int64_t nrows = 20;
    char msg[160];
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const uint64_t seed = 900 + (uint64_t)ci;
        test_rng r = {seed};
        for (int64_t i = 15; i < nrows; i++) rows[i] = rng_int(&r, 0, T - 1);
        pipe_data p = pipe_data_make(&r, &c, d, 6);
        ref_nsa_inputs in = pipe_inputs(&p, cases[ci]);
        double *o = vec(T * d.HQ * d.DV), *orow = vec(nrows * d.HQ * d.DV), *want = vec(nrows * d.HQ * d.DV);
        ref_nsa_forward(&c, scale, d, &in, o, NULL, NULL, NULL, NULL);
        fill_const(orow, nrows * d.HQ * d.DV, 777.0);
        ref_nsa_forward_rows(&c, scale, d, &in, rows, nrows, orow);
        for (int64_t i = 0; i < nrows; i++)
            memcpy(want + i * d.HQ * d.DV, o + rows[i] * d.HQ * d.DV, (size_t)(d.HQ * d.DV) * sizeof(double));
        snprintf(msg, sizeof msg, "rows vs dense seed=%llu T=300 flags=0x%x: max diff %.3g", (unsigned long long)seed,
                 cases[ci], max_diff(orow, want, nrows * d.HQ * d.DV));
        CHECK_MSG(close_rel(orow, want, nrows * d.HQ * d.DV, 1e-12), msg);
        free(o);
        free(orow);
        free(want);
        pipe_data_free(&p);
    }
}

void test_ref_all(void)
{
    test_compress();
    test_cmp_attn();
    test_slc_attn();
    test_attention();
    test_select();
    test_branches();
    test_pipeline_fd();
    test_short_sequences();
    test_forward_rows();
}
