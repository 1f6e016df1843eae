/* range/range.h -- attention whose rows see a contiguous range of keys: the window / dense
 * rule and the compressed rule (spec sections 2 and 5). The forward and dQ run on the sm_90a
 * warp-specialised tile of hopper_fwd_dq.cuh (qwg_kernel) where it can, else on qtile
 * (attn/); dK / dV on the attn/ tiles. launch.cu holds the entry points of the
 * compressed-attention op and the host drivers. */
#ifndef NSA_CUDA_RANGE_RANGE_H
#define NSA_CUDA_RANGE_RANGE_H

#include "plan.h"
#include "../attn/tiles.h"

/* sm_90a forward / dQ tile of the range rules, head dims 64 / 128 / 192 (DV 128); maps: four
 * CUtensorMaps, QWG_MAP_K .. QWG_MAP_O (Q's and O's (dO's in dQ) only read when P->qbox /
 * obox) */
enum { QWG_MAP_K = 0, QWG_MAP_V = 1, QWG_MAP_Q = 2, QWG_MAP_O = 3 };
void nsa_cu_qwg_64(grun *g, const qparams *P, int mode, int bf16, int64_t tiles, const void *maps);
void nsa_cu_qwg_128(grun *g, const qparams *P, int mode, int bf16, int64_t tiles, const void *maps);
void nsa_cu_qwg_192(grun *g, const qparams *P, int mode, int bf16, int64_t tiles, const void *maps); /* DK 192, DV 128 */

/* The rules (prim/mask.cuh) of a window / dense branch and of the compressed branch. */
rule_t cu_rule_window(int64_t wl, int64_t wr, int causal);
rule_t cu_rule_cmp(const nsa_problem *p);

/* Forward of a range branch (window / dense / compressed): o and lse (o absent (NULL or
 * no data): lse only, V unread). */
void cu_fwd_range(grun *g, const rule_t *rule, const dview *q, nsa_dtype dt, const dview *k, const dview *v,
                  const dview *o, const dview *lse);
/* dQ, dK, dV of a range branch (see bwd_io). @return which outputs the tiles wrote themselves
 * (the others are in the fp32 buffers for the caller to store). */
enum { CU_BWD_WROTE_DQ = 1, CU_BWD_WROTE_DKDV = 2 };
int cu_bwd_range(grun *g, const rule_t *rule, const bwd_io *io);
/* The backward of a range branch on its own: dq [B, T, HQ, DK], dk / dv [B, KR, H, D], each
 * written directly by the tiles that own its rows where they can (cu_bwd_range), else summed
 * in fp32 accumulators from the workspace and stored. KR: cmp_rows for the compressed branch,
 * Tk for the window. */
void cu_range_bwd_op(grun *g, const rule_t *r, const nsa_tensor *q_t, const nsa_tensor *k_t, const nsa_tensor *v_t,
                     const nsa_tensor *o_t, const nsa_tensor *lse_t, const nsa_tensor *dout_t, int64_t KR,
                     const nsa_tensor *dq_t, const nsa_tensor *dk_t, const nsa_tensor *dv_t);
/* dk32 / dv32 of every compressed key tile += its further row segments' partials, in order
 * (P: the dK / dV launch's params; tiles over seqmap tm = compressed key tiles). */
void nsa_cu_seg_reduce(grun *g, const kparams *P, seqmap tm, int64_t tiles);

#endif
