/* selected/hopper_fwd_dq.cuh -- sfw_kernel: selected attention forward and dQ on sm_90a
 * (DK = DV = 64 / 128, G >= 4): one warp per 16 heads of one position (two neighbouring
 * positions per CTA when G <= 16, sharing the stages of the blocks both selected; at G = 4,
 * and for dQ at G = 8, a warp's rows are 16 / G positions over the union of their blocks), K /
 * V by TMA in 32-key stages, mma.sync from the swizzled tiles. The kernel body exists only in
 * the sm_90a build. */
#ifndef NSA_CUDA_SELECTED_HOPPER_FWD_DQ_CUH
#define NSA_CUDA_SELECTED_HOPPER_FWD_DQ_CUH

#include "selected.h"
#include "../prim/softmax.cuh"
#include "../prim/wgmma.cuh"
#include "../prim/nonfinite.cuh"
#include <limits.h>

#if defined(__CUDACC__)

/* ==== sfw_kernel helpers: one warp's mma.sync products on the swizzled TMA tiles ========== */

/* C = A B^T for the warp's 16 rows: A fragments in registers (KT steps of 16 columns), B the
 * BN rows of a swizzled tile (S = Q K^T, dP = dO V^T) */
template <typename T, int NT, int KT, int BN>
__device__ __forceinline__ void sfw_abt(float (&C)[NT][4], const uint32_t (&A)[KT][4], const unsigned char *B, int lane)
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++) C[nt][0] = C[nt][1] = C[nt][2] = C[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KT; kk++)
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t b[4];
            const int r = np * 16 + (lane & 7) + (lane >> 4) * 8;
            ldsm4(b, B + sw_off(BN, r, kk * 2 + ((lane >> 3) & 1)));
            dtraits<T>::mma(C[2 * np], A[kk], b[0], b[1]);
            dtraits<T>::mma(C[2 * np + 1], A[kk], b[2], b[3]);
        }
}

/* acc += P B for the warp's 16 rows: P the fp32 scores of the chunk's BN keys (as A
 * fragments), B the chunk's swizzled tile read transposed (O += P V, dQ += dS K) */
template <typename T, int NT, int KT, int BN>
__device__ __forceinline__ void sfw_pb(float (&acc)[2 * KT][4], const float (&Pm)[NT][4], const unsigned char *B, int lane)
{
#pragma unroll
    for (int k2 = 0; k2 < NT / 2; k2++) {
        uint32_t a[4];
        sc_frag_a<T>(a, Pm[2 * k2], Pm[2 * k2 + 1]);
#pragma unroll
        for (int vp = 0; vp < KT; vp++) {
            uint32_t b[4];
            const int r = k2 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            ldsm4t(b, B + sw_off(BN, r, vp * 2 + (lane >> 4)));
            dtraits<T>::mma(acc[2 * vp], a, b[0], b[1]);
            dtraits<T>::mma(acc[2 * vp + 1], a, b[2], b[3]);
        }
    }
}

/* ==== sfw_kernel: selected attention, forward and dQ, TMA ===================================
 * One warp per CTA: 16 query heads g0 .. g0 + 15 of one position (heads past G are padding
 * rows: at G = 4 three quarters of the products are wasted, but the branch is bound by moving
 * each position's blocks, which a tile over several positions would multiply by the union of
 * their selections) against the blocks that position selected. Their K / V arrive in chunks of BN keys through
 * TMA (4-D tensor maps over the [B, T, H, D] views, 128-byte swizzle, built by the host) into
 * NS stages, NS - 1 chunks ahead of the products, each stage completing on its own mbarrier:
 * the copy engine moves the bytes while the warp computes, where qtile's one warp spent its
 * issue slots on 16-byte cp.async copies and its barriers. The
 * products stay mma.sync (16 rows are one m16 tile; wgmma needs 64), reading the swizzled
 * tiles with ldmatrix at swizzled addresses (conflict-free: 8 rows, one chunk each). Same
 * arithmetic as qtile's path (scores, masks, online softmax, epilogue).
 * RP > 1 (G = 16 / RP, i.e. 4 or 8): each warp's 16 rows are RP neighbouring positions x G
 * heads instead of one position's 16 (padded) heads, walking the union of their blocks, rows
 * of a position that did not select a chunk's block masked: at G = 4 the union of four
 * positions (~55 blocks with random selections: the forced ones shared) is fewer K / V bytes
 * than four 16-block walks, and no padding rows. NP positions per CTA, NP / RP warps of rows.
 * KS > 1 (forward): KS warps share each warp's rows and take alternate chunks of the walk,
 * each with its own running max / sum / accumulators, combined at the end in a fixed order:
 * the union's ~55 chunks at G = 4 are a chain of online-softmax steps that one warp per CTA
 * ran latency-bound. */
