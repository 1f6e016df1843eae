/* pipeline/nsa.cu -- the whole NSA forward and backward on the GPU (nsa.h section 7), mirroring the
 * CPU pipeline (src/cpu/ops.c): compression (default: mean pooling, stored in the storage
 * dtype), compressed attention, selection, selected and window attention, gating; the backward runs each branch's dQ and dK/dV into fp32
 * accumulators and chains the compressed gradients back through the pooling. */
#include "../compress/compress.h"
#include "../gate/gate.h"
#include "../range/range.h"
#include "../selected/selected.h"
#include "../selection/selection.h"
#include "../cuda_backend.h"

typedef struct plan {
    int cmp_on, slc_on, swa_on, selecting, need_scores, own_cmp, sep_slc, sep_swa;
    const nsa_tensor *idx, *counts;
} plan;

static void plan_make(plan *pl, const nsa_forward_args *a, int backward)
{
    memset(pl, 0, sizeof *pl);
    pl->cmp_on = nsa_present(&a->g_cmp);
    pl->slc_on = nsa_present(&a->g_slc);
    pl->swa_on = nsa_present(&a->g_swa);
    pl->selecting = !backward && pl->slc_on && !nsa_present(&a->block_indices);
    pl->need_scores = pl->cmp_on || pl->selecting;
    pl->own_cmp = nsa_present(&a->k_cmp);
    pl->sep_slc = nsa_present(&a->k_slc);
    pl->sep_swa = nsa_present(&a->k_swa);
    if (pl->slc_on) {
        pl->idx = nsa_present(&a->block_indices) ? &a->block_indices : &a->saved.block_indices;
        pl->counts = nsa_present(&a->block_indices) && nsa_present(&a->block_counts) ? &a->block_counts : NULL;
    }
}

/* Compressed K/V of the branch: the caller's, or mean pooling of k, v into the workspace,
 * stored in the storage dtype (as any bf16 / f16 implementation keeps them; the compressed
 * branch, the selection and the backward all read these same values). */
static void cmp_kv(grun *g, const nsa_forward_args *a, int own, dview *kc, dview *vc)
{
    const nsa_problem *p = g->p;
    const nsa_dtype dt = a->q.dtype;
    if (own) {
        *kc = dv_of(&a->k_cmp);
        *vc = dv_of(&a->v_cmp);
        return;
    }
    const size_t es = nsa_dtype_size(dt);
    const size_t nk = nsa_size_elems(p->B, p->cmp_rows, p->H, p->DK), nv = nsa_size_elems(p->B, p->cmp_rows, p->H, p->DV);
    *kc = dv_flat(g_take_n(g, nsa_size_add(nk, 8), es), dt, p->cmp_rows, p->H, p->DK);
    *vc = dv_flat(g_take_n(g, nsa_size_add(nv, 8), es), dt, p->cmp_rows, p->H, p->DV);
    const dview k = dv_of(&a->k), v = dv_of(&a->v);
    nsa_cu_compress(g, &k, p->DK, kc);
    nsa_cu_compress(g, &v, p->DV, vc);
}

/* The sliding branch's rule: causal, w - 1 keys to the left; a query chunk's rows at the end of
 * its Tk positions. */
static rule_t swa_rule(const nsa_problem *p)
{
    rule_t r = cu_rule_window(nsa_rule_swa_left(p->cfg.window), 0, 1);
    r.shift = (int)(p->Tk - p->T);
    return r;
}

