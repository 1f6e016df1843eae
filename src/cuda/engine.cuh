/* engine.cuh -- the three tensor-core kernels every attention op of the backend is built on
 * (mma.sync m16n8k16 bf16/f16 -> f32, ldmatrix, cp.async; sm_80 and sm_90a alike):
 *
 *   qtile_kernel  forward (online softmax -> o, lse) and dQ, over a tile of BM = 16 * nw
 *                 query rows; row = position * G + head of one kv head (the CPU's packing),
 *                 so any G shares each K/V chunk between all rows of the tile. Keys come in
 *                 chunks of BN (64; 32 for the one-warp selected tiles) through a cp.async
 *                 pipeline (two stages; one buffer for the one-warp tiles, K and V staggered
 *                 in the forward), either a contiguous
 *                 range per row (window / dense / compressed masks) or, for selected
 *                 attention, the ascending union of the tile positions' selected blocks,
 *                 each row masked to its own blocks and causally.
 *   ktile_kernel  dK and dV: a CTA owns 64 keys (16 per warp) and visits every query row
 *                 that sees them (a contiguous range, or the inverted selection list), so
 *                 dK/dV need no atomics and are bitwise deterministic.
 *   select_kernel importance (spec 3) from recomputed compressed probabilities, summed over
 *                 a position's heads, and the streaming top-n per position.
 *
 * Compile-time: padded head dims DKP/DVP (64, 128, 192/128) and the storage type; the rest
 * (G, true dims, masks, strides) is run time. Smaller dims run zero-padded. */
#ifndef NSA_CUDA_ENGINE_CUH
#define NSA_CUDA_ENGINE_CUH

#include "common.cuh"
#include "kernels.h"
#include "wgmma.cuh"
#include <limits.h>

#define QT_BN 64 /* keys per CTA (ktile), keys per step (select); qtile's chunk is its BN parameter */

__device__ __forceinline__ float ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* Keys of sequence sq that a rule's queries choose from: its compressed keys, or its own
 * (the window rule's explicit count nk when it has one: Tq != Tk). */
__device__ __forceinline__ int rule_nkeys(const rule_t &r, const seqinfo &sq)
{
    return r.kind == RULE_CMP ? sq.ncmp : r.kind == RULE_WIN && r.nk >= 0 ? r.nk : sq.len;
}

/* Visible keys [lo, hi] of query t (empty when hi < lo); for selected attention the causal
 * bound only (blocks are masked separately). */
__device__ __forceinline__ void rule_bounds(const rule_t &r, int t, int nkeys, int *lo, int *hi)
{
    if (r.kind == RULE_CMP) {
        const int nv = t + 1 >= r.cl ? (t + 1 - r.cl) / r.cd + 1 : 0;
        *lo = 0;
        *hi = (nv < nkeys ? nv : nkeys) - 1;
    } else if (r.kind == RULE_WIN) {
        t += r.shift; /* bottom-right aligned diagonal (Tq != Tk); t < 0: the row sees nothing */
        const int64_t a = (r.wl < 0 || t - r.wl < 0) ? 0 : t - r.wl;
        int64_t b;
        if (r.causal) b = t < nkeys - 1 ? t : nkeys - 1;
        else b = (r.wr < 0 || t + r.wr > nkeys - 1) ? nkeys - 1 : t + r.wr;
        *lo = (int)a;
        *hi = (int)b;
    } else {
        *lo = 0;
        *hi = t < nkeys - 1 ? t : nkeys - 1;
    }
}

/* ==== score-tile helpers shared by the mma.sync (qtile) and wgmma (hopper.cuh) tiles ======
 * S[nt][e]: the accumulator layout of a warp's 16 rows (row lane / 4 + 8 (e / 2), column
 * 8 nt + 2 (lane % 4) + (e % 2)), which is also the layout of the A fragments built from it. */

/* Scale scores into the log2 domain and mask keys outside [lo[x], hi[x]] or past c1. A chunk
 * every row of the warp sees whole (full, warp-uniform: the compressed branch past its first
 * rows, window interiors, selected blocks that end before the query) takes a branch without
 * the per-element compares and selects: same products, so the same values as the masked path
 * (__fmul_rn in both: no FMA contraction with the later subtraction on one path only). */
template <int NT>
__device__ __forceinline__ void sc_mask_scale(float (&S)[NT][4], int full, int c0, int c1, const int lo[2],
                                              const int hi[2], int lane, float sl2)
{
    if (full) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) S[nt][e] = __fmul_rn(S[nt][e], sl2);
    } else {
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int x = e >> 1, key = c0 + nt * 8 + 2 * (lane & 3) + (e & 1);
                const int out = !(key < c1 && key >= lo[x] && key <= hi[x]);
                S[nt][e] = out ? -INFINITY : __fmul_rn(S[nt][e], sl2);
            }
    }
}

/* tanh(x) as 1 - 2 / (e^2x + 1): a few instructions against tanhf's dozens, error ~1e-7
 * absolute (e^2x -> inf gives 1, -> 0 gives -1); the softcap of every attention path. */
__device__ __forceinline__ float tanh_fast(float x) { return 1.0f - __fdividef(2.0f, __expf(2.0f * x) + 1.0f); }

/* The logit softcap of the attention op on raw scores q.k: S -> softcap * tanh(scale q.k /
 * softcap) in the log2 domain. @return the factor sc_mask_scale must still apply: 1 after the
 * cap, scale * log2(e) without one. */
template <int NT>
__device__ __forceinline__ float sc_softcap(float (&S)[NT][4], const rule_t &r, float scale, float sl2)
{
    if (!(r.cap > 0.0f)) return sl2;
    const float k = scale / r.cap, c2 = r.cap * NSA_LOG2E;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) S[nt][e] = c2 * tanh_fast(k * S[nt][e]);
    return 1.0f;
}

/* Whether every row of the warp sees all keys [c0, c1) of a chunk of `width` keys (rows' ranges
 * lo / hi): such a chunk skips sc_mask_scale's per-element compares. */
__device__ __forceinline__ int sc_chunk_whole(int c0, int c1, int width, const int lo[2], const int hi[2])
{
    const int w = c1 - c0 == width && lo[0] <= c0 && c1 - 1 <= hi[0] && lo[1] <= c0 && c1 - 1 <= hi[1];
    return __all_sync(0xffffffffu, w);
}

