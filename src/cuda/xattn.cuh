/* xattn.cuh -- the attention op with every option of nsa.h section 5 on the GPU: Tq != Tk
 * (bottom-right aligned), separate q / k packings, logit softcap, sinks, segment ids, additive
 * bias (and its gradient), boolean mask, Philox dropout; head dims up to 256. The plain calls
 * (no option, dims the engine has) keep the tuned tiles of engine.cuh / hopper.cuh; these
 * kernels are the general path (mma.sync m16n8k16, sm_80 and sm_90a alike):
 *
 *   xfwd_kernel  64 query rows of one query head per CTA (16 per warp), online softmax over
 *                chunks of 64 keys: o, lse (sinks join the denominator at the end).
 *   xdq_kernel   the same tiling: recomputes P, dP and dS = P (z dP - D); dQ, and the score
 *                gradient into the fp32 dbias accumulator. When dbias broadcasts over the
 *                batch or the heads, one CTA loops over every member that shares its
 *                elements, in a fixed order: no atomics, bitwise deterministic.
 *   xdkv_kernel  64 keys of one kv head per CTA (16 per warp) visit every query row of the G
 *                heads that may see them, in chunks: dK and dV (at DP 256 in two passes,
 *                whose accumulators would not fit together in registers).
 *
 * Every score goes through x_pair (window, segments, mask, softcap, bias, in the order of
 * nsa.h), every dropout factor through x_keep (src/philox.h): forward and backward see the
 * same scores and the same mask as the CPU backend. */
#ifndef NSA_CUDA_XATTN_CUH
#define NSA_CUDA_XATTN_CUH

#include "engine.cuh"
#include "../philox.h"

/* One sequence of the call: batch index, first packed query / key row, lengths. */
typedef struct xseq {
    int64_t b, q0, k0;
    int qlen, klen;
} xseq;

__device__ __forceinline__ xseq xseq_get(const xparams &P, int64_t s)
{
    xseq q;
    if (P.cuq) {
        q.b = 0;
        q.q0 = P.cuq[s], q.qlen = (int)(P.cuq[s + 1] - q.q0);
        q.k0 = P.cuk[s], q.klen = (int)(P.cuk[s + 1] - q.k0);
    } else {
        q.b = s;
        q.q0 = q.k0 = 0;
        q.qlen = (int)P.Tq, q.klen = (int)P.Tk;
    }
    return q;
}

/* This CTA's sequence and tile: a dense batch has one sequence per grid z; packed ones a
 * device prefix of tiles (empty sequences own none). */
__device__ __forceinline__ void x_task(const xparams &P, int64_t *s, int64_t *tile)
{
    if (!P.first) {
        *s = blockIdx.z;
        *tile = blockIdx.x;
        return;
    }
    const int64_t task = blockIdx.x;
    int64_t lo = 0, hi = P.nseq - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (P.first[mid + 1] <= task) lo = mid + 1;
        else hi = mid;
    }
    *s = lo;
    *tile = task - P.first[lo];
}

/* Window of local query i before the emptiness test: keys [*a, *b] clamped to the sequence
 * (*b < *a: none); both never decrease in i, so a tile's keys are [a(first), b(last)].
 * Windows wider than the sequence are clamped first, so nothing overflows. */
__device__ __forceinline__ void x_range(const xparams &P, int qlen, int klen, int i, int64_t *a, int64_t *b)
{
    const int64_t d = (int64_t)i + klen - qlen, span = (int64_t)klen + qlen;
    const int64_t lo = (P.wl < 0 || P.wl > span) ? 0 : d - P.wl;
    const int64_t hi = P.causal ? d : ((P.wr < 0 || P.wr > span) ? (int64_t)klen - 1 : d + P.wr);
    *a = lo < 0 ? 0 : lo;
    *b = hi > klen - 1 ? klen - 1 : hi;
}

/* The same as int bounds of one row, [lo, hi] = [1, 0] when it sees no key. */
__device__ __forceinline__ void x_bounds(const xparams &P, int qlen, int klen, int i, int *lo, int *hi)
{
    int64_t a, b;
    x_range(P, qlen, klen, i, &a, &b);
    *lo = b < a ? 1 : (int)a;
    *hi = b < a ? 0 : (int)b;
}

