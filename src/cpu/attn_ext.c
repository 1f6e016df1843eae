/* attn_ext.c -- the attention op (nsa.h section 5) with every option: Tq != Tk (bottom-right
 * aligned), separate q / k packings, logit softcap, sinks, segment ids, additive bias, boolean
 * mask, Philox dropout. The fast window path (range.c) keeps the calls without them.
 *
 * Same tiling as range.c, with the scores transformed per element after the Q K^T product:
 *   forward  tasks (sequence, kv head, query tile): online softmax over key blocks of EXT_KB;
 *   dQ       tasks (sequence, kv head, query tile);
 *   dK, dV   tasks (sequence, kv head, key block), visiting every query tile that may see it;
 *   dbias    tasks (bias row group, bias head, query tile), summing the broadcast members in
 *            a fixed order (no atomics: bitwise deterministic whatever the thread count);
 *   dsinks   one sum per query head.
 * Scratch is O(tile x EXT_KB) per thread: no score matrix is ever materialised. */
#include "common.h"
#include "../philox.h"
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { EXT_KB = 64, EXT_ROWS = 64 };

/* ---- the call's options, resolved once ---------------------------------------------- */
typedef struct ext_opts {
    const nsa_problem *p;
    const nsa_attention_args *a;
    int causal;
    int64_t wl, wr;
    float cap;          /* softcap, 0 = off */
    const nsa_tensor *bias, *mask, *qseg, *kseg, *sinks; /* NULL = absent */
    int dropout;
    uint32_t thresh;    /* keep iff word >= thresh */
    float rp;           /* 1 / (1 - p) */
} ext_opts;

static const nsa_tensor *opt(const nsa_tensor *t) { return nsa_present(t) ? t : NULL; }

static ext_opts ext_opts_make(const nsa_problem *p, const nsa_attention_args *a)
{
    ext_opts o;
    memset(&o, 0, sizeof o);
    o.p = p;
    o.a = a;
    o.causal = a->causal != 0;
    o.wl = a->window_left;
    o.wr = nsa_rule_window_right(a->window_right, a->causal);
    o.cap = a->softcap;
    o.bias = opt(&a->bias);
    o.mask = opt(&a->mask);
    o.qseg = opt(&a->q_segment_ids);
    o.kseg = opt(&a->k_segment_ids);
    o.sinks = opt(&a->sinks);
    o.dropout = a->dropout_p > 0.0f;
    o.thresh = nsa_dropout_threshold(a->dropout_p);
    o.rp = 1.0f / (1.0f - a->dropout_p);
    return o;
}

/* ---- sequences: batch index, first packed query / key row, lengths ------------------- */
typedef struct ext_seq {
    int64_t b, q0, qlen, k0, klen;
} ext_seq;

static ext_seq ext_seq_get(const nsa_problem *p, int64_t s)
{
    ext_seq q;
    if (p->cu_seqlens_q) {
        q.b = 0;
        q.q0 = p->cu_seqlens_q[s], q.qlen = p->cu_seqlens_q[s + 1] - q.q0;
        q.k0 = p->cu_seqlens_k[s], q.klen = p->cu_seqlens_k[s + 1] - q.k0;
    } else if (p->cu_seqlens) {
        q.b = 0;
        q.q0 = q.k0 = p->cu_seqlens[s];
        q.qlen = q.klen = p->cu_seqlens[s + 1] - p->cu_seqlens[s];
    } else {
        q.b = s;
        q.q0 = q.k0 = 0;
        q.qlen = p->T;
        q.klen = p->Tk;
    }
    return q;
}

/* Window bounds of local query i, [lo, hi] in local keys (empty when hi < lo); both never
 * decrease in i. The diagonal is bottom-right aligned (nsa_rule_diag). */
static void ext_bounds(const ext_opts *o, const ext_seq *sq, int64_t i, int64_t *lo, int64_t *hi)
{
    const int64_t dg = nsa_rule_diag(i, sq->qlen, sq->klen);
    *lo = nsa_rule_window_lo(dg, o->wl);
    *hi = nsa_rule_window_hi(dg, o->wr, o->causal, sq->klen);
}

/* Query tiles: bq positions x G heads = at most EXT_ROWS rows (G rows when G > EXT_ROWS). */
static int64_t ext_bq(const nsa_problem *p)
{
    const int64_t bq = EXT_ROWS / p->G;
    return bq < 1 ? 1 : bq;
}

