/* gpu_wgmma.cu -- unit test of the Hopper primitives of src/cuda/prim (wgmma.cuh, tma.cuh) on the GPU: the
 * swizzled tile loaders, the wgmma descriptors and the generated wgmma wrappers, exactly as
 * qwg_kernel uses them:
 *   S = Q K^T   Q [64 x D], K [128 x D], both K-major from shared memory (SS);
 *   O = P V     P [64 x 128] from registers in the accumulator layout, V [128 x D] MN-major
 *               from shared memory (RS, transposed B);
 * for D = 64 and 128, bf16 and f16 (and 192, bf16), against a float64 product on the host. A layout mistake
 * shows as a wrong product here before it shows as a wrong attention in the sweep.
 * Prints one line per case and "N passed, N failed"; exit status 1 on any failure, 2 when the
 * device is not a Hopper (nothing to test). */
#include "../src/cuda/prim/softmax.cuh"
#include "../src/cuda/prim/wgmma.cuh"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x)                                                                                    \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));          \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)

/* One warpgroup: S [64 x 128] = Q K^T and O [64 x D] = P V, written back row-major. */
template <int DP, typename T>
__global__ void __launch_bounds__(128) probe_kernel(const T *q, const T *k, const T *p, const T *v, float *s_out,
                                                    float *o_out)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BN = 128, NT = BN / 8, KT = DP / 16;
    extern __shared__ unsigned char raw[];
    unsigned char *sm = (unsigned char *)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
    unsigned char *Qs = sm, *Ks = Qs + 64 * DP * 2, *Vs = Ks + BN * DP * 2;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    sw_load_lin<T, DP, 64, 128>(Qs, q, 0, DP, 64, tid);
    sw_load_lin<T, DP, BN, 128>(Ks, k, 0, DP, BN, tid);
    sw_load_lin<T, DP, BN, 128>(Vs, v, 0, DP, BN, tid);
    cp_commit();
    cp_wait<0>();
    fence_async_smem();
    __syncthreads();

    float S[NT][4];
    wg_fence();
    for (int kk = 0; kk < KT; kk++) {
        const uint64_t da = wg_desc(Qs + (kk >> 2) * 64 * 128 + (kk & 3) * 32, 16, 1024);
        const uint64_t db = wg_desc(Ks + (kk >> 2) * BN * 128 + (kk & 3) * 32, 16, 1024);
        wgmma_op<T, BN>::template ss<0>(&S[0][0], da, db, kk > 0);
    }
    wg_commit();
    wg_wait<0>();
    const int ra = warp * 16 + (lane >> 2);
    for (int nt = 0; nt < NT; nt++)
        for (int e = 0; e < 4; e++) s_out[(ra + (e >> 1) * 8) * BN + nt * 8 + 2 * (lane & 3) + (e & 1)] = S[nt][e];

    /* P in the accumulator layout, packed into A fragments as qwg_kernel does */
    for (int nt = 0; nt < NT; nt++)
        for (int e = 0; e < 4; e++)
            S[nt][e] = dtraits<T>::to_f(p[(ra + (e >> 1) * 8) * BN + nt * 8 + 2 * (lane & 3) + (e & 1)]);
    uint32_t pa[BN / 16][4];
    for (int k2 = 0; k2 < BN / 16; k2++) sc_frag_a<T>(pa[k2], S[2 * k2], S[2 * k2 + 1]);
    float O[DP / 8][4];
    for (int i = 0; i < DP / 8; i++) O[i][0] = O[i][1] = O[i][2] = O[i][3] = 0.0f;
    wg_fence();
    for (int k2 = 0; k2 < BN / 16; k2++)
        wgmma_op<T, DP>::template rs<1>(&O[0][0], pa[k2], wg_desc(Vs + k2 * 16 * 128, BN * 128, 1024), 1);
    wg_commit();
    wg_wait<0>();
    for (int nt = 0; nt < DP / 8; nt++)
        for (int e = 0; e < 4; e++) o_out[(ra + (e >> 1) * 8) * DP + nt * 8 + 2 * (lane & 3) + (e & 1)] = O[nt][e];
#endif
}

static float rnd(unsigned *s)
{
    *s = *s * 1664525u + 1013904223u;
    return ((*s >> 8) & 0xFFFF) / 32768.0f - 1.0f;
}