/* Shared memory of sfw_kernel<DP, BN, NS>: byte offsets from the 1024-aligned base; the host
 * reserves bytes + 1024 (sfw_smem, checked below). */
template <int DP, int BN, int NS> struct sfw_layout {
    static constexpr size_t TB = (size_t)BN * DP * 2;            /* K or V of a chunk */
    static constexpr size_t k = 0, v = k + NS * TB;              /* [NS] K, V stages */
    static constexpr size_t full = v + NS * TB;                  /* [NS] the chunk landed */
    static constexpr size_t empty = full + NS * sizeof(uint64_t); /* [NS] every warp is done with the stage */
    static constexpr size_t bytes = empty + NS * sizeof(uint64_t);
    static_assert(bytes + 1024 == sfw_smem(DP, BN, NS), "sfw_smem reserves exactly this layout");
};

template <int DP, typename T, int MODE, int BN, int NS, int NP, int RP, int KS>
__global__ void __launch_bounds__(32 * (NP / RP) * KS) sfw_kernel(const qparams P, const __grid_constant__ CUtensorMap tk,
                                                      const __grid_constant__ CUtensorMap tv)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if (nf_set(P.nf)) return; /* a non-finite input: the scalar kernels run this call (nonfinite.cuh) */
    constexpr int NT = BN / 8, KT = DP / 16, TB = BN * DP * 2; /* tile bytes (K or V of a chunk) */
    constexpr bool DQ = MODE == MODE_DQ;
    constexpr int W = NP / RP, GR = 16 / RP; /* warps; rows per position in a warp's 16 */
    using L = sfw_layout<DP, BN, NS>;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_align1024(smem_raw);
    unsigned char *Ks = smem + L::k, *Vs = smem + L::v;
    uint64_t *full = (uint64_t *)(smem + L::full), *empty = (uint64_t *)(smem + L::empty);
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) / KS, ks = (threadIdx.x >> 5) % KS;
    int64_t s, tile;
    seq_decode(P.sm, blockIdx.x, &s, &tile);
    const seqinfo sq = seq_get(P.sm, s);
    const int h = blockIdx.y;
    /* NP = 1: tile = position * ceil(G / 16) + head group, heads g0 .. g0 + 15, those >= G
     * padding (zero Q rows, nothing written). NP > 1 (G <= 16): tile = NP neighbouring
     * positions, one warp each, sharing the stages of the blocks they both selected (the
     * forced first and local blocks at least): fewer K / V bytes from L2, the bound. */
    const int64_t G = P.G, ngr = NP == 1 ? (G + 15) / 16 : 1;
    const int t0 = (int)(tile / ngr) * NP, t = t0 + warp * RP; /* the warp's first row */
    const int64_t g0 = (tile % ngr) * 16;
    const int rows = G - g0 < 16 ? (int)(G - g0) : 16;
    const int lp = P.rule.lp, nsub = (lp + BN - 1) / BN;
    const int sh = P.rule.shift; /* query row t is position t + sh (a query chunk; else 0) */
    const int wpos = t + sh;     /* the warp's first position */
    /* the usable-block lists (ascending) of the CTA's positions; none past the sequence */
    const int32_t *U[NP];
    int cnt[NP], tp[NP], tpos[NP]; /* the positions' rows and positions (row + sh) */
