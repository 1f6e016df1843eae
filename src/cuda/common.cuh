/* common.cuh -- what every CUDA file of the backend shares:
 *   host:   the run state of one op call (stream, workspace arena with a sizing dry run,
 *           first error), launch checking;
 *   both:   strided tensor views, per-sequence unit counts (tiles, regions) of a varlen batch;
 *   device: sequence lookup, dtype traits, mma.sync / ldmatrix / cp.async wrappers and the
 *           row loaders that stage tensor rows into shared memory.
 * Positions inside one sequence are int (cu_seqlens is int32); element offsets are int64. */
#ifndef NSA_CUDA_COMMON_CUH
#define NSA_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

extern "C" {
#include "../internal.h"
#include "../rules.h"
}

#define NSA_LOG2E 1.4426950408889634f
#define NSA_LN2 0.6931471805599453f

/* ==== host: one op call ================================================================ */

/* Every op runs its host code twice: once with dry = 1 to size the workspace (no CUDA call
 * is made, takes only count bytes), once for real. Carving and launching share one code
 * path, so the size and the use cannot disagree. */
typedef struct grun {
    cudaStream_t st;
    char *base;
    size_t used;
    int dry;
    nsa_status err;
    const nsa_problem *p;
    int32_t *cu;    /* device copy of cu_seqlens (varlen), else NULL */
    int64_t *cmp0;  /* device prefix of compressed rows per sequence (varlen), else NULL */
    int smem_max;   /* opt-in shared memory per block of the device (live pass) */
    int cc_major;   /* compute capability of the device (live pass) */
} grun;

static inline void *g_take(grun *g, size_t bytes)
{
    size_t at = (g->used + 255) & ~(size_t)255;
    g->used = at + bytes;
    return g->dry ? NULL : (void *)(g->base + at);
}

static inline int g_live(const grun *g) { return !g->dry && g->err == NSA_STATUS_SUCCESS; }

static inline void g_check(grun *g, cudaError_t e)
{
    if (e != cudaSuccess && g->err == NSA_STATUS_SUCCESS) g->err = NSA_STATUS_DEVICE_ERROR;
}

/* After a launch: a bad configuration or a sticky error surfaces here. */
static inline void g_launched(grun *g) { g_check(g, cudaGetLastError()); }

static inline void g_fail(grun *g, nsa_status st)
{
    if (g->err == NSA_STATUS_SUCCESS) g->err = st;
}

static inline void g_zero(grun *g, void *p, size_t bytes)
{
    if (g_live(g) && bytes) g_check(g, cudaMemsetAsync(p, 0, bytes, g->st));
}

static inline int64_t cdiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* ==== views ============================================================================ */

/* A rank-3/4 tensor as the kernels see it: element (i0, i1, i2, d) lives at
 * p + i0*s0 + i1*s1 + i2*s2 + d. al: rows start on 16 bytes and every stride keeps them
 * there, so 16-byte copies are legal (else the loaders fall back to scalar reads). */
typedef struct dview {
    void *p;
    int64_t s0, s1, s2;
    int dt; /* nsa_dtype */
    int al;
} dview;

static inline dview dv_of(const nsa_tensor *t)
{
    dview v;
    memset(&v, 0, sizeof v);
    if (!t || !t->data) return v;
    v.p = t->data;
    v.dt = (int)t->dtype;
    v.s0 = t->stride[0];
    v.s1 = t->rank > 1 ? t->stride[1] : 0;
    v.s2 = t->rank > 2 ? t->stride[2] : 0;
    const int64_t vec = 16 / (int64_t)nsa_dtype_size(t->dtype);
    v.al = ((uintptr_t)t->data % 16 == 0) && v.s0 % vec == 0 && v.s1 % vec == 0 && v.s2 % vec == 0;
    return v;
}

/* A contiguous [n0, n1, n2, D] buffer of workspace memory. */
static inline dview dv_flat(void *p, nsa_dtype dt, int64_t n1, int64_t n2, int64_t D)
{
    dview v;
    v.p = p;
    v.dt = (int)dt;
    v.s2 = D;
    v.s1 = n2 * D;
    v.s0 = n1 * n2 * D;
    const int64_t vec = 16 / (int64_t)nsa_dtype_size(dt);
    v.al = ((uintptr_t)p % 16 == 0) && D % vec == 0;
    return v;
}

