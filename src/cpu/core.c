/* core.c -- the fp32 attention tile shared by compressed, selected and windowed attention,
 * forward (online softmax, FlashAttention-2 style) and backward (recompute P from lse).
 * Rows carry their own visible key range, so one routine serves every mask of the spec. */
#include "common.h"

void core_tile_alloc(core_tile *t, ws_arena *a, int64_t R, int64_t DK, int64_t DV, int64_t s_cap, int backward)
{
    const size_t f = sizeof(float), i = sizeof(int64_t), xd = nsa_size_of(DK > DV ? DK : DV);
    const size_t r = nsa_size_of(R), dk = nsa_size_of(DK), dv = nsa_size_of(DV);
    /* the tile keeps these in int (loop bounds of the micro-kernels) */
    if (R > INT_MAX || DK > INT_MAX || DV > INT_MAX) ws_fail(a);
    t->R = (int)R;
    t->DK = (int)DK;
    t->DV = (int)DV;
    t->S_cap = s_cap;
    t->Q = (float *)ws_take_2d(a, r, dk, f);
    t->lo = (int64_t *)ws_take_n(a, r, i);
    t->hi = (int64_t *)ws_take_n(a, r, i);
    t->m = (float *)ws_take_n(a, r, f);
    t->l = (float *)ws_take_n(a, r, f);
    t->ninf = (unsigned char *)ws_take_n(a, r, 1);
    t->O = (float *)ws_take_2d(a, r, dv, f);
    t->S = (float *)ws_take_2d(a, r, nsa_size_of(s_cap), f);
    t->xt = (float *)ws_take_2d(a, xd, 16, f);
    t->dO = t->lse = t->Drow = t->dQ = NULL;
    if (backward) {
        t->dO = (float *)ws_take_2d(a, r, dv, f);
        t->lse = (float *)ws_take_n(a, r, f);
        t->Drow = (float *)ws_take_n(a, r, f);
        t->dQ = (float *)ws_take_2d(a, r, dk, f);
    }
}

void core_fwd_begin(core_tile *t)
{
    for (int r = 0; r < t->R; r++) {
        t->m[r] = -INFINITY;
        t->l[r] = 0.0f;
        t->ninf[r] = 0;
    }
    memset(t->O, 0, (size_t)t->R * t->DV * sizeof(float));
}

/* ---- micro-kernels ----------------------------------------------------------------------
 * Register-blocked products: 8 rows x 16 lanes of fp32 accumulators held in GCC/Clang
 * vector types, so they stay in vector registers (one zmm each with AVX-512, two ymm with
 * AVX2) instead of being spilled as plain arrays are. vf16 is only 4-byte aligned, so
 * loads and stores through it may be unaligned. */
typedef float vf16 __attribute__((vector_size(64), aligned(4)));
enum { MK_ROWS = 8, MK_LANES = 16 };

static inline vf16 vload(const float *p) { return *(const vf16 *)p; }
static inline void vstore(float *p, vf16 v) { *(vf16 *)p = v; }
static inline vf16 vzero(void) { return (vf16){0}; }
/* First w lanes of p (the rest 0) and the matching partial store: for dims not a multiple of 16. */
static inline vf16 vload_n(const float *p, int w)
{
    vf16 v = vzero();
    for (int j = 0; j < w; j++) v[j] = p[j];
    return v;
}
static inline void vstore_n(float *p, vf16 v, int w)
{
    for (int j = 0; j < w; j++) p[j] = v[j];
}

typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));

/* core_exp on 16 lanes (same polynomial, same clamp), written with vector types because
 * the scalar version's rounding and bit tricks defeat the auto-vectoriser. Rounding to the
 * nearest integer uses the 1.5 * 2^23 trick (exact for |y| < 2^22). */
static inline vf16 vexp(vf16 x)
{
    const vf16 lo = vzero() - 87.0f, hi = vzero() + 88.0f;
    const vi16 under = x < lo;
    x = (vf16)((under & (vi16)lo) | (~under & (vi16)x));
    const vi16 over = x > hi;
    x = (vf16)((over & (vi16)hi) | (~over & (vi16)x));
    const vf16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const vf16 f = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    const vf16 p =
        1.0f + f * (1.0f + f * (0.5f + f * (0.166666667f + f * (0.0416666667f + f * (0.00833333333f + f * (0.00138888889f + f * 0.000198412698f))))));
    const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
    return (vf16)(~under & (vi16)(p * (vf16)bits));
}

