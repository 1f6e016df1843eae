/* selection/plan.h -- tile sizes of the selection kernels and the planner of the selection
 * (selection/plan.c). Plain C. */
#ifndef NSA_CUDA_SELECTION_PLAN_H
#define NSA_CUDA_SELECTION_PLAN_H

#include "../plan.h"

#ifdef __cplusplus
extern "C" {
#endif

NSA_SMEM_FN size_t select_smem(int DKP, int P, int JC, int n, int HC)
{
    const size_t LDK = DKP + 8;
    const size_t el = 64 * LDK + 64 * LDK;
    return el * 2 + (HC == 16 ? 0 : 64 * 65 * 4) + (size_t)P * JC * 4 + (size_t)P * n * 8 + (size_t)P * 4 + 64 * 4 + 64 * 4 + 16 + 64 * 8 +
           (size_t)P * 64 * 4;
}

/* swg_kernel (selection/hopper.cuh): positions per CTA (the wgmma rows) and compressed keys per pass;
 * the key tile's bytes, reused as the pass's probabilities p [BP][NK] f32 */
#define SWG_BP 64
#define SWG_NK 128
#define SWG_QST 3 /* Q tiles in flight (one head each) */
#define SWG_WMAX 8 /* compressed keys per selection block whose overlaps the importance pass keeps in registers */
#define SWG_KBYTES(DKP) (SWG_NK * (DKP) * 2 > SWG_BP * SWG_NK * 4 ? SWG_NK * (DKP) * 2 : SWG_BP * SWG_NK * 4)
/* Shared memory of swg_kernel<DKP, T, NR, MS, WS>: slack, SWG_QST Q tiles, the key tile, rank
 * keys [NR][MS][BP] (NR >= n: 16 or 32; MS merge lanes per position; none with WS, whose merge
 * warpgroup keeps them in registers), the Q stages' and the key tile's mbarriers, importances
 * [BP][JC | 1] (two with WS: one pass merged while the next is written), the G heads' lse [G][BP],
 * counts, per-position block and visible keys. Must match the carving in the kernel. */
NSA_SMEM_FN size_t swg_smem(int DKP, int JC, int NR, int MS, int G, int WS)
{
    return 1024 + SWG_QST * (size_t)SWG_BP * DKP * 2 + (size_t)SWG_KBYTES(DKP) + (WS ? 0 : (size_t)NR * MS * SWG_BP * 8) +
           (SWG_QST + 1) * 8 + (WS ? 2 : 1) * (size_t)SWG_BP * (JC | 1) * 4 + (size_t)G * SWG_BP * 4 + 3 * SWG_BP * 4;
}
/* registers a thread of swg_kernel<..., WS = true>'s two warpgroups (setmaxnreg; the sum is 256,
 * two CTAs of 256 threads an SM): the products', the merge's (16 rank keys, 32 registers) */
#define SWG_WS_PREGS 192
#define SWG_WS_MREGS 64

enum { CU_SEL_UNSUPPORTED = -1, CU_SEL_SELECT = 0, CU_SEL_SWG = 1 };

typedef struct cu_select_plan {
    int kernel; /* CU_SEL_SELECT (mma.sync), CU_SEL_SWG (sm_90a), or CU_SEL_UNSUPPORTED (n too large) */
    int P;      /* select_kernel: positions per CTA */
    int HC;     /* select_kernel: heads per pass */
    int JC;     /* selection blocks per key pass */
    int NR, MS; /* swg_kernel: rank-list length (16 / 32 >= n) and merge lanes per position */
    int WS;     /* swg_kernel: the merge in a warpgroup of its own, beside the products (NR 16, MS 2) */
} cu_select_plan;

/* The selection: swg when the device is a Hopper, the binary carries it, the head dim is
 * exactly 64, 128 or 192, q and k_cmp are aligned, a pass's keys fit SWG_NK, n <= 32 (its
 * register lists) and its shared memory fits; else select_kernel. no_tma: swg's Q / K maps
 * could not be made. */
cu_select_plan cu_plan_select(const nsa_problem *p, const cu_device *d, const cu_overrides *o, const cu_views *v,
                              int no_tma);
/* Selection blocks per pass whose overlapping compressed keys fit in nk (0: not even one). */
int cu_select_blocks_per_pass(const nsa_config *c, int nk, int cap);

#ifdef __cplusplus
}
#endif

#endif
