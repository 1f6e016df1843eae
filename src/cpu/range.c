/* range.c -- compressed attention (spec 2, with the importance + top-n selection of spec 3
 * fused into its forward) and windowed / dense attention (spec 5), forward and backward.
 * Both masks give every query a contiguous key range [lo(t), hi(t)], non-decreasing in t.
 *
 * Forward: tasks over (sequence, kv head, tile of query positions); a tile holds every
 * query head of the group for bq positions, so K/V rows are shared by G * bq rows.
 * Backward: dQ over query tiles, then dK/dV over key tiles (each task owns its key rows:
 * no atomics, bitwise deterministic whatever the thread count). */
#include "common.h"
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { RANGE_KB = 64, ROWS_PER_TILE = 64 };

static int64_t positions_per_tile(const nsa_problem *p)
{
    int64_t bq = ROWS_PER_TILE / p->G;
    return bq < 1 ? 1 : bq;
}

static int64_t seq_keys(const range_rule *r, const cpu_seq *s) { return r->cmp ? s->ncmp : s->len; }
static int64_t seq_key_base(const range_rule *r, const cpu_seq *s) { return r->cmp ? s->cmp_row0 : s->row0; }

/* Visible keys of query t, [lo, hi] in the sequence's key index space (empty if hi < lo). */
static void rule_bounds(const range_rule *r, int64_t t, int64_t nkeys, int64_t *lo, int64_t *hi)
{
    if (r->cmp) {
        *lo = 0;
        *hi = nsa_rule_cmp_visible_cap(t, r->l, r->d, nkeys) - 1;
        return;
    }
    *lo = nsa_rule_window_lo(t, r->wl);
    *hi = nsa_rule_window_hi(t, r->wr, r->causal, nkeys);
}

typedef struct tiles_arg {
    const range_rule *rule;
    int64_t per_tile;
    int keys; /* tile over keys instead of queries */
} tiles_arg;

static int64_t count_tiles(const cpu_seq *s, const void *arg)
{
    const tiles_arg *ta = (const tiles_arg *)arg;
    int64_t n = ta->keys ? seq_keys(ta->rule, s) : s->qlen;
    return (n + ta->per_tile - 1) / ta->per_tile;
}

/* Largest key count of any sequence bounds the score row of a whole compressed row. */
static int64_t max_keys(const nsa_problem *p, const range_rule *r)
{
    if (!r->cmp) return RANGE_KB;
    int64_t mx = 0;
    if (!p->cu_seqlens) mx = nsa_rule_num_cmp(p->Tk, r->l, r->d);
    else
        for (int64_t s = 0; s < p->num_seqs; s++) {
            int64_t n = nsa_rule_num_cmp(p->cu_seqlens[s + 1] - p->cu_seqlens[s], r->l, r->d);
            mx = n > mx ? n : mx;
        }
    return mx > 0 ? mx : 1;
}

static int64_t max_slc_blocks(const nsa_problem *p)
{
    int64_t mx = 0;
    if (!p->cu_seqlens) mx = nsa_rule_num_slc(p->Tk, p->cfg.slc_block);
    else
        for (int64_t s = 0; s < p->num_seqs; s++) {
            int64_t n = nsa_rule_num_slc(p->cu_seqlens[s + 1] - p->cu_seqlens[s], p->cfg.slc_block);
            mx = n > mx ? n : mx;
        }
    return mx > 0 ? mx : 1;
}

/* Per-thread scratch of the forward: one tile, a row of lse, importance and a dO row. */
static size_t fwd_thread_bytes(const nsa_problem *p, const range_rule *r, int with_select, core_tile *t,
                               ws_arena *a, float **lse_rows, float **imp)
{
    const int64_t R = positions_per_tile(p) * p->G; /* <= max(64, G): G = HQ / H fits */
    core_tile_alloc(t, a, R, p->DK, p->DV, max_keys(p, r), 0);
    *lse_rows = (float *)ws_take_n(a, nsa_size_of(R), sizeof(float));
    *imp = with_select ? (float *)ws_take_n(a, nsa_size_add(nsa_size_of(max_slc_blocks(p)), nsa_size_of(max_keys(p, r))),
                                            sizeof(float))
                       : NULL;
    return ws_region_bytes(a);
}

size_t range_fwd_ws(const nsa_context *ctx, const nsa_problem *p, const range_rule *rule, int with_select)
{
    /* mirrors range_fwd's carving: tasks, then one scratch region per thread */
    ws_arena a = {NULL, 0}, probe = {NULL, 0};
    cpu_tasks tk;
    tiles_arg ta = {rule, positions_per_tile(p), 0};
    cpu_tasks_build(&tk, &a, p, NULL, count_tiles, &ta);
    core_tile t;
    float *lse_rows, *imp;
    ws_take_threads(&a, ctx, fwd_thread_bytes(p, rule, with_select, &t, &probe, &lse_rows, &imp));
    return nsa_size_add(a.used, 64);
}

