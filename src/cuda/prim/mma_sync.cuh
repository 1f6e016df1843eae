/* prim/mma_sync.cuh -- the sm_80 tensor-core primitives every tile shares: any-dtype element
 * loads and stores, dtype traits with the mma.sync m16n8k16 product, ldmatrix, cp.async, the
 * fragment address maps, and the row loaders that stage tensor rows into shared memory. */
#ifndef NSA_CUDA_PRIM_MMA_SYNC_CUH
#define NSA_CUDA_PRIM_MMA_SYNC_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "seq.cuh"

#if defined(__CUDACC__)

/* ==== dtypes ============================================================================ */

__device__ __forceinline__ float ld_any(const void *p, int dt, int64_t off)
{
    switch (dt) {
    case NSA_DTYPE_F32: return ((const float *)p)[off];
    case NSA_DTYPE_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[off]);
    case NSA_DTYPE_F16: return __half2float(((const __half *)p)[off]);
    default: return (float)((const int32_t *)p)[off];
    }
}

__device__ __forceinline__ void st_any(void *p, int dt, int64_t off, float x)
{
    switch (dt) {
    case NSA_DTYPE_F32: ((float *)p)[off] = x; break;
    case NSA_DTYPE_BF16: ((__nv_bfloat16 *)p)[off] = __float2bfloat16_rn(x); break;
    case NSA_DTYPE_F16: ((__half *)p)[off] = __float2half_rn(x); break;
    default: ((int32_t *)p)[off] = (int32_t)x;
    }
}

template <typename T> struct dtraits;
template <> struct dtraits<__nv_bfloat16> {
    static constexpr int dt = NSA_DTYPE_BF16; /* for the any-dtype helpers, where it folds */
    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *(uint32_t *)&v;
    }
    static __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct dtraits<__half> {
    static constexpr int dt = NSA_DTYPE_F16;
    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        __half2 v = __floats2half2_rn(lo, hi);
        return *(uint32_t *)&v;
    }
    static __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from_f(float x) { return __float2half_rn(x); }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

