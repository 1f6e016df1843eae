/* test_rules.c -- src/rules.h against the expressions it replaced. Each old_* function below is
 * a verbatim copy of arithmetic that was written out in a backend (its source is named above
 * it; CUDA copies are translated to C: references become pointers); every check runs the old
 * and the new form over an exhaustive grid and must find them equal. Where a rule has a plain
 * statement in the spec, the new form is also checked against that statement. */
#include "harness.h"
#include "rules.h"
#include "cpu/common.h"
#include "cpu/common.h" /* twice on purpose: the guard must cover the whole header */
#include "nsa.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- counting mismatches: one harness check per rule, the first mismatch printed ------- */

typedef struct tally {
    long checks, bad;
    char first[256];
} tally;

static void tally_eq(tally *t, int64_t got, int64_t want, const char *what, int64_t a, int64_t b, int64_t c,
                     int64_t d)
{
    t->checks++;
    if (got == want) return;
    if (t->bad++ == 0)
        snprintf(t->first, sizeof t->first, "%s: got %lld, old %lld at (%lld, %lld, %lld, %lld)", what,
                 (long long)got, (long long)want, (long long)a, (long long)b, (long long)c, (long long)d);
}

static void tally_done(tally *t, const char *name)
{
    if (g_tests_verbose) printf("  rules %s: %ld comparisons, %ld mismatches\n", name, t->checks, t->bad);
    CHECK_MSG(t->checks > 0 && t->bad == 0, t->bad ? t->first : name);
}

/* wl, wr: unbounded, small, around a tile of 64 and around the paper's window of 512 */
static int window_grid(int64_t *w)
{
    int n = 0;
    w[n++] = -1;
    for (int64_t x = 0; x <= 20; x++) w[n++] = x;
    const int64_t more[] = {63, 64, 65, 511, 512};
    for (int i = 0; i < 5; i++) w[n++] = more[i];
    return n;
}

/* (Tq, Tk) pairs: equal, more keys, more queries, empty sides */
static const int64_t QK[][2] = {{1, 1}, {5, 5}, {64, 64}, {300, 300}, {97, 161}, {161, 97}, {1, 300},
                                {300, 1}, {0, 5}, {5, 0}, {65, 64}, {64, 65}};
enum { NQK = (int)(sizeof QK / sizeof QK[0]) };

/* ======================================================================================== */
/* Old copies: the CPU backend                                                              */
/* ======================================================================================== */

typedef struct old_range_rule {
    int cmp;
    int64_t l, d;
    int64_t wl, wr;
    int causal;
} old_range_rule;

/* src/cpu/range.c rule_bounds */
static void old_rule_bounds(const old_range_rule *r, int64_t t, int64_t nkeys, int64_t *lo, int64_t *hi)
{
    if (r->cmp) {
        int64_t nv = nsa_rule_cmp_visible(t, r->l, r->d);
        *lo = 0;
        *hi = (nv < nkeys ? nv : nkeys) - 1;
        return;
    }
    *lo = r->wl < 0 || t - r->wl < 0 ? 0 : t - r->wl;
    if (r->causal) *hi = t < nkeys - 1 ? t : nkeys - 1;
    else *hi = r->wr < 0 || t + r->wr > nkeys - 1 ? nkeys - 1 : t + r->wr;
}

/* src/cpu/range.c first_query_reaching */
static int64_t old_first_query_reaching(const old_range_rule *r, int64_t len, int64_t nkeys, int64_t c)
{
    int64_t a = 0, b = len; /* answer in [a, b]; b = none */
    while (a < b) {
        int64_t mid = a + (b - a) / 2, lo, hi;
        old_rule_bounds(r, mid, nkeys, &lo, &hi);
        if (hi >= c) b = mid;
        else a = mid + 1;
    }
    return a;
}

/* src/cpu/range.c last_query_starting_by */
static int64_t old_last_query_starting_by(const old_range_rule *r, int64_t len, int64_t nkeys, int64_t c)
{
    int64_t a = -1, b = len - 1; /* answer in [a, b]; -1 = none */
    while (a < b) {
        int64_t mid = b - (b - a) / 2, lo, hi;
        old_rule_bounds(r, mid, nkeys, &lo, &hi);
        if (lo <= c) a = mid;
        else b = mid - 1;
    }
    return a;
}

typedef struct old_ext_opts {
    int causal;
    int64_t wl, wr;
} old_ext_opts;

typedef struct old_ext_seq {
    int64_t qlen, klen;
} old_ext_seq;

/* src/cpu/attn_ext.c ext_opts_make: the window fields */
static old_ext_opts old_ext_opts_make(int causal, int64_t window_left, int64_t window_right)
{
    old_ext_opts o;
    o.causal = causal != 0;
    o.wl = window_left;
    o.wr = causal ? 0 : window_right;
    return o;
}

/* src/cpu/attn_ext.c ext_bounds */
static void old_ext_bounds(const old_ext_opts *o, const old_ext_seq *sq, int64_t i, int64_t *lo, int64_t *hi)
{
    const int64_t d = i + sq->klen - sq->qlen;
    int64_t a = o->wl < 0 ? 0 : d - o->wl, b = o->causal ? d : (o->wr < 0 ? sq->klen - 1 : d + o->wr);
    *lo = a < 0 ? 0 : a;
    *hi = b > sq->klen - 1 ? sq->klen - 1 : b;
}

