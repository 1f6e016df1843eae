/* prim/softmax.cuh -- a warp's tile of scores in the mma.sync accumulator layout (S[nt][e]:
 * row lane / 4 + 8 (e / 2), column 8 nt + 2 (lane % 4) + (e % 2), also the layout of the A
 * fragments built from it): masking to each row's visible keys, softcap, the online softmax
 * and the row epilogue, shared by the mma.sync and wgmma tiles and the option kernels. */
#ifndef NSA_CUDA_PRIM_SOFTMAX_CUH
#define NSA_CUDA_PRIM_SOFTMAX_CUH

#include "mask.cuh"

#if defined(__CUDACC__)

__device__ __forceinline__ float ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* ==== score-tile helpers shared by the mma.sync and wgmma tiles ======
 * S[nt][e]: the accumulator layout of a warp's 16 rows (row lane / 4 + 8 (e / 2), column
 * 8 nt + 2 (lane % 4) + (e % 2)), which is also the layout of the A fragments built from it. */

/* Mask a chunk's raw scores: keys outside [lo[x], hi[x]] or past c1 become -inf, the rest stay
 * raw products q.k (the softmax applies the log2-domain scale inside its exponent). A chunk
 * every row of the warp sees whole (full, warp-uniform: the compressed branch past its first
 * rows, window interiors, selected blocks that end before the query) skips the per-element
 * compares. */
template <int NT>
__device__ __forceinline__ void sc_mask(float (&S)[NT][4], int full, int c0, int c1, const int lo[2],
                                            const int hi[2], int lane)
{
    if (full) return;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int x = e >> 1, key = c0 + nt * 8 + 2 * (lane & 3) + (e & 1);
            if (!(key < c1 && key >= lo[x] && key <= hi[x])) S[nt][e] = -INFINITY;
        }
}

/* tanh(x) as 1 - 2 / (e^2x + 1): a few instructions against tanhf's dozens, error ~1e-7
 * absolute (e^2x -> inf gives 1, -> 0 gives -1); the softcap of every attention path. */
__device__ __forceinline__ float tanh_fast(float x) { return 1.0f - __fdividef(2.0f, __expf(2.0f * x) + 1.0f); }

/* The softcap's constants in the backward tiles: a raw product s becomes the log2-domain
 * score c2 tanh(k s) (k = scale / cap, c2 = cap log2(e): sc_softcap's), ic2 = 1 / c2. All 0
 * without a cap. */
struct sc_capbw {
    float k, c2, ic2;
};

__device__ __forceinline__ sc_capbw sc_capbw_of(const rule_t &r, float scale)
{
    sc_capbw c = {0.0f, 0.0f, 0.0f};
    if (r.cap > 0.0f) c.k = scale / r.cap, c.c2 = r.cap * NSA_LOG2E, c.ic2 = 1.0f / c.c2;
    return c;
}

/* The logit softcap of the attention op on raw scores q.k: S -> softcap * tanh(scale q.k /
 * softcap) in the log2 domain. @return the log2-domain factor the softmax must still apply:
 * 1 after the cap, scale * log2(e) without one. */
template <int NT>
__device__ __forceinline__ float sc_softcap(float (&S)[NT][4], const rule_t &r, float scale, float sl2)
{
    if (!(r.cap > 0.0f)) return sl2;
    /* sc_capbw_of's k and c2, derived here: through it the tiles kept its unused 1 / c2 */
    const float k = scale / r.cap, c2 = r.cap * NSA_LOG2E;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) S[nt][e] = c2 * tanh_fast(k * S[nt][e]);
    return 1.0f;
}

/* The softcap in the backward tiles: they recompute the forward's capped scores the same way,
 * so P matches the saved lse, and dS takes the cap's derivative d(cap tanh(x / cap)) / dx =
 * 1 - tanh^2 (x = scale q.k; the scale itself is applied to dQ and dK as without a cap).
 * sc_cap_prob: P = 2^(c2 tanh(k s) - l2) of a raw product s, and that factor in *f. */
__device__ __forceinline__ float sc_cap_prob(float s, float l2, const sc_capbw &c, float *f)
{
    const float t = tanh_fast(c.k * s);
    *f = 1.0f - t * t;
    return ex2(c.c2 * t - l2);
}

