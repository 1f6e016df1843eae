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
    if (!dry) {
        if (cudaSetDevice(ctx->device) != cudaSuccess ||
            cudaDeviceGetAttribute(&g->smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device) != cudaSuccess ||
            cudaDeviceGetAttribute(&g->cc_major, cudaDevAttrComputeCapabilityMajor, ctx->device) != cudaSuccess)
            g->err = NSA_STATUS_DEVICE_ERROR;
    }
}

float *cu_take_f32(grun *g, int64_t n, int zero)
{
    float *x = (float *)g_take(g, (size_t)(n > 0 ? n : 1) * sizeof(float));
    if (zero) g_zero(g, x, (size_t)(n > 0 ? n : 0) * sizeof(float));
    return x;
}
