/* selected/ops.cu -- the selected-attention op (nsa.h section 4) and its backward on the GPU. */
#include "selected.h"
#include "../cuda_backend.h"

static void run_slc_attn(grun *g, const nsa_slc_attn_args *a)
{
    if (!cu_attn_supported(g, a->q.dtype)) return;
    g_seq_setup(g, 0);
    int32_t *U, *ucnt;
    cu_take_usable(g, &a->block_indices, &a->block_counts, &U, &ucnt);
    const dview q = dv_of(&a->q), k = dv_of(&a->k), v = dv_of(&a->v), o = dv_of(&a->o), lse = dv_of(&a->lse);
    cu_fwd_slc(g, &q, a->q.dtype, &k, &v, U, ucnt, g->p->m, &o, &lse);
}

size_t nsa_cuda_slc_attn_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_args *a)
{
    return cu_op_workspace(ctx, p, run_slc_attn, a);
}

nsa_status nsa_cuda_slc_attn(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_slc_attn, a, ws);
}

static void run_slc_attn_bwd(grun *g, const nsa_slc_attn_bwd_args *a)
{
    const nsa_problem *p = g->p;
    const nsa_slc_attn_args *f = &a->fwd;
    if (!cu_attn_supported(g, f->q.dtype)) return;
    g_seq_setup(g, 0);
    int32_t *U, *ucnt;
    cu_take_usable(g, &f->block_indices, &f->block_counts, &U, &ucnt);
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

size_t nsa_cuda_slc_attn_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_bwd_args *a)
{
    return cu_op_workspace(ctx, p, run_slc_attn_bwd, a);
}

nsa_status nsa_cuda_slc_attn_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_bwd_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_slc_attn_bwd, a, ws);
}
