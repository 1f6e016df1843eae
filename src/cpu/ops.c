/* ops.c -- the CPU backend's public operations: pack the strided inputs into fp32 panels,
 * run the branch drivers (compress.c, range.c, slc.c), store the results. Each op's
 * workspace function runs the same carving on an empty arena, so size and use agree. */
#include "cpu.h"
#include "common.h"

static float *take_panel(ws_arena *a, const nsa_tensor *like)
{
    return (float *)ws_take(a, panel_bytes(like));
}

static float *take_zeroed_panel(ws_arena *a, const nsa_tensor *like)
{
    float *p = take_panel(a, like);
    if (p) memset(p, 0, panel_bytes(like));
    return p;
}

static float *take_dq32(ws_arena *a, const nsa_problem *p)
{
    const size_t bytes = nsa_size_mul(nsa_size_elems(p->B, p->T, p->HQ, p->DK), sizeof(float));
    float *d = (float *)ws_take(a, bytes);
    if (d) memset(d, 0, bytes);
    return d;
}

static range_rule cmp_rule(const nsa_problem *p)
{
    range_rule r = {1, p->cfg.cmp_len, p->cfg.cmp_stride, -1, -1, 1};
    return r;
}

static range_rule window_rule(int64_t wl, int64_t wr, int causal)
{
    range_rule r = {0, 0, 1, wl, wr, causal};
    return r;
}

/* The sliding branch (spec 5): causal, window_left w - 1. */
/* The problem the sliding branch runs: its own softmax scale (config.swa_scale, resolved). */
static nsa_problem swa_problem(const nsa_problem *p)
{
    nsa_problem pw = *p;
    pw.scale = p->swa_scale;
    return pw;
}

static range_rule swa_rule(const nsa_problem *p)
{
    return window_rule(nsa_rule_swa_left(p->cfg.window), 0, 1);
}

/* Larger of two scratch needs: phases run one after the other and share one region (an
 * overflowed need, SIZE_MAX, stays the larger). */
static size_t max_sz(size_t a, size_t b) { return a > b ? a : b; }

/* ---- 1. compression ------------------------------------------------------------------ */

static void compress_carve(ws_arena *a, const nsa_problem *p, const nsa_tensor *x, const nsa_tensor *xc,
                           int64_t **cu, float **xp, float **xcp)
{
    *cu = cpu_cmp_offsets(a, p);
    *xp = take_panel(a, x);
    *xcp = take_panel(a, xc);
}

size_t nsa_cpu_compress_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_args *a)
{
    (void)ctx;
    ws_arena w = {NULL, 0};
    int64_t *cu;
    float *xp, *xcp;
    compress_carve(&w, p, &a->x, &a->x_cmp, &cu, &xp, &xcp);
    return nsa_size_add(w.used, 64);
}

nsa_status nsa_cpu_compress(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_args *a, void *ws)
{
    ws_arena w = {(char *)ws, 0};
    int64_t *cu;
    float *xp, *xcp;
    compress_carve(&w, p, &a->x, &a->x_cmp, &cu, &xp, &xcp);
    cpu_pack_heads(ctx, &a->x, xp);
    compress_panel(ctx, p, cu, xp, a->x.shape[3], xcp);
    cpu_unpack_heads(ctx, xcp, &a->x_cmp);
    return NSA_STATUS_SUCCESS;
}

size_t nsa_cpu_compress_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_bwd_args *a)
{
    (void)ctx;
    ws_arena w = {NULL, 0};
    int64_t *cu;
    float *xp, *xcp;
    compress_carve(&w, p, &a->dx, &a->dx_cmp, &cu, &xp, &xcp);
    return nsa_size_add(w.used, 64);
}

