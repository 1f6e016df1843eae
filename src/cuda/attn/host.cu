/* attn/host.cu -- host side of the attention tiles shared by the range and selected branches:
 * parameter blocks from the problem, the views' alignment for the planners, and the launches
 * of the tiles both branches use (the one place where the run-time head-dim class becomes a
 * template argument). */
#include "tiles.h"
#include "../prim/tmap.h"
#include <limits.h>
#include <string.h>

static int class_dv(int cls) { return cls == 192 ? 128 : cls; }

int cu_attn_supported(grun *g, nsa_dtype dt)
{
    const nsa_problem *p = g->p;
    if (dt != NSA_DTYPE_F16 && dt != NSA_DTYPE_BF16 && dt != NSA_DTYPE_F32) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "q: dtype %s, the CUDA kernels take f16, bf16 or f32", nsa_dtype_name(dt));
        return 0;
    }
    if (!cu_dims_class(p->DK, p->DV)) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "q: DK %lld and DV %lld, no CUDA tile for these head dims",
               (long long)p->DK, (long long)p->DV);
        return 0;
    }
    if (p->T > INT_MAX / 2 || p->Tk > INT_MAX / 2 || p->H > 65535 || (p->cfg.slc_block > 0 && p->cfg.slc_block > INT_MAX / 4)) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "q: T %lld, Tk %lld, H %lld or slc_block %lld beyond the CUDA kernels (T, Tk <= %d, "
               "H <= 65535, slc_block <= %d)", (long long)p->T, (long long)p->Tk, (long long)p->H, (long long)p->cfg.slc_block,
               INT_MAX / 2, INT_MAX / 4);
        return 0;
    }
    return 1;
}

void cu_qparams_base(qparams *P, const nsa_problem *p, const dview *q)
{
    memset(P, 0, sizeof *P);
    P->q = *q;
    P->T = p->T, P->HQ = p->HQ, P->H = p->H, P->G = p->G;
    P->DK = (int)p->DK, P->DV = (int)p->DV;
    P->scale = p->scale;
    P->sl2 = p->scale * NSA_LOG2E;
}

void cu_dq_params(qparams *P, const nsa_problem *p, const bwd_io *io)
{
    cu_qparams_base(P, p, io->q);
    P->k = *io->k;
    P->v = *io->v;
    P->lse = *io->lse;
    P->dout = *io->dout;
    P->Dw = io->Dw;
    P->gw = io->gate ? io->gw : NULL;
    P->dq = io->dq32;
}

void cu_bwd_scan(grun *g, const bwd_io *io)
{
    const nsa_problem *p = g->p;
    cu_scan_score_operand(g, io->q, p->B, p->T, p->HQ, p->DK);
    cu_scan_score_operand(g, io->k, p->B, io->KR, p->H, p->DK);
    cu_scan_nonfinite(g, io->v, p->B, io->KR, p->H, p->DV);
    cu_scan_lse(g, io->lse, p->B, p->T, p->HQ);
}

void cu_dkdv_params(kparams *P, const nsa_problem *p, const bwd_io *io)
{
    memset(P, 0, sizeof *P);
    P->q = *io->q, P->k = *io->k, P->v = *io->v, P->dout = *io->dout, P->lse = *io->lse;
    P->Dw = io->Dw;
    P->gw = io->gate ? io->gw : NULL;
    P->dk = io->dk32, P->dv = io->dv32;
    P->bk = 64;
    P->T = p->T, P->HQ = p->HQ, P->H = p->H, P->G = p->G, P->KR = io->KR;
    P->DK = (int)p->DK, P->DV = (int)p->DV;
    P->scale = p->scale;
    P->sl2 = p->scale * NSA_LOG2E;
}

void cu_bwd_simt(grun *g, const rule_t *r, const bwd_io *io, const cu_slc_lists *lists)
{
    const nsa_problem *p = g->p;
    qparams Q;
    cu_dq_params(&Q, p, io);
    Q.rule = *r;
    Q.sm = g_plain_map(g);
    kparams K;
    cu_dkdv_params(&K, p, io);
    K.rule = *r;
    K.sm = Q.sm;
    if (lists) {
        Q.U = lists->U, Q.ucnt = lists->ucnt, Q.m = lists->m;
        K.offs = lists->offs, K.list = lists->list, K.offs_pref = lists->offs_pref, K.list_pref = lists->list_pref;
        K.m = lists->m;
    }
    if (io->dq_out) g_zero(g, io->dq32, nsa_size_mul(nsa_size_elems(p->B, p->T, p->HQ, p->DK), sizeof(float)));
    nsa_cu_simt_q(g, &Q, MODE_DQ, p->B, NULL);
    nsa_cu_simt_k(g, &K, p->B, NULL);
}