/* A row's sum over the four lanes that hold its columns (the accumulator layout above). */
__device__ __forceinline__ float sc_quad_sum(float v)
{
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

/* A finished forward row: lse from the running max m2 (log2 domain) and this row's sum l; with
 * a sink (sinks[hq * sinks_s]; sinks NULL: none), lse = log(l e^m + e^sink). @return o's
 * multiplier (1 / l, times e^(lse without the sink - lse)); 0 for a row that saw no key. */
__device__ __forceinline__ float sc_row_finish(float m2, float l, const float *sinks, int64_t sinks_s, int64_t hq,
                                               float *lse_out)
{
    float lse = l > 0.0f ? (m2 + log2f(l)) * NSA_LN2 : -INFINITY, w = l > 0.0f ? 1.0f / l : 0.0f;
    if (sinks) {
        const float sk = sinks[hq * sinks_s], mx = lse > sk ? lse : sk;
        if (mx != -INFINITY) {
            const float lz = mx + logf(expf(lse - mx) + expf(sk - mx));
            w *= expf(lse - lz); /* l = 0: w stays 0 */
            lse = lz;
        }
    }
    *lse_out = lse;
    return w;
}

/* Online softmax step: S (log2 domain) becomes exp2(S - new max) per row; the row max m_,
 * the row sum l_ (this lane's share) and the accumulator rows rescale. */
template <int NT, int NA>
__device__ __forceinline__ void sc_softmax(float (&S)[NT][4], float m_[2], float l_[2], float (&acc)[NA][4])
{
#pragma unroll
    for (int x = 0; x < 2; x++) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(S[nt][2 * x], S[nt][2 * x + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mnew = fmaxf(m_[x], mx);
        const float muse = mnew == -INFINITY ? 0.0f : mnew;
        const float alpha = ex2(m_[x] - muse);
        m_[x] = mnew;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            S[nt][2 * x] = ex2(S[nt][2 * x] - muse);
            S[nt][2 * x + 1] = ex2(S[nt][2 * x + 1] - muse);
            sum += S[nt][2 * x] + S[nt][2 * x + 1];
        }
        l_[x] = l_[x] * alpha + sum;
#pragma unroll
        for (int d = 0; d < NA; d++) acc[d][2 * x] *= alpha, acc[d][2 * x + 1] *= alpha;
    }
}

/* The A fragment of 16 keys (columns 16 k2 .. 16 k2 + 15) from S[2 k2], S[2 k2 + 1]. */
template <typename T>
__device__ __forceinline__ void sc_frag_a(uint32_t a[4], const float s0[4], const float s1[4])
{
    a[0] = dtraits<T>::pack(s0[0], s0[1]);
    a[1] = dtraits<T>::pack(s0[2], s0[3]);
    a[2] = dtraits<T>::pack(s1[0], s1[1]);
    a[3] = dtraits<T>::pack(s1[2], s1[3]);
}

/* ==== qtile: forward and dQ ============================================================== */

/* Union of the selected blocks of up to 64 positions, walked by warp 0: lane L follows
 * positions L and L + 32 of the tile through their ascending usable lists. */
typedef struct slc_iter {
    const int32_t *uA, *uB;
    int cA, cB, nA, nB, fA, fB, cur_c, cur_end, lp, len;
    int hA, hB; /* the lists' next entries (INT_MAX: exhausted), loaded one call ahead */
} slc_iter;

/* Next chunk [c0, c1) (one block, at most bn keys) and which positions selected it.
 * @return 0 when the union is exhausted. Warp 0 only. */
__device__ __forceinline__ int slc_next(slc_iter *it, int lane, int bn, int *c0, int *c1, unsigned char *flags)
{
    if (it->cur_c >= it->cur_end) {
        const int j = __reduce_min_sync(0xffffffffu, it->hA < it->hB ? it->hA : it->hB);
        if (j == INT_MAX) return 0;
        it->fA = it->hA == j;
        it->fB = it->hB == j;
        /* the next heads' global loads are consumed only at the next call, a chunk later,
         * so their latency hides behind that chunk's work instead of stalling the warp */
        if (it->fA) it->cA++, it->hA = it->cA < it->nA ? it->uA[it->cA] : INT_MAX;
        if (it->fB) it->cB++, it->hB = it->cB < it->nB ? it->uB[it->cB] : INT_MAX;
        it->cur_c = j * it->lp;
        it->cur_end = j * it->lp + it->lp < it->len ? j * it->lp + it->lp : it->len;
    }
    *c0 = it->cur_c;
    *c1 = it->cur_c + bn < it->cur_end ? it->cur_c + bn : it->cur_end;
    it->cur_c = *c1;
    flags[lane] = (unsigned char)it->fA;
    flags[lane + 32] = (unsigned char)it->fB;
    return 1;
}

/* BN: keys per chunk, 64; 32 for the one-warp selected tiles, whose K/V buffers then take
 * half the shared memory, so more of these latency-bound CTAs fit an SM. */
template <int DKP, int DVP, typename T, int MODE, int BN>
__global__ void __launch_bounds__(128) qtile_kernel(const qparams P)
{
    constexpr int LDK = DKP + 8, LDV = DVP + 8, NT = BN / 8, KT = DKP / 16, VT = DVP / 16;
    extern __shared__ __align__(16) unsigned char smem[];
    const int nw = P.nw, BM = nw * 16, nthr = nw * 32;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int64_t s, tile;
    seq_decode(P.sm, blockIdx.x, &s, &tile);
    const seqinfo sq = seq_get(P.sm, s);
    const int h = blockIdx.y;
    const int64_t G = P.G;
    const int64_t r0 = tile * BM;
    const int64_t nrow_all = (int64_t)sq.len * G;
    const int nrows = (int)(nrow_all - r0 < BM ? nrow_all - r0 : BM);
    const int is_cmp = P.rule.kind == RULE_CMP, is_slc = P.rule.kind == RULE_SLC;
    const int nkeys = rule_nkeys(P.rule, sq);
    const int64_t key_row0 = is_cmp ? sq.cmp0 : sq.row0;
    const int has_v = MODE == MODE_DQ || P.o.p != nullptr;

    const int nst = P.nst; /* K/V stages: 2 = prefetch the next chunk during this one */
    /* one-warp forward (selected attention, G >= 16): Q fragments come straight from global
     * memory into registers, so the tile needs no Q buffer and one more CTA fits an SM (the
     * kernel is latency bound at ~5 one-warp CTAs per SM); must match qtile_smem */
    const int qreg = MODE == MODE_FWD && nw == 1;
    T *Qs = (T *)smem;
    T *Os = Qs + (qreg ? 0 : BM * LDK);
    T *Ks = Os + (MODE == MODE_DQ ? BM * LDV : 0);
    T *Vs = Ks + nst * BN * LDK;
    int64_t *roff = (int64_t *)(Vs + nst * BN * LDV);
    int64_t *roff2 = roff + BM;
    int *desc = (int *)(roff2 + BM);                      /* [3][4]: c0, c1, have (selected) */
    unsigned char *flags = (unsigned char *)(desc + 12); /* [3][64] */

    const int p_first = (int)(r0 / G), p_last = (int)((r0 + nrows - 1) / G);

    for (int r = tid; r < BM; r += nthr) {
        int64_t off = -1, off2 = -1;
        if (r < nrows) {
            const int64_t rr = r0 + r, pos = rr / G, g = rr % G;
            off = sq.b * P.q.s0 + (sq.row0 + pos) * P.q.s1 + (h * G + g) * P.q.s2;
            if (MODE == MODE_DQ) off2 = sq.b * P.dout.s0 + (sq.row0 + pos) * P.dout.s1 + (h * G + g) * P.dout.s2;
        }
        roff[r] = off;
        roff2[r] = off2;
    }

    /* this lane's two rows: lane / 4 and lane / 4 + 8 of the warp's 16 */
    int rlo[2], rhi[2], rposl[2];
    float rl2[2], rD[2], rg[2];
    for (int x = 0; x < 2; x++) {
        const int r = warp * 16 + (lane >> 2) + x * 8;
        rlo[x] = 1, rhi[x] = 0, rposl[x] = 0, rl2[x] = INFINITY, rD[x] = 0.0f, rg[x] = 1.0f;
        if (r < nrows) {
            const int64_t rr = r0 + r;
            const int pos = (int)(rr / G), g = (int)(rr % G);
            rposl[x] = pos - p_first;
            rule_bounds(P.rule, pos, nkeys, &rlo[x], &rhi[x]);
            if (MODE == MODE_DQ) {
                const int64_t flat = (sq.b * P.T + sq.row0 + pos) * P.HQ + h * G + g;
                const float lse = ((const float *)P.lse.p)[sq.b * P.lse.s0 + (sq.row0 + pos) * P.lse.s1 + (h * G + g) * P.lse.s2];
                rl2[x] = lse == -INFINITY ? INFINITY : lse * NSA_LOG2E;
                rD[x] = P.Dw[flat];
                rg[x] = P.gw ? P.gw[flat] : 1.0f;
            }
        }
    }

    int kmin = 0, kmax = -1;
    if (!is_slc && nrows > 0) {
        int lo0, hi0, lo1, hi1;
        rule_bounds(P.rule, p_first, nkeys, &lo0, &hi0);
        rule_bounds(P.rule, p_last, nkeys, &lo1, &hi1);
        kmin = lo0;
        kmax = hi1;
    }
    slc_iter it;
    memset(&it, 0, sizeof it);
    it.hA = it.hB = INT_MAX;
    if (is_slc && warp == 0) {
        it.lp = P.rule.lp;
        it.len = sq.len;
        const int pa = p_first + lane, pb = p_first + lane + 32;
        if (nrows > 0 && pa <= p_last) {
            const int64_t id = (sq.b * P.T + sq.row0 + pa) * P.H + h;
            it.uA = P.U + id * P.m;
            it.nA = P.ucnt[id];
            it.hA = it.nA > 0 ? it.uA[0] : INT_MAX;
        }
        if (nrows > 0 && pb <= p_last) {
            const int64_t id = (sq.b * P.T + sq.row0 + pb) * P.H + h;
            it.uB = P.U + id * P.m;
            it.nB = P.ucnt[id];
            it.hB = it.nB > 0 ? it.uB[0] : INT_MAX;
        }
    }
    int64_t vbase = 0;
    if (has_v) vbase = sq.b * P.v.s0 + key_row0 * P.v.s1 + (int64_t)h * P.v.s2;

    /* Chunk j of the key sequence: ranges are arithmetic; the selected union is walked by
     * warp 0 two chunks ahead into desc/flags slot j % 3 (a slot is rewritten only after
     * the barrier that ends its last reader). */
#define QT_PRODUCE(slot)                                                                         \
    do {                                                                                         \
        int c0_ = 0, c1_ = 0;                                                                    \
        const int hv_ = nrows > 0 ? slc_next(&it, lane, BN, &c0_, &c1_, flags + (slot) * 64) : 0;   \
        if (lane == 0) desc[(slot) * 4] = c0_, desc[(slot) * 4 + 1] = c1_, desc[(slot) * 4 + 2] = hv_; \
    } while (0)
#define QT_GET(j, hv, c0v, c1v)                                                                  \
    do {                                                                                         \
        if (is_slc) {                                                                            \
            hv = desc[((j) % 3) * 4 + 2], c0v = desc[((j) % 3) * 4], c1v = desc[((j) % 3) * 4 + 1]; \
        } else {                                                                                 \
            c0v = kmin + (j) * BN;                                                               \
            hv = kmax >= kmin && c0v <= kmax;                                                    \
            c1v = c0v + BN < kmax + 1 ? c0v + BN : kmax + 1;                                     \
        }                                                                                        \
    } while (0)
#define QT_ISSUE_K(stage, c0v, c1v)                                                              \
    load_rows_lin<T, DKP>(Ks + (stage) * BN * LDK, LDK, (const T *)P.k.p,                       \
                          sq.b * P.k.s0 + (key_row0 + (c0v)) * P.k.s1 + (int64_t)h * P.k.s2, P.k.s1, \
                          (c1v) - (c0v), BN, P.DK, P.k.al, tid, nthr)
#define QT_ISSUE_V(stage, c0v, c1v)                                                              \
    do {                                                                                         \
        if (has_v)                                                                               \
            load_rows_lin<T, DVP>(Vs + (stage) * BN * LDV, LDV, (const T *)P.v.p, vbase + (c0v) * P.v.s1, P.v.s1, \
                                  (c1v) - (c0v), BN, P.DV, P.v.al, tid, nthr);                   \
    } while (0)
#define QT_ISSUE(stage, c0v, c1v)                                                                \
    do {                                                                                         \
        QT_ISSUE_K(stage, c0v, c1v);                                                             \
        QT_ISSUE_V(stage, c0v, c1v);                                                             \
    } while (0)

    if (is_slc && warp == 0) QT_PRODUCE(0);
    __syncthreads();
    if (!qreg) load_rows<T, DKP>(Qs, LDK, (const T *)P.q.p, roff, BM, P.DK, P.q.al, tid, nthr);
    if (MODE == MODE_DQ) load_rows<T, DVP>(Os, LDV, (const T *)P.dout.p, roff2, BM, P.DV, P.dout.al, tid, nthr);
    /* kvs (one buffer, forward): K and V of a chunk travel as two cp.async groups; the next
     * chunk's K is issued as soon as the scores are done and its V once P V is done, so each
     * load overlaps half a chunk of work without a second buffer (the one-warp selected
     * tiles are latency bound and a second buffer would cost a resident CTA) */
    const int kvs = MODE == MODE_FWD && nst == 1;
    int have, cc0, cc1;
    QT_GET(0, have, cc0, cc1);
    if (kvs) {
        if (have) QT_ISSUE_K(0, cc0, cc1);
        cp_commit();
        if (have) QT_ISSUE_V(0, cc0, cc1);
    } else if (have) {
        QT_ISSUE(0, cc0, cc1);
    }
    cp_commit();
    if (is_slc && warp == 0 && have) QT_PRODUCE(1);

    uint32_t qf[MODE == MODE_FWD ? KT : 1][4];
    if constexpr (MODE == MODE_FWD) {
        if (qreg) { /* the A-fragment layout of ldsm4 at frag_a_off: a[i] = row lane / 4 (+ 8
                     * for odd i), columns 2 (lane % 4) (+ 8 for i >= 2) and the next one */
            const unsigned short *qp = (const unsigned short *)P.q.p;
#pragma unroll
            for (int kk = 0; kk < KT; kk++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int64_t off = roff[(lane >> 2) + (i & 1) * 8];
                    const int c = kk * 16 + (i >> 1) * 8 + 2 * (lane & 3);
                    const uint32_t lo = off >= 0 && c < P.DK ? qp[off + c] : 0u;
                    const uint32_t hi = off >= 0 && c + 1 < P.DK ? qp[off + c + 1] : 0u;
                    qf[kk][i] = lo | hi << 16;
                }
        }
    }
    float acc[MODE == MODE_FWD ? DVP / 8 : DKP / 8][4];
    for (int i = 0; i < (MODE == MODE_FWD ? DVP / 8 : DKP / 8); i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    float m_[2] = {-INFINITY, -INFINITY}, l_[2] = {0.0f, 0.0f};

    for (int ci = 0; have; ci++) {
        if (kvs) cp_wait<1>(); /* K of chunk ci (its V may still be in flight) */
        else cp_wait<0>();
        __syncthreads(); /* chunk ci landed; everyone is done with chunk ci - 1 */
        const int st = nst == 2 ? (ci & 1) : 0;
        const int c0 = cc0, c1 = cc1;
        int have_next, nc0, nc1;
        QT_GET(ci + 1, have_next, nc0, nc1);
        if (nst == 2) {
            if (have_next) QT_ISSUE(st ^ 1, nc0, nc1);
            cp_commit();
            if (is_slc && warp == 0 && have_next) QT_PRODUCE((ci + 2) % 3);
        }
        if constexpr (MODE == MODE_FWD) {
            if (ci == 0 && !qreg) {
#pragma unroll
                for (int kk = 0; kk < KT; kk++) ldsm4(qf[kk], Qs + warp * 16 * LDK + kk * 16 + frag_a_off(lane, LDK));
            }
        }
        const unsigned char *fl = flags + (ci % 3) * 64;

        float S[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
        {
            const T *Kp = Ks + st * BN * LDK;
#pragma unroll
            for (int kk = 0; kk < KT; kk++) {
                uint32_t a[4];
                if constexpr (MODE == MODE_FWD) {
                    a[0] = qf[kk][0], a[1] = qf[kk][1], a[2] = qf[kk][2], a[3] = qf[kk][3];
                } else {
                    ldsm4(a, Qs + warp * 16 * LDK + kk * 16 + frag_a_off(lane, LDK));
                }
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    uint32_t b[4];
                    ldsm4(b, Kp + np * 16 * LDK + kk * 16 + frag_bn_off(lane, LDK));
                    dtraits<T>::mma(S[2 * np], a, b[0], b[1]);
                    dtraits<T>::mma(S[2 * np + 1], a, b[2], b[3]);
                }
            }
        }

        if (kvs) { /* K is read: refill it with the next chunk's */
            __syncthreads();
            if (have_next) QT_ISSUE_K(0, nc0, nc1);
            cp_commit();
        }

        /* scale into the log2 domain and mask; a row whose position did not select this
         * block sees nothing of it (its range becomes empty) */
        int mlo[2], mhi[2];
#pragma unroll
        for (int x = 0; x < 2; x++) {
            mlo[x] = rlo[x], mhi[x] = rhi[x];
            if (is_slc && !fl[rposl[x]]) mlo[x] = INT_MAX;
        }
        sc_mask_scale<NT>(S, sc_chunk_whole(c0, c1, BN, mlo, mhi), c0, c1, mlo, mhi, lane,
                          MODE == MODE_FWD ? sc_softcap<NT>(S, P.rule, P.scale, P.sl2) : P.sl2);

        if constexpr (MODE == MODE_FWD) {
            sc_softmax<NT, DVP / 8>(S, m_, l_, acc);
            if (kvs) { /* V of chunk ci (the next K may still be in flight) */
                cp_wait<1>();
                __syncthreads();
            }
            if (has_v) {
                const T *Vp = Vs + st * BN * LDV;
#pragma unroll
                for (int k2 = 0; k2 < NT / 2; k2++) {
                    uint32_t a[4];
                    sc_frag_a<T>(a, S[2 * k2], S[2 * k2 + 1]);
#pragma unroll
                    for (int vp = 0; vp < VT; vp++) {
                        uint32_t b[4];
                        ldsm4t(b, Vp + k2 * 16 * LDV + vp * 16 + frag_bk_off(lane, LDV));
                        dtraits<T>::mma(acc[2 * vp], a, b[0], b[1]);
                        dtraits<T>::mma(acc[2 * vp + 1], a, b[2], b[3]);
                    }
                }
            }
        } else {
            /* P from the saved lse; dP = dO V^T; dS = P (g dP - D); dQ += dS K */
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) S[nt][e] = ex2(S[nt][e] - rl2[e >> 1]);
            float dP[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) dP[nt][0] = dP[nt][1] = dP[nt][2] = dP[nt][3] = 0.0f;
            const T *Vp = Vs + st * BN * LDV;
#pragma unroll
            for (int kk = 0; kk < VT; kk++) {
                uint32_t a[4];
                ldsm4(a, Os + warp * 16 * LDV + kk * 16 + frag_a_off(lane, LDV));
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    uint32_t b[4];
                    ldsm4(b, Vp + np * 16 * LDV + kk * 16 + frag_bn_off(lane, LDV));
                    dtraits<T>::mma(dP[2 * np], a, b[0], b[1]);
                    dtraits<T>::mma(dP[2 * np + 1], a, b[2], b[3]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) dP[nt][e] = S[nt][e] * (dP[nt][e] * rg[e >> 1] - rD[e >> 1]);
            const T *Kp = Ks + st * BN * LDK;
#pragma unroll
            for (int k2 = 0; k2 < NT / 2; k2++) {
                uint32_t a[4];
                sc_frag_a<T>(a, dP[2 * k2], dP[2 * k2 + 1]);
#pragma unroll
                for (int dp = 0; dp < KT; dp++) {
                    uint32_t b[4];
                    ldsm4t(b, Kp + k2 * 16 * LDK + dp * 16 + frag_bk_off(lane, LDK));
                    dtraits<T>::mma(acc[2 * dp], a, b[0], b[1]);
                    dtraits<T>::mma(acc[2 * dp + 1], a, b[2], b[3]);
                }
            }
        }
        if (kvs) { /* V is read: refill it; the union walk moves one chunk further */
            __syncthreads();
            if (have_next) QT_ISSUE_V(0, nc0, nc1);
            cp_commit();
            if (is_slc && warp == 0 && have_next) QT_PRODUCE((ci + 2) % 3);
        } else if (nst == 1) { /* one buffer: refill it once everyone has read it */
            __syncthreads();
            if (have_next) QT_ISSUE(0, nc0, nc1);
            cp_commit();
            if (is_slc && warp == 0 && have_next) QT_PRODUCE((ci + 2) % 3);
        }
        have = have_next, cc0 = nc0, cc1 = nc1;
    }
    cp_wait<0>();
#undef QT_PRODUCE
#undef QT_GET
#undef QT_ISSUE
#undef QT_ISSUE_K
#undef QT_ISSUE_V

    /* epilogue */
#pragma unroll
    for (int x = 0; x < 2; x++) {
        const int r = warp * 16 + (lane >> 2) + x * 8;
        const float l = sc_quad_sum(l_[x]);
        if (r >= nrows) continue;
        const int64_t rr = r0 + r, pos = rr / G, g = rr % G, hq = h * G + g;
        if constexpr (MODE == MODE_FWD) {
            float lse;
            const float inv = sc_row_finish(m_[x], l, P.rule.sinks, P.rule.sinks_s, hq, &lse);
            if (P.o.p) {
                const int64_t ob = sq.b * P.o.s0 + (sq.row0 + pos) * P.o.s1 + hq * P.o.s2;
#pragma unroll
                for (int d = 0; d < DVP / 8; d++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int col = d * 8 + 2 * (lane & 3) + e;
                        if (col < P.DV) st_any(P.o.p, P.o.dt, ob + col, acc[d][2 * x + e] * inv);
                    }
            }
            if ((lane & 3) == 0 && P.lse.p)
                ((float *)P.lse.p)[sq.b * P.lse.s0 + (sq.row0 + pos) * P.lse.s1 + hq * P.lse.s2] = lse;
        } else {
            float *dq = P.dq + ((sq.b * P.T + sq.row0 + pos) * P.HQ + hq) * P.DK;
#pragma unroll
            for (int d = 0; d < DKP / 8; d++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int col = d * 8 + 2 * (lane & 3) + e;
                    if (col < P.DK) dq[col] += acc[d][2 * x + e] * P.scale;
                }
        }
    }
}

/* ==== ktile: dK and dV ===================================================================== */

/* First query whose range reaches key c, last whose range starts at or before key c (both
 * monotone in t, as on the CPU). */
static __device__ int kt_first_reaching(const rule_t &r, int len, int nkeys, int c)
{
    int a = 0, b = len;
    while (a < b) {
        const int mid = a + (b - a) / 2;
        int lo, hi;
        rule_bounds(r, mid, nkeys, &lo, &hi);
        if (hi >= c) b = mid;
        else a = mid + 1;
    }
    return a;
}

static __device__ int kt_last_starting(const rule_t &r, int len, int nkeys, int c)
{
    int a = -1, b = len - 1;
    while (a < b) {
        const int mid = b - (b - a) / 2;
        int lo, hi;
        rule_bounds(r, mid, nkeys, &lo, &hi);
        if (lo <= c) a = mid;
        else b = mid - 1;
    }
    return a;
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
        const int64_t per_T = (P.T + lp - 1) / lp + 1;
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
        const int64_t nb1 = (q0.len + lp - 1) / lp + 1;
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
            const int64_t all = (int64_t)sq.len * G, sz = ((all + P.nseg - 1) / P.nseg + BQ - 1) / BQ * BQ;
            const int64_t a0 = sg * sz, a1 = a0 + sz < all ? a0 + sz : all;
            const int64_t lo = rbase > a0 ? rbase : a0, hi = rbase + nrows < a1 ? rbase + nrows : a1;
            rbase = lo;
            nrows = hi > lo ? hi - lo : 0;
            if (sg > 0) slot = (int64_t)blockIdx.x * P.H + h;
        }
    } else {
        const int lp = P.rule.lp, j = (int)(local / P.nsub), sub = (int)(local % P.nsub);
        const int bend = j * lp + lp < sq.len ? j * lp + lp : sq.len;
        k0 = j * lp + sub * BK;
        k1 = k0 + BK < bend ? k0 + BK : bend;
        if (k0 >= k1) return 0;
        unitspec ul = {UK_LIST, P.m, 1, 0, 0}, uo = {UK_INV_OFFS, 0, lp, 0, 0};
        const int64_t lreg = (P.list_pref ? P.list_pref[s] : s * seq_units(ul, P.T)) * P.H + h * seq_units(ul, sq.len);
        const int64_t oreg = (P.offs_pref ? P.offs_pref[s] : s * seq_units(uo, P.T)) * P.H + h * seq_units(uo, sq.len);
        const int32_t *offs = P.offs + oreg;
        int64_t cnt = offs[j + 1] - offs[j], first = 0;
        if (P.segp > 0) {
            first = seg * P.segp;
            cnt = cnt - first < P.segp ? cnt - first : P.segp;
        }
        list = P.list + lreg + offs[j] + first;
        nrows = cnt > 0 ? cnt * G : 0;
    }
    if (nrows == 0) { /* no query sees these keys here: nothing to add (a partial slot reads 0) */
        if (slot >= 0)
            for (int64_t i = tid; i < (int64_t)(k1 - k0) * (P.DK + P.DV); i += nthr) {
                const int64_t key = i / (P.DK + P.DV), col = i % (P.DK + P.DV);
                P.part[slot * BK * (P.DK + P.DV) + (col < P.DK ? key * P.DK + col : (int64_t)BK * P.DK + key * P.DV + (col - P.DK))] = 0.0f;
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

template <int DKP, int DVP, typename T>
__global__ void __launch_bounds__(128) ktile_kernel(const kparams P)
{
    constexpr int LDK = DKP + 8, LDV = DVP + 8, BK = QT_BN, BQ = 64, NT = BQ / 8, KT = DKP / 16, VT = DVP / 16;
    extern __shared__ __align__(16) unsigned char smem[];
    const int nthr = 128, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    T *Ks = (T *)smem;
    T *Vs = Ks + BK * LDK;
    T *Qs = Vs + BK * LDV;      /* [2][BQ][LDK] data stages */
    T *Ds = Qs + 2 * BQ * LDK;  /* [2][BQ][LDV] */
    int64_t *rq = (int64_t *)(Ds + 2 * BQ * LDV); /* [3][BQ] row slots */
    int64_t *ro = rq + 3 * BQ;
    float *rl2 = (float *)(ro + 3 * BQ);
    float *rD = rl2 + 3 * BQ, *rg = rD + 3 * BQ;
    int *rlo = (int *)(rg + 3 * BQ), *rhi = rlo + 3 * BQ;
    int *rfull = rhi + 3 * BQ; /* [3][2]: every row of the slot's warp half sees all BK keys */

    /* the task lives in shared memory: the row fill of every chunk reads it there instead of
     * holding its ~20 registers through the products (spilled otherwise) */
    __shared__ kt_task ts;
    {
        kt_task t;
        if (!kt_task_get<BK, BQ>(P, &t, tid, nthr)) return;
        if (tid == 0) ts = t;
    }
    __syncthreads();
    const kt_task &t = ts;
    const int h = t.h, k0 = t.k0, k1 = t.k1;
    const kt_rows R = {rq, ro, rl2, rD, rg, rlo, rhi, rfull};

    const int64_t kb = t.sq.b * P.k.s0 + (t.key_row0 + k0) * P.k.s1 + (int64_t)h * P.k.s2;
    const int64_t vb = t.sq.b * P.v.s0 + (t.key_row0 + k0) * P.v.s1 + (int64_t)h * P.v.s2;
    load_rows_lin<T, DKP>(Ks, LDK, (const T *)P.k.p, kb, P.k.s1, k1 - k0, BK, P.DK, P.k.al, tid, nthr);
    load_rows_lin<T, DVP>(Vs, LDV, (const T *)P.v.p, vb, P.v.s1, k1 - k0, BK, P.DV, P.v.al, tid, nthr);

    const int64_t nchunks = (t.nrows + BQ - 1) / BQ;

#define KT_ISSUE(stage, rs)                                                                      \
    do {                                                                                         \
        load_rows<T, DKP>(Qs + (stage) * BQ * LDK, LDK, (const T *)P.q.p, rq + (rs) * BQ, BQ, P.DK, P.q.al, tid, nthr); \
        load_rows<T, DVP>(Ds + (stage) * BQ * LDV, LDV, (const T *)P.dout.p, ro + (rs) * BQ, BQ, P.DV, P.dout.al, tid, nthr); \
    } while (0)

    /* rows of chunk c live in slot c % 3, filled two chunks ahead; data in stage c & 1 */
    kt_fill<BQ>(P, t, R, 0, 0, tid);
    if (nchunks > 1) kt_fill<BQ>(P, t, R, 1, 1, tid);
    __syncthreads();
    KT_ISSUE(0, 0);
    cp_commit();

    float dK[DKP / 8][4], dV[DVP / 8][4];
#pragma unroll
    for (int i = 0; i < DKP / 8; i++) dK[i][0] = dK[i][1] = dK[i][2] = dK[i][3] = 0.0f;
#pragma unroll
    for (int i = 0; i < DVP / 8; i++) dV[i][0] = dV[i][1] = dV[i][2] = dV[i][3] = 0.0f;
    int kr[2];
    kr[0] = k0 + warp * 16 + (lane >> 2);
    kr[1] = kr[0] + 8;

    for (int64_t c = 0; c < nchunks; c++) {
        const int st = (int)(c & 1), sl = (int)(c % 3);
        cp_wait<0>();
        __syncthreads(); /* chunk c landed; everyone is done with chunk c - 1 */
        if (c + 1 < nchunks) KT_ISSUE(st ^ 1, (int)((c + 1) % 3));
        cp_commit();
        if (c + 2 < nchunks) kt_fill<BQ>(P, t, R, (int)((c + 2) % 3), c + 2, tid);
        const T *Qp = Qs + st * BQ * LDK, *Dp = Ds + st * BQ * LDV;
        const float *l2 = rl2 + sl * BQ, *Dr = rD + sl * BQ, *gr = rg + sl * BQ;
        const int *lo = rlo + sl * BQ, *hi = rhi + sl * BQ;

        float S[NT][4], dP[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
            dP[nt][0] = dP[nt][1] = dP[nt][2] = dP[nt][3] = 0.0f;
        }
        /* S^T = K Q^T (keys x rows) */
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            uint32_t a[4];
            ldsm4(a, Ks + warp * 16 * LDK + kk * 16 + frag_a_off(lane, LDK));
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                uint32_t b[4];
                ldsm4(b, Qp + np * 16 * LDK + kk * 16 + frag_bn_off(lane, LDK));
                dtraits<T>::mma(S[2 * np], a, b[0], b[1]);
                dtraits<T>::mma(S[2 * np + 1], a, b[2], b[3]);
            }
        }
        /* dP^T = V dO^T */
#pragma unroll
        for (int kk = 0; kk < VT; kk++) {
            uint32_t a[4];
            ldsm4(a, Vs + warp * 16 * LDV + kk * 16 + frag_a_off(lane, LDV));
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                uint32_t b[4];
                ldsm4(b, Dp + np * 16 * LDV + kk * 16 + frag_bn_off(lane, LDV));
                dtraits<T>::mma(dP[2 * np], a, b[0], b[1]);
                dtraits<T>::mma(dP[2 * np + 1], a, b[2], b[3]);
            }
        }
        /* P^T (masked), dS^T = P^T (g dP^T - D); S becomes g P^T for dV. Most chunks of a
         * range rule are whole (every row sees all BK keys: the compressed branch's rows past
         * the first ~BK * d positions, the window's interior): those skip the per-element
         * bounds (two shared loads and compares each) for the same values. */
        if (k1 - k0 == BK && rfull[sl * 2] && rfull[sl * 2 + 1]) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int n = nt * 8 + 2 * (lane & 3) + (e & 1);
                    const float p = ex2(S[nt][e] * P.sl2 - kt_l2(l2[n]));
                    dP[nt][e] = p * (dP[nt][e] * gr[n] - Dr[n]);
                    S[nt][e] = p * gr[n];
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int n = nt * 8 + 2 * (lane & 3) + (e & 1), key = kr[e >> 1];
                    const int vis = key < k1 && key >= lo[n] && key <= hi[n];
                    const float p = vis ? ex2(S[nt][e] * P.sl2 - kt_l2(l2[n])) : 0.0f;
                    dP[nt][e] = p * (dP[nt][e] * gr[n] - Dr[n]);
                    S[nt][e] = p * gr[n];
                }
        }
        /* dV += (g P)^T dO, dK += dS^T Q */