/* ---- per-thread scratch ----------------------------------------------------------------- */
typedef struct ext_scratch {
    core_tile t;         /* Q, lo/hi, m/l, O, S (scores / P), xt; backward: dO, lse, Drow, dQ */
    float *dS;           /* [R, EXT_KB] dP, then dS */
    float *dcap;         /* [R, EXT_KB] softcap derivative 1 - tanh^2 */
    float *row;          /* [EXT_KB] a bias row segment */
    float *tmp;          /* [DV] */
    float *lse_rows;     /* [R] */
    float *acc;          /* [R, EXT_KB] dbias accumulator */
    int64_t *rb, *rhq, *ri; /* [R] per row: batch, query head, packed query row */
    int32_t *rseg;       /* [R] per row: query segment id */
    unsigned char *vis;  /* [R, EXT_KB] 1 = the pair is visible (window, segments, mask, bias > -inf):
                            kept apart from the score, since a visible score may itself be -inf */
} ext_scratch;

static size_t ext_scratch_carve(ext_scratch *x, ws_arena *a, const nsa_problem *p)
{
    const int64_t R = ext_bq(p) * p->G; /* <= max(EXT_ROWS, G): G = HQ / H fits */
    const size_t r = nsa_size_of(R);
    core_tile_alloc(&x->t, a, R, p->DK, p->DV, EXT_KB, 1);
    x->dS = (float *)ws_take_2d(a, r, EXT_KB, sizeof(float));
    x->dcap = (float *)ws_take_2d(a, r, EXT_KB, sizeof(float));
    x->row = (float *)ws_take_n(a, EXT_KB, sizeof(float));
    x->tmp = (float *)ws_take_n(a, nsa_size_of(p->DV), sizeof(float));
    x->lse_rows = (float *)ws_take_n(a, r, sizeof(float));
    x->acc = (float *)ws_take_2d(a, r, EXT_KB, sizeof(float));
    x->rb = (int64_t *)ws_take_n(a, r, sizeof(int64_t));
    x->rhq = (int64_t *)ws_take_n(a, r, sizeof(int64_t));
    x->ri = (int64_t *)ws_take_n(a, r, sizeof(int64_t));
    x->rseg = (int32_t *)ws_take_n(a, r, sizeof(int32_t));
    x->vis = (unsigned char *)ws_take_2d(a, r, EXT_KB, 1);
    return ws_region_bytes(a);
}

static size_t ext_thread_bytes(const nsa_problem *p)
{
    ws_arena probe = {NULL, 0};
    ext_scratch x;
    return ext_scratch_carve(&x, &probe, p);
}

/* ---- tasks --------------------------------------------------------------------------- */
/* first[s] = first task of unit s; units are sequences (or bias row groups), `heads` tasks
 * per tile. Reuses cpu_tasks_decode. */
static void ext_tasks(cpu_tasks *tk, ws_arena *a, int64_t units, int64_t heads, const int64_t *tiles)
{
    tk->H = heads;
    tk->nseq = units;
    tk->first = (int64_t *)ws_take_n(a, nsa_size_add(nsa_size_of(units), 1), sizeof(int64_t));
    tk->total = 0;
    if (!tk->first || !tiles) return;
    tk->first[0] = 0;
    for (int64_t s = 0; s < units; s++) tk->first[s + 1] = tk->first[s] + heads * tiles[s];
    tk->total = tk->first[units];
}

static int64_t *ext_tile_counts(ws_arena *a, const nsa_problem *p, int keys)
{
    int64_t *n = (int64_t *)ws_take_n(a, nsa_size_of(p->num_seqs > 0 ? p->num_seqs : 1), sizeof(int64_t));
    if (!n) return NULL;
    const int64_t bq = ext_bq(p);
    for (int64_t s = 0; s < p->num_seqs; s++) {
        const ext_seq sq = ext_seq_get(p, s);
        n[s] = keys ? (sq.klen + EXT_KB - 1) / EXT_KB : (sq.qlen + bq - 1) / bq;
    }
    return n;
}

/* One task of a (sequence, kv head) tiling (forward, dQ, dK/dV): its sequence, kv head h,
 * tile index, and the head's K / V rows of the sequence (row 0 at element row `off`). */
typedef struct ext_task {
    ext_seq sq;
    int64_t h, tile, off;
    const float *K, *V;
} ext_task;

static ext_task ext_task_open(const nsa_problem *p, const cpu_tasks *tk, int64_t task, const float *Kp,
                              const float *Vp)
{
    ext_task t;
    int64_t s;
    cpu_tasks_decode(tk, task, &s, &t.h, &t.tile);
    t.sq = ext_seq_get(p, s);
    t.off = (t.sq.b * p->H + t.h) * p->Tk + t.sq.k0;
    t.K = Kp + t.off * p->DK, t.V = Vp + t.off * p->DV;
    return t;
}

/* ---- rows ------------------------------------------------------------------------------ */
/* Rows r = i * G + g of positions [t0, t0 + nt) of kv head h: Q (scaled), ranges, row ids;
 * with g also dO, lse and D = rowsum(dO * O). @return the union [kmin, kmax] of the ranges. */