nsa_status nsa_cpu_compress_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_bwd_args *a, void *ws)
{
    ws_arena w = {(char *)ws, 0};
    int64_t *cu;
    float *dxp, *dxcp;
    compress_carve(&w, p, &a->dx, &a->dx_cmp, &cu, &dxp, &dxcp);
    memset(dxp, 0, panel_bytes(&a->dx));
    cpu_pack_heads(ctx, &a->dx_cmp, dxcp);
    compress_panel_bwd(ctx, p, cu, dxcp, a->dx.shape[3], dxp);
    cpu_unpack_heads(ctx, dxp, &a->dx);
    return NSA_STATUS_SUCCESS;
}

/* ---- 2. compressed attention, 3. selection ------------------------------------------- */

size_t nsa_cpu_cmp_attn_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_args *a)
{
    ws_arena w = {NULL, 0};
    cpu_cmp_offsets(&w, p);
    take_panel(&w, &a->k_cmp);
    take_panel(&w, &a->v_cmp);
    range_rule r = cmp_rule(p);
    return nsa_size_add(nsa_size_add(w.used, 64), range_fwd_ws(ctx, p, &r, 0));
}

nsa_status nsa_cpu_cmp_attn(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_args *a, void *ws)
{
    ws_arena w = {(char *)ws, 0};
    int64_t *cu = cpu_cmp_offsets(&w, p);
    float *kc = take_panel(&w, &a->k_cmp), *vc = take_panel(&w, &a->v_cmp);
    cpu_pack_heads(ctx, &a->k_cmp, kc);
    cpu_pack_heads(ctx, &a->v_cmp, vc);
    range_rule r = cmp_rule(p);
    range_fwd(ctx, p, &r, cu, &a->q, kc, vc, p->cmp_rows, &a->o, &a->lse, NULL, ws_take(&w, 0));
    return NSA_STATUS_SUCCESS;
}

typedef struct bwd_panels {
    int64_t *cu;
    float *K, *V, *dq32, *dK, *dV;
} bwd_panels;

static void branch_bwd_carve(ws_arena *w, const nsa_problem *p, const nsa_tensor *k, const nsa_tensor *v,
                             bwd_panels *b)
{
    b->cu = cpu_cmp_offsets(w, p);
    b->K = take_panel(w, k);
    b->V = take_panel(w, v);
    b->dq32 = take_dq32(w, p);
    b->dK = take_zeroed_panel(w, k);
    b->dV = take_zeroed_panel(w, v);
}

/* Packs K/V, and after the branch's backward stores dq, dk, dv. */
static void branch_bwd_finish(const nsa_context *ctx, const bwd_panels *b, const nsa_tensor *dq,
                              const nsa_tensor *dk, const nsa_tensor *dv)
{
    cpu_store_dense(ctx, b->dq32, dq);
    cpu_unpack_heads(ctx, b->dK, dk);
    cpu_unpack_heads(ctx, b->dV, dv);
}

size_t nsa_cpu_cmp_attn_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_bwd_args *a)
{
    ws_arena w = {NULL, 0};
    bwd_panels b;
    branch_bwd_carve(&w, p, &a->fwd.k_cmp, &a->fwd.v_cmp, &b);
    range_rule r = cmp_rule(p);
    return nsa_size_add(nsa_size_add(w.used, 64), range_bwd_ws(ctx, p, &r));
}

nsa_status nsa_cpu_cmp_attn_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_bwd_args *a, void *ws)
{
    ws_arena w = {(char *)ws, 0};
    bwd_panels b;
    branch_bwd_carve(&w, p, &a->fwd.k_cmp, &a->fwd.v_cmp, &b);
    cpu_pack_heads(ctx, &a->fwd.k_cmp, b.K);
    cpu_pack_heads(ctx, &a->fwd.v_cmp, b.V);
    grad_src g = {&a->dout, NULL, &a->fwd.o, &a->fwd.lse};
    range_rule r = cmp_rule(p);
    range_bwd(ctx, p, &r, b.cu, &a->fwd.q, b.K, b.V, p->cmp_rows, &g, b.dq32, b.dK, b.dV, ws_take(&w, 0));
    branch_bwd_finish(ctx, &b, &a->dq, &a->dk_cmp, &a->dv_cmp);
    return NSA_STATUS_SUCCESS;
}

