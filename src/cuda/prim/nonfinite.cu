/* prim/nonfinite.cu -- the call's non-finite flag and the scan that sets it (run.h). */
#include "run.h"
#include "rowwise.cuh"
#include <float.h>
#include <math.h>
#include <string.h>

/* Whether a word of storage holds a value that sends the call to the scalar kernels. lim == 0:
 * a NaN or an infinity (all exponent bits set: em per 16-bit half, or per 32-bit word for f32),
 * or with nan_only (f32: a saved lse) a NaN; lim > 0: a magnitude above lim (float bits: a
 * non-negative float's bits order as its value, and those of an infinity or a NaN lie above every
 * finite one's). two: a word of two 16-bit elements (else the high half is 0). */
template <int ES>
__device__ __forceinline__ bool nf_bad(uint32_t w, bool two, int dt, uint32_t em, uint32_t lim, int nan_only)
{
    if (ES == 4) {
        const uint32_t a = w & 0x7FFFFFFFu;
        return lim ? a > lim : nan_only ? a > 0x7F800000u : (w & em) == em;
    }
    if (!lim) return (w & em) == em || ((w >> 16) & em) == em;
    auto mag = [&](uint32_t h) { /* |a 16-bit element| as f32 bits */
        return dt == NSA_DTYPE_BF16 ? (h << 16) & 0x7FFFFFFFu
                                    : __float_as_uint(fabsf(__half2float(__ushort_as_half((unsigned short)h))));
    };
    return mag(w & 0xFFFFu) > lim || (two && mag(w >> 16) > lim);
}

/* nf_bad over the four words of a 16-byte load */
template <int ES>
__device__ __forceinline__ bool nf_bad4(const uint4 v, int dt, uint32_t em, uint32_t lim, int nan_only)
{
    return nf_bad<ES>(v.x, true, dt, em, lim, nan_only) | nf_bad<ES>(v.y, true, dt, em, lim, nan_only) |
           nf_bad<ES>(v.z, true, dt, em, lim, nan_only) | nf_bad<ES>(v.w, true, dt, em, lim, nan_only);
}

/* A view that covers one contiguous range (its strides a permutation of a dense tensor's): n16
 * 16-byte words from p, four loads in flight a thread; one atomicOr a warp that finds one. */
template <int ES>
__global__ void nf_flat_kernel(const uint4 *p, int64_t n16, int dt, uint32_t em, uint32_t lim, int nan_only, int *flag)
{
    bool bad = false;
    auto take = [&](const uint4 v) { bad |= nf_bad4<ES>(v, dt, em, lim, nan_only); };
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * step < n16; i += 4 * step) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) v[u] = __ldg(p + i + u * step);
#pragma unroll
        for (int u = 0; u < 4; u++) take(v[u]);
    }
    for (; i < n16; i += step) take(__ldg(p + i));
    if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) atomicOr(flag, 1);
}

/* Any other view: one row per lpr = 2^lsh threads, 16-byte loads where the view allows (a grid
 * of every row at once). */
template <int ES>
__global__ void nf_scan_kernel(dview t, int64_t n1, int64_t n2, int64_t D, int64_t rows, int vec, int lsh, uint32_t em,
                               uint32_t lim, int nan_only, int *flag)
{
    const int lpr = 1 << lsh;
    bool bad = false;
    /* (the CTA's first thread steps by the grid: every thread of a CTA makes the same trips) */
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t first = (int64_t)blockIdx.x * blockDim.x; (first >> lsh) < rows; first += step) {
        const int64_t gt = first + threadIdx.x, row = gt >> lsh;
        const int sub = (int)(gt & (lpr - 1));
        if (row >= rows) continue;
        int64_t i0, i1, i2;
        split_row(row, n2, n1, rows, &i0, &i1, &i2);
        const unsigned char *base = (const unsigned char *)t.p + (i0 * t.s0 + i1 * t.s1 + i2 * t.s2) * ES;
        if (vec) {
            for (int64_t c = sub; c < D * ES / 16; c += lpr) {
                bad |= nf_bad4<ES>(*(const uint4 *)(base + c * 16), t.dt, em, lim, nan_only);
            }
        } else {
            for (int64_t d = sub; d < D; d += lpr) {
                const uint32_t w = ES == 4 ? *(const uint32_t *)(base + d * 4) : *(const unsigned short *)(base + d * 2);
                bad |= nf_bad<ES>(w, false, t.dt, em, lim, nan_only);
            }
        }
    }
    if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) atomicOr(flag, 1);
}

/* The launch shape of a row scan over [n0, n1, n2, D]: 16-byte loads when the view allows, and
 * the threads a row (lsh: log2) for one load each, up to a warp. */
static unsigned scan_shape(const dview *t, int64_t n0, int64_t n1, int64_t n2, int64_t D, int *vec, int *lsh, int64_t *rows)
{
    const int es = (int)nsa_dtype_size((nsa_dtype)t->dt);
    *vec = t->al && (D * es) % 16 == 0;
    const int64_t units = *vec ? D * es / 16 : D;
    *lsh = 0;
    while ((1 << *lsh) < 32 && (1 << *lsh) < units) (*lsh)++;
    *rows = n0 * n1 * n2;
    return grid1(*rows << *lsh, PREP_THREADS);
}

