/* attention/launch.cu -- the attention op (nsa.h section 5) on the GPU: plain calls (causal,
 * windows, scale; softcap, sinks and a dense Tq != Tk in the forward) on the tuned range
 * tiles, everything else on the option-complete kernels (kernels.cuh), whose host driver
 * follows: it fills xparams from a validated call, lays out the sequence tables, and launches
 * forward, dQ (+ dbias), dK / dV and the small dsinks / dbias kernels. */
#include "kernels.cuh"
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include "attention.h"
#include "plan.h"
#include "../range/range.h"
#include "../cuda_backend.h"

static void run_attention(grun *g, const nsa_attention_args *a)
{
    /* float32 storage: every call on the options' scalar kernels (simt.cu) */
    if (a->q.dtype == NSA_DTYPE_F32 || cu_plan_attention_fwd(g->p, a) == CU_ATTN_GENERAL) {
        if (cu_xattn_supported(g, a->q.dtype)) cu_xattn_fwd(g, a);
        return;
    }
    if (!cu_attn_supported(g, a->q.dtype)) return;
    g_seq_setup(g, 0);
    const dview q = dv_of(&a->q), k = dv_of(&a->k), v = dv_of(&a->v), o = dv_of(&a->o), lse = dv_of(&a->lse);
    rule_t r = cu_rule_window(a->window_left, a->window_right, a->causal);
    r.cap = a->softcap;
    r.flex_rows = g->p->flex_rows;
    if (a->sinks.data) r.sinks = (const float *)a->sinks.data, r.sinks_s = a->sinks.stride[0];
    if (g->p->Tk != g->p->T) r.shift = (int)nsa_rule_diag(0, g->p->T, g->p->Tk), r.nk = (int)g->p->Tk;
    cu_fwd_range(g, &r, &q, a->q.dtype, &k, &v, &o, &lse);
}

size_t nsa_cuda_attention_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_args *a)
{
    return cu_op_workspace(ctx, p, run_attention, a);
}

nsa_status nsa_cuda_attention(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_attention, a, ws);
}

static void run_attention_bwd(grun *g, const nsa_attention_bwd_args *a)
{
    const nsa_attention_args *f = &a->fwd;
    if (f->q.dtype == NSA_DTYPE_F32 || cu_plan_attention_bwd(g->p, f) == CU_ATTN_GENERAL) {
        if (cu_xattn_supported(g, f->q.dtype)) cu_xattn_bwd(g, a);
        return;
    }
    if (!cu_attn_supported(g, f->q.dtype)) return;
    g_seq_setup(g, 0);
    rule_t r = cu_rule_window(f->window_left, f->window_right, f->causal);
    r.cap = f->softcap; /* (the tiles' backward takes a softcap alone: the planner) */
    r.flex_rows = g->p->flex_rows;
    cu_range_bwd_op(g, &r, &f->q, &f->k, &f->v, &f->o, &f->lse, &a->dout, g->p->T, &a->dq, &a->dk, &a->dv);
}

size_t nsa_cuda_attention_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_bwd_args *a)
{
    return cu_op_workspace(ctx, p, run_attention_bwd, a);
}

nsa_status nsa_cuda_attention_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_bwd_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_attention_bwd, a, ws);
}

/* ---- host drivers ------------------------------------------------------------------------ */

/* Head-dim class of the option kernels: both dims padded to the same 64 / 128 / 256. */
static int x_class(int64_t DK, int64_t DV)
{
    const int64_t m = DK > DV ? DK : DV;
    return m <= 64 ? 64 : m <= 128 ? 128 : m <= 256 ? 256 : 0;
}

int cu_xattn_supported(grun *g, nsa_dtype dt)
{
    const nsa_problem *p = g->p;
    if (dt != NSA_DTYPE_F16 && dt != NSA_DTYPE_BF16 && dt != NSA_DTYPE_F32) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "q: dtype %s, the CUDA attention takes f16, bf16 or f32", nsa_dtype_name(dt));
        return 0;
    }
    if (!x_class(p->DK, p->DV)) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "q: DK %lld and DV %lld, the CUDA attention takes head dims up to 256",
               (long long)p->DK, (long long)p->DV);
        return 0;
    }
    if (p->T > INT_MAX / 2 || p->Tk > INT_MAX / 2 || p->HQ > 65535 || p->H > 65535 || p->B > 65535) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "q: Tq %lld, Tk %lld, HQ %lld, H %lld or B %lld beyond the CUDA grid "
               "(T, Tk <= %d; HQ, H, B <= 65535)", (long long)p->T, (long long)p->Tk, (long long)p->HQ, (long long)p->H,
               (long long)p->B, INT_MAX / 2);
        return 0;
    }
    return 1;
}