void cu_simt_standby_q(grun *g, const qparams *P, int mode)
{
    if (!P->nf) return;
    qparams S = *P;
    S.sm = g_plain_map(g);
    nsa_cu_simt_q(g, &S, mode, g->p->B, P->nf);
}

void cu_simt_standby_k(grun *g, const kparams *P)
{
    if (!P->nf) return;
    kparams S = *P;
    S.sm = g_plain_map(g);
    nsa_cu_simt_k(g, &S, g->p->B, P->nf);
}

void cu_run_qtile(grun *g, const qparams *P, int mode, int bn, int64_t tiles, nsa_dtype dt)
{
    const int cls = cu_dims_class(g->p->DK, g->p->DV);
    if (!g_live(g) || tiles == 0) return;
    if (qtile_smem(cls, class_dv(cls), QTILE_NW(bn), mode, QTILE_NST(bn), bn) > (size_t)g->dev.smem_max) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "device: the query tile for head dim %d needs more shared memory than the "
               "device's %d bytes", cls, g->dev.smem_max);
        return;
    }
    const int bf16 = dt == NSA_DTYPE_BF16;
    switch (cls) {
    case 64: nsa_cu_qtile_64(g, P, mode, bf16, bn, tiles); break;
    case 128: nsa_cu_qtile_128(g, P, mode, bf16, bn, tiles); break;
    default: nsa_cu_qtile_192(g, P, mode, bf16, bn, tiles); break;
    }
}

void cu_run_ktile(grun *g, const kparams *P, int64_t tiles, nsa_dtype dt)
{
    const int cls = cu_dims_class(g->p->DK, g->p->DV);
    if (!g_live(g) || tiles == 0) return;
    if (ktile_smem(cls, class_dv(cls)) > (size_t)g->dev.smem_max) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "device: the key tile for head dim %d needs more shared memory than the "
               "device's %d bytes", cls, g->dev.smem_max);
        return;
    }
    const int bf16 = dt == NSA_DTYPE_BF16;
    switch (cls) {
    case 64: nsa_cu_ktile_64(g, P, bf16, tiles); break;
    case 128: nsa_cu_ktile_128(g, P, bf16, tiles); break;
    default: nsa_cu_ktile_192(g, P, bf16, tiles); break;
    }
}

/* kwp's four tensor maps (q, dout, k, v): range rules one box of 64 / G positions x G heads
 * per 64-row chunk, the selected rule one box per listed position. @return 0 when one cannot
 * be made. */
int cu_kwp_maps(const grun *g, const kparams *K, nsa_dtype dt, int slc, CUtensorMap maps[4])
{
    const nsa_problem *p = g->p;
    const int qrows = slc ? 1 : (int)(64 / p->G), krows = slc ? 64 : KWG_BK;
    return tmap_make_h(&maps[0], &K->q, dt, p->B, p->T, p->HQ, K->DK, qrows, (int)p->G) &&
           tmap_make_h(&maps[1], &K->dout, dt, p->B, p->T, p->HQ, K->DV, qrows, (int)p->G) &&
           tmap_make(&maps[2], &K->k, dt, p->B, K->KR, p->H, K->DK, krows) &&
           tmap_make(&maps[3], &K->v, dt, p->B, K->KR, p->H, K->DV, krows);
}

/* The alignment of a parameter block's views, as the planners take it. */
cu_views cu_views_of(const dview *q, const dview *k, const dview *v, const dview *o, const dview *dout)
{
    cu_views w;
    memset(&w, 0, sizeof w);
    w.q = q && q->p && q->al;
    w.k = k && k->p && k->al;
    w.has_v = v && v->p;
    w.v = w.has_v && v->al;
    w.has_o = o && o->p;
    w.o = w.has_o && o->al;
    w.o_dt = w.has_o ? o->dt : 0;
    w.dout = dout && dout->p && dout->al;
    return w;
}

