/* devmem.c -- host or CUDA device memory behind one interface (see devmem.h). */
#define _POSIX_C_SOURCE 200809L

#include "devmem.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef NSA_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

static void default_fail(const char *reason)
{
    fprintf(stderr, "FAIL %s\n", reason);
    fflush(stdout), fflush(stderr);
    _exit(3);
}

static devmem_fail_fn g_fail = default_fail;

void devmem_set_fail(devmem_fail_fn fn) { g_fail = fn ? fn : default_fail; }

static void failf(const char *fmt, ...)
{
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    g_fail(msg);
    _exit(3); /* a hook that returned: stop anyway */
}

/* Does be's memory live on the device? Asking for CUDA memory without CUDA is a bug of the caller. */
static int on_device(nsa_backend be)
{
#ifdef NSA_WITH_CUDA
    return be == NSA_BACKEND_CUDA;
#else
    if (be == NSA_BACKEND_CUDA) failf("device memory asked for, but this build has no CUDA");
    return 0;
#endif
}

void *devmem_alloc(nsa_backend be, size_t bytes, const char *what)
{
    if (on_device(be)) {
#ifdef NSA_WITH_CUDA
        void *p = NULL;
        const cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
        if (e != cudaSuccess) failf("out of device memory allocating %zu bytes for %s (%s)", bytes, what, cudaGetErrorString(e));
        return p;
#endif
    }
    void *p = malloc(bytes ? bytes : 1);
    if (!p) failf("out of host memory allocating %zu bytes for %s", bytes, what);
    return p;
}

void devmem_free(nsa_backend be, void *p)
{
    if (on_device(be)) {
#ifdef NSA_WITH_CUDA
        cudaFree(p);
        return;
#endif
    }
    free(p);
}

void devmem_zero(nsa_backend be, void *p, size_t bytes)
{
    if (on_device(be)) {
#ifdef NSA_WITH_CUDA
        const cudaError_t e = cudaMemset(p, 0, bytes);
        if (e != cudaSuccess) failf("zeroing device memory failed: %s", cudaGetErrorString(e));
        return;
#endif
    }
    memset(p, 0, bytes);
}

void devmem_upload(nsa_backend be, void *dst, const void *host, size_t bytes)
{
    if (on_device(be)) {
#ifdef NSA_WITH_CUDA
        const cudaError_t e = cudaMemcpy(dst, host, bytes, cudaMemcpyHostToDevice);
        if (e != cudaSuccess) failf("copy to the device failed (an earlier kernel may have faulted): %s", cudaGetErrorString(e));
        return;
#endif
    }
    if (dst != host) memcpy(dst, host, bytes);
}

void devmem_download(nsa_backend be, void *host, const void *src, size_t bytes)
{
    if (on_device(be)) {
#ifdef NSA_WITH_CUDA
        const cudaError_t e = cudaMemcpy(host, src, bytes, cudaMemcpyDeviceToHost);
        if (e != cudaSuccess) failf("copy from the device failed (an earlier kernel may have faulted): %s", cudaGetErrorString(e));
        return;
#endif
    }
    if (host != src) memcpy(host, src, bytes);
}

void devmem_sync(nsa_backend be)
{
    if (on_device(be)) {
#ifdef NSA_WITH_CUDA
        const cudaError_t e = cudaDeviceSynchronize();
        if (e != cudaSuccess) failf("the device reported an error: %s", cudaGetErrorString(e));
#endif
    }
}

#ifdef NSA_WITH_CUDA
static void *sweep_alloc(size_t bytes) { return devmem_alloc(NSA_BACKEND_CUDA, bytes, "the sweep"); }
static void sweep_release(void *p) { devmem_free(NSA_BACKEND_CUDA, p); }
static void sweep_upload(void *dev, const void *host, size_t bytes) { devmem_upload(NSA_BACKEND_CUDA, dev, host, bytes); }
static void sweep_download(void *host, const void *dev, size_t bytes) { devmem_download(NSA_BACKEND_CUDA, host, dev, bytes); }
static const sweep_memory g_device = {sweep_alloc, sweep_release, sweep_upload, sweep_download};
#endif

const sweep_memory *devmem_sweep_memory(void)
{
#ifdef NSA_WITH_CUDA
    return &g_device;
#else
    return NULL;
#endif
}
