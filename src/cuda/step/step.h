/* step/step.h -- what the inference step's kernels share (step.cu: the scalar kernels and the
 * host code; tiled.cu: the tensor-core kernels of the common shapes): the parameter block, the
 * cache views, a sequence's lengths and its checks, read on the device. */
#ifndef NSA_CUDA_STEP_STEP_H
#define NSA_CUDA_STEP_STEP_H

#include "../prim/run.h"
#include "../prim/simt.cuh"
#include "../cuda_backend.h"

/* A cache as the kernels read it: k, v views and the block table (bt NULL: contiguous). */
typedef struct step_cache_t {
    dview k, v;
    const int32_t *bt;
    int64_t bt0, bt1, page, pool, cap;
} step_cache_t;

typedef struct step_params {
    dview q, kn, vn, o, gc, gs, gw, idx, bi, bc; /* idx: the selection made (selected); bi, bc: the caller's */
    step_cache_t kv, ckv;
    const int32_t *qlens, *seqlens;
    int64_t qlens_s, seqlens_s;
    int32_t *errors;
    int64_t errors_s;
    int32_t *ok; /* [B] workspace: 1 = the sequence passed the checks */
    float *psum; /* [STEP_MAX_WARPS][ckv.cap] workspace */
    int64_t B, Tq, HQ, H, G;
    int DK, DV;
    int64_t l, d, lp, n, m, n_init, n_local, w; /* m: the caller's index width (else n) */
    float scale, swa_scale;
    int append, pool, use_cmp, use_slc, use_swa, selects; /* selects: slc on without caller indices */
    /* the dense step's (nsa_attention_step) */
    dview lse;
    const float *sinks;
    int64_t sinks_s, wl, wr;
    float softcap;
    int causal;
} step_params;

__device__ __forceinline__ int64_t step_row(const step_cache_t &c, const dview &x, int64_t b, int64_t r, int64_t h)
{
    if (!c.bt) return b * x.s0 + r * x.s1 + h * x.s2;
    const int64_t pg = c.bt[b * c.bt0 + (r / c.page) * c.bt1];
    return pg * x.s0 + (r % c.page) * x.s1 + h * x.s2;
}

struct step_seq_t {
    int64_t n, L0, L;
};
__device__ __forceinline__ step_seq_t step_seq(const step_params &P, int64_t b)
{
    step_seq_t s;
    s.n = P.qlens ? P.qlens[b * P.qlens_s] : P.Tq;
    s.L0 = P.seqlens[b * P.seqlens_s];
    s.L = P.append ? s.L0 + s.n : s.L0;
    return s;
}

/* The first problem of sequence b of lengths s (nsa_step_error), or 0, found by the whole CTA
 * (the same answer in every thread): its queries, its lengths, its token pages, then its
 * compressed rows. Each thread checks its share of both block tables with every load in flight
 * before any is tested, so the check costs one or two memory round trips however long the
 * sequence (a warp walking its pages 32 at a time took one per 256 pages). */
__device__ __forceinline__ int step_problem_cta(const step_params &P, int64_t b, const step_seq_t &s)
{
    if (s.n < 0 || s.n > P.Tq) return NSA_STEP_BAD_QLEN;
    if (s.L0 < 0) return NSA_STEP_BAD_SEQLEN;
    if (!P.append && s.n > s.L0) return NSA_STEP_NO_TOKENS;
    if (s.L > P.kv.cap) return NSA_STEP_OVER_CAPACITY;
    const bool cmp = P.use_cmp || P.selects;
    const int64_t nc = cmp ? nsa_rule_num_cmp(s.L, P.l, P.d) : 0;
    const bool cmp_fits = nc <= P.ckv.cap; /* else its pages past the table's row are not read */
    const int64_t np = P.kv.bt ? (s.L + P.kv.page - 1) / P.kv.page : 0;
    const int64_t ncp = cmp && cmp_fits && P.ckv.bt ? (nc + P.ckv.page - 1) / P.ckv.page : 0;
    bool bad = false, bad_c = false;
#pragma unroll 8
    for (int64_t j = threadIdx.x; j < np; j += blockDim.x) {
        const int32_t pg = P.kv.bt[b * P.kv.bt0 + j * P.kv.bt1];
        bad |= pg < 0 || pg >= P.kv.pool;
    }
#pragma unroll 4
    for (int64_t j = threadIdx.x; j < ncp; j += blockDim.x) {
        const int32_t pg = P.ckv.bt[b * P.ckv.bt0 + j * P.ckv.bt1];
        bad_c |= pg < 0 || pg >= P.ckv.pool;
    }
    bad = __syncthreads_or(bad) != 0, bad_c = __syncthreads_or(bad_c) != 0;
    if (bad) return NSA_STEP_BAD_PAGE;
    if (!cmp) return NSA_STEP_OK;
    if (!cmp_fits) return NSA_STEP_OVER_CMP_CAPACITY;
    return bad_c ? NSA_STEP_BAD_CMP_PAGE : NSA_STEP_OK;
}

