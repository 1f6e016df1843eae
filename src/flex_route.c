/* flex_route.c -- the dense route of block-sparse attention (flex_route.h, docs/spec.md 14). */
#include "flex_route.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"

static int g_route = -1; /* -1: NSA_FLEX_ROUTE not read yet (atomics: calls may come from several threads) */

int flex_route_enabled(void)
{
    int on = __atomic_load_n(&g_route, __ATOMIC_RELAXED);
    if (on < 0) {
        const char *e = getenv("NSA_FLEX_ROUTE");
        on = !(e && e[0] == '0' && e[1] == 0);
        int unset = -1; /* (a switch set meanwhile wins) */
        if (!__atomic_compare_exchange_n(&g_route, &unset, on, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) on = unset;
    }
    return on;
}

void flex_route_set_enabled(int on) { __atomic_store_n(&g_route, on != 0, __ATOMIC_RELAXED); }

static long g_taken;
long flex_route_taken(void) { return __atomic_load_n(&g_taken, __ATOMIC_RELAXED); }
void flex_route_note_taken(void) { __atomic_add_fetch(&g_taken, 1, __ATOMIC_RELAXED); }

int flex_route_plan(const nsa_flex_args *a, const nsa_problem *p, flex_route *r)
{
    memset(r, 0, sizeof *r);
    if (!flex_route_enabled() || p->T != p->Tk || p->T < 1 || p->T > INT32_MAX) return 0;
    if (!expr_as_attention(a->mask_mod, a->score_mod, &r->m) || r->m.prefix > 0) return 0; /* (prefix-LM: no option) */
    if (r->m.doc >= 0) {
        /* one packed batch of documents (varlen needs B = 1); ids for every row, so that no read
         * of the mod's clamps and the runs are those of doc[0 .. T) */
        const nsa_tensor *d = expr_capture_tensor(a->mask_mod, r->m.doc);
        if (p->B != 1 || d->rank != 1 || d->shape[0] < p->T) return 0;
        r->doc = d;
    }
    return 1;
}

void flex_route_host_free(flex_route_host *h)
{
    for (int i = 0; i < 5; i++) free(h->owned[i]), h->owned[i] = NULL;
    h->doc = NULL;
}

/* The largest |element| of a [B, T, H, D] view (NaN when one is NaN). */
static float view_absmax(const nsa_tensor *t)
{
    const int es = (int)nsa_dtype_size(t->dtype);
    float mx = 0.0f;
    for (int64_t i0 = 0; i0 < t->shape[0]; i0++)
        for (int64_t i1 = 0; i1 < t->shape[1]; i1++)
            for (int64_t i2 = 0; i2 < t->shape[2]; i2++) {
                const char *row = (const char *)t->data + (i0 * t->stride[0] + i1 * t->stride[1] + i2 * t->stride[2]) * es;
                for (int64_t e = 0; e < t->shape[3]; e++) {
                    uint16_t h = 0;
                    float x;
                    if (es == 4) memcpy(&x, row + e * 4, 4);
                    else memcpy(&h, row + e * 2, 2), x = t->dtype == NSA_DTYPE_F16 ? nsa_f16_to_f32(h) : nsa_bf16_to_f32(h);
                    x = fabsf(x);
                    if (x != x) return x;
                    mx = x > mx ? x : mx;
                }
            }
    return mx;
}

nsa_status flex_route_host_cpu(const nsa_flex_args *a, const nsa_problem *p, const flex_route *r, flex_route_host *h)
{
    memset(h, 0, sizeof *h);
    h->lists = a->block_mask;
    if (r->doc && !a->doc_runs) {
        h->doc = (int32_t *)malloc((size_t)p->T * sizeof(int32_t));
        if (!h->doc) return nsa_fail(NSA_STATUS_OUT_OF_MEMORY, "mask_mod: no host memory for the document ids");
        h->owned[0] = h->doc;
        flex_route_gather_doc(r->doc, p->T, h->doc);
    }
    if (flex_route_needs_scan(r)) h->qmax = view_absmax(&a->q), h->kmax = view_absmax(&a->k);
    return NSA_STATUS_SUCCESS;
}

static int cmp_i32(const void *x, const void *y)
{
    const int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return (a > b) - (a < b);
}

int64_t flex_route_doc_runs(const int32_t *doc, int64_t T, int32_t *cu)
{
    int64_t n = 0;
    cu[0] = 0;
    for (int64_t i = 1; i <= T; i++)
        if (i == T || doc[i] != doc[i - 1]) cu[++n] = (int32_t)i;
    int32_t *ids = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    if (!ids) return -1;
    for (int64_t s = 0; s < n; s++) ids[s] = doc[cu[s]];
    qsort(ids, (size_t)n, sizeof(int32_t), cmp_i32);
    int distinct = 1;
    for (int64_t s = 1; s < n && distinct; s++) distinct = ids[s] != ids[s - 1];
    free(ids);
    return distinct ? n : 0;
}

void flex_route_gather_doc(const nsa_tensor *doc, int64_t T, int32_t *out)
{
    for (int64_t i = 0; i < T; i++) out[i] = ((const int32_t *)doc->data)[i * doc->stride[0]];
}

/* The keys row i sees under the options, [*lo, *hi]. */
static void row_keys(const expr_attention *m, int64_t T, const int32_t *cu, int64_t n, int64_t i, int64_t *lo, int64_t *hi)
{
    int64_t l = 0, h = T - 1;
    if (cu) {
        int64_t a = 0, b = n - 1; /* the last run starting at or before i */
        while (a < b) {
            const int64_t m = (a + b + 1) / 2;
            if (cu[m] <= i) a = m;
            else b = m - 1;
        }
        l = cu[a], h = cu[a + 1] - 1;
    }
    if (m->window_left >= 0 && i - m->window_left > l) l = i - m->window_left;
    if (m->causal) {
        if (i < h) h = i;
    } else if (m->window_right >= 0 && m->window_right < h - i) {
        h = i + m->window_right;
    }
    if (m->prefix > 0 && h < (m->prefix < T ? m->prefix : T) - 1) h = (m->prefix < T ? m->prefix : T) - 1; /* (alone: l = 0) */
    *lo = l, *hi = h;
}

void flex_route_block_keys(const expr_attention *m, int64_t T, const int32_t *cu, int64_t n, int64_t r0, int64_t r1,
                           int64_t *some_lo, int64_t *some_hi, int64_t *all_lo, int64_t *all_hi)
{
    int64_t lo0, hi0, lo1, hi1;
    row_keys(m, T, cu, n, r0, &lo0, &hi0);
    row_keys(m, T, cu, n, r1, &lo1, &hi1);
    *some_lo = lo0, *some_hi = hi1, *all_lo = lo1, *all_hi = hi0;
}

static int32_t list_at(const nsa_tensor *t, int64_t b, int64_t h, int64_t i, int64_t e)
{
    const int64_t bb = t->shape[0] == 1 ? 0 : b, hh = t->shape[1] == 1 ? 0 : h;
    return ((const int32_t *)t->data)[bb * t->stride[0] + hh * t->stride[1] + i * t->stride[2] + e * (t->rank == 4 ? t->stride[3] : 0)];
}

void flex_lists_extent(const nsa_block_mask *m, const nsa_problem *p, int64_t *Bm, int64_t *Hm)
{
    const nsa_tensor *all[4] = {&m->kv_num_blocks, &m->kv_indices, &m->full_kv_num_blocks, &m->full_kv_indices};
    *Bm = *Hm = 0;
    if (p->B == 0 || p->HQ == 0) return; /* nothing to walk, nothing to compute */
    for (int t = 0; t < 4; t++)
        if (nsa_present(all[t])) {
            *Bm = all[t]->shape[0] > *Bm ? all[t]->shape[0] : *Bm;
            *Hm = all[t]->shape[1] > *Hm ? all[t]->shape[1] : *Hm;
        }
}

int flex_route_decide(const flex_route *r, const flex_route_host *h, const nsa_problem *p, int32_t *cu, int64_t *nseq)
{
    const int64_t T = p->T;
    *nseq = 0;
    if (h->decline) return 0;
    if (flex_route_needs_scan(r) && !h->scores_on_device) { /* (NaN fails the comparison too) */
        const double bound = (double)p->scale * (double)p->DK * (double)h->qmax * (double)h->kmax;
        if (!(bound < (double)FLT_MAX / 4.0)) return 0;
    }
    if (r->doc && h->runs) { /* (validated: bounds from 0 to T, increasing) */
        memcpy(cu, h->runs, (size_t)(h->nruns + 1) * sizeof(int32_t));
        *nseq = h->nruns;
    } else if (r->doc) {
        const int64_t n = flex_route_doc_runs(h->doc, T, cu);
        if (n <= 0) return (int)n;
        *nseq = n;
    }
    const nsa_block_mask *m = &h->lists;
    if (!nsa_present(&m->kv_num_blocks)) return 1; /* every key block partial: the mask_mod decides every pair */
    const int64_t qb = m->q_block, kb = m->kv_block, nqb = (T + qb - 1) / qb, nkb = (T + kb - 1) / kb;
    const int full = nsa_present(&m->full_kv_num_blocks);
    /* per key block, the (b, h, query block) stamp that last listed it */
    int64_t *seen = (int64_t *)malloc((size_t)nkb * sizeof(int64_t));
    if (!seen) return -1;
    for (int64_t j = 0; j < nkb; j++) seen[j] = -1;
    /* every (batch, head) any of the four tensors tells apart (each broadcasts its own size-1 dims) */
    int64_t Bm, Hm;
    flex_lists_extent(m, p, &Bm, &Hm);
    const int32_t *cuv = r->doc ? cu : NULL;
    int ok = 1;
    int64_t stamp = 0;
    for (int64_t b = 0; b < Bm && ok; b++)
        for (int64_t hh = 0; hh < Hm && ok; hh++)
            for (int64_t i = 0; i < nqb && ok; i++, stamp++) {
                const int64_t np = list_at(&m->kv_num_blocks, b, hh, i, 0), nf = full ? list_at(&m->full_kv_num_blocks, b, hh, i, 0) : 0;
                for (int64_t e = 0; e < np; e++) {
                    const int32_t j = list_at(&m->kv_indices, b, hh, i, e);
                    seen[j] = stamp;
                }
                for (int64_t e = 0; e < nf; e++) {
                    const int32_t j = list_at(&m->full_kv_indices, b, hh, i, e);
                    seen[j] = stamp;
                }
                const int64_t r0 = i * qb, r1 = (i + 1) * qb < T ? (i + 1) * qb - 1 : T - 1;
                int64_t some_lo, some_hi, all_lo, all_hi;
                flex_route_block_keys(&r->m, T, cuv, *nseq, r0, r1, &some_lo, &some_hi, &all_lo, &all_hi);
                /* every block some row sees listed; a full block's pairs all shown */
                for (int64_t j = some_lo / kb; j <= some_hi / kb && ok; j++) ok = seen[j] == stamp;
                for (int64_t e = 0; e < nf && ok; e++) {
                    const int64_t j = list_at(&m->full_kv_indices, b, hh, i, e);
                    const int64_t k0 = j * kb, k1 = (j + 1) * kb < T ? (j + 1) * kb - 1 : T - 1;
                    ok = all_lo <= k0 && k1 <= all_hi;
                }
            }
    free(seen);
    return ok;
}

void flex_route_args(const flex_route *r, const nsa_flex_args *a, const nsa_tensor *lse, const int32_t *cu, int64_t nseq,
                     nsa_attention_args *out)
{
    memset(out, 0, sizeof *out);
    out->q = a->q, out->k = a->k, out->v = a->v, out->o = a->o, out->lse = *lse;
    out->scale = a->scale;
    out->causal = r->m.causal;
    out->window_left = r->m.window_left;
    out->window_right = r->m.causal ? -1 : r->m.window_right;
    out->softcap = r->m.softcap;
    if (cu) out->varlen.cu_seqlens = cu, out->varlen.num_seqs = nseq;
}
