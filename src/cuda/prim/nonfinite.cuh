/* prim/nonfinite.cuh -- non-finite operand values against masked pairs. A tensor-core product
 * multiplies every pair of its tile, masked ones included, and 0 * inf and 0 * NaN are NaN: a
 * non-finite value in a key row (forward, dQ) or a query row (dK / dV) that some row of the
 * tile does not see would reach that row -- a row the mask hides it from, a padded row's
 * neighbour, another sequence of a packed batch. So a tile with masked pairs checks the operand
 * rows that some of its rows do not see (a handful at a window's or the diagonal's edge, none
 * in a whole tile) and, only when one holds a non-finite value, replaces that product by a
 * scalar sum over the visible pairs: dense attention's result, paid for only by the tiles that
 * meet such a value. The choice is uniform over the threads that issue the product together
 * (a warp for mma.sync, a warpgroup for wgmma), as the callers' row bounds are. All of this
 * lives in the careful variant of each kernel, which runs only for calls whose inputs hold a
 * non-finite value (the flag of run.h): finite calls run the plain tiles, unchanged. */
#ifndef NSA_CUDA_PRIM_NONFINITE_CUH
#define NSA_CUDA_PRIM_NONFINITE_CUH

#include "mma_sync.cuh"
#include "wgmma.cuh"

#if defined(__CUDACC__)

/* Each tile kernel exists twice: the plain variant (NF false), exactly the tiles' arithmetic,
 * and the careful one (NF true) with the checks above. Both are launched; at its start each
 * reads the call's flag (run.h) and one of them stands aside: the plain one when the inputs
 * hold a non-finite value, the careful one when they do not (or nf is NULL). */
template <bool NF> __device__ __forceinline__ bool nf_stand_aside(const int *nf)
{
    const bool set = nf != nullptr && *(const volatile int *)nf != 0;
    return NF != set;
}

/* Exponent bits of the 16-bit storage types: all ones is an infinity or a NaN. */
template <typename T> struct nf_bits;
template <> struct nf_bits<__nv_bfloat16> { static constexpr uint32_t exp = 0x7F80u; };
template <> struct nf_bits<__half> { static constexpr uint32_t exp = 0x7C00u; };

/* Whether either of two packed 16-bit values is non-finite. */
template <typename T> __device__ __forceinline__ bool nf_pair(uint32_t w)
{
    constexpr uint32_t E = nf_bits<T>::exp;
    return (w & E) == E || ((w >> 16) & E) == E;
}

/* The two packed values of a 32-bit word as floats (element 0 in the low half). */
template <typename T> __device__ __forceinline__ void nf_unpack(uint32_t w, float &lo, float &hi)
{
    T a, b;
    const unsigned short ul = (unsigned short)(w & 0xFFFFu), uh = (unsigned short)(w >> 16);
    memcpy(&a, &ul, 2);
    memcpy(&b, &uh, 2);
    lo = dtraits<T>::to_f(a), hi = dtraits<T>::to_f(b);
}

/* An operand tile in shared memory: rows of 16-byte chunks, either the 128-byte swizzle of
 * wgmma.cuh (ld 0: a tile of R rows) or plain rows ld bytes apart (the padded cp.async tiles). */
struct nf_tile {
    const unsigned char *p;
    int R, ld;
    __device__ __forceinline__ const unsigned char *chunk(int r, int c) const
    {
        return ld ? p + r * ld + c * 16 : p + sw_off(R, r, c);
    }
};

/* Whether the edges of an n-row chunk hold a non-finite value in their first D columns: rows
 * [0, a) and [b, n), a and b clamped to [0, n) -- the keys below the largest first visible key
 * of a tile's rows, and those past the smallest last one (the only keys some row of a tile of
 * interval rules does not see). The warp's answer, one vote. */
