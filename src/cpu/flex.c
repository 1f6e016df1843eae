/* flex.c -- block-sparse attention with mods (spec 14) on the CPU: the block lists checked on
 * the host before any write, then per (batch entry, query head, query block) the rows of that
 * block over the key blocks it lists: the partial ones through the mask_mod (evaluated per
 * pair), the full ones whole; every visible score through the score_mod; a two-pass softmax
 * per row (the max, then the weights), so that NaN and all -inf rows behave as spec 14 says. */
#include "common.h"

#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "../flex_route.h"
#include "../mod/expr.h"

/* A block-mask list entry as this call reads it (broadcast dims of size 1 read entry 0). */
static const int32_t *list_at(const nsa_tensor *t, int64_t b, int64_t h, int64_t qb)
{
    const int64_t bb = t->shape[0] == 1 ? 0 : b, hh = t->shape[1] == 1 ? 0 : h;
    return (const int32_t *)t->data + bb * t->stride[0] + hh * t->stride[1] + qb * t->stride[2];
}

static int32_t count_at(const nsa_tensor *t, int64_t b, int64_t h, int64_t qb) { return *list_at(t, b, h, qb); }

/* Counts within their lists, indices within the key blocks, each block once per query block:
 * checked before the first write, the first fault named (BAD_ARGUMENT). */
static nsa_status flex_check(const nsa_flex_args *a, const nsa_problem *p, unsigned char *seen, int64_t nkb)
{
    const nsa_block_mask *m = &a->block_mask;
    if (!nsa_present(&m->kv_num_blocks)) return NSA_STATUS_SUCCESS;
    const int64_t nqb = m->kv_num_blocks.shape[2];
    int64_t Bx, Hm; /* every (batch, head) the lists tell apart */
    flex_lists_extent(m, p, &Bx, &Hm);
    for (int64_t b = 0; b < Bx; b++)
        for (int64_t h = 0; h < Hm; h++)
            for (int64_t qb = 0; qb < nqb; qb++) {
                memset(seen, 0, (size_t)nkb);
                for (int full = 0; full < 2; full++) {
                    const nsa_tensor *nt = full ? &m->full_kv_num_blocks : &m->kv_num_blocks;
                    const nsa_tensor *it = full ? &m->full_kv_indices : &m->kv_indices;
                    if (!nsa_present(nt)) continue;
                    const char *nn = full ? "full_kv_num_blocks" : "kv_num_blocks", *in = full ? "full_kv_indices" : "kv_indices";
                    const int32_t cnt = count_at(nt, b, h, qb);
                    const int64_t width = it->shape[3];
                    if (cnt < 0 || cnt > width)
                        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "block_mask.%s[%" PRId64 ", %" PRId64 ", %" PRId64 "]: %d, must be "
                                        "in [0, %" PRId64 "] (the list width)", nn, b, h, qb, (int)cnt, width);
                    /* (an empty list's strides are not checked: no pointer into it unless it has entries) */
                    const int32_t *ix = cnt > 0 ? list_at(it, b, h, qb) : NULL;
                    for (int64_t e = 0; e < cnt; e++) {
                        const int32_t j = ix[e * it->stride[3]];
                        if (j < 0 || j >= nkb)
                            return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "block_mask.%s[%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64
                                            "]: key block %d outside [0, %" PRId64 ")", in, b, h, qb, e, (int)j, nkb);
                        if (seen[j])
                            return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "block_mask.%s[%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64
                                            "]: key block %d listed twice for query block %" PRId64, in, b, h, qb, e, (int)j, qb);
                        seen[j] = 1;
                    }
                }
            }
    return NSA_STATUS_SUCCESS;
}

nsa_status nsa_flex_lists_check(const nsa_flex_args *a, const nsa_problem *p)
{
    const int64_t nkb = p->Tk / a->block_mask.kv_block + (p->Tk % a->block_mask.kv_block != 0);
    unsigned char *seen = (unsigned char *)malloc((size_t)(nkb > 0 ? nkb : 1));
    if (!seen) return nsa_fail(NSA_STATUS_OUT_OF_MEMORY, "block_mask: no host memory to check the lists");
    const nsa_status st = flex_check(a, p, seen, nkb);
    free(seen);
    return st;
}

