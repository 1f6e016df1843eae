/* selection/launch.cu -- the selection op (nsa.h section 3) on the GPU and its host driver:
 * the plan (selection/plan.c) with its tensor maps, the task map and the launch of swg_kernel
 * or select_kernel. */
#include "selection.h"
#include "../attn/tiles.h"
#include "../prim/tmap.h"
#include <limits.h>
#include <string.h>
#include "../range/range.h"
#include "../cuda_backend.h"

static void run_select(grun *g, const nsa_select_args *a)
{
    const nsa_problem *p = g->p;
    if (!cu_attn_supported(g, a->q.dtype)) return;
    g_seq_setup(g, 1);
    const dview q = dv_of(&a->q), kc = dv_of(&a->k_cmp), idx = dv_of(&a->block_indices);
    const dview cnt = dv_of(&a->block_counts);
    dview lse = dv_of(&a->lse_cmp);
    if (!nsa_present(&a->lse_cmp)) { /* the compressed attention's normaliser, lse only */
        float *lw = cu_take_f32(g, nsa_size_elems(p->B, p->T, p->HQ, 1), 0);
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

/* ---- host drivers ------------------------------------------------------------------------ */

void cu_select(grun *g, const dview *q, nsa_dtype dt, const dview *k, const dview *lse, const dview *idx,
               const dview *cnt)
{
    const nsa_problem *p = g->p;
    const nsa_config *c = &p->cfg;
    sparams P;
    memset(&P, 0, sizeof P);
    P.q = *q, P.lse = *lse, P.idx = *idx;
    if (cnt) P.cnt = *cnt;
    P.k = *k;
    P.T = p->T, P.HQ = p->HQ, P.H = p->H, P.G = p->G, P.DK = (int)p->DK;
    P.sl2 = p->scale * NSA_LOG2E;
    P.cl = (int)c->cmp_len, P.cd = (int)c->cmp_stride, P.lp = (int)c->slc_block;
    P.n = (int)c->slc_topk, P.n_init = (int)(c->n_init < INT_MAX ? c->n_init : INT_MAX);
    P.n_local = (int)(c->n_local < INT_MAX ? c->n_local : INT_MAX);
    if (dt == NSA_DTYPE_F32) { /* float32 storage: the scalar kernel */
        P.sm = g_plain_map(g);
        nsa_cu_select_simt(g, &P, p->B);
        return;
    }
    const cu_views v = cu_views_of(&P.q, &P.k, NULL, NULL, NULL);
    cu_select_plan pl = cu_plan_select(p, &g->dev, g->ovr, &v, 0);
    if (pl.kernel == CU_SEL_UNSUPPORTED) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "config.slc_topk: %lld, the CUDA selection takes at most 6144",
               (long long)c->slc_topk);
        return;
    }
    P.HC = pl.HC;
    P.P = pl.P;
    const int D = P.DK;
    CUtensorMap maps[2];
    if (pl.kernel == CU_SEL_SWG && (!tmap_make(&maps[0], &P.q, dt, p->B, p->T, p->HQ, D, SWG_BP) ||
                                    !tmap_make(&maps[1], &P.k, dt, p->B, p->cmp_rows, p->H, D, SWG_NK)))
        pl = cu_plan_select(p, &g->dev, g->ovr, &v, 1);
    P.JC = pl.JC;
    if (pl.kernel == CU_SEL_SWG) {
        unitspec u = {UK_ROWS, 1, SWG_BP, 0, 0};
        int64_t tiles;
        P.sm = g_seqmap(g, u, &tiles);
        if (!g_live(g) || tiles == 0) return;
        const int bf16 = dt == NSA_DTYPE_BF16;
        switch (D) {
        case 64: nsa_cu_swg_64(g, &P, bf16, pl.NR, pl.MS, pl.WS, tiles, maps); break;
        case 128: nsa_cu_swg_128(g, &P, bf16, pl.NR, pl.MS, pl.WS, tiles, maps); break;
        default: nsa_cu_swg_192(g, &P, bf16, pl.NR, pl.MS, pl.WS, tiles, maps); break;
        }
        return;
    }
    unitspec u = {UK_ROWS, 1, P.P, 0, 0};
    int64_t tiles;
    P.sm = g_seqmap(g, u, &tiles);
    const int cls = cu_dims_class(p->DK, 0);
    if (!g_live(g) || tiles == 0) return;
    if (select_smem(cls, P.P, P.JC, P.n, P.HC) > (size_t)g->dev.smem_max) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "config.slc_topk: %d with head dim %d needs more shared memory for the "
               "selection than the device's %d bytes", P.n, cls, g->dev.smem_max);
        return;
    }
    const int bf16 = dt == NSA_DTYPE_BF16;
    switch (cls) {
    case 64: nsa_cu_select_64(g, &P, bf16, tiles); break;
    case 128: nsa_cu_select_128(g, &P, bf16, tiles); break;
    default: nsa_cu_select_192(g, &P, bf16, tiles); break;
    }
}