/* src/cpu/attn_ext.c ext_first_reaching */
static int64_t old_ext_first_reaching(const old_ext_opts *o, const old_ext_seq *sq, int64_t c)
{
    int64_t a = 0, b = sq->qlen;
    while (a < b) {
        int64_t mid = a + (b - a) / 2, lo, hi;
        old_ext_bounds(o, sq, mid, &lo, &hi);
        if (hi >= c) b = mid;
        else a = mid + 1;
    }
    return a;
}

/* src/cpu/attn_ext.c ext_last_starting */
static int64_t old_ext_last_starting(const old_ext_opts *o, const old_ext_seq *sq, int64_t c)
{
    int64_t a = -1, b = sq->qlen - 1;
    while (a < b) {
        int64_t mid = b - (b - a) / 2, lo, hi;
        old_ext_bounds(o, sq, mid, &lo, &hi);
        if (lo <= c) a = mid;
        else b = mid - 1;
    }
    return a;
}

/* src/cpu/range.c select_position: the current block, the visible count, and the compressed
 * blocks overlapping selection block j */
static int64_t old_select_cur(int64_t tpos, int64_t lp) { return tpos / lp; }

static int64_t old_select_nv(int64_t tpos, int64_t l, int64_t d, int64_t nkeys)
{
    int64_t nv = nsa_rule_cmp_visible(tpos, l, d);
    nv = nv < nkeys ? nv : nkeys;
    return nv;
}

static void old_select_overlapping(int64_t j, int64_t l, int64_t d, int64_t lp, int64_t nv, int64_t *i0o, int64_t *i1o)
{
    int64_t i0 = j * lp - l + 1 > 0 ? (j * lp - l + 1 + d - 1) / d : 0;
    int64_t i1 = ((j + 1) * lp - 1) / d;
    if (i1 > nv - 1) i1 = nv - 1;
    *i0o = i0, *i1o = i1;
}

/* src/cpu/slc.c usable_blocks: a block starting after t is skipped */
static int old_slc_skipped(int64_t j, int64_t lp, int64_t t) { return j * lp > t; }

/* src/cpu/slc.c one_position / slc_bwd: the keys of block j */
static void old_slc_keys(int64_t j, int64_t lp, int64_t len, int64_t *c0o, int64_t *c1o)
{
    const int64_t c0 = j * lp, c1 = c0 + lp < len ? c0 + lp : len;
    *c0o = c0, *c1o = c1;
}

/* src/cpu/ops.c: the sliding branch's rule and attention_rule's window_right */
static int64_t old_swa_wl(int64_t window) { return window - 1; }
static int64_t old_attention_wr(int causal, int64_t window_right) { return causal ? 0 : window_right; }

/* ======================================================================================== */
/* Old copies: the CUDA backend (listed for replacement; the same rules must hold there)    */
/* ======================================================================================== */

/* src/cuda/selection/topn.cuh div_nn */
static int64_t old_div_nn(int64_t a, int b)
{
    return a <= INT_MAX ? (int64_t)((unsigned)a / (unsigned)b) : a / b;
}

enum { OLD_RULE_WIN = 0, OLD_RULE_CMP = 1, OLD_RULE_SLC = 2 };
typedef struct old_rule_t {
    int kind;
    int64_t wl, wr;
    int causal;
    int cl, cd, lp;
    int shift;
    int nk;
} old_rule_t;

/* src/cuda/prim/mask.cuh rule_bounds, as it was */
static void old_cu_rule_bounds(const old_rule_t *r, int t, int nkeys, int *lo, int *hi)
{
    if (r->kind == OLD_RULE_CMP) {
        const int nv = t + 1 >= r->cl ? (t + 1 - r->cl) / r->cd + 1 : 0;
        *lo = 0;
        *hi = (nv < nkeys ? nv : nkeys) - 1;
    } else if (r->kind == OLD_RULE_WIN) {
        t += r->shift; /* bottom-right aligned diagonal (Tq != Tk); t < 0: the row sees nothing */
        const int64_t a = (r->wl < 0 || t - r->wl < 0) ? 0 : t - r->wl;
        int64_t b;
        if (r->causal) b = t < nkeys - 1 ? t : nkeys - 1;
        else b = (r->wr < 0 || t + r->wr > nkeys - 1) ? nkeys - 1 : t + r->wr;
        *lo = (int)a;
        *hi = (int)b;
    } else {
        *lo = 0;
        *hi = t < nkeys - 1 ? t : nkeys - 1;
    }
}

/* src/cuda/attn/dkdv_tasks.cuh kt_first_reaching / kt_last_starting, as they were (bisections) */
static int old_kt_first_reaching(const old_rule_t *r, int len, int nkeys, int c)
{
    int a = 0, b = len;
    while (a < b) {
        const int mid = a + (b - a) / 2;
        int lo, hi;
        old_cu_rule_bounds(r, mid, nkeys, &lo, &hi);
        if (hi >= c) b = mid;
        else a = mid + 1;
    }
    return a;
}

static int old_kt_last_starting(const old_rule_t *r, int len, int nkeys, int c)
{
    int a = -1, b = len - 1;
    while (a < b) {
        const int mid = b - (b - a) / 2;
        int lo, hi;
        old_cu_rule_bounds(r, mid, nkeys, &lo, &hi);
        if (lo <= c) a = mid;
        else b = mid - 1;
    }
    return a;
}

typedef struct old_xparams {
    int causal;
    int64_t wl, wr;
} old_xparams;

