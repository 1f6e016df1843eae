/* gate/gate.cu -- the gating kernels and the gating op (nsa.h section 6) on the GPU. */
#include "gate.h"
#include "../prim/rowwise.cuh"
#include "../cuda_backend.h"

typedef struct gate3 {
    dview o[3], g[3], d[3], dg[3];
    float *Dw[3], *gw[3]; /* backward: per-row D = g * rowsum(dout * o) and g of each branch */
} gate3;

/* lpr lanes per (b, t, hq) row (a power of two dividing 32); vec: 8 elements per access.
 * Grid-stride over the rows x lpr items: a few CTAs per SM that live through the whole pass
 * beat one short-lived CTA per 256 items (bench/NOTES.md). */
__global__ void gate_kernel(gate3 a, dview o, int64_t T, int64_t HQ, int64_t DV, int64_t rows, int vec, int lpr)
{
    const int64_t total = rows * lpr, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t gt = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; gt < total; gt += stride) {
        const int64_t row = gt / lpr;
        const int sub = (int)(gt & (lpr - 1));
        int64_t hq, t, b;
        split_row(row, HQ, T, rows, &b, &t, &hq);
        float gv[3];
        int64_t ob[3];
        for (int x = 0; x < 3; x++) {
            gv[x] = a.g[x].p ? ld_any(a.g[x].p, a.g[x].dt, b * a.g[x].s0 + t * a.g[x].s1 + hq * a.g[x].s2) : 0.0f;
            ob[x] = b * a.o[x].s0 + t * a.o[x].s1 + hq * a.o[x].s2;
        }
        const int64_t base = b * o.s0 + t * o.s1 + hq * o.s2;
        if (vec) {
            for (int64_t d = 8 * sub; d < DV; d += 8 * lpr) {
                float v[3][8], acc[8];
                for (int x = 0; x < 3; x++)
                    if (a.g[x].p) ld8_any(a.o[x].p, a.o[x].dt, ob[x] + d, v[x]);
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    acc[i] = 0.0f;
                    for (int x = 0; x < 3; x++)
                        if (a.g[x].p) acc[i] += gv[x] * v[x][i];
                }
                st8_any(o.p, o.dt, base + d, acc);
            }
            continue;
        }
        for (int64_t d = sub; d < DV; d += lpr) {
            float acc = 0.0f;
            for (int x = 0; x < 3; x++)
                if (a.g[x].p) acc += gv[x] * ld_any(a.o[x].p, a.o[x].dt, ob[x] + d);
            st_any(o.p, o.dt, base + d, acc);
        }
    }
}

/* ---- the dense form ----------------------------------------------------------------------
 * Every view in one 16-bit dtype and dense in row-major order ([B, T, HQ, DV] at row * DV, a
 * gate or dg at row), DV / 8 a power of two up to 32: a 16-byte chunk's row is its index
 * shifted, and each thread issues all of its loads before the first use, which the general
 * kernels above (a row's strides, lanes per row, branch after branch) do not; these reach
 * about twice their share of the HBM bandwidth (bench/NOTES.md). The sums are the same, in
 * the same order. */
template <typename T> struct gate_dense {
    const T *o[3], *g[3]; /* present branches only (NULL: absent gate) */
    T *out;               /* forward: o */
    const T *dout;        /* backward */
    T *dg[3];             /* backward, each when given */
    float *Dw[3], *gw[3]; /* backward row terms, each when given */
};

/* o = sum of g_x o_x: thread = 16-byte chunk, two chunks a grid-stride step */
template <typename T>
__global__ void gate_dense_kernel(gate_dense<T> a, int64_t chunks, int cshift)
{
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i0 < chunks; i0 += 2 * stride) {
        float v[2][3][8], gv[2][3];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int64_t i = i0 + u * stride;
            if (i >= chunks) continue;
#pragma unroll
            for (int x = 0; x < 3; x++)
                if (a.g[x]) {
                    gv[u][x] = dtraits<T>::to_f(a.g[x][i >> cshift]);
                    ld8_any(a.o[x], dtraits<T>::dt, i * 8, v[u][x]);
                }
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int64_t i = i0 + u * stride;
            if (i >= chunks) continue;
            float acc[8];
#pragma unroll
            for (int e = 0; e < 8; e++) {
                acc[e] = 0.0f;
#pragma unroll
                for (int x = 0; x < 3; x++)
                    if (a.g[x]) acc[e] += gv[u][x] * v[u][x][e];
            }
            st8_any(a.out, dtraits<T>::dt, i * 8, acc);
        }
    }
}

