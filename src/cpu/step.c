/* step.c -- one inference step against KV caches (spec 12) on the CPU: the lengths, counts and
 * page indices checked before any write, the append of the step's tokens, the compressed rows
 * they complete (mean pooling), then for each new query and kv head the three branches, the
 * selection between them and the gates, straight from the caches. A decode step reads each
 * cached row once per query head, which is what a CPU step costs anyway; nothing is packed. */
#include "common.h"

#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <string.h>

/* One cache as the step reads it: contiguous (bt NULL) or paged (page rows per page). */
typedef struct step_cache {
    const nsa_tensor *k, *v, *bt;
    int64_t page;
} step_cache;

static step_cache cache_of(const nsa_kv_cache *c)
{
    step_cache s = {&c->k, &c->v, nsa_present(&c->block_table) ? &c->block_table : NULL, c->k.shape[1]};
    return s;
}

/* Element offset of row r, head h of sequence b in tensor x (c's k or v). */
static int64_t cache_off(const step_cache *c, const nsa_tensor *x, int64_t b, int64_t r, int64_t h)
{
    if (!c->bt) return b * x->stride[0] + r * x->stride[1] + h * x->stride[2];
    const int64_t pg = *io_i32(c->bt, b * c->bt->stride[0] + (r / c->page) * c->bt->stride[1]);
    return pg * x->stride[0] + (r % c->page) * x->stride[1] + h * x->stride[2];
}

/* The step's sequence b: new queries n, cached tokens before (L0) and after (L) the append. */
typedef struct step_seq {
    int64_t n, L0, L;
} step_seq;

static step_seq seq_of(const nsa_step_args *a, const nsa_problem *p, int64_t b)
{
    step_seq s;
    s.n = nsa_present(&a->q_lens) ? *io_i32(&a->q_lens, b * a->q_lens.stride[0]) : p->T;
    s.L0 = *io_i32(&a->seqlens, b * a->seqlens.stride[0]);
    s.L = nsa_present(&a->k_new) ? s.L0 + s.n : s.L0;
    return s;
}

/* Pages of rows [0, rows) of sequence b inside the pool. */
static nsa_status pages_check(const step_cache *c, const char *name, int64_t b, int64_t rows)
{
    if (!c->bt) return NSA_STATUS_SUCCESS;
    const int64_t pool = c->k->shape[0];
    for (int64_t j = 0; j * c->page < rows; j++) {
        const int32_t pg = *io_i32(c->bt, b * c->bt->stride[0] + j * c->bt->stride[1]);
        if (pg < 0 || pg >= pool)
            return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%s.block_table[%" PRId64 ", %" PRId64 "]: page %d outside [0, %" PRId64
                            ") (sequence %" PRId64 " has %" PRId64 " rows)", name, b, j, (int)pg, pool, b, rows);
    }
    return NSA_STATUS_SUCCESS;
}

/* Everything the step will read or write, checked before its first write. */
static nsa_status step_check(const nsa_step_args *a, const nsa_problem *p, int cmp)
{
    const nsa_config *c = &p->cfg;
    const step_cache kv = cache_of(&a->cache), ckv = cache_of(&a->cmp_cache);
    for (int64_t b = 0; b < p->B; b++) {
        const step_seq s = seq_of(a, p, b);
        if (s.n < 0 || s.n > p->T)
            return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "q_lens[%" PRId64 "]: %" PRId64 ", must be in [0, Tq = %" PRId64 "]", b, s.n,
                            p->T);
        if (s.L0 < 0) return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "seqlens[%" PRId64 "]: %" PRId64 " is negative", b, s.L0);
        if (!nsa_present(&a->k_new) && s.n > s.L0)
            return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "q_lens[%" PRId64 "]: %" PRId64 " queries, but seqlens[%" PRId64 "] = %" PRId64
                            " tokens are cached (without k_new the cache holds the step's tokens)", b, s.n, b, s.L0);
        if (s.L > p->cache_cap)
            return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "seqlens[%" PRId64 "]: %" PRId64 " cached + %" PRId64 " appended tokens "
                            "exceed cache's capacity of %" PRId64 " rows", b, s.L0, s.L - s.L0, p->cache_cap);
        nsa_status st = pages_check(&kv, "cache", b, s.L);
        if (st != NSA_STATUS_SUCCESS) return st;
        if (!cmp) continue;
        const int64_t nc = nsa_rule_num_cmp(s.L, c->cmp_len, c->cmp_stride);
        if (nc > p->cmp_cap)
            return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "cmp_cache: sequence %" PRId64 " of %" PRId64 " tokens has %" PRId64
                            " compressed rows, the cache holds %" PRId64, b, s.L, nc, p->cmp_cap);
        if ((st = pages_check(&ckv, "cmp_cache", b, nc)) != NSA_STATUS_SUCCESS) return st;
    }
    return NSA_STATUS_SUCCESS;
}