/* src/cuda/attention/kernels.cuh x_range, as it was */
static void old_x_range(const old_xparams *P, int qlen, int klen, int i, int64_t *a, int64_t *b)
{
    const int64_t d = (int64_t)i + klen - qlen, span = (int64_t)klen + qlen;
    const int64_t lo = (P->wl < 0 || P->wl > span) ? 0 : d - P->wl;
    const int64_t hi = P->causal ? d : ((P->wr < 0 || P->wr > span) ? (int64_t)klen - 1 : d + P->wr);
    *a = lo < 0 ? 0 : lo;
    *b = hi > klen - 1 ? klen - 1 : hi;
}

/* src/cuda/attention/kernels.cuh xdkv kernel, as it was: the queries that may see keys [j0, j0 + nkeys) */
static void old_x_key_queries(const old_xparams *P, int qlen, int klen, int j0, int nkeys, int64_t *qmin_o,
                              int64_t *qmax_o)
{
    const int shift = klen - qlen;
    int64_t qmin = 0, qmax = (int64_t)qlen - 1;
    const int64_t span = (int64_t)klen + qlen;
    if (P->causal) qmin = (int64_t)j0 - shift;
    else if (P->wr >= 0 && P->wr <= span) qmin = (int64_t)j0 - shift - P->wr;
    if (P->wl >= 0 && P->wl <= span) qmax = (int64_t)j0 + nkeys - 1 - shift + P->wl;
    qmin = qmin < 0 ? 0 : qmin;
    qmax = qmax > qlen - 1 ? qlen - 1 : qmax;
    if (nkeys <= 0) qmax = -1;
    *qmin_o = qmin, *qmax_o = qmax;
}

/* src/cuda/selection/ampere.cuh (per position) and selection/hopper.cuh: nv in int */
static int old_cu_nv(int t, int cl, int cd) { return t + 1 >= cl ? (t + 1 - cl) / cd + 1 : 0; }

/* src/cuda/selection/ampere.cuh SEL_RANGE and selection/hopper.cuh's range lambda: compressed keys
 * [iA, iB) overlapping selection blocks [jA, jA + JC) */
static void old_sel_range(int jA_, int JC, int lp, int cl, int cd, int nv_max, int *iA_, int *iB_)
{
    const int64_t a0_ = (int64_t)(jA_) * lp - cl;
    *iA_ = a0_ < 0 ? 0 : (int)(old_div_nn(a0_, cd) + 1);
    *iB_ = (int)(old_div_nn((int64_t)((jA_) + JC) * lp - 1, cd) + 1);
    *iB_ = *iB_ < nv_max ? *iB_ : nv_max;
}

/* src/cuda/selection/ampere.cuh importance: one block j's keys [ia, ib) and overlaps */
static void old_sel_block(int j, int lp, int cl, int cd, int *ia_o, int *ib_o)
{
    const int64_t b0 = (int64_t)j * lp - cl;
    int ia = b0 < 0 ? 0 : (int)(old_div_nn(b0, cd) + 1);
    int ib = (int)(old_div_nn((int64_t)j * lp + lp - 1, cd) + 1);
    *ia_o = ia, *ib_o = ib;
}

static int old_sel_overlap(int i, int j, int lp, int cl, int cd)
{
    const int lo = i * cd > j * lp ? i * cd : j * lp;
    const int hi = i * cd + cl < j * lp + lp ? i * cd + cl : j * lp + lp;
    return hi - lo;
}

/* src/cuda/selection/hopper.cuh importance: the same with x = i * cd */
static int old_swg_overlap(int i, int j, int lp, int cl, int cd)
{
    const int jlo = j * lp, jhi = jlo + lp;
    const int x = i * cd, lo = x > jlo ? x : jlo, hi = x + cl < jhi ? x + cl : jhi;
    return hi - lo;
}

/* src/cuda/compress/compress.cu compress_bwd_kernel, as it was: the compressed blocks covering token tl */
static void old_compress_bwd_blocks(int tl, int cl, int cd, int ncmp, int *ilo_o, int *ihi_o)
{
    const int a = tl - cl + 1;
    const int ilo = a <= 0 ? 0 : (a + cd - 1) / cd;
    int ihi = tl / cd;
    ihi = ihi < ncmp - 1 ? ihi : ncmp - 1;
    *ilo_o = ilo, *ihi_o = ihi;
}

/* src/cuda/common.cuh seq_get / seq_units: Nc */
static int old_cu_ncmp(int len, int cl, int cd) { return (cd > 0 && len >= cl) ? (len - cl) / cd + 1 : 0; }

/* src/cuda/selected/lists.cu / attn/dkdv_tasks.cuh, as they were: nb, usable test, block end */
static int64_t old_cu_nb(int64_t len, int64_t lp) { return (len + lp - 1) / lp; }
static int old_cu_unusable(int32_t j, int64_t lp, int64_t pos) { return (int64_t)j * lp > pos; }
static int old_cu_unusable_div(int j, int t, int lp) { return j > t / lp; }
static int old_cu_bend(int j, int lp, int len) { return j * lp + lp < len ? j * lp + lp : len; }

/* ======================================================================================== */
/* Tests                                                                                    */
/* ======================================================================================== */

/* Window bounds of every row: range.c, attn_ext.c, attention/kernels.cuh's x_range, prim/mask.cuh's
 * rule_bounds (window and selected rules), and the int32 forms on clamped windows. */
