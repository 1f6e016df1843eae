/* attn/ampere_fwd_dq.cuh -- qtile_kernel: forward (online softmax -> o, lse) and dQ of any
 * rule on mma.sync m16n8k16 (sm_80 and sm_90a alike), over a tile of BM = 16 * nw query rows;
 * row = position * G + head of one kv head (the CPU's packing), so any G shares each K/V chunk
 * between all rows of the tile. Keys come in chunks of BN (64; 32 for the one-warp selected
 * tiles) through a cp.async pipeline (two stages; one buffer for the one-warp tiles, K and V
 * staggered in the forward), either a contiguous range per row (window / dense / compressed)
 * or, for selected attention, the ascending union of the tile positions' selected blocks,
 * each row masked to its own blocks and causally. Compile-time: padded head dims DKP / DVP
 * and the storage type; the rest is run time, smaller dims run zero-padded. */
#ifndef NSA_CUDA_ATTN_AMPERE_FWD_DQ_CUH
#define NSA_CUDA_ATTN_AMPERE_FWD_DQ_CUH

#include "tiles.h"
#include "../prim/softmax.cuh"
#include "../prim/nonfinite.cuh"
#include <limits.h>

#if defined(__CUDACC__)

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

/* Shared memory of qtile_kernel<DKP, DVP, MODE, BN>: byte offsets in carving order (rows padded
 * by 8 elements against bank conflicts); the host reserves bytes (qtile_smem, checked below).
 * The one-warp forward keeps Q in registers (no Q tile). */
template <int DKP, int DVP, int MODE, int BN> struct qtile_layout {
    static constexpr size_t NW = QTILE_NW(BN), NST = QTILE_NST(BN), BM = 16 * NW, LDK = DKP + 8, LDV = DVP + 8;
    static constexpr bool QREG = MODE == MODE_FWD && NW == 1;
    static constexpr size_t q = 0;                                      /* [BM][LDK] Q (not QREG) */
    static constexpr size_t o = q + (QREG ? 0 : BM * LDK * 2);          /* [BM][LDV] dO (dQ mode) */
    static constexpr size_t k = o + (MODE == MODE_DQ ? BM * LDV * 2 : 0); /* [NST][BN][LDK] K stages */
    static constexpr size_t v = k + NST * BN * LDK * 2;                 /* [NST][BN][LDV] V stages */
    static constexpr size_t roff = v + NST * BN * LDV * 2;              /* [BM] q row offsets */
    static constexpr size_t roff2 = roff + BM * sizeof(int64_t);        /* [BM] dout row offsets */
    static constexpr size_t desc = roff2 + BM * sizeof(int64_t);        /* [3][4] chunk c0, c1, have */
    static constexpr size_t flags = desc + 12 * 4;                      /* [3][64] rows that selected the chunk */
    static constexpr size_t bytes = flags + 3 * 64;
    static_assert(bytes == qtile_smem(DKP, DVP, NW, MODE, NST, BN), "qtile_smem reserves exactly this layout");
};

/* BN: keys per chunk, 64; 32 for the one-warp selected tiles, whose K/V buffers then take
 * half the shared memory, so more of these latency-bound CTAs fit an SM. */
template <int DKP, int DVP, typename T, int MODE, int BN>
__global__ void __launch_bounds__(128) qtile_kernel(const qparams P)
{
    if (nf_set(P.nf)) return; /* a non-finite input: the scalar kernels run this call (nonfinite.cuh) */
    constexpr int LDK = DKP + 8, LDV = DVP + 8, NT = BN / 8, KT = DKP / 16, VT = DVP / 16;
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int nw = QTILE_NW(BN), BM = nw * 16, nthr = nw * 32;
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

    constexpr int nst = QTILE_NST(BN); /* K/V stages: 2 = prefetch the next chunk during this one */
    /* one-warp forward (selected attention, G >= 16): Q fragments come straight from global
     * memory into registers, so the tile needs no Q buffer and one more CTA fits an SM (the
     * kernel is latency bound at ~5 one-warp CTAs per SM) */
    using L = qtile_layout<DKP, DVP, MODE, BN>;
    const int qreg = L::QREG;
    T *Qs = (T *)(smem + L::q), *Os = (T *)(smem + L::o);
    T *Ks = (T *)(smem + L::k), *Vs = (T *)(smem + L::v);
    int64_t *roff = (int64_t *)(smem + L::roff), *roff2 = (int64_t *)(smem + L::roff2);
    int *desc = (int *)(smem + L::desc);                       /* [3][4]: c0, c1, have (selected) */
    unsigned char *flags = (unsigned char *)(smem + L::flags); /* [3][64] */

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
    int rlo[2], rhi[2], rposl[2], rseen[2] = {0, 0}; /* rseen: the row saw a key (sc_row_finish) */
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
        it.len = sq.klen; /* (the key side: a block ends at min((j + 1) l', klen)) */
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
            rseen[x] |= mlo[x] <= mhi[x] && mlo[x] < c1 && mhi[x] >= c0;
        }
        const float f = sc_softcap<NT>(S, P.rule, P.scale, P.sl2);
        sc_mask<NT>(S, sc_chunk_whole(c0, c1, BN, mlo, mhi), c0, c1, mlo, mhi, lane);

        if constexpr (MODE == MODE_FWD) {
            sc_softmax<NT, DVP / 8>(S, m_, l_, acc, f);
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
                for (int e = 0; e < 4; e++) S[nt][e] = ex2(__fmaf_rn(S[nt][e], f, -rl2[e >> 1]));
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
            if (P.rule.cap > 0.0f) { /* the softcap's factor, read back from P (P = 2^(c2 tanh - l2)) */
                const float ic2 = sc_capbw_of(P.rule, P.scale).ic2;
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) dP[nt][e] *= sc_cap_grad(lg2(S[nt][e]) + rl2[e >> 1], ic2);
            }
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
            const int seen = rseen[x] && !(P.rule.flex_rows && l == 0.0f); /* (flex_rows: all -inf, empty) */
            const float inv = sc_row_finish(m_[x], l, seen, P.rule.sinks, P.rule.sinks_s, hq, &lse);
            sc_row_clear(acc, x, seen);
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

/* ---- launcher ---- */

template <int DKP, int DVP, typename T, int MODE, int BN>
static void launch_qtile_bn(grun *g, const qparams *P, int64_t tiles)
{
    const size_t smem = qtile_layout<DKP, DVP, MODE, BN>::bytes;
    g_smem_optin(g, (const void *)qtile_kernel<DKP, DVP, T, MODE, BN>, smem);
    if (g->err != NSA_STATUS_SUCCESS) return;
    qtile_kernel<DKP, DVP, T, MODE, BN><<<dim3((unsigned)tiles, (unsigned)P->H), QTILE_NW(BN) * 32, smem, g->st>>>(*P);
    g_launched(g);
}

template <int DKP, int DVP, typename T, int MODE>
static void launch_qtile_t(grun *g, const qparams *P, int bn, int64_t tiles)
{
    if (bn == 32) launch_qtile_bn<DKP, DVP, T, MODE, 32>(g, P, tiles);
    else launch_qtile_bn<DKP, DVP, T, MODE, 64>(g, P, tiles);
}

#endif /* __CUDACC__ */

#endif
