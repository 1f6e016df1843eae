/* selection/launch.cu -- host driver of the selection: sm_90a swg_kernel or select_kernel,
 * their pass sizes and task maps. */
#include "selection.h"
#include "../attn/tiles.h"
#include "../prim/tmap.h"
#include <limits.h>
#include <string.h>

/* Selection blocks per pass whose overlapping compressed keys fit in nk (0: not even one). */
static int select_jc(const nsa_config *c, int nk, int cap)
{
    for (int jc = cap; jc >= 1; jc--)
        if ((jc * c->slc_block + c->cmp_len - 1) / c->cmp_stride + 1 <= nk) return jc;
    return 0;
}

/* The sm_90a selection (hopper.cuh swg_kernel) when the device, the binary, the head dim
 * (exactly 64, 128 or 192), the row alignment and the sizes allow it (a pass's keys fit
 * SWG_NK, n <= 32 for its register lists) and the Q / K tensor maps can be made;
 * NSA_CUDA_WGMMA=0 keeps select_kernel. Returns whether it ran. Never in the dry pass: a
 * sequence map takes the same workspace for any tile height, so select_kernel's sizes the
 * workspace for both. */
static int swg_try(grun *g, sparams *P, nsa_dtype dt)
{
    const nsa_problem *p = g->p;
    const int D = P->DK;
    if (g->dry || !cu_wgmma_env() || g->cc_major != 9 || (D != 64 && D != 128 && D != 192) || !P->q.al || !P->k.al) return 0;
    const int jc = select_jc(&p->cfg, SWG_NK, 64);
    if (jc < 1 || P->n > 32 || P->G > INT_MAX / SWG_BP ||
        swg_smem(D, jc, P->n <= 16 ? 16 : 32, 1, (int)P->G) > (size_t)g->smem_max || !cu_sm90_ready(D))
        return 0;
    CUtensorMap maps[2];
    if (!tmap_make(&maps[0], &P->q, dt, p->B, p->T, p->HQ, D, SWG_BP) ||
        !tmap_make(&maps[1], &P->k, dt, p->B, p->cmp_rows, p->H, D, SWG_NK))
        return 0;
    P->JC = jc;
    unitspec u = {UK_ROWS, 1, SWG_BP, 0, 0};
    int64_t tiles;
    P->sm = g_seqmap(g, u, &tiles);
    if (!g_live(g) || tiles == 0) return 1;
    const int bf16 = dt == NSA_DTYPE_BF16;
    switch (D) {
    case 64: nsa_cu_swg_64(g, P, bf16, tiles, maps); break;
    case 128: nsa_cu_swg_128(g, P, bf16, tiles, maps); break;
    default: nsa_cu_swg_192(g, P, bf16, tiles, maps); break;
    }
    return 1;
}

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
    P.HC = (int)(p->G < 64 ? p->G : 64);
    P.P = 64 / P.HC;
    const int64_t cap = (48 * 1024) / (8 * (c->slc_topk > 0 ? c->slc_topk : 1));
    if (P.P > cap) P.P = (int)cap;
    if (P.P < 1 || c->slc_topk > INT_MAX / 8) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED); /* n > 6144: the per-position lists would not fit */
        return;
    }
    if (swg_try(g, &P, dt)) return;
    /* selection blocks per pass: as many as keep the overlapping compressed keys within 64 */
    P.JC = select_jc(c, 64, 64);
    if (P.JC < 1) P.JC = 1; /* select_kernel walks a pass's keys in chunks of 64 */
    unitspec u = {UK_ROWS, 1, P.P, 0, 0};
    int64_t tiles;
    P.sm = g_seqmap(g, u, &tiles);
    const int cls = cu_dims_class(p->DK, 0);
    if (!g_live(g) || tiles == 0) return;
    if (select_smem(cls, P.P, P.JC, P.n, P.HC) > (size_t)g->smem_max) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED);
        return;
    }
    const int bf16 = dt == NSA_DTYPE_BF16;
    switch (cls) {
    case 64: nsa_cu_select_64(g, &P, bf16, tiles); break;
    case 128: nsa_cu_select_128(g, &P, bf16, tiles); break;
    default: nsa_cu_select_192(g, &P, bf16, tiles); break;
    }
}
