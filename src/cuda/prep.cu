/* prep.cu -- the backend's small kernels: per-sequence prefixes of a varlen batch, mean
 * pooling and its backward, gating, the per-row D of every backward, fp32 -> storage
 * stores, the usable-block lists of selected attention and their inversion (per block, the
 * ascending queries that selected it), which makes the selected dK/dV deterministic. */
#include "kernels.h"

#define PREP_THREADS 256
#define INV_CHUNK 1024 /* positions per inversion task */

static unsigned grid1(int64_t n, int per) { return (unsigned)((n + per - 1) / per); }

/* row -> (b, i, h) of a [B, I, H] row space: 32-bit divisions whenever the row count fits
 * (a 64-bit division is a long software sequence, and these kernels are otherwise a few
 * loads per row) */
__device__ __forceinline__ void split_row(int64_t row, int64_t H, int64_t I, int64_t rows, int64_t *b, int64_t *i, int64_t *h)
{
    if (rows <= 0x7fffffff) {
        const unsigned r = (unsigned)row, hh = (unsigned)H, q = r / hh;
        *h = r - q * hh;
        *i = q % (unsigned)I;
        *b = q / (unsigned)I;
    } else {
        *h = row % H, *i = (row / H) % I, *b = row / (H * I);
    }
}

/* ==== sequences ============================================================================ */

/* One pass of a block-wide exclusive scan over blockDim.x values (one per thread, v): returns
 * this thread's exclusive prefix, carry (shared) included, and adds the pass's total to carry.
 * wsum is shared [32]; every thread of the block must call it (it synchronises). */
template <typename T>
__device__ T block_scan_pass(T v, T *wsum, T *carry)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
    T x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) wsum[warp] = x;
    __syncthreads();
    if (warp == 0) {
        T t = lane < nwarp ? wsum[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const T y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += y;
        }
        wsum[lane] = t;
    }
    __syncthreads();
    if (warp > 0) x += wsum[warp - 1];
    const T exclusive = *carry + x - v;
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) *carry += x;
    __syncthreads();
    return exclusive;
}

/* out[s] = sum of units over sequences < s, out[nseq] = total (one block). */
__global__ void prefix_kernel(const int32_t *cu, int64_t nseq, unitspec u, int64_t *out)
{
    __shared__ int64_t wsum[32];
    __shared__ int64_t carry;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int64_t base = 0; base < nseq; base += blockDim.x) {
        const int64_t s = base + threadIdx.x;
        const int64_t v = s < nseq ? seq_units(u, (int64_t)(cu[s + 1] - cu[s])) : 0;
        const int64_t x = block_scan_pass<int64_t>(v, wsum, &carry);
        if (s < nseq) out[s] = x;
    }
    if (threadIdx.x == 0) out[nseq] = carry;
}

int64_t g_units_total(const nsa_problem *p, unitspec u)
{
    if (!p->cu_seqlens) return p->B * seq_units(u, p->T);
    int64_t t = 0;
    for (int64_t s = 0; s < p->num_seqs; s++) t += seq_units(u, (int64_t)(p->cu_seqlens[s + 1] - p->cu_seqlens[s]));
    return t;
}

void g_seq_setup(grun *g, int need_cmp)
{
    const nsa_problem *p = g->p;
    g->cu = NULL;
    g->cmp0 = NULL;
    if (!p->cu_seqlens) return;
    const int64_t N = p->num_seqs;
    g->cu = (int32_t *)g_take(g, (size_t)(N + 1) * sizeof(int32_t));
    if (g_live(g)) g_check(g, cudaMemcpyAsync(g->cu, p->cu_seqlens, (size_t)(N + 1) * sizeof(int32_t), cudaMemcpyHostToDevice, g->st));
    if (need_cmp) {
        unitspec u = {UK_CMP, 0, 1, p->cfg.cmp_len, p->cfg.cmp_stride};
        int64_t total;
        g->cmp0 = g_prefix(g, u, &total);
    }
}

