/* test_step.c -- the inference step (spec 12) on the CPU. Sequences are fed to nsa_step in
 * random steps (a prefill chunk, then decode steps of one token and multi-token steps, a
 * different count per sequence, some sequences idle) over contiguous and paged caches with
 * shuffled pages; every step's outputs and selections must equal nsa_forward's rows over the
 * whole sequences (f32: the same function, only the order of fp32 sums differs). Also: the
 * caller's compressed cache, a step whose tokens the caller appended, the caller's selection
 * (block_indices), and bad lengths, counts,
 * pages and shapes, each refused with a detail naming the argument and no byte written. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "nsa.h"
#include "sweep.h" /* sweep_memory: the device's memory hooks */

enum { ST_B = 3, ST_HQ = 4, ST_H = 2, ST_DK = 16, ST_DV = 12 };

/* Device runs (test_step_on with memory hooks): every buffer a step reads or writes is mirrored
 * into device memory and its outputs come back, so the checks read host memory. */
static const sweep_memory *g_mem;

typedef struct seqdata {
    int64_t T;
    float *q, *k, *v, *g[3]; /* [T, HQ, DK], [T, H, DK], [T, H, DV], gates [T, HQ] */
    float *o_ref;            /* nsa_forward's o [T, HQ, DV] */
    int32_t *idx_ref;        /* its selection [T, H, n] */
} seqdata;

static float *rnd(test_rng *r, int64_t n, double lo, double hi)
{
    float *x = (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = (float)(lo + (hi - lo) * rng_uniform(r));
    return x;
}

static nsa_config step_config(void)
{
    nsa_config c = nsa_config_default();
    c.cmp_len = 8, c.cmp_stride = 4, c.slc_block = 16, c.slc_topk = 4, c.n_init = 1, c.n_local = 1, c.window = 20;
    c.scale = 0.3f, c.swa_scale = 0.25f;
    return c;
}

/* nsa_forward over one whole sequence (B = 1): the reference rows. gates: bit 0 cmp, 1 slc, 2 swa. */
static void forward_ref(nsa_context *ctx, const nsa_config *cfg, seqdata *s, int gates)
{
    const int64_t T = s->T, n = cfg->slc_topk;
    nsa_forward_args a;
    memset(&a, 0, sizeof a);
    a.q = nsa_tensor_4d(s->q, NSA_DTYPE_F32, 1, T, ST_HQ, ST_DK);
    a.k = nsa_tensor_4d(s->k, NSA_DTYPE_F32, 1, T, ST_H, ST_DK);
    a.v = nsa_tensor_4d(s->v, NSA_DTYPE_F32, 1, T, ST_H, ST_DV);
    nsa_tensor *g[3] = {&a.g_cmp, &a.g_slc, &a.g_swa};
    nsa_tensor *ob[3] = {&a.saved.o_cmp, &a.saved.o_slc, &a.saved.o_swa};
    nsa_tensor *lb[3] = {&a.saved.lse_cmp, &a.saved.lse_slc, &a.saved.lse_swa};
    float *keep[6] = {0};
    for (int x = 0; x < 3; x++) {
        if (!(gates >> x & 1)) continue;
        *g[x] = nsa_tensor_3d(s->g[x], NSA_DTYPE_F32, 1, T, ST_HQ);
        keep[2 * x] = (float *)malloc((size_t)(T * ST_HQ * ST_DV + 1) * sizeof(float));
        keep[2 * x + 1] = (float *)malloc((size_t)(T * ST_HQ + 1) * sizeof(float));
        *ob[x] = nsa_tensor_4d(keep[2 * x], NSA_DTYPE_F32, 1, T, ST_HQ, ST_DV);
        *lb[x] = nsa_tensor_3d(keep[2 * x + 1], NSA_DTYPE_F32, 1, T, ST_HQ);
    }
    s->o_ref = (float *)malloc((size_t)(T * ST_HQ * ST_DV + 1) * sizeof(float));
    s->idx_ref = (int32_t *)malloc((size_t)(T * ST_H * n + 1) * sizeof(int32_t));
    a.o = nsa_tensor_4d(s->o_ref, NSA_DTYPE_F32, 1, T, ST_HQ, ST_DV);
    if (gates & 2) a.saved.block_indices = nsa_tensor_4d(s->idx_ref, NSA_DTYPE_I32, 1, T, ST_H, n);
    a.config = *cfg;
    size_t need = 0;
    CHECK_STATUS(nsa_forward_workspace_size(ctx, &a, &need), NSA_STATUS_SUCCESS);
    void *ws = malloc(need ? need : 1);
    CHECK_STATUS(nsa_forward(ctx, &a, ws, need), NSA_STATUS_SUCCESS);
    free(ws);
    for (int x = 0; x < 6; x++) free(keep[x]);
}

/* A step's caches and the host arrays behind them. */
typedef struct caches {
    int64_t cap, ccap, page, pool, cpool, pps, cpps;
    int paged;
    float *k, *v, *kc, *vc;
    int32_t *bt, *cbt;
} caches;

static void shuffle(test_rng *r, int32_t *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) x[i] = (int32_t)i;
    for (int64_t i = n - 1; i > 0; i--) {
        const int64_t j = rng_int(r, 0, i);
        const int32_t t = x[i];
        x[i] = x[j], x[j] = t;
    }
}

static void caches_make(caches *c, test_rng *r, const nsa_config *cfg, int64_t cap, int paged, int64_t page)
{
    memset(c, 0, sizeof *c);
    c->cap = cap, c->paged = paged, c->page = page;
    c->ccap = nsa_num_cmp_blocks(cfg, cap);
    if (paged) {
        c->pps = (cap + page - 1) / page, c->cpps = (c->ccap + page - 1) / page;
        c->pool = ST_B * c->pps + 3, c->cpool = ST_B * c->cpps + 2; /* spare pages nobody uses */
        int32_t *perm = (int32_t *)malloc((size_t)(c->pool + c->cpool) * sizeof(int32_t));
        c->bt = (int32_t *)malloc((size_t)(ST_B * c->pps + 1) * sizeof(int32_t));
        c->cbt = (int32_t *)malloc((size_t)(ST_B * c->cpps + 1) * sizeof(int32_t));
        shuffle(r, perm, c->pool);
        memcpy(c->bt, perm, (size_t)(ST_B * c->pps) * sizeof(int32_t));
        shuffle(r, perm, c->cpool);
        memcpy(c->cbt, perm, (size_t)(ST_B * c->cpps) * sizeof(int32_t));
        free(perm);
    }
    const int64_t rows = paged ? c->pool * page : ST_B * cap, crows = paged ? c->cpool * page : ST_B * c->ccap;
    c->k = rnd(r, rows * ST_H * ST_DK, -9, 9), c->v = rnd(r, rows * ST_H * ST_DV, -9, 9); /* garbage until written */
    c->kc = rnd(r, crows * ST_H * ST_DK, -9, 9), c->vc = rnd(r, crows * ST_H * ST_DV, -9, 9);
}

