/* selection/hopper.cuh -- swg_kernel: the selection on sm_90a: 64 positions per CTA as the
 * wgmma rows, the G heads' probabilities summed in the accumulator registers, the top-n as
 * 64-bit rank keys through a register insertion network; no score matrix in memory. Q and
 * the compressed keys arrive by TMA. The kernel body exists only in the sm_90a build. */
#ifndef NSA_CUDA_SELECTION_HOPPER_CUH
#define NSA_CUDA_SELECTION_HOPPER_CUH

#include "topn.cuh"
#include "../prim/softmax.cuh"
#include "../prim/wgmma.cuh"

#if defined(__CUDACC__)

/* Rank key of candidate block j (importance v >= 0 or NaN, forced f) for position-wise top-n:
 * the order (forced, importance, lower index) of spec 3 (nsa_rule_ranks_above) as one unsigned
 * compare, since non-negative floats order as their bit patterns: a number's field is its bits
 * + 1 (the sign masked, so -0 ties +0), a NaN's is 0, below every number. 0 is no block
 * (every real key has the index field > 0). */
__device__ __forceinline__ uint64_t swg_key(int f, float v, int j)
{
    const uint64_t imp = v == v ? (uint64_t)(__float_as_uint(v) & 0x7FFFFFFFu) + 1u : 0u;
    return ((uint64_t)(f != 0) << 63) | (imp << 31) | (uint64_t)(0x7FFFFFFF - j);
}

/* c into the kept list L (best first, zeros = empty) by the branchless insertion network,
 * L[i] = max(L[i], min(c, L[i - 1])): the last entry drops out when c beats it, and c = 0
 * (no candidate) leaves L as it is. */
template <int NR>
__device__ __forceinline__ void swg_insert(uint64_t (&L)[NR], uint64_t c)
{
#pragma unroll
    for (int i = NR - 1; i > 0; i--) {
        const uint64_t lo = c < L[i - 1] ? c : L[i - 1];
        L[i] = L[i] > lo ? L[i] : lo;
    }
    L[0] = L[0] > c ? L[0] : c;
}

/* The second merge lane's list (entries at M[e * stride], best first) into L: its entries go
 * through the network until one no longer beats L's last. */
template <int NR>
__device__ __forceinline__ void swg_merge_lane(uint64_t (&L)[NR], const uint64_t *M, int stride)
{
    for (int e = 0; e < NR; e++) {
        const uint64_t c = M[e * stride];
        if (c <= L[NR - 1]) break;
        swg_insert<NR>(L, c);
    }
}

/* A position's kept blocks: the first n nonzero keys of L as block indices, entry-major at
 * LJ[k * stride] (sel_write's layout); returns how many. */
template <int NR>
__device__ __forceinline__ int swg_blocks(const uint64_t (&L)[NR], int n, int *LJ, int stride)
{
    int k = 0;
#pragma unroll
    for (int i = 0; i < NR; i++)
        if (i < n && L[i] != 0) LJ[k++ * stride] = 0x7FFFFFFF - (int)(L[i] & 0x7FFFFFFF);
    return k;
}

/* One pass of the top-n for the 32 positions of a warp (lane = position pp, its list at keys
 * [NR][MS][SWG_BP], best first, zeros = empty): the list in registers; each lane scans its own
 * candidates for the next one that beats its last entry (a compare each), and the warp runs
 * the insertion network (swg_insert) once per round, a no-op for lanes without a winner (c =
 * 0). Rounds = the most winners of any lane: all JC while the lists fill, a few once they hold
 * their top n (random scores: ~n / (keys seen) of a pass's candidates win). Keeping the top NR
 * >= n keeps the top n. MS lanes per position (half = 0 .. MS - 1) each keep the top of every
 * MS-th candidate in their own list, merged once at the end: with MS = 2 every warp of the CTA
 * merges and none waits at the barrier (one lane per position left two of four warps idle for
 * a sixth of the kernel). (Running the network for every candidate any lane could use, a warp
 * per position merging by rank counts, and one thread per position shifting a shared-memory
 * list were all slower: bench/NOTES.md.) */
