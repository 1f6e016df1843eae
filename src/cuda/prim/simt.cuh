/* prim/simt.cuh -- helpers of the scalar attention kernels (attn/simt.cu, attention/simt.cu):
 * one warp per row, lane l owning columns l, l + 32, ... (head dims up to 256), elements
 * read in any storage dtype, dot products met by one fixed butterfly (deterministic), a
 * persistent grid that walks the rows, and the stand-aside test of the non-finite path. */
#ifndef NSA_CUDA_PRIM_SIMT_CUH
#define NSA_CUDA_PRIM_SIMT_CUH

#include "mma_sync.cuh" /* ld_any, st_any */

#define SIMT_COLS 8 /* columns per lane */
#define SIMT_WARPS 8
#define SIMT_BLOCKS_PER_SM 8

#if defined(__CUDACC__)

/* lane's columns of row `off` of t (0 past D) */
__device__ __forceinline__ void simt_load(float (&x)[SIMT_COLS], const dview &t, int64_t off, int D, int lane)
{
#pragma unroll
    for (int i = 0; i < SIMT_COLS; i++) {
        const int d = lane + 32 * i;
        x[i] = d < D ? ld_any(t.p, t.dt, off + d) : 0.0f;
    }
}

/* the warp's dot product of two rows held as above */
__device__ __forceinline__ float simt_dot(const float (&a)[SIMT_COLS], const float (&b)[SIMT_COLS], int D, int lane)
{
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < SIMT_COLS; i++)
        if (lane + 32 * i < D) s = fmaf(a[i], b[i], s);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

/* lane's columns of a row times mul into row `off` of view t */
__device__ __forceinline__ void simt_store(const dview &t, int64_t off, int D, const float (&x)[SIMT_COLS], float mul,
                                           int lane)
{
#pragma unroll
    for (int i = 0; i < SIMT_COLS; i++) {
        const int d = lane + 32 * i;
        if (d < D) st_any(t.p, t.dt, off + d, x[i] * mul);
    }
}

/* only_if: NULL runs the kernel; else it runs only when *only_if (a call's non-finite flag,
 * run.h) is set, the tiles standing aside (nonfinite.cuh) */
__device__ __forceinline__ bool simt_stand_aside(const int *only_if)
{
    return only_if != nullptr && *(const volatile int *)only_if == 0;
}

/* The scalar kernels' row finish, in the natural-log domain (the tiles' sc_row_finish works in
 * log2): lse from the running max m and the sum l, and o's multiplier returned. A row that saw
 * keys whose weights are all 0 (scores all -inf) is 0 / 0 in dense attention, NaN; under
 * flex_rows it is empty instead, and *seen is cleared. A row that saw none: o = 0, lse = -inf.
 * A sink (sinks[hq * sinks_s]; NULL: none) adds e^sink to the sum. */
__device__ __forceinline__ float simt_row_finish(float m, float l, bool *seen, int flex_rows, const float *sinks,
                                                 int64_t sinks_s, int64_t hq, float *lse_out)
{
    if (flex_rows && l == 0.0f) *seen = false;
    const bool nan_row = l == 0.0f && *seen && !sinks;
    float lse = l != 0.0f ? m + logf(l) : nan_row ? NAN : -INFINITY;
    float wgt = l != 0.0f ? 1.0f / l : nan_row ? NAN : 0.0f;
    if (sinks) {
        const float sk = sinks[hq * sinks_s], mx = lse > sk ? lse : sk;
        if (mx != -INFINITY) {
            const float lz = mx + logf(expf(lse - mx) + expf(sk - mx));
            wgt *= expf(lse - lz);
            lse = lz;
        }
    }
    *lse_out = lse;
    return wgt;
}

/* the first warp index and the stride of the grid's walk over work items */
__device__ __forceinline__ int64_t simt_warp0() { return (int64_t)blockIdx.x * SIMT_WARPS + (threadIdx.x >> 5); }
__device__ __forceinline__ int64_t simt_nwarps() { return (int64_t)gridDim.x * SIMT_WARPS; }

/* Blocks for `items` warps of work: at most SIMT_BLOCKS_PER_SM per SM, each warp walking
 * items apart (a stand-aside launch then costs one wave of blocks that return at once). */
static inline unsigned simt_grid(int64_t items)
{
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        sms <= 0)
        sms = 132;
    const int64_t want = (items + SIMT_WARPS - 1) / SIMT_WARPS, cap = (int64_t)sms * SIMT_BLOCKS_PER_SM;
    return (unsigned)(want < cap ? (want > 0 ? want : 1) : cap);
}

#endif /* __CUDACC__ */

#endif