/* One thread's scratch: a query row, a K / V row, the output row, the row's scores and the
 * visible keys' indices (at most Tk each). */
typedef struct flex_scratch {
    float *q, *x, *acc, *sc;
    int64_t *key;
} flex_scratch;

static void flex_take(ws_arena *w, const nsa_problem *p, flex_scratch *s)
{
    s->q = (float *)ws_take_n(w, nsa_size_of(p->DK), sizeof(float));
    s->x = (float *)ws_take_n(w, nsa_size_of(p->DK > p->DV ? p->DK : p->DV), sizeof(float));
    s->acc = (float *)ws_take_n(w, nsa_size_of(p->DV), sizeof(float));
    s->sc = (float *)ws_take_n(w, nsa_size_of(p->Tk), sizeof(float));
    s->key = (int64_t *)ws_take_n(w, nsa_size_of(p->Tk), sizeof(int64_t));
}

static int64_t key_blocks(const nsa_flex_args *a, const nsa_problem *p)
{
    return p->Tk / a->block_mask.kv_block + (p->Tk % a->block_mask.kv_block != 0);
}

size_t nsa_cpu_flex_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_args *a)
{
    ws_arena one = {NULL, 0}, all = {NULL, 0};
    flex_scratch s;
    flex_take(&one, p, &s);
    ws_take_n(&all, nsa_size_of(key_blocks(a, p)), 1); /* the check's seen-set */
    ws_take_threads(&all, ctx, ws_region_bytes(&one));
    return nsa_size_add(all.used, 64);
}

/* The visible pairs of row i against key block j (partial: through the mask_mod), appended. */
static int64_t flex_block(const nsa_flex_args *a, const nsa_problem *p, int64_t b, int64_t hq, int64_t i, int64_t j, int partial,
                          int64_t *key, int64_t n)
{
    const int64_t k0 = j * a->block_mask.kv_block, k1 = k0 + a->block_mask.kv_block < p->Tk ? k0 + a->block_mask.kv_block : p->Tk;
    for (int64_t kv = k0; kv < k1; kv++)
        if (!partial || !a->mask_mod || expr_eval(a->mask_mod, b, hq, i, kv, 0.0f) != 0.0f) key[n++] = kv;
    return n;
}

/* The visible keys of row i of (b, hq), in list order, into key[]: @return their count. */
static int64_t flex_visible(const nsa_flex_args *a, const nsa_problem *p, int64_t b, int64_t hq, int64_t i, int64_t *key)
{
    const nsa_block_mask *m = &a->block_mask;
    const int64_t qb = i / m->q_block;
    int64_t n = 0;
    if (!nsa_present(&m->kv_num_blocks)) {
        for (int64_t j = 0, nkb = key_blocks(a, p); j < nkb; j++) n = flex_block(a, p, b, hq, i, j, 1, key, n);
        return n;
    }
    for (int full = 0; full < 2; full++) {
        const nsa_tensor *nt = full ? &m->full_kv_num_blocks : &m->kv_num_blocks;
        const nsa_tensor *it = full ? &m->full_kv_indices : &m->kv_indices;
        if (!nsa_present(nt)) continue;
        const int32_t cnt = count_at(nt, b, hq, qb);
        const int32_t *ix = cnt > 0 ? list_at(it, b, hq, qb) : NULL;
        for (int64_t e = 0; e < cnt; e++) n = flex_block(a, p, b, hq, i, ix[e * it->stride[3]], !full, key, n);
    }
    return n;
}

/* The scaled product of the loaded query row with key j (before the score_mod). */
static float flex_product(const nsa_flex_args *a, const nsa_problem *p, int64_t b, int64_t j, int64_t h, const float *q, float *x)
{
    io_load(&a->k, io_off(&a->k, b, j, h), p->DK, x);
    float s = 0.0f;
    for (int64_t d = 0; d < p->DK; d++) s += q[d] * x[d];
    return s * p->scale;
}