static void run_forward(grun *g, const nsa_forward_args *a)
{
    const nsa_problem *p = g->p;
    const nsa_saved *sv = &a->saved;
    const nsa_dtype dt = a->q.dtype;
    if (!cu_attn_supported(g, dt)) return;
    plan pl;
    plan_make(&pl, a, 0);
    g_seq_setup(g, 1);
    const dview q = dv_of(&a->q);
    dview kc, vc;
    memset(&kc, 0, sizeof kc);
    memset(&vc, 0, sizeof vc);
    if (pl.need_scores) cmp_kv(g, a, pl.own_cmp, &kc, &vc);

    if (pl.cmp_on) {
        const dview o = dv_of(&sv->o_cmp), lse = dv_of(&sv->lse_cmp);
        const rule_t r = cu_rule_cmp(p);
        cu_fwd_range(g, &r, &q, dt, &kc, &vc, &o, &lse);
    }
    if (pl.selecting) {
        dview lse = dv_of(&sv->lse_cmp);
        if (!pl.cmp_on) { /* the compressed normaliser alone */
            float *lw = cu_take_f32(g, nsa_size_elems(p->B, p->T, p->HQ, 1), 0);
            lse = dv_flat(lw, NSA_DTYPE_F32, p->T, p->HQ, 1);
            const rule_t r = cu_rule_cmp(p);
            cu_fwd_range(g, &r, &q, dt, &kc, NULL, NULL, &lse);
        }
        const dview idx = dv_of(&sv->block_indices);
        dview none;
        memset(&none, 0, sizeof none);
        cu_select(g, &q, dt, &kc, &lse, &idx, &none);
    }
    if (pl.slc_on) {
        const int64_t rows = p->B * p->T * p->H, m = pl.idx->shape[3];
        int32_t *U = (int32_t *)g_take_n(g, nsa_size_add(nsa_size_mul(nsa_size_of(rows), nsa_size_of(m)), 1), sizeof(int32_t));
        int32_t *ucnt = (int32_t *)g_take_n(g, nsa_size_add(nsa_size_of(rows), 1), sizeof(int32_t));
        const dview iv = dv_of(pl.idx), cv = pl.counts ? dv_of(pl.counts) : dview();
        nsa_cu_usable(g, &iv, pl.counts ? &cv : NULL, m, p->cfg.slc_block, U, ucnt);
        const dview k = dv_of(pl.sep_slc ? &a->k_slc : &a->k), v = dv_of(pl.sep_slc ? &a->v_slc : &a->v);
        const dview o = dv_of(&sv->o_slc), lse = dv_of(&sv->lse_slc);
        cu_fwd_slc(g, &q, dt, &k, &v, U, ucnt, m, &o, &lse);
    }
    if (pl.swa_on) {
        const dview k = dv_of(pl.sep_swa ? &a->k_swa : &a->k), v = dv_of(pl.sep_swa ? &a->v_swa : &a->v);
        const dview o = dv_of(&sv->o_swa), lse = dv_of(&sv->lse_swa);
        const rule_t r = swa_rule(p);
        /* the sliding branch's own softmax scale: the tiles read it from the run's problem */
        nsa_problem pw = *p;
        pw.scale = p->swa_scale;
        g->p = &pw;
        cu_fwd_range(g, &r, &q, dt, &k, &v, &o, &lse);
        g->p = p;
    }
    const dview os[3] = {dv_of(&sv->o_cmp), dv_of(&sv->o_slc), dv_of(&sv->o_swa)};
    const dview gs[3] = {dv_of(&a->g_cmp), dv_of(&a->g_slc), dv_of(&a->g_swa)};
    const dview o = dv_of(&a->o);
    nsa_cu_gate(g, os, gs, &o, p->B, p->T, p->HQ, p->DV);
}

size_t nsa_cuda_forward_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_forward_args *a)
{
    return cu_op_workspace(ctx, p, run_forward, a);
}

nsa_status nsa_cuda_forward(const nsa_context *ctx, const nsa_problem *p, const nsa_forward_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_forward, a, ws);
}