#pragma unroll
        for (int k2 = 0; k2 < NT / 2; k2++) {
            uint32_t a[4], d[4];
            sc_frag_a<T>(a, S[2 * k2], S[2 * k2 + 1]);
            sc_frag_a<T>(d, dP[2 * k2], dP[2 * k2 + 1]);
#pragma unroll
            for (int vp = 0; vp < VT; vp++) {
                uint32_t b[4];
                ldsm4t(b, Dp + k2 * 16 * LDV + vp * 16 + frag_bk_off(lane, LDV));
                dtraits<T>::mma(dV[2 * vp], a, b[0], b[1]);
                dtraits<T>::mma(dV[2 * vp + 1], a, b[2], b[3]);
            }
#pragma unroll
            for (int dp = 0; dp < KT; dp++) {
                uint32_t b[4];
                ldsm4t(b, Qp + k2 * 16 * LDK + dp * 16 + frag_bk_off(lane, LDK));
                dtraits<T>::mma(dK[2 * dp], d, b[0], b[1]);
                dtraits<T>::mma(dK[2 * dp + 1], d, b[2], b[3]);
            }
        }
    }
    cp_wait<0>();
#undef KT_ISSUE

#pragma unroll
    for (int x = 0; x < 2; x++) {
        const int key = kr[x];
        if (key >= k1) continue;
        const int64_t row = (t.sq.b * P.KR + t.key_row0 + key) * P.H + h, slot = t.slot;
        if (slot >= 0) { /* this segment's partial, written whole (the reduce adds them in order) */
            float *pk = P.part + slot * BK * (P.DK + P.DV) + (int64_t)(key - k0) * P.DK;
            float *pv = P.part + slot * BK * (P.DK + P.DV) + (int64_t)BK * P.DK + (int64_t)(key - k0) * P.DV;
#pragma unroll
            for (int d = 0; d < DKP / 8; d++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int col = d * 8 + 2 * (lane & 3) + e;
                    if (col < P.DK) pk[col] = dK[d][2 * x + e] * P.scale;
                }
#pragma unroll
            for (int d = 0; d < DVP / 8; d++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int col = d * 8 + 2 * (lane & 3) + e;
                    if (col < P.DV) pv[col] = dV[d][2 * x + e];
                }
            continue;
        }
        float *dk = P.dk + row * P.DK, *dv = P.dv + row * P.DV;
#pragma unroll
        for (int d = 0; d < DKP / 8; d++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = d * 8 + 2 * (lane & 3) + e;
                if (col < P.DK) dk[col] += dK[d][2 * x + e] * P.scale;
            }
#pragma unroll
        for (int d = 0; d < DVP / 8; d++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = d * 8 + 2 * (lane & 3) + e;
                if (col < P.DV) dv[col] += dV[d][2 * x + e];
            }
    }
}

