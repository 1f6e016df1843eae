/* selected/launch.cu -- host drivers of the selected branch: the choice between the sm_90a
 * TMA tile and qtile's union tiles, the task maps, and the backward's inverted lists and
 * segments. */
#include "selected.h"
#include "../prim/tmap.h"
#include <limits.h>
#include <stdlib.h>
#include <string.h>

static int has(const nsa_tensor *t) { return t->data != NULL; }

rule_t cu_rule_slc(const nsa_problem *p)
{
    rule_t r;
    memset(&r, 0, sizeof r);
    r.kind = RULE_SLC;
    r.lp = (int)p->cfg.slc_block;
    return r;
}

/* G >= 16: one warp (16 rows) per CTA, so a tile never mixes the selections of different
 * positions, single-buffered so that more CTAs fit an SM; smaller G: 64 rows over several
 * positions, keys = the union of their blocks, double-buffered. */
static int slc_warps(const nsa_problem *p) { return p->G >= 16 ? 1 : 4; }
static int slc_stages(const nsa_problem *p) { return p->G >= 16 ? 1 : 2; }
/* keys per chunk: 32 for the one-warp tiles (half the K/V shared memory: 8 instead of 5-6
 * of these latency-bound CTAs per SM), 64 otherwise */
static int slc_chunk(const nsa_problem *p) { return p->G >= 16 ? 32 : 64; }

/* Keys per chunk and stages of the TMA tile: 32 keys in 2 stages (32 KB: six or seven of
 * these one-warp CTAs per SM), unless NSA_CUDA_SLC_BN says "32x3" (three stages, four CTAs)
 * or "64" (64 keys, 2 stages, three CTAs: Triton's shape), for comparisons. H100 64k paper,
 * selected forward: 17.4 / 18.3 / 20.7 ms; 16 keys in 4 stages: 22.6. np: positions per CTA
 * on the default stages, 2 (neighbours sharing their common blocks' stages; forward 17.5 ->
 * 16.1 ms) unless NSA_CUDA_SLC_NP=1. Read once. */
static int sfw_bn(int *ns, int *np)
{
    static int bn, st, two;
    if (!bn) {
        const char *e = getenv("NSA_CUDA_SLC_BN");
        bn = e && atoi(e) == 64 ? 64 : 32;
        st = bn == 32 && e && strchr(e, 'x') && atoi(strchr(e, 'x') + 1) == 3 ? 3 : 2;
        const char *n = getenv("NSA_CUDA_SLC_NP");
        two = bn == 32 && st == 2 && !(n && n[0] == '1');
    }
    *ns = st;
    *np = two ? 2 : 1;
    return bn;
}

/* The TMA selected-attention tile (forward or dQ) for P when the device, the binary, the
 * dims (DK == DV == 64 or 128), the group and the views allow it; launches it and returns 1,
 * else 0 (qtile runs). A tile is 16 heads of one position, padded past G: from G = 4 on
 * that beats qtile's 64-row tiles over the union of 16 / G positions' blocks (64k, G = 4:
 * selected forward 27.4 -> see bench/cuda.md); at G = 1 and 2 the union, which shares each
 * block between positions, moves fewer bytes than one tile per position. */
static int sfw_try(grun *g, qparams *P, int mode, nsa_dtype dt, int64_t KR)
{
    const nsa_problem *p = g->p;
    const int D = (int)p->DK;
    if (g->dry || !cu_wgmma_env() || g->cc_major != 9 || p->DK != p->DV || (D != 64 && D != 128) || p->G < 4) return 0;
    if (mode == MODE_FWD && (!P->o.al || (P->o.dt != (int)dt && P->o.dt != NSA_DTYPE_F32))) return 0;
    int ns, np;
    const int bn = sfw_bn(&ns, &np);
    if (sfw_smem(D, bn, ns) > (size_t)g->smem_max || !cu_sm90_ready(D)) return 0;
    CUtensorMap tk, tv;
    if (!tmap_make(&tk, &P->k, dt, p->B, KR, p->H, D, bn) || !tmap_make(&tv, &P->v, dt, p->B, KR, p->H, D, bn)) return 0;
    if (p->G > 16) np = 1; /* two positions per CTA only when one head group holds G */
    /* Union tiles (hopper.cuh sfw_kernel's RP): one warp's 16 rows are 16 / G neighbouring
     * positions x G heads over the union of their blocks (no padding rows; the forced blocks
     * loaded once for them), unless NSA_CUDA_SLC_RP=1 (for comparisons). H100, 64k, same-call
     * A/Bs: dQ at G = 4 (HQ 16, H 4) 16.5 -> 14.0 ms (L2 bytes 125 -> 113 GB), backward
     * 34.9 -> 32.6; at G = 8 backward 50.3 -> 48.9. The forward at G = 4 with two warps taking
     * alternate chunks (KS = 2: the union's ~55 online-softmax steps in one warp ran 14.9 ->
     * 17.0 ms): selected 15.0 -> 14.3, forward 21.9 -> 21.2 (16k 4.15 -> 3.93); at G = 8 it
     * measured 0.5% slower, and dQ with two warps 2.3 ms slower, so neither is used. */
    static int rp_env = -1;
    if (rp_env < 0) {
        const char *e = getenv("NSA_CUDA_SLC_RP");
        rp_env = !(e && e[0] == '1');
    }
    const int uni = rp_env && bn == 32 && ns == 2 && (mode == MODE_DQ ? p->G == 4 || p->G == 8 : p->G == 4);
    P->rp = uni ? (int)(16 / p->G) : 1;
    P->ks = uni && mode == MODE_FWD ? 2 : 1;
    if (P->rp > 1) np = P->rp;
    P->nw = np;
    P->bn = bn;
    P->nst = ns;
    unitspec u = {UK_ROWS, (p->G + 15) / 16, np, 0, 0}; /* positions x head group */
    int64_t tiles;
    P->sm = g_seqmap(g, u, &tiles);
    if (!g_live(g) || tiles == 0) return 1;
    const int bf16 = dt == NSA_DTYPE_BF16;
    if (D == 64) nsa_cu_sfw_64(g, P, mode, bf16, tiles, &tk, &tv);
    else nsa_cu_sfw_128(g, P, mode, bf16, tiles, &tk, &tv);
    return 1;
}

