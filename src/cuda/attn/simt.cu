/* attn/simt.cu -- the scalar attention kernels of the range and selected rules: one warp per
 * query row (forward, dQ) or per key row (dK / dV), fp32 arithmetic over the pairs the rule
 * shows and no others, any storage dtype (f32, bf16, f16) read element by element. They take
 * the tiles' parameter blocks (tiles.h) and write what the tiles' whole pipeline writes: o and
 * lse; dq added into the fp32 buffer (or stored into dqo); dk / dv added into the fp32
 * buffers. They are the float32 path of these rules (IEEE fp32 products, no tensor cores),
 * which the tiles cannot take, and the path of calls whose inputs hold a NaN or an infinity
 * (launched beside the tiles, which stand aside then: prim/nonfinite.cuh): a pair a row does
 * not see is never multiplied, so a non-finite value reaches exactly the rows dense attention
 * would send it to.
 *
 * Each warp walks work items (rows or keys) gridDim.x * warps apart; a row's sums run in one
 * fixed order (lanes own columns lane, lane + 32, ...; a warp's partial dot products meet by
 * one butterfly), so results are deterministic. The dK / dV of a key add its queries in
 * ascending order: the range rules' queries form an interval (a row's first and last visible
 * keys never decrease with its position), found by binary search; the selected rule's are
 * the inverted lists (selected/lists.cu). */
#include "tiles.h"
#include "../prim/simt.cuh"
#include "../prim/rowwise.cuh"
#include <limits.h>

