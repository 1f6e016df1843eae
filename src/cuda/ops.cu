/* ops.cu -- the CUDA backend's single operations (nsa.h sections 1-6). Each op is one
 * function run twice: a sizing pass (workspace query) and the real one, so both carve the
 * workspace identically. Outputs are fully overwritten; fp32 accumulators live in the
 * workspace and are stored to the strided outputs at the end. */
#include "branches.h"
#include "cuda_backend.h"

static int has(const nsa_tensor *t) { return t->data != NULL; }

/* Defines nsa_cuda_<op>_workspace and nsa_cuda_<op> around `static void run_<op>(grun *,
 * const args_t *)`. */
#define CUDA_OP(op, args_t)                                                                          \
    size_t nsa_cuda_##op##_workspace(const nsa_context *ctx, const nsa_problem *p, const args_t *a) \
    {                                                                                                \
        grun g;                                                                                      \
        g_init(&g, ctx, p, NULL, 1);                                                                 \
        run_##op(&g, a);                                                                             \
        return g.used + 256;                                                                         \
    }                                                                                                \
    nsa_status nsa_cuda_##op(const nsa_context *ctx, const nsa_problem *p, const args_t *a, void *ws) \
    {                                                                                                \
        grun g;                                                                                      \
        g_init(&g, ctx, p, ws, 0);                                                                   \
        if (g.err != NSA_STATUS_SUCCESS) return g.err;                                               \
        run_##op(&g, a);                                                                             \
        if (g.err == NSA_STATUS_SUCCESS) g_check(&g, cudaGetLastError());                            \
        return g.err;                                                                                \
    }

/* ---- 1. compression ------------------------------------------------------------------------ */

static void run_compress(grun *g, const nsa_compress_args *a)
{
    g_seq_setup(g, 1);
    const dview x = dv_of(&a->x), out = dv_of(&a->x_cmp);
    nsa_cu_compress(g, &x, a->x.shape[3], &out);
}
CUDA_OP(compress, nsa_compress_args)

static void run_compress_bwd(grun *g, const nsa_compress_bwd_args *a)
{
    g_seq_setup(g, 1);
    const dview src = dv_of(&a->dx_cmp), dx = dv_of(&a->dx);
    nsa_cu_compress_bwd(g, &src, NULL, a->dx.shape[3], &dx, NULL);
}
CUDA_OP(compress_bwd, nsa_compress_bwd_args)

/* ---- 2. compressed attention ----------------------------------------------------------------- */

static void run_cmp_attn(grun *g, const nsa_cmp_attn_args *a)
{
    if (!cu_attn_supported(g, a->q.dtype)) return;
    g_seq_setup(g, 1);
    const dview q = dv_of(&a->q), kc = dv_of(&a->k_cmp), vc = dv_of(&a->v_cmp), o = dv_of(&a->o), lse = dv_of(&a->lse);
    const rule_t r = cu_rule_cmp(g->p);
    cu_fwd_range(g, &r, &q, a->q.dtype, &kc, &vc, &o, &lse);
}
CUDA_OP(cmp_attn, nsa_cmp_attn_args)

/* The backward of a range branch (compressed or window attention) on its own: fp32
 * accumulators from the workspace, then dq [B, T, HQ, DK], dk/dv [B, KR, H, D] stored. KR is
 * the key rows: cmp_rows for the compressed branch, T for the window. */
static void range_bwd_op(grun *g, const rule_t *r, const nsa_tensor *q_t, const nsa_tensor *k_t, const nsa_tensor *v_t,
                         const nsa_tensor *o_t, const nsa_tensor *lse_t, const nsa_tensor *dout_t, int64_t KR,
                         const nsa_tensor *dq_t, const nsa_tensor *dk_t, const nsa_tensor *dv_t)
{
    const nsa_problem *p = g->p;
    const dview q = dv_of(q_t), k = dv_of(k_t), v = dv_of(v_t), o = dv_of(o_t), lse = dv_of(lse_t);
    const dview dout = dv_of(dout_t);
    bwd_io io;
    memset(&io, 0, sizeof io);
    io.q = &q, io.k = &k, io.v = &v, io.o = &o, io.lse = &lse, io.dout = &dout, io.dt = q_t->dtype;
    io.KR = KR;
    io.Dw = cu_take_f32(g, p->B * p->T * p->HQ, 0);
    io.dq32 = cu_take_f32(g, p->B * p->T * p->HQ * p->DK, 0); /* zeroed by cu_bwd_range if it adds */
    io.dk32 = cu_take_f32(g, p->B * KR * p->H * p->DK, 1);
    io.dv32 = cu_take_f32(g, p->B * KR * p->H * p->DV, 1);
    const dview dq = dv_of(dq_t), dk = dv_of(dk_t), dv = dv_of(dv_t);
    io.dq_out = &dq;
    if (!cu_bwd_range(g, r, &io)) nsa_cu_store32(g, io.dq32, &dq, p->B, p->T, p->HQ, p->DK);
    nsa_cu_store32(g, io.dk32, &dk, p->B, KR, p->H, p->DK);
    nsa_cu_store32(g, io.dv32, &dv, p->B, KR, p->H, p->DV);
}