static void caches_free(caches *c) { free(c->k), free(c->v), free(c->kc), free(c->vc), free(c->bt), free(c->cbt); }

static nsa_kv_cache view_of(float *k, float *v, int32_t *bt, int64_t d0, int64_t d1, int64_t pps)
{
    nsa_kv_cache x;
    memset(&x, 0, sizeof x);
    x.k = nsa_tensor_4d(k, NSA_DTYPE_F32, d0, d1, ST_H, ST_DK);
    x.v = nsa_tensor_4d(v, NSA_DTYPE_F32, d0, d1, ST_H, ST_DV);
    if (bt) x.block_table = nsa_tensor_make(bt, NSA_DTYPE_I32, 2, (int64_t[]){ST_B, pps});
    return x;
}

static nsa_kv_cache token_cache(caches *c)
{
    return c->paged ? view_of(c->k, c->v, c->bt, c->pool, c->page, c->pps) : view_of(c->k, c->v, NULL, ST_B, c->cap, 0);
}

static nsa_kv_cache cmp_cache(caches *c)
{
    return c->paged ? view_of(c->kc, c->vc, c->cbt, c->cpool, c->page, c->cpps) : view_of(c->kc, c->vc, NULL, ST_B, c->ccap, 0);
}

/* Row r of sequence b of a cache (host arrays): the element offset of [r, h = 0, d = 0]. */
static int64_t host_row(const caches *c, int cmp, int64_t b, int64_t r, int64_t D)
{
    if (!c->paged) return ((b * (cmp ? c->ccap : c->cap)) + r) * ST_H * D;
    const int32_t pg = (cmp ? c->cbt[b * c->cpps + r / c->page] : c->bt[b * c->pps + r / c->page]);
    return ((int64_t)pg * c->page + r % c->page) * ST_H * D;
}

/* The caller's compressed rows 0 .. Nc(L) - 1 of sequence b (mean pooling, as nsa_compress). */
static void caller_pool(caches *c, const nsa_config *cfg, const seqdata *s, int64_t b, int64_t L)
{
    const int64_t nc = nsa_num_cmp_blocks(cfg, L);
    for (int64_t i = 0; i < nc; i++)
        for (int x = 0; x < 2; x++) {
            const int64_t D = x ? ST_DV : ST_DK;
            const float *src = x ? s->v : s->k;
            float *dst = (x ? c->vc : c->kc) + host_row(c, 1, b, i, D);
            for (int64_t h = 0; h < ST_H; h++)
                for (int64_t e = 0; e < D; e++) {
                    float sum = 0.0f;
                    for (int64_t t = i * cfg->cmp_stride; t < i * cfg->cmp_stride + cfg->cmp_len; t++) sum += src[(t * ST_H + h) * D + e];
                    dst[h * D + e] = sum * (1.0f / (float)cfg->cmp_len);
                }
        }
}

/* One buffer of a mirrored call: host copy, device copy, bytes, written by the step. */
typedef struct mirror_t {
    void *host, *dev;
    size_t bytes;
    int out;
} mirror_t;

static void mirror(mirror_t *m, int *nm, nsa_tensor *t, size_t bytes, int out)
{
    if (!t->data) return;
    for (int i = 0; i < *nm; i++)
        if (m[i].host == t->data) { /* one buffer behind two views (gates) */
            t->data = m[i].dev;
            return;
        }
    m[*nm].host = t->data, m[*nm].bytes = bytes, m[*nm].out = out;
    m[*nm].dev = g_mem->alloc(bytes ? bytes : 1);
    g_mem->upload(m[*nm].dev, t->data, bytes);
    t->data = m[(*nm)++].dev;
}

static size_t dense_bytes(const nsa_tensor *t)
{
    size_t n = 4; /* every dtype here has 4 bytes */
    for (int d = 0; d < t->rank; d++) n *= (size_t)t->shape[d];
    return n;
}

/* nsa_step on ctx, the buffers mirrored to the device when g_mem is set (the caches' arrays
 * whole: c holds their sizes). */
static nsa_status step_call(nsa_context *ctx, const nsa_step_args *a, const caches *c)
{
    size_t need = 0;
    nsa_status st = nsa_step_workspace_size(ctx, a, &need);
    if (st != NSA_STATUS_SUCCESS) return st;
    if (!g_mem) {
        void *ws = malloc(need ? need : 1);
        st = nsa_step(ctx, a, ws, need);
        free(ws);
        return st;
    }
    nsa_step_args d = *a;
    mirror_t m[20];
    int nm = 0;
    const int64_t rows = c->paged ? c->pool * c->page : ST_B * c->cap, crows = c->paged ? c->cpool * c->page : ST_B * c->ccap;
    mirror(m, &nm, &d.q, dense_bytes(&a->q), 0), mirror(m, &nm, &d.q_lens, dense_bytes(&a->q_lens), 0);
    mirror(m, &nm, &d.seqlens, dense_bytes(&a->seqlens), 0);
    mirror(m, &nm, &d.k_new, dense_bytes(&a->k_new), 0), mirror(m, &nm, &d.v_new, dense_bytes(&a->v_new), 0);
    mirror(m, &nm, &d.cache.k, (size_t)(rows * ST_H * ST_DK) * 4, 1), mirror(m, &nm, &d.cache.v, (size_t)(rows * ST_H * ST_DV) * 4, 1);
    mirror(m, &nm, &d.cmp_cache.k, (size_t)(crows * ST_H * ST_DK) * 4, 1);
    mirror(m, &nm, &d.cmp_cache.v, (size_t)(crows * ST_H * ST_DV) * 4, 1);
    mirror(m, &nm, &d.cache.block_table, (size_t)(ST_B * c->pps) * 4, 0);
    mirror(m, &nm, &d.cmp_cache.block_table, (size_t)(ST_B * c->cpps) * 4, 0);
    mirror(m, &nm, &d.g_cmp, dense_bytes(&a->g_cmp), 0), mirror(m, &nm, &d.g_slc, dense_bytes(&a->g_slc), 0);
    mirror(m, &nm, &d.g_swa, dense_bytes(&a->g_swa), 0);
    mirror(m, &nm, &d.o, dense_bytes(&a->o), 1), mirror(m, &nm, &d.selected, dense_bytes(&a->selected), 1);
    mirror(m, &nm, &d.block_indices, dense_bytes(&a->block_indices), 0);
    mirror(m, &nm, &d.block_counts, dense_bytes(&a->block_counts), 0);
    mirror(m, &nm, &d.errors, dense_bytes(&a->errors), 1);
    void *ws = g_mem->alloc(need ? need : 1);
    st = nsa_step(ctx, &d, ws, need);
    for (int i = 0; i < nm; i++) { /* (the download waits for the step) */
        if (m[i].out) g_mem->download(m[i].host, m[i].dev, m[i].bytes);
        g_mem->release(m[i].dev);
    }
    g_mem->release(ws);
    return st;
}

