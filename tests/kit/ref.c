/* ref.c -- the float64 reference of spec/nsa.md, one sequence at a time (see ref.h).
 *
 * Written from the spec alone and deliberately plain: every mask is a materialised 0/1
 * array built from the spec's visibility rule, every softmax is the textbook one, every
 * selection sorts a whole candidate row. It shares no code with src/, so a backend bug
 * cannot hide behind a shared helper. Speed matters only enough for T ~ 1000.
 *
 * Layout (all contiguous, row-major): q [T, HQ, DK], k [T, H, DK], v [T, H, DV],
 * k_cmp [Nc, H, DK], v_cmp [Nc, H, DV], o [T, HQ, DV], lse / gates [T, HQ],
 * block_indices [T, H, m]. Query head hq reads kv head hq / G, G = HQ / H. */
#include "ref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------ */
/* Small helpers                                                                         */
/* ------------------------------------------------------------------------------------ */

/* Zeroed array of count elements (count 0 still gives a valid pointer). An oracle that
 * runs out of memory cannot answer, so it stops loudly instead of passing silently. */
static void *ref_alloc(int64_t count, size_t size)
{
    void *p = calloc(count > 0 ? (size_t)count : 1, size);
    if (!p) {
        fprintf(stderr, "ref: out of memory (%lld x %zu bytes)\n", (long long)count, size);
        abort();
    }
    return p;
}

static double *dalloc(int64_t n) { return ref_alloc(n, sizeof(double)); }
static unsigned char *ualloc(int64_t n) { return ref_alloc(n, 1); }

/* a [n] . b [n]. Eight partial sums, unrolled by hand: one long chain of dependent adds
 * (or a loop gcc -O2 will not vectorise) made T ~ 1000, D ~ 192 several times slower.
 * Every dot product of the reference goes through here, so all paths round alike. */
static double dot(const double *a, const double *b, int64_t n)
{
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0, s4 = 0.0, s5 = 0.0, s6 = 0.0, s7 = 0.0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        s0 += a[i] * b[i];
        s1 += a[i + 1] * b[i + 1];
        s2 += a[i + 2] * b[i + 2];
        s3 += a[i + 3] * b[i + 3];
        s4 += a[i + 4] * b[i + 4];
        s5 += a[i + 5] * b[i + 5];
        s6 += a[i + 6] * b[i + 6];
        s7 += a[i + 7] * b[i + 7];
    }
    for (; i < n; i++) s0 += a[i] * b[i];
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7));
}

/* y [n] += a * x [n]; y and x never overlap. Unrolled by hand because gcc -O2 vectorises
 * straight-line groups but not a loop of unknown length; each y[i] is the same either way. */
static void axpy(double *restrict y, double a, const double *restrict x, int64_t n)
{
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        y[i] += a * x[i];
        y[i + 1] += a * x[i + 1];
        y[i + 2] += a * x[i + 2];
        y[i + 3] += a * x[i + 3];
    }
    for (; i < n; i++) y[i] += a * x[i];
}

