/* rules.h -- NSA's position arithmetic (spec/nsa.md sections 1-5, nsa.h section 5), written
 * once and shared by the front end, the CPU backend and the CUDA kernels (NSA_HD marks
 * host+device code). Every function here is pure integer arithmetic on positions; no tensor
 * access. Positions are local to a sequence; key ranges are inclusive, [lo, hi], and empty
 * when hi < lo.
 *
 * The int32 forms (suffix 32) are the same arithmetic for kernels whose loops live in 32-bit
 * registers; their callers guarantee that every position, length and product involved fits
 * in int32 (windows: pass them through nsa_rule_window_clamp first). Their divisions are
 * unsigned: the dividends are never negative (positions and block indices are >= 0), and it
 * is the shorter instruction sequence on the GPU. tests/test_rules.c holds the copies these
 * functions replaced and checks each against its replacement. */
#ifndef NSA_RULES_H
#define NSA_RULES_H

#include <stdint.h>

#ifdef __CUDACC__
#define NSA_HD __host__ __device__ __forceinline__
#else
#define NSA_HD static inline
#endif

/* ---- 1. compression: block i covers tokens [i*d, i*d + l) ----------------------------- */

/* Nc = floor((T - l) / d) + 1 compressed blocks when T >= l, else 0. */
NSA_HD int64_t nsa_rule_num_cmp(int64_t T, int64_t l, int64_t d)
{
    return T >= l ? (T - l) / d + 1 : 0;
}

/* Last token of compressed block i; also the first query that sees the block (spec 2). */
/* ... in 32-bit arithmetic (T, l, d >= 1 small enough for int32), as the kernels count per
 * sequence */
NSA_HD int32_t nsa_rule_num_cmp32(int32_t T, int32_t l, int32_t d)
{
    return T >= l ? (int32_t)((uint32_t)(T - l) / (uint32_t)d) + 1 : 0;
}

NSA_HD int64_t nsa_rule_cmp_last_token(int64_t i, int64_t l, int64_t d)
{
    return i * d + l - 1;
}

/* First compressed block that covers token x (the first i with i*d + l - 1 >= x). */
NSA_HD int64_t nsa_rule_cmp_first_at(int64_t x, int64_t l, int64_t d)
{
    return x >= l ? (x - l) / d + 1 : 0;
}

/* Last compressed block that starts at or before token x (it covers x, as d <= l); may
 * exceed Nc - 1 near the end of a sequence. */
NSA_HD int64_t nsa_rule_cmp_last_at(int64_t x, int64_t d)
{
    return x / d;
}

/* ---- 2. compressed attention: query t sees block i iff i*d + l - 1 <= t ------------- */

/* Number of compressed blocks query t sees: blocks 0 .. (t + 1 - l) / d. */
NSA_HD int64_t nsa_rule_cmp_visible(int64_t t, int64_t l, int64_t d)
{
    return t + 1 >= l ? (t + 1 - l) / d + 1 : 0;
}

NSA_HD int32_t nsa_rule_cmp_visible32(int32_t t, int32_t l, int32_t d)
{
    return t + 1 >= l ? (int32_t)((uint32_t)(t + 1 - l) / (uint32_t)d) + 1 : 0;
}

/* The same, capped by the sequence's nc compressed keys: a row reads keys [0, result) (the
 * cap binds only for t >= the sequence's length). */
NSA_HD int64_t nsa_rule_cmp_visible_cap(int64_t t, int64_t l, int64_t d, int64_t nc)
{
    const int64_t nv = nsa_rule_cmp_visible(t, l, d);
    return nv < nc ? nv : nc;
}

NSA_HD int32_t nsa_rule_cmp_visible_cap32(int32_t t, int32_t l, int32_t d, int32_t nc)
{
    const int32_t nv = nsa_rule_cmp_visible32(t, l, d);
    return nv < nc ? nv : nc;
}

/* ---- 3. selection: block j covers tokens [j*l', (j+1)*l') ---------------------------- */

/* nb = ceil(T / l') selection blocks. */
NSA_HD int64_t nsa_rule_num_slc(int64_t T, int64_t lp)
{
    return T > 0 ? (T - 1) / lp + 1 : 0; /* (not (T + lp - 1) / lp: lp may be near INT64_MAX) */
}

/* The selection block holding position t: query t's current block cur (its candidates are
 * blocks 0 .. cur). */