template <int NR, int MS>
__device__ __forceinline__ void swg_merge_list(const sparams &P, const float *imp, int ims, uint64_t (&L)[NR], int p0, int npos,
                                               int jA, int JC, int pp, int half)
{
    const int cur = (p0 + pp) / P.lp;
    int m = cur - jA + 1 < JC ? cur - jA + 1 : JC;
    if (pp >= npos) m = 0;
    int jj = half;
    for (;;) {
        uint64_t c = 0;
        while (jj < m) {
            const int j = jA + jj;
            const uint64_t k = swg_key(nsa_rule_forced(j, cur, P.n_init, P.n_local), imp[pp * ims + jj], j);
            jj += MS;
            if (k > L[NR - 1]) {
                c = k;
                break;
            }
        }
        if (!__any_sync(0xffffffffu, c != 0)) break;
        swg_insert<NR>(L, c);
    }
}

/* The same with the list kept in shared memory between passes (keys [NR][MS][SWG_BP]). */
template <int NR, int MS>
__device__ __forceinline__ void swg_merge(const sparams &P, const float *imp, int ims, uint64_t *keys, int p0, int npos,
                                          int jA, int JC, int pp, int half)
{
    uint64_t *K = keys + half * SWG_BP + pp; /* entry i at K[i * MS * SWG_BP] */
    uint64_t L[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) L[i] = K[i * MS * SWG_BP];
    swg_merge_list<NR, MS>(P, imp, ims, L, p0, npos, jA, JC, pp, half);
#pragma unroll
    for (int i = 0; i < NR; i++) K[i * MS * SWG_BP] = L[i];
}

/* One warpgroup per CTA (two with WS, below), 64 consecutive positions of one kv head (the wgmma rows are
 * positions, not position x head as in select_kernel). A pass takes the compressed keys
 * [iA, iB) (at most SWG_NK) that overlap JC selection blocks; for each of the G heads in
 * turn, S = Q_g K^T (wgmma SS) and p += 2^(S sl2 - lse_g): the head sum of the probabilities
 * accumulates elementwise in registers, with no cross-lane reduction. The products are
 * software-pipelined in halves of 64 keys: the next half's product runs on the tensor cores
 * while this half's exponentials run. Q tiles (one head each, the same for every pass)
 * and key tiles arrive by TMA, issued by thread 0, on mbarriers: the Q tiles cycle through
 * SWG_QST stages as one stream of G uses per pass (a stage is refilled once every warp is
 * past the product that read it), so the next pass's first heads load during this pass's
 * last ones. (Loading them by cp.async was a quarter of this kernel's instructions: the
 * address work of 8 copies per thread per head.) The heads' lse sit in shared memory, read
 * once per CTA. The pass then writes p to shared memory (over the key tile, free by then),
 * folds it into block importances, issues the next pass's key tile and merges the candidates
 * into the kept lists (swg_merge, MS lanes per position) while it loads. Two CTAs per SM
 * overlap one's merges with the other's products. Keys a position cannot see (or past the
 * pass, which the key box may hold) are never read back from p. NR: list registers, 16 or 32
 * (>= n); MS: merge lanes per position (swg_merge), 2 where that still fits two CTAs per SM.
 * WS: a second warpgroup does the merge, its lists in registers for the whole kernel, while
 * the first computes the next pass: the importances are double-buffered, handed over by named
 * barriers (full: written, empty: merged), and the first warpgroup's barriers are its own; the
 * merge warpgroup writes the blocks at the end (bench/NOTES.md has the measurements). */