/* ==== select: importance + top-n ============================================================ */

/* One butterfly step: lanes whose `bit` is set keep v[HALF..2 HALF) and the others v[0..HALF),
 * each adding its partner's copy of the kept half; the kept values move to v[0..HALF). */
template <int HALF>
__device__ __forceinline__ void sel_halve(float *v, int lane, int bit)
{
    const int up = (lane & bit) != 0;
#pragma unroll
    for (int k = 0; k < HALF; k++) {
        const float send = up ? v[k] : v[k + HALF];
        const float keep = up ? v[k + HALF] : v[k];
        v[k] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
    }
}

/* a / b for a >= 0, b > 0: 32-bit division whenever a fits (positions always do), as 64-bit
 * division is a long software sequence and these run per pass and per block */
__device__ __forceinline__ int64_t div_nn(int64_t a, int b)
{
    return a <= INT_MAX ? (int64_t)((unsigned)a / (unsigned)b) : a / b;
}

/* One pass of the streaming top-n (spec 3), one thread per position pp < npos: candidates
 * jA .. jA + JC - 1 (importance imp[pp * ims + jj]) enter the position's kept list, best first
 * (entry i at LI[i * NP + pp] importance, LJ[i * NP + pp] block; kept[pp] entries), by
 * insertion in the order (forced, importance, index). That order is total, so the list is
 * exactly the CPU's (cpu/select.c) whatever the pass boundaries. With random importances few
 * candidates beat the last kept entry once the list is full, so most cost one comparison; the
 * entry-major layout and an odd ims keep a warp's 32 positions on distinct banks. (A warp per
 * position, merging by rank counts, cost 8 of the 17 ms of the selection at 64k.) */