/* Row i of batch entry b, head hq: its visible keys, their (modified) scores, the softmax. */
static void flex_row(const nsa_flex_args *a, const nsa_problem *p, int64_t b, int64_t hq, int64_t i, flex_scratch *t)
{
    const int64_t h = hq / p->G, DV = p->DV;
    const int64_t n = flex_visible(a, p, b, hq, i, t->key);
    io_load(&a->q, io_off(&a->q, b, i, hq), p->DK, t->q);
    float mx = -INFINITY;
    for (int64_t e = 0; e < n; e++) {
        float s = flex_product(a, p, b, t->key[e], h, t->q, t->x);
        if (a->score_mod) s = expr_eval(a->score_mod, b, hq, i, t->key[e], s);
        t->sc[e] = s;
        mx = s > mx || s != s || mx != mx ? (mx != mx ? mx : s) : mx; /* NaN wins */
    }
    for (int64_t d = 0; d < DV; d++) t->acc[d] = 0.0f;
    float lse = -INFINITY;
    if (mx != -INFINITY) { /* a row whose scores are all -inf (or that sees no key) is empty */
        float l = 0.0f;
        for (int64_t e = 0; e < n; e++) {
            const float w = expf(t->sc[e] - mx); /* exp(-inf) = 0: a -inf score hides its pair */
            if (w == 0.0f) continue;
            l += w;
            io_load(&a->v, io_off(&a->v, b, t->key[e], h), DV, t->x);
            for (int64_t d = 0; d < DV; d++) t->acc[d] += w * t->x[d];
        }
        for (int64_t d = 0; d < DV; d++) t->acc[d] /= l;
        lse = mx + logf(l);
    }
    io_store(&a->o, io_off(&a->o, b, i, hq), DV, t->acc);
    if (nsa_present(&a->lse)) io_set(&a->lse, io_off(&a->lse, b, i, hq), lse);
}

nsa_status nsa_cpu_flex(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_args *a, void *ws)
{
    ws_arena one = {NULL, 0}, all = {(char *)ws, 0};
    flex_scratch probe;
    flex_take(&one, p, &probe);
    const size_t region = ws_region_bytes(&one);
    unsigned char *seen = (unsigned char *)ws_take_n(&all, nsa_size_of(key_blocks(a, p)), 1);
    char *regions = ws_take_threads(&all, ctx, region);
    const nsa_status st = flex_check(a, p, seen, key_blocks(a, p));
    if (st != NSA_STATUS_SUCCESS) return st;
    const int64_t nqb = p->T / a->block_mask.q_block + (p->T % a->block_mask.q_block != 0);
    const int64_t tasks = p->B * p->HQ * nqb;
#pragma omp parallel num_threads(cpu_threads(ctx))
    {
        ws_arena mine = {regions + (size_t)omp_get_thread_num() * region, 0};
        flex_scratch t;
        flex_take(&mine, p, &t);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t qb = task % nqb, hq = (task / nqb) % p->HQ, b = task / (nqb * p->HQ);
            const int64_t i1 = (qb + 1) * a->block_mask.q_block < p->T ? (qb + 1) * a->block_mask.q_block : p->T;
            for (int64_t i = qb * a->block_mask.q_block; i < i1; i++) flex_row(a, p, b, hq, i, &t);
        }
    }
    return NSA_STATUS_SUCCESS;
}

/* ---- the backward ---------------------------------------------------------------------------- */
/* Elements of the score_mod's tensors whose gradients are wanted (per thread, row-major). */
static int64_t grad_elems(const nsa_flex_bwd_args *a, int64_t *off)
{
    int64_t total = 0;
    const int n = a->fwd.score_mod ? expr_num_captures(a->fwd.score_mod) : 0;
    for (int c = 0; c < NSA_MOD_MAX_TENSORS; c++) {
        off[c] = -1;
        if (c >= n || !nsa_present(&a->dscore_tensors[c])) continue;
        const nsa_tensor *t = expr_capture_tensor(a->fwd.score_mod, c);
        int64_t cnt = 1;
        for (int d = 0; d < t->rank; d++) cnt *= t->shape[d];
        off[c] = total;
        total += cnt;
    }
    return total;
}

