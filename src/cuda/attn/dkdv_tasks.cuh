/* attn/dkdv_tasks.cuh -- the tasks of the dK / dV tiles (ktile, kwg, kwp): a task owns a run
 * of keys of one (sequence, kv head) and visits every query row that sees them (a contiguous
 * range, or the inverted selection list), so dK / dV need no atomics and are bitwise
 * deterministic; long row runs are cut into segments whose partials are reduced in order.
 * Also the per-row slots (offsets, lse, D, gate, visible range) the tiles stream. */
#ifndef NSA_CUDA_ATTN_DKDV_TASKS_CUH
#define NSA_CUDA_ATTN_DKDV_TASKS_CUH

#include "tiles.h"
#include "../prim/softmax.cuh"
#include <limits.h>

#if defined(__CUDACC__)

#define QT_BN 64 /* keys per ktile task, keys per select_kernel step */

/* First query row (of len, row t at position t + r.shift) whose range reaches key c < nkeys,
 * and last whose range starts at or before key c, of a range rule (src/rules.h) */
static __device__ int kt_first_reaching(const rule_t &r, int len, int nkeys, int c)
{
    if (r.kind == RULE_CMP) { /* block c is seen from its last token on */
        const int64_t t = nsa_rule_cmp_last_token(c, r.cl, r.cd) - r.shift;
        return (int)(t < 0 ? 0 : t < len ? t : len);
    }
    return (int)nsa_rule_window_q_first(c, r.wr, r.causal, len, (int64_t)len + r.shift);
}

static __device__ int kt_last_starting(const rule_t &r, int len, int nkeys, int c)
{
    (void)nkeys;
    if (r.kind == RULE_CMP) return len - 1; /* every range starts at key 0 */
    return (int)nsa_rule_window_q_last(c, r.wl, len, (int64_t)len + r.shift);
}

/* Where element (key, col) of a bk-key partial lies (col < DK + DV): the keys' dK rows of DK
 * floats first, then their dV rows. */
__host__ __device__ __forceinline__ int64_t kt_part_off(int64_t bk, int64_t DK, int64_t DV, int64_t key, int64_t col)
{
    return col < DK ? key * DK + col : bk * DK + key * DV + (col - DK);
}

/* One reduction CTA's slice (blockIdx.z of gridDim.z) of a key tile's partials: for every
 * element of keys [0, nk) of the tile, dk / dv (row drow0 + key, kv head h) += its `count`
 * partials at first, first + step, ..., added in that order (four loads in flight), so the
 * bits depend neither on the slicing nor on the loads' order. */
__device__ __forceinline__ void kt_partials_add(const kparams &P, const float *first, int64_t step, int64_t count,
                                                int64_t bk, int64_t nk, int64_t drow0, int64_t h)
{
    const int64_t W = P.DK + P.DV, n = nk * W, per = (n + gridDim.z - 1) / gridDim.z;
    const int64_t i0 = blockIdx.z * per, i1 = i0 + per < n ? i0 + per : n;
    for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        const int64_t key = i / W, col = i % W;
        const float *src = first + kt_part_off(bk, P.DK, P.DV, key, col);
        float sum = 0.0f;
        int64_t e = 0;
        for (; e + 4 <= count; e += 4, src += 4 * step) {
            const float a = src[0], b = src[step], c = src[2 * step], d = src[3 * step];
            sum += a, sum += b, sum += c, sum += d;
        }
        for (; e < count; e++, src += step) sum += src[0];
        const int64_t row = (drow0 + key) * P.H + h;
        if (col < P.DK) P.dk[row * P.DK + col] += sum;
        else P.dv[row * P.DV + (col - P.DK)] += sum;
    }
}

/* One ktile task (the CTA's blockIdx): keys [k0, k1) of (sequence, head h) and the query
 * rows that see them: flattened rows rbase .. rbase + nrows - 1 (range rules) or the inverted
 * list's positions (selected); slot >= 0: a further segment writing partial `slot`.
 * Shared by ktile_kernel and the sm_90a kwg_kernel. */
typedef struct kt_task {
    seqinfo sq;
    int64_t slot, nrows, rbase, key_row0;
    const int32_t *list;
    int h, k0, k1, nkeys, is_slc;
} kt_task;