static void test_window_bounds(void)
{
    int64_t W[32];
    const int nw = window_grid(W);
    tally tr = {0}, te = {0}, tx = {0}, tc = {0}, t32 = {0}, tcl = {0}, tsl = {0};
    for (int causal = 0; causal <= 1; causal++)
        for (int a = 0; a < nw; a++)
            for (int b = 0; b < nw; b++) {
                const int64_t wl = W[a], wr = W[b];
                /* range.c: Tq == Tk == nkeys */
                const old_range_rule orr = {0, 0, 1, wl, old_attention_wr(causal, wr), causal};
                for (int k = 0; k < NQK; k++) {
                    const int64_t tq = QK[k][0], tk = QK[k][1];
                    const int64_t wrn = nsa_rule_window_right(wr, causal);
                    if (tq == tk)
                        for (int64_t t = 0; t < tq; t++) {
                            int64_t lo, hi;
                            old_rule_bounds(&orr, t, tk, &lo, &hi);
                            tally_eq(&tr, nsa_rule_window_lo(t, wl), lo, "range lo", t, wl, wr, causal);
                            tally_eq(&tr, nsa_rule_window_hi(t, wrn, causal, tk), hi, "range hi", t, wl, wr, causal);
                        }
                    const old_ext_opts oe = old_ext_opts_make(causal, wl, wr);
                    const old_ext_seq sq = {tq, tk};
                    const old_xparams xp = {causal, wl, causal ? 0 : wr};
                    const old_rule_t cr = {OLD_RULE_WIN, wl, causal ? 0 : wr, causal, 0, 0, 0, (int)(tk - tq), (int)tk};
                    const int64_t span = tq + tk;
                    for (int64_t i = 0; i < tq; i++) {
                        const int64_t dg = nsa_rule_diag(i, tq, tk);
                        const int64_t lo = nsa_rule_window_lo(dg, wl), hi = nsa_rule_window_hi(dg, wrn, causal, tk);
                        int64_t olo, ohi;
                        old_ext_bounds(&oe, &sq, i, &olo, &ohi);
                        tally_eq(&te, lo, olo, "ext lo", i, wl, wr, causal);
                        tally_eq(&te, hi, ohi, "ext hi", i, wl, wr, causal);
                        old_x_range(&xp, (int)tq, (int)tk, (int)i, &olo, &ohi);
                        tally_eq(&tx, lo, olo, "x_range lo", i, wl, wr, causal);
                        tally_eq(&tx, hi, ohi, "x_range hi", i, wl, wr, causal);
                        int clo, chi;
                        old_cu_rule_bounds(&cr, (int)i, (int)tk, &clo, &chi);
                        tally_eq(&tc, lo, clo, "cuda window lo", i, wl, wr, causal);
                        tally_eq(&tc, hi, chi, "cuda window hi", i, wl, wr, causal);
                        /* the int32 forms on windows clamped to the sequence */
                        const int32_t wl32 = (int32_t)nsa_rule_window_clamp(wl, span);
                        const int32_t wr32 = (int32_t)nsa_rule_window_clamp(wrn, span);
                        const int32_t dg32 = nsa_rule_diag32((int32_t)i, (int32_t)tq, (int32_t)tk);
                        tally_eq(&t32, dg32, dg, "diag32", i, tq, tk, 0);
                        tally_eq(&t32, nsa_rule_window_lo32(dg32, wl32), lo, "lo32", i, wl, wr, causal);
                        tally_eq(&t32, nsa_rule_window_hi32(dg32, wr32, causal, (int32_t)tk), hi, "hi32", i, wl, wr,
                                 causal);
                        /* a clamped window has the same bounds in 64 bits too */
                        tally_eq(&tcl, nsa_rule_window_lo(dg, nsa_rule_window_clamp(wl, span)), lo, "clamp lo", i, wl,
                                 span, 0);
                        tally_eq(&tcl, nsa_rule_window_hi(dg, nsa_rule_window_clamp(wrn, span), causal, tk), hi,
                                 "clamp hi", i, wr, span, causal);
                        /* the spec's statement (nsa.h section 5), key by key: every key of
                         * short sequences, the edges of the range in long ones */
                        const int64_t j0 = tk <= 65 ? -1 : lo - 1, j1 = tk <= 65 ? tk : hi + 1;
                        for (int64_t j = j0; j <= j1 && j <= tk; j++) {
                            const int sees = j >= 0 && j < tk && (wl < 0 || j >= dg - wl) &&
                                             (causal ? j <= dg : (wr < 0 || j <= dg + wr));
                            tally_eq(&tcl, sees, j >= lo && j <= hi, "spec window", i, j, wl, wr);
                        }
                    }
                }
            }
    /* the selected rule's causal bound: prim/mask.cuh's RULE_SLC branch */
    for (int64_t nk = 0; nk <= 70; nk++)
        for (int64_t t = 0; t < 140; t++) {
            const old_rule_t cr = {OLD_RULE_SLC, 0, 0, 0, 0, 0, 16, 0, -1};
            int clo, chi;
            old_cu_rule_bounds(&cr, (int)t, (int)nk, &clo, &chi);
            tally_eq(&tsl, 0, clo, "slc lo", t, nk, 0, 0);
            tally_eq(&tsl, nsa_rule_window_hi(t, 0, 1, nk), chi, "slc hi", t, nk, 0, 0);
            tally_eq(&tsl, nsa_rule_window_hi32((int32_t)t, 0, 1, (int32_t)nk), chi, "slc hi32", t, nk, 0, 0);
        }
    tally_done(&tr, "range.c window bounds");
    tally_done(&te, "attn_ext.c window bounds");
    tally_done(&tx, "attention x_range");
    tally_done(&tc, "mask.cuh window rule_bounds");
    tally_done(&t32, "int32 window bounds");
    tally_done(&tcl, "window clamp and the spec's window");
    tally_done(&tsl, "mask.cuh selected rule_bounds");
}

