/* test_plan.c -- the CUDA planners (src/cuda/plan.h and each room's plan.c) against the kernel
 * choices the backend made before they existed. Each old_* function below transcribes the
 * decision code that used to sit in the launchers (the same conditions in the same order, the
 * environment switches read as strings); every check runs old and new over a grid of
 * devices, head dims, group sizes, dtypes, alignments, overrides and configurations and must
 * find the same kernel and tile parameters. Plain C: runs in the CPU suite, no GPU needed. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include "harness.h"
#include "cuda/plan.h"
#include "cuda/attn/plan.h"
#include "cuda/range/plan.h"
#include "cuda/selected/plan.h"
#include "cuda/selection/plan.h"
#include "cuda/attention/plan.h"

#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

/* ---- the inputs of the old decisions --------------------------------------------------- */

typedef struct old_env {
    const char *wgmma, *kwp, *slc_bn, *slc_np, *slc_rp, *swg_ws; /* NSA_CUDA_* values (NULL: unset) */
} old_env;

typedef struct old_dev {
    int dry, cc, smem, ready; /* ready: the binary's sm_90a kernels (all classes alike) */
} old_dev;

static int env_wgmma(const old_env *e) { return !(e->wgmma && e->wgmma[0] == '0'); }
static int env_kwp(const old_env *e) { return !(e->kwp && e->kwp[0] == '0'); }
static int env_swg_ws(const old_env *e) { return !(e->swg_ws && e->swg_ws[0] == '0'); }

/* sfw_bn of the old selected launcher */
static int old_sfw_bn(const old_env *e, int *ns, int *np)
{
    const char *b = e->slc_bn, *n = e->slc_np;
    const int bn = b && atoi(b) == 64 ? 64 : 32;
    const int st = bn == 32 && b && strchr(b, 'x') && atoi(strchr(b, 'x') + 1) == 3 ? 3 : 2;
    const int two = bn == 32 && st == 2 && !(n && n[0] == '1');
    *ns = st;
    *np = two ? 2 : 1;
    return bn;
}

static int old_qwg_class(int DK, int DV, int has_v)
{
    if (!has_v) DV = DK == 192 ? 128 : DK;
    if ((DK == 64 || DK == 128) && DV == DK) return DK;
    if (DK == 192 && DV == 128) return 192;
    return 0;
}

/* ---- range forward / dQ: qwg_usable and its callers ------------------------------------ */

typedef struct old_range { int wg, rows, nw, nst, bn, qbox, obox; } old_range;

static old_range old_plan_range(const nsa_problem *p, const old_dev *d, const old_env *e, const cu_views *v, int mode,
                                int dt, int maps_ok)
{
    old_range r = {0, 64, 4, 2, 64, 0, 0};
    int ok = !d->dry && (mode != MODE_DQ || v->dout);
    if (ok && (!env_wgmma(e) || d->cc != 9)) ok = 0;
    const int D = old_qwg_class((int)p->DK, (int)p->DV, v->has_v), DV = D == 192 ? 128 : D;
    if (ok && (!D || !v->q || !v->k || (v->has_v && !v->v))) ok = 0;
    if (ok && v->has_o && (!v->o || (v->o_dt != dt && v->o_dt != NSA_DTYPE_F32))) ok = 0;
    if (ok && (qwg_smem(D, DV, MODE_DQ) > (size_t)d->smem || qwg_smem(D, DV, MODE_FWD) > (size_t)d->smem)) ok = 0;
    if (ok && !d->ready) ok = 0;
    if (ok && !maps_ok) ok = 0;
    if (!ok) return r;
    const int64_t G = p->G;
    r.wg = 1;
    r.rows = QWG_BM;
    r.qbox = G <= QWG_BM && QWG_BM % G == 0;
    if (mode == MODE_FWD) r.obox = r.qbox && v->has_o && v->o_dt == dt && G <= 64 && 64 % G == 0;
    return r;
}

/* ---- dK / dV: kwg, kwp_usable ------------------------------------------------------------ */

static int old_kwp_usable(const nsa_problem *p, const old_dev *d, const old_env *e, const cu_views *v, int slc, int maps_ok)
{
    if (!env_kwp(e) || !env_wgmma(e) || d->cc != 9 || p->G > 64 || 64 % p->G) return 0;
    if (p->DK != p->DV || (p->DK != 64 && p->DK != 128) || !d->ready) return 0;
    if (kwp_smem((int)p->DK, slc) > (size_t)d->smem) return 0;
    if (!v->dout || !v->q || !v->k || !v->v) return 0;
    return maps_ok;
}

static cu_dkdv_plan old_plan_dkdv(const nsa_problem *p, const old_dev *d, const old_env *e, const cu_views *v, int slc,
                                  int wg, int maps_ok)
{
    cu_dkdv_plan r = {CU_DKDV_KTILE, 64};
    if (slc) {
        if (!d->dry && old_kwp_usable(p, d, e, v, 1, maps_ok)) r.kernel = CU_DKDV_KWP;
        return r;
    }
    const int kwg = wg && p->DK == p->DV && kwg_smem((int)p->DK) <= (size_t)d->smem;
    r.bk = kwg ? KWG_BK : 64;
    if (kwg) r.kernel = old_kwp_usable(p, d, e, v, 0, maps_ok) ? CU_DKDV_KWP : CU_DKDV_KWG;
    return r;
}