/* Forward (o, lse) or dQ of query rows [B, T, HQ], one warp per row. */
__global__ void __launch_bounds__(32 * SIMT_WARPS) simt_q_kernel(const qparams P, int mode, int64_t B, const int *only_if)
{
    if (simt_stand_aside(only_if)) return;
    const int lane = threadIdx.x & 31;
    const int64_t nwarps = simt_nwarps(), rows = B * P.T * P.HQ;
    const bool slc = P.rule.kind == RULE_SLC, has_v = mode == MODE_DQ || P.o.p != nullptr;
    for (int64_t w = simt_warp0(); w < rows; w += nwarps) {
        const int64_t hq = w % P.HQ, t = (w / P.HQ) % P.T, b = w / (P.HQ * P.T);
        const seqinfo sq = seq_get(P.sm, seq_of_row(P.sm, b, t));
        if (t < sq.row0 || t >= sq.row0 + sq.len) continue; /* a packed batch's padding row */
        const int pos = (int)(t - sq.row0);
        const int64_t h = hq / P.G;
        const int nkeys = rule_nkeys(P.rule, sq);
        const int64_t kr0 = P.rule.kind == RULE_CMP ? sq.cmp0 : sq.row0;
        int lo, hi;
        rule_bounds(P.rule, pos, nkeys, &lo, &hi);
        const int32_t *U = nullptr;
        int ucnt = 0;
        if (slc) {
            const int64_t id = (b * P.T + t) * P.H + h;
            U = P.U + id * P.m;
            ucnt = P.ucnt[id];
        }
        const int64_t kb = b * P.k.s0 + h * P.k.s2, vb = b * P.v.s0 + h * P.v.s2;
        float q[SIMT_COLS], x[SIMT_COLS], acc[SIMT_COLS];
        simt_load(q, P.q, b * P.q.s0 + t * P.q.s1 + hq * P.q.s2, P.DK, lane);
#pragma unroll
        for (int i = 0; i < SIMT_COLS; i++) acc[i] = 0.0f;
        /* the visible keys in ascending order: [lo, hi], or the selected blocks' part of it */
        auto walk = [&](auto &&fn) {
            if (!slc) {
                for (int j = lo; j <= hi; j++) fn(j);
                return;
            }
            for (int e = 0; e < ucnt; e++) {
                const int a = max(lo, U[e] * P.rule.lp), z = min(hi, U[e] * P.rule.lp + P.rule.lp - 1);
                for (int j = a; j <= z; j++) fn(j);
            }
        };
        if (mode == MODE_FWD) {
            float m = -INFINITY, l = 0.0f;
            bool seen = false;
            walk([&](int j) {
                simt_load(x, P.k, kb + (kr0 + j) * P.k.s1, P.DK, lane);
                float s = simt_dot(q, x, P.DK, lane) * P.scale;
                if (P.rule.cap > 0.0f) s = P.rule.cap * tanhf(s / P.rule.cap);
                seen = true;
                if (s > m) { /* a new maximum (a NaN score never is one: it reaches l and acc below) */
                    const float alpha = m == -INFINITY ? 0.0f : expf(m - s);
                    l *= alpha;
#pragma unroll
                    for (int i = 0; i < SIMT_COLS; i++) acc[i] *= alpha;
                    m = s;
                }
                /* no maximum yet: a -inf score weighs 0, a NaN one stays NaN (dense softmax) */
                const float p = m == -INFINITY ? (s != s ? s : 0.0f) : expf(s - m);
                l += p;
                if (has_v) {
                    simt_load(x, P.v, vb + (kr0 + j) * P.v.s1, P.DV, lane);
#pragma unroll
                    for (int i = 0; i < SIMT_COLS; i++) acc[i] = fmaf(p, x[i], acc[i]);
                }
            });
            float lse; /* as the tiles' row finish (softmax.cuh), in the natural-log domain */
            const float wgt = simt_row_finish(m, l, &seen, P.rule.flex_rows, P.rule.sinks, P.rule.sinks_s, hq, &lse);
            if (P.o.p) {
                const int64_t ob = b * P.o.s0 + t * P.o.s1 + hq * P.o.s2;
#pragma unroll
                for (int i = 0; i < SIMT_COLS; i++) {
                    const int d = lane + 32 * i;
                    if (d < P.DV) st_any(P.o.p, P.o.dt, ob + d, seen ? acc[i] * wgt : 0.0f);
                }
            }
            if (lane == 0 && P.lse.p) ((float *)P.lse.p)[b * P.lse.s0 + t * P.lse.s1 + hq * P.lse.s2] = lse;
        } else {
            const int64_t flat = (b * P.T + t) * P.HQ + hq;
            const float lse = ((const float *)P.lse.p)[b * P.lse.s0 + t * P.lse.s1 + hq * P.lse.s2];
            const float D = P.Dw[flat], g = P.gw ? P.gw[flat] : 1.0f;
            float dO[SIMT_COLS];
            simt_load(dO, P.dout, b * P.dout.s0 + t * P.dout.s1 + hq * P.dout.s2, P.DV, lane);
            if (lse == -INFINITY) lo = 0, hi = -1, ucnt = 0; /* a row that saw no key (flex_rows: or only -inf scores): dq = 0 */
            walk([&](int j) {
                simt_load(x, P.k, kb + (kr0 + j) * P.k.s1, P.DK, lane);
                float s = simt_dot(q, x, P.DK, lane) * P.scale, f = 1.0f;
                if (P.rule.cap > 0.0f) { /* the softcap and its factor on dS: 1 - tanh^2 */
                    const float th = tanhf(s / P.rule.cap);
                    s = P.rule.cap * th, f = 1.0f - th * th;
                }
                const float p = lse == -INFINITY ? 0.0f : expf(s - lse); /* -inf: the row saw no key */
                float y[SIMT_COLS];
                simt_load(y, P.v, vb + (kr0 + j) * P.v.s1, P.DV, lane);
                const float ds = p * (g * simt_dot(dO, y, P.DV, lane) - D) * f;
#pragma unroll
                for (int i = 0; i < SIMT_COLS; i++) acc[i] = fmaf(ds, x[i], acc[i]);
            });
#pragma unroll
            for (int i = 0; i < SIMT_COLS; i++) {
                const int d = lane + 32 * i;
                if (d >= P.DK) continue;
                if (P.dqo.p) st_any(P.dqo.p, P.dqo.dt, b * P.dqo.s0 + t * P.dqo.s1 + hq * P.dqo.s2 + d, acc[i] * P.scale);
                else P.dq[flat * P.DK + d] += acc[i] * P.scale;
            }
        }
    }
}

