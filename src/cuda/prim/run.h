/* prim/run.h -- the host side of one op call: the run state (stream, workspace arena with a
 * sizing dry run, first error), launch checks, and the strided tensor views the kernels take.
 * Every op's host code runs twice, once to size the workspace and once for real, through
 * cu_op_workspace / cu_op_run, so the size and the use of the workspace cannot disagree. */
#ifndef NSA_CUDA_PRIM_RUN_H
#define NSA_CUDA_PRIM_RUN_H

#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

extern "C" {
#include "../../internal.h"
#include "../../rules.h"
}
#include "../plan.h"

#define NSA_LOG2E 1.4426950408889634f
#define NSA_LN2 0.6931471805599453f

/* Every op runs its host code twice: once with dry = 1 to size the workspace (no CUDA call
 * is made, takes only count bytes), once for real. Carving and launching share one code
 * path, so the size and the use cannot disagree. The count saturates (size.h): once a take
 * overflows, `used` stays SIZE_MAX, which api.c refuses (NSA_STATUS_SIZE_OVERFLOW) before
 * a live pass could see it. */
typedef struct grun {
    cudaStream_t st;
    char *base;
    size_t used;
    size_t limit; /* live pass: the bytes the sizing pass counted, under NSA_CUDA_CHECK_WORKSPACE=1
                     (g_limit_to); else SIZE_MAX */
    int dry;
    nsa_status err;
    const nsa_problem *p;
    int32_t *cu;    /* device copy of cu_seqlens (varlen), else NULL */
    int64_t *cmp0;  /* device prefix of compressed rows per sequence (varlen), else NULL */
    cu_device dev;            /* the device's limits (live pass; all zero in the sizing pass) */
    int device;               /* the context's device */
    const cu_overrides *ovr;  /* the context's planner overrides */
    void *flex_cache;         /* the context's block-sparse kernel cache (live pass; NULL in the sizing pass) */
    /* The call's non-finite flag (one device int, zeroed where first taken: g_nf) and the
     * tensors already scanned into it (cu_scan_nonfinite: each once per call). */
    int *nf;
    int nf_taken, nf_nseen;
    const void *nf_seen[8];
} grun;

/* A live take past g->limit: the call fails (WORKSPACE_TOO_SMALL, naming both sizes) and
 * launches nothing more. */
void g_take_past(grun *g);

static inline void *g_take(grun *g, size_t bytes)
{
    const size_t at = nsa_size_align(g->used, 256);
    g->used = nsa_size_add(at, bytes);
    if (!g->dry && g->used > g->limit) {
        g_take_past(g);
        return NULL;
    }
    return g->dry || g->used == SIZE_MAX ? NULL : (void *)(g->base + at);
}

/* count elements of elem_bytes each: call sites pass counts (size.h), never their own products. */
static inline void *g_take_n(grun *g, size_t count, size_t elem_bytes)
{
    return g_take(g, nsa_size_mul(count, elem_bytes));
}

static inline int g_live(const grun *g) { return !g->dry && g->err == NSA_STATUS_SUCCESS; }

/* The first CUDA error of the call becomes its status; its detail names the call (the
 * source text `what`) and the runtime's own words. */
static inline void g_check_call(grun *g, cudaError_t e, const char *what)
{
    if (e == cudaSuccess || g->err != NSA_STATUS_SUCCESS) return;
    g->err = nsa_fail(NSA_STATUS_DEVICE_ERROR, "device: %.120s failed: %s (%s)", what, cudaGetErrorName(e),
                      cudaGetErrorString(e));
}
#define g_check(g, e) g_check_call((g), (e), #e)

/* After a launch: a bad configuration or a sticky error surfaces here. */
#define g_launched(g) g_check_call((g), cudaGetLastError(), "a kernel launch (cudaGetLastError)")

/* cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), made at most
 * once per kernel, device and size: the attribute stays with the kernel in the device's context,
 * and the call would otherwise cost host time on every launch (an inference step's budget is
 * tens of microseconds). A no-op outside the live pass. Only for kernels of the loaded binary,
 * whose addresses stay theirs for the process's life (not the runtime-compiled ones, whose
 * handles a later library may reuse). */
void g_smem_optin(grun *g, const void *fn, size_t smem);

