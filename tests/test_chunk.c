/* test_chunk.c -- query chunks (nsa.h "Query chunks", spec 0.3): the NSA operations on the last
 * Tq positions of Tk-token sequences, the local step of context parallelism. Each random case
 * draws whole sequences, calls the operation with q (and the gates, dout, the caller's indices)
 * restricted to rows [s, Tk) as strided views into the whole arrays, and checks:
 *   - every output row against the float64 reference (tests/kit/ref.c) of the whole sequence,
 *     row s + i, with the tolerance rule (f32 storage);
 *   - the backward's dq rows and the whole dk, dv (dk_cmp, dk_slc, ...) against the reference's
 *     backward of the whole sequence with dout zero on the rows before the chunk;
 *   - the selection, row for row, equal to the same backend's whole-sequence selection (the
 *     reference then runs with those indices, so a near-tie cannot make the check flaky);
 *   - bad chunk shapes (Tk < T, kv_len negative or short, a chunk under varlen, compressed rows
 *     that are not Nc(Tk)) refused with a detail naming the argument, no output touched.
 * Chunks start anywhere: at 0 (the whole sequence), inside compressed and selection blocks, at
 * the end (no query). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "nsa.h"
#include "ref.h"
#include "sweep.h" /* sweep_tolerance */

typedef struct chunk_case {
    nsa_config cfg;
    int64_t B, Tk, s, T, HQ, H, DK, DV, Nc, n, m;
    int gates, own_cmp, own_idx, counts, sep_slc, sep_swa;
} chunk_case;

/* Whole-sequence arrays [B, Tk, ...] (compressed [B, Nc, ...]), f32 and their float64 copies. */
typedef struct whole {
    float *q, *k, *v, *ks, *vs, *kw, *vw, *kc, *vc, *g[3], *dout;
    int32_t *idx, *cnt; /* the caller's selection [B, Tk, H, m], counts [B, Tk, H] */
} whole;

static float *frand(test_rng *r, int64_t n, double lo, double hi)
{
    float *x = (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = (float)(lo + (hi - lo) * rng_uniform(r));
    return x;
}

static float *fzero(int64_t n) { return (float *)calloc((size_t)(n > 0 ? n : 1), sizeof(float)); }

/* double copy of sequence b's rows of a [B, rows, X, D] array */
static double *seq_d(const float *x, int64_t b, int64_t rows, int64_t X, int64_t D)
{
    const int64_t n = rows * X * D;
    double *y = (double *)malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
    for (int64_t i = 0; i < n; i++) y[i] = x[b * n + i];
    return y;
}

/* A view of rows [r0, r0 + rows) of each batch entry of a contiguous [B, R, X, D] array. */
static nsa_tensor view4(void *base, nsa_dtype dt, int64_t B, int64_t R, int64_t r0, int64_t rows, int64_t X, int64_t D)
{
    nsa_tensor t = nsa_tensor_4d((char *)base + (size_t)(r0 * X * D) * nsa_dtype_size(dt), dt, B, rows, X, D);
    t.stride[0] = R * X * D;
    return t;
}

static nsa_tensor view3(void *base, nsa_dtype dt, int64_t B, int64_t R, int64_t r0, int64_t rows, int64_t X)
{
    nsa_tensor t = nsa_tensor_3d((char *)base + (size_t)(r0 * X) * nsa_dtype_size(dt), dt, B, rows, X);
    t.stride[0] = R * X;
    return t;
}

static void draw_case(test_rng *r, chunk_case *c)
{
    static const int64_t L[][3] = {{4, 2, 8}, {8, 4, 16}, {8, 8, 8}, {6, 3, 12}, {4, 4, 12}};
    memset(c, 0, sizeof *c);
    nsa_config *f = &c->cfg;
    *f = nsa_config_default();
    const int64_t *l = L[rng_int(r, 0, 4)];
    f->cmp_len = l[0], f->cmp_stride = l[1], f->slc_block = l[2];
    f->n_init = rng_int(r, 0, 1), f->n_local = rng_int(r, 0, 2);
    f->slc_topk = f->n_init + f->n_local + rng_int(r, 1, 3);
    f->window = rng_int(r, 1, 40);
    f->scale = rng_int(r, 0, 1) ? 0.0f : 0.35f;
    f->swa_scale = rng_int(r, 0, 2) ? 0.0f : 0.2f;
    c->B = rng_int(r, 1, 2);
    c->H = rng_int(r, 1, 2);
    c->HQ = c->H * rng_int(r, 1, 4);
    c->DK = rng_int(r, 0, 1) ? 16 : 8;
    c->DV = rng_int(r, 0, 1) ? 12 : c->DK;
    c->Tk = rng_int(r, 1, 130);
    /* the chunk start: 0 (whole sequences), the end (no query), or anywhere */
    const int64_t pick = rng_int(r, 0, 9);
    c->s = pick == 0 ? 0 : pick == 1 ? c->Tk : rng_int(r, 0, c->Tk - 1);
    c->T = c->Tk - c->s;
    c->Nc = nsa_num_cmp_blocks(f, c->Tk);
    c->n = f->slc_topk;
    c->gates = (int)rng_int(r, 1, 7);
    c->own_cmp = rng_int(r, 0, 3) == 0;
    c->own_idx = rng_int(r, 0, 3) == 0;
    c->counts = c->own_idx && rng_int(r, 0, 1);
    c->m = c->own_idx ? rng_int(r, 1, 5) : c->n;
    c->sep_slc = rng_int(r, 0, 4) == 0;
    c->sep_swa = rng_int(r, 0, 4) == 0;
}

static void whole_make(whole *w, test_rng *r, const chunk_case *c)
{
    const int64_t B = c->B, Tk = c->Tk;
    memset(w, 0, sizeof *w);
    w->q = frand(r, B * Tk * c->HQ * c->DK, -1, 1);
    w->k = frand(r, B * Tk * c->H * c->DK, -1, 1);
    w->v = frand(r, B * Tk * c->H * c->DV, -1, 1);
    w->ks = frand(r, B * Tk * c->H * c->DK, -1, 1);
    w->vs = frand(r, B * Tk * c->H * c->DV, -1, 1);
    w->kw = frand(r, B * Tk * c->H * c->DK, -1, 1);
    w->vw = frand(r, B * Tk * c->H * c->DV, -1, 1);
    w->kc = frand(r, B * c->Nc * c->H * c->DK, -1, 1);
    w->vc = frand(r, B * c->Nc * c->H * c->DV, -1, 1);
    for (int x = 0; x < 3; x++) w->g[x] = frand(r, B * Tk * c->HQ, 0, 1);
    w->dout = frand(r, B * Tk * c->HQ * c->DV, -1, 1);
    const int64_t nb = nsa_num_slc_blocks(&c->cfg, Tk), rows = B * Tk * c->H;
    w->idx = (int32_t *)malloc((size_t)(rows * c->m + 1) * sizeof(int32_t));
    w->cnt = (int32_t *)malloc((size_t)(rows + 1) * sizeof(int32_t));
    for (int64_t i = 0; i < rows * c->m; i++) w->idx[i] = (int32_t)rng_int(r, -1, nb); /* -1 and nb are skipped */
    for (int64_t i = 0; i < rows; i++) w->cnt[i] = (int32_t)rng_int(r, -1, c->m + 1);
}

static void whole_free(whole *w)
{
    free(w->q), free(w->k), free(w->v), free(w->ks), free(w->vs), free(w->kw), free(w->vw), free(w->kc), free(w->vc);
    for (int x = 0; x < 3; x++) free(w->g[x]);
    free(w->dout), free(w->idx), free(w->cnt);
}

/* rows [s, Tk) of sequence b of a [B, Tk, X] array (float64 reference, row-major X per row)
 * against the chunk's [B, T, X] output; records one check named `what`. */
static void check_rows(const char *what, const chunk_case *c, const float *got, const double *const *ref, int64_t X)
{
    const int64_t n = c->B * c->T * X;
    double *want = (double *)calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t i = 0; i < c->T * X; i++) want[b * c->T * X + i] = ref[b][c->s * X + i];
    const double tol = sweep_tolerance(NSA_DTYPE_F32, want, NULL, n);
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        const int ok = isinf(want[i]) ? got[i] == want[i] : fabs(got[i] - want[i]) <= tol;
        if (!ok && bad++ == 0) first = i;
    }
    char msg[320];
    snprintf(msg, sizeof msg, "%s: %lld of %lld off (first [%lld] got %.9g want %.9g, tol %.3g); B %lld Tk %lld s %lld "
             "HQ %lld H %lld DK %lld DV %lld l %lld d %lld l' %lld n %lld w %lld gates %d", what, (long long)bad,
             (long long)n, (long long)first, first >= 0 ? got[first] : 0.0, first >= 0 ? want[first] : 0.0, tol,
             (long long)c->B, (long long)c->Tk, (long long)c->s, (long long)c->HQ, (long long)c->H, (long long)c->DK,
             (long long)c->DV, (long long)c->cfg.cmp_len, (long long)c->cfg.cmp_stride, (long long)c->cfg.slc_block,
             (long long)c->n, (long long)c->cfg.window, c->gates);
    harness_record(bad == 0, __FILE__, __LINE__, what, msg);
    free(want);
}

