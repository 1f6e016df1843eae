/* internal.h -- what the front end (api.c, validate.c) and the backends share.
 * Not installed; never included by users. */
#ifndef NSA_INTERNAL_H
#define NSA_INTERNAL_H

#include "nsa.h"
#include "size.h" /* saturating size arithmetic, for every size the library computes */

/* Sizes of one validated call, derived once by validate.c so that no backend re-derives
 * them. Fields an op does not use stay 0. */
typedef struct nsa_problem {
    int64_t B, T, HQ, H, G, DK, DV;
    int64_t num_seqs;          /* B (dense batch) or varlen.num_seqs */
    const int32_t *cu_seqlens; /* host, varlen only; else NULL */
    int64_t cmp_rows;          /* dim 1 of k_cmp/x_cmp: Nc(T) dense, sum of Nc(len_s) varlen */
    int64_t m;                 /* last dim of block_indices (selection width) */
    float scale;               /* resolved: config.scale, or 1/sqrt(DK) when that is 0 */
    float swa_scale;           /* resolved: config.swa_scale, or scale when that is 0 (no config: scale) */
    nsa_config cfg;
    /* the attention op's; other ops leave Tk == T and the rest 0 */
    int64_t Tk;                /* key rows (dim 1 of k, v); T is then the query rows Tq */
    const int64_t *cu_seqlens_q, *cu_seqlens_k; /* host, varlen_qk only; else NULL */
    int extended;              /* the attention call uses an option beyond causal / windows / scale
                                  (CUDA: the general kernels of src/cuda/attention instead of the tuned tiles) */
    int flex_rows;             /* an attention call of block-sparse attention's dense route: a row whose
                                  visible scores are all -inf is empty (o = 0, lse = -inf), as the
                                  block-sparse engine has it, not NaN as in dense attention. CUDA's kernels
                                  honour it (and their backward sends q, k that could overflow a score to
                                  the scalar kernels); the CPU route is taken only where no such row arises */
    /* the step op's: rows per sequence its token cache and its compressed cache can hold */
    int64_t cache_cap, cmp_cap;
} nsa_problem;

/* The detail of the last failure on this thread (nsa_last_error_detail): every public call that
 * returns a status empties it on entry, and each failing path writes one line naming the
 * argument at fault. nsa_fail formats it (snprintf into a fixed per-thread buffer, truncated,
 * never allocating) and returns `status`, so a failing path reads `return nsa_fail(...)`. */
enum { NSA_DETAIL_BYTES = 256 };
#ifdef __cplusplus
extern "C" { /* the CUDA launchers (C++) report through the same functions */
#endif
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
nsa_status nsa_fail(nsa_status status, const char *fmt, ...);
/* Empties the detail: the start of every public call, and its successful end. */
void nsa_detail_clear(void);
/* "[2, 64, 4, 64]": a view's shape for a detail (buf of at least 64 bytes). */
const char *nsa_shape_text(const nsa_tensor *t, char *buf, size_t size);
#ifdef __cplusplus
}
#endif

/* An optional tensor is present when it has data (nsa.h: absent = data NULL). */
static inline int nsa_present(const nsa_tensor *t) { return t->data != NULL; }

/* Validators: return SUCCESS and fill *p, or the specific error status. They read no
 * tensor data except cu_seqlens (host) and never write to any tensor. */
/* nsa_config_validate with the detail's name for the config: "config", or "fwd.config"
 * inside a backward's args. */
nsa_status nsa_config_check(const nsa_config *c, const char *name);
nsa_status nsa_validate_compress(const nsa_compress_args *a, nsa_problem *p);
nsa_status nsa_validate_compress_bwd(const nsa_compress_bwd_args *a, nsa_problem *p);
nsa_status nsa_validate_cmp_attn(const nsa_cmp_attn_args *a, nsa_problem *p);
nsa_status nsa_validate_cmp_attn_bwd(const nsa_cmp_attn_bwd_args *a, nsa_problem *p);
nsa_status nsa_validate_select(const nsa_select_args *a, nsa_problem *p);
nsa_status nsa_validate_slc_attn(const nsa_slc_attn_args *a, nsa_problem *p);
nsa_status nsa_validate_slc_attn_bwd(const nsa_slc_attn_bwd_args *a, nsa_problem *p);
nsa_status nsa_validate_attention(const nsa_attention_args *a, nsa_problem *p);
nsa_status nsa_validate_attention_bwd(const nsa_attention_bwd_args *a, nsa_problem *p);
nsa_status nsa_validate_gate(const nsa_gate_args *a, nsa_problem *p);
nsa_status nsa_validate_gate_bwd(const nsa_gate_bwd_args *a, nsa_problem *p);
nsa_status nsa_validate_forward(const nsa_forward_args *a, nsa_problem *p);
nsa_status nsa_validate_backward(const nsa_backward_args *a, nsa_problem *p);
nsa_status nsa_validate_step(const nsa_step_args *a, nsa_problem *p);
nsa_status nsa_validate_attention_step(const nsa_attention_step_args *a, nsa_problem *p);
nsa_status nsa_validate_flex(const nsa_flex_args *a, nsa_problem *p);
nsa_status nsa_validate_flex_bwd(const nsa_flex_bwd_args *a, nsa_problem *p);
/* The block lists of a validated flex call, in host memory: counts, indices, each block once
 * (cpu/flex.c; the CUDA backend checks its lists, copied back, with it). */