/* Selected attention forward or dQ (P's U / ucnt lists set): the TMA tile when sfw_try takes
 * it, else qtile's tiles over the union of 16 / G positions' blocks. */
static void run_slc_q(grun *g, qparams *P, int mode, nsa_dtype dt)
{
    const nsa_problem *p = g->p;
    if (sfw_try(g, P, mode, dt, p->T)) return;
    P->nw = slc_warps(p);
    P->nst = slc_stages(p);
    P->bn = slc_chunk(p);
    unitspec u = {UK_ROWS, p->G, 16 * P->nw, 0, 0};
    int64_t tiles;
    P->sm = g_seqmap(g, u, &tiles);
    cu_run_qtile(g, P, mode, tiles, dt);
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
    run_slc_q(g, &P, MODE_FWD, dt);
}

void cu_bwd_slc(grun *g, const bwd_io *io, const int32_t *U, const int32_t *ucnt, int64_t m)
{
    const nsa_problem *p = g->p;
    const int64_t lp = p->cfg.slc_block;
    if (!io->D_ready) nsa_cu_dprep(g, io->dout, io->o, io->gate, io->Dw, io->gate ? io->gw : NULL, p->B, p->T, p->HQ, p->DV);
    qparams Q;
    cu_dq_params(&Q, p, io);
    Q.rule = cu_rule_slc(p);
    Q.U = U, Q.ucnt = ucnt, Q.m = (int)m;
    run_slc_q(g, &Q, MODE_DQ, io->dt);

    inv_index ix;
    memset(&ix, 0, sizeof ix);
    nsa_cu_invert(g, U, ucnt, m, lp, &ix);
    kparams K;
    cu_dkdv_params(&K, p, io);
    K.rule = cu_rule_slc(p);
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
        noffs += seq_units(uo, len);
        ebound += len * m / segp;
    }
    const int64_t nflat = noffs * p->H;
    ebound *= p->H;
    int32_t *xoff = (int32_t *)g_take(g, (size_t)(nflat + 1) * sizeof(int32_t));
    float *part = cu_take_f32(g, ebound * K.nsub * 64 * (p->DK + p->DV), 0);
    nsa_cu_slc_segments(g, &ix, nflat, segp, xoff);
    K.segp = (int)segp, K.xoff = xoff, K.nflat = nflat, K.part = part;
    /* same tasks and partials on either tile */
    CUtensorMap maps[4];
    const int kwp = !g->dry && cu_kwp_usable(g, &K, io->dt, 1, maps);
    if (kwp) cu_run_kwp(g, &K, io->dt, 1, ktiles, maps);
    else cu_run_ktile(g, &K, ktiles, io->dt);
    if (ebound > 0) {
        kparams X = K;
        X.extra = 1;
        if (kwp) cu_run_kwp(g, &X, io->dt, 1, ebound * K.nsub, maps);
        else cu_run_ktile(g, &X, ebound * K.nsub, io->dt);
        nsa_cu_slc_reduce(g, &K, ktiles);
    }
}

void cu_take_usable(grun *g, const nsa_tensor *idx, const nsa_tensor *counts, int32_t **U, int32_t **ucnt)
{
    const nsa_problem *p = g->p;
    const int64_t rows = p->B * p->T * p->H;
    *U = (int32_t *)g_take(g, (size_t)(rows * p->m + 1) * sizeof(int32_t));
    *ucnt = (int32_t *)g_take(g, (size_t)(rows + 1) * sizeof(int32_t));
    const dview iv = dv_of(idx), cv = dv_of(counts);
    nsa_cu_usable(g, &iv, counts && has(counts) ? &cv : NULL, p->m, p->cfg.slc_block, *U, *ucnt);
}