/* the same for a whole [B, R, X] gradient (every key row) */
static void check_all(const char *what, const chunk_case *c, const float *got, const double *const *ref, int64_t R,
                      int64_t X)
{
    chunk_case w = *c;
    w.s = 0, w.T = R;
    check_rows(what, &w, got, ref, X);
}

static double **per_seq(int64_t B) { return (double **)calloc((size_t)B, sizeof(double *)); }

static void free_seqs(double **x, int64_t B)
{
    if (!x) return;
    for (int64_t b = 0; b < B; b++) free(x[b]);
    free(x);
}

/* A workspace of the size the query just wrote to *need (read here, after the query ran). */
static void *ws_for(nsa_status st, const size_t *need)
{
    CHECK_STATUS(st, NSA_STATUS_SUCCESS);
    return malloc(*need ? *need : 1);
}

/* ---- the whole NSA, forward and backward -------------------------------------------------- */

/* The forward args of rows [r0, r0 + rows) of the whole arrays (r0 = 0, rows = Tk: the whole
 * sequences), outputs into o, ob / lb (per branch), sel. */
static nsa_forward_args forward_args(const chunk_case *c, whole *w, int64_t r0, int64_t rows, float *o, float *const ob[3],
                                     float *const lb[3], int32_t *sel)
{
    const int64_t B = c->B, Tk = c->Tk, HQ = c->HQ, H = c->H;
    nsa_forward_args a;
    memset(&a, 0, sizeof a);
    a.q = view4(w->q, NSA_DTYPE_F32, B, Tk, r0, rows, HQ, c->DK);
    a.k = nsa_tensor_4d(w->k, NSA_DTYPE_F32, B, Tk, H, c->DK);
    a.v = nsa_tensor_4d(w->v, NSA_DTYPE_F32, B, Tk, H, c->DV);
    if (c->sep_slc) {
        a.k_slc = nsa_tensor_4d(w->ks, NSA_DTYPE_F32, B, Tk, H, c->DK);
        a.v_slc = nsa_tensor_4d(w->vs, NSA_DTYPE_F32, B, Tk, H, c->DV);
    }
    if (c->sep_swa) {
        a.k_swa = nsa_tensor_4d(w->kw, NSA_DTYPE_F32, B, Tk, H, c->DK);
        a.v_swa = nsa_tensor_4d(w->vw, NSA_DTYPE_F32, B, Tk, H, c->DV);
    }
    if (c->own_cmp) {
        a.k_cmp = nsa_tensor_4d(w->kc, NSA_DTYPE_F32, B, c->Nc, H, c->DK);
        a.v_cmp = nsa_tensor_4d(w->vc, NSA_DTYPE_F32, B, c->Nc, H, c->DV);
    }
    nsa_tensor *g[3] = {&a.g_cmp, &a.g_slc, &a.g_swa};
    nsa_tensor *so[3] = {&a.saved.o_cmp, &a.saved.o_slc, &a.saved.o_swa};
    nsa_tensor *sl[3] = {&a.saved.lse_cmp, &a.saved.lse_slc, &a.saved.lse_swa};
    for (int x = 0; x < 3; x++) {
        if (!(c->gates >> x & 1)) continue;
        *g[x] = view3(w->g[x], NSA_DTYPE_F32, B, Tk, r0, rows, HQ);
        *so[x] = nsa_tensor_4d(ob[x], NSA_DTYPE_F32, B, rows, HQ, c->DV);
        *sl[x] = nsa_tensor_3d(lb[x], NSA_DTYPE_F32, B, rows, HQ);
    }
    if (c->own_idx) {
        a.block_indices = view4(w->idx, NSA_DTYPE_I32, B, Tk, r0, rows, H, c->m);
        if (c->counts) a.block_counts = view3(w->cnt, NSA_DTYPE_I32, B, Tk, r0, rows, H);
    } else if (c->gates & 2) {
        a.saved.block_indices = nsa_tensor_4d(sel, NSA_DTYPE_I32, B, rows, H, c->n);
    }
    a.o = nsa_tensor_4d(o, NSA_DTYPE_F32, B, rows, HQ, c->DV);
    a.config = c->cfg;
    return a;
}

