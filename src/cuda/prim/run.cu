/* prim/run.cu -- the run state of one op call (prim/run.h). */
#include "run.h"

#include <pthread.h>

void g_init(grun *g, const nsa_context *ctx, const nsa_problem *p, void *ws, int dry)
{
    memset(g, 0, sizeof *g);
    g->st = (cudaStream_t)ctx->stream;
    g->base = (char *)ws;
    g->dry = dry;
    g->err = NSA_STATUS_SUCCESS;
    g->p = p;
    g->ovr = &ctx->cuda;
    g->device = ctx->device;
    g->limit = SIZE_MAX;
    if (!dry) {
        g->flex_cache = ctx->flex_cache;
        g_check(g, cudaSetDevice(ctx->device));
        g_check(g, cudaDeviceGetAttribute(&g->dev.smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device));
        g_check(g, cudaDeviceGetAttribute(&g->dev.cc_major, cudaDevAttrComputeCapabilityMajor, ctx->device));
        if (g->dev.cc_major == 9)
            for (int i = 0; i < 3; i++) g->dev.sm90_ready[i] = cu_sm90_binary(i == 0 ? 64 : i == 1 ? 128 : 192);
    }
}

void g_take_past(grun *g)
{
    g_fail(g, NSA_STATUS_WORKSPACE_TOO_SMALL, "workspace: this call takes %zu bytes, past the %zu its sizing pass "
           "counted (an internal error: a workspace take that depends on the device)", g->used, g->limit);
}

/* The kernels whose shared-memory limit this process has raised, per device (g_smem_optin). */
enum { OPTIN_SLOTS = 256 };
static struct {
    const void *fn;
    int device, smem;
} g_optin[OPTIN_SLOTS];
static int g_optin_n;
static pthread_mutex_t g_optin_lock = PTHREAD_MUTEX_INITIALIZER;

void g_smem_optin(grun *g, const void *fn, size_t smem)
{
    if (!g_live(g)) return;
    pthread_mutex_lock(&g_optin_lock);
    int at = -1;
    for (int i = 0; i < g_optin_n && at < 0; i++)
        if (g_optin[i].fn == fn && g_optin[i].device == g->device) at = i;
    const int done = at >= 0 && (size_t)g_optin[at].smem >= smem;
    pthread_mutex_unlock(&g_optin_lock);
    if (done) return;
    const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    g_check_call(g, e, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    if (e != cudaSuccess) return;
    pthread_mutex_lock(&g_optin_lock);
    if (at < 0 && g_optin_n < OPTIN_SLOTS) at = g_optin_n++; /* (a full table: the call is made every time) */
    if (at >= 0 && (g_optin[at].fn != fn || g_optin[at].device != g->device || (size_t)g_optin[at].smem < smem))
        g_optin[at].fn = fn, g_optin[at].device = g->device, g_optin[at].smem = (int)smem;
    pthread_mutex_unlock(&g_optin_lock);
}

/* whether the loaded binary carries the sm_90a kernels of head-dim class D (asked once per
 * class and process) */
int cu_sm90_binary(int D)
{
    static int ready[3] = {-1, -1, -1};
    const int i = cu_class_index(D);
    if (ready[i] < 0) ready[i] = i == 0 ? nsa_cu_sm90_ready_64() : i == 1 ? nsa_cu_sm90_ready_128() : nsa_cu_sm90_ready_192();
    return ready[i];
}

float *cu_take_f32(grun *g, size_t n, int zero)
{
    float *x = (float *)g_take_n(g, n > 0 ? n : 1, sizeof(float));
    if (zero) g_zero(g, x, nsa_size_mul(n, sizeof(float)));
    return x;
}
