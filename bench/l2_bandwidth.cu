// l2_bandwidth.cu -- how many bytes per second the SMs can pull from L2 (and from HBM), the
// way the selected-attention tile (src/cuda/hopper.cuh sfw_kernel) pulls its K / V blocks:
// bulk copies (cp.async.bulk, the copy engine of TMA) of 16 KB pieces at scattered offsets of
// a buffer into shared-memory stages, completing on mbarriers. A buffer of a few MB stays in
// L2; one of 1 GB streams from HBM. This is the floor the selected branch is measured
// against in bench/NOTES.md (its 16 blocks of K and V per position and kv head are random
// under random inputs, so it can only move them, never reuse them).
//
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o build/l2_bandwidth bench/l2_bandwidth.cu
//   build/l2_bandwidth            # prints GB/s per buffer size and CTAs per SM
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e_ = (x);                                                                   \
        if (e_ != cudaSuccess) {                                                                \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

constexpr int PIECE = 16384; /* bytes per bulk copy: one 64-key K or V block of 128 bf16 columns */
constexpr int NS = 4;        /* stages in flight per CTA */

__device__ __forceinline__ uint32_t sa(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* One thread per CTA keeps NS bulk copies in flight over `per_cta` pieces at pseudo-random
 * offsets of buf (npieces of PIECE bytes); the sum of one word per piece keeps the copies live. */
__global__ void bulk_read(const unsigned char *buf, int64_t npieces, int per_cta, unsigned long long *sink)
{
    extern __shared__ __align__(128) unsigned char stage[];
    __shared__ __align__(8) uint64_t bar[NS];
    if (threadIdx.x != 0) return;
    for (int s = 0; s < NS; s++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&bar[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    uint64_t x = 0x9E3779B97F4A7C15ull * (blockIdx.x + 1);
    auto issue = [&](int s) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        const unsigned char *src = buf + (int64_t)(x % (uint64_t)npieces) * PIECE;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&bar[s])), "r"(PIECE) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         sa(stage + s * PIECE)),
                     "l"(src), "r"(PIECE), "r"(sa(&bar[s]))
                     : "memory");
    };
    unsigned long long acc = 0;
    for (int i = 0; i < NS && i < per_cta; i++) issue(i);
    for (int i = 0; i < per_cta; i++) {
        const int s = i % NS, ph = (i / NS) & 1;
        asm volatile("{\n.reg .pred p;\nW_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W_%=;\n}\n" ::"r"(
                         sa(&bar[s])),
                     "r"(ph)
                     : "memory");
        acc += *(volatile uint32_t *)(stage + s * PIECE);
        if (i + NS < per_cta) issue(s);
    }
    atomicAdd(sink, acc);
}

int main()
{
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
    const int64_t maxb = (int64_t)1 << 30;
    unsigned char *buf;
    unsigned long long *sink;
    CK(cudaMalloc(&buf, maxb));
    CK(cudaMalloc(&sink, 8));
    CK(cudaMemset(buf, 1, maxb));
    const size_t smem = (size_t)NS * PIECE;
    CK(cudaFuncSetAttribute(bulk_read, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    printf("%10s %8s %10s\n", "buffer MB", "CTAs/SM", "GB/s");
    for (int64_t mb : {4, 16, 32, 1024})
        for (int per_sm : {2, 4, 6, 8}) {
            const int64_t np = mb * 1024 * 1024 / PIECE;
            const int ctas = sms * per_sm, per_cta = 2048;
            std::vector<float> t;
            for (int r = 0; r < 12; r++) {
                CK(cudaEventRecord(a));
                bulk_read<<<ctas, 32, smem>>>(buf, np, per_cta, sink);
                CK(cudaEventRecord(b));
                CK(cudaEventSynchronize(b));
                CK(cudaGetLastError());
                float ms;
                CK(cudaEventElapsedTime(&ms, a, b));
                if (r >= 2) t.push_back(ms); /* after warm-up */
            }
            std::sort(t.begin(), t.end());
            const double bytes = (double)ctas * per_cta * PIECE;
            printf("%10lld %8d %10.0f\n", (long long)mb, per_sm, bytes / (t[t.size() / 2] * 1e-3) / 1e9);
        }
    return 0;
}