size_t nsa_cpu_select_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_select_args *a)
{
    ws_arena w = {NULL, 0};
    cpu_cmp_offsets(&w, p);
    take_panel(&w, &a->k_cmp);
    range_rule r = cmp_rule(p);
    return nsa_size_add(nsa_size_add(w.used, 64), range_fwd_ws(ctx, p, &r, 1));
}

nsa_status nsa_cpu_select(const nsa_context *ctx, const nsa_problem *p, const nsa_select_args *a, void *ws)
{
    ws_arena w = {(char *)ws, 0};
    int64_t *cu = cpu_cmp_offsets(&w, p);
    float *kc = take_panel(&w, &a->k_cmp);
    cpu_pack_heads(ctx, &a->k_cmp, kc);
    select_sink sel = {nsa_present(&a->lse_cmp) ? &a->lse_cmp : NULL, &a->block_indices,
                       nsa_present(&a->block_counts) ? &a->block_counts : NULL};
    range_rule r = cmp_rule(p);
    range_fwd(ctx, p, &r, cu, &a->q, kc, NULL, p->cmp_rows, NULL, NULL, &sel, ws_take(&w, 0));
    return NSA_STATUS_SUCCESS;
}

/* ---- 4. selected attention ------------------------------------------------------------ */

size_t nsa_cpu_slc_attn_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_args *a)
{
    ws_arena w = {NULL, 0};
    take_panel(&w, &a->k);
    take_panel(&w, &a->v);
    return nsa_size_add(nsa_size_add(w.used, 64), slc_fwd_ws(ctx, p));
}

nsa_status nsa_cpu_slc_attn(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_args *a, void *ws)
{
    ws_arena w = {(char *)ws, 0};
    float *K = take_panel(&w, &a->k), *V = take_panel(&w, &a->v);
    cpu_pack_heads(ctx, &a->k, K);
    cpu_pack_heads(ctx, &a->v, V);
    slc_fwd(ctx, p, &a->q, K, V, &a->block_indices, nsa_present(&a->block_counts) ? &a->block_counts : NULL, &a->o,
            &a->lse, ws_take(&w, 0));
    return NSA_STATUS_SUCCESS;
}

size_t nsa_cpu_slc_attn_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_bwd_args *a)
{
    ws_arena w = {NULL, 0};
    bwd_panels b;
    branch_bwd_carve(&w, p, &a->fwd.k, &a->fwd.v, &b);
    return nsa_size_add(nsa_size_add(w.used, 64), slc_bwd_ws(ctx, p));
}

nsa_status nsa_cpu_slc_attn_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_bwd_args *a, void *ws)
{
    ws_arena w = {(char *)ws, 0};
    bwd_panels b;
    branch_bwd_carve(&w, p, &a->fwd.k, &a->fwd.v, &b);
    cpu_pack_heads(ctx, &a->fwd.k, b.K);
    cpu_pack_heads(ctx, &a->fwd.v, b.V);
    grad_src g = {&a->dout, NULL, &a->fwd.o, &a->fwd.lse};
    slc_bwd(ctx, p, &a->fwd.q, b.K, b.V, &a->fwd.block_indices,
            nsa_present(&a->fwd.block_counts) ? &a->fwd.block_counts : NULL, &g, b.dq32, b.dK, b.dV, ws_take(&w, 0));
    branch_bwd_finish(ctx, &b, &a->dq, &a->dk, &a->dv);
    return NSA_STATUS_SUCCESS;
}

/* ---- 5. dense / windowed attention ---------------------------------------------------- */

static range_rule attention_rule(const nsa_attention_args *a)
{
    return window_rule(a->window_left, nsa_rule_window_right(a->window_right, a->causal), a->causal != 0);
}

