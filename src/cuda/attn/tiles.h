/* attn/tiles.h -- the attention tiles every NSA branch runs on: a query row sees the keys of
 * its rule (prim/mask.cuh: window / dense, compressed, or its selected blocks), so one set of
 * forward / dQ tiles and one set of dK / dV tiles serve the range rules (range/) and the
 * selected rule (selected/). Their parameter blocks, shared-memory sizes and launchers:
 *   ampere_fwd_dq.cuh  qtile_kernel  forward and dQ, mma.sync (sm_80 and sm_90a)
 *   ampere_dkdv.cuh    ktile_kernel  dK / dV, mma.sync
 *   hopper_dkdv.cuh    kwg_kernel, kwp_kernel  dK / dV on wgmma (kwp: TMA producer), sm_90a
 * Kernels take their params struct by value; every launcher is a no-op in the sizing pass or
 * after an earlier error. */
#ifndef NSA_CUDA_ATTN_TILES_H
#define NSA_CUDA_ATTN_TILES_H

#include "plan.h"
#include "../prim/mask.cuh"
#include <cuda.h> /* CUtensorMap */

/* qtile: forward (o, lse) or dQ of one branch. */
typedef struct qparams {
    dview q, k, v, o, lse, dout;
    const float *Dw, *gw;  /* DQ: flat per-row D = g * rowsum(dout * o), gate g (NULL: 1) */
    float *dq;             /* DQ: flat fp32 [B*T*HQ*DK], added to */
    int64_t T, HQ, H, G;
    int DK, DV;
    float sl2, scale;      /* scale * log2(e), scale */
    rule_t rule;
    const int32_t *U, *ucnt; /* SLC: usable blocks [B*T*H][m] ascending, counts */
    int m;
    seqmap sm;
    /* qwg: Q (and dO in dQ) arrives as one TMA box of 128 / G positions x G heads (G divides
     * 128); forward O leaves each warpgroup as one of 64 / G positions (G divides 64; O in q's
     * dtype) */
    int qbox, obox;
    int64_t tiles, tasks;  /* qwg: tiles per kv head, tiles x H (set by its launcher) */
    dview dqo;             /* qwg dQ: .p set = write dq here (q's dtype or f32) instead of adding into dq */
    int *ctr;              /* qwg forward: zeroed task counter of a persistent walk (NULL: none) */
    int dyn;               /* (set by the launcher: the walk is persistent) */
    int pipe;              /* qwg forward: the tile pipelined inside each warpgroup (cu_plan_range_pipe) */
    const int *nf;         /* the call's non-finite flag (run.h; NULL: never set) */
} qparams;

/* ktile: dK, dV of one branch into flat fp32 [B, KR, H, D] buffers (added to). */
typedef struct kparams {
    dview q, k, v, dout, lse;
    const float *Dw, *gw;
    float *dk, *dv;
    int64_t T, HQ, H, G, KR;
    int DK, DV;
    float sl2, scale;
    rule_t rule;
    /* SLC: inverted selection, per (sequence, head) region: offs[nb + 1], list[len * m] */
    const int32_t *offs, *list;
    const int64_t *offs_pref, *list_pref; /* varlen region prefixes (NULL: dense) */
    int m, nsub;                          /* list width, 64-key tiles per block */
    /* Long lists are cut into segments of segp queries (0: never): the first segment adds
     * into dk/dv, each further one (enumerated by xoff over the flat offs array of nflat
     * entries) writes an fp32 partial that nsa_cu_slc_reduce adds in order afterwards. */
    int segp, extra;                      /* extra: this launch runs the further segments */
    const int32_t *xoff;
    int64_t nflat;
    float *part;
    /* Compressed keys are few (Nc / 64 tiles) and each is seen by most queries, and causal
     * attention with few kv heads has few tasks of unequal length: nseg > 1 splits each
     * sequence's rows into nseg absolute segments, one task per (tile, segment); segment 0
     * adds into dk/dv, the others write the partial of slot (task, head), added in order by
     * nsa_cu_seg_reduce. */
    int nseg;
    int bk;                               /* keys per task: 64 (ktile), KWG_BK (kwg_kernel) */
    /* kwg / kwp and the scalar kernels, a range rule whose tasks each own all rows of their keys
     * (one row segment): .p set = dK / dV written here once (k's dtype or f32), instead of added
     * into dk / dv; keys no query sees get zeros */
    dview dko, dvo;
    seqmap sm;
    const int *nf; /* the call's non-finite flag (run.h; NULL: never set) */
} kparams;

/* Launchers, one per head-dim class (64 = DK, DV <= 64; 128 = DK, DV <= 128; 192 = DK <= 192,
 * DV <= 128), defined in the generated src/cuda/inst files. */
/* qtile with BN keys per chunk (its warps and stages follow: QTILE_NW, QTILE_NST) */
void nsa_cu_qtile_64(grun *g, const qparams *P, int mode, int bf16, int bn, int64_t tiles);
void nsa_cu_qtile_128(grun *g, const qparams *P, int mode, int bf16, int bn, int64_t tiles);
void nsa_cu_qtile_192(grun *g, const qparams *P, int mode, int bf16, int bn, int64_t tiles);
void nsa_cu_ktile_64(grun *g, const kparams *P, int bf16, int64_t tiles);
void nsa_cu_ktile_128(grun *g, const kparams *P, int bf16, int64_t tiles);
void nsa_cu_ktile_192(grun *g, const kparams *P, int bf16, int64_t tiles);
/* sm_90a dK / dV of the range rules, kparams as ktile, DK == DV == 64 / 128 */
void nsa_cu_kwg_64(grun *g, const kparams *P, int bf16, int64_t tiles);
void nsa_cu_kwg_128(grun *g, const kparams *P, int bf16, int64_t tiles);
/* ... the same with a producer warpgroup and TMA (range rules: bit for bit kwg's sums), and,
 * slc = 1, the selected rule's dK / dV over the inverted lists (ktile's tasks and partials);
 * maps: four host CUtensorMap (q, dout: box 64 x G x (slc ? 1 : 64 / G) x 1; k, v: box 64 x 1
 * x (slc ? 64 : 128) x 1) */