/* ==== sequences ========================================================================= */

#ifdef __CUDACC__
#define NSA_CU_HD __host__ __device__ __forceinline__
#else
#define NSA_CU_HD static inline
#endif

/* Per-sequence unit counts: how many tiles / workspace entries one sequence of length len
 * owns for a given launch. The host sums them for grid sizes and workspace; the device
 * prefix-sums them (varlen) to find a task's sequence. */
enum unit_kind {
    UK_ROWS = 0,   /* ceil(len * a / b): tiles of b flattened rows (position x a heads) */
    UK_CMP_TILES,  /* ceil(Nc(len) / b) */
    UK_CMP,        /* Nc(len) */
    UK_SLC_TILES,  /* nb(len) * a, nb = ceil(len / b) */
    UK_INV_CNT,    /* ceil(len / a) * nb(len), nb = ceil(len / b) */
    UK_INV_OFFS,   /* nb(len) + 1, nb = ceil(len / b) */
    UK_LIST,       /* len * a */
    UK_CMP_TILES_X /* ceil(Nc(len) / b) * a: compressed key tiles, a row segments each */
};

typedef struct unitspec {
    int kind;
    int64_t a, b;
    int64_t cl, cd; /* compression l, d (UK_CMP*) */
} unitspec;

NSA_CU_HD int64_t seq_units(unitspec u, int64_t len)
{
    switch (u.kind) {
    case UK_ROWS: return (len * u.a + u.b - 1) / u.b;
    case UK_CMP_TILES: {
        int64_t nc = len >= u.cl ? (len - u.cl) / u.cd + 1 : 0;
        return (nc + u.b - 1) / u.b;
    }
    case UK_CMP: return len >= u.cl ? (len - u.cl) / u.cd + 1 : 0;
    case UK_SLC_TILES: return (len + u.b - 1) / u.b * u.a;
    case UK_INV_CNT: return (len + u.a - 1) / u.a * ((len + u.b - 1) / u.b);
    case UK_INV_OFFS: return (len + u.b - 1) / u.b + 1;
    case UK_CMP_TILES_X: {
        int64_t nc = len >= u.cl ? (len - u.cl) / u.cd + 1 : 0;
        return (nc + u.b - 1) / u.b * u.a;
    }
    default: return len * u.a;
    }
}

/* Where a launch's tasks come from: dense batches have per_seq tasks per sequence; varlen
 * ones a device prefix first[nseq + 1]. */
typedef struct seqmap {
    const int32_t *cu;    /* device cu_seqlens or NULL */
    const int64_t *cmp0;  /* device compressed-row prefix or NULL */
    const int64_t *first; /* device task prefix or NULL (dense) */
    int64_t nseq, T, per_seq;
    int cl, cd;
} seqmap;

typedef struct seqinfo {
    int64_t b, row0, cmp0;
    int len, ncmp;
} seqinfo;

#ifdef __CUDACC__
__device__ __forceinline__ seqinfo seq_get(const seqmap &m, int64_t s)
{
    seqinfo q;
    if (m.cu) {
        q.b = 0;
        q.row0 = m.cu[s];
        q.len = m.cu[s + 1] - m.cu[s];
        q.cmp0 = m.cmp0 ? m.cmp0[s] : 0;
    } else {
        q.b = s;
        q.row0 = 0;
        q.len = (int)m.T;
        q.cmp0 = 0;
    }
    q.ncmp = (m.cd > 0 && q.len >= m.cl) ? (q.len - m.cl) / m.cd + 1 : 0;
    return q;
}

/* task -> (sequence, task within it); empty sequences own no task. */
__device__ __forceinline__ void seq_decode(const seqmap &m, int64_t task, int64_t *s, int64_t *local)
{
    if (!m.first) {
        *s = task / m.per_seq;
        *local = task % m.per_seq;
        return;
    }
    int64_t lo = 0, hi = m.nseq - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (m.first[mid + 1] <= task) lo = mid + 1;
        else hi = mid;
    }
    *s = lo;
    *local = task - m.first[lo];
}

