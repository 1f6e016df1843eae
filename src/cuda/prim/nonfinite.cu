/* prim/nonfinite.cu -- the call's non-finite flag and the scan that sets it (run.h). */
#include "run.h"
#include "rowwise.cuh"

/* One row per lpr = 2^lsh threads: whether any element of the view is a NaN or an infinity
 * (all exponent bits set: em per 16-bit half, or per 32-bit word for f32), or with nan_only
 * (f32) a NaN. One atomic per warp that finds one. */
template <int ES>
__global__ void nf_scan_kernel(dview t, int64_t n1, int64_t n2, int64_t D, int64_t rows, int vec, int lsh, uint32_t em,
                               int nan_only, int *flag)
{
    const int64_t gt = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, row = gt >> lsh;
    const int lpr = 1 << lsh, sub = (int)(gt & (lpr - 1));
    bool bad = false;
    auto word = [&](uint32_t w) {
        if (ES == 4) return nan_only ? (w & 0x7FFFFFFFu) > 0x7F800000u : (w & em) == em;
        return (w & em) == em || ((w >> 16) & em) == em;
    };
    if (row < rows) {
        int64_t i0, i1, i2;
        split_row(row, n2, n1, rows, &i0, &i1, &i2);
        const unsigned char *base = (const unsigned char *)t.p + (i0 * t.s0 + i1 * t.s1 + i2 * t.s2) * ES;
        if (vec) {
            for (int64_t c = sub; c < D * ES / 16; c += lpr) {
                const uint4 v = *(const uint4 *)(base + c * 16);
                bad |= word(v.x) | word(v.y) | word(v.z) | word(v.w);
            }
        } else {
            for (int64_t d = sub; d < D; d += lpr) {
                const uint32_t w = ES == 4 ? *(const uint32_t *)(base + d * 4) : *(const unsigned short *)(base + d * 2);
                bad |= word(w); /* (a 16-bit element: the high half is 0) */
            }
        }
    }
    if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) atomicOr(flag, 1);
}

int *g_nf(grun *g)
{
    if (!g->nf_taken) {
        g->nf_taken = 1;
        g->nf = (int *)g_take(g, sizeof(int));
        if (g->ovr->nonfinite == 1) { /* always the scalar kernels */
            if (g_live(g)) g_check(g, cudaMemsetAsync(g->nf, 1, sizeof(int), g->st));
        } else {
            g_zero(g, g->nf, sizeof(int));
        }
    }
    return g->nf;
}

const int *g_nf_tiles(grun *g)
{
    int *f = g_nf(g);
    return g->ovr->nonfinite == 0 ? NULL : f;
}

static void cu_scan_values(grun *g, const dview *t, int64_t n0, int64_t n1, int64_t n2, int64_t D, int nan_only)
{
    int *flag = g_nf(g);
    if (!g_live(g) || g->ovr->nonfinite >= 0 || !t->p || n0 <= 0 || n1 <= 0 || n2 <= 0 || D <= 0) return;
    for (int i = 0; i < g->nf_nseen; i++)
        if (g->nf_seen[i] == t->p) return;
    if (g->nf_nseen < (int)(sizeof g->nf_seen / sizeof g->nf_seen[0])) g->nf_seen[g->nf_nseen++] = t->p;
    const int es = (int)nsa_dtype_size((nsa_dtype)t->dt);
    const int vec = t->al && (D * es) % 16 == 0;
    const int64_t units = vec ? D * es / 16 : D;
    int lsh = 0;
    while ((1 << lsh) < 32 && (1 << lsh) < units) lsh++;
    const int64_t rows = n0 * n1 * n2;
    const uint32_t em = t->dt == NSA_DTYPE_F32 ? 0x7F800000u : t->dt == NSA_DTYPE_F16 ? 0x7C00u : 0x7F80u;
    const unsigned grid = grid1(rows << lsh, PREP_THREADS);
    if (es == 4)
        nf_scan_kernel<4><<<grid, PREP_THREADS, 0, g->st>>>(*t, n1, n2, D, rows, vec, lsh, em, nan_only, flag);
    else
        nf_scan_kernel<2><<<grid, PREP_THREADS, 0, g->st>>>(*t, n1, n2, D, rows, vec, lsh, em, 0, flag);
    g_launched(g);
}

void cu_scan_nonfinite(grun *g, const dview *t, int64_t n0, int64_t n1, int64_t n2, int64_t D)
{
    cu_scan_values(g, t, n0, n1, n2, D, 0);
}

void cu_scan_lse(grun *g, const dview *lse, int64_t B, int64_t T, int64_t HQ)
{
    cu_scan_values(g, lse, B, T, HQ, 1, 1);
}
