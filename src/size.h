/* size.h -- saturating size arithmetic: the one way the library multiplies and adds sizes
 * (element counts, byte counts, workspace offsets), in the front end, the CPU backend and
 * the CUDA host code alike (plain C, header only).
 *
 * A result that does not fit size_t is SIZE_MAX, and SIZE_MAX stays SIZE_MAX through every
 * later step (even times 0): no buffer can hold SIZE_MAX bytes, so a size that ends as
 * SIZE_MAX means that something on the way overflowed, and one check at the end (api.c:
 * NSA_STATUS_SIZE_OVERFLOW) catches it wherever it happened. */
#ifndef NSA_SIZE_H
#define NSA_SIZE_H

#include <stddef.h>
#include <stdint.h>

/* a * b, or SIZE_MAX when that overflows or either factor already did. */
static inline size_t nsa_size_mul(size_t a, size_t b)
{
    if (a == SIZE_MAX || b == SIZE_MAX) return SIZE_MAX;
    if (a != 0 && b > SIZE_MAX / a) return SIZE_MAX;
    return a * b;
}

/* a + b, or SIZE_MAX when that overflows (an addend that is SIZE_MAX always does). */
static inline size_t nsa_size_add(size_t a, size_t b) { return b > SIZE_MAX - a ? SIZE_MAX : a + b; }

/* a rounded up to a multiple of `align` (a power of two); SIZE_MAX stays SIZE_MAX, which the
 * mask alone would round down to a plausible size. */
static inline size_t nsa_size_align(size_t a, size_t align)
{
    const size_t up = nsa_size_add(a, align - 1);
    return up == SIZE_MAX ? SIZE_MAX : up & ~(align - 1);
}

/* A count held in int64 as a size: a negative one (never a size) or one past size_t (32-bit
 * hosts) reads as an overflow. */
static inline size_t nsa_size_of(int64_t v)
{
    if (v < 0) return SIZE_MAX;
#if SIZE_MAX < INT64_MAX
    if (v >= (int64_t)SIZE_MAX) return SIZE_MAX;
#endif
    return (size_t)v;
}

/* Elements of an [a, b, c, d] block of int64 dims (1 for a dim it lacks). */
static inline size_t nsa_size_elems(int64_t a, int64_t b, int64_t c, int64_t d)
{
    return nsa_size_mul(nsa_size_mul(nsa_size_of(a), nsa_size_of(b)), nsa_size_mul(nsa_size_of(c), nsa_size_of(d)));
}

#endif
