/* attention/simt.cu -- the attention op with its options on the scalar kernels (prim/simt.cuh):
 * one warp per query row (forward, dQ and dbias) or per key row (dK, dV), fp32 products over
 * the pairs a row sees and no others. Every pair goes through the same function as the tiles'
 * x_pair (window, segments, mask, softcap, bias, in the order of nsa.h) and the same Philox
 * dropout words, so these kernels compute the function of kernels.cuh. They run the calls
 * whose inputs hold a NaN or an infinity (beside the tiles, which stand aside then:
 * prim/nonfinite.cuh), where a masked pair's 0 * NaN inside a tensor-core product would
 * reach a row dense attention keeps finite. Deterministic: a row's sums in one fixed order;
 * a dbias element shared by several batch entries or heads is summed by one warp, in order. */
#include "attention.h"
#include "../prim/simt.cuh"
#include "../../philox.h"

/* The sequence holding packed row t (queries, or keys when key) of batch entry b. */
struct xs_seq {
    int64_t b, q0, k0;
    int qlen, klen;
};
__device__ __forceinline__ xs_seq xs_seq_of(const xparams &P, int64_t b, int64_t t, bool key)
{
    xs_seq q;
    if (!P.cuq) {
        q.b = b, q.q0 = q.k0 = 0, q.qlen = (int)P.Tq, q.klen = (int)P.Tk;
        return q;
    }
    const int64_t *cu = key ? P.cuk : P.cuq;
    int64_t a = 0, z = P.nseq - 1; /* the last s with cu[s] <= t (empty sequences before it do not matter) */
    while (a < z) {
        const int64_t mid = (a + z + 1) / 2;
        if (cu[mid] <= t) a = mid;
        else z = mid - 1;
    }
    q.b = 0, q.q0 = P.cuq[a], q.k0 = P.cuk[a];
    q.qlen = (int)(P.cuq[a + 1] - q.q0), q.klen = (int)(P.cuk[a + 1] - q.k0);
    return q;
}

__device__ __forceinline__ int xs_seg(const pview &v, int64_t b, int64_t row)
{
    return v.p ? ((const int32_t *)v.p)[b * v.s0 + row * v.s1] : 0;
}

/* Keys [*lo, *hi] local query i sees by the window ([1, 0]: none). */
__device__ __forceinline__ void xs_bounds(const xparams &P, const xs_seq &sq, int i, int *lo, int *hi)
{
    const int64_t d = nsa_rule_diag(i, sq.qlen, sq.klen);
    const int64_t a = nsa_rule_window_lo(d, P.wl), z = nsa_rule_window_hi(d, P.wr, P.causal, sq.klen);
    *lo = z < a ? 1 : (int)a;
    *hi = z < a ? 0 : (int)z;
}

/* Score of pair (local i, local j) of (b, hq), natural units, given qk = q . k: cap(scale qk)
 * + bias; -inf and *shown = false when a segment, the mask or a -inf bias hides it (the caller
 * has checked the window). *dc: d score / d (scale qk); *z: the dropout factor. */
__device__ __forceinline__ float xs_pair(const xparams &P, const xs_seq &sq, int64_t b, int64_t hq, int i, int j, float qk,
                                         int qseg, bool *shown, float *dc, float *z)
{
    const int64_t qr = sq.q0 + i, kr = sq.k0 + j;
    *shown = false, *dc = 1.0f, *z = 1.0f;
    if (P.kseg.p && xs_seg(P.kseg, b, kr) != qseg) return -INFINITY;
    float mb = 0.0f;
    if (P.bias.p) mb = ld_any(P.bias.p, P.bias.dt, b * P.bias.s0 + hq * P.bias.s1 + qr * P.bias.s2 + kr * P.bias.s3);
    if (P.mask.p && !((const unsigned char *)P.mask.p)[b * P.mask.s0 + hq * P.mask.s1 + qr * P.mask.s2 + kr * P.mask.s3])
        mb = -INFINITY;
    if (mb == -INFINITY) return -INFINITY;
    *shown = true;
    float s = qk * P.scale;
    if (P.cap > 0.0f) {
        const float t = tanhf(s / P.cap);
        s = P.cap * t;
        *dc = 1.0f - t * t;
    }
    if (P.dropout) {
        uint32_t w[4];
        nsa_dropout_words(P.seed, P.offset, b, P.HQ, hq, qr, 4 * (kr >> 2), w);
        *z = w[kr & 3] >= P.thresh ? P.rp : 0.0f;
    }
    return s + mb;
}