/* y [n] += x [n]; no overlap. */
static void add_to(double *restrict y, const double *restrict x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

/* dst [n] = 0 when dst is wanted (non-NULL). */
static void zero_if(double *dst, int64_t n)
{
    if (dst) memset(dst, 0, (size_t)(n > 0 ? n : 0) * sizeof(double));
}

/* dst [n] = src [n] when both exist. */
static void copy_if(double *dst, const double *src, int64_t n)
{
    if (dst && src && n > 0) memcpy(dst, src, (size_t)n * sizeof(double));
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* nb = ceil(T / l'): selection blocks of a T-token sequence (spec 3). */
static int64_t num_slc(const nsa_config *c, int64_t T) { return (T + c->slc_block - 1) / c->slc_block; }

/* ------------------------------------------------------------------------------------ */
/* Rounding hook: the "straightforward same-precision implementation"                     */
/* ------------------------------------------------------------------------------------ */

/* See ref.h: NULL = exact float64. Set, every tensor a plain low-precision implementation
 * materialises (scores, probabilities, outputs, dP, dS, compressed K/V) is rounded. */
double (*ref_store_round)(double) = NULL;

static double rnd(double x) { return ref_store_round ? ref_store_round(x) : x; }

/* ------------------------------------------------------------------------------------ */
/* The attention core: R query rows of one kv head against its Tk keys                   */
/* ------------------------------------------------------------------------------------ */

/* Query rows processed together. Each key row is then read once per block instead of once
 * per query row, which is what keeps T ~ 1000, D ~ 192 affordable; every row's own
 * arithmetic (and so its result, to the bit) is the same whatever the block. */
enum { REF_ROW_BLOCK = 32 };

/* Key s is k + s*k_stride [DK] and v + s*v_stride [DV]. Row r: q[r] [DK], vis[r] [Tk] 0/1.
 * Writes P [R, Tk] = softmax(scale * q[r] . k_s) over the visible keys (0 elsewhere),
 * lse [R] (optional) = natural-log sum-exp of the visible scores, and, when o != NULL,
 * o[r] [DV] = sum_s P[r, s] v_s. A row that sees no key gets P = 0, o = 0, lse = -INFINITY,
 * so an empty row never produces NaN. */
static void attend_rows(double scale, int64_t DK, int64_t DV, int64_t Tk, const double *k, int64_t k_stride,
                        const double *v, int64_t v_stride, int64_t R, const double *const *q,
                        const unsigned char *const *vis, double *P, double *const *o, double *lse)
{
    /* S = scale * Q K^T on the visible entries. */
    for (int64_t s = 0; s < Tk; s++)
        for (int64_t r = 0; r < R; r++)
            P[r * Tk + s] = vis[r][s] ? rnd(scale * dot(q[r], k + s * k_stride, DK)) : 0.0;
    /* Textbook softmax per row, the max subtracted so large scores cannot overflow. */
    for (int64_t r = 0; r < R; r++) {
        double *p = P + r * Tk, mx = -INFINITY, sum = 0.0;
        int any = 0;
        for (int64_t s = 0; s < Tk; s++)
            if (vis[r][s] && (!any || p[s] > mx)) {
                mx = p[s];
                any = 1;
            }
        if (lse) lse[r] = -INFINITY;
        if (!any) continue;
        for (int64_t s = 0; s < Tk; s++)
            if (vis[r][s]) {
                p[s] = exp(p[s] - mx);
                sum += p[s];
            }
        for (int64_t s = 0; s < Tk; s++)
            if (vis[r][s]) p[s] = rnd(p[s] / sum);
        if (lse) lse[r] = mx + log(sum);
    }
    if (!o) return;
    /* O = P V; per row the keys are still summed in ascending order. */
    for (int64_t r = 0; r < R; r++) memset(o[r], 0, (size_t)DV * sizeof(double));
    for (int64_t s = 0; s < Tk; s++)
        for (int64_t r = 0; r < R; r++)
            if (vis[r][s]) axpy(o[r], P[r * Tk + s], v + s * v_stride, DV);
    if (ref_store_round)
        for (int64_t r = 0; r < R; r++)
            for (int64_t e = 0; e < DV; e++) o[r][e] = rnd(o[r][e]);
}

/* Backward of attend_rows for the loss sum_r o[r] . dout[r]; dout[r] [DV]. o_in (NULL = none):
 * the forward output o_in[r] [DV] that the backward is handed, from which the naive
 * implementation takes D (below) instead of from its own.
 * dq[r] [DK] is overwritten; dk (key s at dk + s*k_stride, [DK]) and dv (dv + s*v_stride,
 * [DV]) are accumulated. P, dS: scratch [R, Tk].
 * dP = dO V^T, D_r = sum_s P dP, dS = P (dP - D); dQ = scale dS K, dK += scale dS^T Q,
 * dV += P^T dO. Empty rows have P = 0 and so contribute nothing. */
static void attend_rows_bwd(double scale, int64_t DK, int64_t DV, int64_t Tk, const double *k, int64_t k_stride,
                            const double *v, int64_t v_stride, int64_t R, const double *const *q,
                            const unsigned char *const *vis, const double *const *dout, const double *const *o_in,
                            double *P, double *dS, double *const *dq, double *dk, double *dv)
{
    /* The naive same-precision implementation (ref_store_round set) takes D = dO . O from a
     * stored, rounded output, as a fused kernel does (exactly, that equals sum_s P dP): the o
     * the backward is handed when there is one, as a kernel reads it, so that both round the
     * same o; else its own. */
    double *o_store[REF_ROW_BLOCK] = {0}, *o_buf = ref_store_round ? dalloc(R * DV) : NULL;
    for (int64_t r = 0; r < R; r++) o_store[r] = o_buf ? o_buf + r * DV : NULL;
    attend_rows(scale, DK, DV, Tk, k, k_stride, v, v_stride, R, q, vis, P, o_buf ? o_store : NULL, NULL);
    for (int64_t s = 0; s < Tk; s++)
        for (int64_t r = 0; r < R; r++)
            dS[r * Tk + s] = vis[r][s] ? rnd(dot(dout[r], v + s * v_stride, DV)) : 0.0;
    for (int64_t r = 0; r < R; r++) {
        double D = 0.0;
        if (o_buf) D = dot(dout[r], o_in ? o_in[r] : o_store[r], DV);
        else
            for (int64_t s = 0; s < Tk; s++) D += P[r * Tk + s] * dS[r * Tk + s];
        for (int64_t s = 0; s < Tk; s++) dS[r * Tk + s] = rnd(P[r * Tk + s] * (dS[r * Tk + s] - D));
        memset(dq[r], 0, (size_t)DK * sizeof(double));
    }
    for (int64_t s = 0; s < Tk; s++)
        for (int64_t r = 0; r < R; r++) {
            if (!vis[r][s]) continue;
            axpy(dq[r], scale * dS[r * Tk + s], k + s * k_stride, DK);
            axpy(dk + s * k_stride, scale * dS[r * Tk + s], q[r], DK);
            axpy(dv + s * v_stride, P[r * Tk + s], dout[r], DV);
        }
    free(o_buf);
}

/* ------------------------------------------------------------------------------------ */
/* Masked dense attention: the core under spec 2, 4 and 5                                */
/* ------------------------------------------------------------------------------------ */

/* One block of the query rows of kv head h, numbered r = t * G + g (query head h*G + g):
 * pointers into q [T, HQ, DK], mask [T, mh, Tk] (mh = 1: one row per query shared by all
 * heads; mh = H: one per query and kv head), an output x [T, HQ, out_w] and an input
 * y [T, HQ, in_w] (out / in NULL = none). */
typedef struct ref_block {
    int64_t R;
    int64_t row[REF_ROW_BLOCK];  /* t * HQ + hq of each row */
    const double *q[REF_ROW_BLOCK];
    const unsigned char *vis[REF_ROW_BLOCK];
    double *out[REF_ROW_BLOCK];
    const double *in[REF_ROW_BLOCK];
} ref_block;

/* Fills B with rows r0 .. r0 + R - 1 of kv head h (R = REF_ROW_BLOCK or what is left). */
static void block_rows(ref_block *B, ref_dims d, int64_t h, int64_t r0, int64_t Tk, const unsigned char *mask,
                       int64_t mh, const double *q, double *out, int64_t out_w, const double *in, int64_t in_w)
{
    const int64_t G = d.HQ / d.H;
    B->R = min64(REF_ROW_BLOCK, d.T * G - r0);
    for (int64_t r = 0; r < B->R; r++) {
        const int64_t t = (r0 + r) / G, hq = h * G + (r0 + r) % G, row = t * d.HQ + hq;
        B->row[r] = row;
        B->q[r] = q + row * d.DK;
        B->vis[r] = mask + (t * mh + (mh == 1 ? 0 : h)) * Tk;
        B->out[r] = out ? out + row * out_w : NULL;
        B->in[r] = in ? in + row * in_w : NULL;
    }
}

/* q [T, HQ, DK], k [Tk, H, DK], v [Tk, H, DV], mask [T, mh, Tk] (see block_rows)
 * -> o [T, HQ, DV] and lse [T, HQ] (either may be NULL). */
static void masked_attn(double scale, ref_dims d, int64_t Tk, const unsigned char *mask, int64_t mh,
                        const double *q, const double *k, const double *v, double *o, double *lse)
{
    const int64_t G = d.HQ / d.H;
    double *P = dalloc(REF_ROW_BLOCK * Tk), lse_b[REF_ROW_BLOCK];
    ref_block B;
    for (int64_t h = 0; h < d.H; h++)
        for (int64_t r0 = 0; r0 < d.T * G; r0 += REF_ROW_BLOCK) {
            block_rows(&B, d, h, r0, Tk, mask, mh, q, o, d.DV, NULL, 0);
            attend_rows(scale, d.DK, d.DV, Tk, k + h * d.DK, d.H * d.DK, v + h * d.DV, d.H * d.DV, B.R, B.q, B.vis, P,
                        o ? B.out : NULL, lse_b);
            if (lse)
                for (int64_t r = 0; r < B.R; r++) lse[B.row[r]] = lse_b[r];
        }
    free(P);
}

/* Backward of masked_attn for the loss sum(o * dout): dout [T, HQ, DV] ->
 * dq [T, HQ, DK], dk [Tk, H, DK], dv [Tk, H, DV], all overwritten. o_given [T, HQ, DV]
 * (NULL = none): the forward output the backward is handed (attend_rows_bwd's o_in). */
static void masked_attn_bwd(double scale, ref_dims d, int64_t Tk, const unsigned char *mask, int64_t mh,
                            const double *q, const double *k, const double *v, const double *dout,
                            const double *o_given, double *dq, double *dk, double *dv)
{
    const int64_t G = d.HQ / d.H;
    double *P = dalloc(REF_ROW_BLOCK * Tk), *dS = dalloc(REF_ROW_BLOCK * Tk);
    ref_block B;
    zero_if(dk, Tk * d.H * d.DK);
    zero_if(dv, Tk * d.H * d.DV);
    for (int64_t h = 0; h < d.H; h++)
        for (int64_t r0 = 0; r0 < d.T * G; r0 += REF_ROW_BLOCK) {
            block_rows(&B, d, h, r0, Tk, mask, mh, q, dq, d.DK, dout, d.DV);
            const double *o_in[REF_ROW_BLOCK];
            for (int64_t r = 0; r < B.R; r++) o_in[r] = o_given ? o_given + B.row[r] * d.DV : NULL;
            attend_rows_bwd(scale, d.DK, d.DV, Tk, k + h * d.DK, d.H * d.DK, v + h * d.DV, d.H * d.DV, B.R, B.q,
                            B.vis, B.in, o_given ? o_in : NULL, P, dS, B.out, dk + h * d.DK, dv + h * d.DV);
        }
    free(P);
    free(dS);
}

/* ------------------------------------------------------------------------------------ */
/* Visibility rows (the spec's rules, one query at a time)                               */
/* ------------------------------------------------------------------------------------ */

/* Spec 2: vis [Nc]; query t sees compressed block i iff its last token i*d + l - 1 <= t. */
static void cmp_mask_row(const nsa_config *c, int64_t t, int64_t Nc, unsigned char *vis)
{
    for (int64_t i = 0; i < Nc; i++) vis[i] = (unsigned char)(i * c->cmp_stride + c->cmp_len - 1 <= t);
}

/* Spec 5 / the attention core: vis [T]; key s visible iff (wl < 0 || s >= t - wl) and
 * (causal ? s <= t : (wr < 0 || s <= t + wr)). */
static void win_mask_row(int causal, int64_t wl, int64_t wr, int64_t t, int64_t T, unsigned char *vis)
{
    for (int64_t s = 0; s < T; s++) {
        int left = wl < 0 || s >= t - wl;
        int right = causal ? s <= t : (wr < 0 || s <= t + wr);
        vis[s] = (unsigned char)(left && right);
    }
}

/* Entries of row (t, h) that are read: counts ? clamp(counts[t, h], 0, m) : m. */
static int64_t slc_count(const int32_t *counts, int64_t t, int64_t h, int64_t H, int64_t m)
{
    if (!counts) return m;
    return min64(max64((int64_t)counts[t * H + h], 0), m);
}

/* Spec 4: vis [T]; query t sees token s iff s <= t and s lies in a block of idx [cnt].
 * Entries -1 or outside [0, nb) are skipped; a duplicate sets the same bits again, so it
 * counts once. */
static void slc_mask_row(const nsa_config *c, int64_t T, int64_t t, const int32_t *idx, int64_t cnt,
                         unsigned char *vis)
{
    const int64_t lp = c->slc_block, nb = num_slc(c, T);
    memset(vis, 0, (size_t)T);
    for (int64_t e = 0; e < cnt; e++) {
        int64_t b = idx[e];
        if (b < 0 || b >= nb) continue;
        for (int64_t s = b * lp; s < (b + 1) * lp && s < T && s <= t; s++) vis[s] = 1;
    }
}

/* mask [T, Nc] of spec 2. */
static unsigned char *cmp_mask(const nsa_config *c, int64_t T, int64_t Nc)
{
    unsigned char *m = ualloc(T * Nc);
    for (int64_t t = 0; t < T; t++) cmp_mask_row(c, t, Nc, m + t * Nc);
    return m;
}

/* The sliding branch's scale (spec 7.1): config.swa_scale, or the common scale when it is 0. */
static double swa_scale(const nsa_config *c, double scale) { return c->swa_scale != 0.0f ? c->swa_scale : scale; }

/* mask [T, T] of the window / dense core. */
static unsigned char *win_mask(int causal, int64_t wl, int64_t wr, int64_t T)
{
    unsigned char *m = ualloc(T * T);
    for (int64_t t = 0; t < T; t++) win_mask_row(causal, wl, wr, t, T, m + t * T);
    return m;
}

/* mask [T, H, T] of spec 4 from block_indices [T, H, m] and counts [T, H] (or NULL). */
static unsigned char *slc_mask(const nsa_config *c, ref_dims d, const int32_t *idx, int64_t m,
                               const int32_t *counts)
{
    unsigned char *mask = ualloc(d.T * d.H * d.T);
    for (int64_t t = 0; t < d.T; t++)
        for (int64_t h = 0; h < d.H; h++)
            slc_mask_row(c, d.T, t, idx + (t * d.H + h) * m, slc_count(counts, t, h, d.H, m),
                         mask + (t * d.H + h) * d.T);
    return mask;
}

/* ------------------------------------------------------------------------------------ */
/* Spec 1: compression                                                                   */
/* ------------------------------------------------------------------------------------ */

int64_t ref_num_cmp(const nsa_config *c, int64_t T)
{
    return T >= c->cmp_len ? (T - c->cmp_len) / c->cmp_stride + 1 : 0;
}

/* x [T, H, D] -> x_cmp [Nc, H, D]: x_cmp[i] = mean(x[i*d .. i*d + l)). */
void ref_compress(const nsa_config *c, int64_t T, int64_t H, int64_t D, const double *x, double *x_cmp)
{
    const int64_t Nc = ref_num_cmp(c, T), l = c->cmp_len, st = c->cmp_stride;
    for (int64_t i = 0; i < Nc; i++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t e = 0; e < D; e++) {
                double sum = 0.0;
                for (int64_t r = 0; r < l; r++) sum += x[((i * st + r) * H + h) * D + e];
                x_cmp[(i * H + h) * D + e] = rnd(sum / (double)l);
            }
}

/* dx_cmp [Nc, H, D] -> dx [T, H, D]: dx[t] = sum over blocks i holding t of dx_cmp[i] / l. */
void ref_compress_bwd(const nsa_config *c, int64_t T, int64_t H, int64_t D, const double *dx_cmp, double *dx)
{
    const int64_t Nc = ref_num_cmp(c, T), l = c->cmp_len, st = c->cmp_stride;
    zero_if(dx, T * H * D);
    for (int64_t i = 0; i < Nc; i++)
        for (int64_t r = 0; r < l; r++)
            for (int64_t h = 0; h < H; h++)
                axpy(dx + ((i * st + r) * H + h) * D, 1.0 / (double)l, dx_cmp + (i * H + h) * D, D);
}

/* ------------------------------------------------------------------------------------ */
/* Spec 2: compressed attention                                                          */
/* ------------------------------------------------------------------------------------ */

/* q [T, HQ, DK], k_cmp [Nc, H, DK], v_cmp [Nc, H, DV] -> o [T, HQ, DV], lse [T, HQ]. */
void ref_cmp_attn(const nsa_config *c, double scale, ref_dims d, int64_t Nc, const double *q,
                  const double *k_cmp, const double *v_cmp, double *o, double *lse)
{
    unsigned char *mask = cmp_mask(c, d.T, Nc);
    masked_attn(scale, d, Nc, mask, 1, q, k_cmp, v_cmp, o, lse);
    free(mask);
}

/* dout [T, HQ, DV] -> dq [T, HQ, DK], dk_cmp [Nc, H, DK], dv_cmp [Nc, H, DV]. */
void ref_cmp_attn_bwd(const nsa_config *c, double scale, ref_dims d, int64_t Nc, const double *q,
                      const double *k_cmp, const double *v_cmp, const double *dout, const double *o_given,
                      double *dq, double *dk_cmp, double *dv_cmp)
{
    unsigned char *mask = cmp_mask(c, d.T, Nc);
    masked_attn_bwd(scale, d, Nc, mask, 1, q, k_cmp, v_cmp, dout, o_given, dq, dk_cmp, dv_cmp);
    free(mask);
}

/* ------------------------------------------------------------------------------------ */
/* Spec 3: importance and selection                                                      */
/* ------------------------------------------------------------------------------------ */

/* One candidate block of one (t, h) row, in the order selection ranks them. */
typedef struct ref_cand {
    int64_t j;
    int forced;
    double imp;
} ref_cand;

/* Forced first, then higher importance, then the lower block index (the tie rule). A NaN
 * importance ranks below every number (and ties with another NaN), so the order stays a total
 * one, which qsort needs, and a row poisoned by a non-finite input still keeps its forced
 * blocks, then its numbered candidates, then NaN ones by index. */
static int cand_order(const void *pa, const void *pb)
{
    const ref_cand *a = pa, *b = pb;
    if (a->forced != b->forced) return a->forced ? -1 : 1;
    const int an = isnan(a->imp), bn = isnan(b->imp);
    if (an != bn) return an ? 1 : -1;
    if (!an && a->imp != b->imp) return a->imp > b->imp ? -1 : 1;
    return (a->j > b->j) - (a->j < b->j);
}

static int int32_order(const void *pa, const void *pb)
{
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    return (a > b) - (a < b);
}

/* Scratch of one selection row, reused across rows. */
typedef struct ref_sel_work {
    double *p;          /* [G, Nc] compressed probabilities of the group's query heads */
    const double **q;   /* [G] the group's query rows */
    const unsigned char **vis;  /* [G] the query's spec-2 row, once per head */
    double *p_slc;      /* [nb] one head's block importance */
    double *imp;        /* [nb] the group's importance */
    ref_cand *cand;     /* [nb] */
} ref_sel_work;

static ref_sel_work sel_work_open(int64_t G, int64_t Nc, int64_t nb)
{
    ref_sel_work w;
    w.p = dalloc(G * Nc);
    w.q = ref_alloc(G, sizeof(const double *));
    w.vis = ref_alloc(G, sizeof(const unsigned char *));
    w.p_slc = dalloc(nb);
    w.imp = dalloc(nb);
    w.cand = ref_alloc(nb, sizeof(ref_cand));
    return w;
}

static void sel_work_close(ref_sel_work *w)
{
    free(w->p);
    free(w->q);
    free(w->vis);
    free(w->p_slc);
    free(w->imp);
    free(w->cand);
}

/* Selection of query t, kv head h: q [T, HQ, DK], k_cmp [Nc, H, DK], vis_cmp [Nc] (the
 * spec-2 row of t) -> w->imp [nb] and idx [n] (ascending, -1 padded).
 * p_slc[j] = sum_i p_cmp[i] * ov(i, j) / d with ov the count of tokens shared by
 * compressed block i = [i*d, i*d + l) and selection block j = [j*l', (j+1)*l');
 * imp[j] = sum of p_slc over the G heads of the group. */
static void select_one(const nsa_config *c, double scale, ref_dims d, int64_t Nc, const double *q,
                       const double *k_cmp, const unsigned char *vis_cmp, int64_t t, int64_t h,
                       ref_sel_work *w, int32_t *idx)
{
    const int64_t G = d.HQ / d.H, nb = num_slc(c, d.T), lp = c->slc_block, n = c->slc_topk;
    const int64_t l = c->cmp_len, st = c->cmp_stride;
    for (int64_t g = 0; g < G; g++) {
        w->q[g] = q + (t * d.HQ + h * G + g) * d.DK;
        w->vis[g] = vis_cmp;
    }
    attend_rows(scale, d.DK, 0, Nc, k_cmp + h * d.DK, d.H * d.DK, NULL, 0, G, w->q, w->vis, w->p, NULL, NULL);
    memset(w->imp, 0, (size_t)nb * sizeof(double));
    for (int64_t g = 0; g < G; g++) {
        memset(w->p_slc, 0, (size_t)nb * sizeof(double));
        for (int64_t i = 0; i < Nc; i++) {
            const int64_t lo = i * st, hi = i * st + l;  /* tokens [lo, hi) */
            /* Only the blocks j that intersect [lo, hi) have ov > 0. */
            for (int64_t j = lo / lp; j < nb && j * lp < hi; j++) {
                int64_t ov = min64(hi, (j + 1) * lp) - max64(lo, j * lp);
                if (ov > 0) w->p_slc[j] += w->p[g * Nc + i] * (double)ov / (double)st;
            }
        }
        add_to(w->imp, w->p_slc, nb);
    }
    /* Candidates j <= cur; forced ones (leading n_init, trailing n_local) rank first. */
    const int64_t cur = t / lp, ncand = cur + 1;
    for (int64_t j = 0; j < ncand; j++) {
        w->cand[j].j = j;
        w->cand[j].forced = j < c->n_init || j > cur - c->n_local;
        w->cand[j].imp = w->imp[j];
    }
    qsort(w->cand, (size_t)ncand, sizeof(ref_cand), cand_order);
    const int64_t kept = min64(n, ncand);
    for (int64_t r = 0; r < kept; r++) idx[r] = (int32_t)w->cand[r].j;
    qsort(idx, (size_t)kept, sizeof(int32_t), int32_order);
    for (int64_t r = kept; r < n; r++) idx[r] = -1;
}

/* q [T, HQ, DK], k_cmp [Nc, H, DK] -> block_indices [T, H, n], imp [T, H, nb] (optional). */
void ref_select(const nsa_config *c, double scale, ref_dims d, int64_t Nc, const double *q,
                const double *k_cmp, int32_t *block_indices, double *imp)
{
    const int64_t G = d.HQ / d.H, nb = num_slc(c, d.T), n = c->slc_topk;
    unsigned char *mask = cmp_mask(c, d.T, Nc);
    ref_sel_work w = sel_work_open(G, Nc, nb);
    for (int64_t t = 0; t < d.T; t++)
        for (int64_t h = 0; h < d.H; h++) {
            select_one(c, scale, d, Nc, q, k_cmp, mask + t * Nc, t, h, &w, block_indices + (t * d.H + h) * n);
            if (imp) memcpy(imp + (t * d.H + h) * nb, w.imp, (size_t)nb * sizeof(double));
        }
    sel_work_close(&w);
    free(mask);
}

/* ------------------------------------------------------------------------------------ */
/* Spec 4: selected attention                                                            */
/* ------------------------------------------------------------------------------------ */

/* q [T, HQ, DK], k [T, H, DK], v [T, H, DV], block_indices [T, H, m], counts [T, H] or NULL
 * -> o [T, HQ, DV], lse [T, HQ]. */
void ref_slc_attn(const nsa_config *c, double scale, ref_dims d, const double *q, const double *k,
                  const double *v, const int32_t *block_indices, int64_t m, const int32_t *counts,
                  double *o, double *lse)
{
    unsigned char *mask = slc_mask(c, d, block_indices, m, counts);
    masked_attn(scale, d, d.T, mask, d.H, q, k, v, o, lse);
    free(mask);
}

/* dout [T, HQ, DV] -> dq [T, HQ, DK], dk [T, H, DK], dv [T, H, DV]. */
void ref_slc_attn_bwd(const nsa_config *c, double scale, ref_dims d, const double *q, const double *k,
                      const double *v, const int32_t *block_indices, int64_t m, const int32_t *counts,
                      const double *dout, const double *o_given, double *dq, double *dk, double *dv)
{
    unsigned char *mask = slc_mask(c, d, block_indices, m, counts);
    masked_attn_bwd(scale, d, d.T, mask, d.H, q, k, v, dout, o_given, dq, dk, dv);
    free(mask);
}

/* ------------------------------------------------------------------------------------ */
/* Spec 5: dense / windowed attention                                                    */
/* ------------------------------------------------------------------------------------ */

/* q [T, HQ, DK], k [T, H, DK], v [T, H, DV] -> o [T, HQ, DV], lse [T, HQ]. */
void ref_attention(double scale, int causal, int64_t window_left, int64_t window_right, ref_dims d,
                   const double *q, const double *k, const double *v, double *o, double *lse)
{
    unsigned char *mask = win_mask(causal, window_left, window_right, d.T);
    masked_attn(scale, d, d.T, mask, 1, q, k, v, o, lse);
    free(mask);
}

/* dout [T, HQ, DV] -> dq [T, HQ, DK], dk [T, H, DK], dv [T, H, DV]. */
void ref_attention_bwd(double scale, int causal, int64_t window_left, int64_t window_right, ref_dims d,
                       const double *q, const double *k, const double *v, const double *dout,
                       const double *o_given, double *dq, double *dk, double *dv)
{
    unsigned char *mask = win_mask(causal, window_left, window_right, d.T);
    masked_attn_bwd(scale, d, d.T, mask, 1, q, k, v, dout, o_given, dq, dk, dv);
    free(mask);
}

/* ------------------------------------------------------------------------------------ */
/* Spec 6: the whole pipeline                                                            */
/* ------------------------------------------------------------------------------------ */

/* One pipeline call's inputs with every default resolved. */
typedef struct ref_pipe {
    int64_t Nc;
    const double *ks, *vs;        /* selection branch K/V [T, H, D] */
    const double *kw, *vw;        /* window branch K/V [T, H, D] */
    const double *kc, *vc;        /* [Nc, H, D]: the caller's or mean pooling (NULL if unneeded) */
    const int32_t *idx;           /* [T, H, width] or NULL when no dense selection was asked */
    int64_t width;
    const int32_t *counts;        /* [T, H] or NULL */
    double *kc_own, *vc_own;
    int32_t *idx_own;
} ref_pipe;

/* Resolves the defaults of `in`. want_sel: the selection is needed (selection branch on, or
 * the caller wants the indices); then k_cmp is needed unless the caller gave indices.
 * dense_sel: run ref_select over all T rows now (ref_nsa_forward_rows selects per row). */
static ref_pipe pipe_open(const nsa_config *c, double scale, ref_dims d, const ref_nsa_inputs *in, int want_sel,
                          int dense_sel)
{
    ref_pipe p;
    memset(&p, 0, sizeof p);
    p.Nc = ref_num_cmp(c, d.T);
    p.ks = in->k_slc ? in->k_slc : in->k;
    p.vs = in->v_slc ? in->v_slc : in->v;
    p.kw = in->k_swa ? in->k_swa : in->k;
    p.vw = in->v_swa ? in->v_swa : in->v;
    const int must_select = want_sel && !in->block_indices;
    if (in->g_cmp || must_select) {
        p.kc = in->k_cmp;
        if (!p.kc) {
            p.kc_own = dalloc(p.Nc * d.H * d.DK);
            ref_compress(c, d.T, d.H, d.DK, in->k, p.kc_own);
            p.kc = p.kc_own;
        }
    }
    if (in->g_cmp) {
        p.vc = in->v_cmp;
        if (!p.vc) {
            p.vc_own = dalloc(p.Nc * d.H * d.DV);
            ref_compress(c, d.T, d.H, d.DV, in->v, p.vc_own);
            p.vc = p.vc_own;
        }
    }
    if (in->block_indices) {
        p.idx = in->block_indices;
        p.width = in->m;
        p.counts = in->block_counts;
    } else if (must_select) {
        /* The computed selection is read in full: no counts. */
        p.width = c->slc_topk;
        if (dense_sel) {
            p.idx_own = ref_alloc(d.T * d.H * p.width, sizeof(int32_t));
            ref_select(c, scale, d, p.Nc, in->q, p.kc, p.idx_own, NULL);
            p.idx = p.idx_own;
        }
    }
    return p;
}

static void pipe_close(ref_pipe *p)
{
    free(p->kc_own);
    free(p->vc_own);
    free(p->idx_own);
}

/* out [DV] = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa, skipping every branch whose
 * gate pointer is NULL (its o_x is then not read). Gates point at one scalar each. */
static void combine_row(int64_t DV, const double *gc, const double *gs, const double *gw, const double *oc,
                        const double *os, const double *ow, double *out)
{
    for (int64_t e = 0; e < DV; e++) {
        double acc = 0.0;
        if (gc) acc += *gc * oc[e];
        if (gs) acc += *gs * os[e];
        if (gw) acc += *gw * ow[e];
        out[e] = acc;
    }
}

/* Gate backward over N = T*HQ rows: dout [N, DV], g [N], o_x [N, DV] ->
 * do_x [N, DV] = g * dout and dg [N] = sum_e dout * o_x (dg may be NULL). */
static void gate_bwd(int64_t N, int64_t DV, const double *g, const double *dout, const double *o_x, double *do_x,
                     double *dg)
{
    for (int64_t r = 0; r < N; r++) {
        for (int64_t e = 0; e < DV; e++) do_x[r * DV + e] = g[r] * dout[r * DV + e];
        if (dg) dg[r] = dot(dout + r * DV, o_x + r * DV, DV);
    }
}

/* A branch gradient src [n] goes to the caller's separate tensor when one was given
 * (sep_given; copied there if dst_sep is wanted), else it adds into the shared dst_main [n]. */
static void route(int sep_given, double *dst_sep, double *dst_main, const double *src, int64_t n)
{
    if (sep_given)
        copy_if(dst_sep, src, n);
    else
        add_to(dst_main, src, n);
}

/* Inputs: see ref_nsa_inputs (one sequence). Outputs: o [T, HQ, DV]; when non-NULL the
 * branch outputs o_cmp / o_slc / o_swa [T, HQ, DV] (zeros for a disabled branch) and
 * block_indices_used [T, H, width] (width = in->m with caller indices, else slc_topk).
 * When block_indices_used is asked for, the selection is computed even if g_slc is NULL. */
void ref_nsa_forward(const nsa_config *c, double scale, ref_dims d, const ref_nsa_inputs *in, double *o,
                     double *o_cmp, double *o_slc, double *o_swa, int32_t *block_indices_used)
{
    ref_pipe p = pipe_open(c, scale, d, in, in->g_slc != NULL || block_indices_used != NULL, 1);
    const int64_t NO = d.T * d.HQ * d.DV;
    double *oc = dalloc(NO), *os = dalloc(NO), *ow = dalloc(NO), *lse = dalloc(d.T * d.HQ);
    if (in->g_cmp) ref_cmp_attn(c, scale, d, p.Nc, in->q, p.kc, p.vc, oc, lse);
    if (in->g_slc) ref_slc_attn(c, scale, d, in->q, p.ks, p.vs, p.idx, p.width, p.counts, os, lse);
    if (in->g_swa) ref_attention(swa_scale(c, scale), 1, c->window - 1, 0, d, in->q, p.kw, p.vw, ow, lse);
    for (int64_t r = 0; r < d.T * d.HQ; r++)
        combine_row(d.DV, in->g_cmp ? in->g_cmp + r : NULL, in->g_slc ? in->g_slc + r : NULL,
                    in->g_swa ? in->g_swa + r : NULL, oc + r * d.DV, os + r * d.DV, ow + r * d.DV, o + r * d.DV);
    copy_if(o_cmp, oc, NO);
    copy_if(o_slc, os, NO);
    copy_if(o_swa, ow, NO);
    if (block_indices_used && d.T * d.H * p.width > 0)
        memcpy(block_indices_used, p.idx, (size_t)(d.T * d.H * p.width) * sizeof(int32_t));
    free(oc);
    free(os);
    free(ow);
    free(lse);
    pipe_close(&p);
}

/* A branch output the backward is handed (in->o_cmp, ...), for the naive pass only: the exact
 * gradient uses the exact output. With one, the branch's own forward is not needed. */
static const double *handed_o(const double *o) { return ref_store_round ? o : NULL; }

/* Backward of ref_nsa_forward for the loss sum(o * dout), dout [T, HQ, DV]. Every non-NULL
 * gradient is overwritten; one that no enabled branch reaches (a disabled branch's gate or
 * K/V, dk_slc without k_slc, ...) is written as zeros. The selection is treated as a
 * constant (it carries no gradient). */
void ref_nsa_backward(const nsa_config *c, double scale, ref_dims d, const ref_nsa_inputs *in,
                      const double *dout, ref_nsa_grads *grads)
{
    ref_pipe p = pipe_open(c, scale, d, in, in->g_slc != NULL, 1);
    const int64_t T = d.T, H = d.H, Nc = p.Nc;
    const int64_t NQ = T * d.HQ * d.DK, NO = T * d.HQ * d.DV, NK = T * H * d.DK, NV = T * H * d.DV;
    zero_if(grads->dq, NQ);
    zero_if(grads->dk, NK);
    zero_if(grads->dv, NV);
    zero_if(grads->dk_slc, NK);
    zero_if(grads->dv_slc, NV);
    zero_if(grads->dk_swa, NK);
    zero_if(grads->dv_swa, NV);
    zero_if(grads->dk_cmp, Nc * H * d.DK);
    zero_if(grads->dv_cmp, Nc * H * d.DV);
    zero_if(grads->dg_cmp, T * d.HQ);
    zero_if(grads->dg_slc, T * d.HQ);
    zero_if(grads->dg_swa, T * d.HQ);

    /* Shared accumulators: every branch adds its dq; dk/dv collect the branches that use k, v. */
    double *dq = dalloc(NQ), *dk = dalloc(NK), *dv = dalloc(NV);
    double *o_x = dalloc(NO), *do_x = dalloc(NO), *lse = dalloc(T * d.HQ), *dq_x = dalloc(NQ);
    double *dk_x = dalloc(NK), *dv_x = dalloc(NV);

    if (in->g_cmp) {
        double *dkc = dalloc(Nc * H * d.DK), *dvc = dalloc(Nc * H * d.DV);
        const double *og = handed_o(in->o_cmp);
        if (!og) ref_cmp_attn(c, scale, d, Nc, in->q, p.kc, p.vc, o_x, lse);
        gate_bwd(T * d.HQ, d.DV, in->g_cmp, dout, og ? og : o_x, do_x, grads->dg_cmp);
        ref_cmp_attn_bwd(c, scale, d, Nc, in->q, p.kc, p.vc, do_x, og, dq_x, dkc, dvc);
        add_to(dq, dq_x, NQ);
        /* Mean pooling is linear: its backward spreads dk_cmp[i] / l over block i's tokens. */
        if (in->k_cmp) {
            copy_if(grads->dk_cmp, dkc, Nc * H * d.DK);
        } else {
            ref_compress_bwd(c, T, H, d.DK, dkc, dk_x);
            add_to(dk, dk_x, NK);
        }
        if (in->v_cmp) {
            copy_if(grads->dv_cmp, dvc, Nc * H * d.DV);
        } else {
            ref_compress_bwd(c, T, H, d.DV, dvc, dv_x);
            add_to(dv, dv_x, NV);
        }
        free(dkc);
        free(dvc);
    }
    if (in->g_slc) {
        const double *og = handed_o(in->o_slc);
        if (!og) ref_slc_attn(c, scale, d, in->q, p.ks, p.vs, p.idx, p.width, p.counts, o_x, lse);
        gate_bwd(T * d.HQ, d.DV, in->g_slc, dout, og ? og : o_x, do_x, grads->dg_slc);
        ref_slc_attn_bwd(c, scale, d, in->q, p.ks, p.vs, p.idx, p.width, p.counts, do_x, og, dq_x, dk_x, dv_x);
        add_to(dq, dq_x, NQ);
        route(in->k_slc != NULL, grads->dk_slc, dk, dk_x, NK);
        route(in->v_slc != NULL, grads->dv_slc, dv, dv_x, NV);
    }
    if (in->g_swa) {
        const double *og = handed_o(in->o_swa);
        if (!og) ref_attention(swa_scale(c, scale), 1, c->window - 1, 0, d, in->q, p.kw, p.vw, o_x, lse);
        gate_bwd(T * d.HQ, d.DV, in->g_swa, dout, og ? og : o_x, do_x, grads->dg_swa);
        ref_attention_bwd(swa_scale(c, scale), 1, c->window - 1, 0, d, in->q, p.kw, p.vw, do_x, og, dq_x, dk_x, dv_x);
        add_to(dq, dq_x, NQ);
        route(in->k_swa != NULL, grads->dk_swa, dk, dk_x, NK);
        route(in->v_swa != NULL, grads->dv_swa, dv, dv_x, NV);
    }
    copy_if(grads->dq, dq, NQ);
    copy_if(grads->dk, dk, NK);
    copy_if(grads->dv, dv, NV);
    free(dq);
    free(dk);
    free(dv);
    free(o_x);
    free(do_x);
    free(lse);
    free(dq_x);
    free(dk_x);
    free(dv_x);
    pipe_close(&p);
}

/* ref_nsa_forward's o for the query rows rows[0..nrows) only -> o_rows [nrows, HQ, DV].
 * Each row rebuilds its own visibility rows and selection, so the memory is O(T) (plus the
 * O(Nc) pooled k_cmp / v_cmp) and the time O(nrows * T * (DK + DV) * HQ). The pieces
 * (attend_rows, select_one, combine_row) are the ones the dense path uses, and a row's
 * arithmetic does not depend on its block, so both agree to the last bit. */
void ref_nsa_forward_rows(const nsa_config *c, double scale, ref_dims d, const ref_nsa_inputs *in,
                          const int64_t *rows, int64_t nrows, double *o_rows)
{
    ref_pipe p = pipe_open(c, scale, d, in, in->g_slc != NULL, 0);
    const int64_t T = d.T, H = d.H, G = d.HQ / d.H, Nc = p.Nc, nb = num_slc(c, T), n = c->slc_topk;
    unsigned char *vis_c = ualloc(Nc), *vis_s = ualloc(T), *vis_w = ualloc(T);
    double *pbuf = dalloc(max64(T, Nc));
    double *oc = dalloc(d.DV), *os = dalloc(d.DV), *ow = dalloc(d.DV);
    int32_t *sel = ref_alloc(n, sizeof(int32_t));
    ref_sel_work w = sel_work_open(G, Nc, nb);
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t t = rows[r];
        cmp_mask_row(c, t, Nc, vis_c);
        win_mask_row(1, c->window - 1, 0, t, T, vis_w);
        for (int64_t h = 0; h < H; h++) {
            if (in->g_slc) {
                const int32_t *row = sel;
                int64_t cnt = n;
                if (p.idx) {
                    row = p.idx + (t * H + h) * p.width;
                    cnt = slc_count(p.counts, t, h, H, p.width);
                } else {
                    select_one(c, scale, d, Nc, in->q, p.kc, vis_c, t, h, &w, sel);
                }
                slc_mask_row(c, T, t, row, cnt, vis_s);
            }
            for (int64_t g = 0; g < G; g++) {
                const int64_t hq = h * G + g, qr = t * d.HQ + hq;
                const double *q_row[1] = {in->q + qr * d.DK};
                const unsigned char *vc_row[1] = {vis_c}, *vs_row[1] = {vis_s}, *vw_row[1] = {vis_w};
                double *oc_row[1] = {oc}, *os_row[1] = {os}, *ow_row[1] = {ow};
                if (in->g_cmp)
                    attend_rows(scale, d.DK, d.DV, Nc, p.kc + h * d.DK, H * d.DK, p.vc + h * d.DV, H * d.DV, 1, q_row,
                                vc_row, pbuf, oc_row, NULL);
                if (in->g_slc)
                    attend_rows(scale, d.DK, d.DV, T, p.ks + h * d.DK, H * d.DK, p.vs + h * d.DV, H * d.DV, 1, q_row,
                                vs_row, pbuf, os_row, NULL);
                if (in->g_swa)
                    attend_rows(swa_scale(c, scale), d.DK, d.DV, T, p.kw + h * d.DK, H * d.DK, p.vw + h * d.DV,
                                H * d.DV, 1, q_row, vw_row, pbuf, ow_row, NULL);
                combine_row(d.DV, in->g_cmp ? in->g_cmp + qr : NULL, in->g_slc ? in->g_slc + qr : NULL,
                            in->g_swa ? in->g_swa + qr : NULL, oc, os, ow, o_rows + (r * d.HQ + hq) * d.DV);
            }
        }
    }
    sel_work_close(&w);
    free(sel);
    free(vis_c);
    free(vis_s);
    free(vis_w);
    free(pbuf);
    free(oc);
    free(os);
    free(ow);
    pipe_close(&p);
}

/* ------------------------------------------------------------------------------------ */
/* The attention op with every option (nsa.h section 5), score matrix materialised         */
/* ------------------------------------------------------------------------------------ */

void ref_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4])
{
    uint32_t x[4] = {ctr[0], ctr[1], ctr[2], ctr[3]}, k[2] = {key[0], key[1]};
    for (int round = 0; round < 10; round++) {
        const uint64_t a = (uint64_t)x[0] * 0xD2511F53u, b = (uint64_t)x[2] * 0xCD9E8D57u;
        const uint32_t y[4] = {(uint32_t)(b >> 32) ^ x[1] ^ k[0], (uint32_t)b, (uint32_t)(a >> 32) ^ x[3] ^ k[1],
                               (uint32_t)a};
        memcpy(x, y, sizeof x);
        k[0] += 0x9E3779B9u; /* the bump after the last round is never used */
        k[1] += 0xBB67AE85u;
    }
    memcpy(out, x, sizeof x);
}