/* s[i] = exp(s[i] - shift) for i < n; @return their sum. */
static float exp_row(float *s, int64_t n, float shift)
{
    vf16 acc = vzero();
    int64_t i = 0;
    for (; i + MK_LANES <= n; i += MK_LANES) {
        const vf16 e = vexp(vload(s + i) - shift);
        vstore(s + i, e);
        acc += e;
    }
    float sum = 0.0f;
    for (int j = 0; j < MK_LANES; j++) sum += acc[j];
    for (; i < n; i++) {
        s[i] = core_exp(s[i] - shift);
        sum += s[i];
    }
    return sum;
}

/* p[i] = exp(p[i] - lse), ds[i] = p[i] * (ds[i] - D) for i < n (the backward's P and dS). */
static void grad_row(float *p, float *ds, int64_t n, float lse, float D)
{
    int64_t i = 0;
    for (; i + MK_LANES <= n; i += MK_LANES) {
        const vf16 e = vexp(vload(p + i) - lse);
        vstore(p + i, e);
        vstore(ds + i, e * (vload(ds + i) - D));
    }
    for (; i < n; i++) {
        p[i] = core_exp(p[i] - lse);
        ds[i] = p[i] * (ds[i] - D);
    }
}

/* S[r * ldS + (c - c0)] = A[r] . X[c] for r < R, c in [c0, c1); A [R, D], X [*, D].
 * Sixteen keys at a time are transposed into xt [D, 16] (8 KiB at D = 128, in L1), so the
 * inner loop is one 16-lane FMA per row against a broadcast value of A; MK_ROWS rows share
 * each load and keep enough independent FMAs in flight. */
static void mk_scores(const float *A, int R, int D, const float *X, int64_t c0, int64_t c1, float *S, int64_t ldS,
                      float *xt)
{
    for (int64_t cb = c0; cb < c1; cb += MK_LANES) {
        const int nk = c1 - cb < MK_LANES ? (int)(c1 - cb) : MK_LANES;
        for (int j = 0; j < MK_LANES; j++)
            for (int d = 0; d < D; d++) xt[d * MK_LANES + j] = j < nk ? X[(cb + j) * D + d] : 0.0f;
        float *out = S + (cb - c0);
        int r = 0;
        for (; r + MK_ROWS <= R; r += MK_ROWS) {
            vf16 acc[MK_ROWS];
            const float *a = A + (size_t)r * D;
#pragma GCC unroll 8
            for (int i = 0; i < MK_ROWS; i++) acc[i] = vzero();
            for (int d = 0; d < D; d++) {
                const vf16 x = vload(xt + d * MK_LANES);
#pragma GCC unroll 8
                for (int i = 0; i < MK_ROWS; i++) acc[i] += a[i * D + d] * x;
            }
            for (int i = 0; i < MK_ROWS; i++) vstore_n(out + (size_t)(r + i) * ldS, acc[i], nk);
        }
        for (; r < R; r++) {
            vf16 acc = vzero();
            const float *a = A + (size_t)r * D;
            for (int d = 0; d < D; d++) acc += a[d] * vload(xt + d * MK_LANES);
            vstore_n(out + (size_t)r * ldS, acc, nk);
        }
    }
}

/* Acc[r] [D] += sum_{c < n} W[r * ldW + c] * X[c] [D] for r < R (P V, dS K). */
static void mk_accum(float *Acc, const float *W, int64_t ldW, int R, const float *X, int D, int64_t n)
{
    for (int d0 = 0; d0 < D; d0 += MK_LANES) {
        const int w = D - d0 < MK_LANES ? D - d0 : MK_LANES;
        int r = 0;
        for (; r + MK_ROWS <= R; r += MK_ROWS) {
            float *o = Acc + (size_t)r * D + d0;
            const float *wr = W + (size_t)r * ldW;
            vf16 acc[MK_ROWS];
#pragma GCC unroll 8
            for (int i = 0; i < MK_ROWS; i++) acc[i] = vload_n(o + (size_t)i * D, w);
            for (int64_t c = 0; c < n; c++) {
                const vf16 x = w == MK_LANES ? vload(X + c * D + d0) : vload_n(X + c * D + d0, w);
#pragma GCC unroll 8
                for (int i = 0; i < MK_ROWS; i++) acc[i] += wr[(size_t)i * ldW + c] * x;
            }
            for (int i = 0; i < MK_ROWS; i++) vstore_n(o + (size_t)i * D, acc[i], w);
        }
        for (; r < R; r++) {
            float *o = Acc + (size_t)r * D + d0;
            const float *wr = W + (size_t)r * ldW;
            vf16 acc = vload_n(o, w);
            for (int64_t c = 0; c < n; c++) acc += wr[c] * vload_n(X + c * D + d0, w);
            vstore_n(o, acc, w);
        }
    }
}