/* ---- selected forward / dQ: sfw_try, run_slc_q ----------------------------------------- */

static cu_slc_plan old_plan_slc(const nsa_problem *p, const old_dev *d, const old_env *e, const cu_views *v, int mode,
                                int dt, int maps_ok)
{
    cu_slc_plan r;
    memset(&r, 0, sizeof r);
    const int D = (int)p->DK;
    int ok = !(d->dry || !env_wgmma(e) || d->cc != 9 || p->DK != p->DV || (D != 64 && D != 128) || p->G < 4);
    if (ok && mode == MODE_FWD && (!v->o || (v->o_dt != dt && v->o_dt != NSA_DTYPE_F32))) ok = 0;
    int ns = 0, np = 0;
    const int bn = old_sfw_bn(e, &ns, &np);
    if (ok && (sfw_smem(D, bn, ns) > (size_t)d->smem || !d->ready)) ok = 0;
    if (ok && !maps_ok) ok = 0;
    if (!ok) {
        r.kernel = CU_SLC_QTILE;
        r.nw = p->G >= 16 ? 1 : 4;
        r.nst = p->G >= 16 ? 1 : 2;
        r.bn = p->G >= 16 ? 32 : 64;
        r.rp = 1, r.ks = 1;
        r.unit_a = p->G, r.unit_b = 16 * r.nw;
        return r;
    }
    if (p->G > 16) np = 1;
    const int rp_env = !(e->slc_rp && e->slc_rp[0] == '1');
    const int uni = rp_env && bn == 32 && ns == 2 && (mode == MODE_DQ ? p->G == 4 || p->G == 8 : p->G == 4);
    r.kernel = CU_SLC_SFW;
    r.rp = uni ? (int)(16 / p->G) : 1;
    r.ks = uni && mode == MODE_FWD ? 2 : 1;
    if (r.rp > 1) np = r.rp;
    r.nw = np;
    r.bn = bn;
    r.nst = ns;
    r.unit_a = (p->G + 15) / 16, r.unit_b = np;
    return r;
}

/* ---- selection: cu_select, swg_try, launch_swg_t ---------------------------------------- */

static int old_select_jc(const nsa_config *c, int nk, int cap)
{
    for (int jc = cap; jc >= 1; jc--)
        if ((jc * c->slc_block + c->cmp_len - 1) / c->cmp_stride + 1 <= nk) return jc;
    return 0;
}

static cu_select_plan old_plan_select(const nsa_problem *p, const old_dev *d, const old_env *e, const cu_views *v,
                                      int maps_ok)
{
    const nsa_config *c = &p->cfg;
    cu_select_plan r;
    memset(&r, 0, sizeof r);
    r.HC = (int)(p->G < 64 ? p->G : 64);
    r.P = 64 / r.HC;
    const int64_t cap = (48 * 1024) / (8 * (c->slc_topk > 0 ? c->slc_topk : 1));
    if (r.P > cap) r.P = (int)cap;
    if (r.P < 1 || c->slc_topk > INT_MAX / 8) {
        r.kernel = CU_SEL_UNSUPPORTED;
        return r;
    }
    const int D = (int)p->DK, n = (int)c->slc_topk;
    int ok = !(d->dry || !env_wgmma(e) || d->cc != 9 || (D != 64 && D != 128 && D != 192) || !v->q || !v->k);
    const int jc = old_select_jc(c, SWG_NK, 64);
    if (ok && (jc < 1 || n > 32 || p->G > INT_MAX / SWG_BP ||
               swg_smem(D, jc, n <= 16 ? 16 : 32, 1, (int)p->G, 0) > (size_t)d->smem || !d->ready))
        ok = 0;
    if (ok && maps_ok) {
        r.kernel = CU_SEL_SWG;
        r.JC = jc;
        const size_t s2 = swg_smem(D, jc, 16, 2, (int)p->G, 0), s1 = swg_smem(D, jc, 16, 1, (int)p->G, 0);
        const int two = 2 * (s2 + 1024) <= 228 * 1024 || (2 * (s1 + 1024) > 228 * 1024 && s2 <= (size_t)d->smem);
        if (n <= 16 && two) r.NR = 16, r.MS = 2;
        else if (n <= 16) r.NR = 16, r.MS = 1;
        else r.NR = 32, r.MS = 1;
        /* the merge's own warpgroup: two lanes a position, two such CTAs an SM */
        r.WS = r.MS == 2 && env_swg_ws(e) && 2 * (swg_smem(D, jc, 16, 2, (int)p->G, 1) + 1024) <= 228 * 1024;
        return r;
    }
    r.kernel = CU_SEL_SELECT;
    r.JC = old_select_jc(c, 64, 64);
    if (r.JC < 1) r.JC = 1;
    return r;
}

