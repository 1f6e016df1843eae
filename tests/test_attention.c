/* test_attention.c -- the attention op's options (nsa.h section 5) on the CPU backend (and, from
 * build/nsa_gpu_tests, on the CUDA backend: test_attention_on) against the float64 reference that materialises the score matrix (ref_attention_ext): awkward
 * shapes (Tq != Tk both ways, lengths 1 and 113, G = 1, 3, 4, DK != DV, head dims up to 256),
 * every option alone and together, f32 / f16 / bf16 with the tolerance rule of style.md
 * (sweep_tolerance), varlen of both kinds with empty and length-1 sequences; then finite
 * differences of the backward, the Philox generator against known answers, and dropout's
 * determinism, mask identity and statistics. */
#include "harness.h"
#include "ref.h"
#include "sweep.h"
#include "../src/dtype.h"
#include "../src/philox.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void test_attention_all(void);
void test_attention_on(nsa_backend backend, const sweep_memory *mem);

/* Device runs (test_attention_on with memory hooks): every tensor of a call is mirrored into
 * device memory, sentinels included, and the outputs' bytes come back, so the same checks
 * (values, bytes outside the elements, determinism) read host memory. f32 storage runs on the
 * GPU's scalar kernels. */
static const sweep_memory *g_mem;

/* ---- host tensors: storage in any dtype plus the stored values as doubles ------------ */
typedef struct buf {
    nsa_tensor t;  /* the view handed to the library */
    nsa_tensor m;  /* the memory layout of the logical elements (t may broadcast it) */
    void *mem;
    size_t bytes;
    double *val;   /* the values as stored (what the reference reads), logical row-major */
    int64_t n;
} buf;

/* Padded layouts (g_pad): dim 1 and the last dim longer than the view, so every output
 * has bytes around its elements that must stay sentinel. */
static int g_pad;

static buf buf_make(nsa_dtype dt, int rank, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    const int64_t shape[4] = {d0, d1, d2, d3};
    int64_t pshape[4] = {d0, d1, d2, d3};
    buf b;
    b.n = 1;
    for (int i = 0; i < rank; i++) b.n *= shape[i];
    if (g_pad && rank >= 2) pshape[rank - 1] += 3, pshape[1] += 1;
    int64_t total = 1;
    for (int i = 0; i < rank; i++) total *= pshape[i] > 0 ? pshape[i] : 1;
    const size_t es = nsa_dtype_size(dt);
    b.bytes = (size_t)total * es;
    b.mem = malloc(b.bytes);
    memset(b.mem, 0xFF, b.bytes); /* NaN sentinel for float outputs */
    b.val = (double *)calloc((size_t)(b.n > 0 ? b.n : 1), sizeof(double));
    b.t = nsa_tensor_make(b.mem, dt, rank, pshape);
    for (int i = 0; i < rank; i++) b.t.shape[i] = shape[i];
    b.m = b.t;
    return b;
}

/* Storage offset (elements) of logical element i. */
static int64_t buf_off(const buf *b, int64_t i)
{
    int64_t off = 0;
    for (int d = b->m.rank - 1; d >= 0; d--) {
        off += (i % b->m.shape[d]) * b->m.stride[d];
        i /= b->m.shape[d];
    }
    return off;
}

/* Every byte outside the logical elements still holds the sentinel. */
static int buf_guard_ok(const buf *b)
{
    if (!b->mem) return 1;
    const size_t es = nsa_dtype_size(b->m.dtype);
    unsigned char *mark = calloc(b->bytes + 1, 1);
    for (int64_t i = 0; i < b->n; i++) memset(mark + (size_t)buf_off(b, i) * es, 1, es);
    int ok = 1;
    for (size_t j = 0; j < b->bytes; j++)
        if (!mark[j] && ((const unsigned char *)b->mem)[j] != 0xFF) ok = 0;
    free(mark);
    return ok;
}

static void buf_free(buf *b)
{
    free(b->mem);
    free(b->val);
    memset(b, 0, sizeof *b);
}

static void buf_store(buf *b, int64_t li, double x)
{
    const int64_t i = buf_off(b, li);
    switch (b->t.dtype) {
    case NSA_DTYPE_F32: ((float *)b->mem)[i] = (float)x; break;
    case NSA_DTYPE_F16: ((uint16_t *)b->mem)[i] = nsa_f32_to_f16((float)x); break;
    case NSA_DTYPE_BF16: ((uint16_t *)b->mem)[i] = nsa_f32_to_bf16((float)x); break;
    case NSA_DTYPE_I32: ((int32_t *)b->mem)[i] = (int32_t)x; break;
    case NSA_DTYPE_U8: ((uint8_t *)b->mem)[i] = (uint8_t)x; break;
    }
    b->val[li] = sweep_round_to(b->t.dtype, x);
}

static double buf_get(const buf *b, int64_t li)
{
    const int64_t i = buf_off(b, li);
    switch (b->t.dtype) {
    case NSA_DTYPE_F32: return ((const float *)b->mem)[i];
    case NSA_DTYPE_F16: return nsa_f16_to_f32(((const uint16_t *)b->mem)[i]);
    case NSA_DTYPE_BF16: return nsa_bf16_to_f32(((const uint16_t *)b->mem)[i]);
    case NSA_DTYPE_I32: return ((const int32_t *)b->mem)[i];
    case NSA_DTYPE_U8: return ((const uint8_t *)b->mem)[i];
    }
    return 0;
}

static void buf_normal(buf *b, test_rng *r, double sd)
{
    for (int64_t i = 0; i < b->n; i++) buf_store(b, i, sd * rng_normal(r));
}

/* ---- comparison with the tolerance rule ------------------------------------------------ */
static const char *g_case = "";

/* got (read from b) against ref with the naive result naive; NaN never passes, inf must match. */
static void compare(const char *what, const buf *b, const double *ref, const double *naive, nsa_dtype storage)
{
    const double tol = sweep_tolerance(storage, ref, naive, b->n);
    long bad = 0;
    double worst = 0;
    char msg[600];
    int len = snprintf(msg, sizeof msg, "%s [%s]:", what, g_case);
    for (int64_t i = 0; i < b->n; i++) {
        const double g = buf_get(b, i);
        int ok;
        if (isnan(g) || isnan(ref[i])) ok = 0;
        else if (isinf(g) || isinf(ref[i])) ok = g == ref[i];
        else {
            ok = fabs(g - ref[i]) <= tol;
            worst = fmax(worst, fabs(g - ref[i]));
        }
        if (!ok && bad++ < 3 && len < (int)sizeof msg - 100)
            len += snprintf(msg + len, sizeof msg - (size_t)len, " [%lld] got %.8g want %.8g;", (long long)i, g, ref[i]);
    }
    if (len < (int)sizeof msg - 60)
        snprintf(msg + len, sizeof msg - (size_t)len, " %ld of %lld off, tol %.3g worst %.3g", bad, (long long)b->n, tol,
                 worst);
    CHECK_MSG(bad == 0, msg);
    snprintf(msg, sizeof msg, "%s [%s]: a byte outside the output's elements was written", what, g_case);
    CHECK_MSG(buf_guard_ok(b), msg);
    if (g_tests_verbose && bad == 0) fprintf(stderr, "  ok %-8s %-40s worst %.3g tol %.3g\n", what, g_case, worst, tol);
}