static void ext_load_tile(ext_scratch *x, const ext_opts *o, const ext_seq *sq, int64_t h, int64_t t0, int64_t nt,
                          const grad_src *g, int64_t *kmin, int64_t *kmax)
{
    const nsa_problem *p = o->p;
    const int64_t G = p->G;
    core_tile *t = &x->t;
    t->R = (int)(nt * G);
    *kmin = INT64_MAX;
    *kmax = -1;
    for (int64_t i = 0; i < nt; i++) {
        const int64_t row = sq->q0 + t0 + i;
        tile_load_rows(t, (int)(i * G), &o->a->q, p->scale, sq->b, row, h, G, g, x->tmp);
        int64_t lo, hi;
        ext_bounds(o, sq, t0 + i, &lo, &hi);
        const int32_t seg = o->qseg ? *io_i32(o->qseg, sq->b * o->qseg->stride[0] + row * o->qseg->stride[1]) : 0;
        for (int64_t k = 0; k < G; k++) {
            const int r = (int)(i * G + k);
            t->lo[r] = lo, t->hi[r] = hi;
            x->rb[r] = sq->b, x->rhq[r] = h * G + k, x->ri[r] = row, x->rseg[r] = seg;
        }
        if (hi >= lo) {
            *kmin = lo < *kmin ? lo : *kmin;
            *kmax = hi > *kmax ? hi : *kmax;
        }
    }
}

/* Element offset of [b, hq, i, j0] in a [Bx, Hx, Tq, Tk] bias or mask (size-1 dims broadcast). */
static int64_t pair_off(const nsa_tensor *t, int64_t b, int64_t hq, int64_t i, int64_t j0)
{
    return (t->shape[0] == 1 ? 0 : b) * t->stride[0] + (t->shape[1] == 1 ? 0 : hq) * t->stride[1] +
           i * t->stride[2] + j0 * t->stride[3];
}

/* src/philox.h's words for the EXT_GROUPS consecutive counters c0 = g0, g0 + 1, ... (same c1..c3
 * and key), lane by lane: the same arithmetic as nsa_philox4x32_10, in a loop the compiler
 * vectorises (a block of EXT_KB keys needs at most EXT_KB / 4 + 1 groups). */
enum { EXT_GROUPS = 32 };

static void ext_philox_groups(uint32_t g0, const uint32_t c[4], uint32_t k0, uint32_t k1,
                              uint32_t out[4][EXT_GROUPS])
{
#pragma omp simd
    for (int g = 0; g < EXT_GROUPS; g++) {
        uint32_t x0 = g0 + (uint32_t)g, x1 = c[1], x2 = c[2], x3 = c[3], a = k0, b = k1;
        for (int round = 0; round < 10; round++) {
            if (round > 0) a += 0x9E3779B9u, b += 0xBB67AE85u;
            const uint64_t p0 = (uint64_t)0xD2511F53u * x0, p1 = (uint64_t)0xCD9E8D57u * x2;
            const uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1 ^ a, y2 = (uint32_t)(p0 >> 32) ^ x3 ^ b;
            x1 = (uint32_t)p1, x3 = (uint32_t)p0, x0 = y0, x2 = y2;
        }
        out[0][g] = x0, out[1][g] = x1, out[2][g] = x2, out[3][g] = x3;
    }
}

/* keep[j - j0] = dropout keep factor (0 or 1 / (1 - p)) of keys [j0, j1) (packed) of row r,
 * j1 - j0 <= EXT_KB; the counter layout of nsa_dropout_words (nsa.h). */
static void ext_keep(const ext_opts *o, const ext_scratch *x, int r, int64_t j0, int64_t j1, float *keep)
{
    const uint64_t seed = o->a->dropout_seed;
    const uint64_t xo = o->a->dropout_offset + (uint64_t)(x->rb[r] * o->p->HQ + x->rhq[r]);
    const uint32_t c[4] = {0, (uint32_t)x->ri[r], (uint32_t)xo, (uint32_t)(xo >> 32)};
    uint32_t w[4][EXT_GROUPS];
    const int64_t g0 = j0 >> 2;
    ext_philox_groups((uint32_t)g0, c, (uint32_t)seed, (uint32_t)(seed >> 32), w);
    for (int64_t j = j0; j < j1; j++) keep[j - j0] = w[j & 3][(j >> 2) - g0] >= o->thresh ? o->rp : 0.0f;
}

/* Scores of keys [c0, c1) (local to the sequence) for every row of the tile, in S with row
 * stride EXT_KB: s = cap(Q.K) + bias on visible pairs, -inf elsewhere, and the visibility in
 * x->vis; with a softcap, dcap gets its derivative 1 - tanh^2. */
