/* slc.c -- selected attention (spec 4), forward and backward.
 * Forward and dQ: tasks over (sequence, kv head, run of query positions); each position's
 * G query heads attend to the tokens of its selected blocks, causally masked.
 * dK/dV: the selection is inverted into, per (sequence, kv head, block j), the ascending
 * list of queries that selected j; a task owns block j's key rows, so the result is
 * deterministic with no atomics. */
#include "common.h"
#ifdef _OPENMP
#include <omp.h>
#endif

enum { SLC_POSITIONS_PER_TASK = 16, SLC_ROWS_PER_TILE = 64 };

static int64_t seq_blocks(const nsa_problem *p, const cpu_seq *s) { return nsa_rule_num_slc(s->len, p->cfg.slc_block); }

static int64_t max_seq_blocks(const nsa_problem *p)
{
    int64_t mx = 1;
    for (int64_t s = 0; s < p->num_seqs; s++) {
        cpu_seq sq = cpu_seq_get(p, NULL, s);
        int64_t n = seq_blocks(p, &sq);
        mx = n > mx ? n : mx;
    }
    return mx;
}

/* The distinct usable blocks of query t (spec 4): entries -1 or outside [0, nb) skipped,
 * blocks starting after t skipped (they hold no visible key), duplicates once; ascending.
 * @return how many were written to out. */
static int64_t usable_blocks(const nsa_problem *p, const nsa_tensor *idx, const nsa_tensor *counts, int64_t b,
                             int64_t row, int64_t h, int64_t t, int64_t nb, int64_t *out)
{
    int64_t cnt = p->m;
    if (counts) {
        int64_t c = (int64_t)*io_i32(counts, io_off(counts, b, row, h));
        cnt = c < 0 ? 0 : (c > p->m ? p->m : c);
    }
    const int32_t *ix = io_i32(idx, io_off(idx, b, row, h));
    int64_t n = 0;
    for (int64_t e = 0; e < cnt; e++) {
        int64_t j = ix[e];
        if (j < 0 || j >= nb || !nsa_rule_slc_visible(j, t, p->cfg.slc_block)) continue;
        int64_t pos = n; /* insertion sort keeps out ascending; m is small */
        while (pos > 0 && out[pos - 1] > j) pos--;
        if (pos > 0 && out[pos - 1] == j) continue;
        for (int64_t k = n; k > pos; k--) out[k] = out[k - 1];
        out[pos] = j;
        n++;
    }
    return n;
}

static int64_t positions_per_tile(const nsa_problem *p)
{
    int64_t bq = SLC_ROWS_PER_TILE / p->G;
    return bq < 1 ? 1 : bq;
}

static size_t thread_bytes(const nsa_problem *p, core_tile *t, ws_arena *a, float **tmp, int64_t **blocks,
                           int64_t **cursor, int backward)
{
    const int64_t R = positions_per_tile(p) * p->G; /* <= max(64, G): G = HQ / H fits */
    /* a block's keys in a row of scores (two halves in the backward): no more than the
     * sequence holds, however long the configured block */
    const int64_t keys = p->cfg.slc_block < p->Tk ? p->cfg.slc_block : (p->Tk > 0 ? p->Tk : 1);
    /* (keys <= Tk < 2^62, as k's bytes fit int64: 2 * keys does too) */
    core_tile_alloc(t, a, R, p->DK, p->DV, 2 * keys, backward);
    /* row scratch: one row of dout (DV floats), or the lse of the tile's R rows */
    *tmp = (float *)ws_take_n(a, nsa_size_of(p->DV > R ? p->DV : R), sizeof(float));
    *blocks = (int64_t *)ws_take_n(a, nsa_size_of(p->m), sizeof(int64_t));
    *cursor = (int64_t *)ws_take_n(a, nsa_size_of(max_seq_blocks(p)), sizeof(int64_t));
    return ws_region_bytes(a);
}

static int64_t position_runs(const cpu_seq *s, const void *arg)
{
    (void)arg;
    return (s->qlen + SLC_POSITIONS_PER_TASK - 1) / SLC_POSITIONS_PER_TASK;
}

