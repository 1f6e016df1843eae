/* attention/kernels.cuh -- the attention op with every option of nsa.h section 5 on the GPU: Tq != Tk
 * (bottom-right aligned), separate q / k packings, logit softcap, sinks, segment ids, additive
 * bias (and its gradient), boolean mask, Philox dropout; head dims up to 256. The plain calls
 * (no option, dims the engine has), and the forward with only softcap, sinks or Tq != Tk in a
 * dense batch, keep the tuned tiles of attn/ and range/ (launch.cu routes); these kernels
 * are the general path (mma.sync m16n8k16, sm_80 and sm_90a alike, chunks through a two-stage
 * cp.async pipeline):
 *
 *   xfwd_kernel  64 query rows of one query head per CTA (16 per warp), online softmax over
 *                chunks of 64 keys (32 at DP 256): o, lse (sinks join the denominator at the end).
 *   xdq_kernel   the same tiling: recomputes P, dP and dS = P (z dP - D); dQ, and the score
 *                gradient into the fp32 dbias accumulator. When dbias broadcasts over the
 *                batch or the heads, one CTA loops over every member that shares its
 *                elements, in a fixed order: no atomics, bitwise deterministic.
 *   xdkv_kernel  64 keys of one kv head per CTA (16 per warp) visit every query row of the G
 *                heads that may see them, in chunks: dK and dV (at DP 256 in two passes,
 *                whose accumulators would not fit together in registers).
 *
 * Every score goes through x_pair (window, segments, mask, softcap, bias, in the order of
 * nsa.h); bias, mask and dropout keeps come from a per-chunk side table (x_side_fill, Philox
 * of src/philox.h): forward and backward see the same scores and the same dropout mask as the
 * CPU backend. */
#ifndef NSA_CUDA_ATTENTION_KERNELS_CUH
#define NSA_CUDA_ATTENTION_KERNELS_CUH

#include "attention.h"
#include "../prim/softmax.cuh"
#include "../prim/nonfinite.cuh"
#include "../../philox.h"

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
 * (*b < *a: none); both never decrease in i, so a tile's keys are [a(first), b(last)]. */