/* Feeds the sequences to nsa_step in random steps of at most `chunk` tokens (first a prefill
 * of up to `prefill`) and compares every step with the reference rows. append: the step
 * appends k_new / v_new; else the test writes the tokens into the cache itself first. */
static void run_steps(nsa_context *ctx, const nsa_config *cfg, seqdata *s, int gates, caches *c, test_rng *r, int64_t prefill,
                      int64_t chunk, int append, int by_caller, int caller_idx, const char *what)
{
    int64_t L[ST_B] = {0, 0, 0};
    const int64_t n = cfg->slc_topk;
    double worst = 0.0;
    long idx_bad = 0, blank_bad = 0, steps = 0;
    for (int first = 1;; first = 0) {
        int64_t cnt[ST_B], Tq = 0, left = 0;
        for (int64_t b = 0; b < ST_B; b++) {
            const int64_t rest = s[b].T - L[b], want = first ? rng_int(r, 0, prefill) : rng_int(r, 0, chunk);
            cnt[b] = want < rest ? want : rest;
            Tq = cnt[b] > Tq ? cnt[b] : Tq;
            left += rest;
        }
        if (left == 0) break;
        if (Tq == 0) continue; /* every sequence idle this time: draw again */
        float *q = rnd(r, ST_B * Tq * ST_HQ * ST_DK, 0, 0), *kn = rnd(r, ST_B * Tq * ST_H * ST_DK, 0, 0);
        float *vn = rnd(r, ST_B * Tq * ST_H * ST_DV, 0, 0), *g[3], *o = rnd(r, ST_B * Tq * ST_HQ * ST_DV, 0, 0);
        int32_t *idx = (int32_t *)malloc((size_t)(ST_B * Tq * ST_H * n) * sizeof(int32_t)), qlens[ST_B], seqlens[ST_B];
        int32_t errors[ST_B] = {-1, -1, -1};
        for (int64_t e = 0; e < ST_B * Tq * ST_H * n; e++) idx[e] = 7; /* rows without a query must come back -1 */
        for (int x = 0; x < 3; x++) g[x] = rnd(r, ST_B * Tq * ST_HQ, 0, 0);
        for (int64_t b = 0; b < ST_B; b++) {
            for (int64_t i = 0; i < cnt[b]; i++) {
                const int64_t t = L[b] + i;
                memcpy(q + ((b * Tq + i) * ST_HQ) * ST_DK, s[b].q + t * ST_HQ * ST_DK, ST_HQ * ST_DK * sizeof(float));
                memcpy(kn + ((b * Tq + i) * ST_H) * ST_DK, s[b].k + t * ST_H * ST_DK, ST_H * ST_DK * sizeof(float));
                memcpy(vn + ((b * Tq + i) * ST_H) * ST_DV, s[b].v + t * ST_H * ST_DV, ST_H * ST_DV * sizeof(float));
                for (int x = 0; x < 3; x++) memcpy(g[x] + (b * Tq + i) * ST_HQ, s[b].g[x] + t * ST_HQ, ST_HQ * sizeof(float));
                if (!append) { /* the caller's own append */
                    memcpy(c->k + host_row(c, 0, b, t, ST_DK), s[b].k + t * ST_H * ST_DK, ST_H * ST_DK * sizeof(float));
                    memcpy(c->v + host_row(c, 0, b, t, ST_DV), s[b].v + t * ST_H * ST_DV, ST_H * ST_DV * sizeof(float));
                }
            }
            qlens[b] = (int32_t)cnt[b];
            seqlens[b] = (int32_t)(append ? L[b] : L[b] + cnt[b]);
            if (by_caller) caller_pool(c, cfg, &s[b], b, L[b] + cnt[b]);
        }
        nsa_step_args a;
        memset(&a, 0, sizeof a);
        a.q = nsa_tensor_4d(q, NSA_DTYPE_F32, ST_B, Tq, ST_HQ, ST_DK);
        a.q_lens = nsa_tensor_make(qlens, NSA_DTYPE_I32, 1, (int64_t[]){ST_B});
        a.seqlens = nsa_tensor_make(seqlens, NSA_DTYPE_I32, 1, (int64_t[]){ST_B});
        if (append) {
            a.k_new = nsa_tensor_4d(kn, NSA_DTYPE_F32, ST_B, Tq, ST_H, ST_DK);
            a.v_new = nsa_tensor_4d(vn, NSA_DTYPE_F32, ST_B, Tq, ST_H, ST_DV);
        }
        a.cache = token_cache(c);
        a.cmp_cache = cmp_cache(c);
        a.cmp_by_caller = by_caller;
        nsa_tensor *gt[3] = {&a.g_cmp, &a.g_slc, &a.g_swa};
        for (int x = 0; x < 3; x++)
            if (gates >> x & 1) *gt[x] = nsa_tensor_3d(g[x], NSA_DTYPE_F32, ST_B, Tq, ST_HQ);
        a.o = nsa_tensor_4d(o, NSA_DTYPE_F32, ST_B, Tq, ST_HQ, ST_DV);
        if ((gates & 2) && caller_idx) { /* the reference's own selection, given as the caller's */
            for (int64_t b = 0; b < ST_B; b++)
                for (int64_t i = 0; i < cnt[b]; i++)
                    memcpy(idx + (b * Tq + i) * ST_H * n, s[b].idx_ref + (L[b] + i) * ST_H * n, (size_t)(ST_H * n) * sizeof(int32_t));
            a.block_indices = nsa_tensor_4d(idx, NSA_DTYPE_I32, ST_B, Tq, ST_H, n);
        } else if (gates & 2) {
            a.selected = nsa_tensor_4d(idx, NSA_DTYPE_I32, ST_B, Tq, ST_H, n);
        }
        /* a step that does not select ignores selected, whatever its shape: a one-element
         * tensor there must come back untouched (and nothing past it written) */
        int32_t stray = 12345;
        if (!a.selected.data) a.selected = nsa_tensor_4d(&stray, NSA_DTYPE_I32, 1, 1, 1, 1);
        a.errors = nsa_tensor_make(errors, NSA_DTYPE_I32, 1, (int64_t[]){ST_B});
        a.config = *cfg;
        CHECK_STATUS(step_call(ctx, &a, c), NSA_STATUS_SUCCESS);
        CHECK(errors[0] == NSA_STEP_OK && errors[1] == NSA_STEP_OK && errors[2] == NSA_STEP_OK);
        blank_bad += stray != 12345;
        for (int64_t b = 0; b < ST_B; b++)
            for (int64_t i = 0; i < cnt[b]; i++) {
                const int64_t t = L[b] + i;
                for (int64_t e = 0; e < ST_HQ * ST_DV; e++) {
                    const double d = fabs((double)o[(b * Tq + i) * ST_HQ * ST_DV + e] - s[b].o_ref[t * ST_HQ * ST_DV + e]);
                    worst = d > worst || d != d ? d : worst;
                }
                if (gates & 2)
                    for (int64_t e = 0; e < ST_H * n; e++) idx_bad += idx[(b * Tq + i) * ST_H * n + e] != s[b].idx_ref[t * ST_H * n + e];
            }
        for (int64_t b = 0; b < ST_B; b++) /* the slots past a sequence's queries: o zero, selection -1 */
            for (int64_t i = cnt[b]; i < Tq; i++) {
                for (int64_t e = 0; e < ST_HQ * ST_DV; e++) blank_bad += o[(b * Tq + i) * ST_HQ * ST_DV + e] != 0.0f;
                if ((gates & 2) && !caller_idx)
                    for (int64_t e = 0; e < ST_H * n; e++) blank_bad += idx[(b * Tq + i) * ST_H * n + e] != -1;
            }
        for (int64_t b = 0; b < ST_B; b++) L[b] += cnt[b];
        steps++;
        free(q), free(kn), free(vn), free(o), free(idx);
        for (int x = 0; x < 3; x++) free(g[x]);
    }
    char msg[200];
    snprintf(msg, sizeof msg, "%s: %ld steps, worst |o - nsa_forward| %.3g, %ld selection entries differ, %ld blank-row entries wrong",
             what, steps, worst, idx_bad, blank_bad);
    CHECK_MSG(worst <= 2e-5 && idx_bad == 0 && blank_bad == 0, msg); /* f32 both ways: only the order of fp32 sums differs */
    if (g_tests_verbose) printf("  %s\n", msg);
}