/* Calls with any option beyond the window branch's (p->extended) take attn_ext.c's path. */
size_t nsa_cpu_attention_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_args *a)
{
    ws_arena w = {NULL, 0};
    take_panel(&w, &a->k);
    take_panel(&w, &a->v);
    range_rule r = attention_rule(a);
    return nsa_size_add(nsa_size_add(w.used, 64), p->extended ? ext_fwd_ws(ctx, p) : range_fwd_ws(ctx, p, &r, 0));
}

nsa_status nsa_cpu_attention(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_args *a, void *ws)
{
    ws_arena w = {(char *)ws, 0};
    float *K = take_panel(&w, &a->k), *V = take_panel(&w, &a->v);
    cpu_pack_heads(ctx, &a->k, K);
    cpu_pack_heads(ctx, &a->v, V);
    if (p->extended) {
        ext_fwd(ctx, p, a, K, V, ws_take(&w, 0));
        return NSA_STATUS_SUCCESS;
    }
    range_rule r = attention_rule(a);
    range_fwd(ctx, p, &r, NULL, &a->q, K, V, p->Tk, &a->o, &a->lse, NULL, ws_take(&w, 0));
    return NSA_STATUS_SUCCESS;
}

size_t nsa_cpu_attention_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_bwd_args *a)
{
    ws_arena w = {NULL, 0};
    bwd_panels b;
    branch_bwd_carve(&w, p, &a->fwd.k, &a->fwd.v, &b);
    range_rule r = attention_rule(&a->fwd);
    return nsa_size_add(nsa_size_add(w.used, 64), p->extended ? ext_bwd_ws(ctx, p, a) : range_bwd_ws(ctx, p, &r));
}

nsa_status nsa_cpu_attention_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_bwd_args *a, void *ws)
{
    ws_arena w = {(char *)ws, 0};
    bwd_panels b;
    branch_bwd_carve(&w, p, &a->fwd.k, &a->fwd.v, &b);
    cpu_pack_heads(ctx, &a->fwd.k, b.K);
    cpu_pack_heads(ctx, &a->fwd.v, b.V);
    if (p->extended) {
        ext_bwd(ctx, p, a, b.K, b.V, b.dq32, b.dK, b.dV, ws_take(&w, 0));
    } else {
        grad_src g = {&a->dout, NULL, &a->fwd.o, &a->fwd.lse};
        range_rule r = attention_rule(&a->fwd);
        range_bwd(ctx, p, &r, NULL, &a->fwd.q, b.K, b.V, p->Tk, &g, b.dq32, b.dK, b.dV, ws_take(&w, 0));
    }
    branch_bwd_finish(ctx, &b, &a->dq, &a->dk, &a->dv);
    return NSA_STATUS_SUCCESS;
}

/* ---- 6. gating ----------------------------------------------------------------------- */

/* o = sum of g_x * o_x over the present gates, row by row. */
static void gate_combine(const nsa_context *ctx, const nsa_tensor *const os[3], const nsa_tensor *const gs[3],
                         const nsa_tensor *o)
{
    const int64_t B = o->shape[0], T = o->shape[1], HQ = o->shape[2], DV = o->shape[3];
#pragma omp parallel num_threads(cpu_threads(ctx))
    {
        float acc[1024], row[1024]; /* DV chunks keep the stack small for any DV */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < B * T * HQ; r++) {
            const int64_t hq = r % HQ, t = (r / HQ) % T, b = r / (HQ * T);
            for (int64_t d0 = 0; d0 < DV; d0 += 1024) {
                const int64_t n = DV - d0 < 1024 ? DV - d0 : 1024;
                for (int64_t d = 0; d < n; d++) acc[d] = 0.0f;
                for (int x = 0; x < 3; x++) {
                    if (!gs[x] || !nsa_present(gs[x])) continue;
                    const float g = io_get(gs[x], io_off(gs[x], b, t, hq));
                    io_load(os[x], io_off(os[x], b, t, hq) + d0, n, row);
                    for (int64_t d = 0; d < n; d++) acc[d] += g * row[d];
                }
                io_store(o, io_off(o, b, t, hq) + d0, n, acc);
            }
        }
    }
}