int64_t *g_prefix(grun *g, unitspec u, int64_t *total)
{
    const nsa_problem *p = g->p;
    *total = g_units_total(p, u);
    if (!p->cu_seqlens) return NULL;
    int64_t *out = (int64_t *)g_take(g, (size_t)(p->num_seqs + 1) * sizeof(int64_t));
    if (g_live(g)) {
        prefix_kernel<<<1, 1024, 0, g->st>>>(g->cu, p->num_seqs, u, out);
        g_launched(g);
    }
    return out;
}

seqmap g_seqmap(grun *g, unitspec u, int64_t *total)
{
    const nsa_problem *p = g->p;
    seqmap m;
    memset(&m, 0, sizeof m);
    m.cu = g->cu;
    m.cmp0 = g->cmp0;
    m.first = g_prefix(g, u, total);
    m.nseq = p->num_seqs;
    m.T = p->T;
    m.per_seq = seq_units(u, p->T);
    if (m.per_seq < 1) m.per_seq = 1; /* dense with no task: never divided by */
    m.cl = (int)p->cfg.cmp_len;
    m.cd = (int)p->cfg.cmp_stride;
    return m;
}

static seqmap plain_map(const grun *g)
{
    seqmap m;
    memset(&m, 0, sizeof m);
    m.cu = g->cu;
    m.cmp0 = g->cmp0;
    m.nseq = g->p->num_seqs;
    m.T = g->p->T;
    m.per_seq = 1;
    m.cl = (int)g->p->cfg.cmp_len;
    m.cd = (int)g->p->cfg.cmp_stride;
    return m;
}

/* ==== compression (spec 1) =================================================================== */

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
        *x, D, *out, plain_map(g), p->cmp_rows, p->H, rows);
    g_launched(g);
}

/* one warp per (b, t, h) row of dx */
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
    const int a = tl - sm.cl + 1;
    const int ilo = a <= 0 ? 0 : (a + sm.cd - 1) / sm.cd;
    int ihi = tl / sm.cd;
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
    const int64_t rows = p->B * p->T * p->H;
    if (!g_live(g) || rows == 0 || D == 0) return;
    compress_bwd_kernel<<<grid1(rows * 32, PREP_THREADS), PREP_THREADS, 0, g->st>>>(*src, src32, D, *dx, dx32, plain_map(g),
                                                                                   p->T, p->cmp_rows, p->H, rows);
    g_launched(g);
}

/* ==== gating (spec 6) ============================================================================= */

typedef struct gate3 {
    dview o[3], g[3], d[3], dg[3];
    float *Dw[3], *gw[3]; /* backward: per-row D = g * rowsum(dout * o) and g of each branch */
} gate3;

/* Stores four f32 values as consecutive elements at offset off (off % 4 == 0 of a 16-byte
 * aligned view, see dview.al): one 16-byte (f32) or 8-byte (f16/bf16) access. */
__device__ __forceinline__ void st4_any(void *p, int dt, int64_t off, float4 v)
{
    if (dt == NSA_DTYPE_F32) {
        *(float4 *)((float *)p + off) = v;
        return;
    }
    uint2 u;
    if (dt == NSA_DTYPE_BF16) {
        const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
        u.x = *(const uint32_t *)&a, u.y = *(const uint32_t *)&b;
    } else {
        const __half2 a = __floats2half2_rn(v.x, v.y), b = __floats2half2_rn(v.z, v.w);
        u.x = *(const uint32_t *)&a, u.y = *(const uint32_t *)&b;
    }
    *(uint2 *)((unsigned short *)p + off) = u;
}

/* Rows of these views can be read four elements at a time: 16-byte aligned rows, D % 4 == 0. */
static int vec4_ok(const dview *v, int n, int64_t D)
{
    if (D % 4) return 0;
    for (int i = 0; i < n; i++)
        if (v[i].p && !v[i].al) return 0;
    return 1;
}

/* Eight consecutive elements at element offset off (off % 8 == 0 of a 16-byte aligned view):
 * one 16-byte access (f16 / bf16) or two (f32). */