/* Forward: o, lse of rows [B, Tq, HQ]. */
__global__ void __launch_bounds__(32 * SIMT_WARPS) xs_fwd_kernel(const xparams P, const int *only_if)
{
    if (simt_stand_aside(only_if)) return;
    const int lane = threadIdx.x & 31;
    const int64_t rows = P.B * P.Tq * P.HQ;
    for (int64_t w = simt_warp0(); w < rows; w += simt_nwarps()) {
        const int64_t hq = w % P.HQ, t = (w / P.HQ) % P.Tq, b0 = w / (P.HQ * P.Tq), h = hq / P.G;
        const xs_seq sq = xs_seq_of(P, b0, t, false);
        if (t < sq.q0 || t >= sq.q0 + sq.qlen) continue;
        const int64_t b = sq.b;
        const int i = (int)(t - sq.q0), qseg = xs_seg(P.qseg, b, t);
        int lo, hi;
        xs_bounds(P, sq, i, &lo, &hi);
        float q[SIMT_COLS], x[SIMT_COLS], acc[SIMT_COLS];
        simt_load(q, P.q, b * P.q.s0 + t * P.q.s1 + hq * P.q.s2, P.DK, lane);
#pragma unroll
        for (int c = 0; c < SIMT_COLS; c++) acc[c] = 0.0f;
        float m = -INFINITY, l = 0.0f;
        bool seen = false;
        for (int j = lo; j <= hi; j++) {
            const int64_t kr = sq.k0 + j;
            simt_load(x, P.k, b * P.k.s0 + kr * P.k.s1 + h * P.k.s2, P.DK, lane);
            bool shown;
            float dc, z;
            const float s = xs_pair(P, sq, b, hq, i, j, simt_dot(q, x, P.DK, lane), qseg, &shown, &dc, &z);
            if (!shown) continue;
            seen = true;
            if (s > m) {
                const float alpha = m == -INFINITY ? 0.0f : expf(m - s);
                l *= alpha;
#pragma unroll
                for (int c = 0; c < SIMT_COLS; c++) acc[c] *= alpha;
                m = s;
            }
            /* no maximum yet: a -inf score weighs 0, a NaN one stays NaN (dense softmax) */
            const float p = m == -INFINITY ? (s != s ? s : 0.0f) : expf(s - m);
            l += p; /* the undropped sum: lse is the undropped softmax's */
            simt_load(x, P.v, b * P.v.s0 + kr * P.v.s1 + h * P.v.s2, P.DV, lane);
#pragma unroll
            for (int c = 0; c < SIMT_COLS; c++) acc[c] = fmaf(p * z, x[c], acc[c]);
        }
        float lse;
        const float wgt = simt_row_finish(m, l, &seen, P.flex_rows, P.sinks, P.sinks_s, hq, &lse);
        simt_store(P.o, b * P.o.s0 + t * P.o.s1 + hq * P.o.s2, P.DV, acc, seen ? wgt : 0.0f, lane); /* none seen: 0 */
        if (lane == 0) ((float *)P.lse.p)[b * P.lse.s0 + t * P.lse.s1 + hq * P.lse.s2] = lse;
    }
}

/* dQ (and the dbias accumulator) of rows [B, Tq, HQ]; with a broadcast dbias one warp takes
 * every batch entry (loop_b) or head (loop_h) that shares the row's elements, in order. With
 * sinks D = sum_j P z dP~ is computed here first and written to Dw for the dK / dV pass. */
