/* compress/compress.cu -- mean pooling and its backward, and the compression op (nsa.h
 * section 1) on the GPU. */
#include "compress.h"
#include "../prim/rowwise.cuh"
#include "../cuda_backend.h"

/* one warp per (b, compressed row, h): lanes over d */
__global__ void compress_kernel(dview x, int64_t D, dview out, seqmap sm, int64_t cmp_rows, int64_t H, int64_t rows)
{
    const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    int64_t h, crow, b;
    split_row(row, H, cmp_rows, rows, &b, &crow, &h);
    int64_t row0 = 0, i = crow;
    if (sm.cu) {
        int64_t lo = 0, hi = sm.nseq - 1;
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (sm.cmp0[mid] <= crow) lo = mid;
            else hi = mid - 1;
        }
        row0 = sm.cu[lo];
        i = crow - sm.cmp0[lo];
    }
    const int64_t base = b * x.s0 + (row0 + i * sm.cd) * x.s1 + h * x.s2;
    const float inv_l = 1.0f / (float)sm.cl;
    for (int64_t d = lane; d < D; d += 32) {
        float sum = 0.0f;
        for (int r = 0; r < sm.cl; r++) sum += ld_any(x.p, x.dt, base + r * x.s1 + d);
        st_any(out.p, out.dt, b * out.s0 + crow * out.s1 + h * out.s2 + d, sum * inv_l);
    }
}

void nsa_cu_compress(grun *g, const dview *x, int64_t D, const dview *out)
{
    const nsa_problem *p = g->p;
    const int64_t rows = p->B * p->cmp_rows * p->H;
    if (!g_live(g) || rows == 0 || D == 0) return;
    compress_kernel<<<grid1(rows * 32, PREP_THREADS), PREP_THREADS, 0, g->st>>>(
        *x, D, *out, g_plain_map(g), p->cmp_rows, p->H, rows);
    g_launched(g);
}

/* one warp per (b, t, h) row of dx (T: the key side's rows, Tk) */
__global__ void compress_bwd_kernel(dview src, const float *src32, int64_t D, dview dx, float *dx32, seqmap sm,
                                    int64_t T, int64_t cmp_rows, int64_t H, int64_t rows)
{
    const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    int64_t h, t, b;
    split_row(row, H, T, rows, &b, &t, &h);
    const int64_t s = seq_of_row(sm, b, t);
    const seqinfo sq = seq_get(sm, s);
    const int tl = (int)(t - sq.row0);
    const int ilo = (int)nsa_rule_cmp_first_at(tl, sm.cl, sm.cd); /* the compressed blocks covering token tl */
    int ihi = (int)nsa_rule_cmp_last_at(tl, sm.cd);
    ihi = ihi < sq.ncmp - 1 ? ihi : sq.ncmp - 1;
    const float inv_l = 1.0f / (float)sm.cl;
    for (int64_t d = lane; d < D; d += 32) {
        float sum = 0.0f;
        for (int i = ilo; i <= ihi; i++) {
            const int64_t crow = sq.cmp0 + i;
            const float v = src32 ? src32[((b * cmp_rows + crow) * H + h) * D + d]
                                  : ld_any(src.p, src.dt, b * src.s0 + crow * src.s1 + h * src.s2 + d);
            sum += v * inv_l;
        }
        if (dx32) dx32[row * D + d] += sum;
        else st_any(dx.p, dx.dt, b * dx.s0 + t * dx.s1 + h * dx.s2 + d, sum);
    }
}

void nsa_cu_compress_bwd(grun *g, const dview *src, const float *src32, int64_t D, const dview *dx, float *dx32)
{
    const nsa_problem *p = g->p;
    const int64_t rows = p->B * p->Tk * p->H;
    if (!g_live(g) || rows == 0 || D == 0) return;
    compress_bwd_kernel<<<grid1(rows * 32, PREP_THREADS), PREP_THREADS, 0, g->st>>>(*src, src32, D, *dx, dx32, g_plain_map(g),
                                                                                   p->Tk, p->cmp_rows, p->H, rows);
    g_launched(g);
}

/* ---- the op ---- */

static void run_compress(grun *g, const nsa_compress_args *a)
{
    g_seq_setup(g, 1);
    const dview x = dv_of(&a->x), out = dv_of(&a->x_cmp);
    nsa_cu_compress(g, &x, a->x.shape[3], &out);
}

size_t nsa_cuda_compress_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_args *a)
{
    return cu_op_workspace(ctx, p, run_compress, a);
}

nsa_status nsa_cuda_compress(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_compress, a, ws);
}

static void run_compress_bwd(grun *g, const nsa_compress_bwd_args *a)
{
    g_seq_setup(g, 1);
    const dview src = dv_of(&a->dx_cmp), dx = dv_of(&a->dx);
    nsa_cu_compress_bwd(g, &src, NULL, a->dx.shape[3], &dx, NULL);
}

size_t nsa_cuda_compress_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_bwd_args *a)
{
    return cu_op_workspace(ctx, p, run_compress_bwd, a);
}

nsa_status nsa_cuda_compress_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_compress_bwd_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_compress_bwd, a, ws);
}