#pragma unroll
    for (int w = 0; w < NP; w++) {
        tp[w] = t0 + w;
        tpos[w] = tp[w] + sh;
        const int64_t uid = (sq.b * P.T + sq.row0 + tp[w]) * P.H + h;
        U[w] = P.U + uid * P.m;
        cnt[w] = tp[w] < sq.len ? P.ucnt[uid] : 0;
    }

    if (threadIdx.x == 0) {
        for (int i = 0; i < NS; i++) {
            mb_init(&full[i], 1);
            mb_init(&empty[i], 32 * W * KS);
        }
        mb_init_fence();
    }
    __syncthreads();

    /* the chunk sequence: sub-chunks of each block of the lists' union (ascending) that start
     * at or before the last position that selected it; walked by the producer (NS - 1 ahead)
     * and by every warp, which computes the chunks its own position needs (mask bit) */
    struct walk {
        int u[NP], sub;
    };
    auto next = [&](walk &w, int *c0, int *bend, int *mask) -> bool {
        for (;;) {
            int j = INT_MAX;
#pragma unroll
            for (int x = 0; x < NP; x++)
                if (w.u[x] < cnt[x]) j = min(j, U[x][w.u[x]]);
            if (j == INT_MAX) return false;
            const int c = j * lp + w.sub * BN;
            int m = 0;
#pragma unroll
            for (int x = 0; x < NP; x++)
                if (w.u[x] < cnt[x] && U[x][w.u[x]] == j && c <= tpos[x]) m |= 1 << x;
            const bool last = w.sub + 1 >= nsub || !m;
            if (m) *c0 = c, *bend = j * lp + lp, *mask = m, w.sub++;
            if (last) {
#pragma unroll
                for (int x = 0; x < NP; x++)
                    if (w.u[x] < cnt[x] && U[x][w.u[x]] == j) w.u[x]++;
                w.sub = 0;
            }
            if (m) return true;
        }
    };
    auto issue = [&](int st, int c0) {
        mb_expect(&full[st], 2 * TB);
#pragma unroll
        for (int cb = 0; cb < DP / 64; cb++) {
            tma_load4(Ks + st * TB + cb * BN * 128, &tk, cb * 64, h, (int)(sq.row0 + c0), (int)sq.b, &full[st]);
            tma_load4(Vs + st * TB + cb * BN * 128, &tv, cb * 64, h, (int)(sq.row0 + c0), (int)sq.b, &full[st]);
        }
    };
    const bool producer = threadIdx.x == 0;
    walk pw, cw;
#pragma unroll
    for (int x = 0; x < NP; x++) pw.u[x] = cw.u[x] = 0;
    pw.sub = cw.sub = 0;
    int pc0, pend, pmask;
    if (producer)
        for (int i = 0; i < NS - 1; i++)
            if (next(pw, &pc0, &pend, &pmask)) issue(i, pc0);
    const bool live = t < sq.len; /* (a warp past the sequence walks along, computing nothing) */
    /* this lane's rows (lane / 4, + 8): position index in the warp, position, head, realness
     * (padding heads past G, or positions past the sequence: zero Q / dO, nothing written) */
    int rpx[2], rt[2], rpos[2];
    int64_t rhq[2];
    bool rreal[2];
#pragma unroll
    for (int x = 0; x < 2; x++) {
        const int r = (lane >> 2) + x * 8;
        rpx[x] = r / GR, rt[x] = t + rpx[x], rpos[x] = rt[x] + sh, rhq[x] = h * G + g0 + r % GR;
        rreal[x] = rt[x] < sq.len && r % GR < rows;
    }

    /* A fragments of Q (and dO) straight from global memory (qtile's qreg layout): a[i] = row
     * lane / 4 (+ 8 for odd i), columns 2 (lane % 4) (+ 8 for i >= 2) and the next one */
    uint32_t qf[KT][4], of[DQ ? KT : 1][4];
    {
        const unsigned short *qp = (const unsigned short *)P.q.p, *op = (const unsigned short *)P.dout.p;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int x = i & 1;
            const int64_t qo = sq.b * P.q.s0 + (sq.row0 + rt[x]) * P.q.s1 + rhq[x] * P.q.s2;
            const int64_t oo = DQ ? sq.b * P.dout.s0 + (sq.row0 + rt[x]) * P.dout.s1 + rhq[x] * P.dout.s2 : 0;
#pragma unroll
            for (int kk = 0; kk < KT; kk++) {
                const int c = kk * 16 + (i >> 1) * 8 + 2 * (lane & 3);
                qf[kk][i] = rreal[x] ? qp[qo + c] | (uint32_t)qp[qo + c + 1] << 16 : 0u;
                if constexpr (DQ) of[kk][i] = rreal[x] ? op[oo + c] | (uint32_t)op[oo + c + 1] << 16 : 0u;
            }
        }
    }
    float rl2[2] = {0.0f, 0.0f}, rD[2] = {0.0f, 0.0f}, rg[2] = {1.0f, 1.0f};
    if constexpr (DQ) {
#pragma unroll
        for (int x = 0; x < 2; x++) {
            if (!rreal[x]) continue; /* padding: dO rows and D are 0, so dS = 0 */
            const int64_t hq = rhq[x], flat = (sq.b * P.T + sq.row0 + rt[x]) * P.HQ + hq;
            const float lse = ((const float *)P.lse.p)[sq.b * P.lse.s0 + (sq.row0 + rt[x]) * P.lse.s1 + hq * P.lse.s2];
            rl2[x] = lse == -INFINITY ? INFINITY : lse * NSA_LOG2E;
            rD[x] = P.Dw[flat];
            rg[x] = P.gw ? P.gw[flat] : 1.0f;
        }
    }
    float acc[DP / 8][4];