__global__ void __launch_bounds__(32 * SIMT_WARPS) xs_dq_kernel(const xparams P, const int *only_if)
{
    if (simt_stand_aside(only_if)) return;
    const int lane = threadIdx.x & 31;
    const int64_t nb = P.loop_b ? 1 : P.B, nh = P.loop_h ? 1 : P.HQ, items = nb * P.Tq * nh;
    for (int64_t w = simt_warp0(); w < items; w += simt_nwarps()) {
        const int64_t wh = w % nh, t = (w / nh) % P.Tq, wb = w / (nh * P.Tq);
        for (int64_t mb = 0; mb < (P.loop_b ? P.B : 1); mb++)
            for (int64_t mh = 0; mh < (P.loop_h ? P.HQ : 1); mh++) {
                const int64_t b0 = P.loop_b ? mb : wb, hq = P.loop_h ? mh : wh, h = hq / P.G;
                const xs_seq sq = xs_seq_of(P, b0, t, false);
                if (t < sq.q0 || t >= sq.q0 + sq.qlen) continue;
                const int64_t b = sq.b;
                const int i = (int)(t - sq.q0), qseg = xs_seg(P.qseg, b, t);
                int lo, hi;
                xs_bounds(P, sq, i, &lo, &hi);
                float q[SIMT_COLS], dO[SIMT_COLS], x[SIMT_COLS], y[SIMT_COLS], acc[SIMT_COLS];
                simt_load(q, P.q, b * P.q.s0 + t * P.q.s1 + hq * P.q.s2, P.DK, lane);
                simt_load(dO, P.dout, b * P.dout.s0 + t * P.dout.s1 + hq * P.dout.s2, P.DV, lane);
                const float lse = ((const float *)P.lse.p)[b * P.lse.s0 + t * P.lse.s1 + hq * P.lse.s2];
                const int64_t flat = (b * P.Tq + t) * P.HQ + hq;
                if (lse == -INFINITY) hi = lo - 1; /* a row that saw no key (flex_rows: or only -inf scores): no gradient */
                /* P, dP~ of a shown pair (false: hidden) */
                auto pair = [&](int j, float *p, float *dpt, float *dc, float *z) {
                    const int64_t kr = sq.k0 + j;
                    simt_load(x, P.k, b * P.k.s0 + kr * P.k.s1 + h * P.k.s2, P.DK, lane);
                    bool shown;
                    const float s = xs_pair(P, sq, b, hq, i, j, simt_dot(q, x, P.DK, lane), qseg, &shown, dc, z);
                    if (!shown) return false;
                    *p = lse == -INFINITY ? 0.0f : expf(s - lse); /* -inf: the row saw no key */
                    simt_load(y, P.v, b * P.v.s0 + kr * P.v.s1 + h * P.v.s2, P.DV, lane);
                    *dpt = simt_dot(dO, y, P.DV, lane);
                    return true;
                };
                float D;
                if (P.sinks) {
                    D = 0.0f;
                    for (int j = lo; j <= hi; j++) {
                        float p, dpt, dc, z;
                        if (pair(j, &p, &dpt, &dc, &z)) D += p * z * dpt;
                    }
                    if (lane == 0) P.Dw[flat] = D;
                } else {
                    D = P.Dw[flat];
                }
                float *db = P.dbias ? P.dbias + ((P.dbB == 1 ? 0 : b) * P.dbH + (P.dbH == 1 ? 0 : hq)) * P.Tq * P.Tk : nullptr;
#pragma unroll
                for (int c = 0; c < SIMT_COLS; c++) acc[c] = 0.0f;
                for (int j = lo; j <= hi; j++) {
                    float p, dpt, dc, z;
                    if (!pair(j, &p, &dpt, &dc, &z)) continue;
                    const float ds = p * (z * dpt - D);
                    if (db && lane == 0) db[t * P.Tk + sq.k0 + j] += ds;
                    const float g = ds * dc;
#pragma unroll
                    for (int c = 0; c < SIMT_COLS; c++) acc[c] = fmaf(g, x[c], acc[c]);
                }
                simt_store(P.dq, b * P.dq.s0 + t * P.dq.s1 + hq * P.dq.s2, P.DK, acc, P.scale, lane);
            }
    }
}