/* Keys any row of local queries [i0, i0 + n) may see: [*kmin, *kmax] (empty: kmax < kmin). */
__device__ __forceinline__ void x_tile_keys(const xparams &P, int qlen, int klen, int i0, int n, int *kmin, int *kmax)
{
    int64_t a0, b0, a1, b1;
    x_range(P, qlen, klen, i0, &a0, &b0);
    x_range(P, qlen, klen, i0 + n - 1, &a1, &b1);
    *kmin = (int)(a0 < klen ? a0 : klen);
    *kmax = (int)(b1 < 0 ? -1 : b1);
}

/* Score of query row i (packed) and key row jp (packed) of (b, hq), natural units: the mask,
 * then cap(scale q.k) + bias; -inf when hidden. *dc: d score / d (scale q.k). */
/* The mask and bias reads of x_pair: -inf (hidden by the mask) or the bias (0 without).
 * Out of line: inlined into every unrolled score element they made each head-dim class a
 * minute of nvcc; they wait on global memory anyway. */
static __device__ __noinline__ float x_mask_bias(const xparams &P, int64_t b, int64_t hq, int64_t i, int64_t jp)
{
    if (P.mask.p && !((const unsigned char *)P.mask.p)[b * P.mask.s0 + hq * P.mask.s1 + i * P.mask.s2 + jp * P.mask.s3])
        return -INFINITY;
    return P.bias.p ? ld_any(P.bias.p, P.bias.dt, b * P.bias.s0 + hq * P.bias.s1 + i * P.bias.s2 + jp * P.bias.s3) : 0.0f;
}

__device__ __forceinline__ float x_pair(const xparams &P, float qk, int vis, int64_t b, int64_t hq, int64_t i,
                                        int64_t jp, float *dc)
{
    *dc = 1.0f;
    if (!vis) return -INFINITY;
    const float mb = P.mask.p || P.bias.p ? x_mask_bias(P, b, hq, i, jp) : 0.0f;
    if (mb == -INFINITY) return -INFINITY;
    float s = qk * P.scale;
    if (P.cap > 0.0f) {
        const float t = tanhf(s / P.cap);
        s = P.cap * t;
        *dc = 1.0f - t * t;
    }
    return s + mb;
}

/* Dropout factor of (b, hq, i, jp): 0 or 1 / (1 - p). Out of line (ten Philox rounds per
 * element, unrolled over every element, were most of the options' compile time). */
static __device__ __noinline__ float x_keep_philox(const xparams &P, int64_t b, int64_t hq, int64_t i, int64_t jp)
{
    uint32_t w[4];
    nsa_dropout_words(P.seed, P.offset, b, P.HQ, hq, i, jp, w);
    return w[jp & 3] >= P.thresh ? P.rp : 0.0f;
}

__device__ __forceinline__ float x_keep(const xparams &P, int64_t b, int64_t hq, int64_t i, int64_t jp)
{
    return P.dropout ? x_keep_philox(P, b, hq, i, jp) : 1.0f;
}

/* Segment id of packed row `row` of batch entry b (0 when absent). */
__device__ __forceinline__ int x_seg(const pview &v, int64_t b, int64_t row)
{
    return v.p ? ((const int32_t *)v.p)[b * v.s0 + row * v.s1] : 0;
}

/* acc [DP / 8][4] of a warp's 16 rows -> rows r0 + (lane / 4, + 8) of a [.., .., .., D] view
 * (row offset roff[x], -1: skip); times mul. */
template <typename T, int DP>
__device__ __forceinline__ void x_store_rows(const dview &out, const int64_t roff[2], int D, float (&acc)[DP / 8][4],
                                             float mul, int lane)
{
    T *o = (T *)out.p;
#pragma unroll
    for (int dt = 0; dt < DP / 8; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int x = e >> 1, c = dt * 8 + 2 * (lane & 3) + (e & 1);
            if (roff[x] >= 0 && c < D) o[roff[x] + c] = dtraits<T>::from_f(acc[dt][e] * mul);
        }
}

