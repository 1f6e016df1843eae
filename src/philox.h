/* philox.h -- Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as
 * 1, 2, 3", SC 2011; the Random123 constants) and the attention dropout mask of nsa.h section 5,
 * written once for the host and the device (NSA_HD): every backend draws the same bits. */
#ifndef NSA_PHILOX_H
#define NSA_PHILOX_H

#include <stdint.h>

#ifdef __CUDACC__
#define NSA_PHILOX_HD __host__ __device__ __forceinline__
#else
#define NSA_PHILOX_HD static inline
#endif

/* out = Philox4x32-10(ctr, key = (k0, k1)). */
NSA_PHILOX_HD void nsa_philox4x32_10(const uint32_t ctr[4], uint32_t k0, uint32_t k1, uint32_t out[4])
{
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    for (int round = 0; round < 10; round++) {
        if (round > 0) { /* the key schedule: bumped before every round but the first */
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

/* The keep threshold of dropout probability p in [0, 1): floor(p * 2^32), exact in double. */
NSA_PHILOX_HD uint32_t nsa_dropout_threshold(float p) { return (uint32_t)((double)p * 4294967296.0); }

/* The four random words serving keys 4*(j>>2) .. 4*(j>>2)+3 of row i of (b, hq) (nsa.h):
 * counter = (j >> 2, i, lo32(x), hi32(x)) with x = offset + b * HQ + hq, key = seed. */
NSA_PHILOX_HD void nsa_dropout_words(uint64_t seed, uint64_t offset, int64_t b, int64_t HQ, int64_t hq, int64_t i,
                                     int64_t j, uint32_t out[4])
{
    const uint64_t x = offset + (uint64_t)(b * HQ + hq);
    const uint32_t ctr[4] = {(uint32_t)((uint64_t)j >> 2), (uint32_t)i, (uint32_t)x, (uint32_t)(x >> 32)};
    nsa_philox4x32_10(ctr, (uint32_t)seed, (uint32_t)(seed >> 32), out);
}

#endif
