/* attn/bwd_rows.cu -- the per-row terms of every branch's backward (D = g * rowsum(dout * o),
 * the gate) and the store of fp32 accumulators into the caller's strided outputs. */
#include "tiles.h"
#include "../prim/rowwise.cuh"

/* lpr lanes a row (row_lanes: D 128 in 16-byte loads, 16 lanes, two rows a warp) */
__global__ void dprep_kernel(dview dout, dview o, dview gate, float *Dw, float *gw, int64_t T, int64_t HQ, int64_t DV,
                             int64_t rows, int lpr, int vec, int *nf)
{
    const lane_row lr = lane_row_of(T, HQ, rows, lpr);
    const int64_t row = lr.row, b = lr.b, t = lr.t, hq = lr.hq;
    const int sub = lr.sub;
    const bool live = lr.live;
    const int64_t db = b * dout.s0 + t * dout.s1 + hq * dout.s2, obase = b * o.s0 + t * o.s1 + hq * o.s2;
    float acc = 0.0f;
    int seen = 0; /* o is exactly 0 for a row that saw no key: its D is 0, even from inf dout */
    if (live && vec) {
        for (int64_t d = 8 * sub; d < DV; d += 8 * lpr) {
            float dd[8], ov[8];
            ld8_any(dout.p, dout.dt, db + d, dd);
            ld8_any(o.p, o.dt, obase + d, ov);
#pragma unroll
            for (int i = 0; i < 8; i++) acc += dd[i] * ov[i], seen |= ov[i] != 0.0f;
        }
    } else if (live) {
        for (int64_t d = sub; d < DV; d += lpr) {
            const float ov = ld_any(o.p, o.dt, obase + d);
            acc += ld_any(dout.p, dout.dt, db + d) * ov;
            seen |= ov != 0.0f;
        }
    }
    acc = group_sum(acc, lpr);
    seen = group_sum((float)seen, lpr) != 0.0f;
    if (live && sub == 0) {
        const float gv = gate.p ? ld_any(gate.p, gate.dt, b * gate.s0 + t * gate.s1 + hq * gate.s2) : 1.0f;
        Dw[row] = seen ? gv * acc : 0.0f;
        if (gw) gw[row] = gv;
        /* a non-finite element of the row's dout or o (or its gate) makes the sum non-finite
         * (inf * 0 is NaN): the call's non-finite flag (run.h) */
        if (!isfinite(gv * acc)) atomicOr(nf, 1);
    }
}

void nsa_cu_dprep(grun *g, const dview *dout, const dview *o, const dview *gate, float *Dw, float *gw, int64_t B,
                  int64_t T, int64_t HQ, int64_t DV)
{
    const int64_t rows = B * T * HQ;
    int *nf = g_nf(g);
    if (!g_live(g) || rows == 0) return;
    dview none;
    memset(&none, 0, sizeof none);
    const dview v[2] = {*dout, *o};
    const int vec = vec8_ok(v, 2, DV), lpr = row_lanes(vec, DV);
    dprep_kernel<<<grid1(rows * lpr, PREP_THREADS), PREP_THREADS, 0, g->st>>>(*dout, *o, gate ? *gate : none, Dw, gw, T,
                                                                            HQ, DV, rows, lpr, vec, nf);
    g_launched(g);
}

/* one warp per (b, r, h) row */
__global__ void store32_kernel(const float *src, dview dst, int64_t R, int64_t H, int64_t D, int64_t rows, int vec)
{
    const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    int64_t h, r, b;
    split_row(row, H, R, rows, &b, &r, &h);
    const int64_t base = b * dst.s0 + r * dst.s1 + h * dst.s2;
    if (vec) {
        for (int64_t d = 4 * lane; d < D; d += 128) st4_any(dst.p, dst.dt, base + d, *(const float4 *)(src + row * D + d));
        return;
    }
    for (int64_t d = lane; d < D; d += 32) st_any(dst.p, dst.dt, base + d, src[row * D + d]);
}

/* The same where dst is dense in row-major [B, R, H, D] order in a 16-bit dtype (its rows then
 * follow src's one for one): thread = 8 elements, two float4 loads and one 16-byte store, two
 * such items a grid-stride step with their loads issued first, no row arithmetic. */
template <typename T>
__global__ void store32_dense_kernel(const float *src, T *dst, int64_t n8)
{
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i0 < n8; i0 += 2 * stride) {
        float4 v[2][2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int64_t i = i0 + u * stride;
            if (i < n8) v[u][0] = *(const float4 *)(src + 8 * i), v[u][1] = *(const float4 *)(src + 8 * i + 4);
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int64_t i = i0 + u * stride;
            if (i >= n8) continue;
            const float w[8] = {v[u][0].x, v[u][0].y, v[u][0].z, v[u][0].w, v[u][1].x, v[u][1].y, v[u][1].z, v[u][1].w};
            st8_any(dst, dtraits<T>::dt, 8 * i, w);
        }
    }
}

void nsa_cu_store32(grun *g, const float *src, const dview *dst, int64_t B, int64_t R, int64_t H, int64_t D)
{
    const int64_t rows = B * R * H;
    if (!g_live(g) || rows == 0 || D == 0) return;
    if (D % 8 == 0 && (uintptr_t)src % 16 == 0 && dense_rows_view(dst, dst->dt, B, R, H, D)) {
        const int64_t n8 = rows * (D / 8);
        const unsigned grid = grid_resident((n8 + 1) / 2, PREP_THREADS);
        if (dst->dt == NSA_DTYPE_BF16)
            store32_dense_kernel<__nv_bfloat16><<<grid, PREP_THREADS, 0, g->st>>>(src, (__nv_bfloat16 *)dst->p, n8);
        else
            store32_dense_kernel<__half><<<grid, PREP_THREADS, 0, g->st>>>(src, (__half *)dst->p, n8);
        g_launched(g);
        return;
    }
    const int vec = vec4_ok(dst, 1, D) && (uintptr_t)src % 16 == 0; /* src rows: D % 4 == 0 keeps them aligned */
    store32_kernel<<<grid1(rows * 32, PREP_THREADS), PREP_THREADS, 0, g->st>>>(src, *dst, R, H, D, rows, vec);
    g_launched(g);
}
