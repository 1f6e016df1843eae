/* attn/host.cu -- host side of the attention tiles shared by the range and selected branches:
 * parameter blocks from the problem, the head-dim class (the one place where run-time dims
 * become template arguments), and the launches of the tiles both branches use. */
#include "tiles.h"
#include "../prim/tmap.h"
#include <limits.h>
#include <stdlib.h>

int cu_dims_class(int64_t DK, int64_t DV)
{
    if (DK <= 64 && DV <= 64) return 64;
    if (DK <= 128 && DV <= 128) return 128;
    if (DK <= 192 && DV <= 128) return 192;
    return 0;
}

static int class_dv(int cls) { return cls == 192 ? 128 : cls; }

int cu_attn_supported(grun *g, nsa_dtype dt)
{
    const nsa_problem *p = g->p;
    if ((dt != NSA_DTYPE_F16 && dt != NSA_DTYPE_BF16) || !cu_dims_class(p->DK, p->DV) || p->T > INT_MAX / 2 ||
        p->H > 65535 || (p->cfg.slc_block > 0 && p->cfg.slc_block > INT_MAX / 4)) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED);
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

void cu_run_qtile(grun *g, const qparams *P, int mode, int64_t tiles, nsa_dtype dt)
{
    const int cls = cu_dims_class(g->p->DK, g->p->DV);
    if (!g_live(g) || tiles == 0) return;
    if (qtile_smem(cls, class_dv(cls), P->nw, mode, P->nst, P->bn) > (size_t)g->smem_max) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED);
        return;
    }
    const int bf16 = dt == NSA_DTYPE_BF16;
    switch (cls) {
    case 64: nsa_cu_qtile_64(g, P, mode, bf16, tiles); break;
    case 128: nsa_cu_qtile_128(g, P, mode, bf16, tiles); break;
    default: nsa_cu_qtile_192(g, P, mode, bf16, tiles); break;
    }
}

void cu_run_ktile(grun *g, const kparams *P, int64_t tiles, nsa_dtype dt)
{
    const int cls = cu_dims_class(g->p->DK, g->p->DV);
    if (!g_live(g) || tiles == 0) return;
    if (ktile_smem(cls, class_dv(cls)) > (size_t)g->smem_max) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED);
        return;
    }
    const int bf16 = dt == NSA_DTYPE_BF16;
    switch (cls) {
    case 64: nsa_cu_ktile_64(g, P, bf16, tiles); break;
    case 128: nsa_cu_ktile_128(g, P, bf16, tiles); break;
    default: nsa_cu_ktile_192(g, P, bf16, tiles); break;
    }
}

/* NSA_CUDA_WGMMA=0 in the environment: never the wgmma paths */
int cu_wgmma_env(void)
{
    static int env = -1;
    if (env < 0) {
        const char *e = getenv("NSA_CUDA_WGMMA");
        env = !(e && e[0] == '0');
    }
    return env;
}

/* whether the loaded binary carries the sm_90a kernels of head-dim class D (asked once) */
int cu_sm90_ready(int D)
{
    static int ready[3] = {-1, -1, -1};
    const int i = D == 64 ? 0 : D == 128 ? 1 : 2;
    if (ready[i] < 0) ready[i] = i == 0 ? nsa_cu_sm90_ready_64() : i == 1 ? nsa_cu_sm90_ready_128() : nsa_cu_sm90_ready_192();
    return ready[i];
}

/* The producer-warp dK / dV tile (kwp_kernel) on a Hopper with the sm_90a kernels, when G
 * divides 64 (a 64-row chunk is whole positions: range rules one TMA box per 64 columns,
 * selected rule one box per listed position), DK == DV == 64 / 128, its shared memory fits
 * and the four tensor maps can be made (maps: q, dout, k, v). NSA_CUDA_KWP=0 keeps kwg /
 * ktile (comparisons; kwg's sums are the same bit for bit). */
int cu_kwp_usable(const grun *g, const kparams *K, nsa_dtype dt, int slc, CUtensorMap maps[4])
{
    static int env = -1;
    if (env < 0) {
        const char *e = getenv("NSA_CUDA_KWP");
        env = !(e && e[0] == '0');
    }
    const nsa_problem *p = g->p;
    if (!env || !cu_wgmma_env() || g->cc_major != 9 || p->G > 64 || 64 % p->G) return 0;
    if (K->DK != K->DV || (K->DK != 64 && K->DK != 128) || !cu_sm90_ready(K->DK)) return 0;
    if (kwp_smem(K->DK, slc) > (size_t)g->smem_max) return 0;
    if (!K->dout.al || !K->q.al || !K->k.al || !K->v.al) return 0;
    const int qrows = slc ? 1 : (int)(64 / p->G), krows = slc ? 64 : KWG_BK;
    return tmap_make_h(&maps[0], &K->q, dt, p->B, p->T, p->HQ, K->DK, qrows, (int)p->G) &&
           tmap_make_h(&maps[1], &K->dout, dt, p->B, p->T, p->HQ, K->DV, qrows, (int)p->G) &&
           tmap_make(&maps[2], &K->k, dt, p->B, K->KR, p->H, K->DK, krows) &&
           tmap_make(&maps[3], &K->v, dt, p->B, K->KR, p->H, K->DV, krows);
}

/* launch kwp_kernel (kwp_usable said yes and made the maps) */
void cu_run_kwp(grun *g, const kparams *K, nsa_dtype dt, int slc, int64_t tiles, const CUtensorMap maps[4])
{
    if (!g_live(g) || tiles == 0) return;
    if (K->DK == 64) nsa_cu_kwp_64(g, K, dt == NSA_DTYPE_BF16, slc, tiles, maps);
    else nsa_cu_kwp_128(g, K, dt == NSA_DTYPE_BF16, slc, tiles, maps);
}
