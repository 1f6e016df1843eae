/* selected/plan.c -- the planner of the selected branch's forward / dQ (selected/plan.h). */
#include "plan.h"

cu_slc_plan cu_plan_slc(const nsa_problem *p, const cu_device *d, const cu_overrides *o, const cu_views *v, int mode,
                        nsa_dtype dt, int no_tma)
{
    cu_slc_plan pl;
    const int64_t G = p->G;
    const int D = (int)p->DK;
    /* TMA tile: 32 keys in 2 stages (six or seven of these one-warp CTAs per SM) unless an
     * override asks for 32 x 3 or 64 x 2; two neighbouring positions per CTA on the default
     * stages */
    const int bn = o->slc_bn == 64 ? 64 : 32, ns = bn == 32 && o->slc_stages == 3 ? 3 : 2;
    int np = bn == 32 && ns == 2 && o->slc_pair ? 2 : 1;
    int sfw = !no_tma && cu_sm90(d, o) && p->DK == p->DV && (D == 64 || D == 128) && G >= 4;
    if (sfw && mode == MODE_FWD && (!v->o || (v->o_dt != (int)dt && v->o_dt != NSA_DTYPE_F32))) sfw = 0;
    if (sfw && (sfw_smem(D, bn, ns) > (size_t)d->smem_max || !cu_sm90_class(d, D))) sfw = 0;
    if (!sfw) {
        pl.kernel = CU_SLC_QTILE;
        pl.bn = G >= 16 ? 32 : 64; /* 32: one warp, single-buffered (attn/plan.h QTILE_NW / QTILE_NST) */
        pl.nw = QTILE_NW(pl.bn);
        pl.nst = QTILE_NST(pl.bn);
        pl.rp = 1, pl.ks = 1;
        pl.unit_a = G, pl.unit_b = 16 * pl.nw;
        return pl;
    }
    if (G > 16) np = 1; /* two positions per CTA only when one head group holds G */
    /* union tiles: one warp's 16 rows are 16 / G neighbouring positions x G heads over the
     * union of their blocks (no padding rows, the forced blocks loaded once); the G = 4
     * forward on two warps taking alternate chunks */
    const int uni = o->slc_union && bn == 32 && ns == 2 && (mode == MODE_DQ ? G == 4 || G == 8 : G == 4);
    pl.kernel = CU_SLC_SFW;
    pl.rp = uni ? (int)(16 / G) : 1;
    pl.ks = uni && mode == MODE_FWD ? 2 : 1;
    if (pl.rp > 1) np = pl.rp;
    pl.nw = np;
    pl.bn = bn;
    pl.nst = ns;
    pl.unit_a = (G + 15) / 16, pl.unit_b = np; /* positions x head group */
    return pl;
}