/* Acc[c] [D] += sum_{r < R} W[r * ldW + c] * Y[r] [D] for c < n (dS^T Q, P^T dO):
 * MK_ROWS keys at a time, so each row of Y is loaded once per MK_ROWS keys. */
static void mk_accum_t(float *Acc, const float *W, int64_t ldW, int R, const float *Y, int D, int64_t n)
{
    for (int d0 = 0; d0 < D; d0 += MK_LANES) {
        const int w = D - d0 < MK_LANES ? D - d0 : MK_LANES;
        int64_t c = 0;
        for (; c + MK_ROWS <= n; c += MK_ROWS) {
            float *o = Acc + c * D + d0;
            vf16 acc[MK_ROWS];
#pragma GCC unroll 8
            for (int i = 0; i < MK_ROWS; i++) acc[i] = vload_n(o + (size_t)i * D, w);
            for (int r = 0; r < R; r++) {
                const float *wr = W + (size_t)r * ldW + c;
                const vf16 y = w == MK_LANES ? vload(Y + (size_t)r * D + d0) : vload_n(Y + (size_t)r * D + d0, w);
#pragma GCC unroll 8
                for (int i = 0; i < MK_ROWS; i++) acc[i] += wr[i] * y;
            }
            for (int i = 0; i < MK_ROWS; i++) vstore_n(o + (size_t)i * D, acc[i], w);
        }
        for (; c < n; c++) {
            float *o = Acc + c * D + d0;
            vf16 acc = vload_n(o, w);
            for (int r = 0; r < R; r++) acc += W[(size_t)r * ldW + c] * vload_n(Y + (size_t)r * D + d0, w);
            vstore_n(o, acc, w);
        }
    }
}

/* ---- non-finite operands ------------------------------------------------------------------
 * The products above multiply every (row, key) pair of a block, hidden ones with weight 0. That
 * is exact for finite operands, but 0 * NaN = NaN and 0 * Inf = NaN: a non-finite key, value,
 * query or upstream gradient would reach rows the mask hides it from. Hidden pairs therefore
 * carry the weight -0.0f (a visible weight is positive, since the exponential is clamped above
 * 0, or NaN, or +0 when dropout drops it), and a product whose operand holds a non-finite value
 * takes the visible-pairs-only path below. Finite inputs never leave the register-blocked path. */
static inline int is_hidden(float w)
{
    union { float f; uint32_t u; } x = {w};
    return x.u == 0x80000000u;
}

void core_fill_hidden(float *s, int64_t n)
{
    for (int64_t i = 0; i < n; i++) s[i] = -0.0f;
}

/* Nonzero when the n floats at x are all finite (x * 0 is NaN exactly for NaN and +-Inf). */
int core_all_finite(const float *x, int64_t n)
{
    vf16 acc = vzero();
    int64_t i = 0;
    for (; i + MK_LANES <= n; i += MK_LANES) acc += vload(x + i) * 0.0f;
    float sum = 0.0f;
    for (int j = 0; j < MK_LANES; j++) sum += acc[j];
    for (; i < n; i++) sum += x[i] * 0.0f;
    return sum == 0.0f;
}

/* mk_accum over the visible pairs only (M[r * ldW + c] not hidden). */
static void mk_accum_visible(float *Acc, const float *W, const float *M, int64_t ldW, int R, const float *X, int D,
                             int64_t n)
{
    for (int r = 0; r < R; r++) {
        float *o = Acc + (size_t)r * D;
        const float *wr = W + (size_t)r * ldW, *mr = M + (size_t)r * ldW;
        for (int64_t c = 0; c < n; c++) {
            if (is_hidden(mr[c])) continue;
            const float w = wr[c], *x = X + c * D;
            for (int d = 0; d < D; d++) o[d] += w * x[d];
        }
    }
}