/* The queries that see a key range: the bisections of range.c, attn_ext.c and attn/dkdv_tasks.cuh
 * and attention/kernels.cuh's closed form against nsa_rule_window_q_first / _q_last. */
static void test_window_queries(void)
{
    int64_t W[32];
    const int nw = window_grid(W);
    tally tr = {0}, te = {0}, tk_ = {0}, tx = {0};
    for (int causal = 0; causal <= 1; causal++)
        for (int a = 0; a < nw; a++)
            for (int b = 0; b < nw; b++) {
                const int64_t wl = W[a], wr = W[b], wrn = nsa_rule_window_right(wr, causal);
                const old_range_rule orr = {0, 0, 1, wl, wrn, causal};
                const old_ext_opts oe = old_ext_opts_make(causal, wl, wr);
                const old_xparams xp = {causal, wl, wrn};
                for (int k = 0; k < NQK; k++) {
                    const int64_t tq = QK[k][0], tk = QK[k][1];
                    const old_ext_seq sq = {tq, tk};
                    const old_rule_t cr = {OLD_RULE_WIN, wl, wrn, causal, 0, 0, 0, (int)(tk - tq), (int)tk};
                    for (int64_t c = 0; c < tk; c++) {
                        const int64_t f = nsa_rule_window_q_first(c, wrn, causal, tq, tk);
                        const int64_t l = nsa_rule_window_q_last(c, wl, tq, tk);
                        if (tq == tk) {
                            tally_eq(&tr, f, old_first_query_reaching(&orr, tq, tk, c), "range first", c, wl, wr,
                                     causal);
                            tally_eq(&tr, l, old_last_query_starting_by(&orr, tq, tk, c), "range last", c, wl, wr,
                                     causal);
                        }
                        tally_eq(&te, f, old_ext_first_reaching(&oe, &sq, c), "ext first", c, wl, wr, causal);
                        tally_eq(&te, l, old_ext_last_starting(&oe, &sq, c), "ext last", c, wl, wr, causal);
                        tally_eq(&tk_, f, old_kt_first_reaching(&cr, (int)tq, (int)tk, (int)c), "kt first", c, wl, wr,
                                 causal);
                        tally_eq(&tk_, l, old_kt_last_starting(&cr, (int)tq, (int)tk, (int)c), "kt last", c, wl, wr,
                                 causal);
                    }
                    /* attention/kernels.cuh's key tiles of 64 (the same queries, read as a range) */
                    for (int64_t j0 = 0; j0 < tk; j0 += 64) {
                        const int64_t nkeys = tk - j0 < 64 ? tk - j0 : 64;
                        int64_t qmin, qmax;
                        old_x_key_queries(&xp, (int)tq, (int)tk, (int)j0, (int)nkeys, &qmin, &qmax);
                        const int64_t f = nsa_rule_window_q_first(j0, wrn, causal, tq, tk);
                        const int64_t l = nsa_rule_window_q_last(j0 + nkeys - 1, wl, tq, tk);
                        const int same = (qmax < qmin && l < f) || (qmin == f && qmax == l);
                        tally_eq(&tx, same, 1, "xattn key queries", j0, wl, wr, causal);
                    }
                }
            }
    tally_done(&tr, "range.c key queries");
    tally_done(&te, "attn_ext.c key queries");
    tally_done(&tk_, "dkdv_tasks key queries");
    tally_done(&tx, "attention key queries");
}

/* Every valid (l, d, l'): d | l, d | l', l <= l' (l' up to 128). @return how many. */
static int valid_configs(int (*cfg)[3], int cap)
{
    int n = 0;
    for (int l = 1; l <= 64; l++)
        for (int d = 1; d <= l; d++) {
            if (l % d) continue;
            for (int lp = l; lp <= 128; lp += d)
                if (lp % d == 0 && n < cap) cfg[n][0] = l, cfg[n][1] = d, cfg[n][2] = lp, n++;
        }
    return n;
}

enum { MAX_CFG = 20000 };