static void ext_scores(ext_scratch *x, const ext_opts *o, const ext_seq *sq, const float *K, int64_t c0, int64_t c1)
{
    core_tile *t = &x->t;
    const int64_t n = c1 - c0;
    core_scores(t->Q, t->R, t->DK, K, c0, c1, t->S, EXT_KB, t->xt);
    for (int r = 0; r < t->R; r++) {
        float *s = t->S + (size_t)r * EXT_KB, *dc = x->dcap + (size_t)r * EXT_KB;
        unsigned char *vis = x->vis + (size_t)r * EXT_KB;
        /* the window range, then the per-element masks */
        const int64_t a = t->lo[r] > c0 ? t->lo[r] - c0 : 0, b = t->hi[r] + 1 < c1 ? t->hi[r] + 1 - c0 : n;
        for (int64_t c = 0; c < n; c++) vis[c] = c >= a && c < b;
        if (o->cap > 0.0f) core_softcap_row(s, dc, n, o->cap);
        if (o->bias) {
            io_load(o->bias, pair_off(o->bias, x->rb[r], x->rhq[r], x->ri[r], sq->k0 + c0), n, x->row);
#pragma omp simd
            for (int64_t c = 0; c < n; c++) s[c] += x->row[c];
            for (int64_t c = 0; c < n; c++) vis[c] &= x->row[c] != -INFINITY; /* a -inf bias masks */
        }
        if (o->kseg) {
            const int32_t *ks = io_i32(o->kseg, x->rb[r] * o->kseg->stride[0] + (sq->k0 + c0) * o->kseg->stride[1]);
            const int64_t st = o->kseg->stride[1];
            for (int64_t c = 0; c < n; c++) vis[c] &= ks[c * st] == x->rseg[r];
        }
        if (o->mask) {
            const uint8_t *m = (const uint8_t *)o->mask->data + pair_off(o->mask, x->rb[r], x->rhq[r], x->ri[r], sq->k0 + c0);
            for (int64_t c = 0; c < n; c++) vis[c] &= m[c] != 0;
        }
        for (int64_t c = 0; c < n; c++)
            if (!vis[c]) s[c] = -INFINITY; /* out of the row max */
    }
}

/* ---- forward -------------------------------------------------------------------------- */

size_t ext_fwd_ws(const nsa_context *ctx, const nsa_problem *p)
{
    ws_arena a = {NULL, 0};
    cpu_tasks tk;
    ext_tile_counts(&a, p, 0);
    ext_tasks(&tk, &a, p->num_seqs, p->H, NULL);
    ws_take_threads(&a, ctx, ext_thread_bytes(p));
    return nsa_size_add(a.used, 64);
}

/* Online softmax over one block: S holds scores (-inf = invisible); afterwards it holds the
 * (dropped) weights that multiply V. */
static void ext_softmax_block(ext_scratch *x, const ext_opts *o, const ext_seq *sq, int64_t c0, int64_t c1)
{
    core_tile *t = &x->t;
    const int64_t n = c1 - c0;
    for (int r = 0; r < t->R; r++) {
        float *s = t->S + (size_t)r * EXT_KB, mx = t->m[r];
        const unsigned char *vis = x->vis + (size_t)r * EXT_KB;
        int visible = 0;
#pragma omp simd reduction(max : mx) reduction(| : visible)
        for (int64_t c = 0; c < n; c++) {
            mx = s[c] > mx ? s[c] : mx;
            visible |= vis[c];
        }
        if (!visible) { /* nothing visible in this block */
            core_fill_hidden(s, n);
            continue;
        }
        /* Visible scores that are all NaN or -inf leave the max at -inf (a row that has seen no
         * finite score yet). Dense softmax: a NaN makes the row NaN. Each -inf key has weight
         * exp(-inf - max) = 0 once a later block (or a sink) brings a finite max, a weight that
         * still multiplies its v (+0 here: visible, so 0 * inf stays NaN); if none comes, the
         * row is exp(-inf - -inf) = NaN without a sink (ninf, ext_finish_rows). */
        if (mx == -INFINITY) {
            int any_nan = 0;
            for (int64_t c = 0; c < n; c++) any_nan |= vis[c] && s[c] != s[c];
            if (any_nan) {
                mx = NAN;
            } else {
                for (int64_t c = 0; c < n; c++) s[c] = vis[c] ? 0.0f : -0.0f;
                t->ninf[r] = 1;
                continue;
            }
        }
        const float alpha = t->m[r] == -INFINITY ? 0.0f : core_exp(t->m[r] - mx);
        const float sum = core_exp_row_masked(s, vis, n, mx);
        t->m[r] = mx;
        t->l[r] = t->l[r] * alpha + sum;
        if (alpha != 1.0f) {
            float *orow = t->O + (size_t)r * t->DV;
            for (int d = 0; d < t->DV; d++) orow[d] *= alpha;
        }
        if (o->dropout) { /* l keeps the undropped sum: lse is that of the undropped softmax */
            ext_keep(o, x, r, sq->k0 + c0, sq->k0 + c1, x->row);
            for (int64_t c = 0; c < n; c++) s[c] *= x->row[c];
        }
    }
}

