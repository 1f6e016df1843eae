/* branches.cu -- host drivers of the attention branches (see branches.h): fill the kernels'
 * parameter blocks from a validated problem, pick the tile shape, dispatch on the head-dim
 * class (the one place where run-time dims become template arguments). */
#include "branches.h"

#include <cuda.h> /* CUtensorMap: the TMA descriptors of the selected-attention tile */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

void g_init(grun *g, const nsa_context *ctx, const nsa_problem *p, void *ws, int dry)
{
    memset(g, 0, sizeof *g);
    g->st = (cudaStream_t)ctx->stream;
    g->base = (char *)ws;
    g->dry = dry;
    g->err = NSA_STATUS_SUCCESS;
    g->p = p;
    if (!dry) {
        if (cudaSetDevice(ctx->device) != cudaSuccess ||
            cudaDeviceGetAttribute(&g->smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device) != cudaSuccess ||
            cudaDeviceGetAttribute(&g->cc_major, cudaDevAttrComputeCapabilityMajor, ctx->device) != cudaSuccess)
            g->err = NSA_STATUS_DEVICE_ERROR;
    }
}

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

rule_t cu_rule_slc(const nsa_problem *p)
{
    rule_t r;
    memset(&r, 0, sizeof r);
    r.kind = RULE_SLC;
    r.lp = (int)p->cfg.slc_block;
    return r;
}

float *cu_take_f32(grun *g, int64_t n, int zero)
{
    float *x = (float *)g_take(g, (size_t)(n > 0 ? n : 1) * sizeof(float));
    if (zero) g_zero(g, x, (size_t)(n > 0 ? n : 0) * sizeof(float));
    return x;
}

/* ---- dispatch ------------------------------------------------------------------------- */

static void run_qtile(grun *g, const qparams *P, int mode, int64_t tiles, nsa_dtype dt)
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

static void run_ktile(grun *g, const kparams *P, int64_t tiles, nsa_dtype dt)
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

static void qparams_base(qparams *P, const nsa_problem *p, const dview *q)
{
    memset(P, 0, sizeof *P);
    P->q = *q;
    P->T = p->T, P->HQ = p->HQ, P->H = p->H, P->G = p->G;
    P->DK = (int)p->DK, P->DV = (int)p->DV;
    P->scale = p->scale;
    P->sl2 = p->scale * NSA_LOG2E;
}

/* ---- TMA descriptors (the sm_90a tiles of hopper.cuh load K / V chunks through them) -------- */