__device__ __forceinline__ void ld8_any(const void *p, int dt, int64_t off, float v[8])
{
    if (dt == NSA_DTYPE_F32) {
        const float4 a = *(const float4 *)((const float *)p + off), b = *(const float4 *)((const float *)p + off + 4);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        return;
    }
    const uint4 u = *(const uint4 *)((const unsigned short *)p + off);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = dt == NSA_DTYPE_BF16 ? __bfloat1622float2(*(const __nv_bfloat162 *)&w[i]) : __half22float2(*(const __half2 *)&w[i]);
        v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void st8_any(void *p, int dt, int64_t off, const float v[8])
{
    if (dt == NSA_DTYPE_F32) {
        *(float4 *)((float *)p + off) = make_float4(v[0], v[1], v[2], v[3]);
        *(float4 *)((float *)p + off + 4) = make_float4(v[4], v[5], v[6], v[7]);
        return;
    }
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (dt == NSA_DTYPE_BF16) {
            const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
            w[i] = *(const uint32_t *)&h;
        } else {
            const __half2 h = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
            w[i] = *(const uint32_t *)&h;
        }
    }
    *(uint4 *)((unsigned short *)p + off) = make_uint4(w[0], w[1], w[2], w[3]);
}

/* Rows of these views can be read eight elements at a time: 16-byte aligned rows, D % 8 == 0. */
static int vec8_ok(const dview *v, int n, int64_t D)
{
    if (D % 8) return 0;
    for (int i = 0; i < n; i++)
        if (v[i].p && !v[i].al) return 0;
    return 1;
}

/* Lanes per row of the gate kernels: vectorised, the power of two covering D / 8 elements
 * (D 128: 16 lanes, two rows per warp, every lane one 16-byte access per tensor); else 32
 * lanes of one element. Rows of a few hundred bytes leave a whole warp per row mostly idle
 * behind its index arithmetic and latency (64k: 3.2 ms for 4.3 GB). */
static int gate_lanes(int vec, int64_t D)
{
    int l = 1;
    while (vec && l < 32 && l * 8 < D) l <<= 1;
    return vec ? l : 32;
}

/* lpr lanes per (b, t, hq) row (a power of two dividing 32); vec: 8 elements per access.
 * Grid-stride over the rows x lpr items: a few CTAs per SM that live through the whole pass
 * instead of one short-lived CTA per 256 items (64k: 262144 CTAs, 2.2 ms for 4.3 GB, 58% of
 * the HBM peak). */
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

/* CTAs of the grid-stride elementwise kernels: enough for every SM to stay full (n items of
 * `per` threads each CTA), never more than the items need */
static unsigned grid_resident(int64_t n, int per)
{
    static int sms;
    if (!sms) {
        int dev = 0;
        if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
            sms < 1) {
            cudaGetLastError();
            sms = 132;
        }
    }
    const int64_t need = (n + per - 1) / per, cap = (int64_t)sms * (2048 / per) * 2;
    return (unsigned)(need < cap ? need : cap);
}

void nsa_cu_gate(grun *g, const dview os[3], const dview gs[3], const dview *o, int64_t B, int64_t T, int64_t HQ,
                 int64_t DV)
{
    const int64_t rows = B * T * HQ;
    if (!g_live(g) || rows == 0 || DV == 0) return;
    gate3 a;
    memset(&a, 0, sizeof a);
    for (int x = 0; x < 3; x++) a.o[x] = os[x], a.g[x] = gs[x];
    dview v[4] = {*o};
    for (int x = 0; x < 3; x++) v[x + 1] = gs[x].p ? os[x] : dview();
    const int vec = vec8_ok(v, 4, DV), lpr = gate_lanes(vec, DV);
    gate_kernel<<<grid_resident(rows * lpr, PREP_THREADS), PREP_THREADS, 0, g->st>>>(a, *o, T, HQ, DV, rows, vec, lpr);
    g_launched(g);
}