/* The step's tokens into rows L0 .. L0 + n - 1 (k_new, v_new have the cache's dtype). */
static void step_append(const nsa_step_args *a, const nsa_problem *p)
{
    const step_cache kv = cache_of(&a->cache);
    const size_t es = nsa_dtype_size(a->q.dtype);
    for (int64_t b = 0; b < p->B; b++) {
        const step_seq s = seq_of(a, p, b);
        for (int64_t i = 0; i < s.n; i++)
            for (int64_t h = 0; h < p->H; h++) {
                memcpy((char *)a->cache.k.data + cache_off(&kv, &a->cache.k, b, s.L0 + i, h) * (int64_t)es,
                       (const char *)a->k_new.data + io_off(&a->k_new, b, i, h) * (int64_t)es, (size_t)p->DK * es);
                memcpy((char *)a->cache.v.data + cache_off(&kv, &a->cache.v, b, s.L0 + i, h) * (int64_t)es,
                       (const char *)a->v_new.data + io_off(&a->v_new, b, i, h) * (int64_t)es, (size_t)p->DV * es);
            }
    }
}

/* Mean pooling (spec 1, as nsa_compress: the rows summed in order, then times 1 / l) of the
 * compressed rows the step's tokens complete: those ending at positions L - n .. L - 1. */
static void step_pool(const nsa_step_args *a, const nsa_problem *p, float *row)
{
    const nsa_config *c = &p->cfg;
    const step_cache kv = cache_of(&a->cache), ckv = cache_of(&a->cmp_cache);
    const float inv_l = 1.0f / (float)c->cmp_len;
    for (int64_t b = 0; b < p->B; b++) {
        const step_seq s = seq_of(a, p, b);
        const int64_t c0 = nsa_rule_num_cmp(s.L - s.n, c->cmp_len, c->cmp_stride), c1 = nsa_rule_num_cmp(s.L, c->cmp_len, c->cmp_stride);
        for (int64_t ci = c0; ci < c1; ci++)
            for (int64_t h = 0; h < p->H; h++)
                for (int x = 0; x < 2; x++) {
                    const nsa_tensor *src = x ? &a->cache.v : &a->cache.k, *dst = x ? &a->cmp_cache.v : &a->cmp_cache.k;
                    const int64_t D = x ? p->DV : p->DK;
                    for (int64_t e = 0; e < D; e++) row[e] = 0.0f;
                    for (int64_t r = ci * c->cmp_stride; r < ci * c->cmp_stride + c->cmp_len; r++) {
                        const int64_t off = cache_off(&kv, src, b, r, h);
                        for (int64_t e = 0; e < D; e++) row[e] += io_get(src, off + e);
                    }
                    const int64_t off = cache_off(&ckv, dst, b, ci, h);
                    for (int64_t e = 0; e < D; e++) io_set(dst, off + e, row[e] * inv_l);
                }
    }
}

/* One thread's scratch: a query row, key row, the branch accumulators, the compressed
 * scores and their sum over the heads, the importance of each candidate block, the selection. */
typedef struct step_scratch {
    float *q, *k, *acc, *sc, *psum, *imp;
    int32_t *sel;
} step_scratch;

static void scratch_take(ws_arena *w, const nsa_problem *p, step_scratch *s)
{
    const size_t nc = nsa_size_of(p->cmp_cap), nb = nsa_size_add(nsa_size_of(p->cache_cap / p->cfg.slc_block), 1);
    s->q = (float *)ws_take_n(w, nsa_size_of(p->DK), sizeof(float));
    s->k = (float *)ws_take_n(w, nsa_size_of(p->DK > p->DV ? p->DK : p->DV), sizeof(float));
    s->acc = (float *)ws_take_n(w, nsa_size_mul(4, nsa_size_of(p->DV)), sizeof(float)); /* three branches, the sum */
    s->sc = (float *)ws_take_n(w, nc, sizeof(float));
    s->psum = (float *)ws_take_n(w, nc, sizeof(float));
    s->imp = (float *)ws_take_n(w, nb, sizeof(float));
    s->sel = (int32_t *)ws_take_n(w, nsa_size_of(p->m > p->cfg.slc_topk ? p->m : p->cfg.slc_topk), sizeof(int32_t));
}