typedef struct flex_bwd_scratch {
    flex_scratch f;
    float *dq, *dkv, *dout, *o; /* dkv: [Tk, DK + DV] of the task's kv head */
    float *grads;                /* the thread's score_mod tensor gradients */
    void *expr;                  /* expr_grad's scratch */
} flex_bwd_scratch;

static void flex_bwd_take(ws_arena *w, const nsa_problem *p, const nsa_flex_bwd_args *a, int64_t gelems, flex_bwd_scratch *s)
{
    flex_take(w, p, &s->f);
    s->dq = (float *)ws_take_n(w, nsa_size_of(p->DK), sizeof(float));
    s->dkv = (float *)ws_take_n(w, nsa_size_mul(nsa_size_of(p->Tk), nsa_size_of(p->DK + p->DV)), sizeof(float));
    s->dout = (float *)ws_take_n(w, nsa_size_of(p->DV), sizeof(float));
    s->o = (float *)ws_take_n(w, nsa_size_of(p->DV), sizeof(float));
    s->grads = (float *)ws_take_n(w, nsa_size_of(gelems), sizeof(float));
    s->expr = ws_take_n(w, a->fwd.score_mod ? expr_scratch_bytes(a->fwd.score_mod) : 0, 1);
}

size_t nsa_cpu_flex_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_bwd_args *a)
{
    int64_t off[NSA_MOD_MAX_TENSORS];
    ws_arena one = {NULL, 0}, all = {NULL, 0};
    flex_bwd_scratch s;
    flex_bwd_take(&one, p, a, grad_elems(a, off), &s);
    ws_take_n(&all, nsa_size_of(key_blocks(&a->fwd, p)), 1);
    ws_take_threads(&all, ctx, ws_region_bytes(&one));
    return nsa_size_add(all.used, 64);
}

/* Rows of query head hq of batch entry b: dq, and their share of dk, dv (t->dkv) and of the
 * score_mod's tensor gradients (t->grads). The forward's lse gives P = exp(s - lse). */
static void flex_bwd_head(const nsa_flex_bwd_args *a, const nsa_problem *p, int64_t b, int64_t hq, float *const *grads,
                          flex_bwd_scratch *t)
{
    const nsa_flex_args *f = &a->fwd;
    const int64_t h = hq / p->G, DK = p->DK, DV = p->DV;
    for (int64_t i = 0; i < p->T; i++) {
        const float lse = io_get(&f->lse, io_off(&f->lse, b, i, hq));
        for (int64_t d = 0; d < DK; d++) t->dq[d] = 0.0f;
        if (lse != -INFINITY) { /* (an empty row has no gradient) */
            const int64_t n = flex_visible(f, p, b, hq, i, t->f.key);
            io_load(&f->q, io_off(&f->q, b, i, hq), DK, t->f.q);
            io_load(&a->dout, io_off(&a->dout, b, i, hq), DV, t->dout);
            io_load(&f->o, io_off(&f->o, b, i, hq), DV, t->o);
            float Drow = 0.0f;
            for (int64_t d = 0; d < DV; d++) Drow += t->dout[d] * t->o[d];
            for (int64_t e = 0; e < n; e++) {
                const int64_t j = t->f.key[e];
                const float u = flex_product(f, p, b, j, h, t->f.q, t->f.x);
                const float s = f->score_mod ? expr_eval(f->score_mod, b, hq, i, j, u) : u;
                const float P = expf(s - lse);
                if (P == 0.0f) continue; /* (a -inf score: a hidden pair) */
                float *dk = t->dkv + j * (DK + DV), *dv = dk + DK;
                io_load(&f->v, io_off(&f->v, b, j, h), DV, t->f.x);
                float dP = 0.0f;
                for (int64_t d = 0; d < DV; d++) dP += t->dout[d] * t->f.x[d], dv[d] += P * t->dout[d];
                const float dS = P * (dP - Drow);
                float dU = dS;
                if (f->score_mod) expr_grad(f->score_mod, b, hq, i, j, u, dS, &dU, grads, t->expr);
                io_load(&f->k, io_off(&f->k, b, j, h), DK, t->f.x);
                const float w = dU * p->scale;
                for (int64_t d = 0; d < DK; d++) t->dq[d] += w * t->f.x[d], dk[d] += w * t->f.q[d];
            }
        }
        io_store(&a->dq, io_off(&a->dq, b, i, hq), DK, t->dq);
    }
}

