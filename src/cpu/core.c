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
        for (int64_t c = a; c < b; c++) {
            const float p = s[c - c0];
            const float *v = V + c * DV;
#pragma omp simd
            for (int d = 0; d < DV; d++) o[d] += p * v[d];
        }
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
    for (int r = 0; r < t->R; r++) {
        if (t->lse[r] == -INFINITY) continue; /* row saw no key: no gradient */
        int64_t a, b;
        row_span(t, r, c0, c1, &a, &b);
        if (a >= b) continue;
        float *s = t->S + (size_t)r * t->S_cap;
        const float *q = t->Q + (size_t)r * DK, *dO = t->dO + (size_t)r * DV;
        scores_row(q, K, DK, a, b, s);
        /* dP[c] = dO . V[c]; reuse scores_row on V with dO as the "query" */
        float *dp = s + (b - a);
        scores_row(dO, V, DV, a, b, dp);
        const float lse = t->lse[r], D = t->Drow[r];
        for (int64_t i = 0; i < b - a; i++) {
            float p = core_exp(s[i] - lse);
            s[i] = p;
            dp[i] = p * (dp[i] - D); /* dS */
        }
        if (t->dQ) {
            float *dq = t->dQ + (size_t)r * DK;
            for (int64_t i = 0; i < b - a; i++) {
                const float ds = dp[i];
                const float *k = K + (a + i) * DK;
#pragma omp simd
                for (int d = 0; d < DK; d++) dq[d] += ds * k[d];
            }
        }
        if (dK)
            for (int64_t i = 0; i < b - a; i++) {
                const float ds = dp[i];
                float *dk = dK + (a - c0 + i) * DK;
#pragma omp simd
                for (int d = 0; d < DK; d++) dk[d] += ds * q[d];
            }
        if (dV)
            for (int64_t i = 0; i < b - a; i++) {
                const float p = s[i];
                float *dv = dV + (a - c0 + i) * DV;
#pragma omp simd
                for (int d = 0; d < DV; d++) dv[d] += p * dO[d];
            }
    }
}
