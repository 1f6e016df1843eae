/* selection/ampere.cuh -- select_kernel: the selection on mma.sync (sm_80 and sm_90a alike):
 * importance from recomputed compressed probabilities, summed over a position's heads, and the
 * streaming top-n per position. */
#ifndef NSA_CUDA_SELECTION_AMPERE_CUH
#define NSA_CUDA_SELECTION_AMPERE_CUH

#include "topn.cuh"
#include "../prim/softmax.cuh"

#if defined(__CUDACC__)

#define SEL_BN 64 /* compressed keys per step */

template <int DKP, typename T>
__global__ void __launch_bounds__(128) select_kernel(const sparams P)
{
    constexpr int LDK = DKP + 8, BM = 64, BN = SEL_BN, NT = BN / 8, KT = DKP / 16, LDP = BN + 1;
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
    const int sh = sq.shift; /* query row pp is position p0 + pp + sh (a query chunk; else 0) */
    const int cur_max = nsa_rule_slc_of32(p0 + npos - 1 + sh, lp);
    const int last_t = p0 + npos - 1 + sh;
    const int nv_max = nsa_rule_cmp_visible_cap32(last_t, cl, cd, sq.ncmp);
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
            rpos[r] = pos + sh; /* the row's position */                                         \
        }                                                                                        \
        __syncthreads();                                                                         \
        load_rows<T, DKP>(Qs, LDK, (const T *)P.q.p, roff, BM, P.DK, P.q.al, tid, nthr);         \
    } while (0)

    if (nhc == 1) SEL_QLOAD(0);

    /* compressed keys [iA_, iB_) overlapping selection blocks [jA_, jA_ + JC) */
#define SEL_RANGE(jA_, iA_, iB_)                                                                 \
    do {                                                                                         \
        iA_ = nsa_rule_slc_first_cmp32((jA_), cl, cd, lp);                                       \
        iB_ = nsa_rule_slc_last_cmp32((jA_) + JC - 1, cd, lp) + 1;                                \
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
                    const int nv = nsa_rule_cmp_visible32(t, cl, cd);
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
                            const int nv = nsa_rule_cmp_visible32(t, cl, cd);
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
                    const int pp = idx / JC, jj = idx % JC, j = jA + jj, t = p0 + pp + sh;
                    if (!nsa_rule_slc_visible(j, t, lp)) continue;
                    int ia = nsa_rule_slc_first_cmp32(j, cl, cd, lp), ib = nsa_rule_slc_last_cmp32(j, cd, lp) + 1;
                    ia = ia > i0 ? ia : i0;
                    ib = ib < i1 ? ib : i1;
                    float acc = 0.0f;
                    for (int i = ia; i < ib; i++) /* weighted by the tokens blocks i and j share */
                        acc += Cs[pp * BN + (i - i0)] * (float)nsa_rule_overlap32(i, j, cl, cd, lp);
                    imp[pp * JC + jj] += acc * inv_d;
                }
                __syncthreads();
            }
        }
        __syncthreads();
        sel_merge(P, imp, JC, LI, LJ, kept, NP, p0 + sh, npos, jA, JC, tid);
        __syncthreads();
    }
#undef SEL_QLOAD
#undef SEL_RANGE
#undef SEL_KLOAD
    cp_commit();
    cp_wait<0>();
    sel_write(P, sq, h, LJ, kept, NP, p0, npos, tid);
}

/* ---- launcher ---- */

template <int DKP, typename T>
static void launch_select_t(grun *g, const sparams *P, int64_t tiles)
{
    const size_t smem = select_smem(DKP, P->P, P->JC, P->n, P->HC);
    g_smem_optin(g, (const void *)select_kernel<DKP, T>, smem);
    if (g->err != NSA_STATUS_SUCCESS) return;
    select_kernel<DKP, T><<<dim3((unsigned)tiles, (unsigned)P->H), 128, smem, g->st>>>(*P);
    g_launched(g);
}

#endif /* __CUDACC__ */

#endif