/* dg_x = rowsum(dout o_x), Dw_x = g_x dg_x, gw_x = g_x: lpr = DV / 8 lanes a row, one 16-byte
 * chunk each, dout loaded once for the three branches; whole warps walk the grid (the row
 * sums' shuffles) */
template <typename T>
__global__ void gate_bwd_dense_kernel(gate_dense<T> a, int64_t chunks, int cshift, int *nf)
{
    const int lpr = 1 << cshift, lane = threadIdx.x & 31;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t w0 = (int64_t)blockIdx.x * blockDim.x + (threadIdx.x & ~31); w0 < chunks; w0 += stride) {
        const int64_t i = w0 + lane, row = i >> cshift;
        const bool live = i < chunks;
        float dd[8], ov[3][8], gv[3] = {0.0f, 0.0f, 0.0f};
        if (live) {
            ld8_any(a.dout, dtraits<T>::dt, i * 8, dd);
#pragma unroll
            for (int x = 0; x < 3; x++)
                if (a.g[x] && (a.dg[x] || a.Dw[x])) ld8_any(a.o[x], dtraits<T>::dt, i * 8, ov[x]);
        }
        if (live && (i & (lpr - 1)) == 0)
#pragma unroll
            for (int x = 0; x < 3; x++)
                if (a.g[x]) gv[x] = dtraits<T>::to_f(a.g[x][row]);
#pragma unroll
        for (int x = 0; x < 3; x++) {
            if (!a.g[x]) continue;
            float dot = 0.0f; /* (nothing asked of the branch: its gate alone is checked) */
            if (live && (a.dg[x] || a.Dw[x]))
#pragma unroll
                for (int e = 0; e < 8; e++) dot += dd[e] * ov[x][e];
            dot = group_sum(dot, lpr);
            if (live && (i & (lpr - 1)) == 0) {
                if (a.dg[x]) a.dg[x][row] = dtraits<T>::from_f(dot);
                if (a.Dw[x]) a.Dw[x][row] = gv[x] * dot, a.gw[x][row] = gv[x];
                /* a non-finite element of the row's dout or o_x (or its gate): the call's flag */
                if (nf && !isfinite(gv[x] * dot)) atomicOr(nf, 1);
            }
        }
    }
}

/* log2(DV / 8) when the rows split into a power of two of 16-byte chunks up to 32, else -1 */
static int gate_dense_shift(int64_t DV)
{
    if (DV % 8 || DV / 8 > 32) return -1;
    const int64_t c = DV / 8;
    if (c & (c - 1)) return -1;
    int s = 0;
    while ((1 << s) < c) s++;
    return s;
}

/* Whether the dense form takes these branches: each present gate and its branch output dense
 * in row-major order in dt (a 16-bit dtype: dense_rows_view) */
static int gate_dense_branches(const dview os[3], const dview gs[3], int dt, int64_t B, int64_t T, int64_t HQ, int64_t DV)
{
    for (int x = 0; x < 3; x++)
        if (gs[x].p && !(dense_rows_view(&gs[x], dt, B, T, HQ, 1) && dense_rows_view(&os[x], dt, B, T, HQ, DV))) return 0;
    return 1;
}

template <typename T>
static void launch_gate_dense(grun *g, const dview os[3], const dview gs[3], const dview *o, int64_t chunks, int cs,
                              unsigned grid)
{
    gate_dense<T> d;
    memset(&d, 0, sizeof d);
    for (int x = 0; x < 3; x++)
        if (gs[x].p) d.o[x] = (const T *)os[x].p, d.g[x] = (const T *)gs[x].p;
    d.out = (T *)o->p;
    gate_dense_kernel<T><<<grid, PREP_THREADS, 0, g->st>>>(d, chunks, cs);
    g_launched(g);
}

