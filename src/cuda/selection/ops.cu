/* selection/ops.cu -- the selection op (nsa.h section 3) on the GPU. */
#include "selection.h"
#include "../range/range.h"
#include "../cuda_backend.h"

static int has(const nsa_tensor *t) { return t->data != NULL; }

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

size_t nsa_cuda_select_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_select_args *a)
{
    return cu_op_workspace(ctx, p, run_select, a);
}

nsa_status nsa_cuda_select(const nsa_context *ctx, const nsa_problem *p, const nsa_select_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_select, a, ws);
}