/* The caller's block indices of (b, i, h) that the query can use -- in [0, cur], once each,
 * ascending -- into out[0 ..], -1 after up to `width` (as the CPU step cleans them). One thread. */
__device__ __forceinline__ void step_caller_blocks(const step_params &P, int64_t b, int64_t i, int64_t h, int64_t cur, int32_t *out,
                                                   int64_t width)
{
    const int64_t cnt = P.bc.p ? ((const int32_t *)P.bc.p)[b * P.bc.s0 + i * P.bc.s1 + h * P.bc.s2] : P.m;
    const int32_t *ix = (const int32_t *)P.bi.p + b * P.bi.s0 + i * P.bi.s1 + h * P.bi.s2;
    int kept = 0;
    for (int64_t e = 0; e < (cnt < 0 ? 0 : cnt > P.m ? P.m : cnt); e++) {
        const int32_t j = ix[e];
        if (j < 0 || j > cur) continue;
        int at = kept; /* insertion into the sorted prefix, duplicates dropped */
        while (at > 0 && out[at - 1] > j) at--;
        if (at > 0 && out[at - 1] == j) continue;
        for (int q = kept; q > at; q--) out[q] = out[q - 1];
        out[at] = j;
        kept++;
    }
    for (int64_t a = kept; a < width; a++) out[a] = -1;
}

/* The tiled step (tiled.cu): tensor-core kernels for bf16 / f16 caches with DK = DV in {64,
 * 128} and at most 16 query heads per kv head. Each (sequence, new query, kv head) is an item
 * whose G query rows share every key; its keys are split over CTAs (flash-decoding), each CTA
 * writing a partial (row max, row sum, unnormalised output) that one combine kernel merges in a
 * fixed order. The NSA step: the compressed branch with the selection's importance per block
 * (ts_split over the compressed cache), the top-n (ts_select), the selected and window branches
 * (ts_split over the chosen blocks and the window), the gates (ts_combine). The dense step: one
 * ts_split over the visible range, then ts_combine. step_tiled_fits / attention_step_tiled_fits
 * say whether a call has those shapes (the same answer in the sizing and the live pass);
 * *_take carves the workspace (both passes), *_launch runs after the check and the append --
 * or, where *_checks says so (a step that writes nothing before it reads: no append, no
 * pooling, one launch round), first, its first kernel checking each sequence itself. */
typedef struct ts_plan {
    int D, hc;                 /* head dim; kv heads per CTA */
    int64_t items, batch;      /* items = B * Tq * H, launched `batch` at a time */
    int64_t tiles1, tpc1, nt1; /* compressed branch (or the dense range): stages, stages per task, tasks */
    int64_t tpc_slc, tpc_swa, nt_slc, nt_swa, tpb; /* selected and window: stages per task, tasks; stages per block */
    int64_t width;             /* the selection list's length */
    int JT;                    /* blocks one compressed tile touches */
    float *part1, *part3, *bins;
    int32_t *sel;
} ts_plan;

int step_tiled_fits(const grun *g, const step_params *P);
void step_tiled_take(grun *g, const step_params *P, ts_plan *pl);
int step_tiled_checks(const step_params *P, const ts_plan *pl);
void step_tiled_launch(grun *g, const step_params *P, const ts_plan *pl, int checks);
int attention_step_tiled_fits(const grun *g, const step_params *P);
void attention_step_tiled_take(grun *g, const step_params *P, ts_plan *pl);
int attention_step_tiled_checks(const step_params *P, const ts_plan *pl);
void attention_step_tiled_launch(grun *g, const step_params *P, const ts_plan *pl, int checks);

#endif