static void seqs_make(seqdata *s, test_rng *r, nsa_context *ctx, const nsa_config *cfg, int gates, const int64_t *T)
{
    for (int b = 0; b < ST_B; b++) {
        s[b].T = T[b];
        s[b].q = rnd(r, T[b] * ST_HQ * ST_DK, -1, 1), s[b].k = rnd(r, T[b] * ST_H * ST_DK, -1, 1);
        s[b].v = rnd(r, T[b] * ST_H * ST_DV, -1, 1);
        for (int x = 0; x < 3; x++) s[b].g[x] = rnd(r, T[b] * ST_HQ, 0, 1);
        forward_ref(ctx, cfg, &s[b], gates);
    }
}

static void seqs_free(seqdata *s)
{
    for (int b = 0; b < ST_B; b++) {
        free(s[b].q), free(s[b].k), free(s[b].v), free(s[b].o_ref), free(s[b].idx_ref);
        for (int x = 0; x < 3; x++) free(s[b].g[x]);
    }
}

static void test_step_equals_forward(nsa_context *ctx, nsa_context *cpu)
{
    const nsa_config cfg = step_config();
    test_rng r = {20261126};
    const int64_t T[ST_B] = {83, 1, 57}; /* crossing compression and selection blocks; a length-1 sequence */
    static const int gate_sets[] = {7, 2, 5, 1};
    for (int gi = 0; gi < 4; gi++) {
        const int gates = gate_sets[gi];
        seqdata s[ST_B];
        seqs_make(s, &r, cpu, &cfg, gates, T);
        static const int64_t pages[] = {0, 1, 16, 5};
        for (int pv = 0; pv < 4; pv++) {
            caches c;
            caches_make(&c, &r, &cfg, 96, pages[pv] > 0, pages[pv] > 0 ? pages[pv] : 1);
            char what[120];
            snprintf(what, sizeof what, "gates %d, %s page %" PRId64 ", prefill + decode", gates, c.paged ? "paged" : "contiguous",
                     c.page);
            run_steps(ctx, &cfg, s, gates, &c, &r, 40, 1, 1, 0, 0, what);
            caches_free(&c);
            caches_make(&c, &r, &cfg, 96, pages[pv] > 0, pages[pv] > 0 ? pages[pv] : 1);
            snprintf(what, sizeof what, "gates %d, %s page %" PRId64 ", multi-token steps", gates, c.paged ? "paged" : "contiguous",
                     c.page);
            run_steps(ctx, &cfg, s, gates, &c, &r, 0, 7, 1, 0, 0, what);
            caches_free(&c);
        }
        caches c;
        caches_make(&c, &r, &cfg, 90, 1, 8);
        run_steps(ctx, &cfg, s, gates, &c, &r, 20, 5, 0, 0, 0, "tokens appended by the caller");
        caches_free(&c);
        caches_make(&c, &r, &cfg, 90, 0, 1);
        run_steps(ctx, &cfg, s, gates, &c, &r, 20, 5, 1, 1, 0, "compressed rows kept by the caller");
        caches_free(&c);
        caches_make(&c, &r, &cfg, 90, 1, 3);
        run_steps(ctx, &cfg, s, gates, &c, &r, 20, 5, 1, 0, 1, "the caller's block_indices");
        caches_free(&c);
        seqs_free(s);
    }
}

/* A valid one-token step of three sequences (lengths 10, 0, 30) over the caches of c. */
typedef struct bad_case {
    float q[ST_B * ST_HQ * ST_DK], kn[ST_B * ST_H * ST_DK], vn[ST_B * ST_H * ST_DV], g[ST_B * ST_HQ], o[ST_B * ST_HQ * ST_DV];
    int32_t qlens[ST_B], seqlens[ST_B], idx[ST_B * ST_H * 4];
    nsa_step_args a;
} bad_case;

static void bad_case_make(bad_case *x, caches *c, const nsa_config *cfg, test_rng *r)
{
    for (int64_t i = 0; i < ST_B * ST_HQ * ST_DK; i++) x->q[i] = (float)rng_uniform(r);
    for (int64_t i = 0; i < ST_B * ST_H * ST_DK; i++) x->kn[i] = (float)rng_uniform(r);
    for (int64_t i = 0; i < ST_B * ST_H * ST_DV; i++) x->vn[i] = (float)rng_uniform(r);
    for (int64_t i = 0; i < ST_B * ST_HQ; i++) x->g[i] = 0.5f;
    memset(x->o, 0, sizeof x->o);
    const int32_t lens[ST_B] = {10, 0, 30};
    for (int b = 0; b < ST_B; b++) x->qlens[b] = 1, x->seqlens[b] = lens[b];
    nsa_step_args *a = &x->a;
    memset(a, 0, sizeof *a);
    a->q = nsa_tensor_4d(x->q, NSA_DTYPE_F32, ST_B, 1, ST_HQ, ST_DK);
    a->q_lens = nsa_tensor_make(x->qlens, NSA_DTYPE_I32, 1, (int64_t[]){ST_B});
    a->seqlens = nsa_tensor_make(x->seqlens, NSA_DTYPE_I32, 1, (int64_t[]){ST_B});
    a->k_new = nsa_tensor_4d(x->kn, NSA_DTYPE_F32, ST_B, 1, ST_H, ST_DK);
    a->v_new = nsa_tensor_4d(x->vn, NSA_DTYPE_F32, ST_B, 1, ST_H, ST_DV);
    a->cache = token_cache(c);
    a->cmp_cache = cmp_cache(c);
    a->g_cmp = nsa_tensor_3d(x->g, NSA_DTYPE_F32, ST_B, 1, ST_HQ);
    a->g_slc = a->g_cmp, a->g_swa = a->g_cmp;
    a->o = nsa_tensor_4d(x->o, NSA_DTYPE_F32, ST_B, 1, ST_HQ, ST_DV);
    a->selected = nsa_tensor_4d(x->idx, NSA_DTYPE_I32, ST_B, 1, ST_H, 4);
    a->config = *cfg;
}

