/* range/range.h -- attention whose rows see a contiguous range of keys: the window / dense
 * rule and the compressed rule (spec sections 2 and 5). The forward and dQ run on the sm_90a
 * warp-specialised tile of hopper_fwd_dq.cuh (qwg_kernel) where it can, else on qtile
 * (attn/); dK / dV on the attn/ tiles. launch.cu holds the host drivers, ops.cu the entry
 * points of the compressed-attention op. */
#ifndef NSA_CUDA_RANGE_RANGE_H
#define NSA_CUDA_RANGE_RANGE_H

#include "../attn/tiles.h"

#define QWG_BM 128 /* rows per CTA: two warpgroups */
/* keys per chunk: 128 in the forward; 64 for dQ, which holds S, dP and dQ in registers */
#define QWG_BN(mode) ((mode) == MODE_FWD ? 128 : 64)

/* K / V stages: 2 of 128 keys in the forward (three do not fit at DK 192), 3 of 64 for dQ */
#define QWG_NS(mode) ((mode) == MODE_FWD ? 2 : 3)
/* Q buffers of qwg: two in the forward at head dims <= 128 (the next task's Q lands during
 * this one; at DK 192 they do not fit beside the stages), else one */
#define QWG_NQ(mode, dkp) ((mode) == MODE_FWD && (dkp) <= 128 ? 2 : 1)
/* bytes of one qwg_task (hopper.cuh; checked there) */
#define QWG_TASK_BYTES 96

/* Shared memory of qwg_kernel<DKP, DVP, MODE>: 1 KB alignment slack, Q (and dO), the K and V
 * stages, row offsets, the stages' and Q buffers' full / empty mbarriers. Must match the carving in the
 * kernel. */
static inline size_t qwg_smem(int DKP, int DVP, int mode)
{
    const size_t bn = QWG_BN(mode), ns = QWG_NS(mode);
    const size_t nq = QWG_NQ(mode, DKP);
    return 1024 + nq * QWG_BM * DKP * 2 + (mode == MODE_DQ ? (size_t)QWG_BM * DVP * 2 : 0) + ns * bn * (DKP + DVP) * 2 +
           2 * QWG_BM * sizeof(int64_t) + (2 * ns + 2 * nq) * sizeof(uint64_t) + nq * QWG_TASK_BYTES;
}

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
/* dQ, dK, dV of a range branch (see bwd_io). @return 1 when the dQ tile wrote io->dq_out itself. */
int cu_bwd_range(grun *g, const rule_t *rule, const bwd_io *io);
/* The backward of a range branch on its own: fp32 accumulators from the workspace, then dq
 * [B, T, HQ, DK], dk / dv [B, KR, H, D] stored. KR: cmp_rows for the compressed branch, Tk for
 * the window. */
void cu_range_bwd_op(grun *g, const rule_t *r, const nsa_tensor *q_t, const nsa_tensor *k_t, const nsa_tensor *v_t,
                     const nsa_tensor *o_t, const nsa_tensor *lse_t, const nsa_tensor *dout_t, int64_t KR,
                     const nsa_tensor *dq_t, const nsa_tensor *dk_t, const nsa_tensor *dv_t);
/* dk32 / dv32 of every compressed key tile += its further row segments' partials, in order
 * (P: the dK / dV launch's params; tiles over seqmap tm = compressed key tiles). */
void nsa_cu_seg_reduce(grun *g, const kparams *P, seqmap tm, int64_t tiles);

#endif