/* mk_accum_t over the visible pairs only. */
static void mk_accum_t_visible(float *Acc, const float *W, const float *M, int64_t ldW, int R, const float *Y, int D,
                               int64_t n)
{
    for (int64_t c = 0; c < n; c++) {
        float *o = Acc + c * D;
        for (int r = 0; r < R; r++) {
            if (is_hidden(M[(size_t)r * ldW + c])) continue;
            const float w = W[(size_t)r * ldW + c], *y = Y + (size_t)r * D;
            for (int d = 0; d < D; d++) o[d] += w * y[d];
        }
    }
}

/* The products as the tiles call them. Only a block with hidden pairs (`hidden`: some row sees
 * less than all of it) can carry a non-finite operand to a row that does not see it, so only
 * then is X (n rows) or Y (R rows) scanned; blocks every row sees whole skip the scan. */
static void accum_checked(float *Acc, const float *W, const float *M, int64_t ldW, int R, const float *X, int D,
                          int64_t n, int hidden)
{
    if (!hidden || core_all_finite(X, n * D)) mk_accum(Acc, W, ldW, R, X, D, n);
    else mk_accum_visible(Acc, W, M, ldW, R, X, D, n);
}

static void accum_t_checked(float *Acc, const float *W, const float *M, int64_t ldW, int R, const float *Y, int D,
                            int64_t n, int hidden)
{
    if (!hidden || core_all_finite(Y, (int64_t)R * D)) mk_accum_t(Acc, W, ldW, R, Y, D, n);
    else mk_accum_t_visible(Acc, W, M, ldW, R, Y, D, n);
}

/* Visible part of [c0, c1) for row r, as [a, b) (empty when a >= b). */
static inline void row_span(const core_tile *t, int r, int64_t c0, int64_t c1, int64_t *a, int64_t *b)
{
    *a = t->lo[r] > c0 ? t->lo[r] : c0;
    *b = t->hi[r] + 1 < c1 ? t->hi[r] + 1 : c1;
}

/* Union of the rows' visible parts of [c0, c1), as [ua, ub) (ua >= ub: nobody sees any). */
static void union_span(const core_tile *t, int64_t c0, int64_t c1, int64_t *ua, int64_t *ub)
{
    *ua = c1;
    *ub = c0;
    for (int r = 0; r < t->R; r++) {
        int64_t a, b;
        row_span(t, r, c0, c1, &a, &b);
        if (a >= b) continue;
        *ua = a < *ua ? a : *ua;
        *ub = b > *ub ? b : *ub;
    }
}

void core_fwd_block(core_tile *t, const float *K, const float *V, int64_t c0, int64_t c1)
{
    const int64_t n = c1 - c0;
    int64_t ua, ub;
    union_span(t, c0, c1, &ua, &ub);
    if (ua >= ub) {
        for (int r = 0; r < t->R; r++) core_fill_hidden(t->S + (size_t)r * t->S_cap, n);
        return;
    }
    mk_scores(t->Q, t->R, t->DK, K, ua, ub, t->S + (ua - c0), t->S_cap, t->xt);
    int hidden = 0; /* some row sees less than [ua, ub) */
    for (int r = 0; r < t->R; r++) {
        float *s = t->S + (size_t)r * t->S_cap;
        int64_t a, b;
        row_span(t, r, c0, c1, &a, &b);
        hidden |= a != ua || b != ub;
        if (a >= b) {
            core_fill_hidden(s, n);
            continue;
        }
        core_fill_hidden(s, a - c0);
        core_fill_hidden(s + (b - c0), c1 - b);
        float mx = t->m[r];
#pragma omp simd reduction(max : mx)
        for (int64_t c = a - c0; c < b - c0; c++) mx = s[c] > mx ? s[c] : mx;
        /* rescale what was accumulated under the old max */
        const float alpha = t->m[r] == -INFINITY ? 0.0f : core_exp(t->m[r] - mx);
        float sum;
        if (mx == -INFINITY) {
            /* every visible score so far is -inf or NaN (the max skips NaN): weight 0 for -inf,
             * NaN stays NaN (not exp(s - mx), which is NaN for both). Such a row is NaN at the
             * end only if no finite score follows in a later block: over the whole row, dense
             * softmax gives these keys exp(-inf - max) = 0 */
            sum = 0.0f;
            for (int64_t c = a - c0; c < b - c0; c++) {
                s[c] = s[c] != s[c] ? s[c] : 0.0f;
                sum += s[c];
            }
            if (sum == 0.0f) t->ninf[r] = 1;
        } else {
            sum = exp_row(s + (a - c0), b - a, mx);
        }
        t->m[r] = mx;
        t->l[r] = t->l[r] * alpha + sum;
        if (V && alpha != 1.0f) {
            float *o = t->O + (size_t)r * t->DV;
            for (int d = 0; d < t->DV; d++) o[d] *= alpha;
        }
    }
    if (V)
        accum_checked(t->O, t->S + (ua - c0), t->S + (ua - c0), t->S_cap, t->R, V + ua * t->DV, t->DV, ub - ua, hidden);
}