typedef CUresult (*tmap_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                   const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* cuTensorMapEncodeTiled through the runtime's driver entry point (libnsa links no libcuda);
 * NULL when the driver has none */
static tmap_encode_fn tmap_encoder(void)
{
    static int tried;
    static tmap_encode_fn fn;
    if (!tried) {
        tried = 1;
        void *f = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (tmap_encode_fn)f;
        else
            cudaGetLastError();
    }
    return fn;
}

/* A 4-D map over the [B, rows, H, D] view v (16-bit elements, 16-byte aligned rows and
 * strides: dview.al), boxes of 64 columns x box_heads heads x `box` rows x 1 batch with the
 * 128-byte swizzle (a box lands as box x box_heads rows of 128 bytes, head fastest) (the canonical layout of wgmma.cuh's sw_off); rows past the tensor read as zeros.
 * Returns 0 when it cannot be made (the caller keeps the cp.async tile). */
static int tmap_make_h(CUtensorMap *m, const dview *v, nsa_dtype dt, int64_t B, int64_t rows, int64_t H, int64_t D,
                       int box, int box_heads)
{
    const tmap_encode_fn fn = tmap_encoder();
    if (!fn || !v->al || D % 64 || rows < 1 || B < 1 || H < 1) return 0; /* (no keys: nothing to load) */
    const int64_t s1 = v->s1 * 2, s2 = v->s2 * 2, s0 = B > 1 ? v->s0 * 2 : s1 * rows;
    const cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)H, (cuuint64_t)rows, (cuuint64_t)B};
    const cuuint64_t strides[3] = {(cuuint64_t)s2, (cuuint64_t)s1, (cuuint64_t)s0};
    if (box_heads < 1 || box_heads > H || box < 1 || box > 256 || box_heads > 256) return 0;
    const cuuint32_t boxd[4] = {64, (cuuint32_t)box_heads, (cuuint32_t)box, 1}, es[4] = {1, 1, 1, 1};
    for (int i = 0; i < 3; i++)
        if (strides[i] % 16 || strides[i] >= ((cuuint64_t)1 << 40)) return 0;
    const CUtensorMapDataType t = dt == NSA_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    return fn(m, t, 4, v->p, dims, strides, boxd, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

static int tmap_make(CUtensorMap *m, const dview *v, nsa_dtype dt, int64_t B, int64_t rows, int64_t H, int64_t D, int box)
{
    return tmap_make_h(m, v, dt, B, rows, H, D, box, 1);
}

/* NSA_CUDA_WGMMA=0 in the environment: never the wgmma paths */
static int qwg_env(void)
{
    static int env = -1;
    if (env < 0) {
        const char *e = getenv("NSA_CUDA_WGMMA");
        env = !(e && e[0] == '0');
    }
    return env;
}

/* whether the loaded binary carries the sm_90a kernels of head-dim class D (asked once) */
static int qwg_ready(int D)
{
    static int ready[3] = {-1, -1, -1};
    const int i = D == 64 ? 0 : D == 128 ? 1 : 2;
    if (ready[i] < 0) ready[i] = i == 0 ? nsa_cu_qwg_ready_64() : i == 1 ? nsa_cu_qwg_ready_128() : nsa_cu_qwg_ready_192();
    return ready[i];
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
    if (!qwg_env() || g->cc_major != 9) return 0;
    const int D = qwg_class(P), DV = D == 192 ? 128 : D;
    if (!D || !P->q.al || !P->k.al || (P->v.p && !P->v.al)) return 0;
    if (P->o.p && (!P->o.al || (P->o.dt != (int)dt && P->o.dt != NSA_DTYPE_F32))) return 0;
    if (qwg_smem(D, DV, MODE_DQ) > (size_t)g->smem_max || qwg_smem(D, DV, MODE_FWD) > (size_t)g->smem_max) return 0;
    if (!qwg_ready(D)) return 0;
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

/* ---- forward ---------------------------------------------------------------------------- */

void cu_fwd_range(grun *g, const rule_t *rule, const dview *q, nsa_dtype dt, const dview *k, const dview *v,
                  const dview *o, const dview *lse)
{
    const nsa_problem *p = g->p;
    qparams P;
    qparams_base(&P, p, q);
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
    run_qtile(g, &P, MODE_FWD, tiles, dt);
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
    if (g->dry || !qwg_env() || g->cc_major != 9 || p->DK != p->DV || (D != 64 && D != 128) || p->G < 4) return 0;
    if (mode == MODE_FWD && (!P->o.al || (P->o.dt != (int)dt && P->o.dt != NSA_DTYPE_F32))) return 0;
    int ns, np;
    const int bn = sfw_bn(&ns, &np);
    if (sfw_smem(D, bn, ns) > (size_t)g->smem_max || !qwg_ready(D)) return 0;
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
    run_qtile(g, P, mode, tiles, dt);
}

void cu_fwd_slc(grun *g, const dview *q, nsa_dtype dt, const dview *k, const dview *v, const int32_t *U,
                const int32_t *ucnt, int64_t m, const dview *o, const dview *lse)
{
    const nsa_problem *p = g->p;
    qparams P;
    qparams_base(&P, p, q);
    P.k = *k;
    P.v = *v;
    P.o = *o;
    P.lse = *lse;
    P.rule = cu_rule_slc(p);
    P.U = U, P.ucnt = ucnt, P.m = (int)m;
    run_slc_q(g, &P, MODE_FWD, dt);
}

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
    if (g->dry || !qwg_env() || g->cc_major != 9 || (D != 64 && D != 128 && D != 192) || !P->q.al || !P->k.al) return 0;
    const int jc = select_jc(&p->cfg, SWG_NK, 64);
    if (jc < 1 || P->n > 32 || P->G > INT_MAX / SWG_BP ||
        swg_smem(D, jc, P->n <= 16 ? 16 : 32, 1, (int)P->G) > (size_t)g->smem_max || !qwg_ready(D))
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

/* ---- backward ----------------------------------------------------------------------------- */

static void dq_params(qparams *P, const nsa_problem *p, const bwd_io *io)
{
    qparams_base(P, p, io->q);
    P->k = *io->k;
    P->v = *io->v;
    P->lse = *io->lse;
    P->dout = *io->dout;
    P->Dw = io->Dw;
    P->gw = io->gate ? io->gw : NULL;
    P->dq = io->dq32;
}

/* The producer-warp dK / dV tile (kwp_kernel) on a Hopper with the sm_90a kernels, when G
 * divides 64 (a 64-row chunk is whole positions: range rules one TMA box per 64 columns,
 * selected rule one box per listed position), DK == DV == 64 / 128, its shared memory fits
 * and the four tensor maps can be made (maps: q, dout, k, v). NSA_CUDA_KWP=0 keeps kwg /
 * ktile (comparisons; kwg's sums are the same bit for bit). */
static int kwp_usable(const grun *g, const kparams *K, nsa_dtype dt, int slc, CUtensorMap maps[4])
{
    static int env = -1;
    if (env < 0) {
        const char *e = getenv("NSA_CUDA_KWP");
        env = !(e && e[0] == '0');
    }
    const nsa_problem *p = g->p;
    if (!env || !qwg_env() || g->cc_major != 9 || p->G > 64 || 64 % p->G) return 0;
    if (K->DK != K->DV || (K->DK != 64 && K->DK != 128) || !qwg_ready(K->DK)) return 0;
    if (kwp_smem(K->DK, slc) > (size_t)g->smem_max) return 0;
    if (!K->dout.al || !K->q.al || !K->k.al || !K->v.al) return 0;
    const int qrows = slc ? 1 : (int)(64 / p->G), krows = slc ? 64 : KWG_BK;
    return tmap_make_h(&maps[0], &K->q, dt, p->B, p->T, p->HQ, K->DK, qrows, (int)p->G) &&
           tmap_make_h(&maps[1], &K->dout, dt, p->B, p->T, p->HQ, K->DV, qrows, (int)p->G) &&
           tmap_make(&maps[2], &K->k, dt, p->B, K->KR, p->H, K->DK, krows) &&
           tmap_make(&maps[3], &K->v, dt, p->B, K->KR, p->H, K->DV, krows);
}

/* launch kwp_kernel (kwp_usable said yes and made the maps) */
static void run_kwp(grun *g, const kparams *K, nsa_dtype dt, int slc, int64_t tiles, const CUtensorMap maps[4])
{
    if (!g_live(g) || tiles == 0) return;
    if (K->DK == 64) nsa_cu_kwp_64(g, K, dt == NSA_DTYPE_BF16, slc, tiles, maps);
    else nsa_cu_kwp_128(g, K, dt == NSA_DTYPE_BF16, slc, tiles, maps);
}

static void dkdv_params(kparams *P, const nsa_problem *p, const bwd_io *io)
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

int cu_bwd_range(grun *g, const rule_t *rule, const bwd_io *io)
{
    const nsa_problem *p = g->p;
    if (!io->D_ready) nsa_cu_dprep(g, io->dout, io->o, io->gate, io->Dw, io->gate ? io->gw : NULL, p->B, p->T, p->HQ, p->DV);
    qparams Q;
    dq_params(&Q, p, io);
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
        run_qtile(g, &Q, MODE_DQ, qtiles, io->dt);
    }

    kparams K;
    dkdv_params(&K, p, io);
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
            if (kwp_usable(g, &K, io->dt, 0, maps)) {
                run_kwp(g, &K, io->dt, 0, ktiles, maps);
            } else {
                if (Q.DK == 64) nsa_cu_kwg_64(g, &K, bf16, ktiles);
                else nsa_cu_kwg_128(g, &K, bf16, ktiles);
            }
        }
    } else {
        run_ktile(g, &K, ktiles, io->dt);
    }
    if (K.nseg > 1) {
        unitspec ut = {UK_CMP_TILES, 0, K.bk, p->cfg.cmp_len, p->cfg.cmp_stride};
        int64_t ntiles;
        const seqmap tm = g_seqmap(g, ut, &ntiles);
        nsa_cu_seg_reduce(g, &K, tm, ntiles);
    }
    return direct;
}

