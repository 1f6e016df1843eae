/* range/launch.cu -- the compressed-attention op (nsa.h section 2) and its backward on the
 * GPU, and the host drivers of every range branch (window / dense, compressed): the plans
 * (range/plan.c, attn/plan.c) with their tensor maps, the task maps and the launches of
 * forward, dQ and dK / dV. Each op is one run function executed twice (sizing pass, live
 * pass: prim/run.h). */
#include "range.h"
#include "../prim/tmap.h"
#include <limits.h>
#include <stdlib.h>
#include <string.h>
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

/* ---- host drivers ------------------------------------------------------------------------ */

rule_t cu_rule_window(int64_t wl, int64_t wr, int causal)
{
    rule_t r;
    memset(&r, 0, sizeof r);
    r.kind = RULE_WIN;
    r.nk = -1; /* the sequence's own keys */
    r.wl = wl;
    r.wr = nsa_rule_window_right(wr, causal);
    r.causal = causal != 0;
    return r;
}

rule_t cu_rule_cmp(const nsa_problem *p)
{
    rule_t r;
    memset(&r, 0, sizeof r);
    r.kind = RULE_CMP;
    r.cl = (int)p->cfg.cmp_len;
    r.cd = (int)p->cfg.cmp_stride;
    r.shift = (int)(p->Tk - p->T); /* a query chunk's rows sit at the end of its Tk positions */
    return r;
}

/* The tensor maps of qwg: K / V chunks (box rows: its chunk of keys), Q's tile (P->qbox),
 * and O's half tiles in the forward (P->obox) or dO's tile in dQ (with qbox), indexed
 * QWG_MAP_K .. QWG_MAP_O. */
typedef struct qwg_maps {
    CUtensorMap m[4];
} qwg_maps;

/* The plan of a range forward / dQ for P, with qwg's maps made (into m) when it chose qwg; a
 * K / V map that cannot be made sends it back to qtile, a Q / O map only turns the box off. */
static cu_range_plan plan_range(grun *g, qparams *P, nsa_dtype dt, int mode, int64_t KR, qwg_maps *m)
{
    const nsa_problem *p = g->p;
    const cu_views v = cu_views_of(&P->q, &P->k, &P->v, &P->o, mode == MODE_DQ ? &P->dout : NULL);
    cu_range_plan pl = cu_plan_range(p, &g->dev, g->ovr, &v, mode, dt, 0);
    if (pl.kernel != CU_FWD_QWG) return pl;
    const int bn = QWG_BN(mode);
    const int64_t G = p->G;
    memset(m, 0, sizeof *m);
    if (!tmap_make(&m->m[QWG_MAP_K], &P->k, dt, p->B, KR, p->H, P->DK, bn) ||
        (P->v.p && !tmap_make(&m->m[QWG_MAP_V], &P->v, dt, p->B, KR, p->H, P->DV, bn)))
        return cu_plan_range(p, &g->dev, g->ovr, &v, mode, dt, 1);
    P->qbox = pl.qbox && tmap_make_h(&m->m[QWG_MAP_Q], &P->q, dt, p->B, p->T, p->HQ, P->DK, (int)(QWG_BM / G), (int)G);
    if (mode == MODE_DQ) /* dO's tile as Q's (the O map's slot) */
        P->qbox = P->qbox && tmap_make_h(&m->m[QWG_MAP_O], &P->dout, dt, p->B, p->T, p->HQ, P->DV, (int)(QWG_BM / G), (int)G);
    else
        P->obox = pl.obox && P->qbox && tmap_make_h(&m->m[QWG_MAP_O], &P->o, dt, p->B, p->T, p->HQ, P->DV, (int)(64 / G), (int)G);
    return pl;
}

