/* range/launch.cu -- host drivers of the range branches: the rules, the choice between the
 * sm_90a tiles and the mma.sync ones, the task maps and the launches of forward, dQ and
 * dK / dV. */
#include "range.h"
#include "../prim/tmap.h"
#include <limits.h>
#include <stdlib.h>
#include <string.h>

rule_t cu_rule_window(int64_t wl, int64_t wr, int causal)
{
    rule_t r;
    memset(&r, 0, sizeof r);
    r.kind = RULE_WIN;
    r.nk = -1; /* the sequence's own keys */
    r.wl = wl;
    r.wr = causal ? 0 : wr;
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
    return r;
}

/* The head-dim classes of the wgmma tiles: exactly 64 / 64, 128 / 128 or 192 / 128 (DK / DV;
 * DV only when V is read); 0 for none. */
static int qwg_class(const qparams *P)
{
    const int DK = P->DK, DV = P->v.p ? P->DV : (DK == 192 ? 128 : DK);
    if ((DK == 64 || DK == 128) && DV == DK) return DK;
    if (DK == 192 && DV == 128) return 192;
    return 0;
}
/* The tensor maps of a wgmma tile: K / V chunks (box rows: its chunk of keys), Q's tile
 * (P->qbox), and O's half tiles in the forward (P->obox) or dO's tile in dQ (with qbox),
 * indexed QWG_MAP_K .. QWG_MAP_O. */
typedef struct qwg_maps {
    CUtensorMap m[4];
} qwg_maps;

/* The sm_90a wgmma tile (hopper.cuh) takes a range-rule forward or dQ when the device is a
 * Hopper, the binary carries that kernel, the head dims are exactly 64, 128 or 192 / 128,
 * every row is 16-byte aligned and the K / V tensor maps can be made (into m);
 * NSA_CUDA_WGMMA=0 in the environment keeps the mma.sync tile (for comparisons). Same
 * function either way: the sweep checks both against float64. */
static int qwg_usable(grun *g, qparams *P, nsa_dtype dt, int mode, int64_t KR, qwg_maps *m)
{
    if (!cu_wgmma_env() || g->cc_major != 9) return 0;
    const int D = qwg_class(P), DV = D == 192 ? 128 : D;
    if (!D || !P->q.al || !P->k.al || (P->v.p && !P->v.al)) return 0;
    if (P->o.p && (!P->o.al || (P->o.dt != (int)dt && P->o.dt != NSA_DTYPE_F32))) return 0;
    if (qwg_smem(D, DV, MODE_DQ) > (size_t)g->smem_max || qwg_smem(D, DV, MODE_FWD) > (size_t)g->smem_max) return 0;
    if (!cu_sm90_ready(D)) return 0;
    const nsa_problem *p = g->p;
    const int bn = QWG_BN(mode);
    memset(m, 0, sizeof *m);
    if (!tmap_make(&m->m[QWG_MAP_K], &P->k, dt, p->B, KR, p->H, P->DK, bn)) return 0;
    if (P->v.p && !tmap_make(&m->m[QWG_MAP_V], &P->v, dt, p->B, KR, p->H, P->DV, bn)) return 0;
    /* the forward's Q tile as one box when 128 rows are whole positions, and each warpgroup's
     * 64 rows of O as one when they are (O in q's dtype); otherwise cp.async / plain stores */
    const int64_t G = p->G;
    P->qbox = G <= QWG_BM && QWG_BM % G == 0 &&
              tmap_make_h(&m->m[QWG_MAP_Q], &P->q, dt, p->B, p->T, p->HQ, P->DK, (int)(QWG_BM / G), (int)G);
    if (mode == MODE_DQ) /* dO's tile as Q's (the O map's slot) */
        P->qbox = P->qbox && tmap_make_h(&m->m[QWG_MAP_O], &P->dout, dt, p->B, p->T, p->HQ, P->DV, (int)(QWG_BM / G), (int)G);
    else
        P->obox = P->qbox && P->o.p && P->o.dt == (int)dt && G <= 64 && 64 % G == 0 &&
                  tmap_make_h(&m->m[QWG_MAP_O], &P->o, dt, p->B, p->T, p->HQ, P->DV, (int)(64 / G), (int)G);
    return 1;
}