/* dK, dV (P.which) of key rows [B, Tk, H]: the G heads' queries that may see the key, in order. */
__global__ void __launch_bounds__(32 * SIMT_WARPS) xs_dkv_kernel(const xparams P, const int *only_if)
{
    if (simt_stand_aside(only_if)) return;
    const int lane = threadIdx.x & 31;
    const int64_t items = P.B * P.Tk * P.H;
    for (int64_t w = simt_warp0(); w < items; w += simt_nwarps()) {
        const int64_t h = w % P.H, kr = (w / P.H) % P.Tk, b0 = w / (P.H * P.Tk);
        const xs_seq sq = xs_seq_of(P, b0, kr, true);
        if (kr < sq.k0 || kr >= sq.k0 + sq.klen) continue;
        const int64_t b = sq.b;
        const int j = (int)(kr - sq.k0);
        float kx[SIMT_COLS], vx[SIMT_COLS], x[SIMT_COLS], y[SIMT_COLS], dK[SIMT_COLS], dV[SIMT_COLS];
        simt_load(kx, P.k, b * P.k.s0 + kr * P.k.s1 + h * P.k.s2, P.DK, lane);
        simt_load(vx, P.v, b * P.v.s0 + kr * P.v.s1 + h * P.v.s2, P.DV, lane);
#pragma unroll
        for (int c = 0; c < SIMT_COLS; c++) dK[c] = dV[c] = 0.0f;
        const int64_t q0 = nsa_rule_window_q_first(j, P.wr, P.causal, sq.qlen, sq.klen);
        const int64_t q1 = nsa_rule_window_q_last(j, P.wl, sq.qlen, sq.klen);
        for (int64_t g = 0; g < P.G; g++) {
            const int64_t hq = h * P.G + g;
            for (int64_t i = q0 < 0 ? 0 : q0; i <= q1 && i < sq.qlen; i++) {
                int lo, hi;
                xs_bounds(P, sq, (int)i, &lo, &hi);
                if (j < lo || j > hi) continue;
                const int64_t t = sq.q0 + i;
                simt_load(x, P.q, b * P.q.s0 + t * P.q.s1 + hq * P.q.s2, P.DK, lane);
                bool shown;
                float dc, z;
                const float s = xs_pair(P, sq, b, hq, (int)i, j, simt_dot(x, kx, P.DK, lane), xs_seg(P.qseg, b, t), &shown,
                                        &dc, &z);
                if (!shown) continue;
                const float lse = ((const float *)P.lse.p)[b * P.lse.s0 + t * P.lse.s1 + hq * P.lse.s2];
                if (lse == -INFINITY) continue; /* a row that saw no key (flex_rows: or only -inf scores): no gradient */
                const float p = expf(s - lse);
                simt_load(y, P.dout, b * P.dout.s0 + t * P.dout.s1 + hq * P.dout.s2, P.DV, lane);
                const float ds = p * (z * simt_dot(y, vx, P.DV, lane) - P.Dw[(b * P.Tq + t) * P.HQ + hq]) * dc, pz = p * z;
#pragma unroll
                for (int c = 0; c < SIMT_COLS; c++) {
                    dK[c] = fmaf(ds, x[c], dK[c]);
                    dV[c] = fmaf(pz, y[c], dV[c]);
                }
            }
        }
        if (P.which & XW_DK) simt_store(P.dk, b * P.dk.s0 + kr * P.dk.s1 + h * P.dk.s2, P.DK, dK, P.scale, lane);
        if (P.which & XW_DV) simt_store(P.dv, b * P.dv.s0 + kr * P.dv.s1 + h * P.dv.s2, P.DV, dV, 1.0f, lane);
    }
}

void nsa_cu_xattn_simt(grun *g, const xparams *P, int kind, const int *only_if)
{
    if (!g_live(g)) return;
    const int64_t items = kind == XK_FWD ? P->B * P->Tq * P->HQ
                          : kind == XK_DQ ? (P->loop_b ? 1 : P->B) * P->Tq * (P->loop_h ? 1 : P->HQ)
                                          : P->B * P->Tk * P->H;
    if (items == 0) return;
    const unsigned grid = simt_grid(items);
    if (kind == XK_FWD) xs_fwd_kernel<<<grid, 32 * SIMT_WARPS, 0, g->st>>>(*P, only_if);
    else if (kind == XK_DQ) xs_dq_kernel<<<grid, 32 * SIMT_WARPS, 0, g->st>>>(*P, only_if);
    else xs_dkv_kernel<<<grid, 32 * SIMT_WARPS, 0, g->st>>>(*P, only_if);
    g_launched(g);
}
