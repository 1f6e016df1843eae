/* prim/mask.cuh -- which keys a query row sees: the rule of a branch (window / dense,
 * compressed, selected) with the options the range tiles apply themselves, and its visible
 * key range per query (host and device). */
#ifndef NSA_CUDA_PRIM_MASK_CUH
#define NSA_CUDA_PRIM_MASK_CUH

#include "common.cuh"

enum { RULE_WIN = 0, RULE_CMP = 1, RULE_SLC = 2 };

/* Which keys a query row sees: window/dense (wl, wr, causal), compressed (l, d) or
 * selected (block lp, causal inside the block). */
typedef struct rule_t {
    int kind;
    int64_t wl, wr;
    int causal;
    int cl, cd, lp;
    /* attention options the range forward tiles (qtile, qwg) apply themselves; 0 / NULL = off
     * (the backward tiles take cap alone; sinks and shift send the backward to the general
     * kernels of attention/kernels.cuh) */
    float cap;            /* logit softcap */
    const float *sinks;   /* [HQ] sink logits at stride sinks_s */
    int64_t sinks_s;
    int shift;            /* Tq != Tk (dense batch): query row t is position t + shift -- the window's
                             diagonal key, and the position the compressed and selected rules read
                             (a query chunk of the NSA ops: shift = Tk - Tq) */
    int nk;               /* window rule: key count (Tk, 0 allowed); -1: the sequence's keys */
    int flex_rows;        /* a row whose visible scores are all -inf is empty, not NaN (nsa_problem.flex_rows) */
} rule_t;

#if defined(__CUDACC__)

/* Keys of sequence sq that a rule's queries choose from: its compressed keys, or its own
 * (the window rule's explicit count nk when it has one: the attention op's Tq != Tk). */
__device__ __forceinline__ int rule_nkeys(const rule_t &r, const seqinfo &sq)
{
    return r.kind == RULE_CMP ? sq.ncmp : r.kind == RULE_WIN && r.nk >= 0 ? r.nk : sq.klen;
}

/* Visible keys [lo, hi] of query row t (position t + r.shift; empty when hi < lo); for selected
 * attention the causal bound only (blocks are masked separately). */
__device__ __forceinline__ void rule_bounds(const rule_t &r, int t, int nkeys, int *lo, int *hi)
{
    const int pos = t + r.shift; /* bottom-right aligned (Tq != Tk); < 0: the row sees nothing */
    if (r.kind == RULE_CMP) {
        *lo = 0;
        *hi = pos < 0 ? -1 : nsa_rule_cmp_visible_cap32(pos, r.cl, r.cd, nkeys) - 1;
    } else if (r.kind == RULE_WIN) {
        *lo = (int)nsa_rule_window_lo(pos, r.wl);
        *hi = (int)nsa_rule_window_hi(pos, r.wr, r.causal, nkeys);
    } else { /* selected: the causal bound (its blocks are masked separately) */
        *lo = 0;
        *hi = nsa_rule_window_hi32(pos, 0, 1, nkeys);
    }
}

#endif /* __CUDACC__ */

#endif