static int run_forward(nsa_context *ctx, const nsa_forward_args *a)
{
    size_t need = 0;
    void *ws = ws_for(nsa_forward_workspace_size(ctx, a, &need), &need);
    nsa_status st = nsa_forward(ctx, a, ws, need);
    CHECK_STATUS(st, NSA_STATUS_SUCCESS);
    free(ws);
    return st == NSA_STATUS_SUCCESS;
}

static void pipeline_case(nsa_context *ctx, const chunk_case *c, whole *w)
{
    const int64_t B = c->B, Tk = c->Tk, T = c->T, HQ = c->HQ, H = c->H, DK = c->DK, DV = c->DV;
    /* the same backend over the whole sequences: its selection is the chunk's rows' */
    float *o_w = fzero(B * Tk * HQ * DV), *ob_w[3], *lb_w[3];
    int32_t *sel_w = (int32_t *)calloc((size_t)(B * Tk * H * c->n + 1), sizeof(int32_t));
    for (int x = 0; x < 3; x++) ob_w[x] = fzero(B * Tk * HQ * DV), lb_w[x] = fzero(B * Tk * HQ);
    nsa_forward_args aw = forward_args(c, w, 0, Tk, o_w, ob_w, lb_w, sel_w);
    run_forward(ctx, &aw);

    float *o = fzero(B * T * HQ * DV), *ob[3], *lb[3];
    int32_t *sel = (int32_t *)calloc((size_t)(B * T * H * c->n + 1), sizeof(int32_t));
    for (int x = 0; x < 3; x++) ob[x] = fzero(B * T * HQ * DV), lb[x] = fzero(B * T * HQ);
    nsa_forward_args a = forward_args(c, w, c->s, T, o, ob, lb, sel);
    if (!run_forward(ctx, &a)) goto out;

    const int selecting = (c->gates & 2) && !c->own_idx;
    if (selecting) {
        int64_t bad = 0;
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < T * H * c->n; i++)
                bad += sel[b * T * H * c->n + i] != sel_w[(b * Tk + c->s) * H * c->n + i];
        CHECK_MSG(bad == 0, "nsa_forward: a chunk's selection differs from the whole sequence's rows");
    }

    /* the reference over the whole sequences, with the selection the backend made */
    double **ro = per_seq(B), **rb[3] = {per_seq(B), per_seq(B), per_seq(B)};
    double **rdq = per_seq(B), **rdk = per_seq(B), **rdv = per_seq(B), **rdks = per_seq(B), **rdvs = per_seq(B);
    double **rdkw = per_seq(B), **rdvw = per_seq(B), **rdkc = per_seq(B), **rdvc = per_seq(B), **rdg[3];
    for (int x = 0; x < 3; x++) rdg[x] = per_seq(B);
    for (int64_t b = 0; b < B; b++) {
        const ref_dims d = {Tk, HQ, H, DK, DV};
        double *q = seq_d(w->q, b, Tk, HQ, DK), *k = seq_d(w->k, b, Tk, H, DK), *v = seq_d(w->v, b, Tk, H, DV);
        double *ks = seq_d(w->ks, b, Tk, H, DK), *vs = seq_d(w->vs, b, Tk, H, DV);
        double *kw = seq_d(w->kw, b, Tk, H, DK), *vw = seq_d(w->vw, b, Tk, H, DV);
        double *kc = seq_d(w->kc, b, c->Nc, H, DK), *vc = seq_d(w->vc, b, c->Nc, H, DV), *g[3];
        for (int x = 0; x < 3; x++) g[x] = seq_d(w->g[x], b, Tk, HQ, 1);
        ref_nsa_inputs in;
        memset(&in, 0, sizeof in);
        in.q = q, in.k = k, in.v = v;
        if (c->sep_slc) in.k_slc = ks, in.v_slc = vs;
        if (c->sep_swa) in.k_swa = kw, in.v_swa = vw;
        if (c->own_cmp) in.k_cmp = kc, in.v_cmp = vc;
        if (c->gates & 1) in.g_cmp = g[0];
        if (c->gates & 2) in.g_slc = g[1];
        if (c->gates & 4) in.g_swa = g[2];
        if (c->own_idx) {
            in.block_indices = w->idx + b * Tk * H * c->m, in.m = c->m;
            if (c->counts) in.block_counts = w->cnt + b * Tk * H;
        } else if (c->gates & 2) {
            in.block_indices = sel_w + b * Tk * H * c->n, in.m = c->n;
        }
        ro[b] = (double *)calloc((size_t)(Tk * HQ * DV + 1), sizeof(double));
        for (int x = 0; x < 3; x++) rb[x][b] = (double *)calloc((size_t)(Tk * HQ * DV + 1), sizeof(double));
        ref_nsa_forward(&c->cfg, c->cfg.scale != 0.0f ? c->cfg.scale : 1.0 / sqrt((double)DK), d, &in, ro[b], rb[0][b],
                        rb[1][b], rb[2][b], NULL);
        /* the backward of the whole sequence with dout zero before the chunk */
        double *dfull = (double *)calloc((size_t)(Tk * HQ * DV + 1), sizeof(double));
        for (int64_t i = c->s * HQ * DV; i < Tk * HQ * DV; i++) dfull[i] = w->dout[b * Tk * HQ * DV + i];
        ref_nsa_grads gr;
        memset(&gr, 0, sizeof gr);
        double **outs[] = {rdq, rdk, rdv, rdks, rdvs, rdkw, rdvw, rdkc, rdvc, rdg[0], rdg[1], rdg[2]};
        const int64_t sizes[] = {Tk * HQ * DK, Tk * H * DK, Tk * H * DV, Tk * H * DK, Tk * H * DV, Tk * H * DK,
                                 Tk * H * DV, c->Nc * H * DK, c->Nc * H * DV, Tk * HQ, Tk * HQ, Tk * HQ};
        for (int x = 0; x < 12; x++) outs[x][b] = (double *)calloc((size_t)(sizes[x] + 1), sizeof(double));
        gr.dq = rdq[b], gr.dk = rdk[b], gr.dv = rdv[b];
        if (c->sep_slc) gr.dk_slc = rdks[b], gr.dv_slc = rdvs[b];
        if (c->sep_swa) gr.dk_swa = rdkw[b], gr.dv_swa = rdvw[b];
        if (c->own_cmp) gr.dk_cmp = rdkc[b], gr.dv_cmp = rdvc[b];
        if (c->gates & 1) gr.dg_cmp = rdg[0][b];
        if (c->gates & 2) gr.dg_slc = rdg[1][b];
        if (c->gates & 4) gr.dg_swa = rdg[2][b];
        ref_nsa_backward(&c->cfg, c->cfg.scale != 0.0f ? c->cfg.scale : 1.0 / sqrt((double)DK), d, &in, dfull, &gr);
        free(dfull), free(q), free(k), free(v), free(ks), free(vs), free(kw), free(vw), free(kc), free(vc);
        for (int x = 0; x < 3; x++) free(g[x]);
    }
    check_rows("nsa_forward o", c, o, (const double *const *)ro, HQ * DV);
    static const char *const bn[3] = {"nsa_forward saved.o_cmp", "nsa_forward saved.o_slc", "nsa_forward saved.o_swa"};
    for (int x = 0; x < 3; x++)
        if (c->gates >> x & 1) check_rows(bn[x], c, ob[x], (const double *const *)rb[x], HQ * DV);

    /* backward */
    {
        nsa_backward_args ba;
        memset(&ba, 0, sizeof ba);
        ba.fwd = a;
        ba.dout = view4(w->dout, NSA_DTYPE_F32, B, Tk, c->s, T, HQ, DV);
        float *dq = fzero(B * T * HQ * DK), *dk = fzero(B * Tk * H * DK), *dv = fzero(B * Tk * H * DV);
        float *dks = fzero(B * Tk * H * DK), *dvs = fzero(B * Tk * H * DV), *dkw = fzero(B * Tk * H * DK);
        float *dvw = fzero(B * Tk * H * DV), *dkc = fzero(B * c->Nc * H * DK), *dvc = fzero(B * c->Nc * H * DV);
        float *dg[3] = {fzero(B * T * HQ), fzero(B * T * HQ), fzero(B * T * HQ)};
        ba.dq = nsa_tensor_4d(dq, NSA_DTYPE_F32, B, T, HQ, DK);
        ba.dk = nsa_tensor_4d(dk, NSA_DTYPE_F32, B, Tk, H, DK);
        ba.dv = nsa_tensor_4d(dv, NSA_DTYPE_F32, B, Tk, H, DV);
        if (c->sep_slc) {
            ba.dk_slc = nsa_tensor_4d(dks, NSA_DTYPE_F32, B, Tk, H, DK);
            ba.dv_slc = nsa_tensor_4d(dvs, NSA_DTYPE_F32, B, Tk, H, DV);
        }
        if (c->sep_swa) {
            ba.dk_swa = nsa_tensor_4d(dkw, NSA_DTYPE_F32, B, Tk, H, DK);
            ba.dv_swa = nsa_tensor_4d(dvw, NSA_DTYPE_F32, B, Tk, H, DV);
        }
        if (c->own_cmp) {
            ba.dk_cmp = nsa_tensor_4d(dkc, NSA_DTYPE_F32, B, c->Nc, H, DK);
            ba.dv_cmp = nsa_tensor_4d(dvc, NSA_DTYPE_F32, B, c->Nc, H, DV);
        }
        nsa_tensor *dgt[3] = {&ba.dg_cmp, &ba.dg_slc, &ba.dg_swa};
        for (int x = 0; x < 3; x++)
            if (c->gates >> x & 1) *dgt[x] = nsa_tensor_3d(dg[x], NSA_DTYPE_F32, B, T, HQ);
        size_t need = 0;
        void *ws = ws_for(nsa_backward_workspace_size(ctx, &ba, &need), &need);
        nsa_status st = nsa_backward(ctx, &ba, ws, need);
        CHECK_STATUS(st, NSA_STATUS_SUCCESS);
        free(ws);
        if (st == NSA_STATUS_SUCCESS) {
            check_rows("nsa_backward dq", c, dq, (const double *const *)rdq, HQ * DK);
            check_all("nsa_backward dk", c, dk, (const double *const *)rdk, Tk, H * DK);
            check_all("nsa_backward dv", c, dv, (const double *const *)rdv, Tk, H * DV);
            if (c->sep_slc) {
                check_all("nsa_backward dk_slc", c, dks, (const double *const *)rdks, Tk, H * DK);
                check_all("nsa_backward dv_slc", c, dvs, (const double *const *)rdvs, Tk, H * DV);
            }
            if (c->sep_swa) {
                check_all("nsa_backward dk_swa", c, dkw, (const double *const *)rdkw, Tk, H * DK);
                check_all("nsa_backward dv_swa", c, dvw, (const double *const *)rdvw, Tk, H * DV);
            }
            if (c->own_cmp) {
                check_all("nsa_backward dk_cmp", c, dkc, (const double *const *)rdkc, c->Nc, H * DK);
                check_all("nsa_backward dv_cmp", c, dvc, (const double *const *)rdvc, c->Nc, H * DV);
            }
            static const char *const gn[3] = {"nsa_backward dg_cmp", "nsa_backward dg_slc", "nsa_backward dg_swa"};
            for (int x = 0; x < 3; x++)
                if (c->gates >> x & 1) check_rows(gn[x], c, dg[x], (const double *const *)rdg[x], HQ);
        }
        free(dq), free(dk), free(dv), free(dks), free(dvs), free(dkw), free(dvw), free(dkc), free(dvc);
        for (int x = 0; x < 3; x++) free(dg[x]);
    }
    free_seqs(ro, B), free_seqs(rdq, B), free_seqs(rdk, B), free_seqs(rdv, B), free_seqs(rdks, B), free_seqs(rdvs, B);
    free_seqs(rdkw, B), free_seqs(rdvw, B), free_seqs(rdkc, B), free_seqs(rdvc, B);
    for (int x = 0; x < 3; x++) free_seqs(rb[x], B), free_seqs(rdg[x], B);