nsa_status nsa_cpu_flex_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_bwd_args *a, void *ws)
{
    int64_t off[NSA_MOD_MAX_TENSORS];
    const int64_t gelems = grad_elems(a, off);
    ws_arena one = {NULL, 0}, all = {(char *)ws, 0};
    flex_bwd_scratch probe;
    flex_bwd_take(&one, p, a, gelems, &probe);
    const size_t region = ws_region_bytes(&one);
    unsigned char *seen = (unsigned char *)ws_take_n(&all, nsa_size_of(key_blocks(&a->fwd, p)), 1);
    char *regions = ws_take_threads(&all, ctx, region);
    const nsa_status st = flex_check(&a->fwd, p, seen, key_blocks(&a->fwd, p));
    if (st != NSA_STATUS_SUCCESS) return st;
    int team = 1; /* the threads that ran (each zeroed its own sums) */
    const int64_t tasks = p->B * p->H, DK = p->DK, DV = p->DV;
#pragma omp parallel num_threads(cpu_threads(ctx))
    {
#pragma omp single
        team = omp_get_num_threads();
        ws_arena mine = {regions + (size_t)omp_get_thread_num() * region, 0};
        flex_bwd_scratch t;
        flex_bwd_take(&mine, p, a, gelems, &t);
        float *grads[NSA_MOD_MAX_TENSORS];
        for (int c = 0; c < NSA_MOD_MAX_TENSORS; c++) grads[c] = off[c] >= 0 ? t.grads + off[c] : NULL;
        for (int64_t e = 0; e < gelems; e++) t.grads[e] = 0.0f;
        /* static: each thread's tasks and so its sums' order are fixed for a thread count */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t h = task % p->H, b = task / p->H;
            for (int64_t e = 0; e < p->Tk * (DK + DV); e++) t.dkv[e] = 0.0f;
            for (int64_t g = 0; g < p->G; g++) flex_bwd_head(a, p, b, h * p->G + g, grads, &t);
            for (int64_t j = 0; j < p->Tk; j++) {
                io_store(&a->dk, io_off(&a->dk, b, j, h), DK, t.dkv + j * (DK + DV));
                io_store(&a->dv, io_off(&a->dv, b, j, h), DV, t.dkv + j * (DK + DV) + DK);
            }
        }
    }
    /* the tensors' gradients: the threads' sums, added in thread order */
    for (int c = 0; c < NSA_MOD_MAX_TENSORS; c++) {
        if (off[c] < 0) continue;
        const nsa_tensor *src = expr_capture_tensor(a->fwd.score_mod, c), *dst = &a->dscore_tensors[c];
        int64_t cnt = 1, idx[NSA_MAX_RANK] = {0};
        for (int d = 0; d < src->rank; d++) cnt *= src->shape[d];
        for (int64_t e = 0; e < cnt; e++) {
            double sum = 0.0;
            for (int th = 0; th < team; th++) {
                ws_arena mine = {regions + (size_t)th * region, 0};
                flex_bwd_scratch t;
                flex_bwd_take(&mine, p, a, gelems, &t);
                sum += t.grads[off[c] + e];
            }
            int64_t o = 0; /* element e (row-major) in the output's strides */
            for (int d = 0; d < dst->rank; d++) o += idx[d] * dst->stride[d];
            ((float *)dst->data)[o] = (float)sum;
            for (int d = dst->rank - 1; d >= 0; d--) { /* next multi-index */
                if (++idx[d] < dst->shape[d]) break;
                idx[d] = 0;
            }
        }
    }
    return NSA_STATUS_SUCCESS;
}