/* ---- one case --------------------------------------------------------------------------- */
/* Broadcast forms of bias and mask [X0, X1, Tq, Tk]. */
enum { PAIR_NONE, PAIR_FULL, PAIR_1H, PAIR_B1, PAIR_11, PAIR_STRIDE0 };

typedef struct acase {
    const char *name;
    int64_t B, Tq, Tk, HQ, H, DK, DV;
    nsa_dtype dt;
    int causal;
    int64_t wl, wr;
    float softcap;
    int sinks, seg, bias, mask, dbias;
    float p;
    uint64_t seed, offset;
    int pad;                    /* padded (strided) views of every tensor */
    int bias_ninf;              /* about 1 in 8 bias entries -inf (masking through the bias) */
    int varlen;                 /* 0 dense, 1 varlen.cu_seqlens (int32), 2 varlen_qk (int64) */
    int nseq;
    int64_t qlens[6], klens[6]; /* varlen lengths (klens unused for varlen 1) */
} acase;

static nsa_context *g_ctx;

typedef struct world {
    acase c;
    int64_t B, Tq, Tk, nseq, vb0, vb1;  /* vb0/vb1: bias view dims 0, 1 */
    int64_t cq[7], ck[7];
    int32_t cu32[7];
    buf q, k, v, o, lse, dout, dq, dk, dv, sinks, dsinks, qseg, kseg, bias, dbias, mask;
    nsa_attention_args a;
    nsa_attention_bwd_args g;
} world;

static void pair_dims(int form, int64_t B, int64_t HQ, int64_t *m0, int64_t *m1, int64_t *v0, int64_t *v1)
{
    *m0 = form == PAIR_FULL || form == PAIR_B1 ? B : 1;
    *m1 = form == PAIR_FULL || form == PAIR_1H ? HQ : 1;
    *v0 = form == PAIR_STRIDE0 ? B : *m0;
    *v1 = form == PAIR_STRIDE0 ? HQ : *m1;
}

/* Element [b, hq, i, j] of a pair tensor's values (memory dims m0, m1 broadcast). */
static double pair_val(const buf *x, int64_t b, int64_t hq, int64_t i, int64_t j, int64_t Tq, int64_t Tk)
{
    const int64_t m0 = x->m.shape[0] == 1 ? 0 : b, m1 = x->m.shape[1] == 1 ? 0 : hq;
    return x->val[((m0 * x->m.shape[1] + m1) * Tq + i) * Tk + j];
}

static buf pair_make(int form, nsa_dtype dt, const world *w)
{
    int64_t m0, m1, v0, v1;
    pair_dims(form, w->B, w->c.HQ, &m0, &m1, &v0, &v1);
    buf x = buf_make(dt, 4, m0, m1, w->Tq, w->Tk);
    if (form == PAIR_STRIDE0) { /* [B, HQ, Tq, Tk] view of one [Tq, Tk] plane; x.m keeps [1, 1, Tq, Tk] */
        x.t.shape[0] = v0, x.t.shape[1] = v1;
        x.t.stride[0] = x.t.stride[1] = 0;
    }
    return x;
}

static void world_build(world *w, const acase *c, uint64_t seed)
{
    test_rng r = {seed};
    memset(w, 0, sizeof *w);
    w->c = *c;
    w->nseq = c->varlen ? c->nseq : c->B;
    w->B = c->varlen ? 1 : c->B;
    w->Tq = c->Tq, w->Tk = c->Tk;
    if (c->varlen) {
        w->cq[0] = w->ck[0] = 0;
        for (int s = 0; s < c->nseq; s++) {
            w->cq[s + 1] = w->cq[s] + c->qlens[s];
            w->ck[s + 1] = w->ck[s] + (c->varlen == 1 ? c->qlens[s] : c->klens[s]);
            w->cu32[s + 1] = (int32_t)w->cq[s + 1];
        }
        w->Tq = w->cq[c->nseq], w->Tk = w->ck[c->nseq];
    }
    const int64_t B = w->B, Tq = w->Tq, Tk = w->Tk, HQ = c->HQ, H = c->H;
    const nsa_dtype dt = w->c.dt;
    g_pad = c->pad;
    w->q = buf_make(dt, 4, B, Tq, HQ, c->DK);
    w->k = buf_make(dt, 4, B, Tk, H, c->DK);
    w->v = buf_make(dt, 4, B, Tk, H, c->DV);
    w->dout = buf_make(dt, 4, B, Tq, HQ, c->DV);
    buf_normal(&w->q, &r, 1.0);
    buf_normal(&w->k, &r, 1.0);
    buf_normal(&w->v, &r, 1.0);
    buf_normal(&w->dout, &r, 1.0);
    w->o = buf_make(dt, 4, B, Tq, HQ, c->DV);
    w->lse = buf_make(NSA_DTYPE_F32, 3, B, Tq, HQ, 0);
    w->dq = buf_make(dt, 4, B, Tq, HQ, c->DK);
    w->dk = buf_make(dt, 4, B, Tk, H, c->DK);
    w->dv = buf_make(dt, 4, B, Tk, H, c->DV);
    nsa_attention_args *a = &w->a;
    a->q = w->q.t, a->k = w->k.t, a->v = w->v.t, a->o = w->o.t, a->lse = w->lse.t;
    a->causal = c->causal, a->window_left = c->wl, a->window_right = c->wr;
    a->softcap = c->softcap;
    a->dropout_p = c->p, a->dropout_seed = c->seed, a->dropout_offset = c->offset;
    if (c->varlen == 1) a->varlen.cu_seqlens = w->cu32, a->varlen.num_seqs = c->nseq;
    if (c->varlen == 2) {
        a->varlen_qk.cu_seqlens_q = w->cq, a->varlen_qk.cu_seqlens_k = w->ck;
        a->varlen_qk.num_seqs = c->nseq;
    }
    if (c->sinks) {
        w->sinks = buf_make(NSA_DTYPE_F32, 1, HQ, 0, 0, 0);
        buf_normal(&w->sinks, &r, 1.5);
        w->dsinks = buf_make(NSA_DTYPE_F32, 1, HQ, 0, 0, 0);
        a->sinks = w->sinks.t;
    }
    if (c->seg) {
        w->qseg = buf_make(NSA_DTYPE_I32, 2, B, Tq, 0, 0);
        w->kseg = buf_make(NSA_DTYPE_I32, 2, B, Tk, 0, 0);
        for (int64_t i = 0; i < w->qseg.n; i++) buf_store(&w->qseg, i, (double)rng_int(&r, 0, 2));
        for (int64_t i = 0; i < w->kseg.n; i++) buf_store(&w->kseg, i, (double)rng_int(&r, 0, 2));
        a->q_segment_ids = w->qseg.t, a->k_segment_ids = w->kseg.t;
    }
    if (c->bias) {
        int64_t m0, m1;
        pair_dims(c->bias, B, HQ, &m0, &m1, &w->vb0, &w->vb1);
        w->bias = pair_make(c->bias, dt, w);
        buf_normal(&w->bias, &r, 1.0);
        for (int64_t i = 0; c->bias_ninf && i < w->bias.n; i++)
            if (rng_uniform(&r) < 0.125) buf_store(&w->bias, i, -INFINITY);
        a->bias = w->bias.t;
        if (c->dbias) {
            w->dbias = buf_make(dt, 4, w->vb0, w->vb1, Tq, Tk);
            w->g.dbias = w->dbias.t;
        }
    }
    if (c->mask) {
        w->mask = pair_make(c->mask, NSA_DTYPE_U8, w);
        for (int64_t i = 0; i < w->mask.n; i++) buf_store(&w->mask, i, rng_uniform(&r) < 0.8 ? 1.0 : 0.0);
        a->mask = w->mask.t;
    }
    g_pad = 0;
    w->g.fwd = *a;
    w->g.dout = w->dout.t, w->g.dq = w->dq.t, w->g.dk = w->dk.t, w->g.dv = w->dv.t;
    if (c->sinks) w->g.dsinks = w->dsinks.t;
}