size_t nsa_cpu_gate_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_args *a)
{
    (void)ctx, (void)p, (void)a;
    return 0;
}

nsa_status nsa_cpu_gate(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_args *a, void *ws)
{
    (void)p, (void)ws;
    const nsa_tensor *os[3] = {&a->o_cmp, &a->o_slc, &a->o_swa};
    const nsa_tensor *gs[3] = {&a->g_cmp, &a->g_slc, &a->g_swa};
    gate_combine(ctx, os, gs, &a->o);
    return NSA_STATUS_SUCCESS;
}

/* dg_x = sum_d dout * o_x (when dg_x given); do_x = g_x * dout (when do_x given). */
static void gate_grads(const nsa_context *ctx, const nsa_tensor *dout, const nsa_tensor *const os[3],
                       const nsa_tensor *const gs[3], const nsa_tensor *const dos[3], const nsa_tensor *const dgs[3])
{
    const int64_t B = dout->shape[0], T = dout->shape[1], HQ = dout->shape[2], DV = dout->shape[3];
#pragma omp parallel num_threads(cpu_threads(ctx))
    {
        float dO[1024], row[1024];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < B * T * HQ; r++) {
            const int64_t hq = r % HQ, t = (r / HQ) % T, b = r / (HQ * T);
            for (int x = 0; x < 3; x++) {
                if (!nsa_present(gs[x])) continue;
                const float g = io_get(gs[x], io_off(gs[x], b, t, hq));
                float dg = 0.0f;
                for (int64_t d0 = 0; d0 < DV; d0 += 1024) {
                    const int64_t n = DV - d0 < 1024 ? DV - d0 : 1024;
                    io_load(dout, io_off(dout, b, t, hq) + d0, n, dO);
                    if (dgs[x] && nsa_present(dgs[x])) {
                        io_load(os[x], io_off(os[x], b, t, hq) + d0, n, row);
                        for (int64_t d = 0; d < n; d++) dg += dO[d] * row[d];
                    }
                    if (dos[x] && nsa_present(dos[x])) {
                        for (int64_t d = 0; d < n; d++) row[d] = g * dO[d];
                        io_store(dos[x], io_off(dos[x], b, t, hq) + d0, n, row);
                    }
                }
                if (dgs[x] && nsa_present(dgs[x])) io_set(dgs[x], io_off(dgs[x], b, t, hq), dg);
            }
        }
    }
}

size_t nsa_cpu_gate_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_bwd_args *a)
{
    (void)ctx, (void)p, (void)a;
    return 0;
}

nsa_status nsa_cpu_gate_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_bwd_args *a, void *ws)
{
    (void)p, (void)ws;
    const nsa_tensor *os[3] = {&a->fwd.o_cmp, &a->fwd.o_slc, &a->fwd.o_swa};
    const nsa_tensor *gs[3] = {&a->fwd.g_cmp, &a->fwd.g_slc, &a->fwd.g_swa};
    const nsa_tensor *dos[3] = {&a->do_cmp, &a->do_slc, &a->do_swa};
    const nsa_tensor *dgs[3] = {&a->dg_cmp, &a->dg_slc, &a->dg_swa};
    gate_grads(ctx, &a->dout, os, gs, dos, dgs);
    return NSA_STATUS_SUCCESS;
}

/* ---- 7. the whole pipeline ------------------------------------------------------------- */

/* Which K/V each branch reads, and the fp32 panels (and gradient panels) behind them. */
typedef struct nsa_plan {
    int cmp_on, slc_on, swa_on, need_scores, own_cmp, sep_slc, sep_swa, need_kv;
    const nsa_tensor *idx, *counts;
    int64_t *cu;
    float *K, *V, *Kc, *Vc, *Ks, *Vs, *Kw, *Vw;           /* inputs */
    float *dq32, *dK, *dV, *dKc, *dVc, *dKs, *dVs, *dKw, *dVw; /* backward accumulators */
} nsa_plan;