/* A 4-D view whose size-1 dims broadcast (stride 0), so [b, hq, i, j] indexes it directly. */
static pview pv_of(const nsa_tensor *t)
{
    pview v;
    memset(&v, 0, sizeof v);
    if (!t || !t->data) return v;
    v.p = t->data;
    v.dt = (int)t->dtype;
    int64_t s[4] = {0, 0, 0, 0};
    for (int d = 0; d < t->rank && d < 4; d++) s[d] = t->shape[d] == 1 ? 0 : t->stride[d];
    v.s0 = s[0], v.s1 = s[1], v.s2 = s[2], v.s3 = s[3];
    return v;
}

/* Everything of the call but the launch-specific prefix; *nqt / *nkt: query / key tiles over
 * all sequences; *qfirst / *kfirst: their device prefixes (packed calls) or NULL. */
static void x_fill(grun *g, const nsa_attention_args *a, xparams *P, int64_t *nqt, int64_t *nkt,
                   const int64_t **qfirst, const int64_t **kfirst)
{
    const nsa_problem *p = g->p;
    memset(P, 0, sizeof *P);
    P->q = dv_of(&a->q), P->k = dv_of(&a->k), P->v = dv_of(&a->v), P->o = dv_of(&a->o), P->lse = dv_of(&a->lse);
    P->bias = pv_of(&a->bias), P->mask = pv_of(&a->mask);
    P->qseg = pv_of(&a->q_segment_ids), P->kseg = pv_of(&a->k_segment_ids);
    if (a->sinks.data) P->sinks = (const float *)a->sinks.data, P->sinks_s = a->sinks.stride[0];
    P->B = p->B, P->Tq = p->T, P->Tk = p->Tk, P->HQ = p->HQ, P->H = p->H, P->G = p->G;
    P->DK = (int)p->DK, P->DV = (int)p->DV;
    P->scale = p->scale;
    P->cap = a->softcap;
    P->causal = a->causal != 0;
    P->wl = a->window_left;
    P->wr = a->causal ? 0 : a->window_right;
    P->dropout = a->dropout_p > 0.0f;
    P->thresh = nsa_dropout_threshold(a->dropout_p);
    P->rp = 1.0f / (1.0f - a->dropout_p);
    P->seed = a->dropout_seed, P->offset = a->dropout_offset;
    P->which = XW_DV | XW_DK;
    P->flex_rows = p->flex_rows;
    *qfirst = *kfirst = NULL;
    if (!p->cu_seqlens_q && !p->cu_seqlens) {
        P->nseq = p->B;
        *nqt = cdiv64(p->T, XQ_BM), *nkt = cdiv64(p->Tk, XQ_BM);
        return;
    }
    /* packed: cu_q, cu_k, then the query- and key-tile prefixes, one upload */
    const int64_t N = p->num_seqs, n1 = N + 1;
    P->nseq = N;
    const size_t bytes = nsa_size_mul(nsa_size_mul(4, nsa_size_of(n1)), sizeof(int64_t));
    int64_t *dev = (int64_t *)g_take(g, bytes);
    int64_t *host = bytes == SIZE_MAX ? NULL : (int64_t *)malloc(bytes);
    if (!host) {
        g_fail(g, NSA_STATUS_OUT_OF_MEMORY, "varlen_qk: allocating the %zu-byte host table of packed sequences failed", bytes);
        *nqt = *nkt = 0;
        return;
    }
    int64_t *cq = host, *ck = host + n1, *qf = host + 2 * n1, *kf = host + 3 * n1;
    qf[0] = kf[0] = 0;
    for (int64_t s = 0; s <= N; s++) {
        cq[s] = p->cu_seqlens_q ? p->cu_seqlens_q[s] : p->cu_seqlens[s];
        ck[s] = p->cu_seqlens_q ? p->cu_seqlens_k[s] : p->cu_seqlens[s];
        if (s > 0) {
            qf[s] = qf[s - 1] + cdiv64(cq[s] - cq[s - 1], XQ_BM);
            kf[s] = kf[s - 1] + cdiv64(ck[s] - ck[s - 1], XQ_BM);
        }
    }
    *nqt = qf[N], *nkt = kf[N];
    /* pageable memory: the copy is staged before cudaMemcpyAsync returns, so host is free to go */
    if (g_live(g)) g_check(g, cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, g->st));
    free(host);
    P->cuq = dev, P->cuk = dev ? dev + n1 : NULL;
    *qfirst = dev ? dev + 2 * n1 : NULL, *kfirst = dev ? dev + 3 * n1 : NULL;
}

