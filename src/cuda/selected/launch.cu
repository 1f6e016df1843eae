/* selected/launch.cu -- the selected-attention op (nsa.h section 4) and its backward on the
 * GPU, and the host drivers of the selected branch: the plans (selected/plan.c, attn/plan.c)
 * with their tensor maps, the task maps, and the backward's inverted lists and segments. */
#include "selected.h"
#include "../prim/tmap.h"
#include <limits.h>
#include <stdlib.h>
#include <string.h>
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
    io.KR = p->Tk;
    io.Dw = cu_take_f32(g, nsa_size_elems(p->B, p->T, p->HQ, 1), 0);
    io.dq32 = cu_take_f32(g, nsa_size_elems(p->B, p->T, p->HQ, p->DK), 1);
    io.dk32 = cu_take_f32(g, nsa_size_elems(p->B, p->Tk, p->H, p->DK), 1);
    io.dv32 = cu_take_f32(g, nsa_size_elems(p->B, p->Tk, p->H, p->DV), 1);
    cu_bwd_slc(g, &io, U, ucnt, p->m);
    const dview dq = dv_of(&a->dq), dk = dv_of(&a->dk), dv = dv_of(&a->dv);
    nsa_cu_store32(g, io.dq32, &dq, p->B, p->T, p->HQ, p->DK);
    nsa_cu_store32(g, io.dk32, &dk, p->B, p->Tk, p->H, p->DK);
    nsa_cu_store32(g, io.dv32, &dv, p->B, p->Tk, p->H, p->DV);
}

size_t nsa_cuda_slc_attn_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_bwd_args *a)
{
    return cu_op_workspace(ctx, p, run_slc_attn_bwd, a);
}

nsa_status nsa_cuda_slc_attn_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_slc_attn_bwd_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_slc_attn_bwd, a, ws);
}

/* ---- host drivers ------------------------------------------------------------------------ */

rule_t cu_rule_slc(const nsa_problem *p)
{
    rule_t r;
    memset(&r, 0, sizeof r);
    r.kind = RULE_SLC;
    r.lp = (int)p->cfg.slc_block;
    r.shift = (int)(p->Tk - p->T); /* a query chunk's rows sit at the end of its Tk positions */
    return r;
}

/* Selected attention forward or dQ (P's U / ucnt lists set) as the planner says: sfw with
 * its K / V maps (a map that cannot be made sends it back to qtile), or qtile's tiles. */
static void run_slc_q(grun *g, qparams *P, int mode, nsa_dtype dt)
{
    const nsa_problem *p = g->p;
    const cu_views v = cu_views_of(&P->q, &P->k, &P->v, &P->o, mode == MODE_DQ ? &P->dout : NULL);
    cu_slc_plan pl = cu_plan_slc(p, &g->dev, g->ovr, &v, mode, dt, 0);
    CUtensorMap tk, tv;
    if (pl.kernel == CU_SLC_SFW && (!tmap_make(&tk, &P->k, dt, p->B, p->Tk, p->H, p->DK, pl.bn) ||
                                    !tmap_make(&tv, &P->v, dt, p->B, p->Tk, p->H, p->DV, pl.bn)))
        pl = cu_plan_slc(p, &g->dev, g->ovr, &v, mode, dt, 1);
    unitspec u = {UK_ROWS, pl.unit_a, pl.unit_b, 0, 0};
    int64_t tiles;
    P->sm = g_seqmap(g, u, &tiles);
    if (pl.kernel == CU_SLC_QTILE) {
        cu_run_qtile(g, P, mode, pl.bn, tiles, dt);
        return;
    }
    if (!g_live(g) || tiles == 0) return;
    const int bf16 = dt == NSA_DTYPE_BF16;
    if (p->DK == 64) nsa_cu_sfw_64(g, P, &pl, mode, bf16, tiles, &tk, &tv);
    else nsa_cu_sfw_128(g, P, &pl, mode, bf16, tiles, &tk, &tv);
}

void cu_fwd_slc(grun *g, const dview *q, nsa_dtype dt, const dview *k, const dview *v, const int32_t *U,
                const int32_t *ucnt, int64_t m, const dview *o, const dview *lse)
{
    const nsa_problem *p = g->p;
    qparams P;
    cu_qparams_base(&P, p, q);
    P.k = *k;
    P.v = *v;
    P.o = *o;
    P.lse = *lse;
    P.rule = cu_rule_slc(p);
    P.U = U, P.ucnt = ucnt, P.m = (int)m;
    if (dt == NSA_DTYPE_F32) { /* float32 storage: the scalar kernels (attn/simt.cu) */
        P.sm = g_plain_map(g);
        nsa_cu_simt_q(g, &P, MODE_FWD, p->B, NULL);
        return;
    }
    cu_scan_nonfinite(g, v, p->B, p->Tk, p->H, p->DV); /* the forward's one B operand */
    P.nf = g_nf_tiles(g);
    run_slc_q(g, &P, MODE_FWD, dt);
    cu_simt_standby_q(g, &P, MODE_FWD);
}

/* the selected rule's dK / dV on kwp_kernel (the plan chose it and its maps were made) */
static void run_kwp(grun *g, const kparams *K, nsa_dtype dt, int64_t tiles, const CUtensorMap maps[4])
{
    if (!g_live(g) || tiles == 0) return;
    if (K->DK == 64) nsa_cu_kwp_64(g, K, dt == NSA_DTYPE_BF16, 1, tiles, maps);
    else nsa_cu_kwp_128(g, K, dt == NSA_DTYPE_BF16, 1, tiles, maps);
}