/* Importance of every selection block for query t of kv head h (spec 3), from the tile's
 * probabilities, then top-n. Rows ti * G .. ti * G + G - 1 are the group's heads: their
 * probabilities are summed first (psum), then each selection block j gathers the few
 * compressed blocks that overlap it, so there is no division in the inner loops. */
static void select_position(const nsa_problem *p, const core_tile *t, int64_t ti, int64_t tpos, int64_t nkeys,
                            const select_sink *sel, int64_t b, int64_t row, int64_t h, float *imp, float *psum)
{
    const nsa_config *c = &p->cfg;
    const int64_t l = c->cmp_len, d = c->cmp_stride, lp = c->slc_block;
    const int64_t cur = nsa_rule_slc_of(tpos, lp);
    const int64_t nv = nsa_rule_cmp_visible_cap(tpos, l, d, nkeys);
    for (int64_t i = 0; i < nv; i++) psum[i] = 0.0f;
    for (int64_t g = 0; g < p->G; g++) {
        const int r = (int)(ti * p->G + g);
        /* no visible block: p_cmp = 0; a NaN l passes (NaN importance), and so does a row whose
         * visible scores were all -inf (its p_cmp is NaN, as core_fwd_end makes its o) */
        if (t->l[r] == 0.0f && !t->ninf[r]) continue;
        float w = t->l[r] == 0.0f ? NAN : 1.0f / t->l[r]; /* S holds exp(s - m): p = S / l */
        if (sel->lse_in) {
            float lse = io_get(sel->lse_in, io_off(sel->lse_in, b, row, h * p->G + g));
            w = lse == -INFINITY ? 0.0f : core_exp(t->m[r] - lse);
        }
        const float *s = t->S + (size_t)r * t->S_cap;
#pragma omp simd
        for (int64_t i = 0; i < nv; i++) psum[i] += s[i] * w;
    }
    const float inv_d = 1.0f / (float)d;
    for (int64_t j = 0; j <= cur; j++) {
        /* the visible compressed blocks overlapping block j */
        const int64_t i0 = nsa_rule_slc_first_cmp(j, l, d, lp);
        int64_t i1 = nsa_rule_slc_last_cmp(j, d, lp);
        if (i1 > nv - 1) i1 = nv - 1;
        float acc = 0.0f;
        for (int64_t i = i0; i <= i1; i++) acc += psum[i] * (float)nsa_rule_overlap(i, j, l, d, lp);
        imp[j] = acc * inv_d;
    }
    int32_t *out = (int32_t *)sel->indices->data + io_off(sel->indices, b, row, h);
    int64_t kept = select_top_n(imp, cur, c, out);
    if (sel->counts) io_set(sel->counts, io_off(sel->counts, b, row, h), (float)kept);
}

/* Loads queries [t0, t0 + nt) of a sequence (positions q0 + t0 ..) into tile rows with their key ranges.
 * @return the union [kmin, kmax] of the rows' ranges via the pointers (kmax < 0: none). */
static void load_query_tile(core_tile *t, const nsa_problem *p, const range_rule *rule, const cpu_seq *sq,
                            int64_t nkeys, const nsa_tensor *q, const grad_src *g, int64_t h, int64_t t0,
                            int64_t nt, float *tmp, int64_t *kmin, int64_t *kmax)
{
    const int64_t G = p->G;
    t->R = (int)(nt * G);
    *kmin = INT64_MAX;
    *kmax = -1;
    for (int64_t i = 0; i < nt; i++) {
        tile_load_rows(t, (int)(i * G), q, p->scale, sq->b, sq->qrow0 + t0 + i, h, G, g, tmp);
        int64_t lo, hi;
        rule_bounds(rule, sq->q0 + t0 + i, nkeys, &lo, &hi);
        for (int64_t k = 0; k < G; k++) {
            t->lo[i * G + k] = lo;
            t->hi[i * G + k] = hi;
        }
        if (hi >= lo) {
            *kmin = lo < *kmin ? lo : *kmin;
            *kmax = hi > *kmax ? hi : *kmax;
        }
    }
}