/* ---- the grid --------------------------------------------------------------------------- */

typedef struct grid_counts {
    long cases, bad;
    char first[320];
} grid_counts;

static void note(grid_counts *g, int same, const char *what, const nsa_problem *p, const old_dev *d, const old_env *e,
                 int mode, int dt, int maps_ok)
{
    g->cases++;
    if (same || g->bad++) return;
    snprintf(g->first, sizeof g->first,
             "%s differs: G %lld DK %lld DV %lld dt %d mode %d cc %d smem %d ready %d dry %d maps %d wgmma %s kwp %s "
             "slc_bn %s np %s rp %s n %lld",
             what, (long long)p->G, (long long)p->DK, (long long)p->DV, dt, mode, d->cc, d->smem, d->ready, d->dry,
             maps_ok, e->wgmma ? e->wgmma : "-", e->kwp ? e->kwp : "-", e->slc_bn ? e->slc_bn : "-",
             e->slc_np ? e->slc_np : "-", e->slc_rp ? e->slc_rp : "-", (long long)p->cfg.slc_topk);
}

static void set_env(const char *name, const char *value)
{
    if (value) setenv(name, value, 1);
    else unsetenv(name);
}

/* The overrides a context would parse from this environment. */
static cu_overrides overrides_of(const old_env *e)
{
    set_env("NSA_CUDA_WGMMA", e->wgmma);
    set_env("NSA_CUDA_KWP", e->kwp);
    set_env("NSA_CUDA_SLC_BN", e->slc_bn);
    set_env("NSA_CUDA_SLC_NP", e->slc_np);
    set_env("NSA_CUDA_SLC_RP", e->slc_rp);
    set_env("NSA_CUDA_SWG_WS", e->swg_ws);
    cu_overrides o;
    cu_overrides_from_env(&o);
    set_env("NSA_CUDA_WGMMA", NULL), set_env("NSA_CUDA_KWP", NULL), set_env("NSA_CUDA_SLC_BN", NULL);
    set_env("NSA_CUDA_SLC_NP", NULL), set_env("NSA_CUDA_SLC_RP", NULL), set_env("NSA_CUDA_SWG_WS", NULL);
    return o;
}

static cu_device device_of(const old_dev *d)
{
    cu_device c;
    memset(&c, 0, sizeof c);
    if (d->dry) return c;
    c.cc_major = d->cc;
    c.smem_max = d->smem;
    for (int i = 0; i < 3; i++) c.sm90_ready[i] = d->ready;
    return c;
}

static const int G_LIST[] = {1, 2, 3, 4, 5, 8, 12, 16, 32, 64, 128};
static const int DIMS[][2] = {{64, 64}, {128, 128}, {192, 128}, {96, 96}, {64, 32}, {128, 64}, {32, 32}, {192, 192}};
static const old_dev DEVS[] = {{1, 0, 0, 0}, {0, 8, 166912, 0}, {0, 8, 101376, 0}, {0, 9, 232448, 1},
                               {0, 9, 232448, 0}, {0, 9, 101376, 1}, {0, 9, 49152, 1}};
/* the NSA_CUDA_SLC_BN shapes exist only in an EXPERIMENTAL build; elsewhere they are ignored */
static const old_env ENVS[] = {
    {NULL, NULL, NULL, NULL, NULL, NULL}, {"0", NULL, NULL, NULL, NULL, NULL}, {NULL, "0", NULL, NULL, NULL, NULL},
    {NULL, NULL, NULL, "1", NULL, NULL},  {NULL, NULL, NULL, NULL, "1", NULL}, {"1", "1", NULL, "0", "0", NULL},
    {NULL, NULL, NULL, NULL, NULL, "0"},
#if NSA_CUDA_EXPERIMENTAL
    {NULL, NULL, "64", NULL, NULL, NULL}, {NULL, NULL, "32x3", NULL, NULL, NULL}, {NULL, NULL, "32x3", "1", "1", NULL},
#endif
};
#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

static nsa_problem problem(int G, int DK, int DV, int64_t T, int64_t H)
{
    nsa_problem p;
    memset(&p, 0, sizeof p);
    p.B = 1, p.T = T, p.Tk = T, p.H = H, p.G = G, p.HQ = G * H, p.DK = DK, p.DV = DV;
    p.cfg.cmp_len = 32, p.cfg.cmp_stride = 16, p.cfg.slc_block = 64, p.cfg.slc_topk = 16;
    p.cfg.n_init = 1, p.cfg.n_local = 2, p.cfg.window = 512;
    return p;
}

/* views: every alignment pattern the planners look at */
static cu_views views(int pattern, int dt)
{
    cu_views v;
    memset(&v, 0, sizeof v);
    v.q = v.k = v.v = v.o = v.dout = 1;
    v.has_v = v.has_o = 1;
    v.o_dt = dt;
    switch (pattern) {
    case 1: v.q = 0; break;
    case 2: v.o = 0; break;
    case 3: v.o_dt = NSA_DTYPE_F32; break;
    case 4: v.has_o = 0, v.o = 0; break;          /* lse only */
    case 5: v.has_v = 0, v.v = 0, v.has_o = 0, v.o = 0; break; /* scores only: V unread */
    case 6: v.dout = 0; break;
    case 7: v.v = 0; break;
    case 8: v.k = 0; break;
    }
    return v;
}