/* The call fails with `want`, its detail names `arg`, and no cache, output or index byte moved. */
static void expect_refused(nsa_context *ctx, bad_case *x, caches *c, nsa_status want, const char *arg)
{
    const int64_t rows = c->paged ? c->pool * c->page : ST_B * c->cap, crows = c->paged ? c->cpool * c->page : ST_B * c->ccap;
    const size_t kb = (size_t)(rows * ST_H * ST_DK) * 4, vb = (size_t)(rows * ST_H * ST_DV) * 4;
    const size_t kcb = (size_t)(crows * ST_H * ST_DK) * 4, vcb = (size_t)(crows * ST_H * ST_DV) * 4;
    void *k0 = malloc(kb), *v0 = malloc(vb), *kc0 = malloc(kcb), *vc0 = malloc(vcb);
    float o0[ST_B * ST_HQ * ST_DV];
    int32_t idx0[ST_B * ST_H * 4];
    memcpy(k0, c->k, kb), memcpy(v0, c->v, vb), memcpy(kc0, c->kc, kcb), memcpy(vc0, c->vc, vcb);
    memcpy(o0, x->o, sizeof o0), memcpy(idx0, x->idx, sizeof idx0);
    const nsa_status st = step_call(ctx, &x->a, c);
    CHECK_STATUS(st, want);
    CHECK_DETAIL(arg);
    CHECK(!memcmp(k0, c->k, kb) && !memcmp(v0, c->v, vb) && !memcmp(kc0, c->kc, kcb) && !memcmp(vc0, c->vc, vcb));
    CHECK(!memcmp(o0, x->o, sizeof o0) && !memcmp(idx0, x->idx, sizeof idx0));
    free(k0), free(v0), free(kc0), free(vc0);
}

static void test_step_refuses(nsa_context *ctx)
{
    const nsa_config cfg = step_config();
    test_rng r = {7};
    caches c;
    bad_case x;
    for (int paged = 0; paged < 2; paged++) {
        caches_make(&c, &r, &cfg, 32, paged, 8);
        bad_case_make(&x, &c, &cfg, &r);
        size_t need = 0;
        CHECK_STATUS(nsa_step_workspace_size(ctx, &x.a, &need), NSA_STATUS_SUCCESS); /* the base case is valid */
        x.seqlens[2] = 32; /* 32 + 1 > 32 rows */
        expect_refused(ctx, &x, &c, NSA_STATUS_BAD_ARGUMENT, "seqlens");
        x.seqlens[2] = 30, x.seqlens[1] = -1;
        expect_refused(ctx, &x, &c, NSA_STATUS_BAD_ARGUMENT, "seqlens");
        x.seqlens[1] = 0, x.qlens[0] = 2; /* Tq is 1 */
        expect_refused(ctx, &x, &c, NSA_STATUS_BAD_ARGUMENT, "q_lens");
        x.qlens[0] = 1;
        memset(&x.a.k_new, 0, sizeof x.a.k_new), memset(&x.a.v_new, 0, sizeof x.a.v_new); /* the cache holds the tokens... */
        expect_refused(ctx, &x, &c, NSA_STATUS_BAD_ARGUMENT, "q_lens");                  /* ...but sequence 1 has none */
        bad_case_make(&x, &c, &cfg, &r);
        if (paged) {
            c.bt[2 * c.pps + 3] = (int32_t)c.pool; /* a page past the pool, in a row the step reads */
            expect_refused(ctx, &x, &c, NSA_STATUS_BAD_ARGUMENT, "cache.block_table");
            c.bt[2 * c.pps + 3] = -2;
            expect_refused(ctx, &x, &c, NSA_STATUS_BAD_ARGUMENT, "cache.block_table");
            c.bt[2 * c.pps + 3] = 0;
            c.cbt[2 * c.cpps] = (int32_t)c.cpool;
            expect_refused(ctx, &x, &c, NSA_STATUS_BAD_ARGUMENT, "cmp_cache.block_table");
            c.cbt[2 * c.cpps] = 0;
        } else {
            x.a.cmp_cache.k.shape[1] = x.a.cmp_cache.v.shape[1] = 3; /* 31 tokens have 6 compressed rows */
            expect_refused(ctx, &x, &c, NSA_STATUS_BAD_ARGUMENT, "cmp_cache");
            bad_case_make(&x, &c, &cfg, &r);
            x.a.cache.k.shape[0] = x.a.cache.v.shape[0] = 2;
            expect_refused(ctx, &x, &c, NSA_STATUS_BAD_SHAPE, "cache.k");
        }
        bad_case_make(&x, &c, &cfg, &r);
        x.a.cmp_by_caller = 2;
        expect_refused(ctx, &x, &c, NSA_STATUS_BAD_ARGUMENT, "cmp_by_caller");
        bad_case_make(&x, &c, &cfg, &r);
        memset(&x.a.v_new, 0, sizeof x.a.v_new);
        expect_refused(ctx, &x, &c, NSA_STATUS_BAD_ARGUMENT, "k_new");
        bad_case_make(&x, &c, &cfg, &r);
        memset(&x.a.cmp_cache, 0, sizeof x.a.cmp_cache);
        expect_refused(ctx, &x, &c, NSA_STATUS_NULL_POINTER, "cmp_cache.k");
        bad_case_make(&x, &c, &cfg, &r);
        x.a.cache.v.dtype = NSA_DTYPE_F16;
        expect_refused(ctx, &x, &c, NSA_STATUS_BAD_DTYPE, "cache.v");
        bad_case_make(&x, &c, &cfg, &r);
        x.a.selected.shape[3] = 3; /* n is 4 */
        expect_refused(ctx, &x, &c, NSA_STATUS_BAD_SHAPE, "selected");
        bad_case_make(&x, &c, &cfg, &r);
        x.a.block_counts = nsa_tensor_make(x.qlens, NSA_DTYPE_I32, 3, (int64_t[]){ST_B, 1, 1});
        expect_refused(ctx, &x, &c, NSA_STATUS_BAD_ARGUMENT, "block_counts"); /* without block_indices */
        caches_free(&c);
    }
}

/* The device reads lengths and pages itself: a sequence with a problem is skipped (nothing of
 * it written to the caches, its rows of o zero) and its code lands in errors; the others run. */