template <int DKP, typename T, int NR, int MS, bool WS>
__global__ void __launch_bounds__(WS ? 256 : 128, 2) swg_kernel(const sparams P, const __grid_constant__ CUtensorMap tq,
                                                     const __grid_constant__ CUtensorMap tk)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(!WS || MS == 2, "the merge warpgroup is two lanes per position");
    constexpr int BP = SWG_BP, NK = SWG_NK, NT = NK / 8, KT = DKP / 16, NTHR = WS ? 256 : 128, NQ = SWG_QST;
    constexpr int QB = BP * DKP * 2, KB = SWG_KBYTES(DKP);
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_align1024(smem_raw);
    unsigned char *Qs = smem;                /* [NQ] Q tiles of one head each */
    unsigned char *Ks = Qs + NQ * QB;        /* key tile; then p [BP][NK] f32 (swizzled) */
    float *Ps = (float *)Ks;
    const int JC = P.JC, IMS = JC | 1;       /* odd row stride: swg_merge's lanes on distinct banks */
    const int G = (int)P.G;
    uint64_t *keys = (uint64_t *)(Ks + KB);  /* [NR][MS][BP] rank keys, best first (WS: none, in registers) */
    uint64_t *qfull = keys + (WS ? 0 : NR * MS * BP); /* [NQ] a Q stage landed */
    uint64_t *kfull = qfull + NQ;            /* the pass's key tile landed */
    float *imp = (float *)(kfull + 1);       /* [BP][IMS] (WS: two, a pass's in imp + (pass & 1) BP IMS) */
    float *lsl = imp + (WS ? 2 : 1) * BP * IMS; /* [G][BP] lse * log2(e) (+inf: no keys, p = 0) */
    int *kept = (int *)(lsl + G * BP);       /* [BP] */
    int *pcur = kept + BP, *pnv = pcur + BP; /* [BP] each: block of the position, its visible keys */

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int64_t s, tile;
    seq_decode(P.sm, blockIdx.x, &s, &tile);
    const seqinfo sq = seq_get(P.sm, s);
    const int h = blockIdx.y;
    /* heaviest tiles (latest positions, most passes) first */
    tile = (sq.len + BP - 1) / BP - 1 - tile;
    const int p0 = (int)tile * BP;
    const int npos = sq.len - p0 < BP ? sq.len - p0 : BP;
    const int lp = P.lp, cl = P.cl, cd = P.cd;
    const int sh = sq.shift; /* query row p0 + r is position p0 + r + sh (a query chunk; else 0) */
    const int cur_max = nsa_rule_slc_of32(p0 + npos - 1 + sh, lp);
    const int last_t = p0 + npos - 1 + sh;
    /* the 32-bit forms: the int64 ones cost this register-bound kernel time (bench/NOTES.md) */
    const int nv_max = nsa_rule_cmp_visible_cap32(last_t, cl, cd, sq.ncmp);
    const float inv_d = 1.0f / (float)cd;
    /* this lane's two rows (positions) of its warp's 16 */
    int rp[2];