static void world_free(world *w)
{
    buf *all[] = {&w->q, &w->k, &w->v, &w->o, &w->lse, &w->dout, &w->dq, &w->dk, &w->dv, &w->sinks, &w->dsinks,
                  &w->qseg, &w->kseg, &w->bias, &w->dbias, &w->mask};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) buf_free(all[i]);
}

static nsa_context *g_ctx1; /* one thread: the results must be bitwise those of g_ctx */

/* ---- device mirrors ---------------------------------------------------------------------- */
typedef struct mirror {
    void *host, *dev;
    size_t bytes;
    int out;
} mirror;

typedef struct mirrors {
    mirror m[24];
    int n;
} mirrors;

/* Bytes from a tensor's first element to one past its last (stride 0 dims included). */
static size_t tensor_extent(const nsa_tensor *t)
{
    int64_t last = 0;
    for (int d = 0; d < t->rank; d++) {
        if (t->shape[d] == 0) return 0;
        last += (t->shape[d] - 1) * t->stride[d];
    }
    return (size_t)(last + 1) * nsa_dtype_size(t->dtype);
}

/* Points t at a device copy of its bytes (one copy per host address). */
static void mirror_tensor(mirrors *ms, nsa_tensor *t, int out)
{
    if (!t->data) return;
    for (int i = 0; i < ms->n; i++)
        if (ms->m[i].host == t->data) {
            ms->m[i].out |= out;
            t->data = ms->m[i].dev;
            return;
        }
    mirror *m = &ms->m[ms->n++];
    m->host = t->data;
    m->bytes = tensor_extent(t);
    m->dev = g_mem->alloc(m->bytes + 16);
    m->out = out;
    if (m->bytes) g_mem->upload(m->dev, m->host, m->bytes);
    t->data = m->dev;
}

static void mirrors_finish(mirrors *ms)
{
    for (int i = 0; i < ms->n; i++) {
        if (ms->m[i].out && ms->m[i].bytes) g_mem->download(ms->m[i].host, ms->m[i].dev, ms->m[i].bytes);
        g_mem->release(ms->m[i].dev);
    }
    ms->n = 0;
}

static void mirror_fwd_args(mirrors *ms, nsa_attention_args *a, int outputs)
{
    nsa_tensor *in[] = {&a->q, &a->k, &a->v, &a->sinks, &a->q_segment_ids, &a->k_segment_ids, &a->bias, &a->mask};
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++) mirror_tensor(ms, in[i], 0);
    mirror_tensor(ms, &a->o, outputs);
    mirror_tensor(ms, &a->lse, outputs);
}

static nsa_status dev_fwd(nsa_context *ctx, const nsa_attention_args *host)
{
    mirrors ms = {.n = 0};
    nsa_attention_args a = *host;
    mirror_fwd_args(&ms, &a, 1);
    size_t need = 0;
    nsa_status st = nsa_attention_workspace_size(ctx, &a, &need);
    if (st == NSA_STATUS_SUCCESS) {
        void *ws = g_mem->alloc(need ? need : 1);
        st = nsa_attention(ctx, &a, ws, need);
        g_mem->release(ws);
    }
    mirrors_finish(&ms);
    return st;
}

static nsa_status dev_bwd(nsa_context *ctx, const nsa_attention_bwd_args *host)
{
    mirrors ms = {.n = 0};
    nsa_attention_bwd_args g = *host;
    mirror_fwd_args(&ms, &g.fwd, 0);
    mirror_tensor(&ms, &g.dout, 0);
    nsa_tensor *out[] = {&g.dq, &g.dk, &g.dv, &g.dsinks, &g.dbias};
    for (size_t i = 0; i < sizeof out / sizeof out[0]; i++) mirror_tensor(&ms, out[i], 1);
    size_t need = 0;
    nsa_status st = nsa_attention_bwd_workspace_size(ctx, &g, &need);
    if (st == NSA_STATUS_SUCCESS) {
        void *ws = g_mem->alloc(need ? need : 1);
        st = nsa_attention_bwd(ctx, &g, ws, need);
        g_mem->release(ws);
    }
    mirrors_finish(&ms);
    return st;
}

static nsa_status run_fwd_on(nsa_context *ctx, const nsa_attention_args *a)
{
    if (g_mem) return dev_fwd(ctx, a);
    size_t need = 0;
    nsa_status st = nsa_attention_workspace_size(ctx, a, &need);
    if (st != NSA_STATUS_SUCCESS) return st;
    void *ws = malloc(need ? need : 1);
    st = nsa_attention(ctx, a, ws, need);
    free(ws);
    return st;
}

static nsa_status run_bwd_on(nsa_context *ctx, const nsa_attention_bwd_args *g)
{
    if (g_mem) return dev_bwd(ctx, g);
    size_t need = 0;
    nsa_status st = nsa_attention_bwd_workspace_size(ctx, g, &need);
    if (st != NSA_STATUS_SUCCESS) return st;
    void *ws = malloc(need ? need : 1);
    st = nsa_attention_bwd(ctx, g, ws, need);
    free(ws);
    return st;
}

static nsa_status run_fwd(const nsa_attention_args *a) { return run_fwd_on(g_ctx, a); }
static nsa_status run_bwd(const nsa_attention_bwd_args *g) { return run_bwd_on(g_ctx, g); }

/* Every output of the call, bitwise, with one thread against the default thread count. */
static void check_threads(world *w)
{
    buf *outs[] = {&w->o, &w->lse, &w->dq, &w->dk, &w->dv, &w->dsinks, &w->dbias};
    void *saved[7];
    for (int i = 0; i < 7; i++) {
        saved[i] = outs[i]->mem ? malloc(outs[i]->bytes) : NULL;
        if (saved[i]) memcpy(saved[i], outs[i]->mem, outs[i]->bytes);
    }
    CHECK_STATUS(run_fwd_on(g_ctx1, &w->a), NSA_STATUS_SUCCESS);
    CHECK_STATUS(run_bwd_on(g_ctx1, &w->g), NSA_STATUS_SUCCESS);
    int same = 1;
    for (int i = 0; i < 7; i++)
        if (saved[i]) {
            same &= memcmp(saved[i], outs[i]->mem, outs[i]->bytes) == 0;
            free(saved[i]);
        }
    char msg[160];
    snprintf(msg, sizeof msg, g_mem ? "[%s] two runs on the GPU differ" : "[%s] one thread and the default thread count differ",
             g_case);
    CHECK_MSG(same, msg);
}

