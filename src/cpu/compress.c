/* compress.c -- mean pooling over overlapping blocks (spec 1) on packed fp32 panels:
 * x [B, H, rows, D] -> x_cmp [B, H, cmp_rows, D], block i = rows [i*d, i*d + l). */
#include "common.h"

void compress_panel(const nsa_context *ctx, const nsa_problem *p, const int64_t *cu_cmp, const float *xp,
                    int64_t D, float *xcp)
{
    const int64_t l = p->cfg.cmp_len, d = p->cfg.cmp_stride, pairs = p->num_seqs * p->H;
    const float inv_l = 1.0f / (float)l;
#pragma omp parallel for schedule(dynamic, 1) num_threads(cpu_threads(ctx))
    for (int64_t pair = 0; pair < pairs; pair++) {
        const int64_t s = pair / p->H, h = pair % p->H;
        const cpu_seq sq = cpu_seq_get(p, cu_cmp, s);
        const float *x = xp + ((sq.b * p->H + h) * p->Tk + sq.row0) * D;
        float *xc = xcp + ((sq.b * p->H + h) * p->cmp_rows + sq.cmp_row0) * D;
        for (int64_t i = 0; i < sq.ncmp; i++) {
            float *dst = xc + i * D;
            for (int64_t e = 0; e < D; e++) dst[e] = 0.0f;
            for (int64_t r = i * d; r < i * d + l; r++)
                for (int64_t e = 0; e < D; e++) dst[e] += x[r * D + e];
            for (int64_t e = 0; e < D; e++) dst[e] *= inv_l;
        }
    }
}

void compress_panel_bwd(const nsa_context *ctx, const nsa_problem *p, const int64_t *cu_cmp, const float *dxcp,
                        int64_t D, float *dxp)
{
    const int64_t l = p->cfg.cmp_len, d = p->cfg.cmp_stride, pairs = p->num_seqs * p->H;
    const float inv_l = 1.0f / (float)l;
#pragma omp parallel for schedule(dynamic, 1) num_threads(cpu_threads(ctx))
    for (int64_t pair = 0; pair < pairs; pair++) {
        const int64_t s = pair / p->H, h = pair % p->H;
        const cpu_seq sq = cpu_seq_get(p, cu_cmp, s);
        float *dx = dxp + ((sq.b * p->H + h) * p->Tk + sq.row0) * D;
        const float *dxc = dxcp + ((sq.b * p->H + h) * p->cmp_rows + sq.cmp_row0) * D;
        for (int64_t i = 0; i < sq.ncmp; i++)
            for (int64_t r = i * d; r < i * d + l; r++)
                for (int64_t e = 0; e < D; e++) dx[r * D + e] += dxc[i * D + e] * inv_l;
    }
}
