/* selected/selected.h -- selected attention (spec section 4): each query attends to the keys
 * of its usable selected blocks, causally. Lists: the usable blocks per (position, kv head)
 * (lists.cu) and, for dK / dV, their inversion per block. Forward and dQ run on the sm_90a
 * TMA tile of hopper_fwd_dq.cuh (sfw_kernel) where it can, else on qtile (attn/); dK / dV on
 * kwp or ktile (attn/). */
#ifndef NSA_CUDA_SELECTED_SELECTED_H
#define NSA_CUDA_SELECTED_SELECTED_H

#include "plan.h"
#include "../attn/tiles.h"

/* sm_90a selected attention (forward / dQ) with TMA, DK == DV == 64 / 128, G >= 4, in the shape
 * the plan chose (chunk, stages, positions per CTA, union rows, split chunks); tk, tv: host
 * CUtensorMap (4-D over the K / V views, box 64 x 1 x bn x 1, 128-byte swizzle) */
void nsa_cu_sfw_64(grun *g, const qparams *P, const cu_slc_plan *pl, int mode, int bf16, int64_t tiles, const void *tk,
                   const void *tv);
void nsa_cu_sfw_128(grun *g, const qparams *P, const cu_slc_plan *pl, int mode, int bf16, int64_t tiles, const void *tk,
                    const void *tv);

rule_t cu_rule_slc(const nsa_problem *p);
/* Forward of selected attention over usable lists U / ucnt of width m. */
void cu_fwd_slc(grun *g, const dview *q, nsa_dtype dt, const dview *k, const dview *v, const int32_t *U,
                const int32_t *ucnt, int64_t m, const dview *o, const dview *lse);
/* dQ, dK, dV of selected attention (see bwd_io) over the usable lists. */
void cu_bwd_slc(grun *g, const bwd_io *io, const int32_t *U, const int32_t *ucnt, int64_t m);
/* Usable-block lists of a selection [B*T*H][m] and counts, taken from the workspace. */
void cu_take_usable(grun *g, const nsa_tensor *idx, const nsa_tensor *counts, int32_t **U, int32_t **ucnt);

/* Usable blocks per (b, t, h) row (spec 4): -1, out of range, not yet started, duplicates
 * removed, ascending -> U [B*T*H][m], ucnt. */
void nsa_cu_usable(grun *g, const dview *idx, const dview *counts, int64_t m, int64_t lp, int32_t *U, int32_t *ucnt);
/* Inverted selection per (sequence, head): offs[nb + 1] and the ascending query lists. */

typedef struct inv_index {
    int32_t *offs, *list;
    const int64_t *offs_pref, *list_pref;
} inv_index;

void nsa_cu_invert(grun *g, const int32_t *U, const int32_t *ucnt, int64_t m, int64_t lp, inv_index *ix);
/* xoff[f] = further segments before flat offs entry f (nflat + 1 entries). */
void nsa_cu_slc_segments(grun *g, const inv_index *ix, int64_t nflat, int64_t segp, int32_t *xoff);
/* dk32/dv32 of every key tile += its further segments' partials, in segment order. */
void nsa_cu_slc_reduce(grun *g, const kparams *P, int64_t tiles);

#endif