/* The first failure of the call, with its detail (printf-style: what is not supported). */
static inline void g_fail(grun *g, nsa_status st, const char *fmt, ...)
{
    if (g->err != NSA_STATUS_SUCCESS) return;
    char buf[NSA_DETAIL_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    g->err = nsa_fail(st, "%s", buf);
}

static inline void g_zero(grun *g, void *p, size_t bytes)
{
    if (g_live(g) && bytes) g_check(g, cudaMemsetAsync(p, 0, bytes, g->st));
}

static inline int64_t cdiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

/* Run state of one op call (dry: sizing pass, ws unused); reads the device's limits in the
 * live pass. */
void g_init(grun *g, const nsa_context *ctx, const nsa_problem *p, void *ws, int dry);
/* Whether the loaded binary carries the sm_90a kernels of head-dim class D (64, 128, 192):
 * not a PTX JIT of the sm_80 build, whose Hopper bodies are empty. */
int cu_sm90_binary(int D);
/* (defined in the generated src/cuda/inst/range_hopper_d*.cu) */
int nsa_cu_sm90_ready_64(void);
int nsa_cu_sm90_ready_128(void);
int nsa_cu_sm90_ready_192(void);
/* fp32 scratch of n floats from the workspace (zeroed when asked); n from size.h's
 * arithmetic (e.g. nsa_size_elems). */
float *cu_take_f32(grun *g, size_t n, int zero);

/* Non-finite inputs (prim/nonfinite.cuh): when the call's flag is set the attention tiles stand
 * aside and the scalar kernels, which multiply only the pairs a row sees, compute the call;
 * finite calls run the tiles unchanged. g_nf: the flag (taken
 * and zeroed on first use, in both passes: the workspace layout). cu_scan_nonfinite: sets it
 * when view t, [n0, n1, n2, D] elements of its dtype, holds a NaN or an infinity (a tensor
 * already scanned in this call is skipped). The row-term kernels (dprep, the gate backward)
 * set it themselves for dout, o and the gates, whose every element they read anyway. */
int *g_nf(grun *g);
/* The flag as the tiles' parameter blocks take it: NULL (never set: no scalar kernels launched)
 * under NSA_CUDA_NONFINITE=0. */
const int *g_nf_tiles(grun *g);
void cu_scan_nonfinite(grun *g, const dview *t, int64_t n0, int64_t n1, int64_t n2, int64_t D);
/* The same for a saved lse [B, T, HQ] (f32), where -inf marks a row that saw no key (it gives
 * P = 0) and only a NaN is a non-finite input to the tiles. */
void cu_scan_lse(grun *g, const dview *lse, int64_t B, int64_t T, int64_t HQ);
/* The scan of q or k, the operands of the scores: cu_scan_nonfinite, and under the problem's
 * flex_rows (block-sparse attention's dense route) also any magnitude that could make a score
 * overflow f32 (|x| above L, max(scale, 1) DK L^2 = FLT_MAX / 4): the scalar kernels then compute the
 * call, and they keep a row of all -inf scores empty as the block-sparse engine does. */
void cu_scan_score_operand(grun *g, const dview *t, int64_t n0, int64_t n1, int64_t n2, int64_t D);

/* The two entry points of every op around its run function: the workspace size (the dry
 * pass's bytes plus alignment slack) and the live call (its first error, or SUCCESS). */
template <typename A>
static inline size_t cu_op_workspace(const nsa_context *ctx, const nsa_problem *p, void (*run)(grun *, const A *),
                                     const A *a)
{
    grun g;
    g_init(&g, ctx, p, NULL, 1);
    run(&g, a);
    return nsa_size_add(g.used, 256);
}

/* Under NSA_CUDA_CHECK_WORKSPACE=1 (ctx->cuda.check_ws): the live pass g may take only what
 * its op's workspace query answered, `sized`, less the alignment slack. */
static inline void g_limit_to(grun *g, size_t sized) { g->limit = sized >= 256 ? sized - 256 : 0; }

template <typename A>
static inline nsa_status cu_op_run(const nsa_context *ctx, const nsa_problem *p, void (*run)(grun *, const A *),
                                   const A *a, void *ws)
{
    grun g;
    g_init(&g, ctx, p, ws, 0);
    if (g.err != NSA_STATUS_SUCCESS) return g.err;
    if (ctx->cuda.check_ws) g_limit_to(&g, cu_op_workspace(ctx, p, run, a));
    run(&g, a);
    if (g.err == NSA_STATUS_SUCCESS) g_check(&g, cudaGetLastError());
    return g.err;
}

#endif
