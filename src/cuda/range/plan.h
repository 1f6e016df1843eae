/* range/plan.h -- tile sizes of the sm_90a range tile (qwg_kernel) and the planner of a range
 * branch's forward / dQ (range/plan.c). Plain C. */
#ifndef NSA_CUDA_RANGE_PLAN_H
#define NSA_CUDA_RANGE_PLAN_H

#include "../attn/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

#define QWG_BM 128 /* rows per CTA: two warpgroups */
/* keys per chunk: 128 in the forward; 64 for dQ, which holds S, dP and dQ in registers */
#define QWG_BN(mode) ((mode) == MODE_FWD ? 128 : 64)

/* K / V stages: 2 of 128 keys in the forward (three do not fit at DK 192), 3 of 64 for dQ */
#define QWG_NS(mode) ((mode) == MODE_FWD ? 2 : 3)
/* Q buffers of qwg: two in the forward at head dims <= 128 (the next task's Q lands during
 * this one; at DK 192 they do not fit beside the stages), else one */
#define QWG_NQ(mode, dkp) ((mode) == MODE_FWD && (dkp) <= 128 ? 2 : 1)
/* The range forward runs a task's chunks pipelined (each warpgroup's softmax under its own
 * P V too) where its last chunk holds more than 64 keys or it has at least this many chunks:
 * the pipelined products are always full-width, which a window tile's short last chunk would
 * pay for in a large share of its few chunks */
#define QWG_PIPE_MIN_CHUNKS 8
/* bytes of one qwg_task (range/hopper_fwd_dq.cuh; checked there) */
#define QWG_TASK_BYTES 96
/* Shared memory of qwg_kernel<DKP, DVP, MODE>: 1 KB alignment slack, Q (and dO), the K and V
 * stages, row offsets, the stages' full / empty mbarriers (K and V apart in the forward) and the Q
 * buffers'. Must match the carving in the kernel. */
NSA_SMEM_FN size_t qwg_smem(int DKP, int DVP, int mode)
{
    const size_t bn = QWG_BN(mode), ns = QWG_NS(mode);
    const size_t nq = QWG_NQ(mode, DKP);
    return 1024 + nq * QWG_BM * DKP * 2 + (mode == MODE_DQ ? (size_t)QWG_BM * DVP * 2 : 0) + ns * bn * (DKP + DVP) * 2 +
           2 * QWG_BM * sizeof(int64_t) + (4 * ns + 2 * nq) * sizeof(uint64_t) + nq * QWG_TASK_BYTES;
}

enum { CU_FWD_QTILE = 0, CU_FWD_QWG = 1 };

typedef struct cu_range_plan {
    int kernel;     /* CU_FWD_QTILE (mma.sync) or CU_FWD_QWG (sm_90a, TMA + wgmma) */
    int rows;       /* query rows (position x head) per tile */
    int nw, nst, bn; /* qtile: warps, K / V stages, keys per chunk */
    int qbox;       /* qwg: Q (and dO in dQ) as one TMA box of QWG_BM / G positions x G heads, if its map can be made */
    int obox;       /* qwg forward: O as TMA boxes of 64 / G positions x G heads, if its map can be made */
} cu_range_plan;

/* Forward (mode MODE_FWD) or dQ (MODE_DQ) of a range rule: qwg when the device is a Hopper,
 * the binary carries that kernel, the head dims are exactly 64, 128 or 192 / 128 (DV only
 * when V is read), the views are aligned (o in q's dtype or f32) and its shared memory fits;
 * else qtile's 64-row tiles. Same function either way. no_tma: qwg's K / V maps could not be
 * made. */
cu_range_plan cu_plan_range(const nsa_problem *p, const cu_device *d, const cu_overrides *o, const cu_views *v,
                            int mode, nsa_dtype dt, int no_tma);
/* Whether the forward of a range rule on qwg runs its pipelined tile (qwg_pipe_task: each
 * warpgroup's softmax under its own P V as well as the other's products): with V, for the
 * window / dense rule (window_rule) whose tasks mostly hold QWG_PIPE_MIN_CHUNKS chunks or more
 * (a window of wl keys to the left, wl < 0 none; Tk keys). Elsewhere the tasks are too short
 * for the pipeline's first and last products, which nothing overlaps (bench/NOTES.md). */
int cu_plan_range_pipe(const nsa_problem *p, const cu_overrides *o, int window_rule, int64_t wl, int has_v);
/* The head-dim class of qwg for these dims (64, 128, 192) or 0 (has_v: V is read). */
int cu_qwg_class(int64_t DK, int64_t DV, int has_v);

#ifdef __cplusplus
}
#endif

#endif