int ref_dropout_keep(double p, uint64_t seed, uint64_t offset, int64_t b, int64_t HQ, int64_t hq, int64_t i, int64_t j)
{
    const uint64_t x = offset + (uint64_t)b * (uint64_t)HQ + (uint64_t)hq;
    const uint32_t ctr[4] = {(uint32_t)(j / 4), (uint32_t)i, (uint32_t)(x & 0xffffffffu), (uint32_t)(x >> 32)};
    const uint32_t key[2] = {(uint32_t)(seed & 0xffffffffu), (uint32_t)(seed >> 32)};
    uint32_t r[4];
    ref_philox4x32_10(ctr, key, r);
    return (double)r[j % 4] >= floor(p * 4294967296.0);
}

/* Everything both directions need: visibility, raw scores u, final scores s, P, keep. */
typedef struct ref_ext {
    int64_t HQ, Tq, Tk;
    unsigned char *vis;   /* [HQ, Tq, Tk] */
    double *u, *s, *P;    /* [HQ, Tq, Tk]; P = exp(s - lse) on visible entries, else 0 */
    double *keep;         /* [HQ, Tq, Tk] 0 or 1 / (1 - p) (1 without dropout) */
    double *lse;          /* [HQ, Tq] */
} ref_ext;

static int64_t ext_at(const ref_ext *e, int64_t hq, int64_t i, int64_t j) { return (hq * e->Tq + i) * e->Tk + j; }