/* o = O exp(m - lse), lse = log(l e^m + e^sink); no key and no sink: o = 0, lse = -inf. */
static void ext_finish_rows(ext_scratch *x, const ext_opts *o)
{
    core_tile *t = &x->t;
    for (int r = 0; r < t->R; r++) {
        float *orow = t->O + (size_t)r * t->DV;
        /* l == 0 exactly when the row saw no key or only keys scored -inf (ninf: NaN without a
         * sink); NaN l (a non-finite row) stays NaN */
        const int nan_row = t->l[r] == 0.0f && t->ninf[r] && !o->sinks;
        float lse = t->l[r] != 0.0f ? t->m[r] + logf(t->l[r]) : nan_row ? NAN : -INFINITY;
        if (o->sinks) {
            const float sk = io_get(o->sinks, x->rhq[r] * o->sinks->stride[0]);
            const float mx = lse > sk ? lse : sk;
            if (mx != -INFINITY) lse = mx + logf(expf(lse - mx) + expf(sk - mx)); /* exp(-inf) = 0 */
        }
        x->lse_rows[r] = lse;
        /* a row that saw no key has O exactly 0 (hidden pairs never add); one that saw only
         * weight-0 keys next to a sink may hold 0 * inf = NaN, which w = 0 keeps */
        const float w = t->l[r] != 0.0f ? expf(t->m[r] - lse) : nan_row ? NAN : 0.0f;
        for (int d = 0; d < t->DV; d++) orow[d] *= w;
    }
}

void ext_fwd(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_args *a, const float *Kp,
             const float *Vp, void *ws)
{
    ws_arena ar = {(char *)ws, 0};
    const ext_opts o = ext_opts_make(p, a);
    cpu_tasks tk;
    ext_tasks(&tk, &ar, p->num_seqs, p->H, ext_tile_counts(&ar, p, 0));
    const size_t per = ext_thread_bytes(p);
    char *thread_base = ws_take_threads(&ar, ctx, per);
    const int64_t bq = ext_bq(p), G = p->G;

#pragma omp parallel num_threads(cpu_threads(ctx))
    {
        ws_arena ta = cpu_thread_arena(thread_base, per, cpu_thread_id());
        ext_scratch x;
        ext_scratch_carve(&x, &ta, p);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tk.total; task++) {
            const ext_task tt = ext_task_open(p, &tk, task, Kp, Vp);
            const ext_seq sq = tt.sq;
            const int64_t h = tt.h, t0 = tt.tile * bq, nt = sq.qlen - t0 < bq ? sq.qlen - t0 : bq;
            const float *K = tt.K, *V = tt.V;
            int64_t kmin, kmax;
            ext_load_tile(&x, &o, &sq, h, t0, nt, NULL, &kmin, &kmax);
            core_fwd_begin(&x.t);
            for (int64_t c0 = kmin; kmax >= 0 && c0 <= kmax; c0 += EXT_KB) {
                const int64_t c1 = c0 + EXT_KB < kmax + 1 ? c0 + EXT_KB : kmax + 1;
                ext_scores(&x, &o, &sq, K, c0, c1);
                ext_softmax_block(&x, &o, &sq, c0, c1);
                core_accum(x.t.O, x.t.S, x.t.S, EXT_KB, x.t.R, V + c0 * p->DV, p->DV, c1 - c0);
            }
            ext_finish_rows(&x, &o);
            for (int64_t i = 0; i < nt; i++)
                tile_store_rows(&x.t, (int)(i * G), &a->o, &a->lse, x.lse_rows, sq.b, sq.q0 + t0 + i, h, G);
        }
    }
}

/* ---- backward ------------------------------------------------------------------------- */

/* P = exp(s - lse) in S and dS = P (dP' - D) in x->dS for keys [c0, c1), where dP' is the
 * gradient of the dropped weights (dO . v) times the keep factor. With for_grad_v, S then
 * holds the dropped weights P * keep (what multiplies dO for dV). dS is the gradient of the
 * score after the bias (dbias); with chain_cap it is chained through the softcap too. */