__device__ __forceinline__ void x_range(const xparams &P, int qlen, int klen, int i, int64_t *a, int64_t *b)
{
    const int64_t d = nsa_rule_diag(i, qlen, klen);
    *a = nsa_rule_window_lo(d, P.wl);
    *b = nsa_rule_window_hi(d, P.wr, P.causal, klen);
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

/* Score of a pair, natural units: cap(scale q.k) + mb, -inf when hidden (vis 0, or the mask:
 * mb = -inf). mb: the pair's bias (0 without) from the chunk's side table. *dc: d score /
 * d (scale q.k). */
__device__ __forceinline__ float x_pair(const xparams &P, float qk, int vis, float mb, float *dc)
{
    *dc = 1.0f;
    if (!vis || mb == -INFINITY) return -INFINITY;
    float s = qk * P.scale;
    if (P.cap > 0.0f) {
        const float t = tanh_fast(__fdividef(s, P.cap));
        s = P.cap * t;
        *dc = 1.0f - t * t;
    }
    return s + mb;
}

__device__ __forceinline__ int x_has_side(const xparams &P) { return P.mask.p || P.bias.p || P.dropout; }

/* The side table of one chunk: query rows [qrow0, qrow0 + nq) of (b, hq), keys [krow0, krow0 +
 * nk) (packed rows; nq, nk <= 64). sb[r * 64 + c] = the bias (0 without) or -inf where the mask
 * hides the pair; kp[r * 64 + c] = 1 where dropout keeps it. All 128 threads, loads along the
 * keys (coalesced), one Philox call per four keys: per element in the unrolled score loops
 * these reads and draws cost 2x the time and most of the compile time. Entries past nq / nk
 * are left as they are (their pairs are invisible). */
/* sb[r * 64 + c] = bias of element type E (or 0): the thread's 32 entries loaded first, all in
 * flight at once (one memory latency per chunk, not 32), then stored */
template <typename E>
__device__ __forceinline__ void x_side_bias(const xparams &P, int64_t b, int64_t hq, int64_t qrow0, int nq,
                                            int64_t krow0, int nk, float *sb, int tid)
{
    const E *bias = (const E *)P.bias.p;
    const int64_t base = b * P.bias.s0 + hq * P.bias.s1 + qrow0 * P.bias.s2 + krow0 * P.bias.s3;
    float v[32];
#pragma unroll
    for (int k = 0; k < 32; k++) {
        const int idx = tid + k * 128, r = idx >> 6, c = idx & 63;
        v[k] = bias && r < nq && c < nk ? (float)bias[base + r * P.bias.s2 + c * P.bias.s3] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < 32; k++) sb[tid + k * 128] = v[k];
}

static __device__ __noinline__ void x_side_fill(const xparams &P, int64_t b, int64_t hq, int64_t qrow0, int nq,
                                                int64_t krow0, int nk, float *sb, unsigned char *kp, int tid)
{
    if (P.mask.p || P.bias.p) {
        if (P.bias.dt == NSA_DTYPE_BF16) x_side_bias<__nv_bfloat16>(P, b, hq, qrow0, nq, krow0, nk, sb, tid);
        else if (P.bias.dt == NSA_DTYPE_F16) x_side_bias<__half>(P, b, hq, qrow0, nq, krow0, nk, sb, tid);
        else x_side_bias<float>(P, b, hq, qrow0, nq, krow0, nk, sb, tid);
        if (P.mask.p) {
            const unsigned char *m = (const unsigned char *)P.mask.p + b * P.mask.s0 + hq * P.mask.s1 + qrow0 * P.mask.s2 +
                                     krow0 * P.mask.s3;
            unsigned char keep[32];
#pragma unroll
            for (int k = 0; k < 32; k++) {
                const int idx = tid + k * 128, r = idx >> 6, c = idx & 63;
                keep[k] = r < nq && c < nk ? m[r * P.mask.s2 + c * P.mask.s3] : 1;
            }
#pragma unroll
            for (int k = 0; k < 32; k++)
                if (!keep[k]) sb[tid + k * 128] = -INFINITY; /* the thread's own entries */
        }
    }
    if (P.dropout && nk > 0) {
        const int64_t g0 = krow0 >> 2;
        const int ng = (int)(((krow0 + nk - 1) >> 2) - g0 + 1);
        for (int idx = tid; idx < nq * ng; idx += 128) {
            const int r = idx / ng;
            const int64_t g = g0 + idx % ng;
            uint32_t w[4];
            nsa_dropout_words(P.seed, P.offset, b, P.HQ, hq, qrow0 + r, 4 * g, w);
            for (int e = 0; e < 4; e++) {
                const int64_t c = 4 * g + e - krow0;
                if (c >= 0 && c < nk) kp[r * 64 + c] = w[e] >= P.thresh;
            }
        }
    }
}

/* At the top of a chunk body (after x_pipe_next's barrier): fills the side table of keys
 * [c0, min(c0 + step, hi + 1)) when the call has one, then a barrier. @return whether sb holds
 * bias / mask values (kp is filled whenever P.dropout). */
__device__ __forceinline__ int x_side_begin(const xparams &P, int64_t b, int64_t hq, int64_t qrow0, int nq, int64_t krow0,
                                            int hi, int c0, int step, float *sb, unsigned char *kp, int tid)
{
    if (!x_has_side(P)) return 0;
    x_side_fill(P, b, hq, qrow0, nq, krow0, (c0 + step < hi + 1 ? c0 + step : hi + 1) - c0, sb, kp, tid);
    __syncthreads();
    return P.mask.p || P.bias.p;
}

/* The dropout factor of side-table entry (r, c): 0 or 1 / (1 - p); 1 without dropout. */
__device__ __forceinline__ float x_keep_at(const xparams &P, const unsigned char *kp, int r, int c)
{
    return P.dropout ? (kp[r * 64 + c] ? P.rp : 0.0f) : 1.0f;
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

/* A two-stage cp.async pipeline over chunks c0 = lo, lo + step, .. <= hi: issue(c0, stage)
 * starts a chunk's copies (and plain stores of per-chunk values). x_pipe_start issues the
 * first chunk (after a barrier: a previous user of the stages is done); x_pipe_next, at the
 * top of each chunk, waits for it, issues the next one into the other stage (its copies fly
 * during this chunk's products) and returns this chunk's stage. The chunk body stays inline
 * in the kernel: passed as a lambda, its accumulators went to local memory. */
template <typename Issue>
__device__ __forceinline__ void x_pipe_start(int lo, int hi, Issue &issue)
{
    __syncthreads();
    if (lo <= hi) issue(lo, 0);
    cp_commit();
}

template <typename Issue>
__device__ __forceinline__ int x_pipe_next(int c0, int step, int hi, int i, Issue &issue)
{
    cp_wait<0>();
    __syncthreads(); /* chunk c0 landed for everyone; everyone is done with chunk c0 - step */
    const int st = i & 1;
    if (c0 + step <= hi) issue(c0 + step, st ^ 1);
    cp_commit();
    return st;
}

/* Shared memory of the three kernels <DP>: byte offsets in carving order (rows padded by 8
 * elements); side tables (bias / mask / dropout keeps of one 64 x 64 chunk, floats then bytes)
 * come last and are reserved only for calls that have them: bytes(side) is what the host
 * reserves (xattn_smem, checked below). */
template <int DP> struct xfwd_layout {
    static constexpr size_t LD = DP + 8, BN = XQ_BN(DP), NS = 2;
    static constexpr size_t q = 0, k = q + XQ_BM * LD * 2, v = k + NS * BN * LD * 2; /* Q; K, V stages */
    static constexpr size_t kseg = v + NS * BN * LD * 2;                            /* [NS][BN] key segments */
    static constexpr size_t sb = kseg + NS * BN * 4, kp = sb + 64 * 64 * 4;         /* side tables */
    static constexpr size_t bytes(bool side) { return side ? kp + 64 * 64 : sb; }
    static_assert(bytes(false) == xattn_smem(DP, XK_FWD, 0) && bytes(true) == xattn_smem(DP, XK_FWD, 1),
                  "xattn_smem reserves exactly this layout");
};
template <int DP> struct xdq_layout {
    static constexpr size_t LD = DP + 8, BN = XQ_BN(DP);
    static constexpr size_t q = 0, o = q + XQ_BM * LD * 2, k = o + XQ_BM * LD * 2, v = k + 2 * BN * LD * 2;
    static constexpr size_t kseg = v + 2 * BN * LD * 2;                             /* [2][BN] key segments */
    static constexpr size_t sb = kseg + 2 * BN * 4, kp = sb + 64 * 64 * 4;          /* side tables */
    static constexpr size_t bytes(bool side) { return side ? kp + 64 * 64 : sb; }
    static_assert(bytes(false) == xattn_smem(DP, XK_DQ, 0) && bytes(true) == xattn_smem(DP, XK_DQ, 1),
                  "xattn_smem reserves exactly this layout");
};
template <int DP> struct xdkv_layout {
    static constexpr size_t LD = DP + 8, BQ = XQ_BQ(DP);
    static constexpr size_t k = 0, v = k + XQ_BM * LD * 2;                          /* the CTA's keys */
    static constexpr size_t q = v + XQ_BM * LD * 2, o = q + 2 * BQ * LD * 2;        /* [2] Q, dO chunks */
    static constexpr size_t rl2 = o + 2 * BQ * LD * 2, rD = rl2 + 2 * BQ * 4;       /* [2][BQ] row values */
    static constexpr size_t rseg = rD + 2 * BQ * 4, rlo = rseg + 2 * BQ * 4, rhi = rlo + 2 * BQ * 4;
    static constexpr size_t sb = rhi + 2 * BQ * 4, kp = sb + 64 * 64 * 4;           /* side tables [query][key] */
    static constexpr size_t bytes(bool side) { return side ? kp + 64 * 64 : sb; }
    static_assert(bytes(false) == xattn_smem(DP, XK_DKV, 0) && bytes(true) == xattn_smem(DP, XK_DKV, 1),
                  "xattn_smem reserves exactly this layout");
};

/* ==== forward ================================================================================ */

template <int DP, typename T>
__global__ void __launch_bounds__(128) xfwd_kernel(const __grid_constant__ xparams P)
{
    if (nf_set(P.nf)) return; /* a non-finite input: the scalar kernels run this call (simt.cu) */
    constexpr int LD = DP + 8, BN = XQ_BN(DP), NT = BN / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    using L = xfwd_layout<DP>;
    T *Qs = (T *)(smem + L::q), *Ks = (T *)(smem + L::k), *Vs = (T *)(smem + L::v); /* K, V: two stages */
    int *kseg = (int *)(smem + L::kseg);
    float *sb = (float *)(smem + L::sb); /* side table */
    unsigned char *kp = smem + L::kp;
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
    int seen[2] = {0, 0}; /* this lane's columns of each row: a visible pair (sc_row_finish) */
    const int64_t kbase = b * P.k.s0 + sq.k0 * P.k.s1 + h * P.k.s2, vbase = b * P.v.s0 + sq.k0 * P.v.s1 + h * P.v.s2;

    auto issue = [&](int c0, int st) {
        const int c1 = c0 + BN < kmax + 1 ? c0 + BN : kmax + 1;
        load_rows_lin<T, DP>(Ks + st * BN * LD, LD, (const T *)P.k.p, kbase + c0 * P.k.s1, P.k.s1, c1 - c0, BN, P.DK,
                             P.k.al, tid, 128);
        load_rows_lin<T, DP>(Vs + st * BN * LD, LD, (const T *)P.v.p, vbase + c0 * P.v.s1, P.v.s1, c1 - c0, BN, P.DV,
                             P.v.al, tid, 128);
        if (tid < BN) kseg[st * BN + tid] = c0 + tid < c1 ? x_seg(P.kseg, b, sq.k0 + c0 + tid) : 0;
    };
    x_pipe_start(kmin, kmax, issue);
    for (int c0 = kmin, i = 0; c0 <= kmax; c0 += BN, i++) {
        const int st = x_pipe_next(c0, BN, kmax, i, issue);
        const int c1 = c0 + BN < kmax + 1 ? c0 + BN : kmax + 1;
        const int side = x_side_begin(P, b, hq, sq.q0 + i0, nrows, sq.k0 + c0, kmax, c0, BN, sb, kp, tid);
        float S[NT][4];
        x_abt<T, DP, NT>(S, Qs + warp * 16 * LD, Ks + st * BN * LD, lane);
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int x = e >> 1, jl = nt * 8 + 2 * (lane & 3) + (e & 1), j = c0 + jl;
                const int r = warp * 16 + (lane >> 2) + 8 * x;
                const int vis = j < c1 && j >= lo[x] && j <= hi[x] && (!P.kseg.p || kseg[st * BN + jl] == seg[x]);
                float dc;
                const float mb = side ? sb[r * 64 + jl] : 0.0f;
                const float sc = x_pair(P, S[nt][e], vis, mb, &dc);
                S[nt][e] = sc * NSA_LOG2E; /* -inf stays -inf */
                seen[x] |= vis && mb != -INFINITY; /* a -inf bias or a mask hides; a -inf score does not */
            }
        sc_softmax<NT, DP / 8>(S, m_, l_, acc, 1.0f); /* S is in the log2 domain already */
        if (P.dropout) /* l keeps the undropped sum: lse is the undropped softmax's */
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    S[nt][e] *= x_keep_at(P, kp, warp * 16 + (lane >> 2) + 8 * (e >> 1), nt * 8 + 2 * (lane & 3) + (e & 1));
                }
        x_pb<T, DP, NT>(acc, S, Vs + st * BN * LD, lane);
    }
    cp_wait<0>();

    /* o = acc / l rescaled to the final lse; lse = log(l e^m + e^sink) */
    int64_t ooff[2];
    for (int x = 0; x < 2; x++) {
        const float l = sc_quad_sum(l_[x]);
        const int seen_row = sc_quad_sum((float)seen[x]) > 0.0f && !(P.flex_rows && l == 0.0f); /* (all -inf: empty) */
        float lse;
        const float w = sc_row_finish(m_[x], l, seen_row, P.sinks, P.sinks_s, hq, &lse);
        sc_row_clear(acc, x, seen_row);
#pragma unroll
        for (int dt = 0; dt < DP / 8; dt++) acc[dt][2 * x] *= w, acc[dt][2 * x + 1] *= w;
        ooff[x] = row[x] >= 0 ? b * P.o.s0 + row[x] * P.o.s1 + hq * P.o.s2 : -1;
        if (row[x] >= 0 && (lane & 3) == 0) ((float *)P.lse.p)[b * P.lse.s0 + row[x] * P.lse.s1 + hq * P.lse.s2] = lse;
    }
    x_store_rows<T, DP>(P.o, ooff, P.DV, acc, 1.0f, lane);
}

