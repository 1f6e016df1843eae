/* gpu_bench.c -- CUDA-event timings of the whole NSA forward and backward on the GPU
 * (CUDA builds only: build/nsa_gpu_bench). Paper config by default: HQ=64, H=4, D=128,
 * bf16, l=32, d=16, l'=64, n=16, w=512; every branch gated on; the default mean-pooled
 * compression. Per length: the median of --reps timed calls after 2 warm-ups, for the full
 * forward/backward and for each branch alone (the other gates absent; the selected branch
 * alone reuses the full forward's selection). Inputs are random (never zeros).
 *
 *   nsa_gpu_bench [--T 8192,16384,32768,65536] [--HQ 64] [--H 4] [--DK 128] [--DV 128]
 *                 [--config paper|fla] [--reps 10] [--f16] [--profile]                    */
#define _POSIX_C_SOURCE 200809L

#include "nsa.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void need_cuda(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        fprintf(stderr, "gpu_bench: %s: %s\n", what, cudaGetErrorString(e));
        exit(1);
    }
}

static void need(nsa_status st, const char *what)
{
    if (st != NSA_STATUS_SUCCESS) {
        fprintf(stderr, "gpu_bench: %s: %s\n", what, nsa_status_string(st));
        exit(1);
    }
}

static uint16_t to_half(float f, int bf16)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if (bf16) return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    /* f16 for |f| in the normal range of the random data (no inf/nan/subnormal handling needed) */
    const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a < 0x38800000u) return (uint16_t)sign;
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

/* A pool of random values (normal * scale + shift) tiled with shifting offsets into n
 * elements: cheap to make, never zero, and no two rows of a tensor alike. */
static void *dev_random(int64_t n, float scale, float shift, int bf16, uint64_t seed)
{
    const int64_t pool_n = 1 << 22;
    uint16_t *pool = (uint16_t *)malloc((size_t)pool_n * 2), *host = (uint16_t *)malloc((size_t)(n > 0 ? n : 1) * 2);
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < pool_n; i++) {
        float acc = 0; /* Irwin-Hall: sum of 4 uniforms, centred: ~normal */
        for (int k = 0; k < 4; k++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            acc += (float)(s >> 40) * (1.0f / 16777216.0f);
        }
        pool[i] = to_half((acc - 2.0f) * 1.7320508f * scale + shift, bf16);
    }
    for (int64_t i = 0; i < n;) {
        const int64_t off = (i * 7919 + 13) % (pool_n / 2), m = n - i < pool_n / 2 ? n - i : pool_n / 2;
        memcpy(host + i, pool + off, (size_t)m * 2);
        i += m;
    }
    void *d = NULL;
    need_cuda(cudaMalloc(&d, (size_t)(n > 0 ? n : 1) * 2), "cudaMalloc");
    need_cuda(cudaMemcpy(d, host, (size_t)n * 2, cudaMemcpyHostToDevice), "upload");
    free(pool);
    free(host);
    return d;
}

static void *dev_zeros(size_t bytes)
{
    void *d = NULL;
    need_cuda(cudaMalloc(&d, bytes ? bytes : 1), "cudaMalloc");
    need_cuda(cudaMemset(d, 0, bytes ? bytes : 1), "memset");
    return d;
}