static void x_launch(grun *g, const xparams *P, int kind, const int64_t grid[3], nsa_dtype dt)
{
    const int cls = x_class(P->DK, P->DV), bf16 = dt == NSA_DTYPE_BF16;
    if (!g_live(g)) return;
    if (dt == NSA_DTYPE_F32) { /* the tiles take 16-bit storage */
        nsa_cu_xattn_simt(g, P, kind, NULL);
        return;
    }
    if (xattn_smem(cls, kind, P->mask.p || P->bias.p || P->dropout) > (size_t)g->dev.smem_max) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "device: the attention tile for head dim %d needs %zu bytes of shared memory, "
               "the device has %d", cls, xattn_smem(cls, kind, P->mask.p || P->bias.p || P->dropout), g->dev.smem_max);
        return;
    }
    switch (cls) {
    case 64: nsa_cu_xattn_64(g, P, kind, bf16, grid); break;
    case 128: nsa_cu_xattn_128(g, P, kind, bf16, grid); break;
    default: nsa_cu_xattn_256(g, P, kind, bf16, grid); break;
    }
    if (P->nf) nsa_cu_xattn_simt(g, P, kind, P->nf); /* runs instead when an input is non-finite */
}

void cu_xattn_fwd(grun *g, const nsa_attention_args *a)
{
    const nsa_problem *p = g->p;
    xparams P;
    int64_t nqt, nkt;
    const int64_t *qf, *kf;
    x_fill(g, a, &P, &nqt, &nkt, &qf, &kf);
    cu_scan_nonfinite(g, &P.v, p->B, p->Tk, p->H, p->DV); /* the forward's one B operand */
    P.nf = g_nf_tiles(g);
    P.first = qf;
    const int64_t grid[3] = {nqt, p->HQ, qf ? 1 : p->B};
    x_launch(g, &P, XK_FWD, grid, a->q.dtype);
}