/* backward: the selection is not recomputed (saved or caller indices are read). */
static void plan_make(nsa_plan *pl, const nsa_forward_args *a, int backward)
{
    memset(pl, 0, sizeof *pl);
    pl->cmp_on = nsa_present(&a->g_cmp);
    pl->slc_on = nsa_present(&a->g_slc);
    pl->swa_on = nsa_present(&a->g_swa);
    pl->need_scores = pl->cmp_on || (!backward && pl->slc_on && !nsa_present(&a->block_indices));
    pl->own_cmp = nsa_present(&a->k_cmp);
    pl->sep_slc = nsa_present(&a->k_slc);
    pl->sep_swa = nsa_present(&a->k_swa);
    pl->need_kv = (pl->need_scores && !pl->own_cmp) || (pl->slc_on && !pl->sep_slc) || (pl->swa_on && !pl->sep_swa);
    if (pl->slc_on) {
        pl->idx = nsa_present(&a->block_indices) ? &a->block_indices : &a->saved.block_indices;
        pl->counts = nsa_present(&a->block_indices) && nsa_present(&a->block_counts) ? &a->block_counts : NULL;
    }
}

/* The compressed panels' shape: like k_cmp when given, else derived from k's. */
static nsa_tensor cmp_like(const nsa_problem *p, const nsa_tensor *x)
{
    nsa_tensor t = *x;
    t.shape[1] = p->cmp_rows;
    return t;
}

/* Carves every panel the plan needs; with backward, the gradient accumulators too. */
static void plan_carve(nsa_plan *pl, ws_arena *w, const nsa_problem *p, const nsa_forward_args *a, int backward)
{
    const nsa_tensor kc = cmp_like(p, &a->k), vc = cmp_like(p, &a->v);
    pl->cu = cpu_cmp_offsets(w, p);
    if (pl->need_kv) {
        pl->K = take_panel(w, &a->k);
        pl->V = take_panel(w, &a->v);
    }
    if (pl->need_scores) {
        pl->Kc = take_panel(w, &kc);
        pl->Vc = take_panel(w, &vc);
    }
    if (pl->sep_slc && pl->slc_on) {
        pl->Ks = take_panel(w, &a->k_slc);
        pl->Vs = take_panel(w, &a->v_slc);
    }
    if (pl->sep_swa && pl->swa_on) {
        pl->Kw = take_panel(w, &a->k_swa);
        pl->Vw = take_panel(w, &a->v_swa);
    }
    if (!backward) return;
    pl->dq32 = take_dq32(w, p);
    pl->dK = take_zeroed_panel(w, &a->k);
    pl->dV = take_zeroed_panel(w, &a->v);
    pl->dKc = take_zeroed_panel(w, &kc);
    pl->dVc = take_zeroed_panel(w, &vc);
    if (pl->sep_slc) {
        pl->dKs = take_zeroed_panel(w, &a->k_slc);
        pl->dVs = take_zeroed_panel(w, &a->v_slc);
    }
    if (pl->sep_swa) {
        pl->dKw = take_zeroed_panel(w, &a->k_swa);
        pl->dVw = take_zeroed_panel(w, &a->v_swa);
    }
}

/* Fills the input panels: k/v, the compressed ones (caller's or mean pooled), separates. */
static void plan_pack(const nsa_context *ctx, nsa_plan *pl, const nsa_problem *p, const nsa_forward_args *a)
{
    if (pl->need_kv) {
        cpu_pack_heads(ctx, &a->k, pl->K);
        cpu_pack_heads(ctx, &a->v, pl->V);
    }
    if (pl->need_scores) {
        if (pl->own_cmp) {
            cpu_pack_heads(ctx, &a->k_cmp, pl->Kc);
            cpu_pack_heads(ctx, &a->v_cmp, pl->Vc);
        } else {
            compress_panel(ctx, p, pl->cu, pl->K, p->DK, pl->Kc);
            compress_panel(ctx, p, pl->cu, pl->V, p->DV, pl->Vc);
        }
    }
    if (pl->Ks) {
        cpu_pack_heads(ctx, &a->k_slc, pl->Ks);
        cpu_pack_heads(ctx, &a->v_slc, pl->Vs);
    }
    if (pl->Kw) {
        cpu_pack_heads(ctx, &a->k_swa, pl->Kw);
        cpu_pack_heads(ctx, &a->v_swa, pl->Vw);
    }
}