static int cmp_f(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

typedef nsa_status (*run_fn)(nsa_context *, const void *, void *, size_t);
static nsa_status run_fwd(nsa_context *c, const void *a, void *w, size_t n) { return nsa_forward(c, (const nsa_forward_args *)a, w, n); }
static nsa_status run_bwd(nsa_context *c, const void *a, void *w, size_t n) { return nsa_backward(c, (const nsa_backward_args *)a, w, n); }

/* median ms of reps calls, after 2 warm-ups */
static float time_ms(nsa_context *ctx, run_fn fn, const void *args, void *ws, size_t wsb, int reps)
{
    cudaEvent_t e0, e1;
    need_cuda(cudaEventCreate(&e0), "event");
    need_cuda(cudaEventCreate(&e1), "event");
    for (int i = 0; i < 2; i++) need(fn(ctx, args, ws, wsb), "warm-up call");
    need_cuda(cudaDeviceSynchronize(), "warm-up");
    float t[64];
    if (reps > 64) reps = 64;
    for (int i = 0; i < reps; i++) {
        need_cuda(cudaEventRecord(e0, 0), "record");
        need(fn(ctx, args, ws, wsb), "timed call");
        need_cuda(cudaEventRecord(e1, 0), "record");
        need_cuda(cudaEventSynchronize(e1), "sync");
        need_cuda(cudaEventElapsedTime(&t[i], e0, e1), "elapsed");
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    qsort(t, (size_t)reps, sizeof(float), cmp_f);
    return t[reps / 2];
}

int main(int argc, char **argv)
{
    int64_t Ts[16] = {8192, 16384, 32768, 65536};
    int nT = 4, reps = 10, bf16 = 1, fla = 0, profile = 0;
    int64_t HQ = 64, H = 4, DK = 128, DV = 128;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--T") && i + 1 < argc) {
            nT = 0;
            for (char *s = strtok(argv[++i], ","); s && nT < 16; s = strtok(NULL, ",")) Ts[nT++] = strtoll(s, NULL, 10);
        } else if (!strcmp(argv[i], "--HQ") && i + 1 < argc) HQ = strtoll(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--H") && i + 1 < argc) H = strtoll(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--DK") && i + 1 < argc) DK = strtoll(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--DV") && i + 1 < argc) DV = strtoll(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--config") && i + 1 < argc) fla = !strcmp(argv[++i], "fla");
        else if (!strcmp(argv[i], "--f16")) bf16 = 0;
        else if (!strcmp(argv[i], "--profile")) profile = 1; /* one forward + backward, for ncu */
        else {
            fprintf(stderr, "usage: nsa_gpu_bench [--T a,b,..] [--HQ n] [--H n] [--DK n] [--DV n] [--config paper|fla] [--reps n] [--f16]\n");
            return 2;
        }
    }
    struct cudaDeviceProp prop;
    need_cuda(cudaGetDeviceProperties(&prop, 0), "device properties");
    nsa_config cfg = nsa_config_default();
    if (fla) cfg.cmp_len = cfg.cmp_stride = cfg.slc_block = 64;
    const nsa_dtype dt = bf16 ? NSA_DTYPE_BF16 : NSA_DTYPE_F16;
    printf("gpu_bench: %s (%d SMs), %s, HQ=%lld H=%lld DK=%lld DV=%lld, config %s (l=%lld d=%lld l'=%lld n=%lld w=%lld), "
           "median of %d\n",
           prop.name, prop.multiProcessorCount, bf16 ? "bf16" : "f16", (long long)HQ, (long long)H, (long long)DK,
           (long long)DV, fla ? "fla" : "paper", (long long)cfg.cmp_len, (long long)cfg.cmp_stride,
           (long long)cfg.slc_block, (long long)cfg.slc_topk, (long long)cfg.window, reps);
    nsa_context_desc d;
    memset(&d, 0, sizeof d);
    d.backend = NSA_BACKEND_CUDA;
    nsa_context *ctx = NULL;
    need(nsa_context_create(&ctx, &d), "context");
    printf("%8s %9s %9s | %9s %9s %9s | %9s %9s %9s  (ms)\n", "T", "fwd", "bwd", "fwd_cmp", "fwd_slc", "fwd_swa",
           "bwd_cmp", "bwd_slc", "bwd_swa");
    for (int it = 0; it < nT; it++) {
        const int64_t T = Ts[it], n = cfg.slc_topk;
        void *q = dev_random(T * HQ * DK, 1.0f, 0.0f, bf16, 1), *k = dev_random(T * H * DK, 1.0f, 0.0f, bf16, 2);
        void *v = dev_random(T * H * DV, 1.0f, 0.0f, bf16, 3), *dout = dev_random(T * HQ * DV, 1.0f, 0.0f, bf16, 4);
        void *gt[3];
        for (int x = 0; x < 3; x++) gt[x] = dev_random(T * HQ, 0.2f, 0.5f, bf16, 5 + x);
        void *so[3], *sl[3], *dg[3];
        for (int x = 0; x < 3; x++) {
            so[x] = dev_zeros((size_t)(T * HQ * DV) * 2);
            sl[x] = dev_zeros((size_t)(T * HQ) * 4);
            dg[x] = dev_zeros((size_t)(T * HQ) * 2);
        }
        void *idx = dev_zeros((size_t)(T * H * n) * 4), *o = dev_zeros((size_t)(T * HQ * DV) * 2);
        void *dq = dev_zeros((size_t)(T * HQ * DK) * 2), *dk = dev_zeros((size_t)(T * H * DK) * 2);
        void *dv = dev_zeros((size_t)(T * H * DV) * 2);

        nsa_forward_args f;
        memset(&f, 0, sizeof f);
        f.q = nsa_tensor_4d(q, dt, 1, T, HQ, DK);
        f.k = nsa_tensor_4d(k, dt, 1, T, H, DK);
        f.v = nsa_tensor_4d(v, dt, 1, T, H, DV);
        f.g_cmp = nsa_tensor_3d(gt[0], dt, 1, T, HQ);
        f.g_slc = nsa_tensor_3d(gt[1], dt, 1, T, HQ);
        f.g_swa = nsa_tensor_3d(gt[2], dt, 1, T, HQ);
        f.o = nsa_tensor_4d(o, dt, 1, T, HQ, DV);
        f.saved.block_indices = nsa_tensor_4d(idx, NSA_DTYPE_I32, 1, T, H, n);
        f.saved.o_cmp = nsa_tensor_4d(so[0], dt, 1, T, HQ, DV);
        f.saved.o_slc = nsa_tensor_4d(so[1], dt, 1, T, HQ, DV);
        f.saved.o_swa = nsa_tensor_4d(so[2], dt, 1, T, HQ, DV);
        f.saved.lse_cmp = nsa_tensor_3d(sl[0], NSA_DTYPE_F32, 1, T, HQ);
        f.saved.lse_slc = nsa_tensor_3d(sl[1], NSA_DTYPE_F32, 1, T, HQ);
        f.saved.lse_swa = nsa_tensor_3d(sl[2], NSA_DTYPE_F32, 1, T, HQ);
        f.config = cfg;
        nsa_backward_args b;
        memset(&b, 0, sizeof b);
        b.fwd = f;
        b.dout = nsa_tensor_4d(dout, dt, 1, T, HQ, DV);
        b.dq = nsa_tensor_4d(dq, dt, 1, T, HQ, DK);
        b.dk = nsa_tensor_4d(dk, dt, 1, T, H, DK);
        b.dv = nsa_tensor_4d(dv, dt, 1, T, H, DV);
        b.dg_cmp = nsa_tensor_3d(dg[0], dt, 1, T, HQ);
        b.dg_slc = nsa_tensor_3d(dg[1], dt, 1, T, HQ);
        b.dg_swa = nsa_tensor_3d(dg[2], dt, 1, T, HQ);

        /* one branch alone: the other gates absent; the selected branch reads the full
         * forward's selection as caller indices */
        nsa_forward_args fb[3];
        nsa_backward_args bb[3];
        for (int x = 0; x < 3; x++) {
            fb[x] = f;
            nsa_tensor *gs[3] = {&fb[x].g_cmp, &fb[x].g_slc, &fb[x].g_swa};
            for (int y = 0; y < 3; y++)
                if (y != x) memset(gs[y], 0, sizeof(nsa_tensor));
            if (x == 1) {
                fb[x].block_indices = f.saved.block_indices;
                memset(&fb[x].saved.block_indices, 0, sizeof(nsa_tensor));
            }
            bb[x] = b;
            bb[x].fwd = fb[x];
            nsa_tensor *dgs[3] = {&bb[x].dg_cmp, &bb[x].dg_slc, &bb[x].dg_swa};
            for (int y = 0; y < 3; y++)
                if (y != x) memset(dgs[y], 0, sizeof(nsa_tensor));
        }

        size_t wsb = 0, w = 0;
        need(nsa_forward_workspace_size(ctx, &f, &w), "forward workspace"), wsb = w > wsb ? w : wsb;
        need(nsa_backward_workspace_size(ctx, &b, &w), "backward workspace"), wsb = w > wsb ? w : wsb;
        for (int x = 0; x < 3; x++) {
            need(nsa_forward_workspace_size(ctx, &fb[x], &w), "forward workspace"), wsb = w > wsb ? w : wsb;
            need(nsa_backward_workspace_size(ctx, &bb[x], &w), "backward workspace"), wsb = w > wsb ? w : wsb;
        }
        void *ws = dev_zeros(wsb);
        if (profile) {
            need(nsa_forward(ctx, &f, ws, wsb), "forward");
            need(nsa_backward(ctx, &b, ws, wsb), "backward");
            need_cuda(cudaDeviceSynchronize(), "profile run");
            printf("%8lld profiled one forward + backward\n", (long long)T);
            return 0;
        }
        const float tf = time_ms(ctx, run_fwd, &f, ws, wsb, reps);
        const float tb = time_ms(ctx, run_bwd, &b, ws, wsb, reps);
        float tfb[3], tbb[3];
        for (int x = 0; x < 3; x++) {
            tfb[x] = time_ms(ctx, run_fwd, &fb[x], ws, wsb, reps);
            tbb[x] = time_ms(ctx, run_bwd, &bb[x], ws, wsb, reps);
        }
        printf("%8lld %9.3f %9.3f | %9.3f %9.3f %9.3f | %9.3f %9.3f %9.3f   ws %.2f GB\n", (long long)T, tf, tb, tfb[0],
               tfb[1], tfb[2], tbb[0], tbb[1], tbb[2], (double)wsb / 1e9);
        fflush(stdout);
        void *all[] = {q, k, v, dout, gt[0], gt[1], gt[2], so[0], so[1], so[2], sl[0], sl[1], sl[2], dg[0], dg[1], dg[2],
                       idx, o, dq, dk, dv, ws};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) cudaFree(all[i]);
    }
    nsa_context_destroy(ctx);
    return 0;
}