size_t nsa_cpu_step_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_step_args *a)
{
    (void)a;
    ws_arena one = {NULL, 0}, all = {NULL, 0};
    step_scratch s;
    scratch_take(&one, p, &s);
    ws_take_n(&all, nsa_size_of(p->DK > p->DV ? p->DK : p->DV), sizeof(float)); /* the pooling row */
    ws_take_threads(&all, ctx, ws_region_bytes(&one));
    return nsa_size_add(all.used, 64);
}

/* Online softmax over one key: score sc, value row v (DV); m, l the running max and sum. */
static void soft_add(float sc, const float *v, int64_t DV, float *m, float *l, float *acc)
{
    if (sc > *m) {
        const float alpha = *m == -INFINITY ? 0.0f : expf(*m - sc);
        *l *= alpha;
        for (int64_t e = 0; e < DV; e++) acc[e] *= alpha;
        *m = sc;
    }
    const float w = *m == -INFINITY ? (sc != sc ? sc : 0.0f) : expf(sc - *m);
    *l += w;
    for (int64_t e = 0; e < DV; e++) acc[e] += w * v[e];
}

static float dot(const float *x, const float *y, int64_t n)
{
    float s = 0.0f;
    for (int64_t e = 0; e < n; e++) s += x[e] * y[e];
    return s;
}

/* Query slot i of sequence b that no query fills (i >= n_b): kv head h's G rows of o zero, of
 * lse -inf (lse NULL for nsa_step), its selection -1 (selected NULL unless the step selects:
 * only then is it validated) -- every output row is defined after a step (the CUDA backend
 * writes the same, and blanks a sequence it skips). */
static void step_blank(const nsa_tensor *o, const nsa_tensor *lse, const nsa_tensor *selected, const nsa_problem *p, int64_t b,
                       int64_t i, int64_t h)
{
    for (int64_t hq = h * p->G; hq < (h + 1) * p->G; hq++) {
        const int64_t off = io_off(o, b, i, hq);
        for (int64_t e = 0; e < p->DV; e++) io_set(o, off + e, 0.0f);
        if (lse && nsa_present(lse)) io_set(lse, io_off(lse, b, i, hq), -INFINITY);
    }
    if (selected && nsa_present(selected)) {
        int32_t *out = (int32_t *)selected->data + io_off(selected, b, i, h);
        for (int64_t e = 0; e < p->cfg.slc_topk; e++) out[e] = -1;
    }
}