static void run_cmp_attn_bwd(grun *g, const nsa_cmp_attn_bwd_args *a)
{
    const nsa_cmp_attn_args *f = &a->fwd;
    if (!cu_attn_supported(g, f->q.dtype)) return;
    g_seq_setup(g, 1);
    const rule_t r = cu_rule_cmp(g->p);
    range_bwd_op(g, &r, &f->q, &f->k_cmp, &f->v_cmp, &f->o, &f->lse, &a->dout, g->p->cmp_rows, &a->dq, &a->dk_cmp,
                 &a->dv_cmp);
}
CUDA_OP(cmp_attn_bwd, nsa_cmp_attn_bwd_args)

/* ---- 3. selection ------------------------------------------------------------------------------ */

static void run_select(grun *g, const nsa_select_args *a)
{
    const nsa_problem *p = g->p;
    if (!cu_attn_supported(g, a->q.dtype)) return;
    g_seq_setup(g, 1);
    const dview q = dv_of(&a->q), kc = dv_of(&a->k_cmp), idx = dv_of(&a->block_indices);
    const dview cnt = dv_of(&a->block_counts);
    dview lse = dv_of(&a->lse_cmp);
    if (!has(&a->lse_cmp)) { /* the compressed attention's normaliser, lse only */
        float *lw = cu_take_f32(g, p->B * p->T * p->HQ, 0);
        lse = dv_flat(lw, NSA_DTYPE_F32, p->T, p->HQ, 1);
        const rule_t r = cu_rule_cmp(p);
        cu_fwd_range(g, &r, &q, a->q.dtype, &kc, NULL, NULL, &lse);
    }
    cu_select(g, &q, a->q.dtype, &kc, &lse, &idx, &cnt);
}
CUDA_OP(select, nsa_select_args)

/* ---- 4. selected attention ------------------------------------------------------------------------ */

/* Usable-block lists of a caller selection: [B*T*H][m] and counts. */
static void take_usable(grun *g, const nsa_tensor *idx, const nsa_tensor *counts, int32_t **U, int32_t **ucnt)
{
    const nsa_problem *p = g->p;
    const int64_t rows = p->B * p->T * p->H;
    *U = (int32_t *)g_take(g, (size_t)(rows * p->m + 1) * sizeof(int32_t));
    *ucnt = (int32_t *)g_take(g, (size_t)(rows + 1) * sizeof(int32_t));
    const dview iv = dv_of(idx), cv = dv_of(counts);
    nsa_cu_usable(g, &iv, counts && has(counts) ? &cv : NULL, p->m, p->cfg.slc_block, *U, *ucnt);
}

static void run_slc_attn(grun *g, const nsa_slc_attn_args *a)
{
    if (!cu_attn_supported(g, a->q.dtype)) return;
    g_seq_setup(g, 0);
    int32_t *U, *ucnt;
    take_usable(g, &a->block_indices, &a->block_counts, &U, &ucnt);
    const dview q = dv_of(&a->q), k = dv_of(&a->k), v = dv_of(&a->v), o = dv_of(&a->o), lse = dv_of(&a->lse);
    cu_fwd_slc(g, &q, a->q.dtype, &k, &v, U, ucnt, g->p->m, &o, &lse);
}
CUDA_OP(slc_attn, nsa_slc_attn_args)

static void run_slc_attn_bwd(grun *g, const nsa_slc_attn_bwd_args *a)
{
    const nsa_problem *p = g->p;
    const nsa_slc_attn_args *f = &a->fwd;
    if (!cu_attn_supported(g, f->q.dtype)) return;
    g_seq_setup(g, 0);
    int32_t *U, *ucnt;
    take_usable(g, &f->block_indices, &f->block_counts, &U, &ucnt);
    const dview q = dv_of(&f->q), k = dv_of(&f->k), v = dv_of(&f->v), o = dv_of(&f->o), lse = dv_of(&f->lse);
    const dview dout = dv_of(&a->dout);
    bwd_io io;
    memset(&io, 0, sizeof io);
    io.q = &q, io.k = &k, io.v = &v, io.o = &o, io.lse = &lse, io.dout = &dout, io.dt = f->q.dtype;
    io.KR = p->T;
    io.Dw = cu_take_f32(g, p->B * p->T * p->HQ, 0);
    io.dq32 = cu_take_f32(g, p->B * p->T * p->HQ * p->DK, 1);
    io.dk32 = cu_take_f32(g, p->B * p->T * p->H * p->DK, 1);
    io.dv32 = cu_take_f32(g, p->B * p->T * p->H * p->DV, 1);
    cu_bwd_slc(g, &io, U, ucnt, p->m);
    const dview dq = dv_of(&a->dq), dk = dv_of(&a->dk), dv = dv_of(&a->dv);
    nsa_cu_store32(g, io.dq32, &dq, p->B, p->T, p->HQ, p->DK);
    nsa_cu_store32(g, io.dk32, &dk, p->B, p->T, p->H, p->DK);
    nsa_cu_store32(g, io.dv32, &dv, p->B, p->T, p->H, p->DV);
}
CUDA_OP(slc_attn_bwd, nsa_slc_attn_bwd_args)