static void ext_grad_block(ext_scratch *x, const ext_opts *o, const ext_seq *sq, const float *K, const float *V,
                           int64_t c0, int64_t c1, int chain_cap, int for_grad_v)
{
    core_tile *t = &x->t;
    const int64_t n = c1 - c0;
    ext_scores(x, o, sq, K, c0, c1);
    core_scores(t->dO, t->R, t->DV, V, c0, c1, x->dS, EXT_KB, t->xt);
    for (int r = 0; r < t->R; r++) {
        float *s = t->S + (size_t)r * EXT_KB, *ds = x->dS + (size_t)r * EXT_KB;
        const float lse = t->lse[r], D = t->Drow[r];
        if (lse == -INFINITY) {
            core_fill_hidden(s, n);
            memset(ds, 0, (size_t)n * sizeof(float));
            continue;
        }
        if (o->dropout) ext_keep(o, x, r, sq->k0 + c0, sq->k0 + c1, x->row);
        else
            for (int64_t c = 0; c < n; c++) x->row[c] = 1.0f;
        core_grad_row_masked(s, ds, x->row, x->vis + (size_t)r * EXT_KB, n, lse, D, for_grad_v);
        if (chain_cap && o->cap > 0.0f) {
            /* hidden pairs keep dS = 0: their cap derivative may be NaN (a NaN score) */
            const float *dc = x->dcap + (size_t)r * EXT_KB;
            const unsigned char *vis = x->vis + (size_t)r * EXT_KB;
            for (int64_t c = 0; c < n; c++) ds[c] = vis[c] ? ds[c] * dc[c] : 0.0f;
        }
    }
}

/* dbias: units are bias row groups. Dense with a batch-broadcast bias (Bb = 1 < B): one group
 * holding every batch (all sequences have the same geometry); else one per sequence. */
typedef struct dbias_plan {
    int64_t units, Hb;
    int all_batches;
} dbias_plan;

static dbias_plan dbias_plan_make(const nsa_problem *p, const nsa_tensor *dbias)
{
    dbias_plan d;
    d.all_batches = !p->cu_seqlens && !p->cu_seqlens_q && dbias->shape[0] == 1 && p->B > 1;
    d.units = d.all_batches ? (p->B > 0 ? 1 : 0) : p->num_seqs;
    d.Hb = dbias->shape[1];
    return d;
}

size_t ext_bwd_ws(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_bwd_args *a)
{
    ws_arena ar = {NULL, 0};
    cpu_tasks tq, tkv, tb;
    ext_tile_counts(&ar, p, 0);
    ext_tile_counts(&ar, p, 1);
    ext_tasks(&tq, &ar, p->num_seqs, p->H, NULL);
    ext_tasks(&tkv, &ar, p->num_seqs, p->H, NULL);
    if (nsa_present(&a->dbias)) {
        const dbias_plan d = dbias_plan_make(p, &a->dbias);
        ext_tile_counts(&ar, p, 0);
        ext_tasks(&tb, &ar, d.units, d.Hb, NULL);
    }
    ws_take_threads(&ar, ctx, ext_thread_bytes(p));
    return nsa_size_add(ar.used, 64);
}

/* Rows of one query head hq: positions [t0, t0 + nt) of sequence sq, with dO, lse, D. */
static void ext_load_head_rows(ext_scratch *x, const ext_opts *o, const ext_seq *sq, int64_t hq, int64_t t0,
                               int64_t nt, const grad_src *g, int64_t *kmin, int64_t *kmax)
{
    const nsa_problem *p = o->p;
    core_tile *t = &x->t;
    t->R = (int)nt;
    *kmin = INT64_MAX;
    *kmax = -1;
    for (int64_t i = 0; i < nt; i++) {
        const int r = (int)i;
        const int64_t row = sq->q0 + t0 + i;
        /* tile_load_rows for a group of one: head hq as "kv head" hq with G = 1 */
        tile_load_rows(t, r, &o->a->q, p->scale, sq->b, row, hq, 1, g, x->tmp);
        int64_t lo, hi;
        ext_bounds(o, sq, t0 + i, &lo, &hi);
        t->lo[r] = lo, t->hi[r] = hi;
        x->rb[r] = sq->b, x->rhq[r] = hq, x->ri[r] = row;
        x->rseg[r] = o->qseg ? *io_i32(o->qseg, sq->b * o->qseg->stride[0] + row * o->qseg->stride[1]) : 0;
        if (hi >= lo) {
            *kmin = lo < *kmin ? lo : *kmin;
            *kmax = hi > *kmax ? hi : *kmax;
        }
    }
}