static void run_backward(grun *g, const nsa_backward_args *ba)
{
    const nsa_problem *p = g->p;
    const nsa_forward_args *a = &ba->fwd;
    const nsa_saved *sv = &a->saved;
    const nsa_dtype dt = a->q.dtype;
    if (!cu_attn_supported(g, dt)) return;
    plan pl;
    plan_make(&pl, a, 1);
    g_seq_setup(g, 1);
    const int64_t B = p->B, T = p->T, Tk = p->Tk, H = p->H, HQ = p->HQ, DK = p->DK, DV = p->DV, R = p->cmp_rows;

    /* fp32 accumulators, zeroed: every branch adds (dk, dv: the key side's Tk rows) */
    const size_t nq = nsa_size_elems(B, T, HQ, DK), nk = nsa_size_elems(B, Tk, H, DK), nv = nsa_size_elems(B, Tk, H, DV);
    const size_t nkc = nsa_size_elems(B, R, H, DK), nvc = nsa_size_elems(B, R, H, DV), qrows = nsa_size_elems(B, T, HQ, 1);
    float *dq32 = cu_take_f32(g, nq, 1);
    float *dk32 = cu_take_f32(g, nk, 1), *dv32 = cu_take_f32(g, nv, 1);
    float *dkc32 = NULL, *dvc32 = NULL, *dks32 = NULL, *dvs32 = NULL, *dkw32 = NULL, *dvw32 = NULL;
    if (pl.cmp_on || pl.own_cmp) dkc32 = cu_take_f32(g, nkc, 1), dvc32 = cu_take_f32(g, nvc, 1);
    if (pl.sep_slc) dks32 = cu_take_f32(g, nk, 1), dvs32 = cu_take_f32(g, nv, 1);
    if (pl.sep_swa) dkw32 = cu_take_f32(g, nk, 1), dvw32 = cu_take_f32(g, nv, 1);
    /* each branch's row terms D = g * rowsum(dout * o_x) and g, from the gate backward's pass */
    float *Dw[3] = {NULL, NULL, NULL}, *gw[3] = {NULL, NULL, NULL};
    const int on[3] = {pl.cmp_on, pl.slc_on, pl.swa_on};
    for (int x = 0; x < 3; x++)
        if (on[x]) Dw[x] = cu_take_f32(g, qrows, 0), gw[x] = cu_take_f32(g, qrows, 0);

    const dview q = dv_of(&a->q), dout = dv_of(&ba->dout);
    {
        const dview os[3] = {dv_of(&sv->o_cmp), dv_of(&sv->o_slc), dv_of(&sv->o_swa)};
        const dview gs[3] = {dv_of(&a->g_cmp), dv_of(&a->g_slc), dv_of(&a->g_swa)};
        const dview dgs[3] = {dv_of(&ba->dg_cmp), dv_of(&ba->dg_slc), dv_of(&ba->dg_swa)};
        nsa_cu_gate_bwd(g, &dout, os, gs, NULL, dgs, Dw, gw, B, T, HQ, DV, g_nf(g));
    }
    bwd_io io;
    memset(&io, 0, sizeof io);
    io.q = &q, io.dout = &dout, io.dt = dt, io.dq32 = dq32, io.D_ready = 1;

    if (pl.cmp_on) {
        dview kc, vc;
        cmp_kv(g, a, pl.own_cmp, &kc, &vc);
        const dview o = dv_of(&sv->o_cmp), lse = dv_of(&sv->lse_cmp), gate = dv_of(&a->g_cmp);
        io.k = &kc, io.v = &vc, io.o = &o, io.lse = &lse, io.gate = &gate, io.Dw = Dw[0], io.gw = gw[0];
        io.dk32 = dkc32, io.dv32 = dvc32, io.KR = R;
        const rule_t r = cu_rule_cmp(p);
        cu_bwd_range(g, &r, &io);
        if (!pl.own_cmp) { /* mean pooling's backward into dk, dv */
            dview none;
            memset(&none, 0, sizeof none);
            nsa_cu_compress_bwd(g, &none, dkc32, DK, &none, dk32);
            nsa_cu_compress_bwd(g, &none, dvc32, DV, &none, dv32);
        }
    }
    if (pl.slc_on) {
        const int64_t rows = B * T * H, m = pl.idx->shape[3];
        int32_t *U = (int32_t *)g_take_n(g, nsa_size_add(nsa_size_mul(nsa_size_of(rows), nsa_size_of(m)), 1), sizeof(int32_t));
        int32_t *ucnt = (int32_t *)g_take_n(g, nsa_size_add(nsa_size_of(rows), 1), sizeof(int32_t));
        const dview iv = dv_of(pl.idx), cv = pl.counts ? dv_of(pl.counts) : dview();
        nsa_cu_usable(g, &iv, pl.counts ? &cv : NULL, m, p->cfg.slc_block, U, ucnt);
        const dview k = dv_of(pl.sep_slc ? &a->k_slc : &a->k), v = dv_of(pl.sep_slc ? &a->v_slc : &a->v);
        const dview o = dv_of(&sv->o_slc), lse = dv_of(&sv->lse_slc), gate = dv_of(&a->g_slc);
        io.k = &k, io.v = &v, io.o = &o, io.lse = &lse, io.gate = &gate, io.KR = Tk, io.Dw = Dw[1], io.gw = gw[1];
        io.dk32 = pl.sep_slc ? dks32 : dk32, io.dv32 = pl.sep_slc ? dvs32 : dv32;
        cu_bwd_slc(g, &io, U, ucnt, m);
    }
    if (pl.swa_on) {
        const dview k = dv_of(pl.sep_swa ? &a->k_swa : &a->k), v = dv_of(pl.sep_swa ? &a->v_swa : &a->v);
        const dview o = dv_of(&sv->o_swa), lse = dv_of(&sv->lse_swa), gate = dv_of(&a->g_swa);
        io.k = &k, io.v = &v, io.o = &o, io.lse = &lse, io.gate = &gate, io.KR = Tk, io.Dw = Dw[2], io.gw = gw[2];
        io.dk32 = pl.sep_swa ? dkw32 : dk32, io.dv32 = pl.sep_swa ? dvw32 : dv32;
        const rule_t r = swa_rule(p);
        nsa_problem pw = *p; /* the sliding branch's own scale, as in the forward */
        pw.scale = p->swa_scale;
        g->p = &pw;
        cu_bwd_range(g, &r, &io);
        g->p = p;
    }

    const dview dq = dv_of(&ba->dq), dk = dv_of(&ba->dk), dv = dv_of(&ba->dv);
    nsa_cu_store32(g, dq32, &dq, B, T, HQ, DK);
    nsa_cu_store32(g, dk32, &dk, B, Tk, H, DK);
    nsa_cu_store32(g, dv32, &dv, B, Tk, H, DV);
    if (pl.own_cmp) {
        const dview x = dv_of(&ba->dk_cmp), y = dv_of(&ba->dv_cmp);
        nsa_cu_store32(g, dkc32, &x, B, R, H, DK);
        nsa_cu_store32(g, dvc32, &y, B, R, H, DV);
    }
    if (pl.sep_slc) {
        const dview x = dv_of(&ba->dk_slc), y = dv_of(&ba->dv_slc);
        nsa_cu_store32(g, dks32, &x, B, Tk, H, DK);
        nsa_cu_store32(g, dvs32, &y, B, Tk, H, DV);
    }
    if (pl.sep_swa) {
        const dview x = dv_of(&ba->dk_swa), y = dv_of(&ba->dv_swa);
        nsa_cu_store32(g, dkw32, &x, B, Tk, H, DK);
        nsa_cu_store32(g, dvw32, &y, B, Tk, H, DV);
    }
}

size_t nsa_cuda_backward_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_backward_args *a)
{
    return cu_op_workspace(ctx, p, run_backward, a);
}

nsa_status nsa_cuda_backward(const nsa_context *ctx, const nsa_problem *p, const nsa_backward_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_backward, a, ws);
}
