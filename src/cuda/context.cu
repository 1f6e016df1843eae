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
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return NSA_STATUS_BACKEND_UNAVAILABLE;
    }
    if (ctx->device >= n) return NSA_STATUS_BAD_ARGUMENT;
    if (cudaSetDevice(ctx->device) != cudaSuccess) return NSA_STATUS_DEVICE_ERROR;
    cu_overrides_from_env(&ctx->cuda); /* read once: the planners never look at the environment */
    return NSA_STATUS_SUCCESS;
}