void range_fwd(const nsa_context *ctx, const nsa_problem *p, const range_rule *rule, const int64_t *cu_cmp,
               const nsa_tensor *q, const float *Kp, const float *Vp, int64_t key_rows,
               const nsa_tensor *o, const nsa_tensor *lse, const select_sink *sel, void *ws)
{
    ws_arena a = {(char *)ws, 0};
    cpu_tasks tk;
    tiles_arg ta = {rule, positions_per_tile(p), 0};
    cpu_tasks_build(&tk, &a, p, cu_cmp, count_tiles, &ta);
    core_tile t0;
    float *lr0, *im0;
    ws_arena probe = {NULL, 0};
    const size_t per = fwd_thread_bytes(p, rule, sel != NULL, &t0, &probe, &lr0, &im0);
    char *thread_base = ws_take_threads(&a, ctx, per);
    const int64_t bq = ta.per_tile, G = p->G, nb_max = sel ? max_slc_blocks(p) : 0;

#pragma omp parallel num_threads(cpu_threads(ctx))
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        ws_arena ta_a = cpu_thread_arena(thread_base, per, tid);
        core_tile t;
        float *lse_rows, *imp;
        fwd_thread_bytes(p, rule, sel != NULL, &t, &ta_a, &lse_rows, &imp);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tk.total; task++) {
            int64_t s, h, tile;
            cpu_tasks_decode(&tk, task, &s, &h, &tile);
            const cpu_seq sq = cpu_seq_get(p, cu_cmp, s);
            const int64_t nkeys = seq_keys(rule, &sq), base = seq_key_base(rule, &sq);
            const float *K = Kp + ((sq.b * p->H + h) * key_rows + base) * p->DK;
            const float *V = Vp ? Vp + ((sq.b * p->H + h) * key_rows + base) * p->DV : NULL;
            const int64_t t0 = tile * bq, nt = sq.qlen - t0 < bq ? sq.qlen - t0 : bq;
            int64_t kmin, kmax;
            load_query_tile(&t, p, rule, &sq, nkeys, q, NULL, h, t0, nt, NULL, &kmin, &kmax);
            core_fwd_begin(&t);
            /* compressed rows are processed whole, so S keeps every probability for the
             * selection; windows go block by block with the online softmax */
            const int64_t step = rule->cmp ? t.S_cap : RANGE_KB;
            for (int64_t c0 = kmin; kmax >= 0 && c0 <= kmax; c0 += step) {
                const int64_t c1 = c0 + step < kmax + 1 ? c0 + step : kmax + 1;
                core_fwd_block(&t, K, o ? V : NULL, c0, c1);
            }
            if (sel)
                for (int64_t i = 0; i < nt; i++) {
                    /* core_fwd_block stored S relative to kmin; selection reads from key 0 */
                    select_position(p, &t, i, sq.q0 + t0 + i, nkeys, sel, sq.b, sq.qrow0 + t0 + i, h, imp, imp + nb_max);
                }
            core_fwd_end(&t, lse_rows);
            for (int64_t i = 0; i < nt; i++)
                tile_store_rows(&t, (int)(i * G), o, lse, lse_rows, sq.b, sq.qrow0 + t0 + i, h, G);
        }
    }
}

/* ---- backward ------------------------------------------------------------------------- */

static size_t bwd_thread_bytes(const nsa_problem *p, core_tile *t, ws_arena *a, float **tmp)
{
    const int64_t R = positions_per_tile(p) * p->G;
    core_tile_alloc(t, a, R, p->DK, p->DV, 2 * RANGE_KB, 1);
    *tmp = (float *)ws_take_n(a, nsa_size_of(p->DV), sizeof(float));
    return ws_region_bytes(a);
}

size_t range_bwd_ws(const nsa_context *ctx, const nsa_problem *p, const range_rule *rule)
{
    /* mirrors range_bwd's carving: query tasks, key tasks, one scratch region per thread */
    ws_arena a = {NULL, 0}, probe = {NULL, 0};
    cpu_tasks tk;
    tiles_arg ta_q = {rule, positions_per_tile(p), 0}, ta_k = {rule, RANGE_KB, 1};
    cpu_tasks_build(&tk, &a, p, NULL, count_tiles, &ta_q);
    cpu_tasks_build(&tk, &a, p, NULL, count_tiles, &ta_k);
    core_tile t;
    float *tmp;
    ws_take_threads(&a, ctx, bwd_thread_bytes(p, &t, &probe, &tmp));
    return nsa_size_add(a.used, 64);
}

/* The queries (indices 0 .. qlen - 1 of the sequence's queries, at positions q0 ..) whose
 * ranges meet keys [c0, c1): [*first, *last] (empty when *last < *first). */