void core_fwd_end(core_tile *t, float *lse_out)
{
    for (int r = 0; r < t->R; r++) {
        float *o = t->O + (size_t)r * t->DV;
        /* l is 0 exactly when the row saw no key (a visible key with a finite score adds at least
         * exp(0) = 1 at the running max) or only keys scored -inf (ninf); a NaN l is a
         * non-finite row, never an empty one */
        if (t->l[r] != 0.0f) {
            float inv = 1.0f / t->l[r];
            for (int d = 0; d < t->DV; d++) o[d] *= inv;
            if (lse_out) lse_out[r] = t->m[r] + logf(t->l[r]);
        } else if (t->ninf[r]) { /* saw keys, all with score -inf */
            for (int d = 0; d < t->DV; d++) o[d] = NAN;
            if (lse_out) lse_out[r] = NAN;
        } else {
            memset(o, 0, (size_t)t->DV * sizeof(float));
            if (lse_out) lse_out[r] = -INFINITY;
        }
    }
}

void core_bwd_block(core_tile *t, const float *K, const float *V, int64_t c0, int64_t c1, float *dK, float *dV)
{
    const int64_t half = t->S_cap / 2;
    int64_t ua, ub;
    union_span(t, c0, c1, &ua, &ub);
    if (ua >= ub) return;
    const int64_t n = ub - ua;
    /* P at S[r][c - ua], dS at S[r][half + c - ua]: the rows' [R, n] matrices */
    float *P = t->S, *dS = t->S + half;
    mk_scores(t->Q, t->R, t->DK, K, ua, ub, P, t->S_cap, t->xt);
    mk_scores(t->dO, t->R, t->DV, V, ua, ub, dS, t->S_cap, t->xt);
    int hidden = 0; /* some row sees less than [ua, ub) */
    for (int r = 0; r < t->R; r++) {
        float *p = P + (size_t)r * t->S_cap, *ds = dS + (size_t)r * t->S_cap;
        int64_t a, b;
        row_span(t, r, ua, ub, &a, &b);
        hidden |= a != ua || b != ub || t->lse[r] == -INFINITY;
        if (t->lse[r] == -INFINITY || a >= b) { /* row saw no key here: no gradient */
            core_fill_hidden(p, n);
            memset(ds, 0, (size_t)n * sizeof(float));
            continue;
        }
        core_fill_hidden(p, a - ua);
        core_fill_hidden(p + (b - ua), ub - b);
        memset(ds, 0, (size_t)(a - ua) * sizeof(float));
        memset(ds + (b - ua), 0, (size_t)(ub - b) * sizeof(float));
        grad_row(p + (a - ua), ds + (a - ua), b - a, t->lse[r], t->Drow[r]);
    }
    if (t->dQ) accum_checked(t->dQ, dS, P, t->S_cap, t->R, K + ua * t->DK, t->DK, n, hidden);
    if (dK) accum_t_checked(dK + (ua - c0) * t->DK, dS, P, t->S_cap, t->R, t->Q, t->DK, n, hidden);
    if (dV) accum_t_checked(dV + (ua - c0) * t->DV, P, P, t->S_cap, t->R, t->dO, t->DV, n, hidden);
}

/* The micro-kernels for the attention op's general path (attn_ext.c). */
void core_scores(const float *A, int R, int D, const float *X, int64_t c0, int64_t c1, float *S, int64_t ldS,
                 float *xt)
{
    mk_scores(A, R, D, X, c0, c1, S, ldS, xt);
}

