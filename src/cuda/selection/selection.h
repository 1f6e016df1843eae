/* selection/selection.h -- the selection (spec section 3): importance of every candidate block
 * from the compressed attention's probabilities, summed over a position's heads, and the top-n
 * per (position, kv head), forced blocks first. sm_90a: swg_kernel on wgmma (hopper.cuh);
 * otherwise select_kernel on mma.sync (ampere.cuh). */
#ifndef NSA_CUDA_SELECTION_SELECTION_H
#define NSA_CUDA_SELECTION_SELECTION_H

#include "plan.h"
#include "../prim/common.cuh"
#include <cuda.h>

/* select: importance of every candidate block, top-n per (position, kv head). */
typedef struct sparams {
    dview q, k, lse, idx, cnt;
    int64_t T, HQ, H, G;
    int DK;
    float sl2;
    int cl, cd, lp, n, n_init, n_local;
    int P, HC, JC; /* positions per CTA, heads per pass, selection blocks per key pass */
    seqmap sm;
} sparams;

void nsa_cu_select_64(grun *g, const sparams *P, int bf16, int64_t tiles);
void nsa_cu_select_128(grun *g, const sparams *P, int bf16, int64_t tiles);
void nsa_cu_select_192(grun *g, const sparams *P, int bf16, int64_t tiles);
/* sm_90a selection on wgmma, head dims exactly 64 / 128 / 192; nr, ms, ws: the plan's rank-list
 * length, merge lanes and whether the merge has a warpgroup of its own; maps: two host CUtensorMap, Q (box 64 x 1 head x SWG_BP rows) and
 * the compressed K (box 64 x 1 x SWG_NK) */
void nsa_cu_swg_64(grun *g, const sparams *P, int bf16, int nr, int ms, int ws, int64_t tiles, const void *maps);
void nsa_cu_swg_128(grun *g, const sparams *P, int bf16, int nr, int ms, int ws, int64_t tiles, const void *maps);
void nsa_cu_swg_192(grun *g, const sparams *P, int bf16, int nr, int ms, int ws, int64_t tiles, const void *maps);

/* The float32 selection on a scalar kernel (simt.cu), B batch entries; NOT_SUPPORTED when its
 * list of n kept blocks per warp does not fit the device's shared memory. */
void nsa_cu_select_simt(grun *g, const sparams *P, int64_t B);

/* Importance + top-n into idx (and cnt when cnt->p). */
void cu_select(grun *g, const dview *q, nsa_dtype dt, const dview *k, const dview *lse, const dview *idx,
               const dview *cnt);

#endif