/* The warp's 16 x NT*8 product A B^T: A = rows of `a` (16 rows at a, ld LD), B = rows of `b`
 * (NT*8 rows, ld LD), both over DP columns. */
template <typename T, int DP, int NT>
__device__ __forceinline__ void x_abt(float (&S)[NT][4], const T *a, const T *b, int lane)
{
    constexpr int LD = DP + 8;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DP / 16; kk++) {
        uint32_t af[4];
        ldsm4(af, a + kk * 16 + frag_a_off(lane, LD));
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t bf[4];
            ldsm4(bf, b + np * 16 * LD + kk * 16 + frag_bn_off(lane, LD));
            dtraits<T>::mma(S[2 * np], af, bf[0], bf[1]);
            dtraits<T>::mma(S[2 * np + 1], af, bf[2], bf[3]);
        }
    }
}

/* acc += W B: W the warp's 16 x NT*8 weights (accumulator layout), B = NT*8 rows of `b`
 * (ld LD) over DP columns. */
template <typename T, int DP, int NT>
__device__ __forceinline__ void x_pb(float (&acc)[DP / 8][4], const float (&W)[NT][4], const T *b, int lane)
{
    constexpr int LD = DP + 8;
#pragma unroll
    for (int k2 = 0; k2 < NT / 2; k2++) {
        uint32_t af[4];
        sc_frag_a<T>(af, W[2 * k2], W[2 * k2 + 1]);
#pragma unroll
        for (int vp = 0; vp < DP / 16; vp++) {
            uint32_t bf[4];
            ldsm4t(bf, b + k2 * 16 * LD + vp * 16 + frag_bk_off(lane, LD));
            dtraits<T>::mma(acc[2 * vp], af, bf[0], bf[1]);
            dtraits<T>::mma(acc[2 * vp + 1], af, bf[2], bf[3]);
        }
    }
}