static int64_t block_tiles(const cpu_seq *s, const void *arg)
{
    return nsa_rule_num_slc(s->len, ((const nsa_problem *)arg)->cfg.slc_block);
}

size_t slc_fwd_ws(const nsa_context *ctx, const nsa_problem *p)
{
    ws_arena a = {NULL, 0}, probe = {NULL, 0};
    core_tile t;
    float *tmp;
    int64_t *blocks, *cursor;
    const size_t per = thread_bytes(p, &t, &probe, &tmp, &blocks, &cursor, 0);
    cpu_tasks tk;
    cpu_tasks_build(&tk, &a, p, NULL, position_runs, NULL);
    ws_take_threads(&a, ctx, per);
    return nsa_size_add(a.used, 64);
}

/* Query i of a sequence (position q0 + i): all G heads over its usable blocks. Forward
 * (g == NULL) writes O and lse; backward accumulates dQ into dq32. */
static void one_position(core_tile *t, const nsa_problem *p, const cpu_seq *sq, int64_t h, int64_t i,
                         const nsa_tensor *q, const float *K, const float *V, const nsa_tensor *idx,
                         const nsa_tensor *counts, const grad_src *g, float *tmp, int64_t *blocks,
                         const nsa_tensor *o, const nsa_tensor *lse, float *dq32)
{
    const int64_t G = p->G, lp = p->cfg.slc_block, row = sq->qrow0 + i, tpos = sq->q0 + i;
    const int64_t nb = seq_blocks(p, sq);
    t->R = (int)G;
    tile_load_rows(t, 0, q, p->scale, sq->b, row, h, G, g, tmp);
    for (int64_t r = 0; r < G; r++) {
        t->lo[r] = 0;
        t->hi[r] = tpos;
    }
    const int64_t nblk = usable_blocks(p, idx, counts, sq->b, row, h, tpos, nb, blocks);
    if (!g) {
        core_fwd_begin(t);
        for (int64_t e = 0; e < nblk; e++) {
            const int64_t c0 = nsa_rule_slc_lo(blocks[e], lp), c1 = nsa_rule_slc_end(blocks[e], lp, sq->len);
            core_fwd_block(t, K, V, c0, c1);
        }
        core_fwd_end(t, tmp);
        tile_store_rows(t, 0, o, lse, tmp, sq->b, row, h, G);
        return;
    }
    memset(t->dQ, 0, (size_t)t->R * t->DK * sizeof(float));
    for (int64_t e = 0; e < nblk; e++) {
        const int64_t c0 = nsa_rule_slc_lo(blocks[e], lp), c1 = nsa_rule_slc_end(blocks[e], lp, sq->len);
        core_bwd_block(t, K, V, c0, c1, NULL, NULL);
    }
    tile_add_dq(t, 0, dq32, p, sq->b, row, h, p->scale);
}

static void per_position_pass(const nsa_context *ctx, const nsa_problem *p, const nsa_tensor *q, const float *Kp,
                              const float *Vp, const nsa_tensor *idx, const nsa_tensor *counts, const grad_src *g,
                              const nsa_tensor *o, const nsa_tensor *lse, float *dq32, ws_arena *a)
{
    cpu_tasks tk;
    cpu_tasks_build(&tk, a, p, NULL, position_runs, NULL);
    core_tile t0;
    float *tmp0;
    int64_t *b0, *c0;
    ws_arena probe = {NULL, 0};
    const size_t per = thread_bytes(p, &t0, &probe, &tmp0, &b0, &c0, g != NULL);
    char *thread_base = ws_take_threads(a, ctx, per);
#pragma omp parallel num_threads(cpu_threads(ctx))
    {
        ws_arena ta = cpu_thread_arena(thread_base, per, cpu_thread_id());
        core_tile t;
        float *tmp;
        int64_t *blocks, *cursor;
        thread_bytes(p, &t, &ta, &tmp, &blocks, &cursor, g != NULL);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tk.total; task++) {
            int64_t s, h, run;
            cpu_tasks_decode(&tk, task, &s, &h, &run);
            const cpu_seq sq = cpu_seq_get(p, NULL, s);
            const float *K = Kp + ((sq.b * p->H + h) * p->Tk + sq.row0) * p->DK;
            const float *V = Vp + ((sq.b * p->H + h) * p->Tk + sq.row0) * p->DV;
            const int64_t i0 = run * SLC_POSITIONS_PER_TASK;
            const int64_t i1 = i0 + SLC_POSITIONS_PER_TASK < sq.qlen ? i0 + SLC_POSITIONS_PER_TASK : sq.qlen;
            for (int64_t i = i0; i < i1; i++)
                one_position(&t, p, &sq, h, i, q, K, V, idx, counts, g, tmp, blocks, o, lse, dq32);
        }
    }
}