/* Compressed visibility and the block arithmetic of the selection (spec 2, 3). */
static void test_cmp_and_selection(void)
{
    static int cfg[MAX_CFG][3];
    const int ncfg = valid_configs(cfg, MAX_CFG);
    CHECK(ncfg < MAX_CFG);
    tally tv = {0}, tb = {0}, tcur = {0}, tov = {0}, tcu = {0}, tq = {0}, tat = {0}, tnc = {0};
    const int64_t lens[] = {0, 1, 37, 64, 299, 300};
    for (int c = 0; c < ncfg; c++) {
        const int64_t l = cfg[c][0], d = cfg[c][1], lp = cfg[c][2];
        const old_range_rule orr = {1, l, d, -1, -1, 1};
        const old_rule_t cr = {OLD_RULE_CMP, 0, 0, 0, (int)l, (int)d, 0, 0, 0};
        for (int li = 0; li < 6 && lp == l; li++) { /* what depends on (l, d) alone: once */
            const int64_t len = lens[li], nc = nsa_rule_num_cmp(len, l, d);
            tally_eq(&tnc, nc, old_cu_ncmp((int)len, (int)l, (int)d), "Nc", len, l, d, 0);
            /* rows of the compressed rule */
            for (int64_t t = 0; t < len; t++) {
                int64_t lo, hi;
                old_rule_bounds(&orr, t, nc, &lo, &hi);
                tally_eq(&tv, nsa_rule_cmp_visible_cap(t, l, d, nc) - 1, hi, "cmp hi", t, l, d, nc);
                tally_eq(&tv, 0, lo, "cmp lo", t, l, d, nc);
                tally_eq(&tv, nsa_rule_cmp_visible_cap32((int32_t)t, (int32_t)l, (int32_t)d, (int32_t)nc) - 1, hi,
                         "cmp hi32", t, l, d, nc);
                int clo, chi;
                old_cu_rule_bounds(&cr, (int)t, (int)nc, &clo, &chi);
                tally_eq(&tcu, nsa_rule_cmp_visible_cap(t, l, d, nc) - 1, chi, "cuda cmp hi", t, l, d, nc);
                tally_eq(&tcu, 0, clo, "cuda cmp lo", t, l, d, nc);
            }
            /* the queries that see compressed keys [c0, c1): range.c's dK/dV tiles */
            for (int64_t c0 = 0; c0 < nc; c0++) {
                const int64_t f = nsa_rule_cmp_last_token(c0, l, d);
                tally_eq(&tq, f < len ? f : len, old_first_query_reaching(&orr, len, nc, c0), "cmp first", c0, l, d,
                         len);
                tally_eq(&tq, len - 1, old_last_query_starting_by(&orr, len, nc, c0), "cmp last", c0, l, d, len);
                tally_eq(&tq, f < len ? f : len, old_kt_first_reaching(&cr, (int)len, (int)nc, (int)c0), "kt cmp first",
                         c0, l, d, len);
            }
            /* the compressed blocks covering each token: compress/compress.cu's backward */
            for (int64_t x = 0; x < len; x++) {
                int ilo, ihi;
                old_compress_bwd_blocks((int)x, (int)l, (int)d, (int)nc, &ilo, &ihi);
                const int64_t a = nsa_rule_cmp_first_at(x, l, d), b0 = nsa_rule_cmp_last_at(x, d);
                tally_eq(&tat, a, ilo, "first_at", x, l, d, len);
                tally_eq(&tat, b0 < nc - 1 ? b0 : nc - 1, ihi, "last_at", x, l, d, len);
                for (int64_t i = a - 1; i <= b0 + 1; i++) /* exactly the blocks [i*d, i*d + l) holding x */
                    tally_eq(&tat, i >= a && i <= b0, i >= 0 && i * d <= x && x < i * d + l, "covers", x, i, l, d);
            }
        }
        /* per position t of a 300-token sequence: visibility, current block, overlaps */
        const int64_t T = 300, nc = nsa_rule_num_cmp(T, l, d);
        for (int64_t t = 0; t < T; t++) {
            if (lp == l) {
                const int64_t nv = nsa_rule_cmp_visible_cap(t, l, d, nc);
                tally_eq(&tv, nv, old_select_nv(t, l, d, nc), "select nv", t, l, d, 0);
                tally_eq(&tv, nsa_rule_cmp_visible32((int32_t)t, (int32_t)l, (int32_t)d),
                         old_cu_nv((int)t, (int)l, (int)d), "nv32", t, l, d, 0);
                tally_eq(&tv, nsa_rule_cmp_visible(t, l, d), old_cu_nv((int)t, (int)l, (int)d), "nv", t, l, d, 0);
                for (int64_t i = 0; i <= nc; i++) /* spec 2: block i visible iff i*d + l - 1 <= t */
                    tally_eq(&tb, i < nsa_rule_cmp_visible(t, l, d), nsa_rule_cmp_last_token(i, l, d) <= t, "visible",
                             t, i, l, d);
            }
            const int64_t cur = nsa_rule_slc_of(t, lp);
            tally_eq(&tcur, cur, old_select_cur(t, lp), "cur", t, lp, 0, 0);
            tally_eq(&tcur, nsa_rule_slc_of32((int32_t)t, (int32_t)lp), old_select_cur(t, lp), "cur32", t, lp, 0, 0);
        }
        const int64_t cur_max = nsa_rule_slc_of(T - 1, lp);
        for (int64_t j = 0; j <= cur_max; j++) {
            const int64_t i0 = nsa_rule_slc_first_cmp(j, l, d, lp), i1 = nsa_rule_slc_last_cmp(j, d, lp);
            /* range.c select_position, at every visible count */
            for (int64_t nv = 0; nv <= nc; nv += (nc > 40 ? 7 : 1)) {
                int64_t o0, o1;
                old_select_overlapping(j, l, d, lp, nv, &o0, &o1);
                tally_eq(&tov, i0, o0, "slc_first_cmp", j, l, d, lp);
                tally_eq(&tov, i1 > nv - 1 ? nv - 1 : i1, o1, "slc_last_cmp", j, l, d, lp);
            }
            tally_eq(&tov, nsa_rule_slc_first_cmp32((int32_t)j, (int32_t)l, (int32_t)d, (int32_t)lp), i0, "first32", j,
                     l, d, lp);
            tally_eq(&tov, nsa_rule_slc_last_cmp32((int32_t)j, (int32_t)d, (int32_t)lp), i1, "last32", j, l, d, lp);
            /* selection/ampere.cuh / hopper.cuh: one block, and runs of JC blocks capped at nv_max */
            int ia, ib;
            old_sel_block((int)j, (int)lp, (int)l, (int)d, &ia, &ib);
            tally_eq(&tcu, i0, ia, "sel block ia", j, l, d, lp);
            tally_eq(&tcu, i1 + 1, ib, "sel block ib", j, l, d, lp);
            for (int JC = 1; JC <= 64; JC *= 4) {
                int iA, iB;
                old_sel_range((int)j, JC, (int)lp, (int)l, (int)d, (int)nc, &iA, &iB);
                const int64_t e = nsa_rule_slc_last_cmp(j + JC - 1, d, lp) + 1;
                tally_eq(&tcu, i0, iA, "SEL_RANGE iA", j, JC, l, d);
                tally_eq(&tcu, e < nc ? e : nc, iB, "SEL_RANGE iB", j, JC, l, d);
            }
            /* the overlaps: exactly the blocks [i0, i1] share tokens with block j */
            for (int64_t i = i0 - 2; i <= i1 + 2; i++) {
                if (i < 0) continue;
                const int64_t ov = nsa_rule_overlap(i, j, l, d, lp);
                tally_eq(&tov, ov > 0, i >= i0 && i <= i1, "overlap range", i, j, l, d);
                tally_eq(&tov, nsa_rule_overlap32((int32_t)i, (int32_t)j, (int32_t)l, (int32_t)d, (int32_t)lp), ov,
                         "overlap32", i, j, l, d);
                if (i >= i0 && i <= i1) {
                    tally_eq(&tcu, ov, old_sel_overlap((int)i, (int)j, (int)lp, (int)l, (int)d), "sel overlap", i, j, l,
                             d);
                    tally_eq(&tcu, ov, old_swg_overlap((int)i, (int)j, (int)lp, (int)l, (int)d), "swg overlap", i, j, l,
                             d);
                }
            }
        }
    }
    tally_done(&tnc, "Nc");
    tally_done(&tv, "compressed visibility");
    tally_done(&tb, "spec 2 visibility");
    tally_done(&tq, "queries of compressed keys");
    tally_done(&tat, "compressed blocks of a token");
    tally_done(&tcur, "current selection block");
    tally_done(&tov, "compressed blocks of a selection block");
    tally_done(&tcu, "CUDA compressed and selection forms");
}

