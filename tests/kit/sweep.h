/* sweep.h -- the random correctness sweep: the backend against the float64 reference
 * (ref.c) on seeded random problems, op by op and for the whole pipeline, forward and
 * backward. Shared by `make test` (fixed seed, fixed case count), build/nsa_gpu_tests and
 * `nsa check`. */
#ifndef NSA_TEST_SWEEP_H
#define NSA_TEST_SWEEP_H

#include <stddef.h>
#include <stdint.h>
#include "nsa.h"

/* A problem the sweep runs; fields left 0 are drawn at random by sweep_case_random. */
typedef struct sweep_case {
    int64_t B, T, HQ, H, DK, DV;
    nsa_dtype dtype;
    nsa_config cfg;
    int varlen;               /* pack several sequences (B = 1) */
    int64_t num_seqs;
    int32_t lens[8];          /* varlen lengths, num_seqs of them */
    int strided;              /* 0 contiguous, 1 padded rows/dims, 2 head-major */
    int gates;                /* bit 0 cmp, 1 slc, 2 swa */
    int own_cmp, own_idx, sep_slc, sep_swa;
    int zero_q;               /* q = 0: every score equal (tie rule) */
} sweep_case;

struct hashlog; /* hashlog.h */

typedef struct sweep_opts {
    uint64_t seed;
    long max_cases;           /* stop after this many random cases (0 = no limit) */
    double minutes;           /* stop after this long (0 = no limit) */
    nsa_backend backend;
    int threads;
    int verbose;
    int64_t max_T;            /* cap for random T (default 1000) */
    const char *label;        /* prefix of the progress lines (default "sweep") */
    const char *op;           /* only this op's checks (sweep_set_op; NULL: all) */
    struct hashlog *hashes;   /* receives every checked output's hash (NULL: none) */
    int nonfinite;            /* the non-finite mode (sweep_set_nonfinite) for this run */
} sweep_opts;

/* Where the sweep's tensors and workspace live. All NULL (the default): host memory, for
 * the CPU backend. On CUDA: devmem_sweep_memory() (devmem.h), so that sweep.c itself needs
 * no CUDA header. */
typedef struct sweep_memory {
    void *(*alloc)(size_t bytes);
    void (*release)(void *p);
    void (*upload)(void *dev, const void *host, size_t bytes);
    void (*download)(void *host, const void *dev, size_t bytes);
} sweep_memory;
void sweep_set_memory(const sweep_memory *m);

/* The sweep's op names, as its checks print them ("nsa_attention o": op nsa_attention):
 * nsa_forward and nsa_backward (the whole pipeline), then each single op and its backward.
 * NULL-terminated. */
extern const char *const sweep_op_names[];
/* From now on only the checks of op `name` run (NULL: every op). What it reads from another op
 * still runs, unchecked, and a case draws its data as in a full run, so a case index and seed
 * mean the same with or without it. @return 0, or -1 for a name not in sweep_op_names. */
int sweep_set_op(const char *name);
/* The non-finite mode, on (1) or off (0) from now on: every op of a case runs with one to three
 * NaN / +inf / -inf values planted at random positions of one of its inputs (q, k, v, k_cmp,
 * v_cmp, gates, bias, branch outputs, dout, ...), and each output's set of non-finite elements
 * must be the float64 reference's, element for element, every finite element within the usual
 * tolerance; rows with no visible key must stay o = 0, lse = -inf, and the attention op runs
 * again with softcap, sinks, segment ids and a bias. One case in five (f32, bf16) plants
 * nothing but scales one sequence's q and k by 1e30 or 1e19, so that f32 scores overflow; then
 * only "a row that sees a key is never reported empty (o = 0, lse = -inf)" is checked. The
 * plants come from a generator of their own: a case's other inputs are the sweep's. */
void sweep_set_nonfinite(int on);
/* Receives the 64-bit hash of each checked output's element bytes; name is "op output". */
typedef void (*sweep_hash_fn)(void *user, const char *name, uint64_t hash);
void sweep_set_hash(sweep_hash_fn fn, void *user);

/* Draws a random valid case from rng state *s (fields already nonzero in *c are kept). */
void sweep_case_random(sweep_case *c, uint64_t *s, int64_t max_T);
/* Case `index` of a run from rng state *state: on CUDA, bf16 or f16 storage (the GPU takes no
 * f32 attention inputs) and the first two cases' shapes fixed; then sweep_case_random. One
 * function, so that a seed gives the same cases in build/nsa_gpu_tests and `nsa check`. */
void sweep_case_next(sweep_case *c, uint64_t *state, long index, nsa_backend backend, int64_t max_T);
/* Runs every check on one case, recording passes and failures in the harness counters.
 * @return the number of failed checks in this case. */
long sweep_run_case(nsa_context *ctx, const sweep_case *c, uint64_t seed, int verbose);
/* Random cases (sweep_case_next) until max_cases or minutes, in host memory for the CPU and in
 * device memory for CUDA (devmem.h); prints a progress line every ~10 s when verbose.
 * @return total failed checks. */
long sweep_run(const sweep_opts *o);
/* The tolerance rule (style.md) for one tensor of n elements against the float64 reference:
 * 2 * (max error of the naive same-precision result, stored in `storage`, + an fp32
 * accumulation floor). naive NULL: the exact result's storage rounding only. */
double sweep_tolerance(nsa_dtype storage, const double *ref, const double *naive, int64_t n);
/* A backward's two naive draws (sweep.c, REF_BWD: from the saved outputs the backward was
 * handed, and from the naive pass's own): b folded into a, element by element the one farther
 * from ref once stored in `storage`, so that sweep_tolerance(a) takes the larger error. */
void sweep_naive_merge(nsa_dtype storage, const double *ref, double *a, const double *b, int64_t n);
/* x rounded to what a tensor of dtype dt stores (f32, f16, bf16; other dtypes: x). */
double sweep_round_to(nsa_dtype dt, double x);
/* One-line description of a case (for failure messages). */
void sweep_case_describe(const sweep_case *c, char *buf, size_t n);

#endif