/* The first position t in [0, n) with hi(t) >= j and the last with lo(t) <= j (both bounds
 * never decrease with t): the rows that see key j are [*t0, *t1]. */
__device__ __forceinline__ void simt_rows_of_key(const rule_t &r, int j, int n, int nkeys, int *t0, int *t1)
{
    int a = 0, z = n; /* first t with hi(t) >= j */
    while (a < z) {
        const int mid = a + (z - a) / 2;
        int lo, hi;
        rule_bounds(r, mid, nkeys, &lo, &hi);
        if (hi >= j) z = mid;
        else a = mid + 1;
    }
    *t0 = a;
    a = -1, z = n - 1; /* last t with lo(t) <= j */
    while (a < z) {
        const int mid = z - (z - a) / 2;
        int lo, hi;
        rule_bounds(r, mid, nkeys, &lo, &hi);
        if (lo <= j) a = mid;
        else z = mid - 1;
    }
    *t1 = a;
}

/* One key row's dK, dV sums (this lane's columns): added into the fp32 buffers, or, with dko /
 * dvo set, stored as the row's whole gradient. */
static __device__ void simt_k_store(const kparams &P, int64_t b, int64_t kr, int64_t h, const float *dK, const float *dV,
                                    int lane)
{
    const int64_t ob = (b * P.KR + kr) * P.H + h;
#pragma unroll
    for (int i = 0; i < SIMT_COLS; i++) {
        const int d = lane + 32 * i;
        if (P.dko.p) {
            if (d < P.DK) st_any(P.dko.p, P.dko.dt, b * P.dko.s0 + kr * P.dko.s1 + h * P.dko.s2 + d, dK[i] * P.scale);
            if (d < P.DV) st_any(P.dvo.p, P.dvo.dt, b * P.dvo.s0 + kr * P.dvo.s1 + h * P.dvo.s2 + d, dV[i]);
            continue;
        }
        if (d < P.DK) P.dk[ob * P.DK + d] += dK[i] * P.scale;
        if (d < P.DV) P.dv[ob * P.DV + d] += dV[i];
    }
}

