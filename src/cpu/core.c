/* core.c -- the fp32 attention tile shared by compressed, selected and windowed attention,
 * forward (online softmax, FlashAttention-2 style) and backward (recompute P from lse).
 * Rows carry their own visible key range, so one routine serves every mask of the spec. */
#include "common.h"

void core_tile_alloc(core_tile *t, ws_arena *a, int R, int DK, int DV, int64_t s_cap, int backward)
{
    t->R = R;
    t->DK = DK;
    t->DV = DV;
    t->S_cap = s_cap;
    t->Q = (float *)ws_take(a, (size_t)R * DK * sizeof(float));
    t->lo = (int64_t *)ws_take(a, (size_t)R * sizeof(int64_t));
    t->hi = (int64_t *)ws_take(a, (size_t)R * sizeof(int64_t));
    t->m = (float *)ws_take(a, (size_t)R * sizeof(float));
    t->l = (float *)ws_take(a, (size_t)R * sizeof(float));
    t->O = (float *)ws_take(a, (size_t)R * DV * sizeof(float));
    t->S = (float *)ws_take(a, (size_t)R * (size_t)s_cap * sizeof(float));
    t->dO = t->lse = t->Drow = t->dQ = NULL;
    if (backward) {
        t->dO = (float *)ws_take(a, (size_t)R * DV * sizeof(float));
        t->lse = (float *)ws_take(a, (size_t)R * sizeof(float));
        t->Drow = (float *)ws_take(a, (size_t)R * sizeof(float));
        t->dQ = (float *)ws_take(a, (size_t)R * DK * sizeof(float));
    }
}

void core_fwd_begin(core_tile *t)
{
    for (int r = 0; r < t->R; r++) {
        t->m[r] = -INFINITY;
        t->l[r] = 0.0f;
    }
    memset(t->O, 0, (size_t)t->R * t->DV * sizeof(float));
}

/* s[c] = q . K[c] for c in [c0, c1): four keys at a time so each q load feeds 4 FMAs. */
static void scores_row(const float *q, const float *K, int DK, int64_t c0, int64_t c1, float *s)
{
    int64_t c = c0;
    for (; c + 4 <= c1; c += 4) {
        const float *k0 = K + c * DK, *k1 = k0 + DK, *k2 = k1 + DK, *k3 = k2 + DK;
        float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int d = 0; d < DK; d++) {
            a0 += q[d] * k0[d];
            a1 += q[d] * k1[d];
            a2 += q[d] * k2[d];
            a3 += q[d] * k3[d];
        }
        s[c - c0] = a0;
        s[c - c0 + 1] = a1;
        s[c - c0 + 2] = a2;
        s[c - c0 + 3] = a3;
    }
    for (; c < c1; c++) {
        const float *k0 = K + c * DK;
        float a0 = 0;
#pragma omp simd reduction(+ : a0)
        for (int d = 0; d < DK; d++) a0 += q[d] * k0[d];
        s[c - c0] = a0;
    }
}

/* Visible part of [c0, c1) for row r, as [a, b) (empty when a >= b). */
static inline void row_span(const core_tile *t, int r, int64_t c0, int64_t c1, int64_t *a, int64_t *b)
{
    *a = t->lo[r] > c0 ? t->lo[r] : c0;
    *b = t->hi[r] + 1 < c1 ? t->hi[r] + 1 : c1;
}

/* o [n] += sum_{c < cnt} w[c] * X[c] [n]: four rows of X per pass, so o is loaded and
 * stored once per four keys instead of once per key. */
static void accumulate_rows(float *o, const float *w, const float *X, int n, int64_t cnt)
{
    int64_t c = 0;
    for (; c + 4 <= cnt; c += 4) {
        const float w0 = w[c], w1 = w[c + 1], w2 = w[c + 2], w3 = w[c + 3];
        const float *x0 = X + c * n, *x1 = x0 + n, *x2 = x1 + n, *x3 = x2 + n;
#pragma omp simd
        for (int d = 0; d < n; d++) o[d] += w0 * x0[d] + w1 * x1[d] + w2 * x2[d] + w3 * x3[d];
    }
    for (; c < cnt; c++) {
        const float w0 = w[c], *x0 = X + c * n;
#pragma omp simd
        for (int d = 0; d < n; d++) o[d] += w0 * x0[d];
    }
}

void core_fwd_block(core_tile *t, const float *K, const float *V, int64_t c0, int64_t c1)
{
    const int DK = t->DK, DV = t->DV;
    const int64_t n = c1 - c0;
    for (int r = 0; r < t->R; r++) {
        float *s = t->S + (size_t)r * t->S_cap;
        int64_t a, b;
        row_span(t, r, c0, c1, &a, &b);
        if (a >= b) {
            memset(s, 0, (size_t)n * sizeof(float));
            continue;
        }
        memset(s, 0, (size_t)(a - c0) * sizeof(float));
        memset(s + (b - c0), 0, (size_t)(c1 - b) * sizeof(float));
        scores_row(t->Q + (size_t)r * DK, K, DK, a, b, s + (a - c0));
        float mx = t->m[r];
        for (int64_t c = a; c < b; c++) mx = s[c - c0] > mx ? s[c - c0] : mx;
        /* rescale what was accumulated under the old max */
        float alpha = t->m[r] == -INFINITY ? 0.0f : core_exp(t->m[r] - mx);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = a; c < b; c++) {
            float e = core_exp(s[c - c0] - mx);
            s[c - c0] = e;
            sum += e;
        }
        t->m[r] = mx;
        t->l[r] = t->l[r] * alpha + sum;
        if (!V) continue;
        float *o = t->O + (size_t)r * DV;
        if (alpha != 1.0f)
            for (int d = 0; d < DV; d++) o[d] *= alpha;
        accumulate_rows(o, s + (a - c0), V + a * DV, DV, b - a);
    }
}