/* Selected attention's keys (spec 4) and the small rules of ops.c. */
static void test_selected_keys(void)
{
    tally ts = {0}, tc = {0}, tm = {0};
    const int64_t lens[] = {0, 1, 2, 63, 64, 65, 130, 300};
    for (int64_t lp = 1; lp <= 130; lp++)
        for (int li = 0; li < 8; li++) {
            const int64_t len = lens[li], nb = nsa_rule_num_slc(len, lp);
            tally_eq(&tc, nb, old_cu_nb(len, lp), "nb", len, lp, 0, 0);
            for (int64_t j = 0; j < nb; j++) {
                int64_t c0, c1;
                old_slc_keys(j, lp, len, &c0, &c1);
                tally_eq(&ts, nsa_rule_slc_lo(j, lp), c0, "slc lo", j, lp, len, 0);
                tally_eq(&ts, nsa_rule_slc_end(j, lp, len), c1, "slc end", j, lp, len, 0);
                tally_eq(&tc, nsa_rule_slc_end32((int32_t)j, (int32_t)lp, (int32_t)len),
                         old_cu_bend((int)j, (int)lp, (int)len), "bend", j, lp, len, 0);
                for (int64_t t = 0; t < len; t++) {
                    const int vis = nsa_rule_slc_visible(j, t, lp);
                    tally_eq(&ts, !vis, old_slc_skipped(j, lp, t), "slc visible", j, t, lp, len);
                    tally_eq(&tc, !vis, old_cu_unusable((int32_t)j, lp, t), "usable", j, t, lp, len);
                    tally_eq(&tc, !vis, old_cu_unusable_div((int)j, (int)t, (int)lp), "usable div", j, t, lp, len);
                    /* the keys query t reads of block j: [c0, c1) cut causally at t */
                    const int64_t hi = nsa_rule_slc_hi(j, t, lp, len);
                    tally_eq(&ts, hi, c1 - 1 < t ? c1 - 1 : t, "slc hi", j, t, lp, len);
                    tally_eq(&ts, nsa_rule_slc_hi32((int32_t)j, (int32_t)t, (int32_t)lp, (int32_t)len), hi, "slc hi32",
                             j, t, lp, len);
                    tally_eq(&ts, hi >= c0, vis, "slc hi vs visible", j, t, lp, len);
                }
            }
        }
    for (int64_t w = 1; w <= 1024; w++) {
        tally_eq(&tm, nsa_rule_swa_left(w), old_swa_wl(w), "swa left", w, 0, 0, 0);
        for (int64_t t = 0; t < 40; t++) /* spec 5: keys [max(0, t - w + 1), t] */
            tally_eq(&tm, nsa_rule_window_lo(t, nsa_rule_swa_left(w)), t - w + 1 > 0 ? t - w + 1 : 0, "swa lo", t, w, 0,
                     0);
    }
    for (int causal = 0; causal <= 1; causal++)
        for (int64_t wr = -1; wr <= 600; wr++)
            tally_eq(&tm, nsa_rule_window_right(wr, causal), old_attention_wr(causal, wr), "window right", wr, causal,
                     0, 0);
    for (int k = 0; k < NQK; k++) /* ops.cu: the rule's shift Tk - T */
        tally_eq(&tm, nsa_rule_diag(0, QK[k][0], QK[k][1]), QK[k][1] - QK[k][0], "shift", QK[k][0], QK[k][1], 0, 0);
    tally_done(&ts, "selected keys");
    tally_done(&tc, "CUDA selected keys");
    tally_done(&tm, "sliding window and window_right");
}