/* Sum over the lpr lanes of a row (aligned groups of a power of two). */
__device__ __forceinline__ float group_sum(float x, int lpr)
{
    for (int o = lpr >> 1; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* lpr lanes per (b, t, hq) row: per present gate, dg = rowsum(dout * o_x) (also the branch's
 * D = g * dg and g for its backward), do_x = g * dout */
__global__ void gate_bwd_kernel(gate3 a, dview dout, int64_t T, int64_t HQ, int64_t DV, int64_t rows, int vec, int lpr)
{
    const int64_t gt = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t row = gt / lpr;
    const int sub = (int)(gt & (lpr - 1));
    /* rows past the end stay for the shuffles (a warp may hold two rows, one of them past) */
    const bool live = row < rows;
    int64_t hq = 0, t = 0, b = 0;
    if (live) split_row(row, HQ, T, rows, &b, &t, &hq);
    const int64_t ob = b * dout.s0 + t * dout.s1 + hq * dout.s2;
    /* branch by branch (dout is re-read from L1 / L2): measured faster than one pass holding
     * all three branches' state (64k: 4.8 vs 6.4 ms) */
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
        }
    }
}

void nsa_cu_gate_bwd(grun *g, const dview *dout, const dview os[3], const dview gs[3], const dview dos[3],
                     const dview dgs[3], float *const Dw[3], float *const gw[3], int64_t B, int64_t T, int64_t HQ,
                     int64_t DV)
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
    const int vec = vec8_ok(v, 7, DV), lpr = gate_lanes(vec, DV);
    gate_bwd_kernel<<<grid1(rows * lpr, PREP_THREADS), PREP_THREADS, 0, g->st>>>(a, *dout, T, HQ, DV, rows, vec, lpr);
    g_launched(g);
}

/* ==== backward row terms, stores ==================================================================== */

__global__ void dprep_kernel(dview dout, dview o, dview gate, float *Dw, float *gw, int64_t T, int64_t HQ, int64_t DV,
                             int64_t rows)
{
    const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    int64_t hq, t, b;
    split_row(row, HQ, T, rows, &b, &t, &hq);
    const int64_t db = b * dout.s0 + t * dout.s1 + hq * dout.s2, obase = b * o.s0 + t * o.s1 + hq * o.s2;
    float acc = 0.0f;
    for (int64_t d = lane; d < DV; d += 32) acc += ld_any(dout.p, dout.dt, db + d) * ld_any(o.p, o.dt, obase + d);
    acc = warp_sum(acc);
    if (lane == 0) {
        const float gv = gate.p ? ld_any(gate.p, gate.dt, b * gate.s0 + t * gate.s1 + hq * gate.s2) : 1.0f;
        Dw[row] = gv * acc;
        if (gw) gw[row] = gv;
    }
}