/* Whether view t, [n0, n1, n2, D] with unit last stride, covers exactly one contiguous range of
 * n0 n1 n2 D elements (its strides, size-1 dims aside, a permutation of a dense tensor's). */
static int scan_dense(const dview *t, int64_t n0, int64_t n1, int64_t n2, int64_t D)
{
    int64_t n[3] = {n0, n1, n2}, s[3] = {t->s0, t->s1, t->s2}, want = D;
    for (int a = 0; a < 3; a++) /* (three entries: sorted by stride in place) */
        for (int b = a + 1; b < 3; b++)
            if (s[b] < s[a]) {
                const int64_t tn = n[a], ts = s[a];
                n[a] = n[b], s[a] = s[b], n[b] = tn, s[b] = ts;
            }
    for (int a = 0; a < 3; a++) {
        if (n[a] == 1) continue;
        if (s[a] != want) return 0;
        want *= n[a];
    }
    return 1;
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

static void cu_scan_values(grun *g, const dview *t, int64_t n0, int64_t n1, int64_t n2, int64_t D, int nan_only, uint32_t lim)
{
    int *flag = g_nf(g);
    if (!g_live(g) || g->ovr->nonfinite >= 0 || !t->p || n0 <= 0 || n1 <= 0 || n2 <= 0 || D <= 0) return;
    for (int i = 0; i < g->nf_nseen; i++)
        if (g->nf_seen[i] == t->p) return;
    if (g->nf_nseen < (int)(sizeof g->nf_seen / sizeof g->nf_seen[0])) g->nf_seen[g->nf_nseen++] = t->p;
    const int es = (int)nsa_dtype_size((nsa_dtype)t->dt);
    const uint32_t em = t->dt == NSA_DTYPE_F32 ? 0x7F800000u : t->dt == NSA_DTYPE_F16 ? 0x7C00u : 0x7F80u;
    const int64_t bytes = n0 * n1 * n2 * D * es;
    if ((uintptr_t)t->p % 16 == 0 && bytes % 16 == 0 && scan_dense(t, n0, n1, n2, D)) {
        /* enough CTAs to keep each SM's loads in flight; each thread then loops */
        const int64_t n16 = bytes / 16, want = cdiv64(n16, 4 * PREP_THREADS);
        const unsigned grid = (unsigned)(want < 2048 ? want : 2048);
        if (es == 4)
            nf_flat_kernel<4><<<grid, PREP_THREADS, 0, g->st>>>((const uint4 *)t->p, n16, t->dt, em, lim, nan_only, flag);
        else
            nf_flat_kernel<2><<<grid, PREP_THREADS, 0, g->st>>>((const uint4 *)t->p, n16, t->dt, em, lim, nan_only, flag);
        g_launched(g);
        return;
    }
    int vec, lsh;
    int64_t rows;
    const unsigned grid = scan_shape(t, n0, n1, n2, D, &vec, &lsh, &rows);
    if (es == 4)
        nf_scan_kernel<4><<<grid, PREP_THREADS, 0, g->st>>>(*t, n1, n2, D, rows, vec, lsh, em, lim, nan_only, flag);
    else
        nf_scan_kernel<2><<<grid, PREP_THREADS, 0, g->st>>>(*t, n1, n2, D, rows, vec, lsh, em, lim, 0, flag);
    g_launched(g);
}

void cu_scan_nonfinite(grun *g, const dview *t, int64_t n0, int64_t n1, int64_t n2, int64_t D)
{
    cu_scan_values(g, t, n0, n1, n2, D, 0, 0);
}

void cu_scan_lse(grun *g, const dview *lse, int64_t B, int64_t T, int64_t HQ)
{
    cu_scan_values(g, lse, B, T, HQ, 1, 1, 0);
}

void cu_scan_score_operand(grun *g, const dview *t, int64_t n0, int64_t n1, int64_t n2, int64_t D)
{
    const nsa_problem *p = g->p;
    uint32_t lim = 0;
    if (p->flex_rows) {
        /* |q|, |k| <= L with max(scale, 1) DK L^2 <= FLT_MAX / 4: no product, partial sum (the
         * tiles sum before they scale) or score reaches infinity; L rounded down to a float */
        const double bound = sqrt((double)FLT_MAX / 4.0 / (fmax(fabs((double)p->scale), 1.0) * (double)p->DK));
        float L = bound >= (double)FLT_MAX ? FLT_MAX : (float)bound;
        if ((double)L > bound) L = nextafterf(L, 0.0f);
        memcpy(&lim, &L, sizeof lim);
        if (lim == 0) lim = 1; /* (a bound below the smallest float: every nonzero value goes) */
    }
    cu_scan_values(g, t, n0, n1, n2, D, 0, lim);
}