void nsa_cu_gate(grun *g, const dview os[3], const dview gs[3], const dview *o, int64_t B, int64_t T, int64_t HQ,
                 int64_t DV)
{
    const int64_t rows = B * T * HQ;
    if (!g_live(g) || rows == 0 || DV == 0) return;
    gate3 a;
    memset(&a, 0, sizeof a);
    for (int x = 0; x < 3; x++) a.o[x] = os[x], a.g[x] = gs[x];
    const int cs = gate_dense_shift(DV), dt = o->dt;
    if (cs >= 0 && dense_rows_view(o, dt, B, T, HQ, DV) && gate_dense_branches(os, gs, dt, B, T, HQ, DV)) {
        const int64_t chunks = rows * (DV / 8);
        const unsigned grid = grid_resident((chunks + 1) / 2, PREP_THREADS);
        if (dt == NSA_DTYPE_BF16) launch_gate_dense<__nv_bfloat16>(g, os, gs, o, chunks, cs, grid);
        else launch_gate_dense<__half>(g, os, gs, o, chunks, cs, grid);
        return;
    }
    dview v[4] = {*o};
    for (int x = 0; x < 3; x++) v[x + 1] = gs[x].p ? os[x] : dview();
    const int vec = vec8_ok(v, 4, DV), lpr = row_lanes(vec, DV);
    gate_kernel<<<grid_resident(rows * lpr, PREP_THREADS), PREP_THREADS, 0, g->st>>>(a, *o, T, HQ, DV, rows, vec, lpr);
    g_launched(g);
}

/* lpr lanes per (b, t, hq) row: per present gate, dg = rowsum(dout * o_x) (also the branch's
 * D = g * dg and g for its backward), do_x = g * dout */
__global__ void gate_bwd_kernel(gate3 a, dview dout, int64_t T, int64_t HQ, int64_t DV, int64_t rows, int vec, int lpr,
                                int *nf)
{
    const lane_row lr = lane_row_of(T, HQ, rows, lpr); /* (rows past the end stay for the shuffles) */
    const int64_t row = lr.row, b = lr.b, t = lr.t, hq = lr.hq;
    const int sub = lr.sub;
    const bool live = lr.live;
    const int64_t ob = b * dout.s0 + t * dout.s1 + hq * dout.s2;
    /* branch by branch (dout is re-read from L1 / L2): faster than one pass holding all three
     * branches' state (bench/NOTES.md) */
    for (int x = 0; x < 3; x++) {
        if (!a.g[x].p) continue;
        const float gv = live ? ld_any(a.g[x].p, a.g[x].dt, b * a.g[x].s0 + t * a.g[x].s1 + hq * a.g[x].s2) : 0.0f;
        const int64_t xo = b * a.o[x].s0 + t * a.o[x].s1 + hq * a.o[x].s2, xd = b * a.d[x].s0 + t * a.d[x].s1 + hq * a.d[x].s2;
        const int need_dot = a.dg[x].p || a.Dw[x];
        float dg = 0.0f;
        if (live && vec) {
            for (int64_t d = 8 * sub; d < DV; d += 8 * lpr) {
                float dd[8], ov[8];
                ld8_any(dout.p, dout.dt, ob + d, dd);
                if (need_dot) {
                    ld8_any(a.o[x].p, a.o[x].dt, xo + d, ov);
#pragma unroll
                    for (int i = 0; i < 8; i++) dg += dd[i] * ov[i];
                }
                if (a.d[x].p) {
#pragma unroll
                    for (int i = 0; i < 8; i++) dd[i] *= gv;
                    st8_any(a.d[x].p, a.d[x].dt, xd + d, dd);
                }
            }
        } else if (live) {
            for (int64_t d = sub; d < DV; d += lpr) {
                const float dd = ld_any(dout.p, dout.dt, ob + d);
                if (need_dot) dg += dd * ld_any(a.o[x].p, a.o[x].dt, xo + d);
                if (a.d[x].p) st_any(a.d[x].p, a.d[x].dt, xd + d, gv * dd);
            }
        }
        dg = group_sum(dg, lpr);
        if (live && sub == 0) {
            if (a.dg[x].p) st_any(a.dg[x].p, a.dg[x].dt, b * a.dg[x].s0 + t * a.dg[x].s1 + hq * a.dg[x].s2, dg);
            if (a.Dw[x]) a.Dw[x][row] = gv * dg, a.gw[x][row] = gv;
            /* a non-finite element of the row's dout or o_x (or its gate) makes the sum
             * non-finite (inf * 0 is NaN): the call's non-finite flag (run.h) */
            if (nf && !isfinite(gv * dg)) atomicOr(nf, 1);
        }
    }
}

template <typename T>
static void launch_gate_bwd_dense(grun *g, const gate3 &a, const dview &dout, int64_t chunks, int cs, unsigned grid, int *nf)
{
    gate_dense<T> d;
    memset(&d, 0, sizeof d);
    d.dout = (const T *)dout.p;
    for (int x = 0; x < 3; x++) {
        if (!a.g[x].p) continue;
        d.o[x] = (const T *)a.o[x].p, d.g[x] = (const T *)a.g[x].p;
        d.dg[x] = (T *)a.dg[x].p;
        d.Dw[x] = a.Dw[x], d.gw[x] = a.gw[x];
    }
    gate_bwd_dense_kernel<T><<<grid, PREP_THREADS, 0, g->st>>>(d, chunks, cs, nf);
    g_launched(g);
}