void nsa_cu_dprep(grun *g, const dview *dout, const dview *o, const dview *gate, float *Dw, float *gw, int64_t B,
                  int64_t T, int64_t HQ, int64_t DV)
{
    const int64_t rows = B * T * HQ;
    if (!g_live(g) || rows == 0) return;
    dview none;
    memset(&none, 0, sizeof none);
    dprep_kernel<<<grid1(rows * 32, PREP_THREADS), PREP_THREADS, 0, g->st>>>(*dout, *o, gate ? *gate : none, Dw, gw, T,
                                                                           HQ, DV, rows);
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

void nsa_cu_store32(grun *g, const float *src, const dview *dst, int64_t B, int64_t R, int64_t H, int64_t D)
{
    const int64_t rows = B * R * H;
    if (!g_live(g) || rows == 0 || D == 0) return;
    const int vec = vec4_ok(dst, 1, D) && (uintptr_t)src % 16 == 0; /* src rows: D % 4 == 0 keeps them aligned */
    store32_kernel<<<grid1(rows * 32, PREP_THREADS), PREP_THREADS, 0, g->st>>>(src, *dst, R, H, D, rows, vec);
    g_launched(g);
}

/* ==== selected attention: usable blocks and the inversion =========================================== */

__global__ void usable_kernel(dview idx, dview cnt, int64_t m, int64_t lp, int32_t *U, int32_t *ucnt, seqmap sm,
                              int64_t T, int64_t H, int64_t rows)
{
    const int64_t row = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    int64_t h, t, b;
    split_row(row, H, T, rows, &b, &t, &h);
    const seqinfo sq = seq_get(sm, seq_of_row(sm, b, t));
    const int64_t pos = t - sq.row0, nb = (sq.len + lp - 1) / lp;
    int64_t c = m;
    if (cnt.p) {
        c = ((const int32_t *)cnt.p)[b * cnt.s0 + t * cnt.s1 + h * cnt.s2];
        c = c < 0 ? 0 : (c > m ? m : c);
    }
    const int32_t *ix = (const int32_t *)idx.p + b * idx.s0 + t * idx.s1 + h * idx.s2;
    int32_t *u = U + row * m;
    int k = 0;
    for (int64_t e = 0; e < c; e++) {
        const int32_t j = ix[e];
        if (j < 0 || j >= nb || (int64_t)j * lp > pos) continue;
        int q = k;
        while (q > 0 && u[q - 1] > j) q--;
        if (q > 0 && u[q - 1] == j) continue;
        for (int r = k; r > q; r--) u[r] = u[r - 1];
        u[q] = j;
        k++;
    }
    ucnt[row] = k;
}

void nsa_cu_usable(grun *g, const dview *idx, const dview *counts, int64_t m, int64_t lp, int32_t *U, int32_t *ucnt)
{
    const nsa_problem *p = g->p;
    const int64_t rows = p->B * p->T * p->H;
    if (!g_live(g) || rows == 0) return;
    dview none;
    memset(&none, 0, sizeof none);
    usable_kernel<<<grid1(rows, PREP_THREADS), PREP_THREADS, 0, g->st>>>(*idx, counts ? *counts : none, m, lp, U, ucnt,
                                                                       plain_map(g), p->T, p->H, rows);
    g_launched(g);
}

typedef struct inv_params {
    const int32_t *U, *ucnt;
    int32_t *cnt, *offs, *list;
    const int64_t *cnt_pref, *offs_pref, *list_pref;
    int64_t m, lp, T, H;
    seqmap sm;
} inv_params;

__device__ __forceinline__ int64_t inv_region(const int64_t *pref, unitspec u, int64_t s, int64_t T, int64_t H,
                                              int64_t h, int64_t len)
{
    return (pref ? pref[s] : s * seq_units(u, T)) * H + h * seq_units(u, len);
}

/* per (sequence, chunk of positions, head): how many of the chunk's queries selected each block */
__global__ void inv_count_kernel(inv_params P)
{
    extern __shared__ int hist[];
    int64_t s, c;
    seq_decode(P.sm, blockIdx.x, &s, &c);
    const seqinfo sq = seq_get(P.sm, s);
    const int64_t h = blockIdx.y, nb = (sq.len + P.lp - 1) / P.lp;
    for (int64_t j = threadIdx.x; j < nb; j += blockDim.x) hist[j] = 0;
    __syncthreads();
    const int64_t p0 = c * INV_CHUNK;
    const int64_t np = sq.len - p0 < INV_CHUNK ? sq.len - p0 : INV_CHUNK;
    for (int64_t i = threadIdx.x; i < np * P.m; i += blockDim.x) {
        const int64_t pp = i / P.m, e = i % P.m;
        const int64_t row = (sq.b * P.T + sq.row0 + p0 + pp) * P.H + h;
        if (e < P.ucnt[row]) atomicAdd(&hist[P.U[row * P.m + e]], 1);
    }
    __syncthreads();
    unitspec uc = {UK_INV_CNT, INV_CHUNK, P.lp, 0, 0};
    int32_t *cnt = P.cnt + inv_region(P.cnt_pref, uc, s, P.T, P.H, h, sq.len) + c * nb;
    for (int64_t j = threadIdx.x; j < nb; j += blockDim.x) cnt[j] = hist[j];
}

/* per (sequence, head): block offsets, and each chunk's first slot per block */
__global__ void inv_scan_kernel(inv_params P)
{
    __shared__ int wsum[32];
    __shared__ int carry;
    const int64_t s = blockIdx.x, h = blockIdx.y;
    const seqinfo sq = seq_get(P.sm, s);
    const int64_t nb = (sq.len + P.lp - 1) / P.lp, nch = (sq.len + INV_CHUNK - 1) / INV_CHUNK;
    unitspec uc = {UK_INV_CNT, INV_CHUNK, P.lp, 0, 0}, uo = {UK_INV_OFFS, 0, P.lp, 0, 0};
    int32_t *cnt = P.cnt + inv_region(P.cnt_pref, uc, s, P.T, P.H, h, sq.len);
    int32_t *offs = P.offs + inv_region(P.offs_pref, uo, s, P.T, P.H, h, sq.len);
    for (int64_t j = threadIdx.x; j < nb; j += blockDim.x) {
        int tot = 0;
        for (int64_t c = 0; c < nch; c++) tot += cnt[c * nb + j];
        offs[j] = tot;
    }
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int64_t base = 0; base < nb; base += blockDim.x) {
        const int64_t j = base + threadIdx.x;
        const int v = j < nb ? offs[j] : 0;
        const int x = block_scan_pass<int>(v, wsum, &carry);
        if (j < nb) offs[j] = x;
    }
    if (threadIdx.x == 0) offs[nb] = carry;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < nb; j += blockDim.x) {
        int run = offs[j];
        for (int64_t c = 0; c < nch; c++) {
            const int t = cnt[c * nb + j];
            cnt[c * nb + j] = run;
            run += t;
        }
    }
}

