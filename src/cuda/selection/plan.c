/* selection/plan.c -- the planner of the selection (selection/plan.h). */
#include "plan.h"

#include <limits.h>

int cu_select_blocks_per_pass(const nsa_config *c, int nk, int cap)
{
    for (int jc = cap; jc >= 1; jc--)
        if ((jc * c->slc_block + c->cmp_len - 1) / c->cmp_stride + 1 <= nk) return jc;
    return 0;
}

cu_select_plan cu_plan_select(const nsa_problem *p, const cu_device *d, const cu_overrides *o, const cu_views *v,
                              int no_tma)
{
    const nsa_config *c = &p->cfg;
    cu_select_plan pl = {CU_SEL_SELECT, 0, 0, 0, 0, 0, 0};
    pl.HC = (int)(p->G < 64 ? p->G : 64);
    pl.P = 64 / pl.HC;
    const int64_t cap = (48 * 1024) / (8 * (c->slc_topk > 0 ? c->slc_topk : 1));
    if (pl.P > cap) pl.P = (int)cap;
    if (pl.P < 1 || c->slc_topk > INT_MAX / 8) { /* n > 6144: the per-position lists would not fit */
        pl.kernel = CU_SEL_UNSUPPORTED;
        return pl;
    }
    const int D = (int)p->DK, n = (int)c->slc_topk;
    const int jc = cu_select_blocks_per_pass(c, SWG_NK, 64);
    if (!no_tma && cu_sm90(d, o) && (D == 64 || D == 128 || D == 192) && v->q && v->k && jc >= 1 && n <= 32 &&
        p->G <= INT_MAX / SWG_BP && swg_smem(D, jc, n <= 16 ? 16 : 32, 1, (int)p->G, 0) <= (size_t)d->smem_max &&
        cu_sm90_class(d, D)) {
        pl.kernel = CU_SEL_SWG;
        pl.JC = jc;
        /* two merge lanes per position (n <= 16) unless their lists would cost the second CTA
         * per SM (sm_90: 228 KB of shared memory per SM, 1 KB of it reserved per CTA) or not
         * fit at all */
        const size_t s2 = swg_smem(D, jc, 16, 2, (int)p->G, 0), s1 = swg_smem(D, jc, 16, 1, (int)p->G, 0);
        const int two = 2 * (s2 + 1024) <= 228 * 1024 || (2 * (s1 + 1024) > 228 * 1024 && s2 <= (size_t)d->smem_max);
        pl.NR = n <= 16 ? 16 : 32;
        pl.MS = n <= 16 && two ? 2 : 1;
        /* the merge in a warpgroup of its own where two such CTAs still fit an SM: the tensor
         * pipe no longer waits on each pass's merge (bench/NOTES.md) */
        pl.WS = pl.MS == 2 && o->swg_ws && 2 * (swg_smem(D, jc, 16, 2, (int)p->G, 1) + 1024) <= 228 * 1024;
        return pl;
    }
    /* selection blocks per pass: as many as keep the overlapping compressed keys within 64
     * (select_kernel walks a pass's keys in chunks of 64) */
    pl.JC = cu_select_blocks_per_pass(c, 64, 64);
    if (pl.JC < 1) pl.JC = 1;
    return pl;
}
