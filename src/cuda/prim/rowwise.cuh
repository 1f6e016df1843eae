/* prim/rowwise.cuh -- helpers of the small row-wise kernels (pooling, gating, stores, list
 * building): launch sizes, row -> (batch, index, head) splits, a block-wide scan, and vector
 * loads / stores of any float dtype. */
#ifndef NSA_CUDA_PRIM_ROWWISE_CUH
#define NSA_CUDA_PRIM_ROWWISE_CUH

#include "common.cuh"

#if defined(__CUDACC__)

#define PREP_THREADS 256
#define INV_CHUNK 256 /* positions per inversion task: the fill walks a chunk serially in one warp */

static inline unsigned grid1(int64_t n, int per) { return (unsigned)((n + per - 1) / per); }

/* CTAs of the grid-stride elementwise kernels: enough for every SM to stay full (n items of
 * `per` threads each CTA), never more than the items need */
static inline unsigned grid_resident(int64_t n, int per)
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

/* Whether v is dense in row-major [B, R, H, D] order (D = 1: a [B, R, H] row term) in dtype dt,
 * a 16-bit one (the dense forms are instantiated for bf16 and f16 only), 16-byte aligned where
 * it holds rows of 16-byte chunks: the elementwise kernels' dense forms then find an element's
 * row by its index alone. */
static int dense_rows_view(const dview *v, int dt, int64_t B, int64_t R, int64_t H, int64_t D)
{
    if (!v->p || v->dt != dt || (dt != NSA_DTYPE_BF16 && dt != NSA_DTYPE_F16)) return 0;
    if (D > 1 && ((uintptr_t)v->p % 16)) return 0;
    return v->s2 == D && v->s1 == H * D && (B == 1 || v->s0 == R * H * D);
}

/* Rows of these views can be read eight elements at a time: 16-byte aligned rows, D % 8 == 0. */
static int vec8_ok(const dview *v, int n, int64_t D)
{
    if (D % 8) return 0;
    for (int i = 0; i < n; i++)
        if (v[i].p && !v[i].al) return 0;
    return 1;
}

/* This thread's [B, T, HQ] row and lane in a grid of lpr lanes a row (row_lanes, below). Rows past
 * the end stay live = false for the shuffles: a warp may hold two rows, one of them past it. */
typedef struct lane_row {
    int64_t row, b, t, hq;
    int sub;
    bool live;
} lane_row;

__device__ __forceinline__ lane_row lane_row_of(int64_t T, int64_t HQ, int64_t rows, int lpr)
{
    lane_row r;
    const int64_t gt = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    r.row = gt / lpr, r.sub = (int)(gt & (lpr - 1)), r.live = r.row < rows;
    r.b = r.t = r.hq = 0;
    if (r.live) split_row(r.row, HQ, T, rows, &r.b, &r.t, &r.hq);
    return r;
}

/* Sum over the lpr lanes of a row (aligned groups of a power of two; every lane of the warp
 * calls it). */
__device__ __forceinline__ float group_sum(float x, int lpr)
{
    for (int o = lpr >> 1; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* Lanes per row of the row-wise kernels (the gates, D = rowsum(dout * o)): vectorised, the power of two covering D / 8 elements
 * (D 128: 16 lanes, two rows per warp, every lane one 16-byte access per tensor); else 32
 * lanes of one element. Rows of a few hundred bytes leave a whole warp per row mostly idle
 * behind its index arithmetic and latency. */
static int row_lanes(int vec, int64_t D)
{
    int l = 1;
    while (vec && l < 32 && l * 8 < D) l <<= 1;
    return vec ? l : 32;
}

#endif /* __CUDACC__ */

#endif