/* per (sequence, chunk, head), one warp: the chunk's queries in ascending order into the
 * lists (a query's blocks are distinct, so the lanes never share a cursor) */
__global__ void inv_fill_kernel(inv_params P)
{
    extern __shared__ int cursor[];
    int64_t s, c;
    seq_decode(P.sm, blockIdx.x, &s, &c);
    const seqinfo sq = seq_get(P.sm, s);
    const int64_t h = blockIdx.y, nb = (sq.len + P.lp - 1) / P.lp;
    const int lane = threadIdx.x;
    unitspec uc = {UK_INV_CNT, INV_CHUNK, P.lp, 0, 0}, ul = {UK_LIST, P.m, 1, 0, 0};
    const int32_t *cnt = P.cnt + inv_region(P.cnt_pref, uc, s, P.T, P.H, h, sq.len) + c * nb;
    int32_t *list = P.list + inv_region(P.list_pref, ul, s, P.T, P.H, h, sq.len);
    for (int64_t j = lane; j < nb; j += 32) cursor[j] = cnt[j];
    __syncwarp();
    const int64_t p0 = c * INV_CHUNK;
    const int64_t np = sq.len - p0 < INV_CHUNK ? sq.len - p0 : INV_CHUNK;
    for (int64_t pp = 0; pp < np; pp++) {
        const int64_t row = (sq.b * P.T + sq.row0 + p0 + pp) * P.H + h;
        const int k = P.ucnt[row];
        for (int e = lane; e < k; e += 32) {
            const int j = P.U[row * P.m + e];
            const int slot = cursor[j];
            cursor[j] = slot + 1;
            list[slot] = (int32_t)(p0 + pp);
        }
        __syncwarp();
    }
}