/* Sequence s: batch index, first query / key row, lengths. */
static void seq_of(const world *w, int64_t s, int64_t *b, int64_t *q0, int64_t *ql, int64_t *k0, int64_t *kl)
{
    if (w->c.varlen) {
        *b = 0, *q0 = w->cq[s], *ql = w->cq[s + 1] - w->cq[s], *k0 = w->ck[s], *kl = w->ck[s + 1] - w->ck[s];
    } else {
        *b = s, *q0 = 0, *ql = w->Tq, *k0 = 0, *kl = w->Tk;
    }
}

typedef struct ref_out {
    double *o, *lse, *dq, *dk, *dv, *ds, *db;
} ref_out;

/* The reference over every sequence of the call, into whole-call arrays. */
/* o_handed, lse_handed (NULL: none): the o [B, Tq, HQ, DV] and lse [B, Tq, HQ] the backward
 * under test was handed, from which the naive pass takes D and the sinks' probabilities (ref.h,
 * o_given, lse_given). */
static void reference(const world *w, ref_out *r, const double *o_handed, const double *lse_handed)
{
    const acase *c = &w->c;
    const int64_t HQ = c->HQ, H = c->H, DK = c->DK, DV = c->DV;
    r->o = calloc((size_t)w->o.n + 1, 8), r->lse = calloc((size_t)w->lse.n + 1, 8);
    r->dq = calloc((size_t)w->dq.n + 1, 8), r->dk = calloc((size_t)w->dk.n + 1, 8), r->dv = calloc((size_t)w->dv.n + 1, 8);
    r->ds = calloc((size_t)HQ + 1, 8), r->db = calloc((size_t)w->dbias.n + 1, 8);
    for (int64_t s = 0; s < w->nseq; s++) {
        int64_t b, q0, ql, k0, kl;
        seq_of(w, s, &b, &q0, &ql, &k0, &kl);
        if (ql == 0) continue;
        ref_attn_opts o;
        memset(&o, 0, sizeof o);
        o.scale = 1.0 / sqrt((double)DK);
        o.causal = c->causal, o.window_left = c->wl, o.window_right = c->causal ? 0 : c->wr;
        o.softcap = c->softcap;
        o.sinks = c->sinks ? w->sinks.val : NULL;
        o.o_given = o_handed ? o_handed + (b * w->Tq + q0) * HQ * DV : NULL;
        o.lse_given = lse_handed ? lse_handed + (b * w->Tq + q0) * HQ : NULL;
        int32_t *qs = NULL, *ks = NULL;
        if (c->seg) {
            qs = malloc((size_t)ql * 4 + 4), ks = malloc((size_t)kl * 4 + 4);
            for (int64_t i = 0; i < ql; i++) qs[i] = (int32_t)w->qseg.val[b * w->Tq + q0 + i];
            for (int64_t j = 0; j < kl; j++) ks[j] = (int32_t)w->kseg.val[b * w->Tk + k0 + j];
            o.q_seg = qs, o.k_seg = ks;
        }
        double *bias = NULL, *dbias = NULL;
        unsigned char *mask = NULL;
        const int64_t np = HQ * ql * kl;
        if (c->bias) {
            bias = malloc((size_t)np * 8 + 8), dbias = malloc((size_t)np * 8 + 8);
            for (int64_t hq = 0; hq < HQ; hq++)
                for (int64_t i = 0; i < ql; i++)
                    for (int64_t j = 0; j < kl; j++)
                        bias[(hq * ql + i) * kl + j] = pair_val(&w->bias, b, hq, q0 + i, k0 + j, w->Tq, w->Tk);
            o.bias = bias;
        }
        if (c->mask) {
            mask = malloc((size_t)np + 1);
            for (int64_t hq = 0; hq < HQ; hq++)
                for (int64_t i = 0; i < ql; i++)
                    for (int64_t j = 0; j < kl; j++)
                        mask[(hq * ql + i) * kl + j] = pair_val(&w->mask, b, hq, q0 + i, k0 + j, w->Tq, w->Tk) != 0;
            o.mask = mask;
        }
        o.dropout_p = c->p, o.seed = c->seed, o.offset = c->offset;
        o.b = b, o.q_row0 = q0, o.k_row0 = k0;
        ref_dims d = {ql, HQ, H, DK, DV};
        const double *q = w->q.val + (b * w->Tq + q0) * HQ * DK, *k = w->k.val + (b * w->Tk + k0) * H * DK;
        const double *v = w->v.val + (b * w->Tk + k0) * H * DV, *dO = w->dout.val + (b * w->Tq + q0) * HQ * DV;
        double ds[64];
        ref_attention_ext(&o, d, kl, q, k, v, r->o + (b * w->Tq + q0) * HQ * DV, r->lse + (b * w->Tq + q0) * HQ);
        ref_attention_ext_bwd(&o, d, kl, q, k, v, dO, r->dq + (b * w->Tq + q0) * HQ * DK,
                              r->dk + (b * w->Tk + k0) * H * DK, r->dv + (b * w->Tk + k0) * H * DV, ds, dbias);
        if (c->sinks)
            for (int64_t hq = 0; hq < HQ; hq++) r->ds[hq] += ds[hq];
        if (c->dbias)
            for (int64_t hq = 0; hq < HQ; hq++)
                for (int64_t i = 0; i < ql; i++)
                    for (int64_t j = 0; j < kl; j++) {
                        const int64_t bb = w->vb0 == 1 ? 0 : b, hb = w->vb1 == 1 ? 0 : hq;
                        r->db[((bb * w->vb1 + hb) * w->Tq + q0 + i) * w->Tk + k0 + j] += dbias[(hq * ql + i) * kl + j];
                    }
        free(qs), free(ks), free(bias), free(dbias), free(mask);
    }
}

static void ref_out_free(ref_out *r)
{
    free(r->o), free(r->lse), free(r->dq), free(r->dk), free(r->dv), free(r->ds), free(r->db);
}

static nsa_dtype g_round_dt;
static double round_hook(double x) { return sweep_round_to(g_round_dt, x); }

static int g_check_threads;

