/* range/ops.cu -- the compressed-attention op (nsa.h section 2) and its backward on the GPU.
 * Each op is one run function executed twice (sizing pass, live pass: prim/run.h). */
#include "range.h"
#include "../cuda_backend.h"

static void run_cmp_attn(grun *g, const nsa_cmp_attn_args *a)
{
    if (!cu_attn_supported(g, a->q.dtype)) return;
    g_seq_setup(g, 1);
    const dview q = dv_of(&a->q), kc = dv_of(&a->k_cmp), vc = dv_of(&a->v_cmp), o = dv_of(&a->o), lse = dv_of(&a->lse);
    const rule_t r = cu_rule_cmp(g->p);
    cu_fwd_range(g, &r, &q, a->q.dtype, &kc, &vc, &o, &lse);
}

size_t nsa_cuda_cmp_attn_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_args *a)
{
    return cu_op_workspace(ctx, p, run_cmp_attn, a);
}

nsa_status nsa_cuda_cmp_attn(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_cmp_attn, a, ws);
}

static void run_cmp_attn_bwd(grun *g, const nsa_cmp_attn_bwd_args *a)
{
    const nsa_cmp_attn_args *f = &a->fwd;
    if (!cu_attn_supported(g, f->q.dtype)) return;
    g_seq_setup(g, 1);
    const rule_t r = cu_rule_cmp(g->p);
    cu_range_bwd_op(g, &r, &f->q, &f->k_cmp, &f->v_cmp, &f->o, &f->lse, &a->dout, g->p->cmp_rows, &a->dq, &a->dk_cmp,
                 &a->dv_cmp);
}

size_t nsa_cuda_cmp_attn_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_bwd_args *a)
{
    return cu_op_workspace(ctx, p, run_cmp_attn_bwd, a);
}

nsa_status nsa_cuda_cmp_attn_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_cmp_attn_bwd_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_cmp_attn_bwd, a, ws);
}