/* Query i of sequence b, kv head h: its G heads' outputs and (selection on) its blocks. */
static void step_query(const nsa_step_args *a, const nsa_problem *p, int64_t b, int64_t i, int64_t h, step_scratch *t)
{
    const nsa_config *c = &p->cfg;
    const step_cache kv = cache_of(&a->cache), ckv = cache_of(&a->cmp_cache);
    const step_seq s = seq_of(a, p, b);
    const int64_t pos = s.L - s.n + i, G = p->G, DK = p->DK, DV = p->DV;
    const int use_cmp = nsa_present(&a->g_cmp), use_slc = nsa_present(&a->g_slc), use_swa = nsa_present(&a->g_swa);
    /* (block_indices is read, and validated, only with the selection branch on) */
    const int caller = use_slc && nsa_present(&a->block_indices), selects = use_slc && !caller;
    const int64_t nc = use_cmp || selects ? nsa_rule_num_cmp(s.L, c->cmp_len, c->cmp_stride) : 0;
    const int64_t nv = use_cmp || selects ? nsa_rule_cmp_visible_cap(pos, c->cmp_len, c->cmp_stride, nc) : 0;
    const int64_t lp = c->slc_block, cur = nsa_rule_slc_of(pos, lp);
    float *o_cmp = t->acc, *o_slc = t->acc + DV, *o_swa = t->acc + 2 * DV, *o = t->acc + 3 * DV;

    /* compressed attention of every head first: the selection sums its probabilities */
    for (int64_t r = 0; r < nv; r++) t->psum[r] = 0.0f;
    for (int64_t g = 0; g < G && nv > 0 && selects; g++) {
        const int64_t hq = h * G + g;
        io_load(&a->q, io_off(&a->q, b, i, hq), DK, t->q);
        float m = -INFINITY;
        for (int64_t r = 0; r < nv; r++) {
            io_load(ckv.k, cache_off(&ckv, ckv.k, b, r, h), DK, t->k);
            t->sc[r] = dot(t->q, t->k, DK) * p->scale;
            m = t->sc[r] > m ? t->sc[r] : m;
        }
        float l = 0.0f;
        for (int64_t r = 0; r < nv; r++) l += expf(t->sc[r] - m);
        for (int64_t r = 0; r < nv; r++) t->psum[r] += expf(t->sc[r] - m) / l;
    }
    int64_t kept = 0;
    if (caller) { /* the caller's blocks a query can use (nsa_forward's rule): in [0, cur], each once, ascending */
        const int64_t m = p->m, cnt = nsa_present(&a->block_counts) ? *io_i32(&a->block_counts, io_off(&a->block_counts, b, i, h)) : m;
        const int32_t *ix = io_i32(&a->block_indices, io_off(&a->block_indices, b, i, h));
        for (int64_t e = 0; e < (cnt < 0 ? 0 : cnt > m ? m : cnt); e++) {
            const int32_t j = ix[e];
            if (j < 0 || j > cur) continue;
            int64_t at = kept;
            while (at > 0 && t->sel[at - 1] > j) at--;
            if (at > 0 && t->sel[at - 1] == j) continue;
            for (int64_t q2 = kept; q2 > at; q2--) t->sel[q2] = t->sel[q2 - 1];
            t->sel[at] = j;
            kept++;
        }
    } else if (use_slc) {
        const int64_t l = c->cmp_len, d = c->cmp_stride;
        for (int64_t j = 0; j <= cur; j++) { /* importance as nsa_forward's selection (spec 3) */
            const int64_t r0 = nsa_rule_slc_first_cmp(j, l, d, lp);
            int64_t r1 = nsa_rule_slc_last_cmp(j, d, lp);
            if (r1 > nv - 1) r1 = nv - 1;
            float acc = 0.0f;
            for (int64_t r = r0; r <= r1; r++) acc += t->psum[r] * (float)nsa_rule_overlap(r, j, l, d, lp);
            t->imp[j] = acc * (1.0f / (float)d);
        }
        kept = select_top_n(t->imp, cur, c, t->sel);
        if (nsa_present(&a->selected)) { /* (validated: the step selects) */
            int32_t *out = (int32_t *)a->selected.data + io_off(&a->selected, b, i, h);
            for (int64_t e = 0; e < c->slc_topk; e++) out[e] = t->sel[e];
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const int64_t hq = h * G + g;
        io_load(&a->q, io_off(&a->q, b, i, hq), DK, t->q);
        for (int64_t e = 0; e < 4 * DV; e++) t->acc[e] = 0.0f;
        if (use_cmp && nv > 0) {
            float m = -INFINITY, l = 0.0f;
            for (int64_t r = 0; r < nv; r++) {
                io_load(ckv.k, cache_off(&ckv, ckv.k, b, r, h), DK, t->k);
                const float sc = dot(t->q, t->k, DK) * p->scale;
                io_load(ckv.v, cache_off(&ckv, ckv.v, b, r, h), DV, t->k);
                soft_add(sc, t->k, DV, &m, &l, o_cmp);
            }
            for (int64_t e = 0; e < DV; e++) o_cmp[e] /= l;
        }
        if (use_slc) {
            float m = -INFINITY, l = 0.0f;
            int seen = 0;
            for (int64_t e = 0; e < kept; e++) {
                const int64_t j = t->sel[e];
                if (j < 0) continue;
                const int64_t hi = nsa_rule_slc_hi(j, pos, lp, s.L);
                for (int64_t r = j * lp; r <= hi; r++, seen = 1) {
                    io_load(kv.k, cache_off(&kv, kv.k, b, r, h), DK, t->k);
                    const float sc = dot(t->q, t->k, DK) * p->scale;
                    io_load(kv.v, cache_off(&kv, kv.v, b, r, h), DV, t->k);
                    soft_add(sc, t->k, DV, &m, &l, o_slc);
                }
            }
            if (seen)
                for (int64_t e = 0; e < DV; e++) o_slc[e] /= l;
        }
        if (use_swa) {
            float m = -INFINITY, l = 0.0f;
            const int64_t lo = pos - c->window + 1 > 0 ? pos - c->window + 1 : 0;
            for (int64_t r = lo; r <= pos; r++) {
                io_load(kv.k, cache_off(&kv, kv.k, b, r, h), DK, t->k);
                const float sc = dot(t->q, t->k, DK) * p->swa_scale;
                io_load(kv.v, cache_off(&kv, kv.v, b, r, h), DV, t->k);
                soft_add(sc, t->k, DV, &m, &l, o_swa);
            }
            for (int64_t e = 0; e < DV; e++) o_swa[e] /= l;
        }
        const float gc = use_cmp ? io_get(&a->g_cmp, io_off(&a->g_cmp, b, i, hq)) : 0.0f;
        const float gs = use_slc ? io_get(&a->g_slc, io_off(&a->g_slc, b, i, hq)) : 0.0f;
        const float gw = use_swa ? io_get(&a->g_swa, io_off(&a->g_swa, b, i, hq)) : 0.0f;
        for (int64_t e = 0; e < DV; e++) {
            float x = 0.0f;
            if (use_cmp) x += gc * o_cmp[e];
            if (use_slc) x += gs * o_slc[e];
            if (use_swa) x += gw * o_swa[e];
            o[e] = x;
        }
        io_store(&a->o, io_off(&a->o, b, i, hq), DV, o);
    }
}

nsa_status nsa_cpu_step(const nsa_context *ctx, const nsa_problem *p, const nsa_step_args *a, void *ws)
{
    const int selects = nsa_present(&a->g_slc) && !nsa_present(&a->block_indices), cmp = nsa_present(&a->g_cmp) || selects;
    nsa_status st = step_check(a, p, cmp);
    if (st != NSA_STATUS_SUCCESS) return st;
    ws_arena one = {NULL, 0}, all = {(char *)ws, 0};
    step_scratch probe;
    scratch_take(&one, p, &probe);
    const size_t region = ws_region_bytes(&one);
    float *row = (float *)ws_take_n(&all, nsa_size_of(p->DK > p->DV ? p->DK : p->DV), sizeof(float));
    char *regions = ws_take_threads(&all, ctx, region);

    if (nsa_present(&a->errors)) /* every sequence passed the checks above */
        for (int64_t b = 0; b < p->B; b++) ((int32_t *)a->errors.data)[b * a->errors.stride[0]] = NSA_STEP_OK;
    if (nsa_present(&a->k_new)) step_append(a, p);
    if (cmp && !a->cmp_by_caller) step_pool(a, p, row);
    /* tasks: (b, query slot, kv head); a slot past the sequence's n queries does nothing */
    const int64_t tasks = p->B * p->T * p->H;
#pragma omp parallel num_threads(cpu_threads(ctx))
    {
        ws_arena mine = {regions + (size_t)omp_get_thread_num() * region, 0};
        step_scratch t;
        scratch_take(&mine, p, &t);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t h = task % p->H, i = (task / p->H) % p->T, b = task / (p->H * p->T);
            if (i < seq_of(a, p, b).n) step_query(a, p, b, i, h, &t);
            else step_blank(&a->o, NULL, selects ? &a->selected : NULL, p, b, i, h);
        }
    }
    return NSA_STATUS_SUCCESS;
}