/* dK, dV of key rows [B, KR, H], one warp per key row. */
__global__ void __launch_bounds__(32 * SIMT_WARPS) simt_k_kernel(const kparams P, int64_t B, const int *only_if)
{
    if (simt_stand_aside(only_if)) return;
    const int lane = threadIdx.x & 31;
    const int64_t nwarps = simt_nwarps(), items = B * P.KR * P.H;
    const bool cmp = P.rule.kind == RULE_CMP, slc = P.rule.kind == RULE_SLC;
    for (int64_t w = simt_warp0(); w < items; w += nwarps) {
        const int64_t h = w % P.H, kr = (w / P.H) % P.KR, b = w / (P.H * P.KR);
        int64_t s = b;
        if (cmp && P.sm.cu) { /* the sequence whose compressed rows hold kr */
            int64_t a = 0, z = P.sm.nseq - 1;
            while (a < z) {
                const int64_t mid = (a + z + 1) / 2;
                if (P.sm.cmp0[mid] <= kr) a = mid;
                else z = mid - 1;
            }
            s = a;
        } else if (!cmp) {
            s = seq_of_row(P.sm, b, kr);
        }
        const seqinfo sq = seq_get(P.sm, s);
        const int nkeys = rule_nkeys(P.rule, sq);
        const int64_t j64 = kr - (cmp ? sq.cmp0 : sq.row0);
        float dK[SIMT_COLS], dV[SIMT_COLS];
#pragma unroll
        for (int i = 0; i < SIMT_COLS; i++) dK[i] = dV[i] = 0.0f;
        if (j64 < 0 || j64 >= nkeys) { /* no rule's key: nothing to add, zeros to store */
            if (P.dko.p) simt_k_store(P, b, kr, h, dK, dV, lane);
            continue;
        }
        const int j = (int)j64;
        float kx[SIMT_COLS], vx[SIMT_COLS], x[SIMT_COLS], y[SIMT_COLS];
        simt_load(kx, P.k, b * P.k.s0 + kr * P.k.s1 + h * P.k.s2, P.DK, lane);
        simt_load(vx, P.v, b * P.v.s0 + kr * P.v.s1 + h * P.v.s2, P.DV, lane);
        auto query = [&](int pos) { /* the G heads of position pos, in order */
            const int64_t t = sq.row0 + pos;
            for (int64_t g = 0; g < P.G; g++) {
                const int64_t hq = h * P.G + g, flat = (b * P.T + t) * P.HQ + hq;
                const float lse = ((const float *)P.lse.p)[b * P.lse.s0 + t * P.lse.s1 + hq * P.lse.s2];
                if (lse == -INFINITY) continue; /* a row that saw no key (or, flex_rows, only -inf scores): no gradient */
                const float D = P.Dw[flat], gt = P.gw ? P.gw[flat] : 1.0f;
                simt_load(x, P.q, b * P.q.s0 + t * P.q.s1 + hq * P.q.s2, P.DK, lane);
                simt_load(y, P.dout, b * P.dout.s0 + t * P.dout.s1 + hq * P.dout.s2, P.DV, lane);
                float sc = simt_dot(x, kx, P.DK, lane) * P.scale, f = 1.0f;
                if (P.rule.cap > 0.0f) { /* as the dq kernel */
                    const float th = tanhf(sc / P.rule.cap);
                    sc = P.rule.cap * th, f = 1.0f - th * th;
                }
                const float p = lse == -INFINITY ? 0.0f : expf(sc - lse);
                const float ds = p * (gt * simt_dot(y, vx, P.DV, lane) - D) * f, gp = gt * p;
#pragma unroll
                for (int i = 0; i < SIMT_COLS; i++) {
                    dK[i] = fmaf(ds, x[i], dK[i]);
                    dV[i] = fmaf(gp, y[i], dV[i]);
                }
            }
        };
        if (slc) { /* the queries that selected j's block, ascending; those before j do not see it */
            unitspec ul = {UK_LIST, P.m, 1, 0, 0}, uo = {UK_INV_OFFS, 0, P.rule.lp, 0, 0};
            const int64_t lreg = (P.list_pref ? P.list_pref[s] : s * seq_units(ul, sq.len, sq.klen)) * P.H + h * seq_units(ul, sq.len, sq.klen);
            const int64_t oreg = (P.offs_pref ? P.offs_pref[s] : s * seq_units(uo, sq.len, sq.klen)) * P.H + h * seq_units(uo, sq.len, sq.klen);
            const int32_t *offs = P.offs + oreg, *list = P.list + lreg;
            const int blk = j / P.rule.lp;
            for (int e = offs[blk]; e < offs[blk + 1]; e++)
                if (list[e] + P.rule.shift >= j) query(list[e]);
        } else {
            int t0, t1;
            simt_rows_of_key(P.rule, j, sq.len, nkeys, &t0, &t1);
            for (int pos = t0; pos <= t1; pos++) query(pos);
        }
        simt_k_store(P, b, kr, h, dK, dV, lane);
    }
}

void nsa_cu_simt_q(grun *g, const qparams *P, int mode, int64_t B, const int *only_if)
{
    const int64_t rows = B * P->T * P->HQ;
    if (!g_live(g) || rows == 0) return;
    simt_q_kernel<<<simt_grid(rows), 32 * SIMT_WARPS, 0, g->st>>>(*P, mode, B, only_if);
    g_launched(g);
}

void nsa_cu_simt_k(grun *g, const kparams *P, int64_t B, const int *only_if)
{
    const int64_t items = B * P->KR * P->H;
    if (!g_live(g) || items == 0) return;
    simt_k_kernel<<<simt_grid(items), 32 * SIMT_WARPS, 0, g->st>>>(*P, B, only_if);
    g_launched(g);
}