void cu_bwd_slc(grun *g, const bwd_io *io, const int32_t *U, const int32_t *ucnt, int64_t m)
{
    const nsa_problem *p = g->p;
    const int64_t lp = p->cfg.slc_block;
    if (!io->D_ready) nsa_cu_dprep(g, io->dout, io->o, io->gate, io->Dw, io->gate ? io->gw : NULL, p->B, p->T, p->HQ, p->DV);
    const rule_t rule = cu_rule_slc(p);
    if (io->dt == NSA_DTYPE_F32) { /* float32 storage: the scalar kernels (attn/simt.cu) */
        inv_index ix;
        memset(&ix, 0, sizeof ix);
        nsa_cu_invert(g, U, ucnt, m, lp, &ix);
        const cu_slc_lists lists = {U, ucnt, (int)m, ix.offs, ix.list, ix.offs_pref, ix.list_pref};
        cu_bwd_simt(g, &rule, io, &lists);
        return;
    }
    cu_bwd_scan(g, io);
    qparams Q;
    cu_dq_params(&Q, p, io);
    Q.rule = rule;
    Q.nf = g_nf_tiles(g);
    Q.U = U, Q.ucnt = ucnt, Q.m = (int)m;
    run_slc_q(g, &Q, MODE_DQ, io->dt);
    cu_simt_standby_q(g, &Q, MODE_DQ);

    inv_index ix;
    memset(&ix, 0, sizeof ix);
    nsa_cu_invert(g, U, ucnt, m, lp, &ix);
    kparams K;
    cu_dkdv_params(&K, p, io);
    K.rule = cu_rule_slc(p);
    K.nf = g_nf_tiles(g);
    K.offs = ix.offs, K.list = ix.list, K.offs_pref = ix.offs_pref, K.list_pref = ix.list_pref;
    K.m = (int)m;
    K.nsub = (int)((lp + 63) / 64);
    unitspec uk = {UK_SLC_TILES, K.nsub, lp, 0, 0};
    int64_t ktiles;
    K.sm = g_seqmap(g, uk, &ktiles);

    /* A block every query selects (the forced first one) would leave one CTA with all T * G
     * rows: lists longer than segp queries (~16k rows, fewer for short inputs so the tests
     * see it) are cut into segments whose partials are reduced in order. */
    int64_t segp = 16384 / p->G, tq = p->T / 8;
    segp = segp < tq ? segp : tq;
    segp = segp > 16 ? segp : 16;
    unitspec uo = {UK_INV_OFFS, 0, lp, 0, 0};
    int64_t noffs = 0, ebound = 0; /* further segments: at most len * m / segp per (sequence, head) */
    for (int64_t s = 0; s < p->num_seqs; s++) {
        const int64_t len = p->cu_seqlens ? p->cu_seqlens[s + 1] - p->cu_seqlens[s] : p->T;
        noffs += seq_units(uo, len, p->cu_seqlens ? len : p->Tk);
        ebound += len * m / segp;
    }
    const int64_t nflat = noffs * p->H;
    ebound *= p->H;
    int32_t *xoff = (int32_t *)g_take_n(g, nsa_size_add(nsa_size_of(nflat), 1), sizeof(int32_t));
    const size_t part_rows = nsa_size_mul(nsa_size_mul(nsa_size_of(ebound), nsa_size_of(K.nsub)), 64);
    float *part = cu_take_f32(g, nsa_size_mul(part_rows, nsa_size_add(nsa_size_of(p->DK), nsa_size_of(p->DV))), 0);
    nsa_cu_slc_segments(g, &ix, nflat, segp, xoff);
    K.segp = (int)segp, K.xoff = xoff, K.nflat = nflat, K.part = part;
    /* same tasks and partials on either tile */
    const cu_views kv = cu_views_of(&K.q, &K.k, &K.v, NULL, &K.dout);
    const cu_dkdv_plan kp = cu_plan_dkdv(p, &g->dev, g->ovr, &kv, 1, 0, 0);
    CUtensorMap maps[4];
    const int kwp = kp.kernel == CU_DKDV_KWP && cu_kwp_maps(g, &K, io->dt, 1, maps);
    if (kwp) run_kwp(g, &K, io->dt, ktiles, maps);
    else cu_run_ktile(g, &K, ktiles, io->dt);
    cu_simt_standby_k(g, &K);
    if (ebound > 0 && g_live(g)) { /* (live only: the launch counts below fit once the workspace did) */
        kparams X = K;
        X.extra = 1;
        if (kwp) run_kwp(g, &X, io->dt, ebound * K.nsub, maps);
        else cu_run_ktile(g, &X, ebound * K.nsub, io->dt);
        nsa_cu_slc_reduce(g, &K, ktiles);
    }
}

void cu_take_usable(grun *g, const nsa_tensor *idx, const nsa_tensor *counts, int32_t **U, int32_t **ucnt)
{
    const nsa_problem *p = g->p;
    const int64_t rows = p->B * p->T * p->H;
    *U = (int32_t *)g_take_n(g, nsa_size_add(nsa_size_mul(nsa_size_of(rows), nsa_size_of(p->m)), 1), sizeof(int32_t));
    *ucnt = (int32_t *)g_take_n(g, nsa_size_add(nsa_size_of(rows), 1), sizeof(int32_t));
    const dview iv = dv_of(idx), cv = dv_of(counts);
    nsa_cu_usable(g, &iv, counts && nsa_present(counts) ? &cv : NULL, p->m, p->cfg.slc_block, *U, *ucnt);
}