/* ---- the dense step (spec 12.1): nsa_attention's function against the token cache ------- */

/* One thread's scratch: a query row, a K or V row, the output row and the row's scores. */
static void dense_scratch(ws_arena *w, const nsa_problem *p, float **q, float **x, float **acc, float **sc)
{
    *q = (float *)ws_take_n(w, nsa_size_of(p->DK), sizeof(float));
    *x = (float *)ws_take_n(w, nsa_size_of(p->DK > p->DV ? p->DK : p->DV), sizeof(float));
    *acc = (float *)ws_take_n(w, nsa_size_of(p->DV), sizeof(float));
    *sc = (float *)ws_take_n(w, nsa_size_of(p->cache_cap), sizeof(float));
}

size_t nsa_cpu_attention_step_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_step_args *a)
{
    (void)a;
    ws_arena one = {NULL, 0}, all = {NULL, 0};
    float *q, *x, *acc, *sc;
    dense_scratch(&one, p, &q, &x, &acc, &sc);
    ws_take_threads(&all, ctx, ws_region_bytes(&one));
    return nsa_size_add(all.used, 64);
}

/* The keys query position pos of a sequence of L tokens sees: [*lo, *hi] (empty: lo > hi). */
static void dense_range(const nsa_attention_step_args *a, int64_t pos, int64_t L, int64_t *lo, int64_t *hi)
{
    *lo = a->window_left < 0 || a->window_left >= pos ? 0 : pos - a->window_left;
    if (a->causal) *hi = pos;
    else *hi = a->window_right < 0 || a->window_right >= L - 1 - pos ? L - 1 : pos + a->window_right; /* (no overflow) */
}

