/* attn/plan.c -- the dK / dV planner (attn/plan.h). */
#include "plan.h"
#include "../../rules.h"

static int kwp_fits(const nsa_problem *p, const cu_device *d, const cu_overrides *o, const cu_views *v, int slc)
{
    if (!o->kwp || !cu_sm90(d, o) || p->G > 64 || 64 % p->G) return 0;
    if (p->DK != p->DV || (p->DK != 64 && p->DK != 128) || !cu_sm90_class(d, (int)p->DK)) return 0;
    if (kwp_smem((int)p->DK, slc) > (size_t)d->smem_max) return 0;
    return v->dout && v->q && v->k && v->v;
}

cu_dkdv_plan cu_plan_dkdv(const nsa_problem *p, const cu_device *d, const cu_overrides *o, const cu_views *v, int slc,
                          int dq_on_wgmma, int no_tma)
{
    cu_dkdv_plan pl = {CU_DKDV_KTILE, 64};
    if (slc) {
        if (!no_tma && kwp_fits(p, d, o, v, 1)) pl.kernel = CU_DKDV_KWP;
        return pl;
    }
    /* same tasks at 128 keys, same ordered partials: the wgmma tiles when the dQ could take its
     * sm_90a tile */
    if (!dq_on_wgmma || p->DK != p->DV || kwg_smem((int)p->DK) > (size_t)d->smem_max) return pl;
    pl.bk = KWG_BK;
    pl.kernel = !no_tma && kwp_fits(p, d, o, v, 0) ? CU_DKDV_KWP : CU_DKDV_KWG;
    return pl;
}

int cu_plan_cmp_segments(const nsa_problem *p, const cu_overrides *o)
{
    if (o->cmp_seg > 0) return o->cmp_seg;
    /* few key tiles, each seen by most queries: each tile's rows are cut into nseg absolute
     * row segments, and tile t has work only in the segments its queries reach (about half of
     * the tasks). Equal tasks still finish unevenly, so ~15 tasks with work per SM keep the
     * SMs busy to the end (64k, H 1: 32 segments left the SMs idle a third of the kernel, 128
     * cut the compressed backward by 14 %); each further segment costs its partial's write
     * and read (bk x (DK + DV) floats, for every tile of every sequence), so at most 4096
     * tasks over the whole batch, 128 segments, and no more segments than the longest
     * sequence has 64-row chunks (a segment holds whole chunks: the rest would be empty) */
    const int64_t nseq = p->cu_seqlens ? p->num_seqs : p->B; /* (as the tasks' seqmap counts them) */
    int64_t tiles = 0, rows_max = 0;
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t lq = p->cu_seqlens ? p->cu_seqlens[s + 1] - p->cu_seqlens[s] : p->T, lk = p->cu_seqlens ? lq : p->Tk;
        tiles += (nsa_rule_num_cmp(lk, p->cfg.cmp_len, p->cfg.cmp_stride) + KWG_BK - 1) / KWG_BK;
        rows_max = lq * p->G > rows_max ? lq * p->G : rows_max;
    }
    const int64_t chunks = (rows_max + 63) / 64;
    int nseg = 8;
    while (nseg < 128 && nseg * 2 <= chunks && tiles * nseg * 2 * p->H <= 4096) nseg *= 2;
    return nseg;
}