void cu_xattn_bwd(grun *g, const nsa_attention_bwd_args *ba)
{
    const nsa_problem *p = g->p;
    const nsa_attention_args *a = &ba->fwd;
    xparams P;
    int64_t nqt, nkt;
    const int64_t *qf, *kf;
    x_fill(g, a, &P, &nqt, &nkt, &qf, &kf);
    P.dout = dv_of(&ba->dout), P.dq = dv_of(&ba->dq), P.dk = dv_of(&ba->dk), P.dv = dv_of(&ba->dv);
    float *Dw = cu_take_f32(g, nsa_size_elems(p->B, p->T, p->HQ, 1), 0);
    /* with sinks the dQ kernel computes D from its products (and writes it for the others) */
    if (!P.sinks) {
        nsa_cu_dprep(g, &P.dout, &P.o, NULL, Dw, NULL, p->B, p->T, p->HQ, p->DV);
    } else { /* (no D pass to see dout and o) */
        cu_scan_nonfinite(g, &P.dout, p->B, p->T, p->HQ, p->DV);
        cu_scan_nonfinite(g, &P.o, p->B, p->T, p->HQ, p->DV);
    }
    cu_scan_score_operand(g, &P.q, p->B, p->T, p->HQ, p->DK);
    cu_scan_score_operand(g, &P.k, p->B, p->Tk, p->H, p->DK);
    cu_scan_nonfinite(g, &P.v, p->B, p->Tk, p->H, p->DV);
    cu_scan_lse(g, &P.lse, p->B, p->T, p->HQ);
    P.nf = g_nf_tiles(g);
    P.Dw = Dw;
    const int want_db = ba->dbias.data != NULL;
    if (want_db) {
        P.dbB = ba->dbias.shape[0], P.dbH = ba->dbias.shape[1];
        P.dbias = cu_take_f32(g, nsa_size_elems(P.dbB, P.dbH, p->T, p->Tk), 1);
        /* the members sharing a dbias element are summed by one CTA, in order */
        P.loop_b = !qf && P.dbB == 1 && p->B > 1;
        P.loop_h = P.dbH == 1 && p->HQ > 1;
    }
    P.first = qf;
    const int64_t gq[3] = {nqt, P.loop_h ? 1 : p->HQ, (qf || P.loop_b) ? 1 : p->B};
    x_launch(g, &P, XK_DQ, gq, a->q.dtype);

    P.first = kf;
    P.loop_b = P.loop_h = 0;
    const int64_t gk[3] = {nkt, p->H, kf ? 1 : p->B};
    if (x_class(p->DK, p->DV) == 256) { /* dK and dV accumulators do not fit together: two passes */
        P.which = XW_DV;
        x_launch(g, &P, XK_DKV, gk, a->q.dtype);
        P.which = XW_DK;
    }
    x_launch(g, &P, XK_DKV, gk, a->q.dtype);

    if (ba->dsinks.data) nsa_cu_xsinks(g, &P, (float *)ba->dsinks.data, ba->dsinks.stride[0]);
    if (want_db) {
        pview dst;
        memset(&dst, 0, sizeof dst);
        dst.p = ba->dbias.data, dst.dt = (int)ba->dbias.dtype;
        dst.s0 = ba->dbias.stride[0], dst.s1 = ba->dbias.stride[1], dst.s2 = ba->dbias.stride[2], dst.s3 = ba->dbias.stride[3];
        nsa_cu_xdbias_store(g, &P, &dst);
    }
}

/* ---- the small kernels ------------------------------------------------------------------ */

#define XS_THREADS 256

/* one block per query head: each thread sums its rows in order, then a fixed tree */
__global__ void xsinks_kernel(const xparams P, float *dsinks, int64_t ds_stride)
{
    __shared__ float part[XS_THREADS];
    const int64_t hq = blockIdx.x, rows = P.B * P.Tq;
    const float sk = P.sinks[hq * P.sinks_s];
    float acc = 0.0f;
    for (int64_t r = threadIdx.x; r < rows; r += XS_THREADS) {
        const int64_t b = r / P.Tq, t = r % P.Tq;
        const float lse = ((const float *)P.lse.p)[b * P.lse.s0 + t * P.lse.s1 + hq * P.lse.s2];
        /* with a sink lse >= sink; a -inf sink takes no share */
        if (sk != -INFINITY) acc += expf(sk - lse) * P.Dw[r * P.HQ + hq];
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int w = XS_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) dsinks[hq * ds_stride] = -part[0];
}

void nsa_cu_xsinks(grun *g, const xparams *P, float *dsinks, int64_t ds_stride)
{
    if (!g_live(g) || P->HQ == 0) return;
    xsinks_kernel<<<(unsigned)P->HQ, XS_THREADS, 0, g->st>>>(*P, dsinks, ds_stride);
    g_launched(g);
}

__global__ void xdbias_store_kernel(const float *src, pview dst, int64_t H, int64_t Tq, int64_t Tk, int64_t n)
{
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t j = e % Tk, i = (e / Tk) % Tq, hb = (e / (Tk * Tq)) % H, bb = e / (Tk * Tq * H);
        st_any((void *)dst.p, dst.dt, bb * dst.s0 + hb * dst.s1 + i * dst.s2 + j * dst.s3, src[e]);
    }
}

void nsa_cu_xdbias_store(grun *g, const xparams *P, const pview *dst)
{
    const int64_t n = P->dbB * P->dbH * P->Tq * P->Tk;
    if (!g_live(g) || n == 0) return;
    const int64_t blocks = cdiv64(n, XS_THREADS);
    xdbias_store_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), XS_THREADS, 0, g->st>>>(P->dbias, *dst, P->dbH,
                                                                                             P->Tq, P->Tk, n);
    g_launched(g);
}