void cu_bwd_slc(grun *g, const bwd_io *io, const int32_t *U, const int32_t *ucnt, int64_t m)
{
    const nsa_problem *p = g->p;
    const int64_t lp = p->cfg.slc_block;
    if (!io->D_ready) nsa_cu_dprep(g, io->dout, io->o, io->gate, io->Dw, io->gate ? io->gw : NULL, p->B, p->T, p->HQ, p->DV);
    qparams Q;
    dq_params(&Q, p, io);
    Q.rule = cu_rule_slc(p);
    Q.U = U, Q.ucnt = ucnt, Q.m = (int)m;
    run_slc_q(g, &Q, MODE_DQ, io->dt);

    inv_index ix;
    memset(&ix, 0, sizeof ix);
    nsa_cu_invert(g, U, ucnt, m, lp, &ix);
    kparams K;
    dkdv_params(&K, p, io);
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
    const int kwp = !g->dry && kwp_usable(g, &K, io->dt, 1, maps);
    if (kwp) run_kwp(g, &K, io->dt, 1, ktiles, maps);
    else run_ktile(g, &K, ktiles, io->dt);
    if (ebound > 0) {
        kparams X = K;
        X.extra = 1;
        if (kwp) run_kwp(g, &X, io->dt, 1, ebound * K.nsub, maps);
        else run_ktile(g, &X, ebound * K.nsub, io->dt);
        nsa_cu_slc_reduce(g, &K, ktiles);
    }
}