void nsa_cu_invert(grun *g, const int32_t *U, const int32_t *ucnt, int64_t m, int64_t lp, inv_index *ix)
{
    const nsa_problem *p = g->p;
    unitspec uc = {UK_INV_CNT, INV_CHUNK, lp, 0, 0}, uo = {UK_INV_OFFS, 0, lp, 0, 0}, ul = {UK_LIST, m, 1, 0, 0};
    unitspec uch = {UK_ROWS, 1, INV_CHUNK, 0, 0};
    int64_t ncnt, noffs, nlist, nchunks;
    const int64_t *cnt_pref = g_prefix(g, uc, &ncnt);
    ix->offs_pref = g_prefix(g, uo, &noffs);
    ix->list_pref = g_prefix(g, ul, &nlist);
    int32_t *cnt = (int32_t *)g_take(g, (size_t)(ncnt * p->H + 1) * sizeof(int32_t));
    ix->offs = (int32_t *)g_take(g, (size_t)(noffs * p->H + 1) * sizeof(int32_t));
    ix->list = (int32_t *)g_take(g, (size_t)(nlist * p->H + 1) * sizeof(int32_t));
    seqmap sm = g_seqmap(g, uch, &nchunks);
    int64_t nb_max = 0;
    for (int64_t s = 0; s < p->num_seqs; s++) {
        const int64_t len = p->cu_seqlens ? p->cu_seqlens[s + 1] - p->cu_seqlens[s] : p->T;
        const int64_t nb = (len + lp - 1) / lp;
        nb_max = nb > nb_max ? nb : nb_max;
    }
    const size_t hist_bytes = (size_t)(nb_max > 0 ? nb_max : 1) * sizeof(int);
    if (hist_bytes > 200 * 1024) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED); /* more than 51200 selection blocks in one sequence */
        return;
    }
    if (!g_live(g) || p->H == 0) return;
    inv_params P;
    memset(&P, 0, sizeof P);
    P.U = U, P.ucnt = ucnt, P.cnt = cnt, P.offs = ix->offs, P.list = ix->list;
    P.cnt_pref = cnt_pref, P.offs_pref = ix->offs_pref, P.list_pref = ix->list_pref;
    P.m = m, P.lp = lp, P.T = p->T, P.H = p->H, P.sm = sm;
    if (hist_bytes > 48 * 1024) {
        g_check(g, cudaFuncSetAttribute(inv_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)hist_bytes));
        g_check(g, cudaFuncSetAttribute(inv_fill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)hist_bytes));
        if (!g_live(g)) return;
    }
    if (nchunks > 0) {
        inv_count_kernel<<<dim3((unsigned)nchunks, (unsigned)p->H), 256, hist_bytes, g->st>>>(P);
        g_launched(g);
    }
    if (p->num_seqs > 0) {
        seqmap plain = plain_map(g);
        P.sm = plain;
        inv_scan_kernel<<<dim3((unsigned)p->num_seqs, (unsigned)p->H), 1024, 0, g->st>>>(P);
        g_launched(g);
        P.sm = sm;
    }
    if (nchunks > 0) {
        inv_fill_kernel<<<dim3((unsigned)nchunks, (unsigned)p->H), 32, hist_bytes, g->st>>>(P);
        g_launched(g);
    }
}

/* ==== selected dK/dV: segments of long query lists ==================================================== */

/* xoff = exclusive prefix over the flat offs array of the further segments per entry (one block) */
__global__ void slc_segments_kernel(const int32_t *offs, int64_t nflat, int64_t segp, int32_t *xoff)
{
    __shared__ int wsum[32];
    __shared__ int carry;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int64_t base = 0; base < nflat; base += blockDim.x) {
        const int64_t f = base + threadIdx.x;
        int v = 0;
        if (f + 1 < nflat) {
            const int64_t c = (int64_t)offs[f + 1] - offs[f]; /* <= 0 past a region's last block */
            v = c > segp ? (int)((c - 1) / segp) : 0;
        }
        const int x = block_scan_pass<int>(v, wsum, &carry);
        if (f < nflat) xoff[f] = x;
    }
    if (threadIdx.x == 0) xoff[nflat] = carry;
}

void nsa_cu_slc_segments(grun *g, const inv_index *ix, int64_t nflat, int64_t segp, int32_t *xoff)
{
    if (!g_live(g)) return;
    slc_segments_kernel<<<1, 1024, 0, g->st>>>(ix->offs, nflat, segp, xoff);
    g_launched(g);
}

/* per key tile (sequence, block, 64-key sub-tile, head): += the partials of its further
 * segments, summed in segment order */