__device__ __forceinline__ void sel_merge(const sparams &P, const float *imp, int ims, float *LI, int *LJ, int *kept, int NP,
                                          int p0, int npos, int jA, int JC, int pp)
{
    if (pp >= npos) return;
    const int n = P.n, cur = (p0 + pp) / P.lp;
    const int m = cur - jA + 1 < JC ? cur - jA + 1 : JC;
    int k = kept[pp];
    /* the last entry of a full list: the bar a candidate must clear */
    int jl = 0, fl = 0;
    float vl = 0.0f;
    if (k == n) jl = LJ[(n - 1) * NP + pp], vl = LI[(n - 1) * NP + pp], fl = nsa_rule_forced(jl, cur, P.n_init, P.n_local);
    for (int jj = 0; jj < m; jj++) {
        const int j = jA + jj, f = nsa_rule_forced(j, cur, P.n_init, P.n_local);
        const float v = imp[pp * ims + jj];
        if (k == n && !nsa_rule_ranks_above(f, v, j, fl, vl, jl)) continue;
        int q = k < n ? k : n - 1; /* a full list drops its last entry */
        while (q > 0) {
            const int w = LJ[(q - 1) * NP + pp];
            const float wv = LI[(q - 1) * NP + pp];
            if (!nsa_rule_ranks_above(f, v, j, nsa_rule_forced(w, cur, P.n_init, P.n_local), wv, w)) break;
            LI[q * NP + pp] = wv, LJ[q * NP + pp] = w;
            q--;
        }
        LI[q * NP + pp] = v, LJ[q * NP + pp] = j;
        if (k < n) k++;
        if (k == n) jl = LJ[(n - 1) * NP + pp], vl = LI[(n - 1) * NP + pp], fl = nsa_rule_forced(jl, cur, P.n_init, P.n_local);
    }
    kept[pp] = k;
}