static void test_step_device_errors(nsa_context *ctx)
{
    const nsa_config cfg = step_config();
    test_rng r = {8};
    caches c;
    bad_case x;
    for (int paged = 0; paged < 2; paged++) {
        caches_make(&c, &r, &cfg, 32, paged, 8);
        bad_case_make(&x, &c, &cfg, &r);
        int32_t errors[ST_B] = {-1, -1, -1};
        x.a.errors = nsa_tensor_make(errors, NSA_DTYPE_I32, 1, (int64_t[]){ST_B});
        const int32_t want = paged ? NSA_STEP_BAD_PAGE : NSA_STEP_OVER_CAPACITY;
        if (paged) c.bt[2 * c.pps + 3] = (int32_t)c.pool;
        else x.seqlens[2] = 32;
        const size_t row = ST_HQ * ST_DV;
        for (size_t e = 0; e < ST_B * row; e++) x.o[e] = 7.0f; /* the skipped rows must come back zero */
        CHECK_STATUS(step_call(ctx, &x.a, &c), NSA_STATUS_SUCCESS);
        CHECK(errors[0] == NSA_STEP_OK && errors[1] == NSA_STEP_OK && errors[2] == want);
        int zero2 = 1, some0 = 0;
        for (size_t e = 0; e < row; e++) zero2 &= x.o[2 * row + e] == 0.0f, some0 |= x.o[e] != 0.0f && x.o[e] != 7.0f;
        CHECK(zero2 && some0); /* sequence 2 skipped and blanked, sequence 0 computed */
        caches_free(&c);
    }
}

/* ---- the dense step (nsa_attention_step) ------------------------------------------------- */

/* One set of attention options. */
typedef struct dense_opts {
    int causal;
    int64_t wl, wr;
    float softcap;
    int sinks;
    const char *name;
} dense_opts;

static const float g_sinks[ST_HQ] = {0.5f, -1.0f, 2.0f, 0.0f};

/* nsa_attention on the CPU: the step's n queries of a sequence against its first L tokens. */
static void dense_ref(nsa_context *cpu, const seqdata *s, int64_t L, int64_t n, const dense_opts *op, float *o, float *lse)
{
    nsa_attention_args a;
    memset(&a, 0, sizeof a);
    a.q = nsa_tensor_4d(s->q + (L - n) * ST_HQ * ST_DK, NSA_DTYPE_F32, 1, n, ST_HQ, ST_DK);
    a.k = nsa_tensor_4d(s->k, NSA_DTYPE_F32, 1, L, ST_H, ST_DK);
    a.v = nsa_tensor_4d(s->v, NSA_DTYPE_F32, 1, L, ST_H, ST_DV);
    a.o = nsa_tensor_4d(o, NSA_DTYPE_F32, 1, n, ST_HQ, ST_DV);
    a.lse = nsa_tensor_3d(lse, NSA_DTYPE_F32, 1, n, ST_HQ);
    a.scale = 0.3f, a.causal = op->causal, a.window_left = op->wl, a.window_right = op->wr, a.softcap = op->softcap;
    if (op->sinks) a.sinks = nsa_tensor_make((void *)g_sinks, NSA_DTYPE_F32, 1, (int64_t[]){ST_HQ});
    size_t need = 0;
    CHECK_STATUS(nsa_attention_workspace_size(cpu, &a, &need), NSA_STATUS_SUCCESS);
    void *ws = malloc(need ? need : 1);
    CHECK_STATUS(nsa_attention(cpu, &a, ws, need), NSA_STATUS_SUCCESS);
    free(ws);
}

/* nsa_attention_step on ctx, mirrored to the device when g_mem is set. */
static nsa_status dense_call(nsa_context *ctx, const nsa_attention_step_args *a, const caches *c)
{
    size_t need = 0;
    nsa_status st = nsa_attention_step_workspace_size(ctx, a, &need);
    if (st != NSA_STATUS_SUCCESS) return st;
    if (!g_mem) {
        void *ws = malloc(need ? need : 1);
        st = nsa_attention_step(ctx, a, ws, need);
        free(ws);
        return st;
    }
    nsa_attention_step_args d = *a;
    mirror_t m[16];
    int nm = 0;
    const int64_t rows = c->paged ? c->pool * c->page : ST_B * c->cap;
    mirror(m, &nm, &d.q, dense_bytes(&a->q), 0), mirror(m, &nm, &d.q_lens, dense_bytes(&a->q_lens), 0);
    mirror(m, &nm, &d.seqlens, dense_bytes(&a->seqlens), 0);
    mirror(m, &nm, &d.k_new, dense_bytes(&a->k_new), 0), mirror(m, &nm, &d.v_new, dense_bytes(&a->v_new), 0);
    mirror(m, &nm, &d.cache.k, (size_t)(rows * ST_H * ST_DK) * 4, 1), mirror(m, &nm, &d.cache.v, (size_t)(rows * ST_H * ST_DV) * 4, 1);
    mirror(m, &nm, &d.cache.block_table, (size_t)(ST_B * c->pps) * 4, 0);
    mirror(m, &nm, &d.sinks, dense_bytes(&a->sinks), 0);
    mirror(m, &nm, &d.o, dense_bytes(&a->o), 1), mirror(m, &nm, &d.lse, dense_bytes(&a->lse), 1);
    mirror(m, &nm, &d.errors, dense_bytes(&a->errors), 1);
    void *ws = g_mem->alloc(need ? need : 1);
    st = nsa_attention_step(ctx, &d, ws, need);
    for (int i = 0; i < nm; i++) {
        if (m[i].out) g_mem->download(m[i].host, m[i].dev, m[i].bytes);
        g_mem->release(m[i].dev);
    }
    g_mem->release(ws);
    return st;
}

/* As run_steps for the dense step: every step's o and lse against nsa_attention of the step's
 * queries over the tokens cached so far. */