static ref_ext ext_open(const ref_attn_opts *o, ref_dims d, int64_t Tk, const double *q, const double *k)
{
    ref_ext e;
    const int64_t G = d.HQ / d.H, Tq = d.T, n = d.HQ * Tq * Tk;
    e.HQ = d.HQ, e.Tq = Tq, e.Tk = Tk;
    e.vis = ualloc(n), e.u = dalloc(n), e.s = dalloc(n), e.P = dalloc(n), e.keep = dalloc(n);
    e.lse = dalloc(d.HQ * Tq);
    for (int64_t hq = 0; hq < d.HQ; hq++)
        for (int64_t i = 0; i < Tq; i++) {
            const int64_t diag = i + Tk - Tq; /* bottom-right aligned diagonal */
            /* mx: the first visible score or sink, then any larger one (as attend_rows), so a
             * NaN or +inf score makes the whole row NaN, as dense softmax arithmetic does */
            double mx = -INFINITY;
            int any = 0;
            for (int64_t j = 0; j < Tk; j++) {
                const int64_t x = ext_at(&e, hq, i, j);
                int vis = (o->window_left < 0 || j >= diag - o->window_left) &&
                          (o->causal ? j <= diag : (o->window_right < 0 || j <= diag + o->window_right));
                if (o->q_seg && o->q_seg[i] != o->k_seg[j]) vis = 0;
                if (o->mask && !o->mask[x]) vis = 0;
                e.u[x] = o->scale * dot(q + (i * d.HQ + hq) * d.DK, k + (j * d.H + hq / G) * d.DK, d.DK);
                double s = o->softcap > 0 ? o->softcap * tanh(e.u[x] / o->softcap) : e.u[x];
                if (o->bias) s += o->bias[x];
                e.s[x] = rnd(s);
                /* a -inf bias entry masks; a -inf score from q or k is a visible key of weight 0 */
                if (o->bias && o->bias[x] == -INFINITY) vis = 0;
                e.vis[x] = (unsigned char)vis;
                if (vis && (!any || e.s[x] > mx)) mx = e.s[x], any = 1;
                e.keep[x] = 1.0;
                if (o->dropout_p > 0)
                    e.keep[x] = ref_dropout_keep(o->dropout_p, o->seed, o->offset, o->b, d.HQ, hq,
                                                 o->q_row0 + i, o->k_row0 + j)
                                    ? 1.0 / (1.0 - o->dropout_p)
                                    : 0.0;
            }
            if (o->sinks && (!any || o->sinks[hq] > mx)) mx = o->sinks[hq], any = 1;
            double z = 0;
            for (int64_t j = 0; any && j < Tk; j++)
                if (e.vis[ext_at(&e, hq, i, j)]) z += exp(e.s[ext_at(&e, hq, i, j)] - mx);
            if (any && o->sinks) z += exp(o->sinks[hq] - mx);
            const double lse = any ? mx + log(z) : -INFINITY;
            e.lse[hq * Tq + i] = lse;
            for (int64_t j = 0; j < Tk; j++) {
                const int64_t x = ext_at(&e, hq, i, j);
                e.P[x] = e.vis[x] ? rnd(exp(e.s[x] - lse)) : 0.0;
            }
        }
    return e;
}