static void test_plan_range_and_dkdv(void)
{
    grid_counts gr = {0, 0, ""}, gk = {0, 0, ""};
    for (int ei = 0; ei < N_OF(ENVS); ei++) {
        const cu_overrides o = overrides_of(&ENVS[ei]);
        for (int di = 0; di < N_OF(DEVS); di++) {
            const cu_device dev = device_of(&DEVS[di]);
            for (int gi = 0; gi < N_OF(G_LIST); gi++)
                for (int ki = 0; ki < N_OF(DIMS); ki++)
                    for (int dt = NSA_DTYPE_F16; dt <= NSA_DTYPE_BF16; dt++)
                        for (int vp = 0; vp < 9; vp++)
                            for (int mode = MODE_FWD; mode <= MODE_DQ; mode++)
                                for (int maps = 0; maps < 2; maps++) {
                                    const nsa_problem p = problem(G_LIST[gi], DIMS[ki][0], DIMS[ki][1], 4096, 4);
                                    cu_views v = views(vp, dt);
                                    if (mode == MODE_DQ) v.has_o = 0, v.o = 0;
                                    const old_range want = old_plan_range(&p, &DEVS[di], &ENVS[ei], &v, mode, dt, maps);
                                    cu_range_plan got = cu_plan_range(&p, &dev, &o, &v, mode, (nsa_dtype)dt, 0);
                                    if (got.kernel == CU_FWD_QWG && !maps) /* the launcher replans */
                                        got = cu_plan_range(&p, &dev, &o, &v, mode, (nsa_dtype)dt, 1);
                                    const int same = (got.kernel == CU_FWD_QWG) == want.wg && got.rows == want.rows &&
                                                     got.nw == want.nw && got.nst == want.nst && got.bn == want.bn &&
                                                     (!want.wg || (got.qbox == want.qbox && got.obox == want.obox));
                                    note(&gr, same, "range plan", &p, &DEVS[di], &ENVS[ei], mode, dt, maps);
                                    if (mode != MODE_DQ) continue;
                                    for (int slc = 0; slc < 2; slc++) {
                                        const cu_dkdv_plan kw = old_plan_dkdv(&p, &DEVS[di], &ENVS[ei], &v, slc, want.wg, maps);
                                        cu_dkdv_plan kg = cu_plan_dkdv(&p, &dev, &o, &v, slc, want.wg, 0);
                                        if (kg.kernel == CU_DKDV_KWP && !maps) kg = cu_plan_dkdv(&p, &dev, &o, &v, slc, want.wg, 1);
                                        note(&gk, kg.kernel == kw.kernel && kg.bk == kw.bk, slc ? "selected dK/dV plan" : "range dK/dV plan",
                                             &p, &DEVS[di], &ENVS[ei], mode, dt, maps);
                                    }
                                }
        }
    }
    if (g_tests_verbose) printf("  plan: range %ld cases, dK/dV %ld cases\n", gr.cases, gk.cases);
    CHECK_MSG(gr.cases > 10000 && gr.bad == 0, gr.bad ? gr.first : "range plan");
    CHECK_MSG(gk.cases > 10000 && gk.bad == 0, gk.bad ? gk.first : "dK/dV plan");
}

/* The compressed dK / dV's row segments: a power of two from 8 to 128, the most that keeps the
 * batch's tasks (key tiles of 128 of every sequence x segments x kv heads) at 4096 or under and
 * the segments no more than the longest sequence's 64-row chunks, unless 8 already passes a
 * bound; NSA_CUDA_CMP_SEG overrides it. */
static int segments_ok(const nsa_problem *p, int n, const int64_t *lens, int64_t nseq)
{
    int64_t tiles = 0, chunks = 0;
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t T = lens[s], l = p->cfg.cmp_len, dd = p->cfg.cmp_stride;
        const int64_t nc = T >= l ? (T - l) / dd + 1 : 0;
        tiles += (nc + 127) / 128;
        chunks = (T * p->G + 63) / 64 > chunks ? (T * p->G + 63) / 64 : chunks;
    }
    const int pow2 = n >= 8 && n <= 128 && (n & (n - 1)) == 0;
    const int within = n == 8 || (tiles * n * p->H <= 4096 && n <= chunks);
    const int most = n == 128 || 2 * n > chunks || tiles * n * 2 * p->H > 4096;
    return pow2 && within && most;
}

