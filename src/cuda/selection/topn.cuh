/* selection/topn.cuh -- pieces of the top-n shared by both selection kernels: the streaming
 * merge of a pass's candidates and the write of a position's kept blocks. */
#ifndef NSA_CUDA_SELECTION_TOPN_CUH
#define NSA_CUDA_SELECTION_TOPN_CUH

#include "selection.h"
#include <limits.h>

#if defined(__CUDACC__)

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

/* One pass of the streaming top-n (spec 3), one thread per position p0 + pp, pp < npos: candidates
 * jA .. jA + JC - 1 (importance imp[pp * ims + jj]) enter the position's kept list, best first
 * (entry i at LI[i * NP + pp] importance, LJ[i * NP + pp] block; kept[pp] entries), by
 * insertion in the order (forced, importance, index). That order is total, so the list is
 * exactly the CPU's (cpu/select.c) whatever the pass boundaries. With random importances few
 * candidates beat the last kept entry once the list is full, so most cost one comparison; the
 * entry-major layout and an odd ims keep a warp's 32 positions on distinct banks (a warp per
 * position merging by rank counts was much slower: bench/NOTES.md). */
__device__ __forceinline__ void sel_merge(const sparams &P, const float *imp, int ims, float *LI, int *LJ, int *kept, int NP,
                                          int p0, int npos, int jA, int JC, int pp)
{
    if (pp >= npos) return;
    const int n = P.n, cur = nsa_rule_slc_of32(p0 + pp, P.lp);
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

#endif /* __CUDACC__ */

#endif
