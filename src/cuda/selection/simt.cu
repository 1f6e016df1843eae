/* selection/simt.cu -- the selection (spec section 3) on a scalar kernel: the float32 path,
 * whose storage the tensor-core selection kernels do not take. One warp per (position, kv
 * head): the importance of each candidate block j <= the position's own, from the compressed
 * attention's probabilities p = exp(scale q . k_cmp - lse) summed over the G heads and over the
 * compressed blocks that overlap j (weights nsa_rule_overlap / d), in fp32; lane 0 keeps the
 * top n as it goes (forced blocks first, then larger importance, ties to the lower index, NaN
 * last: nsa_rule_ranks_above), in a list of n entries in shared memory. */
#include "selection.h"
#include "../prim/simt.cuh"

#define SEL_SIMT_WARPS 4

__global__ void __launch_bounds__(32 * SEL_SIMT_WARPS) select_simt_kernel(const sparams P, int64_t B)
{
    extern __shared__ unsigned char sel_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int32_t *kidx = (int32_t *)sel_smem + warp * P.n;                               /* kept blocks, best first */
    float *kimp = (float *)(sel_smem + SEL_SIMT_WARPS * P.n * 4) + warp * P.n;      /* their importance */
    const int64_t rows = B * P.T * P.H, nwarps = (int64_t)gridDim.x * SEL_SIMT_WARPS;
    const float inv_d = 1.0f / (float)P.cd;
    for (int64_t w = (int64_t)blockIdx.x * SEL_SIMT_WARPS + warp; w < rows; w += nwarps) {
        const int64_t h = w % P.H, t = (w / P.H) % P.T, b = w / (P.H * P.T);
        const seqinfo sq = seq_get(P.sm, seq_of_row(P.sm, b, t));
        if (t < sq.row0 || t >= sq.row0 + sq.len) continue;
        const int pos = (int)(t - sq.row0) + sq.shift, cur = (int)nsa_rule_slc_of(pos, P.lp); /* (its position) */
        const int nv = (int)nsa_rule_cmp_visible_cap(pos, P.cl, P.cd, sq.ncmp);
        float kx[SIMT_COLS], qx[SIMT_COLS];
        int kept = 0;
        for (int j = 0; j <= cur; j++) {
            const int i0 = (int)nsa_rule_slc_first_cmp(j, P.cl, P.cd, P.lp);
            int i1 = (int)nsa_rule_slc_last_cmp(j, P.cd, P.lp);
            i1 = i1 < nv - 1 ? i1 : nv - 1;
            float acc = 0.0f;
            for (int i = i0 < 0 ? 0 : i0; i <= i1; i++) {
                simt_load(kx, P.k, b * P.k.s0 + (sq.cmp0 + i) * P.k.s1 + h * P.k.s2, P.DK, lane);
                float ps = 0.0f;
                for (int64_t g = 0; g < P.G; g++) {
                    const int64_t hq = h * P.G + g;
                    const float lse = ((const float *)P.lse.p)[b * P.lse.s0 + t * P.lse.s1 + hq * P.lse.s2];
                    if (lse == -INFINITY) continue; /* the head saw no compressed block: p = 0 */
                    simt_load(qx, P.q, b * P.q.s0 + t * P.q.s1 + hq * P.q.s2, P.DK, lane);
                    ps += exp2f(simt_dot(qx, kx, P.DK, lane) * P.sl2 - lse * NSA_LOG2E);
                }
                acc += ps * (float)nsa_rule_overlap(i, j, P.cl, P.cd, P.lp);
            }
            const float imp = acc * inv_d;
            if (lane == 0) { /* insert j into the ranked list (select_top_n's order) */
                const int fj = nsa_rule_forced(j, cur, P.n_init, P.n_local);
                int at;
                if (kept < P.n) {
                    at = kept++;
                } else {
                    const int wj = kidx[P.n - 1];
                    at = nsa_rule_ranks_above(fj, imp, j, nsa_rule_forced(wj, cur, P.n_init, P.n_local), kimp[P.n - 1], wj)
                             ? P.n - 1
                             : -1;
                }
                while (at > 0) {
                    const int a = kidx[at - 1];
                    if (!nsa_rule_ranks_above(fj, imp, j, nsa_rule_forced(a, cur, P.n_init, P.n_local), kimp[at - 1], a)) break;
                    kidx[at] = kidx[at - 1], kimp[at] = kimp[at - 1];
                    at--;
                }
                if (at >= 0) kidx[at] = j, kimp[at] = imp;
            }
        }
        if (lane == 0) { /* ascending block order, then -1 */
            for (int i = 1; i < kept; i++) {
                const int v = kidx[i];
                int k = i;
                while (k > 0 && kidx[k - 1] > v) kidx[k] = kidx[k - 1], k--;
                kidx[k] = v;
            }
            int32_t *out = (int32_t *)P.idx.p + b * P.idx.s0 + t * P.idx.s1 + h * P.idx.s2;
            for (int i = 0; i < P.n; i++) out[i] = i < kept ? kidx[i] : -1;
            if (P.cnt.p) ((int32_t *)P.cnt.p)[b * P.cnt.s0 + t * P.cnt.s1 + h * P.cnt.s2] = kept;
        }
        __syncwarp();
    }
}

void nsa_cu_select_simt(grun *g, const sparams *P, int64_t B)
{
    const int64_t rows = B * P->T * P->H;
    if (!g_live(g) || rows == 0) return;
    const size_t smem = (size_t)SEL_SIMT_WARPS * P->n * 8;
    if (smem > (size_t)g->dev.smem_max) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "config.slc_topk: %d, the float32 selection on CUDA keeps at most %d blocks",
               P->n, g->dev.smem_max / (SEL_SIMT_WARPS * 8));
        return;
    }
    g_smem_optin(g, (const void *)select_simt_kernel, smem);
    if (!g_live(g)) return;
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        sms <= 0)
        sms = 132;
    const int64_t want = (rows + SEL_SIMT_WARPS - 1) / SEL_SIMT_WARPS, cap = (int64_t)sms * 16;
    select_simt_kernel<<<(unsigned)(want < cap ? want : cap), 32 * SEL_SIMT_WARPS, smem, g->st>>>(*P, B);
    g_launched(g);
}