static void run_case(const acase *c, uint64_t seed)
{
    world w;
    world_build(&w, c, seed);
    g_case = c->name;
    CHECK_STATUS(run_fwd(&w.a), NSA_STATUS_SUCCESS);
    /* the backward reads the forward's o and lse as stored */
    CHECK_STATUS(run_bwd(&w.g), NSA_STATUS_SUCCESS);
    ref_out ex, nv;
    reference(&w, &ex, NULL, NULL);
    const nsa_dtype dt = w.c.dt; /* as stored (bf16 for f32 cases on the GPU) */
    double *o_handed = malloc((size_t)w.o.n * 8 + 8), *lse_handed = malloc((size_t)w.lse.n * 8 + 8);
    for (int64_t i = 0; i < w.o.n; i++) o_handed[i] = buf_get(&w.o, i);
    for (int64_t i = 0; i < w.lse.n; i++) lse_handed[i] = buf_get(&w.lse, i);
    /* the naive pass twice: from the o and lse the backward was handed, and from its own; the
     * rule takes the larger of the two errors (sweep_naive_merge, tests/kit/sweep.c says why) */
    ref_out nv_own;
    g_round_dt = dt;
    ref_store_round = round_hook;
    reference(&w, &nv, o_handed, w.lse.n > 0 ? lse_handed : NULL);
    reference(&w, &nv_own, NULL, NULL);
    ref_store_round = NULL;
    free(o_handed), free(lse_handed);
    sweep_naive_merge(dt, ex.dq, nv.dq, nv_own.dq, w.dq.n), sweep_naive_merge(dt, ex.dk, nv.dk, nv_own.dk, w.dk.n);
    sweep_naive_merge(dt, ex.dv, nv.dv, nv_own.dv, w.dv.n), sweep_naive_merge(dt, ex.db, nv.db, nv_own.db, w.dbias.n);
    sweep_naive_merge(NSA_DTYPE_F32, ex.ds, nv.ds, nv_own.ds, c->HQ);
    ref_out_free(&nv_own);
    compare("o", &w.o, ex.o, nv.o, dt);
    compare("lse", &w.lse, ex.lse, nv.lse, NSA_DTYPE_F32);
    compare("dq", &w.dq, ex.dq, nv.dq, dt);
    compare("dk", &w.dk, ex.dk, nv.dk, dt);
    compare("dv", &w.dv, ex.dv, nv.dv, dt);
    if (c->sinks) compare("dsinks", &w.dsinks, ex.ds, nv.ds, NSA_DTYPE_F32);
    if (c->dbias) compare("dbias", &w.dbias, ex.db, nv.db, dt);
    if (g_check_threads) check_threads(&w);
    ref_out_free(&ex);
    ref_out_free(&nv);
    world_free(&w);
}

/* A case with only shapes set; options are added field by field. */
static acase shape(const char *name, int64_t B, int64_t Tq, int64_t Tk, int64_t HQ, int64_t H, int64_t DK, int64_t DV)
{
    acase c;
    memset(&c, 0, sizeof c);
    c.name = name, c.B = B, c.Tq = Tq, c.Tk = Tk, c.HQ = HQ, c.H = H, c.DK = DK, c.DV = DV;
    c.dt = NSA_DTYPE_F32;
    c.wl = c.wr = -1;
    return c;
}

static void test_cases(void)
{
    uint64_t seed = 5000;
    acase c;
    /* shapes: Tq != Tk both ways, causal bottom-right, windows, lengths 1, G = 1, 3, 4 */
    c = shape("Tq<Tk causal", 2, 37, 113, 4, 2, 64, 64), c.causal = 1;
    run_case(&c, seed++);
    c = shape("Tq>Tk causal (empty rows)", 1, 113, 50, 3, 1, 96, 64), c.causal = 1;
    run_case(&c, seed++);
    c.name = "Tq>Tk causal + sinks (lse = sink)", c.sinks = 1;
    run_case(&c, seed++);
    c = shape("Tq>Tk window 5/7", 1, 70, 33, 4, 1, 32, 48), c.wl = 5, c.wr = 7;
    run_case(&c, seed++);
    c = shape("Tq<Tk causal window 9", 2, 20, 90, 4, 4, 16, 24), c.causal = 1, c.wl = 9;
    run_case(&c, seed++);
    c = shape("Tq=1", 1, 1, 113, 2, 1, 64, 64), c.causal = 1;
    run_case(&c, seed++);
    c = shape("Tk=1", 2, 113, 1, 2, 2, 64, 32), c.causal = 1;
    run_case(&c, seed++);
    c = shape("Tq=Tk=1", 1, 1, 1, 3, 1, 8, 8);
    run_case(&c, seed++);
    c = shape("hd 256 small T", 1, 17, 19, 2, 1, 256, 256), c.causal = 1;
    run_case(&c, seed++);
    c = shape("hd 192/128", 1, 33, 29, 4, 2, 192, 128);
    run_case(&c, seed++);
    c = shape("hd 128 G=3", 1, 40, 40, 3, 1, 128, 128), c.softcap = 3.0f;
    run_case(&c, seed++);
    c = shape("softcap subnormal", 1, 9, 12, 2, 1, 8, 8), c.softcap = 1e-40f; /* cap(u) = +-softcap, no gradient */
    run_case(&c, seed++);
    /* each option alone */
    c = shape("softcap", 2, 113, 113, 2, 2, 64, 64), c.softcap = 2.5f, c.causal = 1;
    run_case(&c, seed++);
    c = shape("sinks", 1, 65, 65, 4, 2, 32, 32), c.sinks = 1, c.causal = 1;
    run_case(&c, seed++);
    c = shape("segments", 2, 100, 100, 4, 1, 32, 16), c.seg = 1;
    run_case(&c, seed++);
    c = shape("bias [B,HQ] + dbias", 2, 45, 70, 4, 2, 32, 32), c.bias = PAIR_FULL, c.dbias = 1;
    run_case(&c, seed++);
    c.name = "bias [1,HQ] + dbias", c.bias = PAIR_1H;
    run_case(&c, seed++);
    c.name = "bias [B,1] + dbias", c.bias = PAIR_B1;
    run_case(&c, seed++);
    c.name = "bias [1,1] + dbias causal", c.bias = PAIR_11, c.causal = 1;
    run_case(&c, seed++);
    c.name = "bias stride 0 + dbias", c.bias = PAIR_STRIDE0, c.causal = 0;
    run_case(&c, seed++);
    c.name = "bias without dbias", c.dbias = 0, c.bias = PAIR_FULL;
    run_case(&c, seed++);
    c = shape("mask [B,HQ]", 2, 50, 77, 4, 2, 32, 32), c.mask = PAIR_FULL;
    run_case(&c, seed++);
    c.name = "mask [1,1] causal", c.mask = PAIR_11, c.causal = 1;
    run_case(&c, seed++);
    c = shape("dropout", 2, 60, 90, 4, 2, 32, 32), c.p = 0.17f, c.seed = 42, c.offset = 7;
    run_case(&c, seed++);
    c.name = "dropout causal window", c.causal = 1, c.wl = 20;
    run_case(&c, seed++);
    /* everything at once, every storage dtype */
    c = shape("all options f32", 2, 60, 90, 4, 1, 64, 48);
    c.causal = 1, c.softcap = 4.0f, c.sinks = 1, c.seg = 1, c.bias = PAIR_1H, c.dbias = 1, c.mask = PAIR_B1;
    c.p = 0.25f, c.seed = 0x123456789abcdefull, c.offset = 1000;
    run_case(&c, seed++);
    c.name = "all options f16", c.dt = NSA_DTYPE_F16;
    run_case(&c, seed++);
    c.name = "all options bf16", c.dt = NSA_DTYPE_BF16;
    run_case(&c, seed++);
    c = shape("all options bf16 G=3 Tq>Tk", 1, 113, 64, 3, 1, 96, 64);
    c.causal = 1, c.softcap = 1.0f, c.sinks = 1, c.bias = PAIR_FULL, c.dbias = 1, c.mask = PAIR_11, c.p = 0.1f;
    c.dt = NSA_DTYPE_BF16;
    run_case(&c, seed++);
    /* empty sides, padded views, -inf bias entries, thread-count determinism */
    c = shape("Tk=0 + sinks", 2, 5, 0, 2, 1, 16, 8), c.sinks = 1;
    run_case(&c, seed++);
    c = shape("Tq=0", 1, 0, 9, 2, 1, 16, 8), c.causal = 1, c.sinks = 1;
    run_case(&c, seed++);
    c = shape("padded views, all options", 2, 33, 47, 4, 2, 24, 40);
    c.pad = 1, c.causal = 1, c.softcap = 3.0f, c.sinks = 1, c.seg = 1, c.bias = PAIR_FULL, c.dbias = 1;
    c.mask = PAIR_1H, c.p = 0.3f, c.seed = 3;
    run_case(&c, seed++);
    c = shape("-inf bias entries", 2, 40, 40, 2, 1, 16, 16), c.bias = PAIR_FULL, c.bias_ninf = 1, c.dbias = 1;
    c.sinks = 1;
    run_case(&c, seed++);
    g_check_threads = 1;
    c = shape("threads: all options, broadcast dbias", 3, 70, 150, 4, 2, 32, 32);
    c.causal = 1, c.softcap = 2.0f, c.sinks = 1, c.seg = 1, c.bias = PAIR_11, c.dbias = 1, c.p = 0.2f, c.seed = 11;
    run_case(&c, seed++);
    g_check_threads = 0;
    /* varlen: the int32 packing with options, and separate int64 packings */
    c = shape("varlen int32 + softcap", 1, 0, 0, 4, 2, 32, 32), c.varlen = 1, c.nseq = 5, c.causal = 1;
    c.softcap = 3.0f;
    c.qlens[0] = 0, c.qlens[1] = 1, c.qlens[2] = 50, c.qlens[3] = 0, c.qlens[4] = 33;
    run_case(&c, seed++);
    c = shape("varlen_qk", 1, 0, 0, 4, 1, 32, 16), c.varlen = 2, c.nseq = 5, c.causal = 1;
    const int64_t ql[5] = {3, 0, 1, 40, 17}, kl[5] = {5, 2, 0, 40, 60};
    memcpy(c.qlens, ql, sizeof ql), memcpy(c.klens, kl, sizeof kl);
    run_case(&c, seed++);
    c.name = "varlen_qk + all options", c.sinks = 1, c.seg = 1, c.bias = PAIR_1H, c.dbias = 1, c.mask = PAIR_11;
    c.softcap = 2.0f, c.p = 0.2f, c.seed = 9, c.causal = 0, c.wl = 10, c.wr = 3;
    run_case(&c, seed++);
    c.name = "varlen_qk + all options f16", c.dt = NSA_DTYPE_F16;
    run_case(&c, seed++);
    g_check_threads = 1;
    c.name = "varlen_qk + all options, threads", c.dt = NSA_DTYPE_F32, c.bias = PAIR_FULL;
    run_case(&c, seed++);
    g_check_threads = 0;
}

