/* prim/wgmma.cuh -- the Hopper (sm_90a) tensor-core primitives: wgmma fences and groups, the
 * async-proxy fence, shared-memory descriptors for the 128-byte swizzle, and the loaders that
 * write swizzled tiles with cp.async. The wgmma products are in wgmma_ops.cuh (generated);
 * TMA, mbarriers and named barriers in tma.cuh. Layout of a swizzled tile of R rows x D
 * columns: D / 64 column blocks of R x 128 bytes, 16-byte chunk c of row r at chunk
 * c ^ (r % 8) of its row, every block starting on 1024 bytes. */
#ifndef NSA_CUDA_PRIM_WGMMA_CUH
#define NSA_CUDA_PRIM_WGMMA_CUH

#include "common.cuh"
#include "wgmma_ops.cuh"
#include "tma.cuh"

#if defined(__CUDACC__)

/* The first 1024-byte boundary inside the dynamic shared memory `raw` (the swizzled tiles'
 * alignment), as an offset from raw so that the compiler keeps the shared address space: a
 * pointer rebuilt from an integer is generic, and every scalar load through it a generic LD
 * (long-scoreboard latency) instead of an LDS. */
__device__ __forceinline__ unsigned char *smem_align1024(unsigned char *raw)
{
    return raw + ((1024u - (smem_addr(raw) & 1023u)) & 1023u);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* cp.async (generic proxy) writes -> wgmma (async proxy) reads: each writer fences, then a
 * barrier */
__device__ __forceinline__ void fence_async_smem()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

/* wgmma shared-memory descriptor, 128-byte swizzle: start address, leading and stride byte
 * offsets (16-byte units, 14 bits each), layout type 1 = SWIZZLE_128B in bits 62-63. */
__device__ __forceinline__ uint64_t wg_desc(const void *p, uint32_t lbo, uint32_t sbo)
{
    const uint64_t a = (uint64_t)smem_addr(p);
    return ((a & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) | ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) |
           (1ull << 62);
}

/* The descriptor of the same tile `off` bytes further on (off a multiple of 16). Only the
 * start-address field changes, and it cannot carry out of its 14 bits (a CTA's shared memory
 * ends below 256 KB), so one 32-bit add replaces rebuilding the descriptor's fields: a tile's
 * products take their k-step and stage descriptors from one base this way. */
__device__ __forceinline__ uint64_t wg_desc_at(uint64_t d, uint32_t off)
{
    const uint32_t lo = (uint32_t)d + (off >> 4), hi = (uint32_t)(d >> 32);
    return ((uint64_t)hi << 32) | lo;
}

/* Byte offset of 16-byte chunk c of row r in a swizzled tile of R rows. */
__device__ __forceinline__ int sw_off(int R, int r, int c) { return (c >> 3) * R * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4); }

/* The K-major descriptor of a swizzled tile at p (the products' A and B of wg_ss_kd). */
__device__ __forceinline__ uint64_t wg_desc_k(const void *p) { return wg_desc(p, 16, 1024); }

/* d (NW columns) = A B^T over KT steps of 16 head-dim columns: A (64 rows at descriptor da,
 * inside a tile of RA rows) and B (NW rows of a tile of RB rows) K-major swizzled tiles; a step
 * is 32 bytes of a 128-byte swizzle row, the next 64-column block after four steps. */
template <typename T, int NW, int KT, int RA, int RB>
__device__ __forceinline__ void wg_ss_kd(float *d, uint64_t da, uint64_t db)
{
#pragma unroll
    for (int kk = 0; kk < KT; kk++)
        wgmma_op<T, NW>::template ss<0>(d, wg_desc_at(da, (kk >> 2) * RA * 128 + (kk & 3) * 32),
                                        wg_desc_at(db, (kk >> 2) * RB * 128 + (kk & 3) * 32), kk > 0);
}

/* ... the same from the tiles' addresses a and b */
template <typename T, int NW, int KT, int RA, int RB>
__device__ __forceinline__ void wg_ss_kmajor(float *d, const unsigned char *a, const unsigned char *b)
{
    wg_ss_kd<T, NW, KT, RA, RB>(d, wg_desc_k(a), wg_desc_k(b));
}

/* The MN-major descriptor of a B tile of RB rows at p (the head dim contiguous: 8-row groups
 * 1024 bytes apart, 64-column blocks RB * 128 bytes apart), for wg_rs_md. */
template <int RB> __device__ __forceinline__ uint64_t wg_desc_mn(const void *p) { return wg_desc(p, RB * 128, 1024); }

/* acc (DA columns) += P B: P as A fragments pa[NW / 16] (16 keys each), B MN-major at
 * descriptor db (wg_desc_mn<RB>) (O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q). */
template <typename T, int DA, int NW>
__device__ __forceinline__ void wg_rs_md(float *acc, const uint32_t (*pa)[4], uint64_t db)
{
#pragma unroll
    for (int k2 = 0; k2 < NW / 16; k2++) wgmma_op<T, DA>::template rs<1>(acc, pa[k2], wg_desc_at(db, k2 * 16 * 128), 1);
}

/* ... the same from the tile's address b */
template <typename T, int DA, int NW, int RB>
__device__ __forceinline__ void wg_rs_mn(float *acc, const uint32_t (*pa)[4], const unsigned char *b)
{
    wg_rs_md<T, DA, NW>(acc, pa, wg_desc_mn<RB>(b));
}

/* R rows of DP elements into a swizzled tile: row r from src + roff[r] (roff < 0: zeros). */
template <typename T, int DP, int R, int NTHR>
__device__ __forceinline__ void sw_load_rows(unsigned char *dst, const T *src, const int64_t *roff, int tid)
{
    constexpr int CH = DP / 8;
#pragma unroll
    for (int i = 0; i < R * CH / NTHR; i++) {
        const int idx = tid + i * NTHR, r = idx / CH, c = idx % CH;
        const int64_t off = roff[r];
        cp16(dst + sw_off(R, r, c), off >= 0 ? src + off + c * 8 : src, off >= 0 ? 16 : 0);
    }
}

/* R consecutive rows (row r at src + base + r * stride, the first `valid` of them real, the
 * rest zeros: masked keys must meet finite V rows) into a swizzled tile. */
template <typename T, int DP, int R, int NTHR>
__device__ __forceinline__ void sw_load_lin(unsigned char *dst, const T *src, int64_t base, int64_t stride, int valid,
                                            int tid)
{
    constexpr int CH = DP / 8;
#pragma unroll
    for (int i = 0; i < R * CH / NTHR; i++) {
        const int idx = tid + i * NTHR, r = idx / CH, c = idx % CH;
        const bool ok = r < valid;
        cp16(dst + sw_off(R, r, c), ok ? src + base + (int64_t)r * stride + c * 8 : src, ok ? 16 : 0);
    }
}

#endif /* __CUDACC__ */

#endif