/* @return 0 when the CTA has nothing to add (a partial slot it owns is zeroed first). */
template <int BK, int BQ>
__device__ __forceinline__ int kt_task_get(const kparams &P, kt_task *t, int tid, int nthr)
{
    int64_t s, local, seg = 0, slot = -1;
    int h;
    if (P.extra) {
        /* a further segment: find its flat offs entry f (xoff[f] <= e < xoff[f + 1]), then
         * the sequence, head and block that own f */
        const int64_t e = blockIdx.x / P.nsub, sub = blockIdx.x % P.nsub;
        if (e >= P.xoff[P.nflat]) return 0;
        int64_t lo = 0, hi = P.nflat - 1;
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (P.xoff[mid] <= e) lo = mid;
            else hi = mid - 1;
        }
        const int64_t f = lo, lp = P.rule.lp;
        seg = e - P.xoff[f] + 1;
        slot = e * P.nsub + sub;
        const int64_t per_T = nsa_rule_num_slc(P.sm.Tk, lp) + 1; /* dense: every sequence's */
        if (P.offs_pref) {
            int64_t a = 0, b = P.sm.nseq - 1;
            while (a < b) {
                const int64_t mid = (a + b + 1) / 2;
                if (P.offs_pref[mid] * P.H <= f) a = mid;
                else b = mid - 1;
            }
            s = a;
        } else {
            s = f / (P.H * per_T);
        }
        const seqinfo q0 = seq_get(P.sm, s);
        const int64_t nb1 = nsa_rule_num_slc(q0.klen, lp) + 1;
        const int64_t r = f - (P.offs_pref ? P.offs_pref[s] : s * per_T) * P.H;
        h = (int)(r / nb1);
        local = (r % nb1) * P.nsub + sub;
    } else {
        seq_decode(P.sm, blockIdx.x, &s, &local);
        h = blockIdx.y;
    }
    const seqinfo sq = seq_get(P.sm, s);
    const int64_t G = P.G;
    const int is_cmp = P.rule.kind == RULE_CMP, is_slc = P.rule.kind == RULE_SLC;
    const int nkeys = rule_nkeys(P.rule, sq);
    const int64_t key_row0 = is_cmp ? sq.cmp0 : sq.row0;

    int k0, k1;
    int64_t nrows = 0, rbase = 0; /* range rows: flattened rows rbase .. rbase + nrows - 1 */
    const int32_t *list = nullptr;
    if (!is_slc) {
        int64_t kt = local, sg = 0;
        /* segment-major: the CTAs running together are the key tiles of one row segment,
         * so they stream the same Q / dO rows through L2 (tile-major, each CTA read its own
         * rows from DRAM: ~40% L2 hits at 64k) */
        if (P.nseg > 1) {
            const int64_t ntl = (nkeys + BK - 1) / BK;
            kt = local % ntl, sg = local / ntl;
        }
        k0 = (int)kt * BK;
        k1 = k0 + BK < nkeys ? k0 + BK : nkeys;
        if (k0 >= k1) return 0;
        const int qfirst = kt_first_reaching(P.rule, sq.len, nkeys, k0);
        const int qlast = kt_last_starting(P.rule, sq.len, nkeys, k1 - 1);
        nrows = qlast >= qfirst ? (int64_t)(qlast - qfirst + 1) * G : 0;
        rbase = (int64_t)qfirst * G;
        if (P.nseg > 1) { /* the tile's rows inside absolute segment sg of the sequence's rows */
            static_assert(BQ == 64, "cu_seg_rows cuts segments of whole 64-row chunks");
            const int64_t all = (int64_t)sq.len * G, sz = cu_seg_rows(all, P.nseg);
            const int64_t a0 = sg * sz, a1 = a0 + sz < all ? a0 + sz : all;
            const int64_t lo = rbase > a0 ? rbase : a0, hi = rbase + nrows < a1 ? rbase + nrows : a1;
            rbase = lo;
            nrows = hi > lo ? hi - lo : 0;
            if (sg > 0) slot = (int64_t)blockIdx.x * P.H + h;
        }
    } else {
        const int lp = P.rule.lp, j = (int)(local / P.nsub), sub = (int)(local % P.nsub);
        const int bend = nsa_rule_slc_end32(j, lp, sq.klen);
        k0 = (int)nsa_rule_slc_lo(j, lp) + sub * BK;
        k1 = k0 + BK < bend ? k0 + BK : bend;
        if (k0 >= k1) return 0;
        unitspec ul = {UK_LIST, P.m, 1, 0, 0}, uo = {UK_INV_OFFS, 0, lp, 0, 0};
        const int64_t lreg = (P.list_pref ? P.list_pref[s] : s * seq_units(ul, sq.len, sq.klen)) * P.H + h * seq_units(ul, sq.len, sq.klen);
        const int64_t oreg = (P.offs_pref ? P.offs_pref[s] : s * seq_units(uo, sq.len, sq.klen)) * P.H + h * seq_units(uo, sq.len, sq.klen);
        const int32_t *offs = P.offs + oreg;
        int64_t cnt = offs[j + 1] - offs[j], first = 0;
        if (P.segp > 0) {
            first = seg * P.segp;
            cnt = cnt - first < P.segp ? cnt - first : P.segp;
        }
        list = P.list + lreg + offs[j] + first;
        nrows = cnt > 0 ? cnt * G : 0;
    }
    if (nrows == 0) { /* no query sees these keys here: nothing to add, but a partial slot is read
                       * (zeros) and a direct store owes the keys their zeros */
        if (P.dko.p || slot >= 0)
            for (int64_t i = tid; i < (int64_t)(k1 - k0) * (P.DK + P.DV); i += nthr) {
                const int64_t key = i / (P.DK + P.DV), col = i % (P.DK + P.DV);
                if (P.dko.p) {
                    const dview &o = col < P.DK ? P.dko : P.dvo;
                    st_any(o.p, o.dt, sq.b * o.s0 + (key_row0 + k0 + key) * o.s1 + (int64_t)h * o.s2 + (col < P.DK ? col : col - P.DK), 0.0f);
                }
                if (slot >= 0)
                    P.part[slot * BK * (P.DK + P.DV) + kt_part_off(BK, P.DK, P.DV, key, col)] = 0.0f;
            }
        return 0;
    }

    t->sq = sq, t->slot = slot, t->nrows = nrows, t->rbase = rbase, t->key_row0 = key_row0;
    t->list = list, t->h = h, t->k0 = k0, t->k1 = k1, t->nkeys = nkeys, t->is_slc = is_slc;
    return 1;
}