static void test_plan_cmp_segments(void)
{
    grid_counts g = {0, 0, ""};
    static const int64_t TS[] = {0, 1, 31, 32, 100, 1000, 4096, 16384, 65536, 131072, 1 << 20};
    static const int CFG[][2] = {{32, 16}, {64, 64}, {16, 16}, {32, 32}, {64, 32}};
    static const int BS[] = {1, 4, 64};
    cu_overrides o;
    cu_overrides_default(&o);
    for (int ti = 0; ti < N_OF(TS); ti++)
        for (int ci = 0; ci < N_OF(CFG); ci++)
            for (int bi = 0; bi < N_OF(BS); bi++)
                for (int G = 1; G <= 16; G *= 4)
                    for (int64_t H = 1; H <= 64; H *= 2) {
                        nsa_problem p = problem(G, 64, 64, TS[ti], H);
                        p.B = p.num_seqs = BS[bi];
                        p.cfg.cmp_len = CFG[ci][0], p.cfg.cmp_stride = CFG[ci][1];
                        int64_t lens[64];
                        for (int s = 0; s < BS[bi]; s++) lens[s] = TS[ti];
                        const int n = cu_plan_cmp_segments(&p, &o);
                        g.cases++;
                        if (!segments_ok(&p, n, lens, BS[bi]) && g.bad++ == 0)
                            snprintf(g.first, sizeof g.first, "segments %d at T %lld l %d d %d B %d G %d H %lld", n,
                                     (long long)TS[ti], CFG[ci][0], CFG[ci][1], BS[bi], G, (long long)H);
                    }
    CHECK_MSG(g.bad == 0, g.bad ? g.first : "segments");
    /* the paper configuration at 64k: one kv head 128 segments, four 32 */
    nsa_problem p = problem(16, 128, 128, 65536, 1);
    CHECK(cu_plan_cmp_segments(&p, &o) == 128);
    p.H = 4, p.HQ = 64;
    CHECK(cu_plan_cmp_segments(&p, &o) == 32);
    /* a batch counts all its sequences' tiles: 64 sequences of 1k at G 16 are 64 tiles (one
     * sequence would take 128 segments, 256 of them 16) */
    p = problem(16, 128, 128, 1024, 1);
    p.B = p.num_seqs = 64;
    CHECK(cu_plan_cmp_segments(&p, &o) == 64);
    p.B = p.num_seqs = 256;
    CHECK(cu_plan_cmp_segments(&p, &o) == 16);
    p.B = p.num_seqs = 1;
    CHECK(cu_plan_cmp_segments(&p, &o) == 128);
    /* short rows: 1k positions at G 1 are 16 chunks of 64 */
    p = problem(1, 128, 128, 1024, 1);
    CHECK(cu_plan_cmp_segments(&p, &o) == 16);
    /* varlen: the sequences' own lengths (cu_seqlens), not the packed T */
    static const int32_t cu[] = {0, 40000, 65536, 66536};
    const int64_t lens[] = {40000, 25536, 1000};
    p = problem(16, 128, 128, 66536, 1);
    p.num_seqs = 3, p.cu_seqlens = cu;
    const int n = cu_plan_cmp_segments(&p, &o);
    CHECK_MSG(segments_ok(&p, n, lens, 3) && n == 64, "varlen segments");
    p.H = 2;
    CHECK(cu_plan_cmp_segments(&p, &o) == 32);
    o.cmp_seg = 2;
    CHECK(cu_plan_cmp_segments(&p, &o) == 2);
}

/* Window / dense dK / dV segments: causal attention with few kv heads is cut (few tasks of
 * unequal length), a window never (its tasks' rows are the window's whatever the segments),
 * many kv heads never; always a power of two 1..64 within 4096 tasks; NSA_CUDA_RANGE_SEG
 * overrides it. */
/* cu_seg_rows: segments of whole 64-row chunks that cover a sequence's rows, none of them
 * empty but possibly the last ones (as kt_task_get walks them) */
static void test_seg_rows(void)
{
    static const int64_t ALL[] = {1, 63, 64, 65, 1000, 4096, 16384 * 16, 65536 * 16 + 5, (int64_t)1 << 36};
    static const int64_t NSEG[] = {1, 2, 3, 8, 64, 128, 256};
    for (int a = 0; a < N_OF(ALL); a++)
        for (int k = 0; k < N_OF(NSEG); k++) {
            const int64_t all = ALL[a], nseg = NSEG[k], sz = cu_seg_rows(all, nseg);
            CHECK(sz > 0 && sz % 64 == 0);
            CHECK(sz * nseg >= all);              /* the segments cover every row */
            CHECK(sz - 64 < (all + nseg - 1) / nseg); /* and are no larger than a chunk past even shares */
        }
}

/* The range forward's pipelined tile: the window / dense rule with V whose tasks span
 * QWG_PIPE_MIN_CHUNKS chunks (dense causal, windows of 1024 keys and more, 2048 keys or more in
 * the sequence); never the compressed rule, a lse-only pass, short windows or short sequences;
 * the override's 0 and 2 take it nowhere and everywhere V is read. */