/* launch qwg for P's head-dim class (the plan chose it and its maps were made) */
static void run_qwg(grun *g, const qparams *P, int mode, int64_t tiles, nsa_dtype dt, const qwg_maps *m)
{
    if (!g_live(g) || tiles == 0) return;
    const int bf16 = dt == NSA_DTYPE_BF16;
    switch (cu_qwg_class(P->DK, P->DV, P->v.p != NULL)) {
    case 64: nsa_cu_qwg_64(g, P, mode, bf16, tiles, m->m); break;
    case 128: nsa_cu_qwg_128(g, P, mode, bf16, tiles, m->m); break;
    default: nsa_cu_qwg_192(g, P, mode, bf16, tiles, m->m); break;
    }
}

void cu_fwd_range(grun *g, const rule_t *rule, const dview *q, nsa_dtype dt, const dview *k, const dview *v,
                  const dview *o, const dview *lse)
{
    const nsa_problem *p = g->p;
    qparams P;
    cu_qparams_base(&P, p, q);
    P.k = *k;
    if (v) P.v = *v;
    if (o) P.o = *o;
    if (lse) P.lse = *lse;
    P.rule = *rule;
    const int64_t KR = rule->kind == RULE_CMP ? p->cmp_rows : p->Tk; /* key rows (Tk == T but for attention) */
    if (dt == NSA_DTYPE_F32) { /* float32 storage: the scalar kernels (attn/simt.cu) */
        P.sm = g_plain_map(g);
        nsa_cu_simt_q(g, &P, MODE_FWD, p->B, NULL);
        return;
    }
    if (v) cu_scan_nonfinite(g, v, p->B, KR, p->H, p->DV); /* the forward's one B operand */
    P.nf = g_nf_tiles(g);
    /* the workspace does not depend on the tile height, so the sizing pass (which plans the
     * portable tile) sizes the sm_90a path too */
    qwg_maps maps;
    const cu_range_plan pl = plan_range(g, &P, dt, MODE_FWD, KR, &maps);
    const int wg = pl.kernel == CU_FWD_QWG;
    P.pipe = wg && cu_plan_range_pipe(p, g->ovr, rule->kind == RULE_WIN, rule->wl, v != NULL);
    P.ctr = (int *)g_take(g, sizeof(int)); /* (both passes: the workspace layout) */
    if (wg) g_zero(g, P.ctr, sizeof(int));
    unitspec u = {UK_ROWS, p->G, pl.rows, 0, 0};
    int64_t tiles;
    P.sm = g_seqmap(g, u, &tiles);
    if (wg) run_qwg(g, &P, MODE_FWD, tiles, dt, &maps);
    else cu_run_qtile(g, &P, MODE_FWD, pl.bn, tiles, dt);
    cu_simt_standby_q(g, &P, MODE_FWD);
}

/* dk_out / dv_out can take the dK / dV tiles' direct stores: aligned rows, k's dtype or f32. */
static int cu_dkdv_out_ok(const bwd_io *io)
{
    const dview *a = io->dk_out, *b = io->dv_out;
    return a && b && a->al && b->al && (a->dt == (int)io->dt || a->dt == NSA_DTYPE_F32) &&
           (b->dt == (int)io->dt || b->dt == NSA_DTYPE_F32);
}

static void cu_zero_dkdv32(grun *g, const bwd_io *io)
{
    const nsa_problem *p = g->p;
    g_zero(g, io->dk32, nsa_size_mul(nsa_size_elems(p->B, io->KR, p->H, p->DK), sizeof(float)));
    g_zero(g, io->dv32, nsa_size_mul(nsa_size_elems(p->B, io->KR, p->H, p->DV), sizeof(float)));
}