template <typename T, int D>
__device__ __forceinline__ bool nf_edges_any(const nf_tile &t, int a, int b, int n, int lane)
{
    constexpr int CH = D / 8;
    a = a < 0 ? 0 : a > n ? n : a;
    b = b < 0 ? 0 : b > n ? n : b;
    if (a >= b) a = n, b = n; /* the edges meet: every row */
    const int rows = a + (n - b); /* rows [0, a), then [b, n) */
    bool bad = false;
    for (int i = lane; i < rows * CH; i += 32) {
        const int k = i / CH, r = k < a ? k : b + (k - a);
        const uint4 v = *(const uint4 *)t.chunk(r, i % CH);
        bad |= nf_pair<T>(v.x) | nf_pair<T>(v.y) | nf_pair<T>(v.z) | nf_pair<T>(v.w);
    }
    return __any_sync(0xffffffffu, bad);
}

/* The same over the rows set in a 64-bit mask (warp-uniform), of tile t (D columns) and, when
 * u.p is set, of tile u (DU columns): one vote for both (a warp's votes are not combined after
 * the fact). */
template <typename T, int D, int DU = D>
__device__ __forceinline__ bool nf_mask_any(const nf_tile &t, uint64_t rows, int lane, const nf_tile u = nf_tile{nullptr, 0, 0})
{
    constexpr int CH = D / 8, CU = DU / 8;
    bool bad = false;
    while (rows) {
        const int r = __ffsll((long long)rows) - 1;
        rows &= rows - 1;
        for (int c = lane; c < CH + (u.p ? CU : 0); c += 32) {
            const uint4 v = *(const uint4 *)(c < CH ? t.chunk(r, c) : u.chunk(r, c - CH));
            bad |= nf_pair<T>(v.x) | nf_pair<T>(v.y) | nf_pair<T>(v.z) | nf_pair<T>(v.w);
        }
    }
    return __any_sync(0xffffffffu, bad);
}

/* The weight of a hidden pair in the tiles that mark it in place (the attention options'
 * kernels, whose masks are not intervals): -0.0f, which no visible weight (exp(.) >= +0, or
 * a product of one) is. */
__device__ __forceinline__ float nf_hide() { return -0.0f; }
__device__ __forceinline__ bool nf_hidden(float a) { return __float_as_uint(a) == 0x80000000u; }

/* The OR of a 64-bit mask over the warp. */
__device__ __forceinline__ uint64_t nf_warp_or(uint64_t m)
{
    const unsigned lo = __reduce_or_sync(0xffffffffu, (unsigned)m), hi = __reduce_or_sync(0xffffffffu, (unsigned)(m >> 32));
    return lo | (uint64_t)hi << 32;
}

/* acc += A B over the pairs a row sees, for a warp's 16 rows in the accumulator layout of
 * softmax.cuh: A the fp32 values (P or dS) of the NT * 8 columns j, B the tile's rows j (NA * 8
 * columns); vis(x, j, a): whether this lane's row x (lane / 4 + 8 x) sees column j, whose A
 * value is a (for tiles that mark hidden pairs in place: nf_hidden). A hidden
 * pair adds nothing, whatever its operands hold. Each A value comes from the quad lane that
 * holds it; the columns are walked in a loop (A through a local copy), as this path runs only
 * for tiles that meet a non-finite value. */
template <typename T, int NT, int NA, typename Vis>
__device__ __forceinline__ void nf_product(float (&acc)[NA][4], const float (&A)[NT][4], const nf_tile &b, int lane,
                                           Vis vis)
{
    float a[NT * 4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) a[nt * 4 + e] = A[nt][e];
#pragma unroll 1
    for (int j = 0; j < NT * 8; j++) {
        const int i = (j >> 3) * 4 + (j & 1), src = (lane & ~3) | ((j & 7) >> 1);
        const float p0 = __shfl_sync(0xffffffffu, a[i], src), p1 = __shfl_sync(0xffffffffu, a[i + 2], src);
        const bool v0 = vis(0, j, p0), v1 = vis(1, j, p1);
#pragma unroll
        for (int d = 0; d < NA; d++) {
            float b0, b1;
            nf_unpack<T>(*(const uint32_t *)(b.chunk(j, d) + (lane & 3) * 4), b0, b1);
            if (v0) acc[d][0] += p0 * b0, acc[d][1] += p0 * b1;
            if (v1) acc[d][2] += p1 * b0, acc[d][3] += p1 * b1;
        }
    }
}

#endif /* __CUDACC__ */

#endif