static void test_plan_range_pipe(void)
{
    cu_overrides o;
    cu_overrides_default(&o);
    nsa_problem p = problem(16, 128, 128, 65536, 1);
    CHECK(cu_plan_range_pipe(&p, &o, 1, -1, 1) == 1);   /* dense causal */
    CHECK(cu_plan_range_pipe(&p, &o, 1, 1024, 1) == 1); /* a window of 1024 */
    CHECK(cu_plan_range_pipe(&p, &o, 1, 512, 1) == 0);  /* 512: tasks of ~5 chunks */
    CHECK(cu_plan_range_pipe(&p, &o, 0, -1, 1) == 0);   /* the compressed rule */
    CHECK(cu_plan_range_pipe(&p, &o, 1, -1, 0) == 0);   /* no V: the lse pass */
    p.T = p.Tk = 1024;
    CHECK(cu_plan_range_pipe(&p, &o, 1, -1, 1) == 0); /* short sequences */
    p.Tk = 4096; /* the attention op's Tq != Tk: the keys count */
    CHECK(cu_plan_range_pipe(&p, &o, 1, -1, 1) == 1);
    o.range_pipe = 0;
    CHECK(cu_plan_range_pipe(&p, &o, 1, -1, 1) == 0);
    o.range_pipe = 2;
    p.T = p.Tk = 64;
    CHECK(cu_plan_range_pipe(&p, &o, 0, 7, 1) == 1);
    CHECK(cu_plan_range_pipe(&p, &o, 0, 7, 0) == 0);
}

static void test_plan_range_segments(void)
{
    test_seg_rows();
    cu_overrides o;
    cu_overrides_default(&o);
    /* causal (wl -1, wr 0), G 16, one kv head: 128 tasks at 16k (the first sees every row)
     * 2 segments (192 tasks with rows), 64 at 8k 8, 32 at 4k 16; two or four kv heads at 16k,
     * and any at 64k: 256 tasks or more, none; G 1 with 16 kv heads: none (measured on an
     * H200: 11.2 -> 7.0 ms at 16k, 5.1 -> 2.2 at 8k; segments were slower where none are taken) */
    nsa_problem p = problem(16, 128, 128, 16384, 1);
    CHECK(cu_plan_range_segments(&p, -1, 0, 1, 0, -1, &o) == 2);
    p.T = p.Tk = 8192;
    CHECK(cu_plan_range_segments(&p, -1, 0, 1, 0, -1, &o) == 8);
    p.T = p.Tk = 4096;
    CHECK(cu_plan_range_segments(&p, -1, 0, 1, 0, -1, &o) == 16);
    for (int64_t H = 2; H <= 4; H += 2) {
        p = problem(16, 128, 128, 16384, H);
        CHECK(cu_plan_range_segments(&p, -1, 0, 1, 0, -1, &o) == 1);
    }
    for (int64_t H = 1; H <= 4; H++) {
        p = problem(16, 128, 128, 65536, H);
        CHECK(cu_plan_range_segments(&p, -1, 0, 1, 0, -1, &o) == 1);
    }
    p = problem(1, 128, 128, 16384, 16);
    CHECK(cu_plan_range_segments(&p, -1, 0, 1, 0, -1, &o) == 1);
    /* the window of 512 keys: never where the sequence is longer than two windows; always a
     * power of two 1..64, within 4096 tasks and 8 chunks of 64 rows a segment */
    grid_counts g = {0, 0, ""};
    static const int64_t TS[] = {0, 1, 100, 1000, 4096, 16384, 65536, 1 << 20};
    for (int ti = 0; ti < N_OF(TS); ti++)
        for (int G = 1; G <= 16; G *= 4)
            for (int64_t H = 1; H <= 64; H *= 4)
                for (int B = 1; B <= 8; B *= 8) {
                    p = problem(G, 128, 128, TS[ti], H);
                    p.B = p.num_seqs = B;
                    const int nw = cu_plan_range_segments(&p, 511, 0, 1, 0, -1, &o);
                    const int nc = cu_plan_range_segments(&p, -1, 0, 1, 0, -1, &o);
                    const int nf = cu_plan_range_segments(&p, -1, -1, 0, 0, -1, &o);
                    const int64_t tiles = B * ((TS[ti] + 127) / 128);
                    g.cases++;
                    int ok = TS[ti] < 1024 || nw == 1;
                    for (int k = 0; k < 3; k++) {
                        const int n = k == 0 ? nw : k == 1 ? nc : nf;
                        ok = ok && n >= 1 && n <= 64 && (n & (n - 1)) == 0 && (n == 1 || tiles * n * H <= 4096);
                        ok = ok && (n == 1 || n * 512 <= TS[ti] * G);
                    }
                    if (!ok && g.bad++ == 0)
                        snprintf(g.first, sizeof g.first, "segments %d / %d / %d at T %lld G %d H %lld B %d", nw, nc, nf,
                                 (long long)TS[ti], G, (long long)H, B);
                }
    CHECK_MSG(g.bad == 0, g.bad ? g.first : "range segments");
    /* varlen: the sequences' own lengths and tiles (one of 8k and two of 100: at 4 segments the
     * 8k one's 64 tiles make 160 tasks with rows and the short ones' 8 more, 168) */
    static const int32_t cu[] = {0, 8192, 8292, 8392};
    p = problem(16, 128, 128, 8392, 1);
    p.num_seqs = 3, p.cu_seqlens = cu;
    CHECK(cu_plan_range_segments(&p, -1, 0, 1, 0, -1, &o) == 4);
    o.range_seg = 1;
    CHECK(cu_plan_range_segments(&p, -1, 0, 1, 0, -1, &o) == 1);
}

