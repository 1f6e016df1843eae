/* flex_route.h -- the dense route of block-sparse attention (docs/spec.md 14): a call whose mods
 * are nsa_attention options (causal, windows, a document mask, a softcap) and whose block mask
 * visits exactly the key blocks those options see runs on nsa_attention's kernels, which compute
 * the same function faster than a kernel generated for any mod can. Backend-neutral: the front
 * end (api.c) plans the route from the mods and shapes, the backend brings the block lists and
 * the document ids to host memory, and this file decides and maps the call. Not installed. */
#ifndef NSA_FLEX_ROUTE_H
#define NSA_FLEX_ROUTE_H

#include "internal.h"
#include "mod/expr.h"

typedef struct flex_route {
    expr_attention m;       /* the mods as options */
    const nsa_tensor *doc;  /* the document mask's ids (rank 1, I32, at least T long), or NULL */
} flex_route;

/* Whether a validated call (bwd: the backward's forward args) may take the route, from its
 * mods, shapes and the route switch alone (no tensor data read): Tq == Tk >= 1 and
 * <= INT32_MAX; a document mask needs B == 1 and ids for every row. @return 1 with *r, or 0. */
int flex_route_plan(const nsa_flex_args *a, const nsa_problem *p, flex_route *r);

/* The route switch: on unless NSA_FLEX_ROUTE=0 (read once); tests turn it off and on to check
 * both paths of the same call. */
int flex_route_enabled(void);
void flex_route_set_enabled(int on);
/* Calls that took the route in this process (the tests check which path a call took). */
long flex_route_taken(void);
void flex_route_note_taken(void);

/* What the decision reads, in host memory (the backend fills it: the CPU points at the caller's
 * tensors, CUDA copies them). */
typedef struct flex_route_host {
    nsa_block_mask lists;  /* the call's block mask, its four tensors in host memory */
    int32_t *doc;          /* doc[0 .. T) gathered, or NULL without a document mask (or with the caller's runs) */
    const int32_t *runs;   /* the caller's doc_runs (n + 1 bounds, nruns = n), or NULL: the runs come from doc */
    int64_t nruns;
    float qmax, kmax;      /* the largest |element| of q and of k (+inf or NaN: a non-finite one; set only when asked) */
    int scores_on_device;  /* the backend's attention keeps a row of all -inf scores empty itself (nsa_problem.flex_rows:
                              CUDA), so qmax, kmax are not read and no magnitude declines the route */
    int decline;           /* the backend cannot read them now (CUDA: a stream being captured) */
    void *owned[5];        /* host buffers to free */
} flex_route_host;
void flex_route_host_free(flex_route_host *h);

/* Whether q and k must be scanned (CPU): without a softcap a score is the scaled product, and a
 * row whose visible scores are all -inf is empty for the block-sparse engine but NaN for dense
 * attention. Such scores need an infinite or NaN input, or finite ones whose product overflows
 * f32; the CPU route is taken only when scale * DK * max|q| * max|k| stays below FLT_MAX / 4 (no
 * product, partial sum or score can reach infinity then). A softcap keeps every score finite or
 * NaN, the same on both paths. CUDA's attention kernels are told instead (nsa_problem.flex_rows):
 * no scan, no synchronisation. */
static inline int flex_route_needs_scan(const flex_route *r) { return r->m.softcap == 0.0f; }

/* The CPU's flex_route_host: the caller's own lists, doc gathered, q and k scanned when asked.
 * @return SUCCESS or OUT_OF_MEMORY (then the engine's path runs). */
nsa_status flex_route_host_cpu(const nsa_flex_args *a, const nsa_problem *p, const flex_route *r, flex_route_host *h);

/* The decision, on lists already checked (nsa_flex_lists_check): the document ids form one run
 * each (then cu[0 .. *nseq] are the runs' bounds; cu has room for T + 1), and every (batch,
 * head, query block) lists, partial or full, each key block holding a pair the options show and
 * lists as full only blocks all of whose pairs they show. @return 1 (take the route), 0 (keep
 * the engine) or -1 (no host memory: keep the engine). */
int flex_route_decide(const flex_route *r, const flex_route_host *h, const nsa_problem *p, int32_t *cu, int64_t *nseq);

/* The (batch, head) extents at which a walk over block mask m's lists reads them: the largest
 * of its tensors' dims (each 1 or the call's B / HQ, a size-1 dim broadcast), but 0 when the
 * call has no batch entry or no query head, where a tensor may broadcast a dim of 1 over a
 * partner of size 0 that holds nothing to read. */
void flex_lists_extent(const nsa_block_mask *m, const nsa_problem *p, int64_t *Bm, int64_t *Hm);

/* The runs of equal ids of doc[0 .. T) as bounds cu[0 .. n] (cu: T + 1 entries). @return n; 0 when
 * an id comes back after another (two runs of one document would see each other); -1 without
 * memory. */
int64_t flex_route_doc_runs(const int32_t *doc, int64_t T, int32_t *cu);

/* Rows r0 .. r1 of T under the options m (documents: the runs cu[0 .. n], or cu NULL): the keys
 * some row sees, [*some_lo, *some_hi], and the keys every row sees, [*all_lo, *all_hi] (empty when
 * all_lo > all_hi). Each row sees one interval -- its document's span cut by the windows, causality
 * and a prefix -- that holds the row itself and whose ends grow with the row, so both follow from
 * the first and the last row. */
void flex_route_block_keys(const expr_attention *m, int64_t T, const int32_t *cu, int64_t n, int64_t r0, int64_t r1,
                           int64_t *some_lo, int64_t *some_hi, int64_t *all_lo, int64_t *all_hi);

/* doc[0 .. T) of a rank-1 int32 view with at least T elements, into out (host memory). */
void flex_route_gather_doc(const nsa_tensor *doc, int64_t T, int32_t *out);

/* The nsa_attention args of the route: a's tensors and scale, lse (the forward's, or a scratch
 * the caller provides), the options, and the document runs as varlen when cu is given. */
void flex_route_args(const flex_route *r, const nsa_flex_args *a, const nsa_tensor *lse, const int32_t *cu, int64_t nseq,
                     nsa_attention_args *out);

#endif /* NSA_FLEX_ROUTE_H */