static void run_dense_steps(nsa_context *ctx, nsa_context *cpu, seqdata *s, const dense_opts *op, caches *c, test_rng *r,
                            int64_t prefill, int64_t chunk, int append, const char *what)
{
    int64_t L[ST_B] = {0, 0, 0};
    double worst = 0.0;
    long steps = 0, blank_bad = 0;
    for (int first = 1;; first = 0) {
        int64_t cnt[ST_B], Tq = 0, left = 0;
        for (int64_t b = 0; b < ST_B; b++) {
            const int64_t rest = s[b].T - L[b], want = first ? rng_int(r, 0, prefill) : rng_int(r, 0, chunk);
            cnt[b] = want < rest ? want : rest;
            Tq = cnt[b] > Tq ? cnt[b] : Tq;
            left += rest;
        }
        if (left == 0) break;
        if (Tq == 0) continue;
        float *q = rnd(r, ST_B * Tq * ST_HQ * ST_DK, 0, 0), *kn = rnd(r, ST_B * Tq * ST_H * ST_DK, 0, 0);
        float *vn = rnd(r, ST_B * Tq * ST_H * ST_DV, 0, 0), *o = rnd(r, ST_B * Tq * ST_HQ * ST_DV, 0, 0);
        float *lse = rnd(r, ST_B * Tq * ST_HQ, 0, 0), *o_ref = rnd(r, Tq * ST_HQ * ST_DV, 0, 0), *lse_ref = rnd(r, Tq * ST_HQ, 0, 0);
        int32_t qlens[ST_B], seqlens[ST_B], errors[ST_B] = {-1, -1, -1};
        for (int64_t b = 0; b < ST_B; b++) {
            for (int64_t i = 0; i < cnt[b]; i++) {
                const int64_t t = L[b] + i;
                memcpy(q + ((b * Tq + i) * ST_HQ) * ST_DK, s[b].q + t * ST_HQ * ST_DK, ST_HQ * ST_DK * sizeof(float));
                memcpy(kn + ((b * Tq + i) * ST_H) * ST_DK, s[b].k + t * ST_H * ST_DK, ST_H * ST_DK * sizeof(float));
                memcpy(vn + ((b * Tq + i) * ST_H) * ST_DV, s[b].v + t * ST_H * ST_DV, ST_H * ST_DV * sizeof(float));
                if (!append) {
                    memcpy(c->k + host_row(c, 0, b, t, ST_DK), s[b].k + t * ST_H * ST_DK, ST_H * ST_DK * sizeof(float));
                    memcpy(c->v + host_row(c, 0, b, t, ST_DV), s[b].v + t * ST_H * ST_DV, ST_H * ST_DV * sizeof(float));
                }
            }
            qlens[b] = (int32_t)cnt[b];
            seqlens[b] = (int32_t)(append ? L[b] : L[b] + cnt[b]);
        }
        nsa_attention_step_args a;
        memset(&a, 0, sizeof a);
        a.q = nsa_tensor_4d(q, NSA_DTYPE_F32, ST_B, Tq, ST_HQ, ST_DK);
        a.q_lens = nsa_tensor_make(qlens, NSA_DTYPE_I32, 1, (int64_t[]){ST_B});
        a.seqlens = nsa_tensor_make(seqlens, NSA_DTYPE_I32, 1, (int64_t[]){ST_B});
        if (append) {
            a.k_new = nsa_tensor_4d(kn, NSA_DTYPE_F32, ST_B, Tq, ST_H, ST_DK);
            a.v_new = nsa_tensor_4d(vn, NSA_DTYPE_F32, ST_B, Tq, ST_H, ST_DV);
        }
        a.cache = token_cache(c);
        a.o = nsa_tensor_4d(o, NSA_DTYPE_F32, ST_B, Tq, ST_HQ, ST_DV);
        a.lse = nsa_tensor_3d(lse, NSA_DTYPE_F32, ST_B, Tq, ST_HQ);
        a.errors = nsa_tensor_make(errors, NSA_DTYPE_I32, 1, (int64_t[]){ST_B});
        a.scale = 0.3f, a.causal = op->causal, a.window_left = op->wl, a.window_right = op->wr, a.softcap = op->softcap;
        if (op->sinks) a.sinks = nsa_tensor_make((void *)g_sinks, NSA_DTYPE_F32, 1, (int64_t[]){ST_HQ});
        CHECK_STATUS(dense_call(ctx, &a, c), NSA_STATUS_SUCCESS);
        CHECK(errors[0] == NSA_STEP_OK && errors[1] == NSA_STEP_OK && errors[2] == NSA_STEP_OK);
        for (int64_t b = 0; b < ST_B; b++) {
            for (int64_t i = cnt[b]; i < Tq; i++) { /* the slots past the sequence's queries: o zero, lse -inf */
                for (int64_t e = 0; e < ST_HQ * ST_DV; e++) blank_bad += o[(b * Tq + i) * ST_HQ * ST_DV + e] != 0.0f;
                for (int64_t e = 0; e < ST_HQ; e++) blank_bad += lse[(b * Tq + i) * ST_HQ + e] != -INFINITY;
            }
            if (cnt[b] == 0) continue;
            dense_ref(cpu, &s[b], L[b] + cnt[b], cnt[b], op, o_ref, lse_ref);
            for (int64_t i = 0; i < cnt[b]; i++) {
                for (int64_t e = 0; e < ST_HQ * ST_DV; e++) {
                    const double d = fabs((double)o[(b * Tq + i) * ST_HQ * ST_DV + e] - o_ref[i * ST_HQ * ST_DV + e]);
                    worst = d > worst || d != d ? d : worst;
                }
                for (int64_t e = 0; e < ST_HQ; e++) {
                    const float x = lse[(b * Tq + i) * ST_HQ + e], y = lse_ref[i * ST_HQ + e];
                    const double d = x == y ? 0.0 : fabs((double)x - y); /* (-inf == -inf: an empty row) */
                    worst = d > worst || d != d ? d : worst;
                }
            }
        }
        for (int64_t b = 0; b < ST_B; b++) L[b] += cnt[b];
        steps++;
        free(q), free(kn), free(vn), free(o), free(lse), free(o_ref), free(lse_ref);
    }
    char msg[400];
    snprintf(msg, sizeof msg, "dense step, %s: %ld steps, worst |o, lse - nsa_attention| %.3g, %ld blank-row entries wrong", what,
             steps, worst, blank_bad);
    CHECK_MSG(worst <= 2e-5 && blank_bad == 0, msg);
    if (g_tests_verbose) printf("  %s\n", msg);
}

static void test_dense_step_equals_attention(nsa_context *ctx, nsa_context *cpu)
{
    const nsa_config cfg = step_config();
    test_rng r = {20261127};
    const int64_t T[ST_B] = {71, 1, 40};
    static const dense_opts opts[] = {
        {1, -1, -1, 0.0f, 0, "causal"},
        {1, 9, -1, 2.5f, 1, "causal, window 9, softcap, sinks"},
        {0, 5, 3, 0.0f, 0, "window (5, 3)"},
        {0, -1, -1, 0.0f, 1, "no mask, sinks"},
        {0, 0, 0, 1.5f, 0, "window (0, 0), softcap"},
    };
    seqdata s[ST_B];
    seqs_make(s, &r, cpu, &cfg, 4, T);
    for (size_t oi = 0; oi < sizeof opts / sizeof opts[0]; oi++) {
        static const int64_t pages[] = {0, 1, 16, 5};
        for (int pv = 0; pv < 4; pv++) {
            caches c;
            caches_make(&c, &r, &cfg, 80, pages[pv] > 0, pages[pv] > 0 ? pages[pv] : 1);
            char what[160];
            snprintf(what, sizeof what, "%s, %s page %" PRId64 ", prefill + decode", opts[oi].name,
                     c.paged ? "paged" : "contiguous", c.page);
            run_dense_steps(ctx, cpu, s, &opts[oi], &c, &r, 30, 1, 1, what);
            caches_free(&c);
            caches_make(&c, &r, &cfg, 80, pages[pv] > 0, pages[pv] > 0 ? pages[pv] : 1);
            snprintf(what, sizeof what, "%s, %s page %" PRId64 ", multi-token steps, tokens appended by the caller",
                     opts[oi].name, c.paged ? "paged" : "contiguous", c.page);
            run_dense_steps(ctx, cpu, s, &opts[oi], &c, &r, 0, 6, 0, what);
            caches_free(&c);
        }
    }
    seqs_free(s);
}