#pragma unroll
    for (int x = 0; x < 2; x++) rp[x] = warp * 16 + (lane >> 2) + x * 8;

    if (tid == 0) {
        for (int i = 0; i < NQ; i++) mb_init(&qfull[i], 1);
        mb_init(kfull, 1);
        mb_init_fence();
    }
    if (!WS)
        for (int i = tid; i < NR * MS * BP; i += NTHR) keys[i] = 0;
    if (tid < BP) {
        const int t = p0 + tid + sh;
        pcur[tid] = tid < npos ? nsa_rule_slc_of32(t, lp) : -1;
        pnv[tid] = nsa_rule_cmp_visible32(t, cl, cd);
    }
    {
        const float *lsep = (const float *)P.lse.p;
        const int64_t l0 = sq.b * P.lse.s0 + (sq.row0 + p0) * P.lse.s1 + (int64_t)h * G * P.lse.s2;
        for (int i = tid; i < G * BP; i += NTHR) {
            const int g = i / BP, r = i - g * BP;
            const float lse = r < npos ? lsep[l0 + r * P.lse.s1 + g * P.lse.s2] : -INFINITY;
            lsl[i] = lse == -INFINITY ? INFINITY : lse * NSA_LOG2E;
        }
    }

    /* compressed keys [iA_, iB_) overlapping selection blocks [jA_, jA_ + JC) */
    auto range = [&](int jA_, int *iA_, int *iB_) {
        *iA_ = nsa_rule_slc_first_cmp32(jA_, cl, cd, lp);
        const int b = nsa_rule_slc_last_cmp32(jA_ + JC - 1, cd, lp) + 1;
        *iB_ = b < nv_max ? b : nv_max;
    };
    /* the Q stream: use u is head u % G in stage u % NQ; passes without keys use none */
    int npass = 0;
    for (int jA = 0; jA <= cur_max; jA += JC) {
        int a, b;
        range(jA, &a, &b);
        npass += a < b;
    }
    const int uses = npass * G;
    auto issue_q = [&](int u_) {
        const int st = u_ % NQ, hq = h * G + u_ % G;
        mb_expect(&qfull[st], QB);
#pragma unroll
        for (int cb = 0; cb < DKP / 64; cb++)
            tma_load4(Qs + st * QB + cb * BP * 128, &tq, cb * 64, hq, (int)(sq.row0 + p0), (int)sq.b, &qfull[st]);
    };
    auto issue_k = [&](int iA_) {
        mb_expect(kfull, NK * DKP * 2);
#pragma unroll
        for (int cb = 0; cb < DKP / 64; cb++)
            tma_load4(Ks + cb * NK * 128, &tk, cb * 64, h, (int)(sq.cmp0 + iA_), (int)sq.b, kfull);
    };
    /* half x (keys 64 x .. 64 x + 63 of the tile) of S = Q K^T for use u_ into S_, left
     * running; the first half waits for the use's Q stage */
    auto product = [&](float (&S_)[NT / 2][4], int u_, int x) {
        if (x == 0) mb_wait(&qfull[u_ % NQ], (u_ / NQ) & 1);
        const unsigned char *Qw = Qs + (u_ % NQ) * QB;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            const uint64_t da = wg_desc(Qw + (kk >> 2) * BP * 128 + (kk & 3) * 32, 16, 1024);
            const uint64_t db = wg_desc(Ks + (kk >> 2) * NK * 128 + x * (NK / 2) * 128 + (kk & 3) * 32, 16, 1024);
            wgmma_op<T, NK / 2>::template ss<0>(&S_[0][0], da, db, kk > 0);
        }
        wg_commit();
    };

    int iA, iB;
    range(0, &iA, &iB);
    __syncthreads(); /* barriers initialised; lse, lists and row facts written */
    if (WS && tid >= 128) {
        /* the merge warpgroup: each pass's candidates into lists held in registers, two lanes
         * a position, while the other warpgroup computes the next pass */
        regs_dec<SWG_WS_MREGS>();
        const int t = tid - 128, pp = t % BP, half = t / BP;
        uint64_t L[NR];
#pragma unroll
        for (int i = 0; i < NR; i++) L[i] = 0;
        int pass = 0;
        for (int jA = 0; jA <= cur_max; jA += JC, pass++) {
            nb_sync(NB_SWG_FULL + (pass & 1));
            swg_merge_list<NR, MS>(P, imp + (pass & 1) * BP * IMS, IMS, L, p0 + sh, npos, jA, JC, pp, half);
            if (jA + 2 * JC <= cur_max) nb_arrive(NB_SWG_EMPTY + (pass & 1)); /* the buffer's next use is pass + 2 */
        }
        /* the products' warpgroup is past its last read of the key tile (its last pass's
         * hand-over came after it): the second lanes' lists and the blocks go there */
        uint64_t *xl = (uint64_t *)Ks;
        int *LJ = (int *)(xl + NR * BP);
        if (half == 1)
#pragma unroll
            for (int i = 0; i < NR; i++) xl[i * BP + pp] = L[i];
        nb_sync_wg(NB_SWG_MERGE);
        if (half == 0) {
            swg_merge_lane<NR>(L, xl + pp, BP);
            if (pp < npos) kept[pp] = swg_blocks<NR>(L, P.n, LJ + pp, BP);
        }
        nb_sync_wg(NB_SWG_MERGE);
        sel_write(P, sq, h, LJ, kept, BP, p0, npos, t);
        return;
    }
    if (WS) regs_inc<SWG_WS_PREGS>();
    /* the products' threads' barrier: the CTA's, or with WS the first warpgroup's */
    auto sync_p = [&]() {
        if (WS) nb_sync_wg(NB_SWG_PRODUCTS);
        else __syncthreads();
    };
    if (tid == 0) {
        for (int x = 0; x < NQ && x < uses; x++) issue_q(x);
        if (iA < iB) issue_k(iA);
    }
    int u = 0, kp = 0; /* next Q use, key tiles consumed */
    int pass = 0;
    for (int jA = 0; jA <= cur_max; jA += JC, pass++) {
        float *const impb = imp + (WS ? (pass & 1) * BP * IMS : 0);
        if (iA < iB) {
            float acc[NT][4];
#pragma unroll
            for (int i = 0; i < NT; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
            mb_wait(kfull, kp & 1);
            kp++;
            /* Each head's product in two halves of 64 keys, issued one ahead: a half's
             * exponentials run while the next half's product does. Two heads per iteration,
             * every product waited for by its end: carrying one across the loop's back edge
             * made ptxas serialise every wgmma (C7514), so one half in four runs its
             * exponentials alone (the other CTA on the SM fills that gap). */
            float SA[NT / 2][4], SB[NT / 2][4];
            auto exps = [&](float (&S_)[NT / 2][4], int x, int g) {
                const float l2[2] = {lsl[g * BP + rp[0]], lsl[g * BP + rp[1]]};
#pragma unroll
                for (int nt = 0; nt < NT / 2; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        acc[x * (NT / 2) + nt][e] += ex2(fmaf(S_[nt][e], P.sl2, -l2[e >> 1]));
            };
            /* use uu's stage is free once every warp is past its second half */
            auto release = [&](int uu) {
                sync_p();
                if (tid == 0 && uu + NQ < uses) issue_q(uu + NQ);
            };
            int g = 0;
            for (; g + 1 < G; g += 2, u += 2) { /* two heads: only the last half's exponentials run alone */
                product(SA, u, 0);
                product(SB, u, 1);
                wg_wait<1>();
                exps(SA, 0, g);
                product(SA, u + 1, 0);
                wg_wait<1>();
                release(u);
                exps(SB, 1, g);
                product(SB, u + 1, 1);
                wg_wait<1>();
                exps(SA, 0, g + 1);
                wg_wait<0>();
                release(u + 1);
                exps(SB, 1, g + 1);
            }
            if (g < G) { /* odd G: the last head alone */
                product(SA, u, 0);
                product(SB, u, 1);
                wg_wait<1>();
                exps(SA, 0, g);
                wg_wait<0>();
                release(u);
                exps(SB, 1, g);
                u++;
            }
            /* (the last step's barrier came after every product of the pass: the key tile
             * becomes p) */
            /* p[r][c] at r * NK + (c ^ 8 (r % 4)): the float2 stores of a half-warp (rows
             * r..r+3) fall in distinct banks */
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int x = 0; x < 2; x++) {
                    const int r = rp[x], c = (nt * 8 + 2 * (lane & 3)) ^ ((r & 3) << 3);
                    *(float2 *)(Ps + r * NK + c) = make_float2(acc[nt][2 * x], acc[nt][2 * x + 1]);
                }
            sync_p();
            if (WS && pass >= 2) nb_sync(NB_SWG_EMPTY + (pass & 1)); /* the merge is done with pass - 2's importances */
            /* importance of block j for position t: p of each compressed key i < nv(t) it
             * overlaps, times the shared tokens / d (spec 3). Lane = block (its keys [ia, ib)
             * are the same for every position, cut at each one's nv), warps over positions:
             * the divisions run once per block and pass, not per (position, block) pair
             * (integer work was a third of this kernel's instructions). */
            for (int jj = lane; jj < JC; jj += 32) {
                const int j = jA + jj, jlo = j * lp, jhi = jlo + lp;
                int ia = nsa_rule_slc_first_cmp32(j, cl, cd, lp), ib = nsa_rule_slc_last_cmp32(j, cd, lp) + 1;
                ia = ia > iA ? ia : iA;
                ib = ib < iB ? ib : iB;
                if (ib - ia <= SWG_WMAX) {
                    /* the block's overlaps (nsa_rule_overlap, the same for every position) in registers */
                    float w[SWG_WMAX];
#pragma unroll
                    for (int q = 0; q < SWG_WMAX; q++) {
                        const int x = (ia + q) * cd, lo = x > jlo ? x : jlo, hi = x + cl < jhi ? x + cl : jhi;
                        w[q] = (float)(hi - lo);
                    }
#pragma unroll 4
                    for (int pp = warp; pp < npos; pp += 4) {
                        if (j <= pcur[pp]) {
                            const int e = (ib < pnv[pp] ? ib : pnv[pp]) - ia, sw = (pp & 3) << 3;
                            const float *row = Ps + pp * NK;
                            float a = 0.0f;
#pragma unroll
                            for (int q = 0; q < SWG_WMAX; q++)
                                if (q < e) a += row[(ia + q - iA) ^ sw] * w[q];
                            impb[pp * IMS + jj] = a * inv_d;
                        }
                    }
                    continue;
                }
                for (int pp = warp; pp < npos; pp += 4) {
                    if (j > pcur[pp]) continue;
                    const int e = ib < pnv[pp] ? ib : pnv[pp], sw = (pp & 3) << 3;
                    float a = 0.0f;
                    for (int i = ia, x = ia * cd; i < e; i++, x += cd) {
                        const int lo = x > jlo ? x : jlo, hi = x + cl < jhi ? x + cl : jhi;
                        a += Ps[pp * NK + ((i - iA) ^ sw)] * (float)(hi - lo);
                    }
                    impb[pp * IMS + jj] = a * inv_d;
                }
            }
            fence_async_smem(); /* the generic reads and writes of p before the next key box */
        } else {
            if (WS && pass >= 2) nb_sync(NB_SWG_EMPTY + (pass & 1));
            for (int idx = tid; idx < npos * JC; idx += 128) impb[(idx / JC) * IMS + idx % JC] = 0.0f;
        }
        sync_p(); /* imp written; p read: the tile is free for the next pass */
        if (WS) nb_arrive(NB_SWG_FULL + (pass & 1)); /* to the merge warpgroup */
        const int jn = jA + JC;
        int nA = 0, nB = 0;
        if (jn <= cur_max) {
            range(jn, &nA, &nB);
            if (tid == 0 && nA < nB) issue_k(nA);
        }
        if (!WS) {
            if (tid < MS * BP) swg_merge<NR, MS>(P, imp, IMS, keys, p0 + sh, npos, jA, JC, tid % BP, tid / BP);
            __syncthreads();
        }
        iA = nA, iB = nB;
    }
    if (WS) return; /* the merge warpgroup writes the blocks */
    /* the first n keys (nonzero ones: blocks) as block indices, entry-major over the keys;
     * with MS = 2 the second list's entries (best first) go through the network into the
     * first until one no longer beats its last */
    uint64_t L[NR];
    if (tid < BP) {
#pragma unroll
        for (int i = 0; i < NR; i++) L[i] = keys[i * MS * BP + tid];
        for (int x = 1; x < MS; x++) swg_merge_lane<NR>(L, keys + x * BP + tid, MS * BP);
    }
    __syncthreads();
    int *LJ = (int *)keys;
    if (tid < npos) kept[tid] = swg_blocks<NR>(L, P.n, LJ + tid, BP);
    sel_write(P, sq, h, LJ, kept, BP, p0, npos, tid);
#endif
}