static void test_plan_selected(void)
{
    grid_counts g = {0, 0, ""};
    for (int ei = 0; ei < N_OF(ENVS); ei++) {
        const cu_overrides o = overrides_of(&ENVS[ei]);
        for (int di = 0; di < N_OF(DEVS); di++) {
            const cu_device dev = device_of(&DEVS[di]);
            for (int gi = 0; gi < N_OF(G_LIST); gi++)
                for (int ki = 0; ki < N_OF(DIMS); ki++)
                    for (int dt = NSA_DTYPE_F16; dt <= NSA_DTYPE_BF16; dt++)
                        for (int vp = 0; vp < 9; vp++)
                            for (int mode = MODE_FWD; mode <= MODE_DQ; mode++)
                                for (int maps = 0; maps < 2; maps++) {
                                    const nsa_problem p = problem(G_LIST[gi], DIMS[ki][0], DIMS[ki][1], 4096, 4);
                                    cu_views v = views(vp, dt);
                                    if (mode == MODE_DQ) v.has_o = 0, v.o = 0;
                                    const cu_slc_plan w = old_plan_slc(&p, &DEVS[di], &ENVS[ei], &v, mode, dt, maps);
                                    cu_slc_plan r = cu_plan_slc(&p, &dev, &o, &v, mode, (nsa_dtype)dt, 0);
                                    if (r.kernel == CU_SLC_SFW && !maps) r = cu_plan_slc(&p, &dev, &o, &v, mode, (nsa_dtype)dt, 1);
                                    const int same = r.kernel == w.kernel && r.nw == w.nw && r.nst == w.nst && r.bn == w.bn &&
                                                     r.rp == w.rp && r.ks == w.ks && r.unit_a == w.unit_a &&
                                                     r.unit_b == w.unit_b;
                                    note(&g, same, "selected plan", &p, &DEVS[di], &ENVS[ei], mode, dt, maps);
                                }
        }
    }
    if (g_tests_verbose) printf("  plan: selected %ld cases\n", g.cases);
    CHECK_MSG(g.cases > 10000 && g.bad == 0, g.bad ? g.first : "selected plan");
}

static void test_plan_select(void)
{
    grid_counts g = {0, 0, ""};
    static const int64_t NS[] = {1, 2, 15, 16, 17, 31, 32, 33, 64, 1000, 6144, 6145, 100000};
    static const int CFG[][3] = {{32, 16, 64}, {64, 64, 64}, {16, 16, 64}, {32, 32, 128}, {64, 16, 64}, {128, 64, 128},
                                 {8, 8, 256}};
    for (int ei = 0; ei < N_OF(ENVS); ei++) {
        const cu_overrides o = overrides_of(&ENVS[ei]);
        for (int di = 0; di < N_OF(DEVS); di++) {
            const cu_device dev = device_of(&DEVS[di]);
            for (int gi = 0; gi < N_OF(G_LIST); gi++)
                for (int ki = 0; ki < N_OF(DIMS); ki++)
                    for (int ni = 0; ni < N_OF(NS); ni++)
                        for (int ci = 0; ci < N_OF(CFG); ci++)
                            for (int vp = 0; vp < 2; vp++)
                                for (int maps = 0; maps < 2; maps++) {
                                    nsa_problem p = problem(G_LIST[gi], DIMS[ki][0], DIMS[ki][1], 4096, 4);
                                    p.cfg.slc_topk = NS[ni];
                                    p.cfg.cmp_len = CFG[ci][0], p.cfg.cmp_stride = CFG[ci][1], p.cfg.slc_block = CFG[ci][2];
                                    const cu_views v = views(vp, NSA_DTYPE_BF16);
                                    const cu_select_plan w = old_plan_select(&p, &DEVS[di], &ENVS[ei], &v, maps);
                                    cu_select_plan r = cu_plan_select(&p, &dev, &o, &v, 0);
                                    if (r.kernel == CU_SEL_SWG && !maps) r = cu_plan_select(&p, &dev, &o, &v, 1);
                                    const int same = r.kernel == w.kernel &&
                                                     (w.kernel == CU_SEL_UNSUPPORTED ||
                                                      (r.P == w.P && r.HC == w.HC && r.JC == w.JC && r.NR == w.NR && r.MS == w.MS && r.WS == w.WS));
                                    note(&g, same, "selection plan", &p, &DEVS[di], &ENVS[ei], 0, 0, maps);
                                }
        }
    }
    if (g_tests_verbose) printf("  plan: selection %ld cases\n", g.cases);
    CHECK_MSG(g.cases > 10000 && g.bad == 0, g.bad ? g.first : "selection plan");
}