/* dS's factor 1 - tanh^2 from a capped log2-domain score S = c2 tanh (-inf where masked, and
 * for a P that underflowed to 0: factor 0, so dS = 0 as P = 0 makes it without a cap). */
__device__ __forceinline__ float sc_cap_grad(float S, float ic2)
{
    const float t = S * ic2;
    return fmaxf(1.0f - t * t, 0.0f);
}

__device__ __forceinline__ float lg2(float x)
{
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* Whether every row of the warp sees all keys [c0, c1) of a chunk of `width` keys (rows' ranges
 * lo / hi): such a chunk skips sc_mask's per-element compares. */
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
 * multiplier (1 / l, times e^(lse without the sink - lse)); 0 for a row that saw no key.
 * `seen`: the mask let the row see at least one key. l is 0 for a row that saw none, and for
 * a seen row whose scores were all -inf (an infinite q or k): without a sink that row is NaN,
 * as exp(s - max) is in dense softmax, not empty; a NaN l (a NaN score) stays NaN in o and lse. */
__device__ __forceinline__ float sc_row_finish(float m2, float l, int seen, const float *sinks, int64_t sinks_s,
                                               int64_t hq, float *lse_out)
{
    const bool nan_row = l == 0.0f && seen && !sinks;
    float lse = l != 0.0f ? (m2 + log2f(l)) * NSA_LN2 : nan_row ? NAN : -INFINITY;
    float w = l != 0.0f ? 1.0f / l : nan_row ? NAN : 0.0f;
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

/* Row x of an accumulator in the layout above, cleared when the row saw no key: such a row is
 * exactly o = 0 whatever the tile multiplied into it (a masked pair's 0 * inf is NaN). */
template <int NA>
__device__ __forceinline__ void sc_row_clear(float (&acc)[NA][4], int x, int seen)
{
    if (seen) return;
#pragma unroll
    for (int d = 0; d < NA; d++) acc[d][2 * x] = acc[d][2 * x + 1] = 0.0f;
}

/* Online softmax step without touching the accumulator, on raw scores S (sc_mask's) and their
 * log2-domain factor f (scale log2(e); 1 for scores already in that domain, as sc_softcap's):
 * P = exp2(S f - new max) per row, the exponent's argument one FFMA. The row max is taken on
 * the raw scores and then scaled (rounding is monotone and f > 0, so it is the max of the
 * scaled scores). The row max m_ and the row sum l_ (this lane's share) update, and alpha[x] is
 * the factor the accumulator's row x must take before the next product adds to it (a tile
 * whose previous product still runs applies it later, sc_rescale). */
template <int NT>
__device__ __forceinline__ void sc_softmax_rows(float (&S)[NT][4], float m_[2], float l_[2], float alpha[2],
                                                       float f)
{
#pragma unroll
    for (int x = 0; x < 2; x++) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(S[nt][2 * x], S[nt][2 * x + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mnew = fmaxf(m_[x], __fmul_rn(mx, f));
        const float muse = mnew == -INFINITY ? 0.0f : mnew;
        alpha[x] = ex2(m_[x] - muse);
        m_[x] = mnew;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            S[nt][2 * x] = ex2(__fmaf_rn(S[nt][2 * x], f, -muse));
            S[nt][2 * x + 1] = ex2(__fmaf_rn(S[nt][2 * x + 1], f, -muse));
            sum += S[nt][2 * x] + S[nt][2 * x + 1];
        }
        l_[x] = l_[x] * alpha[x] + sum;
    }
}

/* The accumulator rows times sc_softmax_rows' factors. */
template <int NA>
__device__ __forceinline__ void sc_rescale(float (&acc)[NA][4], const float alpha[2])
{
#pragma unroll
    for (int d = 0; d < NA; d++)
        acc[d][0] *= alpha[0], acc[d][1] *= alpha[0], acc[d][2] *= alpha[1], acc[d][3] *= alpha[1];
}

/* Online softmax step: sc_softmax_rows, then the accumulator rows rescale. */
template <int NT, int NA>
__device__ __forceinline__ void sc_softmax(float (&S)[NT][4], float m_[2], float l_[2], float (&acc)[NA][4], float f)
{
    float alpha[2];
    sc_softmax_rows<NT>(S, m_, l_, alpha, f);
    sc_rescale<NA>(acc, alpha);
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

#endif /* __CUDACC__ */

#endif