/* Bad lengths, pages and options of the dense step: refused, named, nothing written. */
static void test_dense_step_refuses(nsa_context *ctx)
{
    const nsa_config cfg = step_config();
    test_rng r = {9};
    for (int paged = 0; paged < 2; paged++) {
        caches c;
        caches_make(&c, &r, &cfg, 32, paged, 8);
        bad_case x;
        bad_case_make(&x, &c, &cfg, &r);
        float lse[ST_B * ST_HQ] = {0};
        nsa_attention_step_args a;
        memset(&a, 0, sizeof a);
        a.q = x.a.q, a.q_lens = x.a.q_lens, a.seqlens = x.a.seqlens, a.k_new = x.a.k_new, a.v_new = x.a.v_new;
        a.cache = x.a.cache, a.o = x.a.o, a.causal = 1, a.window_left = -1, a.window_right = -1;
        a.lse = nsa_tensor_3d(lse, NSA_DTYPE_F32, ST_B, 1, ST_HQ);
        const nsa_attention_step_args base = a;
        size_t need = 0;
        CHECK_STATUS(nsa_attention_step_workspace_size(ctx, &a, &need), NSA_STATUS_SUCCESS);
        struct {
            int what;
            nsa_status want;
            const char *arg;
        } cases[] = {
            {0, NSA_STATUS_BAD_ARGUMENT, "seqlens"}, {1, NSA_STATUS_BAD_ARGUMENT, "q_lens"},
            {2, NSA_STATUS_BAD_SOFTCAP, "softcap"},  {3, NSA_STATUS_BAD_WINDOW, "window_left"},
            {4, NSA_STATUS_BAD_DTYPE, "lse"},        {5, NSA_STATUS_BAD_SHAPE, "sinks"},
            {6, NSA_STATUS_BAD_ARGUMENT, "cache.block_table"}, {7, NSA_STATUS_BAD_SCALE, "scale"},
        };
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            if (cases[ci].what == 6 && !paged) continue;
            a = base;
            const float sinks[ST_HQ + 1] = {0};
            switch (cases[ci].what) {
            case 0: x.seqlens[2] = 32; break;
            case 1: x.qlens[0] = 2; break;
            case 2: a.softcap = -1.0f; break;
            case 3: a.window_left = -2; break;
            case 4: a.lse.dtype = NSA_DTYPE_F16; break;
            case 5: a.sinks = nsa_tensor_make((void *)sinks, NSA_DTYPE_F32, 1, (int64_t[]){ST_HQ + 1}); break;
            case 6: c.bt[2 * c.pps + 3] = (int32_t)c.pool; break;
            case 7: a.scale = NAN; break;
            }
            const int64_t rows = paged ? c.pool * c.page : ST_B * c.cap;
            const size_t kb = (size_t)(rows * ST_H * ST_DK) * 4;
            void *k0 = malloc(kb);
            float o0[ST_B * ST_HQ * ST_DV], l0[ST_B * ST_HQ];
            memcpy(k0, c.k, kb), memcpy(o0, x.o, sizeof o0), memcpy(l0, lse, sizeof l0);
            CHECK_STATUS(dense_call(ctx, &a, &c), cases[ci].want);
            CHECK_DETAIL(cases[ci].arg);
            CHECK(!memcmp(k0, c.k, kb) && !memcmp(o0, x.o, sizeof o0) && !memcmp(l0, lse, sizeof l0));
            free(k0);
            x.seqlens[2] = 30, x.qlens[0] = 1;
            if (paged) c.bt[2 * c.pps + 3] = 0;
        }
        caches_free(&c);
    }
}

/* The device skips a dense step's bad sequence and reports it, as nsa_step's. */
static void test_dense_step_device_errors(nsa_context *ctx)
{
    const nsa_config cfg = step_config();
    test_rng r = {10};
    for (int paged = 0; paged < 2; paged++) {
        caches c;
        caches_make(&c, &r, &cfg, 32, paged, 8);
        bad_case x;
        bad_case_make(&x, &c, &cfg, &r);
        int32_t errors[ST_B] = {-1, -1, -1};
        nsa_attention_step_args a;
        memset(&a, 0, sizeof a);
        a.q = x.a.q, a.q_lens = x.a.q_lens, a.seqlens = x.a.seqlens, a.k_new = x.a.k_new, a.v_new = x.a.v_new;
        a.cache = x.a.cache, a.o = x.a.o, a.causal = 1, a.window_left = -1, a.window_right = -1;
        a.errors = nsa_tensor_make(errors, NSA_DTYPE_I32, 1, (int64_t[]){ST_B});
        const int32_t want = paged ? NSA_STEP_BAD_PAGE : NSA_STEP_OVER_CAPACITY;
        if (paged) c.bt[2 * c.pps + 3] = (int32_t)c.pool;
        else x.seqlens[2] = 32;
        const size_t row = ST_HQ * ST_DV;
        CHECK_STATUS(dense_call(ctx, &a, &c), NSA_STATUS_SUCCESS);
        CHECK(errors[0] == NSA_STEP_OK && errors[1] == NSA_STEP_OK && errors[2] == want);
        int zero2 = 1, some0 = 0;
        for (size_t e = 0; e < row; e++) zero2 &= x.o[2 * row + e] == 0.0f, some0 |= x.o[e] != 0.0f;
        CHECK(zero2 && some0);
        caches_free(&c);
    }
}

void test_step_on(nsa_backend be, const sweep_memory *mem)
{
    nsa_context *cpu = harness_cpu_context(0), *ctx = cpu;
    if (!cpu) return;
    if (be != NSA_BACKEND_CPU) {
        nsa_context_desc d;
        memset(&d, 0, sizeof d);
        d.backend = be;
        ctx = NULL;
        CHECK_STATUS(nsa_context_create(&ctx, &d), NSA_STATUS_SUCCESS);
        if (!ctx) {
            nsa_context_destroy(cpu);
            return;
        }
    }
    g_mem = mem;
    test_step_equals_forward(ctx, cpu);
    test_dense_step_equals_attention(ctx, cpu);
    if (be == NSA_BACKEND_CPU) test_step_refuses(ctx), test_dense_step_refuses(ctx);
    else test_step_device_errors(ctx), test_dense_step_device_errors(ctx);
    g_mem = NULL;
    if (ctx != cpu) nsa_context_destroy(ctx);
    nsa_context_destroy(cpu);
}

void test_step_all(void) { test_step_on(NSA_BACKEND_CPU, NULL); }