__global__ void slc_reduce_kernel(kparams P)
{
    int64_t s, local;
    seq_decode(P.sm, blockIdx.x, &s, &local);
    const seqinfo sq = seq_get(P.sm, s);
    const int64_t h = blockIdx.y, lp = P.rule.lp, j = local / P.nsub, sub = local % P.nsub;
    const int64_t per_T = (P.T + lp - 1) / lp + 1, nb1 = (sq.len + lp - 1) / lp + 1;
    const int64_t f = (P.offs_pref ? P.offs_pref[s] : s * per_T) * P.H + h * nb1 + j;
    const int64_t x0 = P.xoff[f], x1 = P.xoff[f + 1];
    if (x0 == x1) return;
    const int64_t bend = j * lp + lp < sq.len ? j * lp + lp : sq.len;
    const int64_t k0 = j * lp + sub * 64, k1 = k0 + 64 < bend ? k0 + 64 : bend;
    if (k0 >= k1) return;
    const int64_t W = P.DK + P.DV;
    for (int64_t i = threadIdx.x; i < (k1 - k0) * W; i += blockDim.x) {
        const int64_t key = i / W, col = i % W;
        const int64_t po = col < P.DK ? key * P.DK + col : 64 * P.DK + key * P.DV + (col - P.DK);
        float sum = 0.0f;
        for (int64_t e = x0; e < x1; e++) sum += P.part[(e * P.nsub + sub) * 64 * W + po];
        const int64_t row = (sq.b * P.KR + sq.row0 + k0 + key) * P.H + h;
        if (col < P.DK) P.dk[row * P.DK + col] += sum;
        else P.dv[row * P.DV + (col - P.DK)] += sum;
    }
}

void nsa_cu_slc_reduce(grun *g, const kparams *P, int64_t tiles)
{
    if (!g_live(g) || tiles == 0) return;
    slc_reduce_kernel<<<dim3((unsigned)tiles, (unsigned)P->H), 256, 0, g->st>>>(*P);
    g_launched(g);
}

/* per compressed key tile (sequence, tile, head): += the partials of row segments 1.., in order */
__global__ void seg_reduce_kernel(kparams P, seqmap tm)
{
    int64_t s, kt;
    seq_decode(tm, blockIdx.x, &s, &kt);
    const seqinfo sq = seq_get(tm, s);
    const int64_t h = blockIdx.y;
    const int is_cmp = P.rule.kind == RULE_CMP;
    const int64_t nkeys = is_cmp ? sq.ncmp : sq.len, key_row0 = is_cmp ? sq.cmp0 : sq.row0;
    const int64_t bk = P.bk, k0 = kt * bk, k1 = k0 + bk < nkeys ? k0 + bk : nkeys;
    if (k0 >= k1) return;
    /* ktile's task of (tile kt, segment sg): segment-major within the sequence */
    const int64_t task0 = (P.sm.first ? P.sm.first[s] : s * P.sm.per_seq) + kt, ntl = (nkeys + bk - 1) / bk;
    const int64_t W = P.DK + P.DV;
    for (int64_t i = threadIdx.x; i < (k1 - k0) * W; i += blockDim.x) {
        const int64_t key = i / W, col = i % W;
        const int64_t po = col < P.DK ? key * P.DK + col : bk * P.DK + key * P.DV + (col - P.DK);
        float sum = 0.0f;
        for (int64_t sg = 1; sg < P.nseg; sg++) sum += P.part[((task0 + sg * ntl) * P.H + h) * bk * W + po];
        const int64_t row = (sq.b * P.KR + key_row0 + k0 + key) * P.H + h;
        if (col < P.DK) P.dk[row * P.DK + col] += sum;
        else P.dv[row * P.DV + (col - P.DK)] += sum;
    }
}

void nsa_cu_seg_reduce(grun *g, const kparams *P, seqmap tm, int64_t tiles)
{
    if (!g_live(g) || tiles == 0) return;
    seg_reduce_kernel<<<dim3((unsigned)tiles, (unsigned)P->H), 256, 0, g->st>>>(*P, tm);
    g_launched(g);
}
