/* prim/tma.cuh -- the Hopper (sm_90a) data-movement and synchronisation primitives: named
 * barriers between warpgroups, mbarriers, register reallocation (setmaxnreg), TMA tensor
 * loads and stores (cp.async.bulk.tensor). The tensor maps are encoded on the host
 * (prim/tmap.h). */
#ifndef NSA_CUDA_PRIM_TMA_CUH
#define NSA_CUDA_PRIM_TMA_CUH

#include "common.cuh"

#if defined(__CUDACC__)

/* Named barrier ids (0 is __syncthreads), one list for every kernel so no two uses collide
 * by accident. With 256 threads (nb_sync / nb_arrive) they join the two consumer warpgroups
 * of a CTA; nb_sync_wg joins one warpgroup's 128. */
enum nb_id {
    NB_PP_A = 1,     /* range forward ping-pong: warpgroup 1's score products after 0's */
    NB_PP_B0 = 2,    /* ... warpgroup 0's accumulating products after 1's score products */
    NB_PP_B1 = 3,    /* ... warpgroup 1's accumulating products after 0's */
    NB_DKDV_SUM = 1, /* selected dK / dV: warpgroup 1's sums handed to warpgroup 0 (no ping-pong there) */
    NB_TASK = 4,     /* range tile: both consumers done with a task's Q, rows and offsets */
    NB_WG0 = 5,      /* range tile: a warpgroup's O tile written before its TMA store (5 + warpgroup) */
    NB_PP_TURN0 = 7, /* range forward, pipelined: warpgroup w's turn to issue its products (7 + w) */
    NB_SWG_PRODUCTS = 1, /* selection, merge in its own warpgroup: the products' warpgroup alone */
    NB_SWG_FULL = 2,     /* ... a pass's importances written (2 + pass % 2) */
    NB_SWG_EMPTY = 4,    /* ... a pass's importances merged, its buffer free (4 + pass % 2) */
    NB_SWG_MERGE = 6,    /* ... the merge warpgroup alone */
};
__device__ __forceinline__ void nb_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void nb_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
/* ... and one warpgroup's own (128 threads) */
__device__ __forceinline__ void nb_sync_wg(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }

/* ---- TMA (cp.async.bulk.tensor) and mbarriers ------------------------------------------
 * A box of a tensor map lands in shared memory and completes a transaction count on an
 * mbarrier; the waiting threads poll the barrier's phase parity. Used by the selected-
 * attention tiles (selected/hopper_fwd_dq.cuh), whose one warp would otherwise spend its issue
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
/* mb_wait for a producer warp: each try_wait may suspend the warp up to a long time limit
 * (it still returns when the phase completes) instead of the short default, so that the
 * producer's polling does not take issue slots from the consumer warps beside it on the same
 * scheduler. */
__device__ __forceinline__ void mb_wait_sleep(uint64_t *bar, int parity)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n.reg .pred p;\nMB_WAIT_SLEEP_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1, %2;\n"
                 "@!p bra MB_WAIT_SLEEP_%=;\n}\n" ::"r"(smem_addr(bar)),
                 "r"(parity), "r"(10000000u)
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