template <int DP> __device__ __forceinline__ void x_zero(float (&acc)[DP / 8][4])
{
#pragma unroll
    for (int i = 0; i < DP / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
}

/* ==== forward ================================================================================ */

template <int DP, typename T>
__global__ void __launch_bounds__(128) xfwd_kernel(const xparams P)
{
    constexpr int LD = DP + 8, BN = 64, NT = BN / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    T *Qs = (T *)smem, *Ks = Qs + XQ_BM * LD, *Vs = Ks + BN * LD;
    int *kseg = (int *)(Vs + BN * LD);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int64_t s, tile;
    x_task(P, &s, &tile);
    const xseq sq = xseq_get(P, s);
    const int64_t hq = blockIdx.y, h = hq / P.G, b = sq.b;
    const int i0 = (int)tile * XQ_BM, nrows = sq.qlen - i0 < XQ_BM ? sq.qlen - i0 : XQ_BM;

    load_rows_lin<T, DP>(Qs, LD, (const T *)P.q.p, b * P.q.s0 + (sq.q0 + i0) * P.q.s1 + hq * P.q.s2, P.q.s1, nrows,
                         XQ_BM, P.DK, P.q.al, tid, 128);
    cp_commit();

    int lo[2], hi[2], seg[2];
    int64_t row[2];
    for (int x = 0; x < 2; x++) {
        const int r = warp * 16 + (lane >> 2) + 8 * x;
        lo[x] = 1, hi[x] = 0, seg[x] = 0, row[x] = -1;
        if (r < nrows) {
            x_bounds(P, sq.qlen, sq.klen, i0 + r, &lo[x], &hi[x]);
            row[x] = sq.q0 + i0 + r;
            seg[x] = x_seg(P.qseg, b, row[x]);
        }
    }
    int kmin, kmax;
    x_tile_keys(P, sq.qlen, sq.klen, i0, nrows, &kmin, &kmax);

    float acc[DP / 8][4];
    x_zero<DP>(acc);
    float m_[2] = {-INFINITY, -INFINITY}, l_[2] = {0.0f, 0.0f};
    const int64_t kbase = b * P.k.s0 + sq.k0 * P.k.s1 + h * P.k.s2, vbase = b * P.v.s0 + sq.k0 * P.v.s1 + h * P.v.s2;

    for (int c0 = kmin; c0 <= kmax; c0 += BN) {
        const int c1 = c0 + BN < kmax + 1 ? c0 + BN : kmax + 1;
        __syncthreads(); /* everyone is done with the previous chunk */
        load_rows_lin<T, DP>(Ks, LD, (const T *)P.k.p, kbase + c0 * P.k.s1, P.k.s1, c1 - c0, BN, P.DK, P.k.al, tid, 128);
        load_rows_lin<T, DP>(Vs, LD, (const T *)P.v.p, vbase + c0 * P.v.s1, P.v.s1, c1 - c0, BN, P.DV, P.v.al, tid, 128);
        cp_commit();
        if (tid < BN) kseg[tid] = c0 + tid < c1 ? x_seg(P.kseg, b, sq.k0 + c0 + tid) : 0;
        cp_wait<0>();
        __syncthreads();

        float S[NT][4];
        x_abt<T, DP, NT>(S, Qs + warp * 16 * LD, Ks, lane);
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int x = e >> 1, jl = nt * 8 + 2 * (lane & 3) + (e & 1), j = c0 + jl;
                const int vis = j < c1 && j >= lo[x] && j <= hi[x] && (!P.kseg.p || kseg[jl] == seg[x]);
                float dc;
                const float sc = x_pair(P, S[nt][e], vis, b, hq, row[x], sq.k0 + j, &dc);
                S[nt][e] = sc * NSA_LOG2E; /* -inf stays -inf */
            }
        sc_softmax<NT, DP / 8>(S, m_, l_, acc);
        if (P.dropout) /* l keeps the undropped sum: lse is the undropped softmax's */
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int x = e >> 1, j = c0 + nt * 8 + 2 * (lane & 3) + (e & 1);
                    if (S[nt][e] != 0.0f) S[nt][e] *= x_keep(P, b, hq, row[x], sq.k0 + j);
                }
        x_pb<T, DP, NT>(acc, S, Vs, lane);
    }

    /* o = acc / l rescaled to the final lse; lse = log(l e^m + e^sink) */
    int64_t ooff[2];
    for (int x = 0; x < 2; x++) {
        float l = l_[x];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        float lse = l > 0.0f ? (m_[x] + log2f(l)) * NSA_LN2 : -INFINITY;
        if (P.sinks) {
            const float sk = P.sinks[hq * P.sinks_s], mx = lse > sk ? lse : sk;
            if (mx != -INFINITY) lse = mx + logf(expf(lse - mx) + expf(sk - mx));
        }
        const float w = l > 0.0f ? expf((m_[x] + log2f(l)) * NSA_LN2 - lse) / l : 0.0f;
#pragma unroll
        for (int dt = 0; dt < DP / 8; dt++) acc[dt][2 * x] *= w, acc[dt][2 * x + 1] *= w;
        ooff[x] = row[x] >= 0 ? b * P.o.s0 + row[x] * P.o.s1 + hq * P.o.s2 : -1;
        if (row[x] >= 0 && (lane & 3) == 0) ((float *)P.lse.p)[b * P.lse.s0 + row[x] * P.lse.s1 + hq * P.lse.s2] = lse;
    }
    x_store_rows<T, DP>(P.o, ooff, P.DV, acc, 1.0f, lane);
}

/* ==== dQ (and dbias) ========================================================================== */