void core_fwd_end(core_tile *t, float *lse_out)
{
    for (int r = 0; r < t->R; r++) {
        float *o = t->O + (size_t)r * t->DV;
        if (t->l[r] > 0.0f) {
            float inv = 1.0f / t->l[r];
            for (int d = 0; d < t->DV; d++) o[d] *= inv;
            if (lse_out) lse_out[r] = t->m[r] + logf(t->l[r]);
        } else {
            memset(o, 0, (size_t)t->DV * sizeof(float));
            if (lse_out) lse_out[r] = -INFINITY;
        }
    }
}

void core_bwd_block(core_tile *t, const float *K, const float *V, int64_t c0, int64_t c1, float *dK, float *dV)
{
    const int DK = t->DK, DV = t->DV;
    const int64_t n = c1 - c0, half = t->S_cap / 2;
    /* Pass 1, per row: P = exp(s - lse) and dS = P * (dO.V - Drow), stored as [R, n] matrices
     * (P at S[r][c - c0], dS at S[r][half + c - c0]; zero outside the row's visible span),
     * and dQ += dS K. */
    for (int r = 0; r < t->R; r++) {
        float *P = t->S + (size_t)r * t->S_cap, *dS = P + half;
        int64_t a, b;
        row_span(t, r, c0, c1, &a, &b);
        if (t->lse[r] == -INFINITY || a >= b) { /* row saw no key here: no gradient */
            memset(P, 0, (size_t)n * sizeof(float));
            memset(dS, 0, (size_t)n * sizeof(float));
            continue;
        }
        memset(P, 0, (size_t)(a - c0) * sizeof(float));
        memset(P + (b - c0), 0, (size_t)(c1 - b) * sizeof(float));
        memset(dS, 0, (size_t)(a - c0) * sizeof(float));
        memset(dS + (b - c0), 0, (size_t)(c1 - b) * sizeof(float));
        const float *q = t->Q + (size_t)r * DK, *dO = t->dO + (size_t)r * DV;
        scores_row(q, K, DK, a, b, P + (a - c0));
        scores_row(dO, V, DV, a, b, dS + (a - c0));
        const float lse = t->lse[r], D = t->Drow[r];
#pragma omp simd
        for (int64_t i = a - c0; i < b - c0; i++) {
            const float p = core_exp(P[i] - lse);
            P[i] = p;
            dS[i] = p * (dS[i] - D);
        }
        if (t->dQ) accumulate_rows(t->dQ + (size_t)r * DK, dS + (a - c0), K + a * DK, DK, b - a);
    }
    /* Pass 2, per key: dK[c] += sum_r dS[r][c] Q[r], dV[c] += sum_r P[r][c] dO[r], four rows
     * at a time so each key row is loaded and stored once per four query rows. */
    if (!dK && !dV) return;
    for (int64_t i = 0; i < n; i++) {
        float *dk = dK ? dK + i * DK : NULL, *dv = dV ? dV + i * DV : NULL;
        int r = 0;
        for (; r + 4 <= t->R; r += 4) {
            const float *S0 = t->S + (size_t)r * t->S_cap;
            const size_t cap = (size_t)t->S_cap;
            const float p0 = S0[i], p1 = S0[cap + i], p2 = S0[2 * cap + i], p3 = S0[3 * cap + i];
            const float d0 = S0[half + i], d1 = S0[cap + half + i], d2 = S0[2 * cap + half + i], d3 = S0[3 * cap + half + i];
            if (dk && (d0 != 0.0f || d1 != 0.0f || d2 != 0.0f || d3 != 0.0f)) {
                const float *q0 = t->Q + (size_t)r * DK, *q1 = q0 + DK, *q2 = q1 + DK, *q3 = q2 + DK;
#pragma omp simd
                for (int d = 0; d < DK; d++) dk[d] += d0 * q0[d] + d1 * q1[d] + d2 * q2[d] + d3 * q3[d];
            }
            if (dv && (p0 != 0.0f || p1 != 0.0f || p2 != 0.0f || p3 != 0.0f)) {
                const float *o0 = t->dO + (size_t)r * DV, *o1 = o0 + DV, *o2 = o1 + DV, *o3 = o2 + DV;
#pragma omp simd
                for (int d = 0; d < DV; d++) dv[d] += p0 * o0[d] + p1 * o1[d] + p2 * o2[d] + p3 * o3[d];
            }
        }
        for (; r < t->R; r++) {
            const float *S0 = t->S + (size_t)r * t->S_cap;
            const float p0 = S0[i], d0 = S0[half + i];
            const float *q0 = t->Q + (size_t)r * DK, *o0 = t->dO + (size_t)r * DV;
            if (dk && d0 != 0.0f)
#pragma omp simd
                for (int d = 0; d < DK; d++) dk[d] += d0 * q0[d];
            if (dv && p0 != 0.0f)
#pragma omp simd
                for (int d = 0; d < DV; d++) dv[d] += p0 * o0[d];
        }
    }
}