/* Fixed-seed random cases: shapes, dtypes, options and packings drawn together. */
static void test_random_cases(void)
{
    static const int64_t dks[] = {8, 16, 32, 48, 64, 96}, gs[] = {1, 2, 3, 4};
    static const nsa_dtype dts[] = {NSA_DTYPE_F32, NSA_DTYPE_F16, NSA_DTYPE_BF16};
    /* NSA_TEST_ATTENTION_SEED=N draws another 40 cases (a longer hunt than the fixed seed) */
    const char *seed = getenv("NSA_TEST_ATTENTION_SEED");
    test_rng r = {seed && seed[0] ? strtoull(seed, NULL, 10) : 20261123};
    char names[40][64];
    for (int n = 0; n < 40; n++) {
        acase c = shape("", rng_int(&r, 1, 3), rng_int(&r, 0, 130), rng_int(&r, 0, 130), 0, rng_int(&r, 1, 2),
                        dks[rng_int(&r, 0, 5)], dks[rng_int(&r, 0, 5)]);
        c.HQ = c.H * gs[rng_int(&r, 0, 3)];
        c.dt = dts[rng_int(&r, 0, 2)];
        c.causal = rng_int(&r, 0, 1);
        c.wl = rng_int(&r, 0, 2) ? -1 : rng_int(&r, 0, 40);
        c.wr = rng_int(&r, 0, 2) ? -1 : rng_int(&r, 0, 40);
        c.softcap = rng_int(&r, 0, 1) ? 0.0f : (float)(0.5 + 4 * rng_uniform(&r));
        c.sinks = (int)rng_int(&r, 0, 1);
        c.seg = (int)rng_int(&r, 0, 1);
        c.bias = rng_int(&r, 0, 1) ? PAIR_NONE : (int)rng_int(&r, PAIR_FULL, PAIR_STRIDE0);
        c.dbias = c.bias && rng_int(&r, 0, 1);
        c.mask = rng_int(&r, 0, 2) ? PAIR_NONE : (int)rng_int(&r, PAIR_FULL, PAIR_11);
        if (rng_int(&r, 0, 1)) c.p = (float)(0.5 * rng_uniform(&r)), c.seed = rng_next(&r), c.offset = rng_next(&r);
        c.pad = (int)rng_int(&r, 0, 1);
        const int vl = (int)rng_int(&r, 0, 3); /* 0, 1: dense; 2: int32 packing; 3: int64 packings */
        if (vl >= 2) {
            c.varlen = vl - 1;
            c.nseq = (int)rng_int(&r, 1, 5);
            for (int s = 0; s < c.nseq; s++) {
                c.qlens[s] = rng_int(&r, 0, 3) ? rng_int(&r, 0, 60) : rng_int(&r, 0, 1);
                c.klens[s] = rng_int(&r, 0, 3) ? rng_int(&r, 0, 60) : rng_int(&r, 0, 1);
            }
        }
        snprintf(names[n], sizeof names[n], "random %d", n);
        c.name = names[n];
        run_case(&c, 9000 + (uint64_t)n);
    }
}

/* Longer sequences for the GPU run: several 64-row tiles and key chunks per sequence, G up to
 * 8, every head-dim class of the kernels, dbias broadcast over batch and heads. */