void nsa_cu_kwp_64(grun *g, const kparams *P, int bf16, int slc, int64_t tiles, const void *maps);
void nsa_cu_kwp_128(grun *g, const kparams *P, int bf16, int slc, int64_t tiles, const void *maps);

/* The scalar kernels (simt.cu): the same parameter blocks over B batch entries, fp32 products
 * over the visible pairs only, any storage dtype. only_if: NULL runs them; else they stand
 * aside unless *only_if (a device int) is set. */
void nsa_cu_simt_q(grun *g, const qparams *P, int mode, int64_t B, const int *only_if);
void nsa_cu_simt_k(grun *g, const kparams *P, int64_t B, const int *only_if);
/* The same launched beside a tile launch of P for calls whose inputs may hold a non-finite
 * value (P->nf set): they run only when the flag is set, when the tiles stand aside
 * (prim/nonfinite.cuh). No-ops when P->nf is NULL. */
void cu_simt_standby_q(grun *g, const qparams *P, int mode);
void cu_simt_standby_k(grun *g, const kparams *P);
/* The selected rule's lists as the scalar backward takes them: per row the usable blocks
 * (selected/lists.cu), per block the queries that selected it. */
typedef struct cu_slc_lists {
    const int32_t *U, *ucnt;
    int m;
    const int32_t *offs, *list;
    const int64_t *offs_pref, *list_pref;
} cu_slc_lists;

/* ---- host side shared by the range and selected branches (attn/host.cu) ---------------- */

/* The NSA ops take f16 / bf16 storage (the tiles) or f32 (the scalar kernels), supported dims,
 * int32 positions. Marks NOT_SUPPORTED on g and returns 0 otherwise. */
int cu_attn_supported(grun *g, nsa_dtype dt);

/* Backward of one branch: dq added to dq32 [B*T*HQ*DK], dK/dV added to flat fp32 [B, KR, H, D]
 * buffers. Dw, gw: per-row scratch [B*T*HQ]: filled by the branch (nsa_cu_dprep) unless
 * D_ready says the caller already did (the pipeline's gate backward computes them). */
typedef struct bwd_io {
    const dview *q, *k, *v, *o, *lse, *dout, *gate; /* gate may be NULL */
    nsa_dtype dt;
    float *Dw, *gw, *dq32, *dk32, *dv32;
    int64_t KR;
    int D_ready;
    /* non-NULL: this rule is dq's only term; dq32 comes unzeroed, and cu_bwd_range either
     * writes dq_out itself (the wgmma dQ tile: returns 1) or zeroes dq32 and adds into it as
     * usual (returns 0; the caller stores it). NULL: dq32 is zeroed and shared (returns 0). */
    const dview *dq_out;
    /* the same for dk / dv (both or neither): dk32 / dv32 come unzeroed, and cu_bwd_range
     * either has the dK / dV tiles write dk_out / dv_out (sets CU_BWD_WROTE_DKDV) or zeroes
     * the buffers and adds into them */
    const dview *dk_out, *dv_out;
} bwd_io;

/* The backward's inputs read by its tiles (q, k, v, lse) scanned into the call's non-finite
 * flag (run.h; dout, o and the gate set it from the row-term kernels). */
void cu_bwd_scan(grun *g, const bwd_io *io);

/* The backward of rule r on the scalar kernels (float32 storage): dq added into io->dq32
 * (zeroed first when io->dq_out says it is dq's only term), dk / dv into io->dk32 / dv32; the
 * selected rule takes its lists (NULL for the range rules). Dw / gw filled by the caller. */
void cu_bwd_simt(grun *g, const rule_t *r, const bwd_io *io, const cu_slc_lists *lists);

/* The parameter blocks of a branch's forward / dQ and dK / dV from the problem. */
void cu_qparams_base(qparams *P, const nsa_problem *p, const dview *q);
void cu_dq_params(qparams *P, const nsa_problem *p, const bwd_io *io);
void cu_dkdv_params(kparams *P, const nsa_problem *p, const bwd_io *io);

/* Launch the mma.sync tiles of the problem's head-dim class (NOT_SUPPORTED when their
 * shared memory does not fit the device). */
void cu_run_qtile(grun *g, const qparams *P, int mode, int bn, int64_t tiles, nsa_dtype dt);
void cu_run_ktile(grun *g, const kparams *P, int64_t tiles, nsa_dtype dt);
/* The alignment of a parameter block's views, as the planners take it (NULL: absent). */
cu_views cu_views_of(const dview *q, const dview *k, const dview *v, const dview *o, const dview *dout);
/* kwp's four tensor maps (q, dout, k, v) for K. @return 0 when one cannot be made. */
int cu_kwp_maps(const grun *g, const kparams *K, nsa_dtype dt, int slc, CUtensorMap maps[4]);

/* Per row of a branch's backward: Dw = g * rowsum(dout * o), gw = g (when gate given). */
void nsa_cu_dprep(grun *g, const dview *dout, const dview *o, const dview *gate, float *Dw, float *gw, int64_t B,
                  int64_t T, int64_t HQ, int64_t DV);
/* Flat fp32 [B, R, H, D] -> a view of the same shape. */
void nsa_cu_store32(grun *g, const float *src, const dview *dst, int64_t B, int64_t R, int64_t H, int64_t D);

#endif