/* xdq_kernel's chunk [c0, min(c0 + BN, kmax + 1)) of keys, after its side table (rows
 * [qrow0, qrow0 + nq) of (b, hq), keys from krow0) is filled: P (S), the softcap derivative
 * (C) and dP~ = dO V^T (dP); Qw / Ow the warp's 16 rows, Kst / Vst / ksg the chunk's stage. */
template <typename T, int DP, int NT>
__device__ __forceinline__ void xdq_products(const xparams &P, const T *Qw, const T *Ow, const T *Kst, const T *Vst,
                                             const int *ksg, float *sb, unsigned char *kp, int64_t b, int64_t hq,
                                             int64_t qrow0, int nq, int64_t krow0, int c0, int kmax, const int lo[2],
                                             const int hi[2], const int seg[2], const float l2[2], int tid,
                                             float (&S)[NT][4], float (&C)[NT][4], float (&dP)[NT][4])
{
    const int lane = tid & 31, warp = tid >> 5;
    const int side = x_side_begin(P, b, hq, qrow0, nq, krow0, kmax, c0, NT * 8, sb, kp, tid);
    const float *sbw = side ? sb + warp * 16 * 64 : nullptr;
    const int c1 = c0 + NT * 8 < kmax + 1 ? c0 + NT * 8 : kmax + 1;
    x_abt<T, DP, NT>(S, Qw, Kst, lane);
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int x = e >> 1, jl = nt * 8 + 2 * (lane & 3) + (e & 1), j = c0 + jl;
            const int vis = j < c1 && j >= lo[x] && j <= hi[x] && (!P.kseg.p || ksg[jl] == seg[x]);
            const float sc = x_pair(P, S[nt][e], vis, sbw ? sbw[((lane >> 2) + 8 * x) * 64 + jl] : 0.0f, &C[nt][e]);
            S[nt][e] = sc == -INFINITY ? 0.0f : ex2(sc * NSA_LOG2E - l2[x]);
        }
    x_abt<T, DP, NT>(dP, Ow, Vst, lane);
}