/* Query i of sequence b, head hq: dense softmax over its visible cached keys in two passes (the
 * scores, then the weights), so a NaN score or an all -inf row is NaN as in dense attention. */
static void dense_query(const nsa_attention_step_args *a, const nsa_step_args *sa, const nsa_problem *p, int64_t b, int64_t i,
                        int64_t hq, float *q, float *x, float *acc, float *sc)
{
    const step_cache kv = cache_of(&a->cache);
    const step_seq s = seq_of(sa, p, b);
    const int64_t pos = s.L - s.n + i, h = hq / p->G, DK = p->DK, DV = p->DV;
    int64_t lo, hi;
    dense_range(a, pos, s.L, &lo, &hi);
    io_load(&a->q, io_off(&a->q, b, i, hq), DK, q);
    float m = -INFINITY;
    for (int64_t r = lo; r <= hi; r++) {
        io_load(kv.k, cache_off(&kv, kv.k, b, r, h), DK, x);
        float v = dot(q, x, DK) * p->scale;
        if (a->softcap > 0.0f) v = a->softcap * tanhf(v / a->softcap);
        sc[r - lo] = v;
        m = v > m || v != v || m != m ? (m != m ? m : v) : m; /* NaN wins */
    }
    const int seen = hi >= lo, sink = nsa_present(&a->sinks);
    const float sk = sink ? io_get(&a->sinks, hq * a->sinks.stride[0]) : -INFINITY;
    if (sink && (sk > m)) m = sk;
    for (int64_t e = 0; e < DV; e++) acc[e] = 0.0f;
    float l = 0.0f, lse;
    if (m == -INFINITY) { /* no key and no (finite) sink: o = 0; keys all at -inf: 0 / 0 as dense softmax */
        lse = seen ? NAN : sink ? sk : -INFINITY;
        if (seen)
            for (int64_t e = 0; e < DV; e++) acc[e] = NAN;
    } else {
        for (int64_t r = lo; r <= hi; r++) {
            const float w = expf(sc[r - lo] - m);
            l += w;
            io_load(kv.v, cache_off(&kv, kv.v, b, r, h), DV, x);
            for (int64_t e = 0; e < DV; e++) acc[e] += w * x[e];
        }
        if (sink) l += expf(sk - m);
        for (int64_t e = 0; e < DV; e++) acc[e] /= l;
        lse = m + logf(l);
    }
    io_store(&a->o, io_off(&a->o, b, i, hq), DV, acc);
    if (nsa_present(&a->lse)) io_set(&a->lse, io_off(&a->lse, b, i, hq), lse);
}

nsa_status nsa_cpu_attention_step(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_step_args *a, void *ws)
{
    const nsa_step_args sa = nsa_step_common(a);
    nsa_status st = step_check(&sa, p, 0);
    if (st != NSA_STATUS_SUCCESS) return st;
    ws_arena one = {NULL, 0}, all = {(char *)ws, 0};
    float *q, *x, *acc, *sc;
    dense_scratch(&one, p, &q, &x, &acc, &sc);
    const size_t region = ws_region_bytes(&one);
    char *regions = ws_take_threads(&all, ctx, region);
    if (nsa_present(&a->errors))
        for (int64_t b = 0; b < p->B; b++) ((int32_t *)a->errors.data)[b * a->errors.stride[0]] = NSA_STEP_OK;
    if (nsa_present(&a->k_new)) step_append(&sa, p);
    const int64_t tasks = p->B * p->T * p->HQ;
#pragma omp parallel num_threads(cpu_threads(ctx))
    {
        ws_arena mine = {regions + (size_t)omp_get_thread_num() * region, 0};
        float *tq, *tx, *tacc, *tsc;
        dense_scratch(&mine, p, &tq, &tx, &tacc, &tsc);
#pragma omp for schedule(dynamic, 4)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t hq = task % p->HQ, i = (task / p->HQ) % p->T, b = task / (p->HQ * p->T);
            if (i < seq_of(&sa, p, b).n) dense_query(a, &sa, p, b, i, hq, tq, tx, tacc, tsc);
            else if (hq % p->G == 0) step_blank(&a->o, &a->lse, NULL, p, b, i, hq / p->G);
        }
    }
    return NSA_STATUS_SUCCESS;
}
