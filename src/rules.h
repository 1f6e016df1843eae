/* rules.h -- NSA's block arithmetic (spec/nsa.md sections 1-3), written once and shared by
 * the front end, the CPU backend and the CUDA kernels (NSA_HD marks host+device code).
 * Every function here is pure integer arithmetic on positions; no tensor access. */
#ifndef NSA_RULES_H
#define NSA_RULES_H

#include <stdint.h>

#ifdef __CUDACC__
#define NSA_HD __host__ __device__ __forceinline__
#else
#define NSA_HD static inline
#endif

/* Nc = floor((T - l) / d) + 1 compressed blocks when T >= l, else 0 (spec 1). */
NSA_HD int64_t nsa_rule_num_cmp(int64_t T, int64_t l, int64_t d)
{
    return T >= l ? (T - l) / d + 1 : 0;
}

/* nb = ceil(T / l') selection blocks (spec 3). */
NSA_HD int64_t nsa_rule_num_slc(int64_t T, int64_t lp)
{
    return (T + lp - 1) / lp;
}

/* Number of compressed blocks query t sees: block i is visible iff i*d + l - 1 <= t,
 * i.e. i <= (t - l + 1) / d. Also capped by Nc (only matters if t >= T, never in use). */
NSA_HD int64_t nsa_rule_cmp_visible(int64_t t, int64_t l, int64_t d)
{
    return t + 1 >= l ? (t + 1 - l) / d + 1 : 0;
}

/* Tokens shared by compressed block i = [i*d, i*d + l) and selection block j = [j*l', (j+1)*l'). */
NSA_HD int64_t nsa_rule_overlap(int64_t i, int64_t j, int64_t l, int64_t d, int64_t lp)
{
    int64_t lo = i * d > j * lp ? i * d : j * lp;
    int64_t hi = i * d + l < (j + 1) * lp ? i * d + l : (j + 1) * lp;
    return hi > lo ? hi - lo : 0;
}

/* Range of selection blocks a compressed block i overlaps: [first, last]. */
NSA_HD int64_t nsa_rule_cmp_first_slc(int64_t i, int64_t d, int64_t lp) { return (i * d) / lp; }
NSA_HD int64_t nsa_rule_cmp_last_slc(int64_t i, int64_t l, int64_t d, int64_t lp) { return (i * d + l - 1) / lp; }

/* Is selection block j forced for a query in block cur (j <= cur assumed)? Spec 3:
 * the first n_init blocks and the n_local blocks ending at cur. */
NSA_HD int nsa_rule_forced(int64_t j, int64_t cur, int64_t n_init, int64_t n_local)
{
    return j < n_init || j > cur - n_local;
}

/* Selection order: forced blocks first, then larger importance, then lower index.
 * Returns nonzero when candidate (fa, ia, ja) ranks strictly above (fb, ib, jb). */
NSA_HD int nsa_rule_ranks_above(int fa, float ia, int64_t ja, int fb, float ib, int64_t jb)
{
    if (fa != fb) return fa > fb;
    if (ia != ib) return ia > ib;
    return ja < jb;
}

#endif