size_t nsa_cpu_forward_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_forward_args *a)
{
    nsa_plan pl;
    plan_make(&pl, a, 0);
    ws_arena w = {NULL, 0};
    plan_carve(&pl, &w, p, a, 0);
    range_rule rc = cmp_rule(p), rw = swa_rule(p);
    size_t scratch = 0;
    if (pl.need_scores) scratch = max_sz(scratch, range_fwd_ws(ctx, p, &rc, pl.slc_on && !nsa_present(&a->block_indices)));
    if (pl.slc_on) scratch = max_sz(scratch, slc_fwd_ws(ctx, p));
    if (pl.swa_on) scratch = max_sz(scratch, range_fwd_ws(ctx, p, &rw, 0));
    return nsa_size_add(nsa_size_add(w.used, 64), scratch);
}

nsa_status nsa_cpu_forward(const nsa_context *ctx, const nsa_problem *p, const nsa_forward_args *a, void *ws)
{
    nsa_plan pl;
    plan_make(&pl, a, 0);
    ws_arena w = {(char *)ws, 0};
    plan_carve(&pl, &w, p, a, 0);
    void *scratch = ws_take(&w, 0);
    plan_pack(ctx, &pl, p, a);
    const nsa_saved *sv = &a->saved;
    if (pl.need_scores) {
        range_rule rc = cmp_rule(p);
        select_sink sel = {NULL, &sv->block_indices, NULL};
        const int selecting = pl.slc_on && !nsa_present(&a->block_indices);
        range_fwd(ctx, p, &rc, pl.cu, &a->q, pl.Kc, pl.Vc, p->cmp_rows, pl.cmp_on ? &sv->o_cmp : NULL,
                  pl.cmp_on ? &sv->lse_cmp : NULL, selecting ? &sel : NULL, scratch);
    }
    if (pl.slc_on)
        slc_fwd(ctx, p, &a->q, pl.sep_slc ? pl.Ks : pl.K, pl.sep_slc ? pl.Vs : pl.V, pl.idx, pl.counts, &sv->o_slc,
                &sv->lse_slc, scratch);
    if (pl.swa_on) {
        range_rule rw = swa_rule(p);
        const nsa_problem pw = swa_problem(p);
        range_fwd(ctx, &pw, &rw, NULL, &a->q, pl.sep_swa ? pl.Kw : pl.K, pl.sep_swa ? pl.Vw : pl.V, p->Tk, &sv->o_swa,
                  &sv->lse_swa, NULL, scratch);
    }
    const nsa_tensor *os[3] = {&sv->o_cmp, &sv->o_slc, &sv->o_swa};
    const nsa_tensor *gs[3] = {&a->g_cmp, &a->g_slc, &a->g_swa};
    gate_combine(ctx, os, gs, &a->o);
    return NSA_STATUS_SUCCESS;
}

size_t nsa_cpu_backward_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_backward_args *a)
{
    nsa_plan pl;
    plan_make(&pl, &a->fwd, 1);
    ws_arena w = {NULL, 0};
    plan_carve(&pl, &w, p, &a->fwd, 1);
    range_rule rc = cmp_rule(p), rw = swa_rule(p);
    size_t scratch = 0;
    if (pl.cmp_on) scratch = max_sz(scratch, range_bwd_ws(ctx, p, &rc));
    if (pl.slc_on) scratch = max_sz(scratch, slc_bwd_ws(ctx, p));
    if (pl.swa_on) scratch = max_sz(scratch, range_bwd_ws(ctx, p, &rw));
    return nsa_size_add(nsa_size_add(w.used, 64), scratch);
}

