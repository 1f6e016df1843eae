/* wgmma.cuh -- the Hopper (sm_90a) primitives the engine kernels share: wgmma fences and
 * groups, the async-proxy fence, named barriers, shared-memory descriptors for the 128-byte
 * swizzle, and the loaders that write swizzled tiles with cp.async. The wgmma products
 * themselves are in wgmma_ops.cuh (generated). Layout of a swizzled tile of R rows x D
 * columns: D / 64 column blocks of R x 128 bytes, 16-byte chunk c of row r at chunk
 * c ^ (r % 8) of its row, every block starting on 1024 bytes. */
#ifndef NSA_CUDA_WGMMA_CUH
#define NSA_CUDA_WGMMA_CUH

#include "common.cuh"
#include "wgmma_ops.cuh"

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

/* Named barriers (ids 1..3; 0 is __syncthreads) between the two warpgroups of a CTA. */
__device__ __forceinline__ void nb_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void nb_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
/* ... and one warpgroup's own (128 threads) */
__device__ __forceinline__ void nb_sync_wg(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }

/* wgmma shared-memory descriptor, 128-byte swizzle: start address, leading and stride byte
 * offsets (16-byte units, 14 bits each), layout type 1 = SWIZZLE_128B in bits 62-63. */
__device__ __forceinline__ uint64_t wg_desc(const void *p, uint32_t lbo, uint32_t sbo)
{
    const uint64_t a = (uint64_t)smem_addr(p);
    return ((a & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) | ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) |
           (1ull << 62);
}

/* Byte offset of 16-byte chunk c of row r in a swizzled tile of R rows. */
__device__ __forceinline__ int sw_off(int R, int r, int c) { return (c >> 3) * R * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4); }

/* d (NW columns) = A B^T over KT steps of 16 head-dim columns: A (64 rows at a, inside a tile
 * of RA rows) and B (NW rows of a tile of RB rows) K-major swizzled tiles; a step is 32 bytes
 * of a 128-byte swizzle row, the next 64-column block after four steps. */
template <typename T, int NW, int KT, int RA, int RB>
__device__ __forceinline__ void wg_ss_kmajor(float *d, const unsigned char *a, const unsigned char *b)
{
#pragma unroll
    for (int kk = 0; kk < KT; kk++) {
        const uint64_t da = wg_desc(a + (kk >> 2) * RA * 128 + (kk & 3) * 32, 16, 1024);
        const uint64_t db = wg_desc(b + (kk >> 2) * RB * 128 + (kk & 3) * 32, 16, 1024);
        wgmma_op<T, NW>::template ss<0>(d, da, db, kk > 0);
    }
}

/* acc (DA columns) += P B: P as A fragments pa[NW / 16] (16 keys each), B MN-major (the head
 * dim contiguous) in a tile of RB rows: 8-key row groups 1024 bytes apart, 64-column blocks
 * RB * 128 bytes apart (O += P V, dQ += dS K). */
template <typename T, int DA, int NW, int RB>
__device__ __forceinline__ void wg_rs_mn(float *acc, const uint32_t (*pa)[4], const unsigned char *b)
{
#pragma unroll
    for (int k2 = 0; k2 < NW / 16; k2++) wgmma_op<T, DA>::template rs<1>(acc, pa[k2], wg_desc(b + k2 * 16 * 128, RB * 128, 1024), 1);
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

/* ---- TMA (cp.async.bulk.tensor) and mbarriers ------------------------------------------
 * A box of a tensor map lands in shared memory and completes a transaction count on an
 * mbarrier; the waiting threads poll the barrier's phase parity. Used by the selected-
 * attention tiles (hopper.cuh sfw_kernel), whose one warp would otherwise spend its issue
 * slots on 16-byte cp.async copies. */
__device__ __forceinline__ void mb_init(uint64_t *bar, int count)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}
/* the barriers' initialisation visible to the copy engine before the first copy */
__device__ __forceinline__ void mb_init_fence()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
/* one arrival that also expects `bytes` of copies on the barrier's current phase */
__device__ __forceinline__ void mb_expect(uint64_t *bar, uint32_t bytes)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mb_wait(uint64_t *bar, int parity)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n.reg .pred p;\nMB_WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra MB_WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
                 "r"(parity)
                 : "memory");
#endif
}
/* expect `bytes` more of copies on the barrier's current phase, without arriving (the
 * copies may be issued before the arrivals that complete the phase) */
__device__ __forceinline__ void mb_expect_tx(uint64_t *bar, uint32_t bytes)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}
/* one plain arrival (release: this thread's earlier shared-memory stores are visible to
 * whoever waits on the phase it completes) */
__device__ __forceinline__ void mb_arrive(uint64_t *bar)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}
/* one arrival once every cp.async this thread issued so far has landed (noinc: the
 * barrier's count includes it) */
__device__ __forceinline__ void mb_arrive_cp(uint64_t *bar)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}
/* Register budget of this warpgroup from here on (warp-specialised kernels: a producer gives
 * registers back, the consumers take them); every thread of the warpgroup executes it. */
template <int N> __device__ __forceinline__ void regs_dec()
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N> __device__ __forceinline__ void regs_inc()
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
/* box at coordinates (c0 innermost, c1, c2, c3) of a 4-D tensor map into dst */
__device__ __forceinline__ void tma_load4(void *dst, const void *map, int c0, int c1, int c2, int c3, uint64_t *bar)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(
                     smem_addr(dst)),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
                 : "memory");
#endif
}

/* shared memory at src (a box in the map's swizzled layout) to the box at coordinates (c0
 * innermost .. c3) of a 4-D tensor map, as one bulk group of this thread; rows past the
 * tensor are not written */
__device__ __forceinline__ void tma_store4(const void *map, const void *src, int c0, int c1, int c2, int c3)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"((uint64_t)map),
                 "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
#endif
}
/* close this thread's bulk stores into a group; wait until every group has read its shared
 * memory (the writes to global memory complete on their own) */
__device__ __forceinline__ void tma_store_commit()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void tma_store_wait_read()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}

#endif /* __CUDACC__ */
#endif