out:
    free(o), free(sel), free(o_w), free(sel_w);
    for (int x = 0; x < 3; x++) free(ob[x]), free(lb[x]), free(ob_w[x]), free(lb_w[x]);
}

/* ---- the single operations ---------------------------------------------------------------- */

static void ops_case(nsa_context *ctx, const chunk_case *c, whole *w, test_rng *r)
{
    const int64_t B = c->B, Tk = c->Tk, T = c->T, HQ = c->HQ, H = c->H, DK = c->DK, DV = c->DV, Nc = c->Nc;
    const double scale = c->cfg.scale != 0.0f ? c->cfg.scale : 1.0 / sqrt((double)DK);
    double **ro = per_seq(B), **rl = per_seq(B), **rdq = per_seq(B), **rdk = per_seq(B), **rdv = per_seq(B);
    double **so = per_seq(B), **sl = per_seq(B), **sdq = per_seq(B), **sdk = per_seq(B), **sdv = per_seq(B);
    for (int64_t b = 0; b < B; b++) {
        const ref_dims d = {Tk, HQ, H, DK, DV};
        double *q = seq_d(w->q, b, Tk, HQ, DK), *k = seq_d(w->k, b, Tk, H, DK), *v = seq_d(w->v, b, Tk, H, DV);
        double *kc = seq_d(w->kc, b, Nc, H, DK), *vc = seq_d(w->vc, b, Nc, H, DV);
        double *dfull = (double *)calloc((size_t)(Tk * HQ * DV + 1), sizeof(double));
        for (int64_t i = c->s * HQ * DV; i < Tk * HQ * DV; i++) dfull[i] = w->dout[b * Tk * HQ * DV + i];
        ro[b] = (double *)calloc((size_t)(Tk * HQ * DV + 1), sizeof(double));
        rl[b] = (double *)calloc((size_t)(Tk * HQ + 1), sizeof(double));
        rdq[b] = (double *)calloc((size_t)(Tk * HQ * DK + 1), sizeof(double));
        rdk[b] = (double *)calloc((size_t)(Nc * H * DK + 1), sizeof(double));
        rdv[b] = (double *)calloc((size_t)(Nc * H * DV + 1), sizeof(double));
        ref_cmp_attn(&c->cfg, scale, d, Nc, q, kc, vc, ro[b], rl[b]);
        ref_cmp_attn_bwd(&c->cfg, scale, d, Nc, q, kc, vc, dfull, NULL, rdq[b], rdk[b], rdv[b]);
        so[b] = (double *)calloc((size_t)(Tk * HQ * DV + 1), sizeof(double));
        sl[b] = (double *)calloc((size_t)(Tk * HQ + 1), sizeof(double));
        sdq[b] = (double *)calloc((size_t)(Tk * HQ * DK + 1), sizeof(double));
        sdk[b] = (double *)calloc((size_t)(Tk * H * DK + 1), sizeof(double));
        sdv[b] = (double *)calloc((size_t)(Tk * H * DV + 1), sizeof(double));
        const int32_t *idx = w->idx + b * Tk * H * c->m, *cnt = c->counts ? w->cnt + b * Tk * H : NULL;
        ref_slc_attn(&c->cfg, scale, d, q, k, v, idx, c->m, cnt, so[b], sl[b]);
        ref_slc_attn_bwd(&c->cfg, scale, d, q, k, v, idx, c->m, cnt, dfull, NULL, sdq[b], sdk[b], sdv[b]);
        free(q), free(k), free(v), free(kc), free(vc), free(dfull);
    }

    /* compressed attention: the caller's compressed keys of Tk tokens, named by kv_len */
    float *o = fzero(B * T * HQ * DV), *lse = fzero(B * T * HQ), *dq = fzero(B * T * HQ * DK);
    float *dkc = fzero(B * Nc * H * DK), *dvc = fzero(B * Nc * H * DV);
    nsa_cmp_attn_bwd_args cb;
    memset(&cb, 0, sizeof cb);
    nsa_cmp_attn_args *ca = &cb.fwd;
    ca->q = view4(w->q, NSA_DTYPE_F32, B, Tk, c->s, T, HQ, DK);
    ca->k_cmp = nsa_tensor_4d(w->kc, NSA_DTYPE_F32, B, Nc, H, DK);
    ca->v_cmp = nsa_tensor_4d(w->vc, NSA_DTYPE_F32, B, Nc, H, DV);
    ca->o = nsa_tensor_4d(o, NSA_DTYPE_F32, B, T, HQ, DV);
    ca->lse = nsa_tensor_3d(lse, NSA_DTYPE_F32, B, T, HQ);
    ca->config = c->cfg;
    ca->kv_len = Tk;
    size_t need = 0;
    void *ws = ws_for(nsa_cmp_attn_workspace_size(ctx, ca, &need), &need);
    CHECK_STATUS(nsa_cmp_attn(ctx, ca, ws, need), NSA_STATUS_SUCCESS);
    free(ws);
    check_rows("nsa_cmp_attn o", c, o, (const double *const *)ro, HQ * DV);
    check_rows("nsa_cmp_attn lse", c, lse, (const double *const *)rl, HQ);
    cb.dout = view4(w->dout, NSA_DTYPE_F32, B, Tk, c->s, T, HQ, DV);
    cb.dq = nsa_tensor_4d(dq, NSA_DTYPE_F32, B, T, HQ, DK);
    cb.dk_cmp = nsa_tensor_4d(dkc, NSA_DTYPE_F32, B, Nc, H, DK);
    cb.dv_cmp = nsa_tensor_4d(dvc, NSA_DTYPE_F32, B, Nc, H, DV);
    ws = ws_for(nsa_cmp_attn_bwd_workspace_size(ctx, &cb, &need), &need);
    CHECK_STATUS(nsa_cmp_attn_bwd(ctx, &cb, ws, need), NSA_STATUS_SUCCESS);
    free(ws);
    check_rows("nsa_cmp_attn_bwd dq", c, dq, (const double *const *)rdq, HQ * DK);
    check_all("nsa_cmp_attn_bwd dk_cmp", c, dkc, (const double *const *)rdk, Nc, H * DK);
    check_all("nsa_cmp_attn_bwd dv_cmp", c, dvc, (const double *const *)rdv, Nc, H * DV);

    /* selection: the chunk's rows equal the whole sequence's, with and without the given lse */
    for (int given_lse = 0; given_lse < 2; given_lse++) {
        int32_t *sel_w = (int32_t *)calloc((size_t)(B * Tk * H * c->n + 1), sizeof(int32_t));
        int32_t *sel = (int32_t *)calloc((size_t)(B * T * H * c->n + 1), sizeof(int32_t));
        int32_t *cnt = (int32_t *)calloc((size_t)(B * T * H + 1), sizeof(int32_t));
        float *lse_w = frand(r, B * Tk * HQ, 1, 3); /* a given normaliser per row */
        nsa_select_args sa;
        memset(&sa, 0, sizeof sa);
        sa.q = nsa_tensor_4d(w->q, NSA_DTYPE_F32, B, Tk, HQ, DK);
        sa.k_cmp = nsa_tensor_4d(w->kc, NSA_DTYPE_F32, B, Nc, H, DK);
        if (given_lse) sa.lse_cmp = nsa_tensor_3d(lse_w, NSA_DTYPE_F32, B, Tk, HQ);
        sa.block_indices = nsa_tensor_4d(sel_w, NSA_DTYPE_I32, B, Tk, H, c->n);
        sa.config = c->cfg;
        ws = ws_for(nsa_select_workspace_size(ctx, &sa, &need), &need);
        CHECK_STATUS(nsa_select(ctx, &sa, ws, need), NSA_STATUS_SUCCESS);
        free(ws);
        sa.q = view4(w->q, NSA_DTYPE_F32, B, Tk, c->s, T, HQ, DK);
        if (given_lse) sa.lse_cmp = view3(lse_w, NSA_DTYPE_F32, B, Tk, c->s, T, HQ);
        sa.block_indices = nsa_tensor_4d(sel, NSA_DTYPE_I32, B, T, H, c->n);
        sa.block_counts = nsa_tensor_3d(cnt, NSA_DTYPE_I32, B, T, H);
        sa.kv_len = Tk;
        ws = ws_for(nsa_select_workspace_size(ctx, &sa, &need), &need);
        CHECK_STATUS(nsa_select(ctx, &sa, ws, need), NSA_STATUS_SUCCESS);
        free(ws);
        int64_t bad = 0, badc = 0;
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < T; i++)
                for (int64_t h = 0; h < H; h++) {
                    int64_t kept = 0;
                    for (int64_t e = 0; e < c->n; e++) {
                        const int32_t got = sel[((b * T + i) * H + h) * c->n + e];
                        bad += got != sel_w[(((b * Tk + c->s + i) * H + h) * c->n) + e];
                        kept += got >= 0;
                    }
                    /* min(n, cur + 1) blocks, cur the block of position s + i */
                    const int64_t cur = (c->s + i) / c->cfg.slc_block, want = c->n < cur + 1 ? c->n : cur + 1;
                    badc += cnt[(b * T + i) * H + h] != want || kept != want;
                }
        CHECK_MSG(bad == 0, given_lse ? "nsa_select (lse_cmp given): a chunk's rows differ from the whole sequence's"
                                      : "nsa_select: a chunk's rows differ from the whole sequence's");
        CHECK_MSG(badc == 0, "nsa_select: a chunk's block_counts are not min(n, cur + 1) at its positions");
        free(sel_w), free(sel), free(cnt), free(lse_w);
    }

    /* selected attention with the caller's indices of the chunk's rows */
    float *o2 = fzero(B * T * HQ * DV), *l2 = fzero(B * T * HQ), *dq2 = fzero(B * T * HQ * DK);
    float *dk2 = fzero(B * Tk * H * DK), *dv2 = fzero(B * Tk * H * DV);
    nsa_slc_attn_bwd_args sb;
    memset(&sb, 0, sizeof sb);
    nsa_slc_attn_args *sa = &sb.fwd;
    sa->q = view4(w->q, NSA_DTYPE_F32, B, Tk, c->s, T, HQ, DK);
    sa->k = nsa_tensor_4d(w->k, NSA_DTYPE_F32, B, Tk, H, DK);
    sa->v = nsa_tensor_4d(w->v, NSA_DTYPE_F32, B, Tk, H, DV);
    sa->block_indices = view4(w->idx, NSA_DTYPE_I32, B, Tk, c->s, T, H, c->m);
    if (c->counts) sa->block_counts = view3(w->cnt, NSA_DTYPE_I32, B, Tk, c->s, T, H);
    sa->o = nsa_tensor_4d(o2, NSA_DTYPE_F32, B, T, HQ, DV);
    sa->lse = nsa_tensor_3d(l2, NSA_DTYPE_F32, B, T, HQ);
    sa->config = c->cfg;
    ws = ws_for(nsa_slc_attn_workspace_size(ctx, sa, &need), &need);
    CHECK_STATUS(nsa_slc_attn(ctx, sa, ws, need), NSA_STATUS_SUCCESS);
    free(ws);
    check_rows("nsa_slc_attn o", c, o2, (const double *const *)so, HQ * DV);
    check_rows("nsa_slc_attn lse", c, l2, (const double *const *)sl, HQ);
    sb.dout = view4(w->dout, NSA_DTYPE_F32, B, Tk, c->s, T, HQ, DV);
    sb.dq = nsa_tensor_4d(dq2, NSA_DTYPE_F32, B, T, HQ, DK);
    sb.dk = nsa_tensor_4d(dk2, NSA_DTYPE_F32, B, Tk, H, DK);
    sb.dv = nsa_tensor_4d(dv2, NSA_DTYPE_F32, B, Tk, H, DV);
    ws = ws_for(nsa_slc_attn_bwd_workspace_size(ctx, &sb, &need), &need);
    CHECK_STATUS(nsa_slc_attn_bwd(ctx, &sb, ws, need), NSA_STATUS_SUCCESS);
    free(ws);
    check_rows("nsa_slc_attn_bwd dq", c, dq2, (const double *const *)sdq, HQ * DK);
    check_all("nsa_slc_attn_bwd dk", c, dk2, (const double *const *)sdk, Tk, H * DK);
    check_all("nsa_slc_attn_bwd dv", c, dv2, (const double *const *)sdv, Tk, H * DV);

    free(o), free(lse), free(dq), free(dkc), free(dvc), free(o2), free(l2), free(dq2), free(dk2), free(dv2);
    free_seqs(ro, B), free_seqs(rl, B), free_seqs(rdq, B), free_seqs(rdk, B), free_seqs(rdv, B);
    free_seqs(so, B), free_seqs(sl, B), free_seqs(sdq, B), free_seqs(sdk, B), free_seqs(sdv, B);
}