/* ---- huge windows through the API: a window wider than the sequence is unbounded, and
 * nothing like t + window_right may overflow on the way (INT64_MAX once emptied every row) */

static nsa_tensor rules_tensor(int rank, int64_t d0, int64_t d1, int64_t d2, int64_t d3, test_rng *r)
{
    const int64_t shape[4] = {d0, d1, d2, d3};
    int64_t n = 1;
    for (int i = 0; i < rank; i++) n *= shape[i];
    float *x = (float *)calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    for (int64_t i = 0; x && r && i < n; i++) x[i] = (float)rng_normal(r);
    return nsa_tensor_make(x, NSA_DTYPE_F32, rank, shape);
}

/* o and lse of one attention call; NULL on failure */
static float *rules_attention(nsa_context *ctx, int64_t Tq, int64_t Tk, int causal, int64_t wl, int64_t wr)
{
    test_rng r = {7};
    nsa_attention_args a;
    memset(&a, 0, sizeof a);
    a.q = rules_tensor(4, 1, Tq, 2, 16, &r);
    a.k = rules_tensor(4, 1, Tk, 1, 16, &r);
    a.v = rules_tensor(4, 1, Tk, 1, 16, &r);
    a.o = rules_tensor(4, 1, Tq, 2, 16, NULL);
    a.lse = rules_tensor(3, 1, Tq, 2, 1, NULL);
    a.causal = causal, a.window_left = wl, a.window_right = wr;
    size_t bytes = 0;
    nsa_status st = nsa_attention_workspace_size(ctx, &a, &bytes);
    void *ws = malloc(bytes ? bytes : 1);
    if (st == NSA_STATUS_SUCCESS) st = nsa_attention(ctx, &a, ws, bytes);
    float *out = (float *)malloc((size_t)(Tq * 2 * 17) * sizeof(float));
    if (out && a.o.data && a.lse.data) {
        memcpy(out, a.o.data, (size_t)(Tq * 2 * 16) * sizeof(float));
        memcpy(out + Tq * 2 * 16, a.lse.data, (size_t)(Tq * 2) * sizeof(float));
    }
    free(ws), free(a.q.data), free(a.k.data), free(a.v.data), free(a.o.data), free(a.lse.data);
    if (st != NSA_STATUS_SUCCESS) {
        free(out);
        return NULL;
    }
    return out;
}

static void test_huge_windows(void)
{
    nsa_context *ctx = NULL;
    nsa_context_desc desc = {.backend = NSA_BACKEND_CPU};
    CHECK_STATUS(nsa_context_create(&ctx, &desc), NSA_STATUS_SUCCESS);
    const int64_t QKs[][2] = {{40, 40}, {30, 70}, {70, 30}}; /* the fast path, then the general one */
    const int64_t huge[] = {INT64_MAX, INT64_MAX - 1, INT64_MAX / 2, 1000};
    for (int k = 0; k < 3; k++) {
        const int64_t tq = QKs[k][0], tk = QKs[k][1];
        float *want = rules_attention(ctx, tq, tk, 0, -1, -1);
        CHECK(want != NULL);
        for (int h = 0; h < 4 && want; h++)
            for (int side = 0; side < 3; side++) {
                const int64_t wl = side != 1 ? huge[h] : -1, wr = side != 0 ? huge[h] : -1;
                float *got = rules_attention(ctx, tq, tk, 0, wl, wr);
                CHECK_MSG(got && !memcmp(got, want, (size_t)(tq * 2 * 17) * sizeof(float)),
                          "a window wider than the sequence must read as unbounded");
                free(got);
            }
        free(want);
    }
    nsa_context_destroy(ctx);
}

/* The 32-bit compressed-block count the kernels use per sequence against the int64 one. */
static void test_num_cmp32(void)
{
    tally t = {0, 0, ""};
    for (int32_t T = 0; T < 3000; T++)
        for (int32_t l = 1; l <= 64; l++)
            for (int32_t d = 1; d <= l; d++)
                if (l % d == 0) tally_eq(&t, nsa_rule_num_cmp32(T, l, d), nsa_rule_num_cmp(T, l, d), "num_cmp32", T, l, d, 0);
    static const int32_t big[] = {65536, 131072, 1 << 20, (1 << 30) + 7, INT32_MAX - 1, INT32_MAX};
    for (int i = 0; i < 6; i++)
        for (int32_t l = 1; l <= 128; l *= 2)
            tally_eq(&t, nsa_rule_num_cmp32(big[i], l, l / 2 ? l / 2 : 1), nsa_rule_num_cmp(big[i], l, l / 2 ? l / 2 : 1),
                     "num_cmp32", big[i], l, l / 2, 0);
    tally_done(&t, "num_cmp32");
}

void test_rules_all(void)
{
    test_num_cmp32();
    test_window_bounds();
    test_window_queries();
    test_cmp_and_selection();
    test_selected_keys();
    test_huge_windows();
}