template <typename T> static T to_t(float x);
template <> __nv_bfloat16 to_t<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __half to_t<__half>(float x) { return __float2half(x); }
template <typename T> static float from_t(T x);
template <> float from_t<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> float from_t<__half>(__half x) { return __half2float(x); }

template <int DP, typename T>
static int run_case(const char *name)
{
    const int BN = 128;
    const size_t nq = 64 * DP, nk = BN * DP, np = 64 * BN;
    T *hq = (T *)malloc(nq * sizeof(T)), *hk = (T *)malloc(nk * sizeof(T)), *hv = (T *)malloc(nk * sizeof(T));
    T *hp = (T *)malloc(np * sizeof(T));
    float *hs = (float *)malloc(np * 4), *ho = (float *)malloc(nq * 4);
    unsigned seed = 12345u + DP;
    for (size_t i = 0; i < nq; i++) hq[i] = to_t<T>(rnd(&seed));
    for (size_t i = 0; i < nk; i++) hk[i] = to_t<T>(rnd(&seed)), hv[i] = to_t<T>(rnd(&seed));
    for (size_t i = 0; i < np; i++) hp[i] = to_t<T>(0.5f + 0.5f * rnd(&seed));
    T *dq, *dk, *dv, *dp;
    float *ds, *dout;
    CK(cudaMalloc(&dq, nq * sizeof(T)));
    CK(cudaMalloc(&dk, nk * sizeof(T)));
    CK(cudaMalloc(&dv, nk * sizeof(T)));
    CK(cudaMalloc(&dp, np * sizeof(T)));
    CK(cudaMalloc(&ds, np * 4));
    CK(cudaMalloc(&dout, nq * 4));
    CK(cudaMemcpy(dq, hq, nq * sizeof(T), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dk, hk, nk * sizeof(T), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv, hv, nk * sizeof(T), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dp, hp, np * sizeof(T), cudaMemcpyHostToDevice));
    const int smem = 1024 + (64 + 2 * BN) * DP * 2;
    CK(cudaFuncSetAttribute(probe_kernel<DP, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    probe_kernel<DP, T><<<1, 128, smem>>>(dq, dk, dp, dv, ds, dout);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(hs, ds, np * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ho, dout, nq * 4, cudaMemcpyDeviceToHost));
    double es = 0, eo = 0, ms = 0, mo = 0;
    for (int i = 0; i < 64; i++)
        for (int j = 0; j < BN; j++) {
            double r = 0;
            for (int d = 0; d < DP; d++) r += (double)from_t(hq[i * DP + d]) * from_t(hk[j * DP + d]);
            es = fmax(es, fabs(r - hs[i * BN + j]));
            ms = fmax(ms, fabs(r));
        }
    for (int i = 0; i < 64; i++)
        for (int d = 0; d < DP; d++) {
            double r = 0;
            for (int j = 0; j < BN; j++) r += (double)from_t(hp[i * BN + j]) * from_t(hv[j * DP + d]);
            eo = fmax(eo, fabs(r - ho[i * DP + d]));
            mo = fmax(mo, fabs(r));
        }
    /* fp32 accumulation of exact products: errors ~1e-6 of the magnitude; a layout error is O(1) */
    const int ok = es <= 1e-4 * ms && eo <= 1e-4 * mo;
    printf("%s %s D=%d: S = Q K^T max err %.3g of %.3g, O = P V max err %.3g of %.3g\n", ok ? "ok  " : "FAIL", name, DP,
           es, ms, eo, mo);
    cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dp), cudaFree(ds), cudaFree(dout);
    free(hq), free(hk), free(hv), free(hp), free(hs), free(ho);
    return ok;
}

int main(void)
{
    int dev = 0, major = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, probe_kernel<128, __nv_bfloat16>));
    if (major != 9 || fa.ptxVersion < 90) {
        printf("wgmma: not a Hopper device or no sm_90a code: nothing to test\n0 passed, 0 failed\n");
        return 2;
    }
    int pass = 0, fail = 0;
    (run_case<128, __nv_bfloat16>("bf16") ? pass : fail)++;
    (run_case<64, __nv_bfloat16>("bf16") ? pass : fail)++;
    (run_case<128, __half>("f16 ") ? pass : fail)++;
    (run_case<64, __half>("f16 ") ? pass : fail)++;
    (run_case<192, __nv_bfloat16>("bf16") ? pass : fail)++; /* O = P V with N = 192 (the dQ of DK 192) */
    printf("%d passed, %d failed\n", pass, fail);
    return fail ? 1 : 0;
}