static void test_chunk_random(void)
{
    nsa_context *ctx = harness_cpu_context(0);
    test_rng r = {0xC4C4u};
    for (int it = 0; it < 60; it++) {
        chunk_case c;
        draw_case(&r, &c);
        whole w;
        whole_make(&w, &r, &c);
        pipeline_case(ctx, &c, &w);
        ops_case(ctx, &c, &w, &r);
        whole_free(&w);
    }
    nsa_context_destroy(ctx);
}

/* ---- refusals ------------------------------------------------------------------------------ */

static void test_chunk_refusals(void)
{
    nsa_context *ctx = harness_cpu_context(0);
    test_rng r = {77};
    enum { B = 1, Tk = 40, T = 24, HQ = 4, H = 2, D = 8 };
    nsa_config cfg = nsa_config_default();
    cfg.cmp_len = 8, cfg.cmp_stride = 4, cfg.slc_block = 8, cfg.slc_topk = 3, cfg.n_init = 1, cfg.n_local = 1;
    cfg.window = 6;
    const int64_t Nc = nsa_num_cmp_blocks(&cfg, Tk);
    float *q = frand(&r, Tk * HQ * D, -1, 1), *k = frand(&r, Tk * H * D, -1, 1), *v = frand(&r, Tk * H * D, -1, 1);
    float *kc = frand(&r, (Nc + 1) * H * D, -1, 1), *g = frand(&r, Tk * HQ, 0, 1);
    float *o = frand(&r, Tk * HQ * D, 5, 6), *lse = frand(&r, Tk * HQ, 5, 6);
    float *o_keep = (float *)malloc(sizeof(float) * Tk * HQ * D);
    memcpy(o_keep, o, sizeof(float) * Tk * HQ * D);
    char ws[64];
    size_t need;

    /* the forward: k shorter than q */
    nsa_forward_args a;
    memset(&a, 0, sizeof a);
    a.q = nsa_tensor_4d(q, NSA_DTYPE_F32, B, T, HQ, D);
    a.k = nsa_tensor_4d(k, NSA_DTYPE_F32, B, T - 1, H, D);
    a.v = nsa_tensor_4d(v, NSA_DTYPE_F32, B, T - 1, H, D);
    a.g_swa = nsa_tensor_3d(g, NSA_DTYPE_F32, B, T, HQ);
    a.saved.o_swa = nsa_tensor_4d(o, NSA_DTYPE_F32, B, T, HQ, D);
    a.saved.lse_swa = nsa_tensor_3d(lse, NSA_DTYPE_F32, B, T, HQ);
    a.o = nsa_tensor_4d(o, NSA_DTYPE_F32, B, T, HQ, D);
    a.config = cfg;
    CHECK_STATUS(nsa_forward_workspace_size(ctx, &a, &need), NSA_STATUS_BAD_SHAPE);
    CHECK_DETAIL("k");
    CHECK_STATUS(nsa_forward(ctx, &a, ws, sizeof ws), NSA_STATUS_BAD_SHAPE);
    /* a chunk under varlen */
    a.k = nsa_tensor_4d(k, NSA_DTYPE_F32, B, Tk, H, D);
    a.v = nsa_tensor_4d(v, NSA_DTYPE_F32, B, Tk, H, D);
    const int32_t cu[3] = {0, 10, T};
    a.varlen.cu_seqlens = cu, a.varlen.num_seqs = 2;
    CHECK_STATUS(nsa_forward(ctx, &a, ws, sizeof ws), NSA_STATUS_BAD_SHAPE);
    CHECK_DETAIL("k");
    /* the caller's compressed rows of the wrong key length */
    memset(&a.varlen, 0, sizeof a.varlen);
    a.g_swa.data = NULL, a.saved.o_swa.data = NULL, a.saved.lse_swa.data = NULL;
    a.g_cmp = nsa_tensor_3d(g, NSA_DTYPE_F32, B, T, HQ);
    a.saved.o_cmp = nsa_tensor_4d(o, NSA_DTYPE_F32, B, T, HQ, D);
    a.saved.lse_cmp = nsa_tensor_3d(lse, NSA_DTYPE_F32, B, T, HQ);
    a.k_cmp = nsa_tensor_4d(kc, NSA_DTYPE_F32, B, nsa_num_cmp_blocks(&cfg, T), H, D);
    a.v_cmp = a.k_cmp;
    CHECK_STATUS(nsa_forward(ctx, &a, ws, sizeof ws), NSA_STATUS_BAD_SHAPE);
    CHECK_DETAIL("k_cmp");

    /* compressed attention: kv_len negative, shorter than T, or not matching k_cmp */
    nsa_cmp_attn_args ca;
    memset(&ca, 0, sizeof ca);
    ca.q = nsa_tensor_4d(q, NSA_DTYPE_F32, B, T, HQ, D);
    ca.k_cmp = nsa_tensor_4d(kc, NSA_DTYPE_F32, B, Nc, H, D);
    ca.v_cmp = ca.k_cmp;
    ca.o = nsa_tensor_4d(o, NSA_DTYPE_F32, B, T, HQ, D);
    ca.lse = nsa_tensor_3d(lse, NSA_DTYPE_F32, B, T, HQ);
    ca.config = cfg;
    ca.kv_len = -1;
    CHECK_STATUS(nsa_cmp_attn(ctx, &ca, ws, sizeof ws), NSA_STATUS_BAD_ARGUMENT);
    CHECK_DETAIL("kv_len");
    ca.kv_len = T - 1;
    CHECK_STATUS(nsa_cmp_attn(ctx, &ca, ws, sizeof ws), NSA_STATUS_BAD_SHAPE);
    CHECK_DETAIL("kv_len");
    ca.kv_len = Tk + 4; /* Nc(Tk + 4) = Nc + 1 rows */
    CHECK_STATUS(nsa_cmp_attn(ctx, &ca, ws, sizeof ws), NSA_STATUS_BAD_SHAPE);
    CHECK_DETAIL("k_cmp");
    nsa_cmp_attn_bwd_args cb;
    memset(&cb, 0, sizeof cb);
    cb.fwd = ca;
    cb.fwd.kv_len = -5;
    CHECK_STATUS(nsa_cmp_attn_bwd(ctx, &cb, ws, sizeof ws), NSA_STATUS_BAD_ARGUMENT);
    CHECK_DETAIL("fwd.kv_len");

    /* selection */
    nsa_select_args sa;
    memset(&sa, 0, sizeof sa);
    sa.q = ca.q;
    sa.k_cmp = ca.k_cmp;
    sa.block_indices = nsa_tensor_4d(o, NSA_DTYPE_I32, B, T, H, cfg.slc_topk);
    sa.config = cfg;
    sa.kv_len = T - 3;
    CHECK_STATUS(nsa_select(ctx, &sa, ws, sizeof ws), NSA_STATUS_BAD_SHAPE);
    CHECK_DETAIL("kv_len");

    /* selected attention: k shorter than q */
    nsa_slc_attn_args la;
    memset(&la, 0, sizeof la);
    la.q = ca.q;
    la.k = nsa_tensor_4d(k, NSA_DTYPE_F32, B, T - 2, H, D);
    la.v = la.k;
    la.block_indices = nsa_tensor_4d(o, NSA_DTYPE_I32, B, T, H, 2);
    la.o = ca.o;
    la.lse = ca.lse;
    la.config = cfg;
    CHECK_STATUS(nsa_slc_attn(ctx, &la, ws, sizeof ws), NSA_STATUS_BAD_SHAPE);
    CHECK_DETAIL("k");

    CHECK_MSG(!memcmp(o, o_keep, sizeof(float) * Tk * HQ * D), "a refused chunk call wrote to an output");
    free(q), free(k), free(v), free(kc), free(g), free(o), free(lse), free(o_keep);
    nsa_context_destroy(ctx);
}