static void test_long_cases(void)
{
    uint64_t seed = 7000;
    acase c;
    c = shape("long: all options bf16", 2, 300, 333, 8, 1, 64, 64);
    c.dt = NSA_DTYPE_BF16, c.causal = 1, c.softcap = 5.0f, c.sinks = 1, c.seg = 1, c.bias = PAIR_11, c.dbias = 1;
    c.mask = PAIR_1H, c.p = 0.1f, c.seed = 77, c.offset = 5;
    run_case(&c, seed++);
    c = shape("long: window 100 Tq>Tk f16 hd 128", 1, 400, 260, 4, 2, 128, 128);
    c.dt = NSA_DTYPE_F16, c.wl = 100, c.wr = 20, c.bias = PAIR_FULL, c.dbias = 1, c.sinks = 1;
    run_case(&c, seed++);
    c = shape("long: hd 256 causal dropout", 1, 200, 200, 2, 1, 256, 256);
    c.dt = NSA_DTYPE_BF16, c.causal = 1, c.p = 0.2f, c.seed = 3, c.softcap = 10.0f;
    run_case(&c, seed++);
    c = shape("long: hd 192/128 segments", 1, 190, 190, 4, 4, 192, 128);
    c.dt = NSA_DTYPE_BF16, c.seg = 1, c.causal = 1;
    run_case(&c, seed++);
    /* the tuned forward tiles with softcap, sinks and Tq != Tk (their backward: src/cuda/attention/kernels.cuh) */
    c = shape("long: Tq<Tk causal softcap + sinks hd 128", 2, 200, 700, 8, 1, 128, 128);
    c.dt = NSA_DTYPE_BF16, c.causal = 1, c.softcap = 20.0f, c.sinks = 1;
    run_case(&c, seed++);
    c = shape("long: Tq>Tk window 64/8 hd 64", 1, 500, 300, 4, 2, 64, 64);
    c.dt = NSA_DTYPE_F16, c.wl = 64, c.wr = 8;
    run_case(&c, seed++);
    c = shape("long: hd 256 plain (no option)", 1, 150, 150, 2, 2, 256, 256);
    c.dt = NSA_DTYPE_BF16, c.causal = 1;
    run_case(&c, seed++);
    c = shape("long: varlen_qk mixed", 1, 0, 0, 6, 3, 96, 64), c.varlen = 2, c.nseq = 4, c.dt = NSA_DTYPE_BF16;
    const int64_t ql[4] = {130, 0, 65, 200}, kl[4] = {70, 10, 129, 260};
    memcpy(c.qlens, ql, sizeof ql), memcpy(c.klens, kl, sizeof kl);
    c.causal = 1, c.sinks = 1, c.bias = PAIR_1H, c.dbias = 1, c.p = 0.15f, c.seed = 12;
    run_case(&c, seed++);
    /* the persistent window forward (more tasks than SMs, two Q buffers): a partial last tile
     * per sequence (1100 positions x 16 heads), and Tq > Tk, where the tasks of the first 800
     * positions have no key chunk (rows that see nothing: o = 0, lse = -inf) */
    c = shape("long: persistent window, partial tiles", 2, 1100, 1100, 32, 2, 64, 64);
    c.dt = NSA_DTYPE_BF16, c.causal = 1, c.wl = 63;
    run_case(&c, seed++);
    c = shape("long: persistent window, Tq > Tk", 2, 1100, 300, 32, 2, 128, 128);
    c.dt = NSA_DTYPE_BF16, c.causal = 1, c.wl = 63;
    run_case(&c, seed++);
    g_check_threads = 1;
    c = shape("long: determinism, broadcast dbias", 3, 200, 130, 4, 2, 64, 32);
    c.dt = NSA_DTYPE_BF16, c.softcap = 3.0f, c.sinks = 1, c.bias = PAIR_11, c.dbias = 1, c.p = 0.3f, c.seed = 8;
    c.wl = 50;
    run_case(&c, seed++);
    g_check_threads = 0;
}

/* ---- finite differences of the backward ------------------------------------------------ */
static double fd_loss(world *w)
{
    if (run_fwd(&w->a) != NSA_STATUS_SUCCESS) return NAN;
    double l = 0;
    for (int64_t i = 0; i < w->o.n; i++) l += buf_get(&w->o, i) * w->dout.val[i];
    return l;
}

/* d loss / d x from the backward against central differences of the forward, f32, tiny. */
static void fd_case(const acase *c, uint64_t seed)
{
    world w;
    world_build(&w, c, seed);
    g_case = c->name;
    CHECK_STATUS(run_fwd(&w.a), NSA_STATUS_SUCCESS);
    CHECK_STATUS(run_bwd(&w.g), NSA_STATUS_SUCCESS);
    struct { const char *name; buf *x; const buf *grad; } in[] = {
        {"q", &w.q, &w.dq}, {"k", &w.k, &w.dk}, {"v", &w.v, &w.dv}, {"sinks", &w.sinks, &w.dsinks},
        {"bias", &w.bias, &w.dbias},
    };
    const double h = 1e-2;
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++) {
        if (!in[i].x->mem || !in[i].grad->mem) continue;
        double worst = 0, scale = 1e-3;
        for (int64_t e = 0; e < in[i].grad->n; e++) scale = fmax(scale, fabs(buf_get(in[i].grad, e)));
        for (int64_t e = 0; e < in[i].x->n; e++) {
            const double x0 = in[i].x->val[e];
            buf_store(in[i].x, e, x0 + h);
            const double lp = fd_loss(&w);
            buf_store(in[i].x, e, x0 - h);
            const double lm = fd_loss(&w);
            buf_store(in[i].x, e, x0);
            const double fd = (lp - lm) / (2 * h);
            worst = fmax(worst, fabs(fd - buf_get(in[i].grad, e)) / scale);
            if (isnan(fd)) worst = INFINITY;
        }
        char msg[200];
        snprintf(msg, sizeof msg, "[%s] d loss / d %s: worst relative difference %.3g", c->name, in[i].name, worst);
        CHECK_MSG(worst < 2e-3, msg);
    }
    world_free(&w);
}

static void test_finite_differences(void)
{
    acase c = shape("fd softcap+sinks+bias", 1, 5, 7, 2, 1, 4, 3);
    c.causal = 1, c.softcap = 1.5f, c.sinks = 1, c.bias = PAIR_FULL, c.dbias = 1;
    fd_case(&c, 71);
    c.name = "fd bias [1,1] broadcast, window, Tq>Tk";
    c.Tq = 7, c.Tk = 4, c.causal = 0, c.wl = 1, c.wr = 2, c.bias = PAIR_11, c.B = 2, c.HQ = 2, c.H = 2;
    fd_case(&c, 72);
    c = shape("fd dropout+segments+mask", 1, 6, 6, 2, 1, 4, 3);
    c.p = 0.3f, c.seed = 5, c.seg = 1, c.mask = PAIR_FULL, c.sinks = 1;
    fd_case(&c, 73);
}

/* ---- Philox and dropout ------------------------------------------------------------------ */
static void test_philox(void)
{
    /* Random123's known answers for philox4x32-10 (kat_vectors) */
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u},
        {~0u, ~0u, ~0u, ~0u, ~0u, ~0u, 0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu},
        {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u, 0xd16cfe09u, 0x94fdccebu,
         0x5001e420u, 0x24126ea1u},
    };
    for (int t = 0; t < 3; t++) {
        uint32_t lib[4], ref[4];
        nsa_philox4x32_10(kat[t], kat[t][4], kat[t][5], lib);
        ref_philox4x32_10(kat[t], kat[t] + 4, ref);
        CHECK(memcmp(lib, kat[t] + 6, sizeof lib) == 0);
        CHECK(memcmp(ref, kat[t] + 6, sizeof ref) == 0);
    }
}