NSA_HD int64_t nsa_rule_slc_of(int64_t t, int64_t lp) { return t / lp; }
NSA_HD int32_t nsa_rule_slc_of32(int32_t t, int32_t lp) { return (int32_t)((uint32_t)t / (uint32_t)lp); }

/* Tokens shared by compressed block i = [i*d, i*d + l) and selection block j = [j*l', (j+1)*l'). */
NSA_HD int64_t nsa_rule_overlap(int64_t i, int64_t j, int64_t l, int64_t d, int64_t lp)
{
    int64_t lo = i * d > j * lp ? i * d : j * lp;
    int64_t hi = i * d + l < (j + 1) * lp ? i * d + l : (j + 1) * lp;
    return hi > lo ? hi - lo : 0;
}

NSA_HD int32_t nsa_rule_overlap32(int32_t i, int32_t j, int32_t l, int32_t d, int32_t lp)
{
    int32_t lo = i * d > j * lp ? i * d : j * lp;
    int32_t hi = i * d + l < (j + 1) * lp ? i * d + l : (j + 1) * lp;
    return hi > lo ? hi - lo : 0;
}

/* Range of selection blocks a compressed block i overlaps: [first, last]. */
NSA_HD int64_t nsa_rule_cmp_first_slc(int64_t i, int64_t d, int64_t lp) { return (i * d) / lp; }
NSA_HD int64_t nsa_rule_cmp_last_slc(int64_t i, int64_t l, int64_t d, int64_t lp) { return (i * d + l - 1) / lp; }

/* Range of compressed blocks a selection block j overlaps: [first, last] (the blocks with a
 * nonzero nsa_rule_overlap; last is not capped by Nc or by what a query sees). */
NSA_HD int64_t nsa_rule_slc_first_cmp(int64_t j, int64_t l, int64_t d, int64_t lp)
{
    return nsa_rule_cmp_first_at(j * lp, l, d);
}

NSA_HD int64_t nsa_rule_slc_last_cmp(int64_t j, int64_t d, int64_t lp)
{
    return nsa_rule_cmp_last_at((j + 1) * lp - 1, d);
}

NSA_HD int32_t nsa_rule_slc_first_cmp32(int32_t j, int32_t l, int32_t d, int32_t lp)
{
    return j * lp >= l ? (int32_t)((uint32_t)(j * lp - l) / (uint32_t)d) + 1 : 0;
}

NSA_HD int32_t nsa_rule_slc_last_cmp32(int32_t j, int32_t d, int32_t lp)
{
    return (int32_t)((uint32_t)((j + 1) * lp - 1) / (uint32_t)d);
}

/* Is selection block j forced for a query in block cur (j <= cur assumed)? Spec 3:
 * the first n_init blocks and the n_local blocks ending at cur. */
NSA_HD int nsa_rule_forced(int64_t j, int64_t cur, int64_t n_init, int64_t n_local)
{
    return j < n_init || j > cur - n_local;
}

/* Selection order: forced blocks first, then larger importance, then lower index; a NaN
 * importance (a row that read a non-finite value) ranks below every number, so the order stays
 * total and every backend keeps the same blocks.
 * Returns nonzero when candidate (fa, ia, ja) ranks strictly above (fb, ib, jb). */
NSA_HD int nsa_rule_ranks_above(int fa, float ia, int64_t ja, int fb, float ib, int64_t jb)
{
    if (fa != fb) return fa > fb;
    const int na = ia != ia, nb = ib != ib;
    if (na != nb) return nb;
    if (!na && ia != ib) return ia > ib;
    return ja < jb;
}

/* ---- 4. selected attention: query t reads the keys <= t of its blocks ---------------- */

/* First key of selection block j. */
NSA_HD int64_t nsa_rule_slc_lo(int64_t j, int64_t lp) { return j * lp; }

/* One past the last key of selection block j in a sequence of len keys (the last block may
 * be short). */
NSA_HD int64_t nsa_rule_slc_end(int64_t j, int64_t lp, int64_t len)
{
    return j * lp + lp < len ? j * lp + lp : len;
}

NSA_HD int32_t nsa_rule_slc_end32(int32_t j, int32_t lp, int32_t len)
{
    return j * lp + lp < len ? j * lp + lp : len;
}

/* Does selection block j hold a key query t sees (its first key <= t)? A block that does
 * not is skipped whole, whatever the selection says. */