void core_accum(float *Acc, const float *W, const float *M, int64_t ldW, int R, const float *X, int D, int64_t n)
{
    accum_checked(Acc, W, M, ldW, R, X, D, n, 1); /* general masks: hidden pairs anywhere */
}

void core_accum_t(float *Acc, const float *W, const float *M, int64_t ldW, int R, const float *Y, int D, int64_t n)
{
    accum_t_checked(Acc, W, M, ldW, R, Y, D, n, 1);
}

/* ---- rows of attn_ext.c's general path: vis[i] == 0 marks a hidden pair (mask, window,
 * segments, a -inf bias), whose weight is the hidden marker -0.0f and whose dS is 0. A visible
 * score of -inf (from an infinite q or k) keeps its tiny weight like any other visible key. -- */

/* The lanes of vis[0..16) that are hidden, as an all-ones lane mask. */
static inline vi16 hidden_lanes(const unsigned char *vis)
{
    vi16 h;
    for (int j = 0; j < MK_LANES; j++) h[j] = vis[j] ? 0 : -1;
    return h;
}

float core_exp_row_masked(float *s, const unsigned char *vis, int64_t n, float shift)
{
    const vf16 nzero = -vzero(); /* -0.0f: 0.0f - 0.0f would be +0 */
    vf16 acc = vzero();
    int64_t i = 0;
    for (; i + MK_LANES <= n; i += MK_LANES) {
        const vi16 hidden = hidden_lanes(vis + i);
        const vf16 e = (vf16)((hidden & (vi16)nzero) | (~hidden & (vi16)vexp(vload(s + i) - shift)));
        vstore(s + i, e);
        acc += e;
    }
    float sum = 0.0f;
    for (int j = 0; j < MK_LANES; j++) sum += acc[j];
    for (; i < n; i++) {
        s[i] = vis[i] ? core_exp(s[i] - shift) : -0.0f;
        sum += s[i];
    }
    return sum;
}

void core_grad_row_masked(float *p, float *ds, const float *keep, const unsigned char *vis, int64_t n, float lse,
                          float D, int dropped_p)
{
    /* hidden pairs: P = -0 (the marker; -0 * keep stays -0) and dS = 0, whatever dP holds */
    int64_t i = 0;
    for (; i + MK_LANES <= n; i += MK_LANES) {
        const vf16 kf = vload(keep + i);
        const vi16 hidden = hidden_lanes(vis + i);
        /* the hidden lanes' marker by a lane loop, not the bitwise blend of core_exp_row_masked:
         * with that blend here GCC 12 at -O3 for AVX-512 (-march=native on a Sapphire Rapids
         * host) stored P where P * kf was asked, so dV lost the dropout factor. The loop runs
         * on an array: on a vector's lanes a newer GCC with -march=native warned that P may be
         * used uninitialized (an error under -Werror) */
        float pl[MK_LANES];
        vstore(pl, vexp(vload(p + i) - lse));
        for (int j = 0; j < MK_LANES; j++)
            if (hidden[j]) pl[j] = -0.0f;
        const vf16 P = vload(pl);
        vstore(ds + i, (vf16)(~hidden & (vi16)(P * (vload(ds + i) * kf - D))));
        vstore(p + i, dropped_p ? P * kf : P);
    }
    for (; i < n; i++) {
        const float P = vis[i] ? core_exp(p[i] - lse) : -0.0f;
        ds[i] = vis[i] ? P * (ds[i] * keep[i] - D) : 0.0f;
        p[i] = dropped_p ? P * keep[i] : P;
    }
}

void core_softcap_row(float *s, float *dcap, int64_t n, float cap)
{
    /* capped so that a subnormal softcap cannot turn 0 * inf into NaN */
    const float two_inv = 2.0f / cap < 3.0e38f ? 2.0f / cap : 3.0e38f;
    int64_t i = 0;
    for (; i + MK_LANES <= n; i += MK_LANES) {
        const vf16 th = 1.0f - 2.0f / (vexp(vload(s + i) * two_inv) + 1.0f);
        vstore(s + i, cap * th);
        vstore(dcap + i, 1.0f - th * th);
    }
    for (; i < n; i++) {
        const float th = 1.0f - 2.0f / (core_exp(s[i] * two_inv) + 1.0f);
        s[i] = cap * th;
        dcap[i] = 1.0f - th * th;
    }
}