/* The kept lists in ascending block order into idx (-1 past the count) and cnt: one thread
 * per position (at most n entries each, entry-major as sel_merge keeps them). */
__device__ __forceinline__ void sel_write(const sparams &P, const seqinfo &sq, int h, int *LJ, const int *kept, int NP,
                                          int p0, int npos, int tid)
{
    const int n = P.n;
    if (tid < npos) {
        const int t = p0 + tid, k = kept[tid];
        int *lj = LJ + tid;
        for (int i = 1; i < k; i++) {
            const int v = lj[i * NP];
            int q = i;
            while (q > 0 && lj[(q - 1) * NP] > v) {
                lj[q * NP] = lj[(q - 1) * NP];
                q--;
            }
            lj[q * NP] = v;
        }
        const int64_t row = sq.row0 + t;
        int32_t *out = (int32_t *)P.idx.p + sq.b * P.idx.s0 + row * P.idx.s1 + (int64_t)h * P.idx.s2;
        for (int e = 0; e < n; e++) out[e] = e < k ? lj[e * NP] : -1;
        if (P.cnt.p) ((int32_t *)P.cnt.p)[sq.b * P.cnt.s0 + row * P.cnt.s1 + (int64_t)h * P.cnt.s2] = k;
    }
}

template <int DKP, typename T>
__global__ void __launch_bounds__(128) select_kernel(const sparams P)
{
    constexpr int LDK = DKP + 8, BM = 64, BN = QT_BN, NT = BN / 8, KT = DKP / 16, LDP = BN + 1;
    extern __shared__ __align__(16) unsigned char smem[];
    const int nthr = 128, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int NP = P.P, JC = P.JC, HC = P.HC, n = P.n;
    T *Qs = (T *)smem;
    T *Ks = Qs + BM * LDK;
    /* HC == 16: a warp's 16 rows are one position's heads, summed in registers (no Ps) */
    const int regsum = HC == 16;
    float *Ps = (float *)(Ks + BN * LDK);
    float *imp = Ps + (regsum ? 0 : BM * LDP);
    float *LI = imp + NP * JC;
    int *LJ = (int *)(LI + NP * n);
    int *kept = LJ + NP * n;
    float *l2s = (float *)(kept + NP);
    int *rpos = (int *)(l2s + BM);
    int64_t *roff = (int64_t *)(((uintptr_t)(rpos + BM) + 15) & ~(uintptr_t)15);
    float *Cs = (float *)(roff + BM); /* [P][BN]: probabilities summed over a position's heads */

    int64_t s, tile;
    seq_decode(P.sm, blockIdx.x, &s, &tile);
    const seqinfo sq = seq_get(P.sm, s);
    const int h = blockIdx.y;
    const int64_t G = P.G;
    const int p0 = (int)tile * NP;
    const int npos = sq.len - p0 < NP ? sq.len - p0 : NP;
    const int lp = P.lp, cl = P.cl, cd = P.cd;
    const int cur_max = (p0 + npos - 1) / lp;
    const int last_t = p0 + npos - 1;
    int nv_max = (int)nsa_rule_cmp_visible(last_t, cl, cd);
    nv_max = nv_max < sq.ncmp ? nv_max : sq.ncmp;
    const int nhc = (int)((G + HC - 1) / HC);
    const float inv_d = 1.0f / (float)cd;

    if (tid < NP) kept[tid] = 0;

    /* rows of head chunk hc: row = pp * HC + gg, head g = hc * HC + gg */
#define SEL_QLOAD(hc)                                                                            \
    do {                                                                                         \
        for (int r = tid; r < BM; r += nthr) {                                                   \
            const int pp = r / HC, gg = r % HC;                                                  \
            const int64_t g = (int64_t)(hc) * HC + gg;                                           \
            int64_t off = -1;                                                                    \
            float l2 = INFINITY;                                                                 \
            int pos = 0;                                                                         \
            if (pp < npos && g < G) {                                                            \
                pos = p0 + pp;                                                                   \
                const int64_t row = sq.row0 + pos, hq = h * G + g;                               \
                off = sq.b * P.q.s0 + row * P.q.s1 + hq * P.q.s2;                                \
                const float lse = ((const float *)P.lse.p)[sq.b * P.lse.s0 + row * P.lse.s1 + hq * P.lse.s2]; \
                l2 = lse == -INFINITY ? INFINITY : lse * NSA_LOG2E;                              \
            }                                                                                    \
            roff[r] = off;                                                                       \
            l2s[r] = l2;                                                                         \
            rpos[r] = pos;                                                                       \
        }                                                                                        \
        __syncthreads();                                                                         \
        load_rows<T, DKP>(Qs, LDK, (const T *)P.q.p, roff, BM, P.DK, P.q.al, tid, nthr);         \
    } while (0)

    if (nhc == 1) SEL_QLOAD(0);

    /* compressed keys [iA_, iB_) overlapping selection blocks [jA_, jA_ + JC) */
#define SEL_RANGE(jA_, iA_, iB_)                                                                 \
    do {                                                                                         \
        const int64_t a0_ = (int64_t)(jA_) * lp - cl;                                            \
        iA_ = a0_ < 0 ? 0 : (int)(div_nn(a0_, cd) + 1);                                          \
        iB_ = (int)(div_nn((int64_t)((jA_) + JC) * lp - 1, cd) + 1);                             \
        iB_ = iB_ < nv_max ? iB_ : nv_max;                                                       \
    } while (0)
#define SEL_KLOAD(i0_, i1_)                                                                      \
    do {                                                                                         \
        load_rows_lin<T, DKP>(Ks, LDK, (const T *)P.k.p, sq.b * P.k.s0 + (sq.cmp0 + (i0_)) * P.k.s1 + (int64_t)h * P.k.s2, \
                              P.k.s1, (i1_) - (i0_), BN, P.DK, P.k.al, tid, nthr);               \
    } while (0)

    /* first key of the tile already in flight into Ks: the next pass's first tile is issued
     * as soon as the scores of this one are consumed, so its load overlaps the importance
     * and top-n work instead of stalling the start of the pass */
    int pre = -1;
    for (int jA = 0; jA <= cur_max; jA += JC) {
        for (int i = tid; i < NP * JC; i += nthr) imp[i] = 0.0f;
        int iA, iB;
        SEL_RANGE(jA, iA, iB);
        for (int i0 = iA; i0 < iB; i0 += BN) {
            const int i1 = i0 + BN < iB ? i0 + BN : iB;
            if (i0 != pre) {
                __syncthreads();
                SEL_KLOAD(i0, i1);
            }
            pre = -1;
            for (int hc = 0; hc < nhc; hc++) {
                if (nhc > 1) {
                    if (hc > 0) __syncthreads();
                    SEL_QLOAD(hc);
                }
                cp_commit();
                cp_wait<0>();
                __syncthreads();
                float S[NT][4];
#pragma unroll
                for (int nt = 0; nt < NT; nt++) S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KT; kk++) {
                    uint32_t a[4];
                    ldsm4(a, Qs + warp * 16 * LDK + kk * 16 + frag_a_off(lane, LDK));
#pragma unroll
                    for (int np = 0; np < NT / 2; np++) {
                        uint32_t b[4];
                        ldsm4(b, Ks + np * 16 * LDK + kk * 16 + frag_bn_off(lane, LDK));
                        dtraits<T>::mma(S[2 * np], a, b[0], b[1]);
                        dtraits<T>::mma(S[2 * np + 1], a, b[2], b[3]);
                    }
                }
                if (regsum) {
                    /* position = warp: sum the 16 heads across the two row halves and the 8
                     * lane groups, so Cs is written directly (one barrier, no Ps round trip) */
                    const int r0 = warp * 16 + (lane >> 2);
                    const int t = rpos[r0];
                    const int nv = t + 1 >= cl ? (t + 1 - cl) / cd + 1 : 0;
                    const int lim = i1 < nv ? i1 : nv;
                    const float la = l2s[r0], lb = l2s[r0 + 8];
                    /* v[k], k = 2 nt + c: this lane's two rows summed for column
                     * nt * 8 + 2 (lane % 4) + c; the 8 lanes of equal lane % 4 hold the other
                     * 14 rows of the same columns */
                    float v[2 * NT];
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int c = 0; c < 2; c++) {
                            const int col = nt * 8 + 2 * (lane & 3) + c;
                            v[2 * nt + c] = i0 + col < lim ? ex2(S[nt][c] * P.sl2 - la) + ex2(S[nt][2 + c] * P.sl2 - lb) : 0.0f;
                        }
                    /* halving butterfly over lane bits 4, 3, 2: each step a lane keeps half of
                     * its columns and adds the partner's half of them (14 shuffles instead of
                     * 48); lane ends with columns k = kb, kb + 1 summed over all 16 rows */
                    static_assert(NT == 8, "the butterfly below halves 16 columns three times");
                    sel_halve<8>(v, lane, 16);
                    sel_halve<4>(v, lane, 8);
                    sel_halve<2>(v, lane, 4);
                    const int kb = ((lane >> 4) & 1) * 8 + ((lane >> 3) & 1) * 4 + ((lane >> 2) & 1) * 2;
                    if (warp < npos) {
                        const int col = (kb >> 1) * 8 + 2 * (lane & 3);
                        Cs[warp * BN + col] = v[0];
                        Cs[warp * BN + col + 1] = v[1];
                    }
                    __syncthreads();
                } else {
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int r = warp * 16 + (lane >> 2) + (e >> 1) * 8;
                            const int col = nt * 8 + 2 * (lane & 3) + (e & 1), i = i0 + col;
                            const int t = rpos[r];
                            const int nv = t + 1 >= cl ? (t + 1 - cl) / cd + 1 : 0;
                            const float pr = (i < i1 && i < nv) ? ex2(S[nt][e] * P.sl2 - l2s[r]) : 0.0f;
                            Ps[r * LDP + col] = pr;
                        }
                    __syncthreads();
                    const int64_t gleft = G - (int64_t)hc * HC;
                    const int hcv = gleft < HC ? (int)gleft : HC;
                    for (int idx = tid; idx < npos * BN; idx += nthr) {
                        const int pp = idx / BN, col = idx % BN;
                        float ps = 0.0f;
                        for (int gg = 0; gg < hcv; gg++) ps += Ps[(pp * HC + gg) * LDP + col];
                        Cs[idx] = ps;
                    }
                    __syncthreads();
                }
                /* Ks is free now (every warp is past its scores) */
                if (hc == nhc - 1 && i1 == iB && jA + JC <= cur_max) {
                    int nA, nB;
                    SEL_RANGE(jA + JC, nA, nB);
                    if (nA < nB) {
                        SEL_KLOAD(nA, nA + BN < nB ? nA + BN : nB);
                        pre = nA;
                    }
                }
                for (int idx = tid; idx < npos * JC; idx += nthr) {
                    const int pp = idx / JC, jj = idx % JC, j = jA + jj, t = p0 + pp;
                    if (j > t / lp) continue;
                    const int64_t b0 = (int64_t)j * lp - cl;
                    int ia = b0 < 0 ? 0 : (int)(div_nn(b0, cd) + 1);
                    int ib = (int)(div_nn((int64_t)j * lp + lp - 1, cd) + 1);
                    ia = ia > i0 ? ia : i0;
                    ib = ib < i1 ? ib : i1;
                    float acc = 0.0f;
                    for (int i = ia; i < ib; i++) {
                        /* tokens shared by compressed block i and selection block j */
                        const int lo = i * cd > j * lp ? i * cd : j * lp;
                        const int hi = i * cd + cl < j * lp + lp ? i * cd + cl : j * lp + lp;
                        acc += Cs[pp * BN + (i - i0)] * (float)(hi - lo);
                    }
                    imp[pp * JC + jj] += acc * inv_d;
                }
                __syncthreads();
            }
        }
        __syncthreads();
        sel_merge(P, imp, JC, LI, LJ, kept, NP, p0, npos, jA, JC, tid);
        __syncthreads();
    }