/* Per-row slots of the query chunks a ktile task streams: offsets of the q / dout rows (not
 * for a tile fed by TMA: kt_fill<BQ, false>, rq / ro NULL), lse (raw: see kt_l2), D, gate,
 * visible range, and per warp half whether every row sees all keys. */
typedef struct kt_rows {
    int64_t *rq, *ro;
    float *rl2, *rD, *rg;
    int *rlo, *rhi, *rfull;
} kt_rows;

/* Row slot `stage` for chunk `chunk` of the task's rows (threads tid < BQ, one row each):
 * q / dO offsets and visible key range computed here; the row's lse, D and gate copied by
 * cp.async into the slot, so the filling warps do not wait on three global loads per chunk
 * (the slot is read two chunks later, after a cp.async wait and a barrier). The slot holds
 * the raw lse: kt_l2 turns it into the log2-domain offset at use. pos_given >= 0: the row's
 * position, looked up ahead by the caller (a producer warp prefetching list entries). */
template <int BQ, bool OFFS = true>
__device__ __forceinline__ void kt_fill_at(const kparams &P, const kt_task &t, const kt_rows &R, int stage, int64_t chunk,
                                           int tid, int pos_given)
{
    if (tid >= BQ) return;
    const int64_t G = P.G, k = chunk * BQ + tid;
    const int i = stage * BQ + tid;
    const seqinfo &sq = t.sq;
    if (k < t.nrows) {
        /* (position, head) of the row: 32-bit divisions whenever they fit */
        const int64_t rk = t.is_slc ? k : t.rbase + k;
        int64_t q, g;
        if (rk <= INT_MAX && G <= INT_MAX) {
            const unsigned u = (unsigned)rk / (unsigned)G;
            q = u, g = rk - (int64_t)u * G;
        } else {
            q = rk / G, g = rk % G;
        }
        const int pos = pos_given >= 0 ? pos_given : t.is_slc ? t.list[q] : (int)q;
        const int64_t hq = t.h * G + g, row = sq.row0 + pos;
        const int64_t flat = (sq.b * P.T + row) * P.HQ + hq;
        if (OFFS) {
            R.rq[i] = sq.b * P.q.s0 + row * P.q.s1 + hq * P.q.s2;
            R.ro[i] = sq.b * P.dout.s0 + row * P.dout.s1 + hq * P.dout.s2;
        }
        cp4(R.rl2 + i, (const float *)P.lse.p + sq.b * P.lse.s0 + row * P.lse.s1 + hq * P.lse.s2);
        cp4(R.rD + i, P.Dw + flat);
        if (P.gw) cp4(R.rg + i, P.gw + flat);
        else R.rg[i] = 1.0f;
        rule_bounds(P.rule, pos, t.nkeys, &R.rlo[i], &R.rhi[i]);
    } else {
        if (OFFS) R.rq[i] = -1, R.ro[i] = -1;
        R.rl2[i] = INFINITY, R.rD[i] = 0.0f, R.rg[i] = 0.0f;
        R.rlo[i] = 1, R.rhi[i] = 0;
    }
    const int f = __all_sync(0xffffffffu, R.rlo[i] <= t.k0 && R.rhi[i] >= t.k1 - 1);
    if ((tid & 31) == 0) R.rfull[stage * 2 + (tid >> 5)] = f;
}