int cu_bwd_range(grun *g, const rule_t *rule, const bwd_io *io)
{
    const nsa_problem *p = g->p;
    if (!io->D_ready) nsa_cu_dprep(g, io->dout, io->o, io->gate, io->Dw, io->gate ? io->gw : NULL, p->B, p->T, p->HQ, p->DV);
    if (io->dt == NSA_DTYPE_F32) { /* float32 storage: the scalar kernels (attn/simt.cu) */
        if (io->dk_out) cu_zero_dkdv32(g, io);
        cu_bwd_simt(g, rule, io, NULL);
        return 0;
    }
    cu_bwd_scan(g, io);
    qparams Q;
    cu_dq_params(&Q, p, io);
    Q.rule = *rule;
    Q.nf = g_nf_tiles(g);
    qwg_maps maps;
    const cu_range_plan pl = plan_range(g, &Q, io->dt, MODE_DQ, io->KR, &maps);
    const int wg = pl.kernel == CU_FWD_QWG;
    unitspec uq = {UK_ROWS, p->G, pl.rows, 0, 0};
    int64_t qtiles;
    Q.sm = g_seqmap(g, uq, &qtiles);
    /* dq written once, in its own dtype, by the task that owns its rows: no fp32 buffer to
     * zero, add into and convert (2 + 4 + 3 bytes per element of traffic at HQ 64, 64k) */
    const int direct = wg && io->dq_out && io->dq_out->al && (io->dq_out->dt == (int)io->dt || io->dq_out->dt == NSA_DTYPE_F32);
    if (direct) {
        Q.dqo = *io->dq_out;
    } else if (io->dq_out) {
        g_zero(g, io->dq32, nsa_size_mul(nsa_size_elems(p->B, p->T, p->HQ, p->DK), sizeof(float)));
    }
    if (wg) {
        run_qwg(g, &Q, MODE_DQ, qtiles, io->dt, &maps);
    } else {
        cu_run_qtile(g, &Q, MODE_DQ, pl.bn, qtiles, io->dt);
    }
    cu_simt_standby_q(g, &Q, MODE_DQ);

    kparams K;
    cu_dkdv_params(&K, p, io);
    K.rule = *rule;
    K.nf = g_nf_tiles(g);
    const cu_views kv = cu_views_of(&K.q, &K.k, &K.v, NULL, &K.dout);
    cu_dkdv_plan kp = cu_plan_dkdv(p, &g->dev, g->ovr, &kv, 0, wg, 0);
    K.bk = kp.bk;
    unitspec uk = {UK_KROWS, 1, K.bk, 0, 0}; /* key tiles: the key side's rows */
    if (rule->kind == RULE_CMP) { /* few key tiles, each seen by most queries: row segments */
        K.nseg = cu_plan_cmp_segments(p, g->ovr);
        uk.kind = UK_CMP_TILES_X, uk.a = K.nseg, uk.b = K.bk, uk.cl = p->cfg.cmp_len, uk.cd = p->cfg.cmp_stride;
    } else { /* causal with few kv heads: few tasks of unequal length, cut the same way */
        K.nseg = cu_plan_range_segments(p, rule->wl, rule->wr, rule->causal, rule->shift, rule->nk, g->ovr);
        if (K.nseg > 1) uk.kind = UK_KROWS_X, uk.a = K.nseg;
    }
    int64_t ktiles;
    K.sm = g_seqmap(g, uk, &ktiles);
    if (K.nseg > 1) {
        /* sized for the larger of the two tilings in both passes (the dry pass cannot know
         * which kernel the device will run) */
        unitspec u64 = uk, u128 = uk;
        u64.b = 64, u128.b = KWG_BK;
        const size_t n64 = nsa_size_mul(nsa_size_of(g_units_total(p, u64)), 64);
        const size_t n128 = nsa_size_mul(nsa_size_of(g_units_total(p, u128)), KWG_BK);
        const size_t row = nsa_size_mul(nsa_size_of(p->H), nsa_size_add(nsa_size_of(p->DK), nsa_size_of(p->DV)));
        K.part = cu_take_f32(g, nsa_size_mul(n64 > n128 ? n64 : n128, row), 0);
    }
    CUtensorMap kmaps[4];
    if (kp.kernel == CU_DKDV_KWP && g_live(g) && ktiles > 0 && !cu_kwp_maps(g, &K, io->dt, 0, kmaps))
        kp = cu_plan_dkdv(p, &g->dev, g->ovr, &kv, 0, wg, 1);
    /* dK / dV written once, in their own dtype, where each task owns every row of its keys
     * (the wgmma tiles, one row segment): no fp32 buffers to zero, add into and convert */
    const int dkv_direct = kp.kernel != CU_DKDV_KTILE && K.nseg <= 1 && cu_dkdv_out_ok(io);
    if (dkv_direct) K.dko = *io->dk_out, K.dvo = *io->dv_out;
    else if (io->dk_out) cu_zero_dkdv32(g, io);
    if (kp.kernel == CU_DKDV_KTILE) {
        cu_run_ktile(g, &K, ktiles, io->dt);
    } else if (g_live(g) && ktiles > 0) {
        const int bf16 = io->dt == NSA_DTYPE_BF16;
        if (kp.kernel == CU_DKDV_KWP) {
            if (K.DK == 64) nsa_cu_kwp_64(g, &K, bf16, 0, ktiles, kmaps);
            else nsa_cu_kwp_128(g, &K, bf16, 0, ktiles, kmaps);
        } else {
            if (K.DK == 64) nsa_cu_kwg_64(g, &K, bf16, ktiles);
            else nsa_cu_kwg_128(g, &K, bf16, ktiles);
        }
    }
    cu_simt_standby_k(g, &K);
    if (K.nseg > 1) {
        /* the key tiles alone, one per (tile, kv head): uk without its segments */
        unitspec ut = uk;
        if (rule->kind == RULE_CMP) ut.kind = UK_CMP_TILES, ut.a = 0;
        else ut.kind = UK_KROWS, ut.a = 1;
        int64_t ntiles;
        const seqmap tm = g_seqmap(g, ut, &ntiles);
        nsa_cu_seg_reduce(g, &K, tm, ntiles);
    }
    return (direct ? CU_BWD_WROTE_DQ : 0) | (dkv_direct ? CU_BWD_WROTE_DKDV : 0);
}