static void ext_dbias(const nsa_context *ctx, const ext_opts *o, const nsa_attention_bwd_args *a, const float *Kp,
                      const float *Vp, const grad_src *g, ws_arena *ar, size_t per)
{
    const nsa_problem *p = o->p;
    const nsa_tensor *db = &a->dbias;
    const dbias_plan d = dbias_plan_make(p, db);
    const int64_t R = ext_bq(p) * p->G; /* positions per dbias tile: one head at a time */
    int64_t *tiles = (int64_t *)ws_take_n(ar, nsa_size_of(d.units > 0 ? d.units : 1), sizeof(int64_t));
    for (int64_t u = 0; u < d.units; u++) {
        const ext_seq sq = ext_seq_get(p, u);
        tiles[u] = (sq.qlen + R - 1) / R;
    }
    cpu_tasks tk;
    ext_tasks(&tk, ar, d.units, d.Hb, tiles);
    char *thread_base = ws_take_threads(ar, ctx, per);

    /* every element is owed: zero the whole tensor, then fill the visible blocks */
    const int64_t rows = db->shape[0] * db->shape[1] * db->shape[2], Tk = db->shape[3];
#pragma omp parallel num_threads(cpu_threads(ctx))
    {
        ws_arena ta = cpu_thread_arena(thread_base, per, cpu_thread_id());
        ext_scratch x;
        ext_scratch_carve(&x, &ta, p);
        memset(x.row, 0, EXT_KB * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t i = r % db->shape[2], hb = (r / db->shape[2]) % db->shape[1], bb = r / (db->shape[2] * db->shape[1]);
            for (int64_t j0 = 0; j0 < Tk; j0 += EXT_KB)
                io_store(db, bb * db->stride[0] + hb * db->stride[1] + i * db->stride[2] + j0,
                         Tk - j0 < EXT_KB ? Tk - j0 : EXT_KB, x.row);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tk.total; task++) {
            int64_t u, hb, tile, kmin, kmax;
            cpu_tasks_decode(&tk, task, &u, &hb, &tile);
            const ext_seq su = ext_seq_get(p, u);
            const int64_t t0 = tile * R, nt = su.qlen - t0 < R ? su.qlen - t0 : R;
            const int64_t b_first = d.all_batches ? 0 : su.b, b_last = d.all_batches ? p->B - 1 : su.b;
            const int64_t h_first = d.Hb == 1 ? 0 : hb, h_last = d.Hb == 1 ? p->HQ - 1 : hb;
            const int64_t bb = db->shape[0] == 1 ? 0 : su.b;
            /* the tile's key range is the same for every member (same sequence geometry) */
            int64_t klo = INT64_MAX, khi = -1;
            for (int64_t i = 0; i < nt; i++) {
                int64_t lo, hi;
                ext_bounds(o, &su, t0 + i, &lo, &hi);
                if (hi >= lo) klo = lo < klo ? lo : klo, khi = hi > khi ? hi : khi;
            }
            for (int64_t c0 = klo; khi >= 0 && c0 <= khi; c0 += EXT_KB) {
                const int64_t c1 = c0 + EXT_KB < khi + 1 ? c0 + EXT_KB : khi + 1, n = c1 - c0;
                memset(x.acc, 0, (size_t)R * EXT_KB * sizeof(float));
                for (int64_t b = b_first; b <= b_last; b++)
                    for (int64_t hq = h_first; hq <= h_last; hq++) {
                        ext_seq sq = su;
                        sq.b = b;
                        const int64_t off = (b * p->H + hq / p->G) * p->Tk + sq.k0;
                        ext_load_head_rows(&x, o, &sq, hq, t0, nt, g, &kmin, &kmax);
                        ext_grad_block(&x, o, &sq, Kp + off * p->DK, Vp + off * p->DV, c0, c1, 0, 0);
                        for (int64_t i = 0; i < nt; i++)
                            for (int64_t c = 0; c < n; c++) x.acc[i * EXT_KB + c] += x.dS[i * EXT_KB + c];
                    }
                for (int64_t i = 0; i < nt; i++)
                    io_store(db, pair_off(db, bb, hb, su.q0 + t0 + i, su.k0 + c0), n, x.acc + i * EXT_KB);
            }
        }
    }
}

/* dsinks[hq] = -sum over the rows of head hq of exp(sink - lse) * rowsum(dO * O). */
static void ext_dsinks(const nsa_context *ctx, const ext_opts *o, const nsa_attention_bwd_args *a)
{
    const nsa_problem *p = o->p;
    const nsa_tensor *dout = &a->dout, *out = &a->fwd.o, *lse = &a->fwd.lse;
#pragma omp parallel num_threads(cpu_threads(ctx))
    {
        float dO[256], ov[256];
#pragma omp for schedule(static)
        for (int64_t hq = 0; hq < p->HQ; hq++) {
            const float sk = io_get(o->sinks, hq * o->sinks->stride[0]);
            double acc = 0.0;
            for (int64_t b = 0; b < p->B; b++)
                for (int64_t i = 0; i < p->T; i++) {
                    const float l = io_get(lse, io_off(lse, b, i, hq));
                    float D = 0.0f;
                    int seen = 0; /* o is exactly 0 for a row that saw no key: no gradient, even from inf dout */
                    for (int64_t d0 = 0; d0 < p->DV; d0 += 256) {
                        const int64_t n = p->DV - d0 < 256 ? p->DV - d0 : 256;
                        io_load(dout, io_off(dout, b, i, hq) + d0, n, dO);
                        io_load(out, io_off(out, b, i, hq) + d0, n, ov);
                        for (int64_t e = 0; e < n; e++) D += dO[e] * ov[e], seen |= ov[e] != 0.0f;
                    }
                    if (seen) acc += (double)expf(sk - l) * D;
                }
            io_set(&a->dsinks, hq * a->dsinks.stride[0], (float)-acc);
        }
    }
}