nsa_status nsa_flex_lists_check(const nsa_flex_args *a, const nsa_problem *p);
/* The part of nsa_step's args that the dense step shares (token cache, lengths, append, o,
 * errors): the backends check and append through nsa_step's code with it. */
nsa_step_args nsa_step_common(const nsa_attention_step_args *a);

/* Explicit overrides of the CUDA planners (src/cuda/plan.h), parsed once when a CUDA context
 * is created. The defaults are the tuned choices; the others compare kernels on the same
 * inputs. */
typedef struct nsa_cuda_overrides {
    int wgmma;      /* 0: never the sm_90a tiles (NSA_CUDA_WGMMA=0): the mma.sync tiles everywhere */
    int kwp;        /* 0: dK / dV never on the TMA-producer tile (NSA_CUDA_KWP=0) */
    int check_ws;   /* 1: each call's live pass refuses to take workspace past the bytes its sizing pass
                       counted (NSA_CUDA_CHECK_WORKSPACE=1, the GPU checks' setting): a take that
                       depends on the device would otherwise run past a buffer sized exactly */
    int slc_bn;     /* selected sm_90a tile: keys per chunk, 32 or 64 (NSA_CUDA_SLC_BN=64) */
    int slc_stages; /* ... stages, 2 or 3 (NSA_CUDA_SLC_BN=32x3) */
    int slc_pair;   /* ... two neighbouring positions per CTA (0: NSA_CUDA_SLC_NP=1) */
    int slc_union;  /* ... union tiles at G = 4 / 8 (0: NSA_CUDA_SLC_RP=1) */
    int nonfinite;  /* the scalar kernels instead of the tiles: -1 when the call's inputs hold a
                       non-finite value (the default), 1 always (NSA_CUDA_NONFINITE=1: their cost
                       and their finite results), 0 never (NSA_CUDA_NONFINITE=0: the scans
                       skipped, masked pairs may then carry a non-finite value to rows the mask
                       hides) */
    int step_tiled; /* 0: the inference steps on their scalar kernels only (NSA_CUDA_STEP_TILED=0) */
    int step_hc;    /* tiled steps: kv heads per CTA, 1, 2 or 4 (NSA_CUDA_STEP_HC); 0: the planner's choice */
    int flex_tc;    /* 0: block-sparse attention (forward and backward) on its scalar kernels only (NSA_CUDA_FLEX_TC=0) */
    int step_pdl;   /* 0: the tiled steps' kernels launched one after the other, not as programmatic dependents (NSA_CUDA_STEP_PDL=0) */
    int swg_ws;     /* 0: the sm_90a selection merges each pass in the products' warpgroup, not a warpgroup of its own (NSA_CUDA_SWG_WS=0) */
    int cmp_seg;    /* the compressed dK / dV's row segments, a power of two 2..256 (NSA_CUDA_CMP_SEG); 0: the planner's choice */
    int range_seg;  /* the window / dense dK / dV's row segments, a power of two 1..128 (NSA_CUDA_RANGE_SEG; 1: none); 0: the planner's choice */
    int range_pipe; /* the range forward's tile pipelined inside each warpgroup: 1 where the planner expects it to pay, 0 never
                       (NSA_CUDA_RANGE_PIPE=0), 2 for every forward that reads V (NSA_CUDA_RANGE_PIPE=2: the checks' variant) */
    int cp_overlap; /* 0: context parallelism's collectives on the context's stream, after and before the chunk calls,
                       instead of on the context's communication stream beside them (NSA_CUDA_CP_OVERLAP=0) */
} nsa_cuda_overrides;

/* Context, shared by all backends. */
struct nsa_context {
    nsa_backend backend;
    int32_t num_threads;
    int32_t device;
    void *stream;
    nsa_cuda_overrides cuda; /* CUDA backend only */
    void *flex_cache;        /* CUDA: the block-sparse kernels compiled for this context (flex/flex.cu) */
    void *cp_state;          /* CUDA: context parallelism's communication stream and events (cp/cp.cu), made by
                                the first call that overlaps; NULL until then */
};

#endif
