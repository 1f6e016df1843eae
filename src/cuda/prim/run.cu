/* prim/run.cu -- the run state of one op call (prim/run.h). */
#include "run.h"

void g_init(grun *g, const nsa_context *ctx, const nsa_problem *p, void *ws, int dry)
{
    memset(g, 0, sizeof *g);
    g->st = (cudaStream_t)ctx->stream;
    g->base = (char *)ws;
    g->dry = dry;
    g->err = NSA_STATUS_SUCCESS;
    g->p = p;
    g->ovr = &ctx->cuda;
    if (!dry) {
        g_check(g, cudaSetDevice(ctx->device));
        g_check(g, cudaDeviceGetAttribute(&g->dev.smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device));
        g_check(g, cudaDeviceGetAttribute(&g->dev.cc_major, cudaDevAttrComputeCapabilityMajor, ctx->device));
        if (g->dev.cc_major == 9)
            for (int i = 0; i < 3; i++) g->dev.sm90_ready[i] = cu_sm90_binary(i == 0 ? 64 : i == 1 ? 128 : 192);
    }
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