void ext_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_bwd_args *a, const float *Kp,
             const float *Vp, float *dq32, float *dKp, float *dVp, void *ws)
{
    ws_arena ar = {(char *)ws, 0};
    const ext_opts o = ext_opts_make(p, &a->fwd);
    cpu_tasks tq, tkv;
    ext_tasks(&tq, &ar, p->num_seqs, p->H, ext_tile_counts(&ar, p, 0));
    ext_tasks(&tkv, &ar, p->num_seqs, p->H, ext_tile_counts(&ar, p, 1));
    const size_t per = ext_thread_bytes(p);
    const grad_src g = {&a->dout, NULL, &a->fwd.o, &a->fwd.lse};
    const int64_t bq = ext_bq(p), G = p->G;
    if (nsa_present(&a->dbias)) {
        ws_arena db = ar; /* its scratch comes after the other passes' (which it does not use) */
        ext_dbias(ctx, &o, a, Kp, Vp, &g, &db, per);
    }
    char *thread_base = ws_take_threads(&ar, ctx, per);

#pragma omp parallel num_threads(cpu_threads(ctx))
    {
        ws_arena ta = cpu_thread_arena(thread_base, per, cpu_thread_id());
        ext_scratch x;
        ext_scratch_carve(&x, &ta, p);
        float *dQbuf = x.t.dQ;

        /* dQ: each task owns its query rows */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tq.total; task++) {
            const ext_task tt = ext_task_open(p, &tq, task, Kp, Vp);
            const ext_seq sq = tt.sq;
            const int64_t h = tt.h, t0 = tt.tile * bq, nt = sq.qlen - t0 < bq ? sq.qlen - t0 : bq;
            const float *K = tt.K, *V = tt.V;
            int64_t kmin, kmax;
            ext_load_tile(&x, &o, &sq, h, t0, nt, &g, &kmin, &kmax);
            x.t.dQ = dQbuf;
            memset(x.t.dQ, 0, (size_t)x.t.R * x.t.DK * sizeof(float));
            for (int64_t c0 = kmin; kmax >= 0 && c0 <= kmax; c0 += EXT_KB) {
                const int64_t c1 = c0 + EXT_KB < kmax + 1 ? c0 + EXT_KB : kmax + 1;
                ext_grad_block(&x, &o, &sq, K, V, c0, c1, 1, 0);
                core_accum(x.t.dQ, x.dS, x.t.S, EXT_KB, x.t.R, K + c0 * p->DK, p->DK, c1 - c0);
            }
            for (int64_t i = 0; i < nt; i++) tile_add_dq(&x.t, (int)(i * G), dq32, p, sq.b, sq.q0 + t0 + i, h, p->scale);
        }

        /* dK, dV: each task owns EXT_KB key rows and visits every query that may see them */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tkv.total; task++) {
            const ext_task tt = ext_task_open(p, &tkv, task, Kp, Vp);
            const ext_seq sq = tt.sq;
            const int64_t h = tt.h, off = tt.off;
            const float *K = tt.K, *V = tt.V;
            int64_t kmin, kmax;
            const int64_t c0 = tt.tile * EXT_KB, c1 = c0 + EXT_KB < sq.klen ? c0 + EXT_KB : sq.klen;
            const int64_t q_first = nsa_rule_window_q_first(c0, o.wr, o.causal, sq.qlen, sq.klen);
            const int64_t q_last = nsa_rule_window_q_last(c1 - 1, o.wl, sq.qlen, sq.klen);
            for (int64_t tq0 = q_first; tq0 <= q_last; tq0 += bq) {
                const int64_t nt = q_last + 1 - tq0 < bq ? q_last + 1 - tq0 : bq;
                ext_load_tile(&x, &o, &sq, h, tq0, nt, &g, &kmin, &kmax);
                ext_grad_block(&x, &o, &sq, K, V, c0, c1, 1, 1);
                core_accum_t(dKp + (off + c0) * p->DK, x.dS, x.t.S, EXT_KB, x.t.R, x.t.Q, p->DK, c1 - c0);
                core_accum_t(dVp + (off + c0) * p->DV, x.t.S, x.t.S, EXT_KB, x.t.R, x.t.dO, p->DV, c1 - c0);
            }
        }
    }
    if (o.sinks) ext_dsinks(ctx, &o, a);
}