/* ---- the context-parallel C entry points (nsa.h section 10): the layout, and the refusals a
 * machine without a GPU can check (the calls themselves: build/nsa_cp_tests on GPUs) ---- */
static void test_cp_entry_points(void)
{
    for (int64_t P = 1; P <= 8; P++)
        for (int64_t T = 0; T <= 301; T += (T < 20 ? 1 : 47)) {
            int64_t sum = 0, ok = 1;
            for (int64_t r = 0; r < P; r++) {
                const int64_t L = nsa_cp_local_length(T, r, P);
                /* chunks r and 2P - 1 - r of c T / 2P .. (c + 1) T / 2P */
                const int64_t c1 = 2 * P - 1 - r;
                ok &= L == (r + 1) * T / (2 * P) - r * T / (2 * P) + (c1 + 1) * T / (2 * P) - c1 * T / (2 * P);
                sum += L;
            }
            CHECK_MSG(ok && sum == T, "nsa_cp_local_length: the ranks' rows are the zigzag chunks and cover T");
        }
    CHECK(nsa_cp_local_length(10, 0, 0) == -1);
    CHECK(nsa_cp_local_length(10, 2, 2) == -1);
    CHECK(nsa_cp_local_length(10, -1, 2) == -1);
    CHECK(nsa_cp_local_length(-1, 0, 2) == -1);
    CHECK(nsa_cp_local_length(INT64_MAX, 0, 2) == -1);
    nsa_context *ctx = harness_cpu_context(0);
    nsa_cp_args a;
    memset(&a, 0, sizeof a);
    size_t need = 0;
    CHECK_STATUS(nsa_cp_forward_workspace_size(NULL, &a, &need), NSA_STATUS_NULL_POINTER);
    CHECK_DETAIL("ctx");
    CHECK_STATUS(nsa_cp_forward_workspace_size(ctx, NULL, &need), NSA_STATUS_NULL_POINTER);
    CHECK_DETAIL("args");
    CHECK_STATUS(nsa_cp_forward(ctx, &a, NULL, 0), NSA_STATUS_NOT_SUPPORTED);
    CHECK_DETAIL("ctx");
    nsa_cp_bwd_args b;
    memset(&b, 0, sizeof b);
    CHECK_STATUS(nsa_cp_backward(ctx, &b, NULL, 0), NSA_STATUS_NOT_SUPPORTED);
    CHECK_STATUS(nsa_cp_backward_workspace_size(ctx, NULL, &need), NSA_STATUS_NULL_POINTER);
    nsa_context_destroy(ctx);
}

void test_chunk_all(void)
{
    test_chunk_random();
    test_chunk_refusals();
    test_cp_entry_points();
}