/* ---- create_block_mask ----------------------------------------------------------------------- */
static nsa_status list_view_check(const nsa_tensor *t, const char *name, int rank, const int64_t *want)
{
    if (!t->data) return nsa_fail(NSA_STATUS_NULL_POINTER, "mask->%s: data is NULL", name);
    if (t->rank != rank) return nsa_fail(NSA_STATUS_BAD_RANK, "mask->%s: rank %d, must be %d", name, (int)t->rank, rank);
    if (t->dtype != NSA_DTYPE_I32) return nsa_fail(NSA_STATUS_BAD_DTYPE, "mask->%s: %s, must be i32", name, nsa_dtype_name(t->dtype));
    for (int d = 0; d < rank; d++) {
        if (want[d] >= 0 && t->shape[d] != want[d])
            return nsa_fail(NSA_STATUS_BAD_SHAPE, "mask->%s: dim %d is %" PRId64 ", must be %" PRId64, name, d, t->shape[d], want[d]);
        if (t->stride[d] < 0 || (t->shape[d] > 1 && t->stride[d] == 0) || (d == rank - 1 && t->stride[d] != 1 && t->shape[d] > 1))
            return nsa_fail(NSA_STATUS_BAD_STRIDE, "mask->%s: stride[%d] is %" PRId64, name, d, t->stride[d]);
    }
    int64_t last = 0; /* the largest element offset, which every write stays within */
    for (int d = 0; d < rank; d++) {
        if (t->shape[d] == 0) return NSA_STATUS_SUCCESS; /* (empty: nothing is written) */
        if (t->shape[d] > 1 && t->stride[d] > (INT64_MAX - last) / (t->shape[d] - 1))
            return nsa_fail(NSA_STATUS_SIZE_OVERFLOW, "mask->%s: stride[%d] %" PRId64 " over dim %" PRId64 " overflows int64 offsets",
                            name, d, t->stride[d], t->shape[d]);
        last += (t->shape[d] - 1) * t->stride[d];
    }
    return NSA_STATUS_SUCCESS;
}