/* ==== shared-memory movement ============================================================ */

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* Four 8x8 b16 matrices; thread i gives the address of row (i % 8) of matrix i / 8. */
__device__ __forceinline__ void ldsm4(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm4t(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

/* 16-byte asynchronous copy; bytes < 16 zero-fills the rest. */
/* 4-byte cp.async (L1-allocating: the per-row values of a chunk, one float each) */
__device__ __forceinline__ void cp4(void *dst, const void *src)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp16(void *dst, const void *src, int bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
/* 16-byte asynchronous copy of a whole 16 bytes (no size operand, no predicate). */
__device__ __forceinline__ void cp16_full(void *dst, const void *src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

/* Fragment addresses (lane -> smem element), for a 16 x 16 block at (r0, c0) of a
 * row-major tile with leading dimension ld:
 *   A operand (rows = m, cols = k), and B operands whose rows are n (non-transposed):  */
__device__ __forceinline__ int frag_a_off(int lane, int ld) { return ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8; }
/* B operand from rows = n (e.g. K [key][d] for S = Q K^T): x4 gives b0,b1 of n-tile 0 and
 * b0,b1 of n-tile 1. */
__device__ __forceinline__ int frag_bn_off(int lane, int ld) { return ((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8; }
/* B operand from rows = k (e.g. V [key][dv] for O = P V), with ldmatrix.trans. */
__device__ __forceinline__ int frag_bk_off(int lane, int ld) { return ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8; }

/* Copies rows of a tensor into a shared tile of `rows` x DP elements (leading dimension
 * ld). Row i comes from src + roff[i] (roff[i] < 0: a zero row); columns >= D are zero.
 * Aligned views use cp.async (the caller commits and waits); others scalar loads. */
template <typename T, int DP>
__device__ __forceinline__ void load_rows(T *dst, int ld, const T *src, const int64_t *roff, int rows, int D, int al,
                                          int tid, int nthr)
{
    constexpr int CH = DP / 8;
    if (al && D == DP && nthr % CH == 0) {
        /* fast path (full aligned rows, the common case): each thread keeps one 16-byte
         * column of every (nthr / CH)-th row, so the loop is a table read and one cp.async
         * per row instead of the general path's divisions, bounds and branches; this
         * address arithmetic was about half the instructions of the selected branch */
        const int rpi = nthr / CH, c = (tid % CH) * 8;
#pragma unroll 2
        for (int r = tid / CH; r < rows; r += rpi) {
            const int64_t off = roff[r];
            cp16(dst + r * ld + c, off >= 0 ? src + off + c : src, off >= 0 ? 16 : 0);
        }
        return;
    }
    for (int idx = tid; idx < rows * CH; idx += nthr) {
        const int r = idx / CH, c = (idx % CH) * 8;
        T *d = dst + r * ld + c;
        const int64_t off = roff[r];
        if (off < 0 || c >= D) {
            *(uint4 *)d = make_uint4(0, 0, 0, 0);
        } else if (al) {
            const int n = D - c < 8 ? D - c : 8;
            cp16(d, src + off + c, n * 2);
        } else {
            for (int e = 0; e < 8; e++) d[e] = c + e < D ? src[off + c + e] : dtraits<T>::from_f(0.0f);
        }
    }
}

/* ROWS full rows of DP elements, row i at src + i * stride, by NTHR threads: compile-time
 * trip count and shared offsets, so each 16-byte copy is one cp.async plus a 64-bit add
 * (the run-time loop cost ~13 instructions per copy, most of a one-warp tile's work). */
template <typename T, int DP, int NTHR, int ROWS>
__device__ __forceinline__ void load_tile_full(T *dst, int ld, const T *src, int64_t stride, int tid)
{
    constexpr int CH = DP / 8, RPI = NTHR / CH;
    static_assert(NTHR % CH == 0 && ROWS % RPI == 0, "whole rows per pass");
    const T *s = src + (int64_t)(tid / CH) * stride + (tid % CH) * 8;
    T *d = dst + (tid / CH) * ld + (tid % CH) * 8;
    const int64_t step = (int64_t)RPI * stride;
#pragma unroll
    for (int i = 0; i < ROWS / RPI; i++, s += step) cp16_full(d + i * RPI * ld, s);
}

/* Same for `rows` consecutive rows base + i * stride, i < valid (the rest zero). */
template <typename T, int DP>
__device__ __forceinline__ void load_rows_lin(T *dst, int ld, const T *src, int64_t base, int64_t stride, int valid,
                                              int rows, int D, int al, int tid, int nthr)
{
    constexpr int CH = DP / 8;
    if (al && D == DP && valid == rows) { /* whole tiles: 64 rows by one or four warps, 32 by one */
        if constexpr (32 % CH == 0) {
            if (nthr == 32 && rows == 64) {
                load_tile_full<T, DP, 32, 64>(dst, ld, src + base, stride, tid);
                return;
            }
            if (nthr == 32 && rows == 32) {
                load_tile_full<T, DP, 32, 32>(dst, ld, src + base, stride, tid);
                return;
            }
        }
        if constexpr (128 % CH == 0) {
            if (nthr == 128 && rows == 64) {
                load_tile_full<T, DP, 128, 64>(dst, ld, src + base, stride, tid);
                return;
            }
        }
    }
    if (al && D == DP && nthr % CH == 0) { /* fast path, as in load_rows */
        const int rpi = nthr / CH, r0 = tid / CH, c = (tid % CH) * 8;
        const T *s = src + base + (int64_t)r0 * stride + c;
        const int64_t sstep = (int64_t)rpi * stride;
        T *d = dst + r0 * ld + c;
#pragma unroll 4
        for (int r = r0; r < rows; r += rpi, s += sstep, d += rpi * ld) cp16(d, r < valid ? s : src, r < valid ? 16 : 0);
        return;
    }
    for (int idx = tid; idx < rows * CH; idx += nthr) {
        const int r = idx / CH, c = (idx % CH) * 8;
        T *d = dst + r * ld + c;
        if (r >= valid || c >= D) {
            *(uint4 *)d = make_uint4(0, 0, 0, 0);
        } else {
            const int64_t off = base + (int64_t)r * stride;
            if (al) {
                const int n = D - c < 8 ? D - c : 8;
                cp16(d, src + off + c, n * 2);
            } else {
                for (int e = 0; e < 8; e++) d[e] = c + e < D ? src[off + c + e] : dtraits<T>::from_f(0.0f);
            }
        }
    }
}

__device__ __forceinline__ float warp_sum(float x)
{
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

#endif /* __CUDACC__ */

#endif
