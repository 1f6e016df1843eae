/* attn/plan.h -- tile sizes of the shared attention tiles (attn/tiles.h) and the planner of a
 * branch's dK / dV (attn/plan.c): which tile, with how many keys per task. Plain C. */
#ifndef NSA_CUDA_ATTN_PLAN_H
#define NSA_CUDA_ATTN_PLAN_H

#include "../plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shared memory of each kernel (bytes); the kernels carve in the same order. */
/* qtile's shape follows its chunk: 64 keys on four warps (64 rows) double-buffered, or 32 keys
 * on one warp (16 rows: the selected tiles at G >= 16) single-buffered, so more of those
 * latency-bound CTAs fit an SM */
#define QTILE_NW(bn) ((bn) == 32 ? 1 : 4)
#define QTILE_NST(bn) ((bn) == 32 ? 1 : 2)

NSA_SMEM_FN size_t qtile_smem(int DKP, int DVP, int nw, int mode, int nst, int bn)
{
    const size_t BM = 16 * (size_t)nw, LDK = DKP + 8, LDV = DVP + 8;
    /* one-warp forward: Q lives in registers (qtile_kernel's qreg) */
    const size_t el = (mode == MODE_FWD && nw == 1 ? 0 : BM * LDK) + (mode == MODE_DQ ? BM * LDV : 0) + (size_t)nst * bn * LDK + (size_t)nst * bn * LDV;
    return el * 2 + 2 * BM * 8 + 12 * 4 + 3 * 64;
}

NSA_SMEM_FN size_t ktile_smem(int DKP, int DVP)
{
    const size_t LDK = DKP + 8, LDV = DVP + 8;
    const size_t el = 3 * 64 * LDK + 3 * 64 * LDV;
    return el * 2 + 2 * 3 * 64 * 8 + 5 * 3 * 64 * 4 + 3 * 2 * 4;
}

/* Register budgets of the warp-specialised sm_90a kernels (qwg, kwp: 384 threads, one producer
 * and two consumer warpgroups; setmaxnreg: 128 x 40 + 256 x 232 <= 64k) */
#define WS_PREGS 40
#define WS_CREGS 232

#define KWG_BK 128 /* keys per kwg_kernel task (ktile: 64) */
/* Shared memory of kwg_kernel<DP>: slack, K and V of 128 keys, two Q and two dO stages of 64
 * rows, the three row slots of ktile (offsets, lse, D, gate, ranges, whole-chunk flags). */
NSA_SMEM_FN size_t kwg_smem(int DP)
{
    return 1024 + 2 * (size_t)KWG_BK * DP * 2 + 4 * (size_t)64 * DP * 2 + 3 * 64 * (2 * sizeof(int64_t) + 5 * 4) + 6 * 4;
}

/* kwp_kernel (attn/hopper_dkdv.cuh): kwg's tasks with a TMA producer warpgroup; row-chunk stages */
#define KWP_NS 3     /* range rules: both warpgroups on every chunk */
#define KWP_NS_SLC 4 /* selected rule: the warpgroups take alternate chunks */
/* slack, K and V of 128 keys (selected: 64), the stages of Q and dO (64 rows each), their
 * full / empty mbarriers, as many row slots (lse, D, gate, ranges: TMA needs no row offsets)
 * and whole-chunk flags */
NSA_SMEM_FN size_t kwp_smem(int DP, int slc)
{
    const size_t ns = slc ? KWP_NS_SLC : KWP_NS, bk = slc ? 64 : KWG_BK;
    return 1024 + 2 * bk * DP * 2 + 2 * ns * 64 * DP * 2 + 2 * ns * 8 + ns * 64 * 5 * 4 + ns * 2 * 4;
}

enum { CU_DKDV_KTILE = 0, CU_DKDV_KWG = 1, CU_DKDV_KWP = 2 };

typedef struct cu_dkdv_plan {
    int kernel; /* CU_DKDV_*: ktile (mma.sync), kwg (wgmma, cp.async rows), kwp (wgmma, TMA producer) */
    int bk;     /* keys per task: 64 (ktile; kwp on the selected rule), KWG_BK (kwg, kwp on the range rules) */
} cu_dkdv_plan;

/* dK / dV of a range rule (slc = 0; dq_on_wgmma: its dQ runs on the sm_90a tile, whose
 * conditions the wgmma dK / dV shares) or of the selected rule (slc = 1). The TMA tile kwp
 * takes G dividing 64 (a 64-row chunk is whole positions), DK == DV == 64 / 128 and aligned
 * views; no_tma: its tensor maps could not be made (the range rules keep kwg, whose sums are
 * the same bit for bit; the selected rule ktile). */
cu_dkdv_plan cu_plan_dkdv(const nsa_problem *p, const cu_device *d, const cu_overrides *o, const cu_views *v, int slc,
                          int dq_on_wgmma, int no_tma);
/* The rows of each row segment when a sequence's `all` dK / dV rows (positions x G) are cut into
 * nseg segments of whole 64-row chunks (the dK / dV tiles' row chunk): kt_task_get cuts them so
 * and cu_plan_range_segments counts them so. */
#ifdef __CUDACC__
__host__ __device__ __forceinline__
#else
static inline
#endif
int64_t cu_seg_rows(int64_t all, int64_t nseg)
{
    return ((all + nseg - 1) / nseg + 63) / 64 * 64;
}

/* Row segments per compressed key tile of the range dK / dV: a power of two 8 .. 128, the most
 * that keeps the batch's tasks at 4096 or under and each segment a 64-row chunk or more (the
 * same in the sizing and the live pass; NSA_CUDA_CMP_SEG overrides it). */
int cu_plan_cmp_segments(const nsa_problem *p, const cu_overrides *o);
/* Row segments of the window / dense rule's dK / dV (wl, wr, causal, shift, nk as its rule_t):
 * 1, or where the batch's key tiles x kv heads are fewer than 165 and the longest task is more
 * than 1.5x an SM's share (causal attention with one or two kv heads), the fewest of 2 .. 64
 * that give 165 tasks with rows. Host-only counting (~1 us), device-free, so the sizing and the
 * live pass agree; NSA_CUDA_RANGE_SEG overrides it. */
int cu_plan_range_segments(const nsa_problem *p, int64_t wl, int64_t wr, int causal, int64_t shift, int64_t nk,
                           const cu_overrides *o);

#ifdef __cplusplus
}
#endif

#endif