void slc_fwd(const nsa_context *ctx, const nsa_problem *p, const nsa_tensor *q, const float *Kp, const float *Vp,
             const nsa_tensor *idx, const nsa_tensor *counts, const nsa_tensor *o, const nsa_tensor *lse, void *ws)
{
    ws_arena a = {(char *)ws, 0};
    per_position_pass(ctx, p, q, Kp, Vp, idx, counts, NULL, o, lse, NULL, &a);
}

/* ---- backward ------------------------------------------------------------------------- */

/* Inverted selection: for (sequence s, head h) a region of nb + 1 offsets followed by the
 * query lists; region starts come from a per-sequence prefix. */
typedef struct inv_index {
    int64_t *seq_first; /* [num_seqs + 1]: start of sequence s's regions (H of them) */
    int32_t *data;
} inv_index;

/* Entries of one (sequence, head) region: nb + 1 offsets, then qlen * m query slots. */
static size_t region_size(const nsa_problem *p, const cpu_seq *sq)
{
    return nsa_size_add(nsa_size_add(nsa_size_of(seq_blocks(p, sq)), 1), nsa_size_mul(nsa_size_of(sq->qlen), nsa_size_of(p->m)));
}

static void inv_alloc(inv_index *ix, ws_arena *a, const nsa_problem *p)
{
    ix->seq_first = (int64_t *)ws_take_n(a, nsa_size_add(nsa_size_of(p->num_seqs), 1), sizeof(int64_t));
    size_t sum = 0;
    for (int64_t s = 0; s < p->num_seqs; s++) {
        cpu_seq sq = cpu_seq_get(p, NULL, s);
        if (ix->seq_first) ix->seq_first[s] = (int64_t)sum;
        sum = nsa_size_add(sum, nsa_size_mul(nsa_size_of(p->H), region_size(p, &sq)));
    }
    /* carving: the sum fitted the workspace (4 bytes an entry), so it fits int64 */
    if (ix->seq_first) ix->seq_first[p->num_seqs] = (int64_t)sum;
    ix->data = (int32_t *)ws_take_n(a, sum, sizeof(int32_t));
}

static int32_t *inv_region(const inv_index *ix, const nsa_problem *p, const cpu_seq *sq, int64_t s, int64_t h)
{
    return ix->data + ix->seq_first[s] + h * (int64_t)region_size(p, sq);
}

size_t slc_bwd_ws(const nsa_context *ctx, const nsa_problem *p)
{
    /* mirrors slc_bwd's carving: dQ pass (tasks + thread tiles), then tasks, the inverted
     * index and thread tiles of the dK/dV pass */
    ws_arena a = {NULL, 0}, probe = {NULL, 0};
    core_tile t;
    float *tmp;
    int64_t *blocks, *cursor;
    const size_t per = thread_bytes(p, &t, &probe, &tmp, &blocks, &cursor, 1);
    cpu_tasks tk;
    cpu_tasks_build(&tk, &a, p, NULL, position_runs, NULL);
    ws_take_threads(&a, ctx, per);
    cpu_tasks_build(&tk, &a, p, NULL, block_tiles, p);
    inv_index ix;
    inv_alloc(&ix, &a, p);
    ws_take_threads(&a, ctx, per);
    return nsa_size_add(a.used, 64);
}