/* ==== dQ (and dbias) ========================================================================== */

template <int DP, typename T>
__global__ void __launch_bounds__(128) xdq_kernel(const __grid_constant__ xparams P)
{
    if (nf_set(P.nf)) return; /* a non-finite input: the scalar kernels run this call (simt.cu) */
    constexpr int LD = DP + 8, BN = XQ_BN(DP), NT = BN / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    using L = xdq_layout<DP>;
    T *Qs = (T *)(smem + L::q), *Os = (T *)(smem + L::o), *Ks = (T *)(smem + L::k), *Vs = (T *)(smem + L::v);
    int *kseg = (int *)(smem + L::kseg);
    float *sb = (float *)(smem + L::sb); /* side table */
    unsigned char *kp = smem + L::kp;
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

            auto issue = [&](int c0, int st) {
                const int c1 = c0 + BN < kmax + 1 ? c0 + BN : kmax + 1;
                load_rows_lin<T, DP>(Ks + st * BN * LD, LD, (const T *)P.k.p, kbase + c0 * P.k.s1, P.k.s1, c1 - c0, BN,
                                     P.DK, P.k.al, tid, 128);
                load_rows_lin<T, DP>(Vs + st * BN * LD, LD, (const T *)P.v.p, vbase + c0 * P.v.s1, P.v.s1, c1 - c0, BN,
                                     P.DV, P.v.al, tid, 128);
                if (tid < BN) kseg[st * BN + tid] = c0 + tid < c1 ? x_seg(P.kseg, b, sq.k0 + c0 + tid) : 0;
            };
            if (P.sinks) {
                /* D = sum_j P z dP~ from the products themselves rather than dO . o: the sink
                 * gradient is a sum of D over every row, and o's storage rounding (plus P's
                 * in the forward's P V) would add up there */
                float Dacc[2] = {0.0f, 0.0f};
                x_pipe_start(kmin, kmax, issue);
                for (int c0 = kmin, i = 0; c0 <= kmax; c0 += BN, i++) {
                    const int st = x_pipe_next(c0, BN, kmax, i, issue);
                    float S[NT][4], dP[NT][4], C[NT][4];
                    xdq_products<T, DP, NT>(P, Qs + warp * 16 * LD, Os + warp * 16 * LD, Ks + st * BN * LD,
                                            Vs + st * BN * LD, kseg + st * BN, sb, kp, b, hq, sq.q0 + i0, nrows,
                                            sq.k0 + c0, c0, kmax, lo, hi, seg, l2, tid, S, C, dP);
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int x = e >> 1, jl = nt * 8 + 2 * (lane & 3) + (e & 1);
                            Dacc[x] += S[nt][e] * x_keep_at(P, kp, warp * 16 + (lane >> 2) + 8 * x, jl) * dP[nt][e];
                        }
                }
                for (int x = 0; x < 2; x++) {
                    Dacc[x] += __shfl_xor_sync(0xffffffffu, Dacc[x], 1);
                    Dacc[x] += __shfl_xor_sync(0xffffffffu, Dacc[x], 2);
                    Dr[x] = Dacc[x];
                    if (row[x] >= 0 && (lane & 3) == 0) P.Dw[(b * P.Tq + row[x]) * P.HQ + hq] = Dacc[x];
                }
            }

            x_pipe_start(kmin, kmax, issue);
            for (int c0 = kmin, i = 0; c0 <= kmax; c0 += BN, i++) {
                const int st = x_pipe_next(c0, BN, kmax, i, issue);
                const int c1 = c0 + BN < kmax + 1 ? c0 + BN : kmax + 1;
                float S[NT][4], dP[NT][4], C[NT][4];
                xdq_products<T, DP, NT>(P, Qs + warp * 16 * LD, Os + warp * 16 * LD, Ks + st * BN * LD,
                                        Vs + st * BN * LD, kseg + st * BN, sb, kp, b, hq, sq.q0 + i0, nrows, sq.k0 + c0,
                                        c0, kmax, lo, hi, seg, l2, tid, S, C, dP);
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int x = e >> 1, jl = nt * 8 + 2 * (lane & 3) + (e & 1), j = c0 + jl;
                        const float z = x_keep_at(P, kp, warp * 16 + (lane >> 2) + 8 * x, jl);
                        const float ds = S[nt][e] * (z * dP[nt][e] - Dr[x]); /* d loss / d score */
                        if (db && row[x] >= 0 && j < c1) db[row[x] * P.Tk + sq.k0 + j] += ds;
                        dP[nt][e] = ds * C[nt][e];
                    }
                x_pb<T, DP, NT>(acc, dP, Ks + st * BN * LD, lane);
            }
            cp_wait<0>();
            int64_t qoff[2];
            for (int x = 0; x < 2; x++) qoff[x] = row[x] >= 0 ? b * P.dq.s0 + row[x] * P.dq.s1 + hq * P.dq.s2 : -1;
            x_store_rows<T, DP>(P.dq, qoff, P.DK, acc, P.scale, lane);
        }
}