/* v = one-hot rows (DV = Tk, H = 1), no mask: o[i, hq, j] = P_ij keep_ij / (1 - p), so the
 * library's dropout mask can be read off o, element by element, and compared with the
 * reference's Philox; the kept fraction must sit within 6 sigma of 1 - p. */
static void test_dropout_mask(void)
{
    acase c = shape("dropout mask", 2, 40, 32, 4, 1, 16, 32);
    c.p = 0.25f, c.seed = 0xfeedbeefcafe1234ull, c.offset = 3;
    world w;
    world_build(&w, &c, 81);
    for (int64_t b = 0; b < 2; b++)
        for (int64_t j = 0; j < 32; j++)
            for (int64_t d = 0; d < 32; d++) buf_store(&w.v, (b * 32 + j) * 32 + d, j == d ? 1.0 : 0.0);
    CHECK_STATUS(run_fwd(&w.a), NSA_STATUS_SUCCESS);
    long mismatched = 0, dropped = 0, n = 0;
    for (int64_t b = 0; b < 2; b++)
        for (int64_t i = 0; i < 40; i++)
            for (int64_t hq = 0; hq < 4; hq++)
                for (int64_t j = 0; j < 32; j++) {
                    const int kept_lib = buf_get(&w.o, ((b * 40 + i) * 4 + hq) * 32 + j) != 0.0;
                    const int kept_ref = ref_dropout_keep(c.p, c.seed, c.offset, b, 4, hq, i, j);
                    mismatched += kept_lib != kept_ref;
                    dropped += !kept_lib;
                    n++;
                }
    CHECK_MSG(mismatched == 0, "the CPU dropout mask differs from the reference Philox mask");
    const double sd = sqrt(n * 0.25 * 0.75);
    CHECK_MSG(fabs(dropped - 0.25 * n) < 6 * sd, "dropped fraction far from p");
    world_free(&w);
}

static void test_dropout_seeds(void)
{
    acase c = shape("dropout seeds", 1, 16, 16, 2, 1, 16, 16);
    c.p = 0.2f, c.seed = 1;
    world w;
    world_build(&w, &c, 91);
    const size_t bytes = w.o.bytes;
    unsigned char *o1 = malloc(bytes);
    double *o2 = malloc((size_t)w.o.n * sizeof(double));
    run_fwd(&w.a);
    memcpy(o1, w.o.mem, bytes);
    memset(w.o.mem, 0xFF, bytes);
    run_fwd(&w.a);
    CHECK_MSG(memcmp(o1, w.o.mem, bytes) == 0, "same seed and offset: output not bitwise equal");
    w.a.dropout_seed = 2;
    run_fwd(&w.a);
    CHECK_MSG(memcmp(o1, w.o.mem, bytes) != 0, "a different seed gave the same output");
    w.a.dropout_seed = 1, w.a.dropout_offset = 2; /* B * HQ = 2: fresh counters */
    run_fwd(&w.a);
    CHECK_MSG(memcmp(o1, w.o.mem, bytes) != 0, "a different offset gave the same output");
    /* the expectation over seeds is the undropped output: with Var[o] per element known
     * exactly from P, the mean squared z-score of the average over N fixed seeds is ~1
     * (about chi2 with >= 32 degrees of freedom, / dof); [0.25, 3] holds with margin */
    w.a.dropout_p = 0.0f;
    run_fwd(&w.a);
    for (int64_t e = 0; e < w.o.n; e++) o2[e] = buf_get(&w.o, e);
    enum { N = 400 };
    double *mean = calloc((size_t)w.o.n, sizeof(double));
    w.a.dropout_p = 0.2f;
    for (int s = 0; s < N; s++) {
        w.a.dropout_seed = 1000 + (uint64_t)s;
        run_fwd(&w.a);
        for (int64_t e = 0; e < w.o.n; e++) mean[e] += buf_get(&w.o, e) / N;
    }
    /* Var[o_d] = p / (1 - p) sum_j P_j^2 v_jd^2, P from the reference */
    ref_attn_opts o;
    memset(&o, 0, sizeof o);
    o.scale = 0.25, o.window_left = o.window_right = -1;
    double z2 = 0;
    for (int64_t hq = 0; hq < 2; hq++)
        for (int64_t i = 0; i < 16; i++) {
            double s[16], mx = -INFINITY, z = 0;
            for (int64_t j = 0; j < 16; j++) {
                double dd = 0;
                for (int64_t d = 0; d < 16; d++) dd += w.q.val[(i * 2 + hq) * 16 + d] * w.k.val[j * 16 + d];
                s[j] = 0.25 * dd;
                mx = fmax(mx, s[j]);
            }
            for (int64_t j = 0; j < 16; j++) z += exp(s[j] - mx);
            for (int64_t d = 0; d < 16; d++) {
                double var = 0;
                for (int64_t j = 0; j < 16; j++) {
                    const double P = exp(s[j] - mx) / z, vv = w.v.val[j * 16 + d];
                    var += P * P * vv * vv;
                }
                var *= 0.2 / 0.8;
                const int64_t e = (i * 2 + hq) * 16 + d;
                z2 += (mean[e] - o2[e]) * (mean[e] - o2[e]) / (var / N);
            }
        }
    z2 /= (double)w.o.n;
    char msg[120];
    snprintf(msg, sizeof msg, "dropout mean over %d seeds: mean squared z-score %.3f, want ~1", (int)N, z2);
    CHECK_MSG(z2 > 0.25 && z2 < 3.0, msg);
    free(mean), free(o1), free(o2);
    world_free(&w);
}

/* Every test on one backend: the CPU (mem NULL), or the CUDA backend with device memory
 * hooks (the determinism check then compares two runs of the same context). The Philox
 * answers and the finite differences (f32 only) are backend-independent: CPU only. */
void test_attention_on(nsa_backend backend, const sweep_memory *mem)
{
    nsa_context_desc d;
    memset(&d, 0, sizeof d);
    d.backend = backend;
    g_mem = mem;
    CHECK_STATUS(nsa_context_create(&g_ctx, &d), NSA_STATUS_SUCCESS);
    g_ctx1 = g_ctx;
    if (!mem) {
        d.num_threads = 1;
        CHECK_STATUS(nsa_context_create(&g_ctx1, &d), NSA_STATUS_SUCCESS);
    }
    /* NSA_TEST_ATTENTION_QUICK=1: the fixed cases only (the sanitizers' runs on the GPU) */
    const char *quick = getenv("NSA_TEST_ATTENTION_QUICK");
    const int all = !(quick && quick[0] == '1');
    if (g_ctx && g_ctx1) {
        if (!mem) test_philox();
        test_cases();
        if (all) test_random_cases();
        if (mem && all) test_long_cases();
        if (!mem) test_finite_differences();
        if (all) test_dropout_mask();
        if (all) test_dropout_seeds();
    }
    if (g_ctx1 != g_ctx) nsa_context_destroy(g_ctx1);
    nsa_context_destroy(g_ctx);
    g_ctx = g_ctx1 = NULL;
    g_mem = NULL;
}

void test_attention_all(void) { test_attention_on(NSA_BACKEND_CPU, NULL); }