/* launch the wgmma tile of P's class (qwg_usable said yes and made the maps) */
static void run_qwg(grun *g, const qparams *P, int mode, int64_t tiles, nsa_dtype dt, const qwg_maps *m)
{
    if (!g_live(g) || tiles == 0) return;
    const int bf16 = dt == NSA_DTYPE_BF16;
    switch (qwg_class(P)) {
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
    /* the workspace a map takes does not depend on the tile height, so the dry pass (which
     * cannot ask the device) sizes the wgmma path too */
    qwg_maps maps;
    const int64_t KR = rule->kind == RULE_CMP ? p->cmp_rows : p->Tk; /* key rows (Tk == T but for attention) */
    const int wg = !g->dry && qwg_usable(g, &P, dt, MODE_FWD, KR, &maps);
    P.ctr = (int *)g_take(g, sizeof(int)); /* (both passes: the workspace layout) */
    if (wg) g_zero(g, P.ctr, sizeof(int));
    P.nw = 4;
    P.nst = 2;
    P.bn = 64;
    unitspec u = {UK_ROWS, p->G, wg ? QWG_BM : 16 * P.nw, 0, 0};
    int64_t tiles;
    P.sm = g_seqmap(g, u, &tiles);
    if (wg) {
        run_qwg(g, &P, MODE_FWD, tiles, dt, &maps);
        return;
    }
    cu_run_qtile(g, &P, MODE_FWD, tiles, dt);
}

int cu_bwd_range(grun *g, const rule_t *rule, const bwd_io *io)
{
    const nsa_problem *p = g->p;
    if (!io->D_ready) nsa_cu_dprep(g, io->dout, io->o, io->gate, io->Dw, io->gate ? io->gw : NULL, p->B, p->T, p->HQ, p->DV);
    qparams Q;
    cu_dq_params(&Q, p, io);
    Q.rule = *rule;
    Q.nw = 4;
    Q.nst = 2;
    Q.bn = 64;
    qwg_maps maps;
    const int wg = !g->dry && Q.dout.al && qwg_usable(g, &Q, io->dt, MODE_DQ, io->KR, &maps);
    unitspec uq = {UK_ROWS, p->G, wg ? QWG_BM : 64, 0, 0};
    int64_t qtiles;
    Q.sm = g_seqmap(g, uq, &qtiles);
    /* dq written once, in its own dtype, by the task that owns its rows: no fp32 buffer to
     * zero, add into and convert (2 + 4 + 3 bytes per element of traffic at HQ 64, 64k) */
    const int direct = wg && io->dq_out && io->dq_out->al && (io->dq_out->dt == (int)io->dt || io->dq_out->dt == NSA_DTYPE_F32);
    if (direct) {
        Q.dqo = *io->dq_out;
    } else if (io->dq_out) {
        g_zero(g, io->dq32, (size_t)(p->B * p->T * p->HQ * p->DK) * sizeof(float));
    }
    if (wg) {
        run_qwg(g, &Q, MODE_DQ, qtiles, io->dt, &maps);
    } else {
        cu_run_qtile(g, &Q, MODE_DQ, qtiles, io->dt);
    }

    kparams K;
    cu_dkdv_params(&K, p, io);
    K.rule = *rule;
    /* same tasks at 128 keys, same ordered partials: the wgmma kernel when the dQ above
     * could take its tile */
    const int kwg = wg && Q.DK == Q.DV && kwg_smem(Q.DK) <= (size_t)g->smem_max;
    K.bk = kwg ? KWG_BK : 64;
    unitspec uk = {UK_ROWS, 1, K.bk, 0, 0};
    if (rule->kind == RULE_CMP) {
        /* few key tiles, each seen by most queries: row segments, enough of them for ~1024
         * tasks (8 .. 64 per tile; the same in both passes). Tile t has work only in the
         * segments its queries reach, so with 8 key tiles (fla's l = d = 64 at 64k) and 8
         * segments, 144 tasks of equal size ran in two waves on 132 SMs */
        const unitspec u128 = {UK_CMP_TILES_X, 1, KWG_BK, p->cfg.cmp_len, p->cfg.cmp_stride};
        const int64_t tiles128 = seq_units(u128, p->T); /* key tiles of 128 of the longest sequence */
        K.nseg = 8;
        while (K.nseg < 64 && tiles128 * K.nseg * p->H < 1024) K.nseg *= 2;
        uk.kind = UK_CMP_TILES_X, uk.a = K.nseg, uk.b = K.bk, uk.cl = p->cfg.cmp_len, uk.cd = p->cfg.cmp_stride;
    }
    int64_t ktiles;
    K.sm = g_seqmap(g, uk, &ktiles);
    if (K.nseg > 1) {
        /* sized for the larger of the two tilings in both passes (the dry pass cannot know
         * which kernel the device will run) */
        unitspec u64 = uk, u128 = uk;
        u64.b = 64, u128.b = KWG_BK;
        const int64_t n64 = g_units_total(p, u64) * 64, n128 = g_units_total(p, u128) * KWG_BK;
        K.part = cu_take_f32(g, (n64 > n128 ? n64 : n128) * p->H * (p->DK + p->DV), 0);
    }
    if (kwg) {
        if (g_live(g) && ktiles > 0) {
            const int bf16 = io->dt == NSA_DTYPE_BF16;
            CUtensorMap maps[4];
            if (cu_kwp_usable(g, &K, io->dt, 0, maps)) {
                cu_run_kwp(g, &K, io->dt, 0, ktiles, maps);
            } else {
                if (Q.DK == 64) nsa_cu_kwg_64(g, &K, bf16, ktiles);
                else nsa_cu_kwg_128(g, &K, bf16, ktiles);
            }
        }
    } else {
        cu_run_ktile(g, &K, ktiles, io->dt);
    }
    if (K.nseg > 1) {
        unitspec ut = {UK_CMP_TILES, 0, K.bk, p->cfg.cmp_len, p->cfg.cmp_stride};
        int64_t ntiles;
        const seqmap tm = g_seqmap(g, ut, &ntiles);
        nsa_cu_seg_reduce(g, &K, tm, ntiles);
    }
    return direct;
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
    io.Dw = cu_take_f32(g, p->B * p->T * p->HQ, 0);
    io.dq32 = cu_take_f32(g, p->B * p->T * p->HQ * p->DK, 0); /* zeroed by cu_bwd_range if it adds */
    io.dk32 = cu_take_f32(g, p->B * KR * p->H * p->DK, 1);
    io.dv32 = cu_take_f32(g, p->B * KR * p->H * p->DV, 1);
    const dview dq = dv_of(dq_t), dk = dv_of(dk_t), dv = dv_of(dv_t);
    io.dq_out = &dq;
    if (!cu_bwd_range(g, r, &io)) nsa_cu_store32(g, io.dq32, &dq, p->B, p->T, p->HQ, p->DK);
    nsa_cu_store32(g, io.dk32, &dk, p->B, KR, p->H, p->DK);
    nsa_cu_store32(g, io.dv32, &dv, p->B, KR, p->H, p->DV);
}