void nsa_cu_gate_bwd(grun *g, const dview *dout, const dview os[3], const dview gs[3], const dview dos[3],
                     const dview dgs[3], float *const Dw[3], float *const gw[3], int64_t B, int64_t T, int64_t HQ,
                     int64_t DV, int *nf)
{
    const int64_t rows = B * T * HQ;
    if (!g_live(g) || rows == 0) return;
    gate3 a;
    memset(&a, 0, sizeof a);
    dview v[7] = {*dout};
    for (int x = 0; x < 3; x++) {
        a.o[x] = os[x], a.g[x] = gs[x];
        if (dos) a.d[x] = dos[x];
        if (dgs) a.dg[x] = dgs[x];
        if (Dw && gs[x].p) a.Dw[x] = Dw[x], a.gw[x] = gw[x];
        if (gs[x].p) v[1 + x] = os[x], v[4 + x] = a.d[x];
    }
    /* the dense form: no do_x to write, every view dense in dout's dtype */
    const int cs = gate_dense_shift(DV), dt = dout->dt;
    int dense = cs >= 0 && dense_rows_view(dout, dt, B, T, HQ, DV) && gate_dense_branches(os, gs, dt, B, T, HQ, DV);
    for (int x = 0; x < 3; x++) {
        if (dos && dos[x].p) dense = 0;
        if (dgs && dgs[x].p && !dense_rows_view(&dgs[x], dt, B, T, HQ, 1)) dense = 0;
    }
    if (dense) {
        const int64_t chunks = rows * (DV / 8);
        const unsigned grid = grid_resident(chunks, PREP_THREADS);
        if (dt == NSA_DTYPE_BF16) launch_gate_bwd_dense<__nv_bfloat16>(g, a, *dout, chunks, cs, grid, nf);
        else launch_gate_bwd_dense<__half>(g, a, *dout, chunks, cs, grid, nf);
        return;
    }
    const int vec = vec8_ok(v, 7, DV), lpr = row_lanes(vec, DV);
    gate_bwd_kernel<<<grid1(rows * lpr, PREP_THREADS), PREP_THREADS, 0, g->st>>>(a, *dout, T, HQ, DV, rows, vec, lpr, nf);
    g_launched(g);
}

/* ---- the op ---- */

static void run_gate(grun *g, const nsa_gate_args *a)
{
    const nsa_problem *p = g->p;
    const dview os[3] = {dv_of(&a->o_cmp), dv_of(&a->o_slc), dv_of(&a->o_swa)};
    const dview gs[3] = {dv_of(&a->g_cmp), dv_of(&a->g_slc), dv_of(&a->g_swa)};
    const dview o = dv_of(&a->o);
    nsa_cu_gate(g, os, gs, &o, p->B, p->T, p->HQ, p->DV);
}

size_t nsa_cuda_gate_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_args *a)
{
    return cu_op_workspace(ctx, p, run_gate, a);
}

nsa_status nsa_cuda_gate(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_gate, a, ws);
}

static void run_gate_bwd(grun *g, const nsa_gate_bwd_args *a)
{
    const nsa_problem *p = g->p;
    const nsa_gate_args *f = &a->fwd;
    const dview os[3] = {dv_of(&f->o_cmp), dv_of(&f->o_slc), dv_of(&f->o_swa)};
    const dview gs[3] = {dv_of(&f->g_cmp), dv_of(&f->g_slc), dv_of(&f->g_swa)};
    const dview dos[3] = {dv_of(&a->do_cmp), dv_of(&a->do_slc), dv_of(&a->do_swa)};
    const dview dgs[3] = {dv_of(&a->dg_cmp), dv_of(&a->dg_slc), dv_of(&a->dg_swa)};
    const dview dout = dv_of(&a->dout);
    nsa_cu_gate_bwd(g, &dout, os, gs, dos, dgs, NULL, NULL, p->B, p->T, p->HQ, p->DV, NULL);
}

size_t nsa_cuda_gate_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_bwd_args *a)
{
    return cu_op_workspace(ctx, p, run_gate_bwd, a);
}

nsa_status nsa_cuda_gate_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_gate_bwd_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_gate_bwd, a, ws);
}