/* Packed row t (0 <= t < T of batch entry b) -> its sequence. */
__device__ __forceinline__ int64_t seq_of_row(const seqmap &m, int64_t b, int64_t t)
{
    if (!m.cu) return b;
    int64_t lo = 0, hi = m.nseq - 1;
    while (lo < hi) { /* the last s with cu[s] <= t: empty sequences before it don't matter */
        int64_t mid = (lo + hi + 1) / 2;
        if (m.cu[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* ==== dtypes ============================================================================ */

__device__ __forceinline__ float ld_any(const void *p, int dt, int64_t off)
{
    switch (dt) {
    case NSA_DTYPE_F32: return ((const float *)p)[off];
    case NSA_DTYPE_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[off]);
    case NSA_DTYPE_F16: return __half2float(((const __half *)p)[off]);
    default: return (float)((const int32_t *)p)[off];
    }
}

__device__ __forceinline__ void st_any(void *p, int dt, int64_t off, float x)
{
    switch (dt) {
    case NSA_DTYPE_F32: ((float *)p)[off] = x; break;
    case NSA_DTYPE_BF16: ((__nv_bfloat16 *)p)[off] = __float2bfloat16_rn(x); break;
    case NSA_DTYPE_F16: ((__half *)p)[off] = __float2half_rn(x); break;
    default: ((int32_t *)p)[off] = (int32_t)x;
    }
}

template <typename T> struct dtraits;
template <> struct dtraits<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *(uint32_t *)&v;
    }
    static __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct dtraits<__half> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        __half2 v = __floats2half2_rn(lo, hi);
        return *(uint32_t *)&v;
    }
    static __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from_f(float x) { return __float2half_rn(x); }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

/* ==== shared-memory movement ============================================================ */

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* Four 8x8 b16 matrices; thread i gives the address of row (i % 8) of matrix i / 8. */
__device__ __forceinline__ void ldsm4(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm4t(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

/* 16-byte asynchronous copy; bytes < 16 zero-fills the rest. */
/* 4-byte cp.async (L1-allocating: the per-row values of a chunk, one float each) */
__device__ __forceinline__ void cp4(void *dst, const void *src)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp16(void *dst, const void *src, int bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
/* 16-byte asynchronous copy of a whole 16 bytes (no size operand, no predicate). */
__device__ __forceinline__ void cp16_full(void *dst, const void *src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

/* Fragment addresses (lane -> smem element), for a 16 x 16 block at (r0, c0) of a
 * row-major tile with leading dimension ld:
 *   A operand (rows = m, cols = k), and B operands whose rows are n (non-transposed):  */
__device__ __forceinline__ int frag_a_off(int lane, int ld) { return ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8; }
/* B operand from rows = n (e.g. K [key][d] for S = Q K^T): x4 gives b0,b1 of n-tile 0 and
 * b0,b1 of n-tile 1. */
__device__ __forceinline__ int frag_bn_off(int lane, int ld) { return ((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8; }
/* B operand from rows = k (e.g. V [key][dv] for O = P V), with ldmatrix.trans. */
__device__ __forceinline__ int frag_bk_off(int lane, int ld) { return ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8; }

/* Copies rows of a tensor into a shared tile of `rows` x DP elements (leading dimension
 * ld). Row i comes from src + roff[i] (roff[i] < 0: a zero row); columns >= D are zero.
 * Aligned views use cp.async (the caller commits and waits); others scalar loads. */
template <typename T, int DP>
__device__ __forceinline__ void load_rows(T *dst, int ld, const T *src, const int64_t *roff, int rows, int D, int al,
                                          int tid, int nthr)
{
    constexpr int CH = DP / 8;
    if (al && D == DP && nthr % CH == 0) {
        /* fast path (full aligned rows, the common case): each thread keeps one 16-byte
         * column of every (nthr / CH)-th row, so the loop is a table read and one cp.async
         * per row instead of the general path's divisions, bounds and branches; this
         * address arithmetic was about half the instructions of the selected branch */
        const int rpi = nthr / CH, c = (tid % CH) * 8;
#pragma unroll 2
        for (int r = tid / CH; r < rows; r += rpi) {
            const int64_t off = roff[r];
            cp16(dst + r * ld + c, off >= 0 ? src + off + c : src, off >= 0 ? 16 : 0);
        }
        return;
    }
    for (int idx = tid; idx < rows * CH; idx += nthr) {
        const int r = idx / CH, c = (idx % CH) * 8;
        T *d = dst + r * ld + c;
        const int64_t off = roff[r];
        if (off < 0 || c >= D) {
            *(uint4 *)d = make_uint4(0, 0, 0, 0);
        } else if (al) {
            const int n = D - c < 8 ? D - c : 8;
            cp16(d, src + off + c, n * 2);
        } else {
            for (int e = 0; e < 8; e++) d[e] = c + e < D ? src[off + c + e] : dtraits<T>::from_f(0.0f);
        }
    }
}

/* ROWS full rows of DP elements, row i at src + i * stride, by NTHR threads: compile-time
 * trip count and shared offsets, so each 16-byte copy is one cp.async plus a 64-bit add
 * (the run-time loop cost ~13 instructions per copy, most of a one-warp tile's work). */
template <typename T, int DP, int NTHR, int ROWS>
__device__ __forceinline__ void load_tile_full(T *dst, int ld, const T *src, int64_t stride, int tid)
{
    constexpr int CH = DP / 8, RPI = NTHR / CH;
    static_assert(NTHR % CH == 0 && ROWS % RPI == 0, "whole rows per pass");
    const T *s = src + (int64_t)(tid / CH) * stride + (tid % CH) * 8;
    T *d = dst + (tid / CH) * ld + (tid % CH) * 8;
    const int64_t step = (int64_t)RPI * stride;
#pragma unroll
    for (int i = 0; i < ROWS / RPI; i++, s += step) cp16_full(d + i * RPI * ld, s);
}

/* Same for `rows` consecutive rows base + i * stride, i < valid (the rest zero). */
template <typename T, int DP>
__device__ __forceinline__ void load_rows_lin(T *dst, int ld, const T *src, int64_t base, int64_t stride, int valid,
                                              int rows, int D, int al, int tid, int nthr)
{
    constexpr int CH = DP / 8;
    if (al && D == DP && valid == rows) { /* whole tiles: 64 rows by one or four warps, 32 by one */
        if constexpr (32 % CH == 0) {
            if (nthr == 32 && rows == 64) {
                load_tile_full<T, DP, 32, 64>(dst, ld, src + base, stride, tid);
                return;
            }
            if (nthr == 32 && rows == 32) {
                load_tile_full<T, DP, 32, 32>(dst, ld, src + base, stride, tid);
                return;
            }
        }
        if constexpr (128 % CH == 0) {
            if (nthr == 128 && rows == 64) {
                load_tile_full<T, DP, 128, 64>(dst, ld, src + base, stride, tid);
                return;
            }
        }
    }
    if (al && D == DP && nthr % CH == 0) { /* fast path, as in load_rows */
        const int rpi = nthr / CH, r0 = tid / CH, c = (tid % CH) * 8;
        const T *s = src + base + (int64_t)r0 * stride + c;
        const int64_t sstep = (int64_t)rpi * stride;
        T *d = dst + r0 * ld + c;
#pragma unroll 4
        for (int r = r0; r < rows; r += rpi, s += sstep, d += rpi * ld) cp16(d, r < valid ? s : src, r < valid ? 16 : 0);
        return;
    }
    for (int idx = tid; idx < rows * CH; idx += nthr) {
        const int r = idx / CH, c = (idx % CH) * 8;
        T *d = dst + r * ld + c;
        if (r >= valid || c >= D) {
            *(uint4 *)d = make_uint4(0, 0, 0, 0);
        } else {
            const int64_t off = base + (int64_t)r * stride;
            if (al) {
                const int n = D - c < 8 ? D - c : 8;
                cp16(d, src + off + c, n * 2);
            } else {
                for (int e = 0; e < 8; e++) d[e] = c + e < D ? src[off + c + e] : dtraits<T>::from_f(0.0f);
            }
        }
    }
}

__device__ __forceinline__ float warp_sum(float x)
{
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
#endif /* __CUDACC__ */

/* ==== prep launches (prep.cu), used by every op file ==================================== */

/* Uploads cu_seqlens (varlen) and the compressed-row prefix into the workspace. */
void g_seq_setup(grun *g, int need_cmp);
/* The task map of one launch: dense -> per_seq, varlen -> a device prefix of units.
 * *total = tasks over all sequences (host). */
seqmap g_seqmap(grun *g, unitspec u, int64_t *total);
/* Units of spec u summed over the sequences (host). */
int64_t g_units_total(const nsa_problem *p, unitspec u);
/* A device prefix of units per sequence (varlen) or NULL (dense: s * units(T)). */
int64_t *g_prefix(grun *g, unitspec u, int64_t *total);

#endif