#pragma unroll
    for (int i = 0; i < DP / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    float m_[2] = {-INFINITY, -INFINITY}, l_[2] = {0.0f, 0.0f};
    const int lo2[2] = {0, 0};

    int c0, bend, mask;
    for (int ci = 0; next(cw, &c0, &bend, &mask); ci++) {
        /* refill the stage chunk ci - 1 used, once every warp released it */
        if (producer && next(pw, &pc0, &pend, &pmask)) {
            const int rs = (ci + NS - 1) % NS;
            if (ci >= 1) mb_wait(&empty[rs], ((ci - 1) / NS) & 1);
            issue(rs, pc0);
        }
        const int st = ci % NS;
        /* every warp waits for every chunk, needed or not: a parity wait on a barrier two
         * phases ahead would pass */
        mb_wait(&full[st], (ci / NS) & 1);
        const int wm = (mask >> (warp * RP)) & ((1 << RP) - 1); /* this warp's positions that need it */
        if (!wm || ci % KS != ks) {
            mb_arrive(&empty[st]);
            continue;
        }
        const unsigned char *Kp = Ks + st * TB, *Vp = Vs + st * TB;

        float S[NT][4];
        sfw_abt<T, NT, KT, BN>(S, qf, Kp, lane);
        const int c1 = c0 + BN < bend ? c0 + BN : bend;
        /* rows of a position that did not select this block see none of its keys */
        const int hi2[2] = {wm >> rpx[0] & 1 ? rpos[0] : -1, wm >> rpx[1] & 1 ? rpos[1] : -1};
        const int full = c1 - c0 == BN && wm == (1 << RP) - 1 && c1 - 1 <= wpos;
        sc_mask<NT>(S, full, c0, c1, lo2, hi2, lane);
        if constexpr (!DQ) {
            sc_softmax<NT, DP / 8>(S, m_, l_, acc, P.sl2);
            sfw_pb<T, NT, KT, BN>(acc, S, Vp, lane);
        } else {
            /* P from the saved lse; dP = dO V^T; dS = P (g dP - D); dQ += dS K */
            float dP[NT][4];
            sfw_abt<T, NT, KT, BN>(dP, of, Vp, lane);
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    dP[nt][e] = ex2(__fmaf_rn(S[nt][e], P.sl2, -rl2[e >> 1])) * (dP[nt][e] * rg[e >> 1] - rD[e >> 1]);
            sfw_pb<T, NT, KT, BN>(acc, dP, Kp, lane);
        }
        fence_async_smem(); /* this thread's ldmatrix reads before the stage's next TMA write */
        mb_arrive(&empty[st]);
    }
    if constexpr (KS > 1) {
        static_assert(!DQ, "split chunks are the forward's (dQ on two warps is slower: selected/plan.c)");
        /* every chunk landed and was read by every warp: the stages hold the partner warps'
         * state, [value][lane] (acc, then m and l), merged into split 0's in split order */
        constexpr int NV = DP / 2 + 4;
        float *xs = (float *)Ks + warp * (KS - 1) * NV * 32;
        __syncthreads();
        if (ks > 0) {
            float *mine = xs + (ks - 1) * NV * 32 + lane;
#pragma unroll
            for (int d = 0; d < DP / 8; d++)
#pragma unroll
                for (int e = 0; e < 4; e++) mine[(d * 4 + e) * 32] = acc[d][e];
#pragma unroll
            for (int x = 0; x < 2; x++) mine[(DP / 2 + x) * 32] = m_[x], mine[(DP / 2 + 2 + x) * 32] = l_[x];
        }
        __syncthreads();
        if (ks > 0) return;
        for (int k = 1; k < KS; k++) {
            const float *other = xs + (k - 1) * NV * 32 + lane;
#pragma unroll
            for (int x = 0; x < 2; x++) {
                const float m1 = other[(DP / 2 + x) * 32], l1 = other[(DP / 2 + 2 + x) * 32];
                const float mn = fmaxf(m_[x], m1), mu = mn == -INFINITY ? 0.0f : mn;
                const float a0 = ex2(m_[x] - mu), a1 = ex2(m1 - mu);
                m_[x] = mn, l_[x] = l_[x] * a0 + l1 * a1;
#pragma unroll
                for (int d = 0; d < DP / 8; d++)
#pragma unroll
                    for (int e = 2 * x; e < 2 * x + 2; e++) acc[d][e] = acc[d][e] * a0 + other[(d * 4 + e) * 32] * a1;
            }
        }
    }
    if (!live) return;

    /* epilogue (qtile's) */
#pragma unroll
    for (int x = 0; x < 2; x++) {
        const int64_t hq = rhq[x];
        const int tr = rt[x];
        if (!rreal[x]) { /* padding rows: nothing to write (shuffles below stay uniform) */
            if constexpr (!DQ) (void)sc_quad_sum(l_[x]);
            continue;
        }
        if constexpr (DQ) {
            float *dq = P.dq + ((sq.b * P.T + sq.row0 + tr) * P.HQ + hq) * P.DK;
#pragma unroll
            for (int d = 0; d < DP / 8; d++) {
                float2 *q2 = (float2 *)(dq + d * 8 + 2 * (lane & 3));
                const float2 o = *q2;
                *q2 = make_float2(o.x + acc[d][2 * x] * P.scale, o.y + acc[d][2 * x + 1] * P.scale);
            }
        } else {
            const float l = sc_quad_sum(l_[x]);
            float lse;
            int seen = 0; /* the row's position has a usable block (its lists hold no future one) */
#pragma unroll
            for (int w = 0; w < NP; w++) seen |= w == warp * RP + rpx[x] && cnt[w] > 0;
            const float inv = sc_row_finish(m_[x], l, seen, nullptr, 0, hq, &lse);
            sc_row_clear(acc, x, seen);
            const int64_t ob = sq.b * P.o.s0 + (sq.row0 + tr) * P.o.s1 + hq * P.o.s2;
#pragma unroll
            for (int d = 0; d < DP / 8; d++) {
                const int col = d * 8 + 2 * (lane & 3);
                if (P.o.dt == NSA_DTYPE_F32) *(float2 *)((float *)P.o.p + ob + col) = make_float2(acc[d][2 * x] * inv, acc[d][2 * x + 1] * inv);
                else *(uint32_t *)((T *)P.o.p + ob + col) = dtraits<T>::pack(acc[d][2 * x] * inv, acc[d][2 * x + 1] * inv);
            }
            if ((lane & 3) == 0 && P.lse.p) ((float *)P.lse.p)[sq.b * P.lse.s0 + (sq.row0 + tr) * P.lse.s1 + hq * P.lse.s2] = lse;
        }
    }
#endif
}