static void ext_close(ref_ext *e)
{
    free(e->vis), free(e->u), free(e->s), free(e->P), free(e->keep), free(e->lse);
}

/* o[i, hq] = sum_j P keep v_j. */
static void ext_out(const ref_ext *e, ref_dims d, const double *v, double *o)
{
    const int64_t G = d.HQ / d.H;
    for (int64_t i = 0; i < e->Tq; i++)
        for (int64_t hq = 0; hq < d.HQ; hq++) {
            double *orow = o + (i * d.HQ + hq) * d.DV;
            memset(orow, 0, (size_t)d.DV * sizeof(double));
            for (int64_t j = 0; j < e->Tk; j++) {
                const int64_t x = ext_at(e, hq, i, j);
                /* every visible key, also at weight 0: 0 * inf in its v is NaN in dense P V too */
                if (e->vis[x]) axpy(orow, e->P[x] * e->keep[x], v + (j * d.H + hq / G) * d.DV, d.DV);
            }
            for (int64_t c = 0; c < d.DV; c++) orow[c] = rnd(orow[c]);
        }
}

void ref_attention_ext(const ref_attn_opts *opt, ref_dims d, int64_t Tk, const double *q, const double *k,
                       const double *v, double *o, double *lse)
{
    ref_ext e = ext_open(opt, d, Tk, q, k);
    if (o) ext_out(&e, d, v, o);
    if (lse)
        for (int64_t i = 0; i < d.T; i++)
            for (int64_t hq = 0; hq < d.HQ; hq++) lse[i * d.HQ + hq] = e.lse[hq * d.T + i];
    ext_close(&e);
}