#undef SEL_QLOAD
#undef SEL_RANGE
#undef SEL_KLOAD
    cp_commit();
    cp_wait<0>();
    sel_write(P, sq, h, LJ, kept, NP, p0, npos, tid);
}

/* ==== launchers (instantiated per head-dim class in engine_d*.cu) ========================== */

template <int DKP, int DVP, typename T, int MODE, int BN>
static void launch_qtile_bn(grun *g, const qparams *P, int64_t tiles)
{
    const size_t smem = qtile_smem(DKP, DVP, P->nw, MODE, P->nst, BN);
    g_check(g, cudaFuncSetAttribute(qtile_kernel<DKP, DVP, T, MODE, BN>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (g->err != NSA_STATUS_SUCCESS) return;
    qtile_kernel<DKP, DVP, T, MODE, BN><<<dim3((unsigned)tiles, (unsigned)P->H), P->nw * 32, smem, g->st>>>(*P);
    g_launched(g);
}

template <int DKP, int DVP, typename T, int MODE>
static void launch_qtile_t(grun *g, const qparams *P, int64_t tiles)
{
    if (P->bn == 32) launch_qtile_bn<DKP, DVP, T, MODE, 32>(g, P, tiles);
    else launch_qtile_bn<DKP, DVP, T, MODE, 64>(g, P, tiles);
}

template <int DKP, int DVP, typename T>
static void launch_ktile_t(grun *g, const kparams *P, int64_t tiles)
{
    const size_t smem = ktile_smem(DKP, DVP);
    g_check(g, cudaFuncSetAttribute(ktile_kernel<DKP, DVP, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (g->err != NSA_STATUS_SUCCESS) return;
    ktile_kernel<DKP, DVP, T><<<dim3((unsigned)tiles, P->extra ? 1u : (unsigned)P->H), 128, smem, g->st>>>(*P);
    g_launched(g);
}

template <int DKP, typename T>
static void launch_select_t(grun *g, const sparams *P, int64_t tiles)
{
    const size_t smem = select_smem(DKP, P->P, P->JC, P->n, P->HC);
    g_check(g, cudaFuncSetAttribute(select_kernel<DKP, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (g->err != NSA_STATUS_SUCCESS) return;
    select_kernel<DKP, T><<<dim3((unsigned)tiles, (unsigned)P->H), 128, smem, g->st>>>(*P);
    g_launched(g);
}

/* One head-dim class: DKP x DVP, both dtypes, every kernel. */
#define NSA_ENGINE_INSTANCE(DKP, DVP)                                                            \
    void nsa_cu_qtile_##DKP(grun *g, const qparams *P, int mode, int bf16, int64_t tiles)        \
    {                                                                                            \
        if (bf16) {                                                                              \
            if (mode == MODE_FWD) launch_qtile_t<DKP, DVP, __nv_bfloat16, MODE_FWD>(g, P, tiles); \
            else launch_qtile_t<DKP, DVP, __nv_bfloat16, MODE_DQ>(g, P, tiles);                  \
        } else {                                                                                 \
            if (mode == MODE_FWD) launch_qtile_t<DKP, DVP, __half, MODE_FWD>(g, P, tiles);       \
            else launch_qtile_t<DKP, DVP, __half, MODE_DQ>(g, P, tiles);                         \
        }                                                                                        \
    }                                                                                            \
    void nsa_cu_ktile_##DKP(grun *g, const kparams *P, int bf16, int64_t tiles)                  \
    {                                                                                            \
        if (bf16) launch_ktile_t<DKP, DVP, __nv_bfloat16>(g, P, tiles);                          \
        else launch_ktile_t<DKP, DVP, __half>(g, P, tiles);                                      \
    }                                                                                            \
    void nsa_cu_select_##DKP(grun *g, const sparams *P, int bf16, int64_t tiles)                 \
    {                                                                                            \
        if (bf16) launch_select_t<DKP, __nv_bfloat16>(g, P, tiles);                              \
        else launch_select_t<DKP, __half>(g, P, tiles);                                          \
    }

#endif