template <int DP, typename T>
__global__ void __launch_bounds__(128) xdq_kernel(const xparams P)
{
    constexpr int LD = DP + 8, BN = XQ_BN(DP), NT = BN / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    T *Qs = (T *)smem, *Os = Qs + XQ_BM * LD, *Ks = Os + XQ_BM * LD, *Vs = Ks + BN * LD;
    int *kseg = (int *)(Vs + BN * LD);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int64_t s, tile;
    x_task(P, &s, &tile);
    const xseq sq = xseq_get(P, s);
    const int i0 = (int)tile * XQ_BM, nrows = sq.qlen - i0 < XQ_BM ? sq.qlen - i0 : XQ_BM;
    /* the members whose dbias elements this CTA owns: one (b, hq), or all that broadcast */
    const int64_t nb = P.loop_b ? P.B : 1, nh = P.loop_h ? P.HQ : 1;

    int lo[2], hi[2], seg[2];
    int64_t row[2];
    for (int x = 0; x < 2; x++) {
        const int r = warp * 16 + (lane >> 2) + 8 * x;
        lo[x] = 1, hi[x] = 0, row[x] = -1;
        if (r < nrows) x_bounds(P, sq.qlen, sq.klen, i0 + r, &lo[x], &hi[x]), row[x] = sq.q0 + i0 + r;
    }
    int kmin, kmax;
    x_tile_keys(P, sq.qlen, sq.klen, i0, nrows, &kmin, &kmax);

    for (int64_t mb = 0; mb < nb; mb++)
        for (int64_t mh = 0; mh < nh; mh++) {
            const int64_t b = P.loop_b ? mb : sq.b, hq = P.loop_h ? mh : (int64_t)blockIdx.y, h = hq / P.G;
            __syncthreads(); /* the previous member's tiles are read */
            load_rows_lin<T, DP>(Qs, LD, (const T *)P.q.p, b * P.q.s0 + (sq.q0 + i0) * P.q.s1 + hq * P.q.s2, P.q.s1,
                                 nrows, XQ_BM, P.DK, P.q.al, tid, 128);
            load_rows_lin<T, DP>(Os, LD, (const T *)P.dout.p, b * P.dout.s0 + (sq.q0 + i0) * P.dout.s1 + hq * P.dout.s2,
                                 P.dout.s1, nrows, XQ_BM, P.DV, P.dout.al, tid, 128);
            cp_commit();
            float l2[2], Dr[2];
            for (int x = 0; x < 2; x++) {
                l2[x] = INFINITY, Dr[x] = 0.0f, seg[x] = 0;
                if (row[x] >= 0) {
                    const float lse = ((const float *)P.lse.p)[b * P.lse.s0 + row[x] * P.lse.s1 + hq * P.lse.s2];
                    l2[x] = lse == -INFINITY ? INFINITY : lse * NSA_LOG2E; /* a row that sees nothing: P = 0 */
                    Dr[x] = P.sinks ? 0.0f : P.Dw[(b * P.Tq + row[x]) * P.HQ + hq]; /* sinks: below */
                    seg[x] = x_seg(P.qseg, b, row[x]);
                }
            }
            float *db = nullptr;
            if (P.dbias)
                db = P.dbias + ((P.dbB == 1 ? 0 : b) * P.dbH + (P.dbH == 1 ? 0 : hq)) * P.Tq * P.Tk;
            float acc[DP / 8][4];
            x_zero<DP>(acc);
            const int64_t kbase = b * P.k.s0 + sq.k0 * P.k.s1 + h * P.k.s2;
            const int64_t vbase = b * P.v.s0 + sq.k0 * P.v.s1 + h * P.v.s2;

            /* chunk [c0, c1) of keys: P (S), the softcap derivative (C) and dP~ = dO V^T (dP) */
            auto chunk = [&](int c0, int c1, float (&S)[NT][4], float (&C)[NT][4], float (&dP)[NT][4]) {
                __syncthreads();
                load_rows_lin<T, DP>(Ks, LD, (const T *)P.k.p, kbase + c0 * P.k.s1, P.k.s1, c1 - c0, BN, P.DK, P.k.al, tid,
                                     128);
                load_rows_lin<T, DP>(Vs, LD, (const T *)P.v.p, vbase + c0 * P.v.s1, P.v.s1, c1 - c0, BN, P.DV, P.v.al, tid,
                                     128);
                cp_commit();
                if (tid < BN) kseg[tid] = c0 + tid < c1 ? x_seg(P.kseg, b, sq.k0 + c0 + tid) : 0;
                cp_wait<0>();
                __syncthreads();
                x_abt<T, DP, NT>(S, Qs + warp * 16 * LD, Ks, lane);
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int x = e >> 1, jl = nt * 8 + 2 * (lane & 3) + (e & 1), j = c0 + jl;
                        const int vis = j < c1 && j >= lo[x] && j <= hi[x] && (!P.kseg.p || kseg[jl] == seg[x]);
                        const float sc = x_pair(P, S[nt][e], vis, b, hq, row[x], sq.k0 + j, &C[nt][e]);
                        S[nt][e] = sc == -INFINITY ? 0.0f : ex2(sc * NSA_LOG2E - l2[x]);
                    }
                x_abt<T, DP, NT>(dP, Os + warp * 16 * LD, Vs, lane);
            };
            if (P.sinks) {
                /* D = sum_j P z dP~ from the products themselves rather than dO . o: the sink
                 * gradient is a sum of D over every row, and o's storage rounding (plus P's
                 * in the forward's P V) would add up there */
                float Dacc[2] = {0.0f, 0.0f};
                for (int c0 = kmin; c0 <= kmax; c0 += BN) {
                    const int c1 = c0 + BN < kmax + 1 ? c0 + BN : kmax + 1;
                    float S[NT][4], dP[NT][4], C[NT][4];
                    chunk(c0, c1, S, C, dP);
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int x = e >> 1, j = c0 + nt * 8 + 2 * (lane & 3) + (e & 1);
                            if (S[nt][e] != 0.0f) Dacc[x] += S[nt][e] * x_keep(P, b, hq, row[x], sq.k0 + j) * dP[nt][e];
                        }
                }
                for (int x = 0; x < 2; x++) {
                    Dacc[x] += __shfl_xor_sync(0xffffffffu, Dacc[x], 1);
                    Dacc[x] += __shfl_xor_sync(0xffffffffu, Dacc[x], 2);
                    Dr[x] = Dacc[x];
                    if (row[x] >= 0 && (lane & 3) == 0) P.Dw[(b * P.Tq + row[x]) * P.HQ + hq] = Dacc[x];
                }
            }

            for (int c0 = kmin; c0 <= kmax; c0 += BN) {
                const int c1 = c0 + BN < kmax + 1 ? c0 + BN : kmax + 1;
                float S[NT][4], dP[NT][4], C[NT][4];
                chunk(c0, c1, S, C, dP);
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int x = e >> 1, j = c0 + nt * 8 + 2 * (lane & 3) + (e & 1);
                        const float z = S[nt][e] != 0.0f ? x_keep(P, b, hq, row[x], sq.k0 + j) : 0.0f;
                        const float ds = S[nt][e] * (z * dP[nt][e] - Dr[x]); /* d loss / d score */
                        if (db && row[x] >= 0 && j < c1) db[row[x] * P.Tk + sq.k0 + j] += ds;
                        dP[nt][e] = ds * C[nt][e];
                    }
                x_pb<T, DP, NT>(acc, dP, Ks, lane);
            }
            int64_t qoff[2];
            for (int x = 0; x < 2; x++) qoff[x] = row[x] >= 0 ? b * P.dq.s0 + row[x] * P.dq.s1 + hq * P.dq.s2 : -1;
            x_store_rows<T, DP>(P.dq, qoff, P.DK, acc, P.scale, lane);
        }
}

