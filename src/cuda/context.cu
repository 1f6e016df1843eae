/* context.cu -- CUDA availability and context set-up. Without a driver or a GPU the
 * runtime reports an error from cudaGetDeviceCount, which reads as "not available". */
#include "prim/common.cuh"
#include "cuda_backend.h"

int nsa_cuda_available(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* leave no error behind for the caller's own checks */
        return 0;
    }
    return n > 0;
}

nsa_status nsa_cuda_context_init(nsa_context *ctx)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return nsa_fail(NSA_STATUS_BACKEND_UNAVAILABLE, "desc.backend: cudaGetDeviceCount failed: %s (%s)",
                        cudaGetErrorName(e), cudaGetErrorString(e));
    }
    if (ctx->device >= n)
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "desc.device: %d, but only %d CUDA device(s) present", (int)ctx->device, n);
    if ((e = cudaSetDevice(ctx->device)) != cudaSuccess)
        return nsa_fail(NSA_STATUS_DEVICE_ERROR, "desc.device: cudaSetDevice(%d) failed: %s (%s)", (int)ctx->device,
                        cudaGetErrorName(e), cudaGetErrorString(e));
    cu_overrides_from_env(&ctx->cuda); /* read once: the planners never look at the environment */
    ctx->flex_cache = nsa_cuda_flex_cache_new();
    if (!ctx->flex_cache) return nsa_fail(NSA_STATUS_OUT_OF_MEMORY, "ctx: no memory for the kernel cache");
    return NSA_STATUS_SUCCESS;
}
