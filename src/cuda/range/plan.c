/* range/plan.c -- the planner of a range branch's forward / dQ (range/plan.h). */
#include "plan.h"

int cu_qwg_class(int64_t DK, int64_t DV, int has_v)
{
    if (!has_v) DV = DK == 192 ? 128 : DK;
    if ((DK == 64 || DK == 128) && DV == DK) return (int)DK;
    if (DK == 192 && DV == 128) return 192;
    return 0;
}

static int qwg_fits(const nsa_problem *p, const cu_device *d, const cu_overrides *o, const cu_views *v, int mode,
                    nsa_dtype dt)
{
    if (!cu_sm90(d, o)) return 0;
    const int D = cu_qwg_class(p->DK, p->DV, v->has_v), DV = D == 192 ? 128 : D;
    if (!D || !v->q || !v->k || (v->has_v && !v->v) || (mode == MODE_DQ && !v->dout)) return 0;
    if (v->has_o && (!v->o || (v->o_dt != (int)dt && v->o_dt != NSA_DTYPE_F32))) return 0;
    if (qwg_smem(D, DV, MODE_DQ) > (size_t)d->smem_max || qwg_smem(D, DV, MODE_FWD) > (size_t)d->smem_max) return 0;
    return cu_sm90_class(d, D);
}

cu_range_plan cu_plan_range(const nsa_problem *p, const cu_device *d, const cu_overrides *o, const cu_views *v,
                            int mode, nsa_dtype dt, int no_tma)
{
    cu_range_plan pl = {CU_FWD_QTILE, 16 * QTILE_NW(64), QTILE_NW(64), QTILE_NST(64), 64, 0, 0};
    if (no_tma || !qwg_fits(p, d, o, v, mode, dt)) return pl;
    const int64_t G = p->G;
    pl.kernel = CU_FWD_QWG;
    pl.rows = QWG_BM;
    /* Q's tile as one box when 128 rows are whole positions, and each warpgroup's 64 rows of O
     * as one when they are (O in q's dtype); otherwise cp.async / plain stores */
    pl.qbox = G <= QWG_BM && QWG_BM % G == 0;
    pl.obox = mode == MODE_FWD && pl.qbox && v->has_o && v->o_dt == (int)dt && G <= 64 && 64 % G == 0;
    return pl;
}

int cu_plan_range_pipe(const nsa_problem *p, const cu_overrides *o, int window_rule, int64_t wl, int has_v)
{
    if (!has_v || o->range_pipe == 0) return 0;
    if (o->range_pipe == 2) return 1;
    const int64_t span = (int64_t)QWG_PIPE_MIN_CHUNKS * QWG_BN(MODE_FWD);
    return window_rule && (wl < 0 || wl >= span) && p->Tk >= 2 * span;
}