/* ---- launchers ---- */

template <int DP, typename T, int MODE, int BN, int NS, int NP, int RP = 1, int KS = 1>
static void launch_sfw_t(grun *g, const qparams *P, int64_t tiles, const void *tk, const void *tv)
{
    const size_t smem = sfw_layout<DP, BN, NS>::bytes + 1024;
    auto kern = sfw_kernel<DP, T, MODE, BN, NS, NP, RP, KS>;
    g_smem_optin(g, (const void *)kern, smem);
    if (g->err != NSA_STATUS_SUCCESS) return;
    kern<<<dim3((unsigned)tiles, (unsigned)P->H), 32 * (NP / RP) * KS, smem, g->st>>>(*P, *(const CUtensorMap *)tk,
                                                                         *(const CUtensorMap *)tv);
    g_launched(g);
}

template <int DP, typename T, int MODE>
static void launch_sfw_m(grun *g, const qparams *P, const cu_slc_plan *pl, int64_t tiles, const void *tk, const void *tv)
{
    /* union tiles (selected/plan.c): forward at G = 4 on two warps taking alternate chunks;
     * dQ at G = 4 / 8 on one warp of four / two positions */
    if constexpr (MODE == MODE_FWD) {
        if (pl->rp == 4) return launch_sfw_t<DP, T, MODE, 32, 2, 4, 4, 2>(g, P, tiles, tk, tv);
    } else {
        if (pl->rp == 4) return launch_sfw_t<DP, T, MODE, 32, 2, 4, 4>(g, P, tiles, tk, tv);
        if (pl->rp == 2) return launch_sfw_t<DP, T, MODE, 32, 2, 2, 2>(g, P, tiles, tk, tv);
    }
    if (pl->nw == 2) launch_sfw_t<DP, T, MODE, 32, 2, 2>(g, P, tiles, tk, tv); /* two positions per CTA */
#if NSA_CUDA_EXPERIMENTAL /* the chunk shapes kept for comparisons (NSA_CUDA_SLC_BN) */
    else if (pl->bn == 64) launch_sfw_t<DP, T, MODE, 64, 2, 1>(g, P, tiles, tk, tv);
    else if (pl->nst == 3) launch_sfw_t<DP, T, MODE, 32, 3, 1>(g, P, tiles, tk, tv);
#endif
    else launch_sfw_t<DP, T, MODE, 32, 2, 1>(g, P, tiles, tk, tv);
}

#endif /* __CUDACC__ */

#endif
