/* selection/selection.h -- the selection (spec section 3): importance of every candidate block
 * from the compressed attention's probabilities, summed over a position's heads, and the top-n
 * per (position, kv head), forced blocks first. sm_90a: swg_kernel on wgmma (hopper.cuh);
 * otherwise select_kernel on mma.sync (ampere.cuh). */
#ifndef NSA_CUDA_SELECTION_SELECTION_H
#define NSA_CUDA_SELECTION_SELECTION_H

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

static inline size_t select_smem(int DKP, int P, int JC, int n, int HC)
{
    const size_t LDK = DKP + 8;
    const size_t el = 64 * LDK + 64 * LDK;
    return el * 2 + (HC == 16 ? 0 : 64 * 65 * 4) + (size_t)P * JC * 4 + (size_t)P * n * 8 + (size_t)P * 4 + 64 * 4 + 64 * 4 + 16 + 64 * 8 +
           (size_t)P * 64 * 4;
}

/* swg_kernel (hopper.cuh): positions per CTA (the wgmma rows) and compressed keys per pass;
 * the key tile's bytes, reused as the pass's probabilities p [BP][NK] f32 */
#define SWG_BP 64
#define SWG_NK 128
#define SWG_QST 3 /* Q tiles in flight (one head each) */
#define SWG_WMAX 8 /* compressed keys per selection block whose overlaps the importance pass keeps in registers */
#define SWG_KBYTES(DKP) (SWG_NK * (DKP) * 2 > SWG_BP * SWG_NK * 4 ? SWG_NK * (DKP) * 2 : SWG_BP * SWG_NK * 4)
/* Shared memory of swg_kernel<DKP, T, NR, MS>: slack, SWG_QST Q tiles, the key tile, rank
 * keys [NR][MS][BP] (NR >= n: 16 or 32; MS merge lanes per position), the Q stages' and the
 * key tile's mbarriers, importances [BP][JC | 1], the G heads' lse [G][BP], counts,
 * per-position block and visible keys. Must match the carving in the kernel. */
static inline size_t swg_smem(int DKP, int JC, int NR, int MS, int G)
{
    return 1024 + SWG_QST * (size_t)SWG_BP * DKP * 2 + (size_t)SWG_KBYTES(DKP) + (size_t)NR * MS * SWG_BP * 8 + (SWG_QST + 1) * 8 +
           (size_t)SWG_BP * (JC | 1) * 4 + (size_t)G * SWG_BP * 4 + 3 * SWG_BP * 4;
}

void nsa_cu_select_64(grun *g, const sparams *P, int bf16, int64_t tiles);
void nsa_cu_select_128(grun *g, const sparams *P, int bf16, int64_t tiles);
void nsa_cu_select_192(grun *g, const sparams *P, int bf16, int64_t tiles);
/* sm_90a selection on wgmma, head dims exactly 64 / 128 / 192; maps: two host CUtensorMap, Q
 * (box 64 x 1 head x SWG_BP rows) and the compressed K (box 64 x 1 x SWG_NK) */
void nsa_cu_swg_64(grun *g, const sparams *P, int bf16, int64_t tiles, const void *maps);
void nsa_cu_swg_128(grun *g, const sparams *P, int bf16, int64_t tiles, const void *maps);
void nsa_cu_swg_192(grun *g, const sparams *P, int bf16, int64_t tiles, const void *maps);

/* Importance + top-n into idx (and cnt when cnt->p). */
void cu_select(grun *g, const dview *q, nsa_dtype dt, const dview *k, const dview *lse, const dview *idx,
               const dview *cnt);

#endif