/* ==== dK and dV ================================================================================ */

template <int DP, typename T>
__global__ void __launch_bounds__(128) xdkv_kernel(const __grid_constant__ xparams P)
{
    if (nf_set(P.nf)) return; /* a non-finite input: the scalar kernels run this call (simt.cu) */
    constexpr int LD = DP + 8, BQ = XQ_BQ(DP), NQ = BQ / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    /* K, V of the CTA's keys; Q, dO chunks and their rows' values in two stages */
    using L = xdkv_layout<DP>;
    T *Ks = (T *)(smem + L::k), *Vs = (T *)(smem + L::v), *Qc = (T *)(smem + L::q), *Oc = (T *)(smem + L::o);
    float *rl2 = (float *)(smem + L::rl2), *rD = (float *)(smem + L::rD);
    int *rseg = (int *)(smem + L::rseg), *rlo = (int *)(smem + L::rlo), *rhi = (int *)(smem + L::rhi);
    float *sb = (float *)(smem + L::sb); /* side table [query][key] */
    unsigned char *kp = smem + L::kp;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int64_t s, tile;
    x_task(P, &s, &tile);
    const xseq sq = xseq_get(P, s);
    const int64_t h = blockIdx.y, b = sq.b;
    const int j0 = (int)tile * XQ_BM, nkeys = sq.klen - j0 < XQ_BM ? sq.klen - j0 : XQ_BM;

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
    const int64_t qmin = nsa_rule_window_q_first(j0, P.wr, P.causal, sq.qlen, sq.klen);
    int64_t qmax = nsa_rule_window_q_last((int64_t)j0 + nkeys - 1, P.wl, sq.qlen, sq.klen);
    if (nkeys <= 0) qmax = -1;

    /* At DP 256 a pass computes one of dK, dV (P.which) into dV's registers: the two sets of
     * accumulators together would spill. */
    constexpr bool BOTH = DP != 256;
    float dK[BOTH ? DP / 8 : 1][4], dV[DP / 8][4];
    if constexpr (BOTH) x_zero<DP>(dK);
    x_zero<DP>(dV);
    for (int64_t g = 0; g < P.G; g++) {
        const int64_t hq = h * P.G + g;
        auto issue = [&](int qc0, int st) {
            const int nq = qmax + 1 - qc0 < BQ ? (int)(qmax + 1 - qc0) : BQ;
            const int64_t prow0 = sq.q0 + qc0;
            load_rows_lin<T, DP>(Qc + st * BQ * LD, LD, (const T *)P.q.p, b * P.q.s0 + prow0 * P.q.s1 + hq * P.q.s2, P.q.s1,
                                 nq, BQ, P.DK, P.q.al, tid, 128);
            load_rows_lin<T, DP>(Oc + st * BQ * LD, LD, (const T *)P.dout.p,
                                 b * P.dout.s0 + prow0 * P.dout.s1 + hq * P.dout.s2, P.dout.s1, nq, BQ, P.DV, P.dout.al, tid,
                                 128);
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
                const int at = st * BQ + tid;
                rlo[at] = lo, rhi[at] = hi, rl2[at] = l2, rD[at] = D, rseg[at] = sg;
            }
        };
        x_pipe_start((int)qmin, (int)qmax, issue);
        for (int qc0 = (int)qmin, i = 0; qc0 <= qmax; qc0 += BQ, i++) {
            const int st = x_pipe_next(qc0, BQ, (int)qmax, i, issue);
            const int nq = qmax + 1 - qc0 < BQ ? (int)(qmax + 1 - qc0) : BQ;
            const int64_t prow0 = sq.q0 + qc0;
            const T *Qp = Qc + st * BQ * LD, *Op = Oc + st * BQ * LD;
            const int rb = st * BQ; /* this stage's row values */
            const int side = x_side_begin(P, b, hq, prow0, nq, sq.k0 + j0, nkeys - 1, 0, XQ_BM, sb, kp, tid);
            /* S^T: this warp's 16 keys x BQ queries */
            float S[NQ][4], C[NQ][4];
            x_abt<T, DP, NQ>(S, Ks + warp * 16 * LD, Qp, lane);
#pragma unroll
            for (int nt = 0; nt < NQ; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int x = e >> 1, r = nt * 8 + 2 * (lane & 3) + (e & 1);
                    const int j = key[x];
                    const int vis = j >= 0 && r < nq && j >= rlo[rb + r] && j <= rhi[rb + r] &&
                                    (!P.kseg.p || rseg[rb + r] == kseg[x]);
                    const int kl = warp * 16 + (lane >> 2) + 8 * x;
                    const float sc = x_pair(P, S[nt][e], vis, side ? sb[r * 64 + kl] : 0.0f, &C[nt][e]);
                    S[nt][e] = sc == -INFINITY ? 0.0f : ex2(sc * NSA_LOG2E - rl2[rb + r]);
                }
            if (P.which & XW_DK) {
                float dS[NQ][4];
                x_abt<T, DP, NQ>(dS, Vs + warp * 16 * LD, Op, lane); /* dP^T */
#pragma unroll
                for (int nt = 0; nt < NQ; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int x = e >> 1, r = nt * 8 + 2 * (lane & 3) + (e & 1);
                        const float z = x_keep_at(P, kp, r, warp * 16 + (lane >> 2) + 8 * x);
                        dS[nt][e] = S[nt][e] * (z * dS[nt][e] - rD[rb + r]) * C[nt][e];
                        S[nt][e] *= z; /* the dropped weight that multiplies dO for dV */
                    }
                if constexpr (BOTH) x_pb<T, DP, NQ>(dK, dS, Qp, lane);
                else x_pb<T, DP, NQ>(dV, dS, Qp, lane);
            } else {
#pragma unroll
                for (int nt = 0; nt < NQ; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int x = e >> 1, r = nt * 8 + 2 * (lane & 3) + (e & 1);
                        S[nt][e] *= x_keep_at(P, kp, r, warp * 16 + (lane >> 2) + 8 * x);
                    }
            }
            if (P.which & XW_DV) x_pb<T, DP, NQ>(dV, S, Op, lane);
        }
    }
    cp_wait<0>();
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

/* Launcher of one head-dim class (instantiated in the generated src/cuda/inst files). */
template <int DP, typename T> static void xattn_launch(grun *g, const xparams *P, int kind, const int64_t grid[3])
{
    void (*fn)(const xparams) = kind == XK_FWD ? xfwd_kernel<DP, T> : kind == XK_DQ ? xdq_kernel<DP, T> : xdkv_kernel<DP, T>;
    const bool side = P->mask.p || P->bias.p || P->dropout;
    const size_t smem = kind == XK_FWD ? xfwd_layout<DP>::bytes(side) : kind == XK_DQ ? xdq_layout<DP>::bytes(side)
                                                                                  : xdkv_layout<DP>::bytes(side);
    g_smem_optin(g, (const void *)fn, smem);
    if (!g_live(g)) return;
    fn<<<dim3((unsigned)grid[0], (unsigned)grid[1], (unsigned)grid[2]), 128, smem, g->st>>>(*P);
    g_launched(g);
}

#endif