void cu_range_bwd_op(grun *g, const rule_t *r, const nsa_tensor *q_t, const nsa_tensor *k_t, const nsa_tensor *v_t,
                     const nsa_tensor *o_t, const nsa_tensor *lse_t, const nsa_tensor *dout_t, int64_t KR,
                     const nsa_tensor *dq_t, const nsa_tensor *dk_t, const nsa_tensor *dv_t)
{
    const nsa_problem *p = g->p;
    const dview q = dv_of(q_t), k = dv_of(k_t), v = dv_of(v_t), o = dv_of(o_t), lse = dv_of(lse_t);
    const dview dout = dv_of(dout_t);
    bwd_io io;
    memset(&io, 0, sizeof io);
    io.q = &q, io.k = &k, io.v = &v, io.o = &o, io.lse = &lse, io.dout = &dout, io.dt = q_t->dtype;
    io.KR = KR;
    io.Dw = cu_take_f32(g, nsa_size_elems(p->B, p->T, p->HQ, 1), 0);
    io.dq32 = cu_take_f32(g, nsa_size_elems(p->B, p->T, p->HQ, p->DK), 0); /* zeroed by cu_bwd_range if it adds */
    /* zeroed by cu_bwd_range if it adds */
    io.dk32 = cu_take_f32(g, nsa_size_elems(p->B, KR, p->H, p->DK), 0);
    io.dv32 = cu_take_f32(g, nsa_size_elems(p->B, KR, p->H, p->DV), 0);
    const dview dq = dv_of(dq_t), dk = dv_of(dk_t), dv = dv_of(dv_t);
    io.dq_out = &dq, io.dk_out = &dk, io.dv_out = &dv;
    const int wrote = cu_bwd_range(g, r, &io);
    if (!(wrote & CU_BWD_WROTE_DQ)) nsa_cu_store32(g, io.dq32, &dq, p->B, p->T, p->HQ, p->DK);
    if (!(wrote & CU_BWD_WROTE_DKDV)) {
        nsa_cu_store32(g, io.dk32, &dk, p->B, KR, p->H, p->DK);
        nsa_cu_store32(g, io.dv32, &dv, p->B, KR, p->H, p->DV);
    }
}
