/* tile.c -- task flattening and the row traffic between strided tensors and core tiles. */
#include "common.h"

void cpu_tasks_build(cpu_tasks *tk, ws_arena *a, const nsa_problem *p, const int64_t *cu_cmp,
                     int64_t (*tiles_of)(const cpu_seq *, const void *), const void *arg)
{
    tk->H = p->H;
    tk->nseq = p->num_seqs;
    tk->first = (int64_t *)ws_take_n(a, nsa_size_add(nsa_size_of(p->num_seqs), 1), sizeof(int64_t));
    tk->total = 0;
    if (!tk->first) return; /* sizing pass */
    tk->first[0] = 0;
    for (int64_t s = 0; s < p->num_seqs; s++) {
        cpu_seq sq = cpu_seq_get(p, cu_cmp, s);
        tk->first[s + 1] = tk->first[s] + p->H * tiles_of(&sq, arg);
    }
    tk->total = tk->first[p->num_seqs];
}

void cpu_tasks_decode(const cpu_tasks *tk, int64_t task, int64_t *s, int64_t *h, int64_t *tile)
{
    /* binary search: the sequence s with first[s] <= task < first[s + 1] (empty sequences
     * have first[s] == first[s + 1] and own no task) */
    int64_t lo = 0, hi = tk->nseq - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (tk->first[mid + 1] <= task) lo = mid + 1;
        else hi = mid;
    }
    *s = lo;
    int64_t per_head = (tk->first[lo + 1] - tk->first[lo]) / tk->H;
    int64_t local = task - tk->first[lo];
    *h = local / per_head;
    *tile = local % per_head;
}

void tile_load_rows(core_tile *t, int r0, const nsa_tensor *q, float scale, int64_t b, int64_t row, int64_t h,
                    int64_t G, const grad_src *g, float *tmp)
{
    for (int64_t i = 0; i < G; i++) {
        const int r = r0 + (int)i;
        const int64_t hq = h * G + i;
        io_load_scaled(q, io_off(q, b, row, hq), t->DK, scale, t->Q + (size_t)r * t->DK);
        if (!g) continue;
        float *dO = t->dO + (size_t)r * t->DV;
        io_load(g->dout, io_off(g->dout, b, row, hq), t->DV, dO);
        if (g->gate) {
            const float gv = io_get(g->gate, io_off(g->gate, b, row, hq));
            for (int d = 0; d < t->DV; d++) dO[d] *= gv;
        }
        io_load(g->o, io_off(g->o, b, row, hq), t->DV, tmp);
        float D = 0.0f;
        for (int d = 0; d < t->DV; d++) D += dO[d] * tmp[d];
        t->Drow[r] = D;
        t->lse[r] = io_get(g->lse, io_off(g->lse, b, row, hq));
    }
}

void tile_store_rows(const core_tile *t, int r0, const nsa_tensor *o, const nsa_tensor *lse, const float *lse_rows,
                     int64_t b, int64_t row, int64_t h, int64_t G)
{
    for (int64_t i = 0; i < G; i++) {
        const int r = r0 + (int)i;
        const int64_t hq = h * G + i;
        if (o) io_store(o, io_off(o, b, row, hq), t->DV, t->O + (size_t)r * t->DV);
        if (lse) io_set(lse, io_off(lse, b, row, hq), lse_rows[r]);
    }
}

void tile_add_dq(const core_tile *t, int r0, float *dq32, const nsa_problem *p, int64_t b, int64_t row, int64_t h,
                 float scale)
{
    const int64_t G = p->G;
    for (int64_t i = 0; i < G; i++) {
        const int r = r0 + (int)i;
        float *dst = dq32 + (((b * p->T + row) * p->HQ) + h * G + i) * p->DK;
        const float *src = t->dQ + (size_t)r * t->DK;
        for (int d = 0; d < t->DK; d++) dst[d] += scale * src[d];
    }
}

void cpu_store_dense(const nsa_context *ctx, const float *acc, const nsa_tensor *x)
{
    const int64_t B = x->shape[0], T = x->shape[1], Hx = x->shape[2], D = x->shape[3];
    const int64_t rows = B * T * Hx;
#pragma omp parallel for schedule(static) num_threads(cpu_threads(ctx))
    for (int64_t r = 0; r < rows; r++) {
        int64_t h = r % Hx, t = (r / Hx) % T, b = r / (Hx * T);
        io_store(x, io_off(x, b, t, h), D, acc + r * D);
    }
}
