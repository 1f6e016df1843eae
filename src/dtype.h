/* dtype.h -- float <-> f16 / bf16 conversion (round to nearest even, NaN kept), shared by
 * the CPU backend, the CLI and the tests. Host code only. */
#ifndef NSA_DTYPE_H
#define NSA_DTYPE_H

#include <stdint.h>
#include <string.h>

static inline uint32_t nsa_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float nsa_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float nsa_bf16_to_f32(uint16_t h) { return nsa_bits_f32((uint32_t)h << 16); }

static inline uint16_t nsa_f32_to_bf16(float f)
{
    uint32_t u = nsa_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float nsa_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return nsa_bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return nsa_bits_f32(sign);
        float f = (float)man * (1.0f / 16777216.0f); /* subnormal: man * 2^-24 */
        return sign ? -f : f;
    }
    return nsa_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t nsa_f32_to_f16(float f)
{
    uint32_t u = nsa_f32_bits(f), sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
    if (a < 0x38800000u) {                                     /* below 2^-14: subnormal or 0 */
        float af = nsa_bits_f32(a) * 16777216.0f;              /* value in units of 2^-24 */
        uint32_t m = (uint32_t)af;
        float rem = af - (float)m;
        if (rem > 0.5f || (rem == 0.5f && (m & 1u))) m++;
        return (uint16_t)(sign | m);
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

#endif