static void test_plan_attention(void)
{
    grid_counts g = {0, 0, ""};
    for (int ki = 0; ki < N_OF(DIMS); ki++)
        for (int opt = 0; opt < 256; opt++) {
            nsa_problem p = problem(4, DIMS[ki][0], DIMS[ki][1], 1000, 2);
            nsa_attention_args a;
            memset(&a, 0, sizeof a);
            static int32_t dummy[4];
            static const int64_t cu[2] = {0, 1000};
            if (opt & 1) p.cu_seqlens_q = cu;
            if (opt & 2) a.q_segment_ids.data = dummy;
            if (opt & 4) a.bias.data = dummy;
            if (opt & 8) a.mask.data = dummy;
            if (opt & 16) a.dropout_p = 0.25f;
            if (opt & 32) a.softcap = 30.0f;
            if (opt & 64) a.sinks.data = dummy, a.sinks.rank = 1, a.sinks.shape[0] = 4;
            if (opt & 128) p.Tk = 2 * p.T;
            p.extended = p.T != p.Tk || a.softcap != 0.0f || a.sinks.data || a.q_segment_ids.data || a.bias.data ||
                         a.mask.data || a.dropout_p != 0.0f || p.cu_seqlens_q;
            /* the forward's tiles take softcap, sinks and Tq != Tk; the backward's a softcap alone */
            const int cls = cu_dims_class(p.DK, p.DV);
            const int fwd_tiles = cls && !p.cu_seqlens_q && !a.q_segment_ids.data && !a.bias.data && !a.mask.data &&
                                  a.dropout_p == 0.0f;
            const int bwd_tiles = fwd_tiles && !a.sinks.data && p.Tk == p.T;
            note(&g, (cu_plan_attention_fwd(&p, &a) == CU_ATTN_TILES) == fwd_tiles, "attention forward plan", &p,
                 &DEVS[0], &ENVS[0], 0, 0, 1);
            note(&g, (cu_plan_attention_bwd(&p, &a) == CU_ATTN_TILES) == bwd_tiles, "attention backward plan", &p,
                 &DEVS[0], &ENVS[0], 1, 0, 1);
        }
    CHECK_MSG(g.bad == 0, g.bad ? g.first : "attention plan");
}

/* The overrides parsed from the environment, one switch at a time. */
/* An integer override's environment variable: each value parsed into the field at byte offset
 * off of the overrides (want), and unset again the planner's choice (0). */
typedef struct env_int {
    const char *v;
    int want;
} env_int;

static void check_env_int(const char *name, const env_int *c, int n, size_t off)
{
    cu_overrides o;
    for (int i = 0; i < n; i++) {
        set_env(name, c[i].v);
        cu_overrides_from_env(&o);
        CHECK_MSG(*(const int *)((const char *)&o + off) == c[i].want, c[i].v);
    }
    set_env(name, NULL);
    cu_overrides_from_env(&o);
    CHECK_MSG(*(const int *)((const char *)&o + off) == 0, name);
}

static void test_plan_overrides(void)
{
    cu_overrides d;
    cu_overrides_default(&d);
    CHECK(d.wgmma == 1 && d.kwp == 1 && d.slc_bn == 32 && d.slc_stages == 2 && d.slc_pair == 1 && d.slc_union == 1 &&
          d.swg_ws == 1);
    old_env e = {"0", NULL, NULL, NULL, NULL, NULL};
    cu_overrides o = overrides_of(&e);
    CHECK(o.wgmma == 0 && o.kwp == 1 && o.swg_ws == 1);
    e = (old_env){NULL, "0", NULL, "1", "1", "0"};
    o = overrides_of(&e);
    CHECK(o.wgmma == 1 && o.kwp == 0 && o.slc_pair == 0 && o.slc_union == 0 && o.swg_ws == 0);
    e = (old_env){NULL, NULL, "64", NULL, NULL, NULL};
    o = overrides_of(&e);
    CHECK(o.slc_bn == (NSA_CUDA_EXPERIMENTAL ? 64 : 32)); /* the variant's kernels exist only there */
    /* NSA_CUDA_CMP_SEG: a power of two 2..256, anything else leaves the planner's choice */
    static const env_int CMP[] = {{"2", 2}, {"64", 64}, {"256", 256}, {"1", 0}, {"3", 0},
                                  {"512", 0}, {"0", 0}, {"x", 0}, {"-8", 0}};
    check_env_int("NSA_CUDA_CMP_SEG", CMP, N_OF(CMP), offsetof(cu_overrides, cmp_seg));
    /* NSA_CUDA_RANGE_SEG: a power of two 1..128 (1: no segments) */
    static const env_int RANGE[] = {{"1", 1}, {"16", 16}, {"128", 128}, {"3", 0}, {"256", 0}, {"0", 0}, {"x", 0}, {"-4", 0}};
    check_env_int("NSA_CUDA_RANGE_SEG", RANGE, N_OF(RANGE), offsetof(cu_overrides, range_seg));
    CHECK(d.cmp_seg == 0 && d.range_seg == 0);
}

void test_plan_all(void)
{
    test_plan_overrides();
    test_plan_range_and_dkdv();
    test_plan_cmp_segments();
    test_plan_range_segments();
    test_plan_range_pipe();
    test_plan_selected();
    test_plan_select();
    test_plan_attention();
}