template <int DKP, typename T, int NR, int MS, bool WS>
static void launch_swg_nr(grun *g, const sparams *P, int64_t tiles, const void *maps)
{
    const size_t smem = swg_smem(DKP, P->JC, NR, MS, (int)P->G, WS);
    g_smem_optin(g, (const void *)swg_kernel<DKP, T, NR, MS, WS>, smem);
    if (g->err != NSA_STATUS_SUCCESS) return;
    const CUtensorMap *m = (const CUtensorMap *)maps;
    swg_kernel<DKP, T, NR, MS, WS><<<dim3((unsigned)tiles, (unsigned)P->H), WS ? 256 : 128, smem, g->st>>>(*P, m[0], m[1]);
    g_launched(g);
}

/* rank-list length NR, merge lanes MS and the merge's own warpgroup (ws) as planned (selection/plan.c) */
template <int DKP, typename T>
static void launch_swg_t(grun *g, const sparams *P, int nr, int ms, int ws, int64_t tiles, const void *maps)
{
    if (nr == 16 && ms == 2 && ws) launch_swg_nr<DKP, T, 16, 2, true>(g, P, tiles, maps);
    else if (nr == 16 && ms == 2) launch_swg_nr<DKP, T, 16, 2, false>(g, P, tiles, maps);
    else if (nr == 16) launch_swg_nr<DKP, T, 16, 1, false>(g, P, tiles, maps);
    else launch_swg_nr<DKP, T, 32, 1, false>(g, P, tiles, maps);
}

#endif /* __CUDACC__ */

#endif