void slc_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_tensor *q, const float *Kp, const float *Vp,
             const nsa_tensor *idx, const nsa_tensor *counts, const grad_src *g, float *dq32, float *dKp,
             float *dVp, void *ws)
{
    ws_arena a = {(char *)ws, 0};
    /* dQ: same traversal as the forward */
    per_position_pass(ctx, p, q, Kp, Vp, idx, counts, g, NULL, NULL, dq32, &a);

    cpu_tasks tk;
    cpu_tasks_build(&tk, &a, p, NULL, block_tiles, p);
    inv_index ix;
    inv_alloc(&ix, &a, p);
    core_tile t0;
    float *tmp0;
    int64_t *b0, *c0;
    ws_arena probe = {NULL, 0};
    const size_t per = thread_bytes(p, &t0, &probe, &tmp0, &b0, &c0, 1);
    char *thread_base = ws_take_threads(&a, ctx, per);
    const int64_t H = p->H, G = p->G, lp = p->cfg.slc_block, bq = positions_per_tile(p);
    const int64_t pairs = p->num_seqs * H;

#pragma omp parallel num_threads(cpu_threads(ctx))
    {
        ws_arena ta = cpu_thread_arena(thread_base, per, cpu_thread_id());
        core_tile t;
        float *tmp;
        int64_t *blocks, *cursor;
        thread_bytes(p, &t, &ta, &tmp, &blocks, &cursor, 1);

        /* invert: count, prefix, fill in ascending query order (serial within a (s, h) pair);
         * the lists hold query indices i (position q0 + i) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t pair = 0; pair < pairs; pair++) {
            const int64_t s = pair / H, h = pair % H;
            const cpu_seq sq = cpu_seq_get(p, NULL, s);
            const int64_t nb = seq_blocks(p, &sq);
            int32_t *off = inv_region(&ix, p, &sq, s, h), *list = off + nb + 1;
            for (int64_t j = 0; j <= nb; j++) off[j] = 0;
            for (int64_t i = 0; i < sq.qlen; i++) {
                int64_t n = usable_blocks(p, idx, counts, sq.b, sq.qrow0 + i, h, sq.q0 + i, nb, blocks);
                for (int64_t e = 0; e < n; e++) off[blocks[e] + 1]++;
            }
            for (int64_t j = 0; j < nb; j++) {
                off[j + 1] += off[j];
                cursor[j] = off[j];
            }
            for (int64_t i = 0; i < sq.qlen; i++) {
                int64_t n = usable_blocks(p, idx, counts, sq.b, sq.qrow0 + i, h, sq.q0 + i, nb, blocks);
                for (int64_t e = 0; e < n; e++) list[cursor[blocks[e]]++] = (int32_t)i;
            }
        }

        /* dK, dV of block j from the queries that selected it */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tk.total; task++) {
            int64_t s, h, j;
            cpu_tasks_decode(&tk, task, &s, &h, &j);
            const cpu_seq sq = cpu_seq_get(p, NULL, s);
            const int64_t nb = seq_blocks(p, &sq);
            const int32_t *off = inv_region(&ix, p, &sq, s, h), *list = off + nb + 1;
            const int64_t koff = (sq.b * H + h) * p->Tk + sq.row0;
            const float *K = Kp + koff * p->DK, *V = Vp + koff * p->DV;
            const int64_t c0 = nsa_rule_slc_lo(j, lp), c1 = nsa_rule_slc_end(j, lp, sq.len);
            t.dQ = NULL;
            for (int64_t e0 = off[j]; e0 < off[j + 1]; e0 += bq) {
                const int64_t nt = off[j + 1] - e0 < bq ? off[j + 1] - e0 : bq;
                t.R = (int)(nt * G);
                for (int64_t i = 0; i < nt; i++) {
                    const int64_t qi = list[e0 + i];
                    tile_load_rows(&t, (int)(i * G), q, p->scale, sq.b, sq.qrow0 + qi, h, G, g, tmp);
                    for (int64_t k = 0; k < G; k++) {
                        t.lo[i * G + k] = 0;
                        t.hi[i * G + k] = sq.q0 + qi;
                    }
                }
                core_bwd_block(&t, K, V, c0, c1, dKp + (koff + c0) * p->DK, dVp + (koff + c0) * p->DV);
            }
        }
    }
}