/* ==== dK and dV ================================================================================ */

template <int DP, typename T>
__global__ void __launch_bounds__(128) xdkv_kernel(const xparams P)
{
    constexpr int LD = DP + 8, BQ = XQ_BQ(DP), NQ = BQ / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    T *Ks = (T *)smem, *Vs = Ks + XQ_BM * LD, *Qc = Vs + XQ_BM * LD, *Oc = Qc + BQ * LD;
    float *rl2 = (float *)(Oc + BQ * LD), *rD = rl2 + BQ;
    int *rseg = (int *)(rD + BQ), *rlo = rseg + BQ, *rhi = rlo + BQ;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int64_t s, tile;
    x_task(P, &s, &tile);
    const xseq sq = xseq_get(P, s);
    const int64_t h = blockIdx.y, b = sq.b;
    const int j0 = (int)tile * XQ_BM, nkeys = sq.klen - j0 < XQ_BM ? sq.klen - j0 : XQ_BM;
    const int shift = sq.klen - sq.qlen;

    load_rows_lin<T, DP>(Ks, LD, (const T *)P.k.p, b * P.k.s0 + (sq.k0 + j0) * P.k.s1 + h * P.k.s2, P.k.s1, nkeys, XQ_BM,
                         P.DK, P.k.al, tid, 128);
    load_rows_lin<T, DP>(Vs, LD, (const T *)P.v.p, b * P.v.s0 + (sq.k0 + j0) * P.v.s1 + h * P.v.s2, P.v.s1, nkeys, XQ_BM,
                         P.DV, P.v.al, tid, 128);
    cp_commit();
    int key[2], kseg[2];
    for (int x = 0; x < 2; x++) {
        const int r = warp * 16 + (lane >> 2) + 8 * x;
        key[x] = r < nkeys ? j0 + r : -1;
        kseg[x] = r < nkeys ? x_seg(P.kseg, b, sq.k0 + j0 + r) : 0;
    }
    /* the queries that may see keys [j0, j0 + nkeys): i + shift within the window of each */
    int64_t qmin = 0, qmax = (int64_t)sq.qlen - 1;
    const int64_t span = (int64_t)sq.klen + sq.qlen;
    if (P.causal) qmin = (int64_t)j0 - shift;
    else if (P.wr >= 0 && P.wr <= span) qmin = (int64_t)j0 - shift - P.wr;
    if (P.wl >= 0 && P.wl <= span) qmax = (int64_t)j0 + nkeys - 1 - shift + P.wl;
    qmin = qmin < 0 ? 0 : qmin;
    qmax = qmax > sq.qlen - 1 ? sq.qlen - 1 : qmax;
    if (nkeys <= 0) qmax = -1;

    /* At DP 256 a pass computes one of dK, dV (P.which) into dV's registers: the two sets of
     * accumulators together would spill. */
    constexpr bool BOTH = DP != 256;
    float dK[BOTH ? DP / 8 : 1][4], dV[DP / 8][4];
    if constexpr (BOTH) x_zero<DP>(dK);
    x_zero<DP>(dV);
    for (int64_t g = 0; g < P.G; g++) {
        const int64_t hq = h * P.G + g;
        for (int qc0 = (int)qmin; qc0 <= qmax; qc0 += BQ) {
            const int nq = qmax + 1 - qc0 < BQ ? (int)(qmax + 1 - qc0) : BQ;
            const int64_t prow0 = sq.q0 + qc0;
            __syncthreads(); /* the previous chunk is read */
            load_rows_lin<T, DP>(Qc, LD, (const T *)P.q.p, b * P.q.s0 + prow0 * P.q.s1 + hq * P.q.s2, P.q.s1, nq, BQ,
                                 P.DK, P.q.al, tid, 128);
            load_rows_lin<T, DP>(Oc, LD, (const T *)P.dout.p, b * P.dout.s0 + prow0 * P.dout.s1 + hq * P.dout.s2,
                                 P.dout.s1, nq, BQ, P.DV, P.dout.al, tid, 128);
            cp_commit();
            if (tid < BQ) {
                int lo = 1, hi = 0;
                float l2 = INFINITY, D = 0.0f;
                int sg = 0;
                if (tid < nq) {
                    const int64_t rw = prow0 + tid;
                    x_bounds(P, sq.qlen, sq.klen, qc0 + tid, &lo, &hi);
                    const float lse = ((const float *)P.lse.p)[b * P.lse.s0 + rw * P.lse.s1 + hq * P.lse.s2];
                    l2 = lse == -INFINITY ? INFINITY : lse * NSA_LOG2E;
                    D = P.Dw[(b * P.Tq + rw) * P.HQ + hq];
                    sg = x_seg(P.qseg, b, rw);
                }
                rlo[tid] = lo, rhi[tid] = hi, rl2[tid] = l2, rD[tid] = D, rseg[tid] = sg;
            }
            cp_wait<0>();
            __syncthreads();

            /* S^T: this warp's 16 keys x BQ queries */
            float S[NQ][4], C[NQ][4];
            x_abt<T, DP, NQ>(S, Ks + warp * 16 * LD, Qc, lane);
#pragma unroll
            for (int nt = 0; nt < NQ; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int x = e >> 1, r = nt * 8 + 2 * (lane & 3) + (e & 1);
                    const int j = key[x];
                    const int vis = j >= 0 && r < nq && j >= rlo[r] && j <= rhi[r] && (!P.kseg.p || rseg[r] == kseg[x]);
                    const float sc = x_pair(P, S[nt][e], vis, b, hq, prow0 + r, sq.k0 + j, &C[nt][e]);
                    S[nt][e] = sc == -INFINITY ? 0.0f : ex2(sc * NSA_LOG2E - rl2[r]);
                }
            if (P.which & XW_DK) {
                float dS[NQ][4];
                x_abt<T, DP, NQ>(dS, Vs + warp * 16 * LD, Oc, lane); /* dP^T */
#pragma unroll
                for (int nt = 0; nt < NQ; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int x = e >> 1, r = nt * 8 + 2 * (lane & 3) + (e & 1);
                        const float z = S[nt][e] != 0.0f ? x_keep(P, b, hq, prow0 + r, sq.k0 + key[x]) : 0.0f;
                        dS[nt][e] = S[nt][e] * (z * dS[nt][e] - rD[r]) * C[nt][e];
                        S[nt][e] *= z; /* the dropped weight that multiplies dO for dV */
                    }
                if constexpr (BOTH) x_pb<T, DP, NQ>(dK, dS, Qc, lane);
                else x_pb<T, DP, NQ>(dV, dS, Qc, lane);
            } else {
#pragma unroll
                for (int nt = 0; nt < NQ; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int x = e >> 1, r = nt * 8 + 2 * (lane & 3) + (e & 1);
                        if (S[nt][e] != 0.0f) S[nt][e] *= x_keep(P, b, hq, prow0 + r, sq.k0 + key[x]);
                    }
            }
            if (P.which & XW_DV) x_pb<T, DP, NQ>(dV, S, Oc, lane);
        }
    }
    int64_t off[2];
    if (P.which & XW_DK) {
        for (int x = 0; x < 2; x++) off[x] = key[x] >= 0 ? b * P.dk.s0 + (sq.k0 + key[x]) * P.dk.s1 + h * P.dk.s2 : -1;
        if constexpr (BOTH) x_store_rows<T, DP>(P.dk, off, P.DK, dK, P.scale, lane);
        else x_store_rows<T, DP>(P.dk, off, P.DK, dV, P.scale, lane);
    }
    if (P.which & XW_DV) {
        for (int x = 0; x < 2; x++) off[x] = key[x] >= 0 ? b * P.dv.s0 + (sq.k0 + key[x]) * P.dv.s1 + h * P.dv.s2 : -1;
        x_store_rows<T, DP>(P.dv, off, P.DV, dV, 1.0f, lane);
    }
}

/* Launcher of one head-dim class (xattn_d64.cu, xattn_d128.cu, xattn_d256.cu). */
template <int DP, typename T> static void xattn_launch(grun *g, const xparams *P, int kind, const int64_t grid[3])
{
    void (*fn)(const xparams) = kind == XK_FWD ? xfwd_kernel<DP, T> : kind == XK_DQ ? xdq_kernel<DP, T> : xdkv_kernel<DP, T>;
    const size_t smem = xattn_smem(DP, kind);
    g_check(g, cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (!g_live(g)) return;
    fn<<<dim3((unsigned)grid[0], (unsigned)grid[1], (unsigned)grid[2]), 128, smem, g->st>>>(*P);
    g_launched(g);
}

#define XATTN_DEFINE(DP)                                                                                 \
    void nsa_cu_xattn_##DP(grun *g, const xparams *P, int kind, int bf16, const int64_t grid[3])         \
    {                                                                                                    \
        if (!g_live(g) || grid[0] == 0 || grid[1] == 0 || grid[2] == 0) return;                          \
        if (bf16) xattn_launch<DP, __nv_bfloat16>(g, P, kind, grid);                                    \
        else xattn_launch<DP, __half>(g, P, kind, grid);                                                \
    }

#endif