/* ... the row's position looked up here (selected rule: its list entry, a dependent load) */
template <int BQ, bool OFFS = true>
__device__ __forceinline__ void kt_fill(const kparams &P, const kt_task &t, const kt_rows &R, int stage, int64_t chunk,
                                        int tid)
{
    kt_fill_at<BQ, OFFS>(P, t, R, stage, chunk, tid, -1);
}

/* The log2-domain softmax offset of a slot's raw lse: p = 2^(s sl2 - l2) (a row that sees no
 * key, lse -inf, gets +inf: p = 0; rows past the task end were filled with +inf). */
__device__ __forceinline__ float kt_l2(float lse) { return lse == -INFINITY ? INFINITY : __fmul_rn(lse, NSA_LOG2E); }

/* The element steps of the dK / dV tiles with a softcap, on S^T and dP^T in the accumulator
 * layout (key rows kr, query columns n): P^T from the raw products (sc_cap_prob), masked to the
 * rows' visible keys unless the chunk is WHOLE; dS^T = P^T (g dP^T - D) times the cap's factor;
 * g P^T for dV. kt_cap_prob_ds does all three in place (S becomes g P^T, dP dS^T); a tile that
 * multiplies dV while dP is still on the tensor cores takes kt_cap_prob first (S becomes P^T)
 * and kt_cap_ds later (dP becomes dS^T, the factor read back from P). The tiles' steps without
 * a cap stay written out in each kernel: through shared helpers ptxas spilled them. */
template <bool WHOLE, int NT>
__device__ __forceinline__ void kt_cap_prob(float (&S)[NT][4], const sc_capbw &c, const float *l2, const int *lo, const int *hi,
                                            const int kr[2], int k1, int lane)
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int n = nt * 8 + 2 * (lane & 3) + (e & 1), key = kr[e >> 1];
            float f;
            if (WHOLE) {
                S[nt][e] = sc_cap_prob(S[nt][e], kt_l2(l2[n]), c, &f);
            } else {
                const int vis = key < k1 && key >= lo[n] && key <= hi[n];
                S[nt][e] = vis ? sc_cap_prob(S[nt][e], kt_l2(l2[n]), c, &f) : 0.0f;
            }
        }
}

template <int NT>
__device__ __forceinline__ void kt_cap_ds(float (&dP)[NT][4], const float (&S)[NT][4], const sc_capbw &c, const float *l2,
                                          const float *gr, const float *Dr, int lane)
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int n = nt * 8 + 2 * (lane & 3) + (e & 1);
            dP[nt][e] = S[nt][e] * (dP[nt][e] * gr[n] - Dr[n]);
            dP[nt][e] *= sc_cap_grad(lg2(S[nt][e]) + kt_l2(l2[n]), c.ic2);
        }
}

template <bool WHOLE, int NT>
__device__ __forceinline__ void kt_cap_prob_ds(float (&S)[NT][4], float (&dP)[NT][4], const sc_capbw &c, const float *l2,
                                               const float *gr, const float *Dr, const int *lo, const int *hi,
                                               const int kr[2], int k1, int lane)
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int n = nt * 8 + 2 * (lane & 3) + (e & 1), key = kr[e >> 1];
            float f = 1.0f, p;
            if (WHOLE) {
                p = sc_cap_prob(S[nt][e], kt_l2(l2[n]), c, &f);
            } else {
                const int vis = key < k1 && key >= lo[n] && key <= hi[n];
                p = vis ? sc_cap_prob(S[nt][e], kt_l2(l2[n]), c, &f) : 0.0f;
            }
            dP[nt][e] = p * (dP[nt][e] * gr[n] - Dr[n]);
            dP[nt][e] *= f;
            S[nt][e] = p * gr[n];
        }
}

#endif /* __CUDACC__ */

#endif