static void queries_of_keys(const range_rule *r, const cpu_seq *sq, int64_t c0, int64_t c1, int64_t *first,
                            int64_t *last)
{
    if (r->cmp) { /* every query from the first that sees block c0 on */
        const int64_t f = nsa_rule_cmp_last_token(c0, r->l, r->d) - sq->q0;
        *first = f < 0 ? 0 : f < sq->qlen ? f : sq->qlen;
        *last = sq->qlen - 1;
        return;
    }
    *first = nsa_rule_window_q_first(c0, r->wr, r->causal, sq->qlen, sq->len);
    *last = nsa_rule_window_q_last(c1 - 1, r->wl, sq->qlen, sq->len);
}

void range_bwd(const nsa_context *ctx, const nsa_problem *p, const range_rule *rule, const int64_t *cu_cmp,
               const nsa_tensor *q, const float *Kp, const float *Vp, int64_t key_rows, const grad_src *g,
               float *dq32, float *dKp, float *dVp, void *ws)
{
    ws_arena a = {(char *)ws, 0};
    cpu_tasks tq, tkv;
    tiles_arg ta_q = {rule, positions_per_tile(p), 0}, ta_k = {rule, RANGE_KB, 1};
    cpu_tasks_build(&tq, &a, p, cu_cmp, count_tiles, &ta_q);
    cpu_tasks_build(&tkv, &a, p, cu_cmp, count_tiles, &ta_k);
    core_tile t0;
    float *tmp0;
    ws_arena probe = {NULL, 0};
    const size_t per = bwd_thread_bytes(p, &t0, &probe, &tmp0);
    char *thread_base = ws_take_threads(&a, ctx, per);
    const int64_t bq = ta_q.per_tile;

#pragma omp parallel num_threads(cpu_threads(ctx))
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        ws_arena ta_a = cpu_thread_arena(thread_base, per, tid);
        core_tile t;
        float *tmp;
        bwd_thread_bytes(p, &t, &ta_a, &tmp);
        float *dQbuf = t.dQ;

        /* dQ: each task owns its query rows */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tq.total; task++) {
            int64_t s, h, tile, kmin, kmax;
            cpu_tasks_decode(&tq, task, &s, &h, &tile);
            const cpu_seq sq = cpu_seq_get(p, cu_cmp, s);
            const int64_t nkeys = seq_keys(rule, &sq), base = seq_key_base(rule, &sq);
            const float *K = Kp + ((sq.b * p->H + h) * key_rows + base) * p->DK;
            const float *V = Vp + ((sq.b * p->H + h) * key_rows + base) * p->DV;
            const int64_t t0 = tile * bq, nt = sq.qlen - t0 < bq ? sq.qlen - t0 : bq;
            load_query_tile(&t, p, rule, &sq, nkeys, q, g, h, t0, nt, tmp, &kmin, &kmax);
            t.dQ = dQbuf;
            memset(t.dQ, 0, (size_t)t.R * t.DK * sizeof(float));
            for (int64_t c0 = kmin; kmax >= 0 && c0 <= kmax; c0 += RANGE_KB) {
                const int64_t c1 = c0 + RANGE_KB < kmax + 1 ? c0 + RANGE_KB : kmax + 1;
                core_bwd_block(&t, K, V, c0, c1, NULL, NULL);
            }
            for (int64_t i = 0; i < nt; i++) tile_add_dq(&t, (int)(i * p->G), dq32, p, sq.b, sq.qrow0 + t0 + i, h, p->scale);
        }

        /* dK, dV: each task owns RANGE_KB key rows and visits every query that sees them */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tkv.total; task++) {
            int64_t s, h, tile, kmin, kmax;
            cpu_tasks_decode(&tkv, task, &s, &h, &tile);
            const cpu_seq sq = cpu_seq_get(p, cu_cmp, s);
            const int64_t nkeys = seq_keys(rule, &sq), base = seq_key_base(rule, &sq);
            const int64_t off_k = ((sq.b * p->H + h) * key_rows + base);
            const float *K = Kp + off_k * p->DK, *V = Vp + off_k * p->DV;
            const int64_t c0 = tile * RANGE_KB, c1 = c0 + RANGE_KB < nkeys ? c0 + RANGE_KB : nkeys;
            int64_t q_first, q_last;
            queries_of_keys(rule, &sq, c0, c1, &q_first, &q_last);
            t.dQ = NULL;
            for (int64_t tq0 = q_first; tq0 <= q_last; tq0 += bq) {
                const int64_t nt = q_last + 1 - tq0 < bq ? q_last + 1 - tq0 : bq;
                load_query_tile(&t, p, rule, &sq, nkeys, q, g, h, tq0, nt, tmp, &kmin, &kmax);
                core_bwd_block(&t, K, V, c0, c1, dKp + (off_k + c0) * p->DK, dVp + (off_k + c0) * p->DV);
            }
        }
    }
}