/* ---- 5. dense / windowed attention ------------------------------------------------------------------- */

/* Calls with an option beyond causal / windows / scale (or head dims the engine has no tile
 * for) take the option-complete kernels of xattn.cuh; the rest the tuned range tiles. */
static int attention_general(const nsa_problem *p) { return p->extended || !cu_dims_class(p->DK, p->DV); }

/* The forward of softcap, sinks and Tq != Tk in a dense batch (alone or together) runs on the
 * tuned tiles too, which apply them per score / per row / in the window bounds (their backward
 * runs xattn.cuh, from the same lse). */
static int attention_fwd_tuned(const nsa_problem *p, const nsa_attention_args *a)
{
    if (!cu_dims_class(p->DK, p->DV)) return 0;
    /* (Tq != Tk comes with a dense batch or varlen_qk, which stays on xattn.cuh) */
    return !p->cu_seqlens_q && !a->q_segment_ids.data && !a->bias.data && !a->mask.data && a->dropout_p == 0.0f;
}

static void run_attention(grun *g, const nsa_attention_args *a)
{
    if (!attention_fwd_tuned(g->p, a)) {
        if (cu_xattn_supported(g, a->q.dtype)) cu_xattn_fwd(g, a);
        return;
    }
    if (!cu_attn_supported(g, a->q.dtype)) return;
    g_seq_setup(g, 0);
    const dview q = dv_of(&a->q), k = dv_of(&a->k), v = dv_of(&a->v), o = dv_of(&a->o), lse = dv_of(&a->lse);
    rule_t r = cu_rule_window(a->window_left, a->window_right, a->causal);
    r.cap = a->softcap;
    if (a->sinks.data) r.sinks = (const float *)a->sinks.data, r.sinks_s = a->sinks.stride[0];
    if (g->p->Tk != g->p->T) r.shift = (int)(g->p->Tk - g->p->T), r.nk = (int)g->p->Tk;
    cu_fwd_range(g, &r, &q, a->q.dtype, &k, &v, &o, &lse);
}
CUDA_OP(attention, nsa_attention_args)

static void run_attention_bwd(grun *g, const nsa_attention_bwd_args *a)
{
    const nsa_attention_args *f = &a->fwd;
    if (attention_general(g->p)) {
        if (cu_xattn_supported(g, f->q.dtype)) cu_xattn_bwd(g, a);
        return;
    }
    if (!cu_attn_supported(g, f->q.dtype)) return;
    g_seq_setup(g, 0);
    const rule_t r = cu_rule_window(f->window_left, f->window_right, f->causal);
    range_bwd_op(g, &r, &f->q, &f->k, &f->v, &f->o, &f->lse, &a->dout, g->p->T, &a->dq, &a->dk, &a->dv);
}
CUDA_OP(attention_bwd, nsa_attention_bwd_args)

/* ---- 6. gating ------------------------------------------------------------------------------------------- */

static void run_gate(grun *g, const nsa_gate_args *a)
{
    const nsa_problem *p = g->p;
    const dview os[3] = {dv_of(&a->o_cmp), dv_of(&a->o_slc), dv_of(&a->o_swa)};
    const dview gs[3] = {dv_of(&a->g_cmp), dv_of(&a->g_slc), dv_of(&a->g_swa)};
    const dview o = dv_of(&a->o);
    nsa_cu_gate(g, os, gs, &o, p->B, p->T, p->HQ, p->DV);
}
CUDA_OP(gate, nsa_gate_args)

static void run_gate_bwd(grun *g, const nsa_gate_bwd_args *a)
{
    const nsa_problem *p = g->p;
    const nsa_gate_args *f = &a->fwd;
    const dview os[3] = {dv_of(&f->o_cmp), dv_of(&f->o_slc), dv_of(&f->o_swa)};
    const dview gs[3] = {dv_of(&f->g_cmp), dv_of(&f->g_slc), dv_of(&f->g_swa)};
    const dview dos[3] = {dv_of(&a->do_cmp), dv_of(&a->do_slc), dv_of(&a->do_swa)};
    const dview dgs[3] = {dv_of(&a->dg_cmp), dv_of(&a->dg_slc), dv_of(&a->dg_swa)};
    const dview dout = dv_of(&a->dout);
    nsa_cu_gate_bwd(g, &dout, os, gs, dos, dgs, NULL, NULL, p->B, p->T, p->HQ, p->DV);
}
CUDA_OP(gate_bwd, nsa_gate_bwd_args)