nsa_status nsa_cpu_backward(const nsa_context *ctx, const nsa_problem *p, const nsa_backward_args *a, void *ws)
{
    const nsa_forward_args *f = &a->fwd;
    const nsa_saved *sv = &f->saved;
    nsa_plan pl;
    plan_make(&pl, f, 1);
    ws_arena w = {(char *)ws, 0};
    plan_carve(&pl, &w, p, f, 1);
    void *scratch = ws_take(&w, 0);
    plan_pack(ctx, &pl, p, f);

    const nsa_tensor *os[3] = {&sv->o_cmp, &sv->o_slc, &sv->o_swa};
    const nsa_tensor *gs[3] = {&f->g_cmp, &f->g_slc, &f->g_swa};
    const nsa_tensor *dos[3] = {NULL, NULL, NULL};
    const nsa_tensor *dgs[3] = {&a->dg_cmp, &a->dg_slc, &a->dg_swa};
    gate_grads(ctx, &a->dout, os, gs, dos, dgs);

    if (pl.cmp_on) {
        range_rule rc = cmp_rule(p);
        grad_src g = {&a->dout, &f->g_cmp, &sv->o_cmp, &sv->lse_cmp};
        range_bwd(ctx, p, &rc, pl.cu, &f->q, pl.Kc, pl.Vc, p->cmp_rows, &g, pl.dq32, pl.dKc, pl.dVc, scratch);
        if (!pl.own_cmp) { /* the default phi is mean pooling of k, v: chain into dk, dv */
            compress_panel_bwd(ctx, p, pl.cu, pl.dKc, p->DK, pl.dK);
            compress_panel_bwd(ctx, p, pl.cu, pl.dVc, p->DV, pl.dV);
        }
    }
    if (pl.slc_on) {
        grad_src g = {&a->dout, &f->g_slc, &sv->o_slc, &sv->lse_slc};
        slc_bwd(ctx, p, &f->q, pl.sep_slc ? pl.Ks : pl.K, pl.sep_slc ? pl.Vs : pl.V, pl.idx, pl.counts, &g, pl.dq32,
                pl.sep_slc ? pl.dKs : pl.dK, pl.sep_slc ? pl.dVs : pl.dV, scratch);
    }
    if (pl.swa_on) {
        range_rule rw = swa_rule(p);
        const nsa_problem pw = swa_problem(p);
        grad_src g = {&a->dout, &f->g_swa, &sv->o_swa, &sv->lse_swa};
        range_bwd(ctx, &pw, &rw, NULL, &f->q, pl.sep_swa ? pl.Kw : pl.K, pl.sep_swa ? pl.Vw : pl.V, p->Tk, &g, pl.dq32,
                  pl.sep_swa ? pl.dKw : pl.dK, pl.sep_swa ? pl.dVw : pl.dV, scratch);
    }

    cpu_store_dense(ctx, pl.dq32, &a->dq);
    cpu_unpack_heads(ctx, pl.dK, &a->dk);
    cpu_unpack_heads(ctx, pl.dV, &a->dv);
    if (pl.own_cmp) {
        cpu_unpack_heads(ctx, pl.dKc, &a->dk_cmp);
        cpu_unpack_heads(ctx, pl.dVc, &a->dv_cmp);
    }
    if (pl.sep_slc) {
        cpu_unpack_heads(ctx, pl.dKs, &a->dk_slc);
        cpu_unpack_heads(ctx, pl.dVs, &a->dv_slc);
    }
    if (pl.sep_swa) {
        cpu_unpack_heads(ctx, pl.dKw, &a->dk_swa);
        cpu_unpack_heads(ctx, pl.dVw, &a->dv_swa);
    }
    return NSA_STATUS_SUCCESS;
}