NSA_HD int nsa_rule_slc_visible(int64_t j, int64_t t, int64_t lp) { return j * lp <= t; }

/* Last key of block j that query t sees: causal inside the block; < nsa_rule_slc_lo: none. */
NSA_HD int64_t nsa_rule_slc_hi(int64_t j, int64_t t, int64_t lp, int64_t len)
{
    const int64_t e = nsa_rule_slc_end(j, lp, len) - 1;
    return e < t ? e : t;
}

NSA_HD int32_t nsa_rule_slc_hi32(int32_t j, int32_t t, int32_t lp, int32_t len)
{
    const int32_t e = nsa_rule_slc_end32(j, lp, len) - 1;
    return e < t ? e : t;
}

/* ---- 5. windows: the sliding branch and the attention op (nsa.h section 5) ----------- */
/* Windows count keys left (wl) and right (wr) of a query's diagonal key; -1 = unbounded.
 * With tq queries facing tk keys the diagonal is aligned bottom-right: query t's diagonal
 * key is t + (tk - tq), which may be negative (then a causal row sees nothing). */

/* window_left of the sliding branch of window w: keys [t - w + 1, t] (spec 5). */
NSA_HD int64_t nsa_rule_swa_left(int64_t w) { return w - 1; }

/* The window_right a call uses: causal ignores the caller's (nsa.h). */
NSA_HD int64_t nsa_rule_window_right(int64_t wr, int causal) { return causal ? 0 : wr; }

/* Query t's diagonal key when tq query rows face tk key rows. */
NSA_HD int64_t nsa_rule_diag(int64_t t, int64_t tq, int64_t tk) { return t + (tk - tq); }
NSA_HD int32_t nsa_rule_diag32(int32_t t, int32_t tq, int32_t tk) { return t + (tk - tq); }

/* A window as a value that fits where span does: one wider than span (>= every |key -
 * diagonal| of the sequence, e.g. tq + tk) reads as unbounded (-1); same bounds as w. */
NSA_HD int64_t nsa_rule_window_clamp(int64_t w, int64_t span) { return w < 0 || w > span ? -1 : w; }

/* First key a row with diagonal key dg sees under window_left wl: max(0, dg - wl). Written so
 * that no window, however large, overflows. */
NSA_HD int64_t nsa_rule_window_lo(int64_t dg, int64_t wl)
{
    return wl < 0 || wl > dg ? 0 : dg - wl;
}

NSA_HD int32_t nsa_rule_window_lo32(int32_t dg, int32_t wl)
{
    return wl < 0 || wl > dg ? 0 : dg - wl;
}

/* Last key, of nk, a row with diagonal key dg sees: causal min(dg, nk - 1), else
 * min(dg + wr, nk - 1) (wr < 0: nk - 1). No window overflows. */
NSA_HD int64_t nsa_rule_window_hi(int64_t dg, int64_t wr, int causal, int64_t nk)
{
    if (causal) return dg < nk - 1 ? dg : nk - 1;
    return wr < 0 || wr > nk - 1 - dg ? nk - 1 : dg + wr;
}

NSA_HD int32_t nsa_rule_window_hi32(int32_t dg, int32_t wr, int causal, int32_t nk)
{
    if (causal) return dg < nk - 1 ? dg : nk - 1;
    return wr < 0 || wr > nk - 1 - dg ? nk - 1 : dg + wr;
}

/* The queries that see key c (0 <= c < tk), the inverse of the two bounds above (both never
 * decrease in t): the first query whose window reaches c, in [0, tq] (tq: none) ... */
NSA_HD int64_t nsa_rule_window_q_first(int64_t c, int64_t wr, int causal, int64_t tq, int64_t tk)
{
    const int64_t e = c - (tk - tq); /* the query whose diagonal key is c */
    const int64_t t = causal ? e : wr < 0 || wr > e ? 0 : e - wr;
    return t < 0 ? 0 : t > tq ? tq : t;
}

/* ... and the last query whose window starts at or before c, in [-1, tq - 1] (-1: none). */
NSA_HD int64_t nsa_rule_window_q_last(int64_t c, int64_t wl, int64_t tq, int64_t tk)
{
    const int64_t e = c - (tk - tq);
    const int64_t t = wl < 0 || wl > tq - 1 - e ? tq - 1 : e + wl;
    return t < -1 ? -1 : t;
}

#endif