nsa_status nsa_create_block_mask(const nsa_mod *mask_mod, int64_t Tq, int64_t Tk, nsa_block_mask *mask)
{
    nsa_detail_clear();
    if (!mask) return nsa_fail(NSA_STATUS_NULL_POINTER, "mask is NULL");
    if (mask_mod && expr_kind_of(mask_mod) != EXPR_MASK)
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "mask_mod: a score_mod (NSA_MOD_SCORE) given as the mask_mod");
    if (Tq < 0 || Tk < 0 || Tq > INT32_MAX || Tk > INT32_MAX)
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%s: %" PRId64 ", must be in [0, INT32_MAX]", Tq < 0 || Tq > INT32_MAX ? "Tq" : "Tk",
                        Tq < 0 || Tq > INT32_MAX ? Tq : Tk);
    if (mask->q_block < 1 || mask->q_block > INT32_MAX || mask->kv_block < 1 || mask->kv_block > INT32_MAX)
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "mask->%s: must be in [1, INT32_MAX]",
                        mask->q_block < 1 || mask->q_block > INT32_MAX ? "q_block" : "kv_block");
    const int64_t nqb = Tq / mask->q_block + (Tq % mask->q_block != 0), nkb = Tk / mask->kv_block + (Tk % mask->kv_block != 0);
    const nsa_tensor *cnt = &mask->kv_num_blocks;
    if (cnt->rank != 3) return nsa_fail(NSA_STATUS_BAD_RANK, "mask->kv_num_blocks: rank %d, must be 3", (int)cnt->rank);
    const int64_t Bm = cnt->shape[0], Hm = cnt->shape[1];
    if (Bm < 0 || Hm < 0 || (Bm && Hm && (nqb * nkb) > INT64_MAX / Bm / Hm))
        return nsa_fail(NSA_STATUS_BAD_SHAPE, "mask->kv_num_blocks: dims 0, 1 are %" PRId64 ", %" PRId64, Bm, Hm);
    const int64_t wc[3] = {Bm, Hm, nqb}, wl[4] = {Bm, Hm, nqb, nkb};
    nsa_status st;
    if ((st = list_view_check(&mask->kv_num_blocks, "kv_num_blocks", 3, wc)) != NSA_STATUS_SUCCESS ||
        (st = list_view_check(&mask->kv_indices, "kv_indices", 4, wl)) != NSA_STATUS_SUCCESS ||
        (st = list_view_check(&mask->full_kv_num_blocks, "full_kv_num_blocks", 3, wc)) != NSA_STATUS_SUCCESS ||
        (st = list_view_check(&mask->full_kv_indices, "full_kv_indices", 4, wl)) != NSA_STATUS_SUCCESS)
        return st;
    /* mods that are attention options (the dense route's forms, Tq == Tk): each row sees one
       interval of keys, so a block's class follows from its first and last rows -- no pair is
       evaluated; documents need their ids as one run each (else every pair is) */
    expr_attention opt;
    int32_t *cu = NULL;
    int64_t nseq = 0;
    int analytic = Tq == Tk && Tq >= 1 && expr_as_attention(mask_mod, NULL, &opt);
    if (analytic && opt.doc >= 0) {
        const nsa_tensor *d = expr_capture_tensor(mask_mod, opt.doc);
        int32_t *ids = d->shape[0] >= Tq ? (int32_t *)malloc((size_t)Tq * sizeof(int32_t)) : NULL;
        cu = ids ? (int32_t *)malloc((size_t)(Tq + 1) * sizeof(int32_t)) : NULL;
        if (cu) flex_route_gather_doc(d, Tq, ids);
        nseq = cu ? flex_route_doc_runs(ids, Tq, cu) : 0;
        analytic = nseq > 0;
        free(ids);
    }
    const int64_t rows = Bm * Hm * nqb;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t qb = row % nqb, h = row / nqb % Hm, b = row / nqb / Hm;
        int32_t *np = (int32_t *)list_at(&mask->kv_num_blocks, b, h, qb), *fp = (int32_t *)list_at(&mask->full_kv_num_blocks, b, h, qb);
        /* (lists of width 0 -- no key blocks -- get no pointer: an empty view's strides are unchecked) */
        int32_t *ip = nkb > 0 ? (int32_t *)list_at(&mask->kv_indices, b, h, qb) : NULL;
        int32_t *fip = nkb > 0 ? (int32_t *)list_at(&mask->full_kv_indices, b, h, qb) : NULL;
        int32_t n = 0, nf = 0;
        const int64_t q0 = qb * mask->q_block, q1 = q0 + mask->q_block < Tq ? q0 + mask->q_block : Tq;
        int64_t some_lo = 0, some_hi = 0, all_lo = 0, all_hi = 0;
        if (analytic) flex_route_block_keys(&opt, Tq, cu, nseq, q0, q1 - 1, &some_lo, &some_hi, &all_lo, &all_hi);
        for (int64_t j = 0; j < nkb; j++) {
            const int64_t k0 = j * mask->kv_block, k1 = k0 + mask->kv_block < Tk ? k0 + mask->kv_block : Tk;
            int shown = 0, hidden = 0; /* some pair visible, some hidden: enough for a partial block */
            if (analytic) {
                shown = k0 <= some_hi && k1 - 1 >= some_lo;
                hidden = !(all_lo <= k0 && k1 - 1 <= all_hi);
            } else {
                for (int64_t i = q0; i < q1 && !(shown && hidden); i++)
                    for (int64_t kv = k0; kv < k1 && !(shown && hidden); kv++) {
                        const int v = !mask_mod || expr_eval(mask_mod, b, h, i, kv, 0.0f) != 0.0f;
                        shown |= v, hidden |= !v;
                    }
            }
            if (shown && !hidden) fip[(nf++) * mask->full_kv_indices.stride[3]] = (int32_t)j;
            else if (shown) ip[(n++) * mask->kv_indices.stride[3]] = (int32_t)j;
        }
        for (int32_t e = n; e < nkb; e++) ip[e * mask->kv_indices.stride[3]] = -1;
        for (int32_t e = nf; e < nkb; e++) fip[e * mask->full_kv_indices.stride[3]] = -1;
        *np = n, *fp = nf;
    }
    free(cu);
    return NSA_STATUS_SUCCESS;
}
