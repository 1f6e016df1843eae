/* prim/nonfinite.cu -- the call's non-finite flag and the scan that sets it (run.h). */
#include "run.h"
#include "rowwise.cuh"

/* One row per lpr = 2^lsh threads. MAX = false: whether any element is a NaN or an infinity
 * (all exponent bits set: em per 16-bit half, or per 32-bit word for f32), or with nan_only
 * (f32) a NaN; one atomicOr into *flag per warp that finds one (a grid of every row at once).
 * MAX = true: the largest |element| as float bits into *(unsigned *)flag (a non-negative
 * float's bits order as its value; a NaN's lie above +inf's, so a NaN reads as larger than
 * any); a capped grid walks the rows and each CTA makes one atomicMax, and only when it raises
 * the value (one atomic a warp on one address serialised: 100 us for 64 MB). */
template <int ES, bool MAX>
__global__ void nf_scan_kernel(dview t, int64_t n1, int64_t n2, int64_t D, int64_t rows, int vec, int lsh, uint32_t em,
                               int nan_only, int *flag)
{
    const int lpr = 1 << lsh;
    bool bad = false;
    unsigned mx = 0;
    auto word = [&](uint32_t w) {
        if (ES == 4) return nan_only ? (w & 0x7FFFFFFFu) > 0x7F800000u : (w & em) == em;
        return (w & em) == em || ((w >> 16) & em) == em;
    };
    auto half_mag = [&](uint32_t h) { /* |a 16-bit element| as f32 bits */
        return t.dt == NSA_DTYPE_BF16 ? (h << 16) & 0x7FFFFFFFu
                                      : __float_as_uint(fabsf(__half2float(__ushort_as_half((unsigned short)h))));
    };
    auto take = [&](uint32_t w, bool two) { /* two: a word of two 16-bit elements */
        if (!MAX) {
            bad |= word(w);
        } else if (ES == 4) {
            mx = max(mx, w & 0x7FFFFFFFu);
        } else {
            mx = max(mx, half_mag(w & 0xFFFFu));
            if (two) mx = max(mx, half_mag(w >> 16));
        }
    };
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
                const uint4 v = *(const uint4 *)(base + c * 16);
                take(v.x, true), take(v.y, true), take(v.z, true), take(v.w, true);
            }
        } else {
            for (int64_t d = sub; d < D; d += lpr) {
                const uint32_t w = ES == 4 ? *(const uint32_t *)(base + d * 4) : *(const unsigned short *)(base + d * 2);
                take(w, false); /* (a 16-bit element: the high half is 0) */
            }
        }
    }
    if (MAX) {
        __shared__ unsigned warp_max[32];
        mx = __reduce_max_sync(0xffffffffu, mx);
        if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = mx;
        __syncthreads();
        if (threadIdx.x < 32) {
            mx = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0u;
            mx = __reduce_max_sync(0xffffffffu, mx);
            if (threadIdx.x == 0 && mx > *(volatile unsigned *)flag) atomicMax((unsigned *)flag, mx);
        }
    } else if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) {
        atomicOr(flag, 1);
    }
}

/* The launch shape of a scan over [n0, n1, n2, D]: 16-byte loads when the view allows, and the
 * threads a row (lsh: log2) for one load each, up to a warp. */
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
    int vec, lsh;
    int64_t rows;
    const unsigned grid = scan_shape(t, n0, n1, n2, D, &vec, &lsh, &rows);
    const uint32_t em = t->dt == NSA_DTYPE_F32 ? 0x7F800000u : t->dt == NSA_DTYPE_F16 ? 0x7C00u : 0x7F80u;
    if (es == 4)
        nf_scan_kernel<4, false><<<grid, PREP_THREADS, 0, g->st>>>(*t, n1, n2, D, rows, vec, lsh, em, nan_only, flag);
    else
        nf_scan_kernel<2, false><<<grid, PREP_THREADS, 0, g->st>>>(*t, n1, n2, D, rows, vec, lsh, em, 0, flag);
    g_launched(g);
}

void cu_scan_absmax(grun *g, const dview *t, int64_t n0, int64_t n1, int64_t n2, int64_t D, unsigned *out)
{
    if (!g_live(g) || !t->p || n0 <= 0 || n1 <= 0 || n2 <= 0 || D <= 0) return;
    int vec, lsh;
    int64_t rows;
    unsigned grid = scan_shape(t, n0, n1, n2, D, &vec, &lsh, &rows);
    grid = grid < 1024 ? grid : 1024; /* (the CTAs' atomics: see the kernel) */
    if (nsa_dtype_size((nsa_dtype)t->dt) == 4)
        nf_scan_kernel<4, true><<<grid, PREP_THREADS, 0, g->st>>>(*t, n1, n2, D, rows, vec, lsh, 0, 0, (int *)out);
    else
        nf_scan_kernel<2, true><<<grid, PREP_THREADS, 0, g->st>>>(*t, n1, n2, D, rows, vec, lsh, 0, 0, (int *)out);
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