/* dPd = dO . v (gradient of the dropped weight), dP = dPd keep, D = sum_j P dP,
 * dS = P (dP - D) (= dbias), du = dS cap'(u), dq = scale du k, dk = scale du q,
 * dv = P keep dO, dsink = -exp(sink - lse) D. */
void ref_attention_ext_bwd(const ref_attn_opts *opt, ref_dims d, int64_t Tk, const double *q, const double *k,
                           const double *v, const double *dout, double *dq, double *dk, double *dv, double *dsinks,
                           double *dbias)
{
    const int64_t G = d.HQ / d.H, Tq = d.T;
    ref_ext e = ext_open(opt, d, Tk, q, k);
    double *dS = dalloc(Tk), *o_buf = ref_store_round ? dalloc(Tq * d.HQ * d.DV) : NULL;
    if (o_buf) ext_out(&e, d, v, o_buf); /* the naive implementation's stored o: D's, unless handed one */
    zero_if(dq, Tq * d.HQ * d.DK);
    zero_if(dk, Tk * d.H * d.DK);
    zero_if(dv, Tk * d.H * d.DV);
    zero_if(dsinks, d.HQ);
    zero_if(dbias, d.HQ * Tq * Tk);
    for (int64_t hq = 0; hq < d.HQ; hq++)
        for (int64_t i = 0; i < Tq; i++) {
            const double *dO = dout + (i * d.HQ + hq) * d.DV, *qi = q + (i * d.HQ + hq) * d.DK;
            double D = 0;
            for (int64_t j = 0; j < Tk; j++) {
                const int64_t x = ext_at(&e, hq, i, j);
                dS[j] = e.vis[x] ? rnd(dot(dO, v + (j * d.H + hq / G) * d.DV, d.DV)) * e.keep[x] : 0.0;
                D += e.P[x] * dS[j];
            }
            if (o_buf) D = dot(dO, (opt->o_given ? opt->o_given : o_buf) + (i * d.HQ + hq) * d.DV, d.DV);
            const double lse = o_buf && opt->lse_given ? opt->lse_given[i * d.HQ + hq] : e.lse[hq * Tq + i];
            if (dsinks && opt->sinks) dsinks[hq] -= exp(opt->sinks[hq] - lse) * D;
            for (int64_t j = 0; j < Tk; j++) {
                const int64_t x = ext_at(&e, hq, i, j);
                if (!e.vis[x]) continue;
                const double ds = rnd(e.P[x] * (dS[j] - D));
                if (dbias) dbias[x] = ds;
                double du = ds;
                if (opt->softcap > 0) {
                    const double th = tanh(e.u[x] / opt->softcap);
                    du *= 1.0 - th * th;
                }
                if (dq) axpy(dq + (i * d.HQ + hq) * d.DK, opt->scale * du, k + (j * d.H + hq / G) * d.DK, d.DK);
                if (dk) axpy(dk + (j * d.H + hq / G) * d.DK, opt->scale * du, qi, d.DK);
                if (dv) axpy(dv + (j * d.H + hq / G) * d.DV, e.P[x] * e.keep[x], dO, d.DV);
            }
        }
    free(dS);
    free(o_buf);
    ext_close(&e);
}
