/* selected/plan.h -- tile sizes of the sm_90a selected-attention tile (sfw_kernel) and the
 * planner of the selected branch's forward / dQ (selected/plan.c). Plain C. */
#ifndef NSA_CUDA_SELECTED_PLAN_H
#define NSA_CUDA_SELECTED_PLAN_H

#include "../attn/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* sfw_kernel (selected/hopper_fwd_dq.cuh): selected attention with TMA, one warp per position, one or two
 * positions per CTA; chunks of bn keys in ns stages (selected/plan.c). Shared memory:
 * slack, K and V stages, their full / empty mbarriers. */
NSA_SMEM_FN size_t sfw_smem(int DP, int bn, int ns)
{
    return 1024 + 2 * (size_t)ns * bn * DP * 2 + 2 * (size_t)ns * 8;
}

enum { CU_SLC_QTILE = 0, CU_SLC_SFW = 1 };

typedef struct cu_slc_plan {
    int kernel;       /* CU_SLC_QTILE (mma.sync, cp.async) or CU_SLC_SFW (sm_90a, TMA) */
    int nw, nst, bn;  /* warps per CTA, K / V stages, keys per chunk */
    int rp;           /* sfw: positions per warp (16 / G: union tiles, rows = positions x heads), else 1 */
    int ks;           /* sfw: warps taking alternate chunks of the same rows (2: the G = 4 forward) */
    int64_t unit_a, unit_b; /* tiles: ceil(len * unit_a / unit_b) per sequence (prim/seq.cuh UK_ROWS) */
} cu_slc_plan;

/* Forward (MODE_FWD) or dQ (MODE_DQ) of selected attention. sfw when the device is a Hopper,
 * the binary carries it, DK == DV == 64 / 128, G >= 4 (a tile is 16 heads of one position,
 * padded past G: from G = 4 on that beats qtile's tiles over the union of 16 / G positions'
 * blocks; at G = 1 and 2 the union shares each block between positions), o aligned in q's
 * dtype or f32, and its shared memory fits; else qtile: one warp of 16 rows per CTA at
 * G >= 16 (a tile never mixes positions' selections), 64 rows over 16 / G positions' block
 * union otherwise. no_tma: sfw's K / V maps could not be made. */
cu_slc_plan cu_plan_slc(const nsa_problem *p, const cu_device *d, const cu_overrides *o, const cu_views *v, int mode,
                        nsa_dtype dt, int no_tma);

#ifdef __cplusplus
}
#endif

#endif
