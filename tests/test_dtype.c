/* test_dtype.c -- src/dtype.h, the one f16 / bf16 conversion of the library, the CLI and the
 * tests, against the formats' definitions computed here in double arithmetic: every 16-bit
 * pattern to f32 (exhaustive), and f32 to 16 bits at every representable value, every
 * midpoint between neighbours (ties to even) and one f32 ulp either side of both, random f32
 * patterns, subnormals of both formats, overflow to inf, and NaN (quiet, sign kept). */
#include "harness.h"
#include "nsa.h"
#include "../src/dtype.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void test_dtype_all(void);

/* A 16-bit binary float: 1 sign bit, ebits exponent bits, mbits mantissa bits. */
typedef struct fmt {
    const char *name;
    int ebits, mbits;
    float (*to_f32)(uint16_t);
    uint16_t (*from_f32)(float);
} fmt;

static int fmt_bias(const fmt *f) { return (1 << (f->ebits - 1)) - 1; }
static uint16_t fmt_inf(const fmt *f) { return (uint16_t)(((1 << f->ebits) - 1) << f->mbits); }
static int fmt_is_nan(const fmt *f, uint16_t h) { return (h & 0x7fff) > fmt_inf(f); }

/* The value of pattern h by the format's definition (NaN patterns: NaN). */
static double decode(const fmt *f, uint16_t h)
{
    const int e = (h >> f->mbits) & ((1 << f->ebits) - 1), m = h & ((1 << f->mbits) - 1);
    double v;
    if (e == (1 << f->ebits) - 1) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp((double)m, 1 - fmt_bias(f) - f->mbits); /* subnormal */
    else v = ldexp((double)((1 << f->mbits) + m), e - fmt_bias(f) - f->mbits);
    return (h & 0x8000) ? -v : v;
}

/* x (not NaN) rounded to the format, to nearest with ties to even, as a pattern. */
static uint16_t encode(const fmt *f, double x)
{
    const uint16_t sign = signbit(x) ? 0x8000 : 0;
    const double a = fabs(x);
    const int emin = 1 - fmt_bias(f), emax = fmt_bias(f);
    if (isinf(a)) return sign | fmt_inf(f);
    int e = 0;
    frexp(a, &e); /* 2^(e-1) <= a < 2^e */
    const int E = a == 0 || e - 1 < emin ? emin : e - 1;
    const double q = ldexp(1.0, E - f->mbits); /* the spacing of the format at a */
    const double v = rint(a / q) * q;          /* a / q is exact; rint rounds half to even */
    if (v == 0) return sign;
    if (v >= ldexp(1.0, emax + 1)) return sign | fmt_inf(f);
    if (v < ldexp(1.0, emin)) return sign | (uint16_t)(v / ldexp(1.0, emin - f->mbits));
    frexp(v, &e);
    const int m = (int)(v / ldexp(1.0, e - 1 - f->mbits)) - (1 << f->mbits);
    return (uint16_t)(sign | ((e - 1 + fmt_bias(f)) << f->mbits) | m);
}

static uint32_t bits_of(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static float float_of(uint32_t u)
{
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* Mismatch counter of one category: the first few are described. */
typedef struct tally {
    long bad, total;
    char first[200];
} tally;

static void tally_add(tally *t, int ok, const char *fmt_, ...) __attribute__((format(printf, 3, 4)));
static void tally_add(tally *t, int ok, const char *fmt_, ...)
{
    t->total++;
    if (ok) return;
    if (t->bad++ == 0) {
        va_list ap;
        va_start(ap, fmt_);
        vsnprintf(t->first, sizeof t->first, fmt_, ap);
        va_end(ap);
    }
}

static void tally_check(const tally *t, const fmt *f, const char *what)
{
    char msg[400];
    snprintf(msg, sizeof msg, "%s %s: %ld of %ld wrong, first: %s", f->name, what, t->bad, t->total, t->first);
    harness_record(t->bad == 0, __FILE__, __LINE__, what, msg);
}

/* f32 -> 16 bits of one non-NaN input against encode(). */
static void check_round(const fmt *f, tally *t, float x)
{
    const uint16_t want = encode(f, (double)x), got = f->from_f32(x);
    tally_add(t, got == want, "%a (0x%08x) -> 0x%04x, want 0x%04x", (double)x, bits_of(x), got, want);
}

static void check_format(const fmt *f)
{
    /* every pattern to f32: the defined value, zeros with their sign, NaN with sign and payload */
    tally to32 = {0, 0, ""}, trip = {0, 0, ""};
    for (uint32_t i = 0; i < 65536; i++) {
        const uint16_t h = (uint16_t)i;
        const float got = f->to_f32(h);
        if (fmt_is_nan(f, h)) {
            const uint32_t payload = (bits_of(got) >> (23 - f->mbits)) & ((1u << f->mbits) - 1);
            tally_add(&to32, isnan(got) && !!signbit(got) == !!(h & 0x8000) && payload == (h & ((1u << f->mbits) - 1)),
                      "NaN 0x%04x -> 0x%08x", h, bits_of(got));
            continue;
        }
        const double want = decode(f, h);
        tally_add(&to32, (double)got == want && !!signbit(got) == !!signbit(want), "0x%04x -> %a, want %a", h,
                  (double)got, want);
        const uint16_t back = f->from_f32(got);
        tally_add(&trip, back == h, "0x%04x -> %a -> 0x%04x", h, (double)got, back);
    }
    tally_check(&to32, f, "to f32, all 65536 patterns");
    tally_check(&trip, f, "round trip of every non-NaN pattern");

    /* f32 -> 16 bits around every finite pattern: the value, its f32 neighbours, the midpoint
     * to the next pattern up in magnitude (a tie: to even) and the midpoint's f32 neighbours */
    tally exact = {0, 0, ""}, near = {0, 0, ""}, ties = {0, 0, ""}, near_ties = {0, 0, ""};
    for (uint32_t i = 0; i < 65536; i++) {
        const uint16_t h = (uint16_t)i;
        if ((h & 0x7fff) >= fmt_inf(f)) continue;
        const double v = decode(f, h), s = (h & 0x8000) ? -1.0 : 1.0;
        /* past the largest finite value the next step up would be 2^(emax+1) */
        const double next = (uint16_t)((h & 0x7fff) + 1) == fmt_inf(f) ? s * ldexp(1.0, fmt_bias(f) + 1) : decode(f, (uint16_t)(h + 1));
        const float x = (float)v, mid = (float)((v + next) / 2); /* both exact in f32 */
        check_round(f, &exact, x);
        check_round(f, &near, nextafterf(x, 0.0f));
        check_round(f, &near, nextafterf(x, s * INFINITY));
        check_round(f, &ties, mid);
        check_round(f, &near_ties, nextafterf(mid, 0.0f));
        check_round(f, &near_ties, nextafterf(mid, s * INFINITY));
    }
    tally_check(&exact, f, "to 16 bits, every representable value");
    tally_check(&near, f, "to 16 bits, one f32 ulp either side of every value");
    tally_check(&ties, f, "to 16 bits, every midpoint (ties to even)");
    tally_check(&near_ties, f, "to 16 bits, one f32 ulp either side of every midpoint");

    /* random f32 patterns (NaN ones skipped), and inf, FLT_MAX and the f32 subnormals' ends */
    tally any = {0, 0, ""};
    test_rng r = {0xD7E5u + (uint64_t)f->mbits};
    for (int k = 0; k < 1000000; k++) {
        const float x = float_of((uint32_t)rng_next(&r));
        if (!isnan(x)) check_round(f, &any, x);
    }
    const float special[] = {INFINITY, -INFINITY, FLT_MAX, -FLT_MAX, FLT_MIN, -FLT_MIN, 0x1p-149f, -0x1p-149f, 0x1p-127f, 0.0f, -0.0f};
    for (size_t k = 0; k < sizeof special / sizeof special[0]; k++) check_round(f, &any, special[k]);
    tally_check(&any, f, "to 16 bits, 1M random f32 patterns and the extremes");

    /* NaN in: a NaN out, quiet (top mantissa bit set), sign kept */
    tally nan = {0, 0, ""};
    const uint32_t nans[] = {0x7fc00000u, 0x7f800001u, 0x7fa00000u, 0x7fffffffu, 0x7f800100u, 0x7fbfffffu, 0x7f802000u};
    for (size_t k = 0; k < sizeof nans / sizeof nans[0]; k++)
        for (uint32_t sgn = 0; sgn < 2; sgn++) {
            const uint32_t u = nans[k] | sgn << 31;
            const uint16_t got = f->from_f32(float_of(u));
            const uint16_t quiet = (uint16_t)(1u << (f->mbits - 1));
            tally_add(&nan, fmt_is_nan(f, got) && (got & quiet) && (got >> 15) == sgn, "NaN 0x%08x -> 0x%04x", u, got);
        }
    tally_check(&nan, f, "NaN to 16 bits stays a quiet NaN of the same sign");
}

/* A few cases by name, so that a failure reads as what it is. */
static void check_named(void)
{
    CHECK(nsa_f16_to_f32(0x0001) == 0x1p-24f);                  /* smallest f16 subnormal */
    CHECK(nsa_f16_to_f32(0x03ff) == 0x3ffp-24f);                /* largest f16 subnormal */
    CHECK(nsa_f32_to_f16(0x1p-24f) == 0x0001);
    CHECK(nsa_f32_to_f16(0x1p-25f) == 0x0000);                  /* half the smallest: tie, to even 0 */
    CHECK(nsa_f32_to_f16(nextafterf(0x1p-25f, 1.0f)) == 0x0001);
    CHECK(nsa_f32_to_f16(0x3p-25f) == 0x0002);                  /* 1.5 x smallest: tie, to even 2 */
    CHECK(nsa_f32_to_f16(-0x1p-26f) == 0x8000);                 /* underflow keeps the sign */
    CHECK(nsa_f32_to_f16(65504.0f) == 0x7bff);                  /* largest f16 */
    CHECK(nsa_f32_to_f16(nextafterf(65520.0f, 0.0f)) == 0x7bff);
    CHECK(nsa_f32_to_f16(65520.0f) == 0x7c00);                  /* tie above the largest: inf */
    CHECK(nsa_f32_to_f16(-1e6f) == 0xfc00);
    CHECK(nsa_f32_to_f16(1.0f + 0x1p-11f) == 0x3c00);           /* tie, to even (down) */
    CHECK(nsa_f32_to_f16(1.0f + 0x3p-11f) == 0x3c02);           /* tie, to even (up) */
    CHECK(nsa_bf16_to_f32(0x0001) == 0x1p-133f);                /* smallest bf16 denormal */
    CHECK(nsa_f32_to_bf16(0x1p-133f) == 0x0001);
    CHECK(nsa_f32_to_bf16(0x1p-149f) == 0x0000);                /* smallest f32 subnormal: to 0 */
    CHECK(nsa_f32_to_bf16(0x3p-134f) == 0x0002);                /* denormal tie, to even (up) */
    CHECK(nsa_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80);           /* tie, to even (down) */
    CHECK(nsa_f32_to_bf16(1.0f + 0x3p-8f) == 0x3f82);           /* tie, to even (up) */
    CHECK(nsa_f32_to_bf16(FLT_MAX) == 0x7f80);                  /* rounds past the largest bf16: inf */
    CHECK(nsa_f32_to_bf16(-INFINITY) == 0xff80);
    CHECK(isnan(nsa_f16_to_f32(0x7e00)) && isnan(nsa_bf16_to_f32(0xffc0)) && signbit(nsa_bf16_to_f32(0xffc0)));
}

/* The public size and name of every dtype, and of a value outside the enum. */
static void check_size_and_name(void)
{
    static const struct { nsa_dtype dt; size_t size; const char *name; } rows[] = {
        {NSA_DTYPE_F32, 4, "f32"}, {NSA_DTYPE_F16, 2, "f16"}, {NSA_DTYPE_BF16, 2, "bf16"},
        {NSA_DTYPE_I32, 4, "i32"}, {NSA_DTYPE_U8, 1, "u8"}, {(nsa_dtype)97, 0, "unknown"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        CHECK(nsa_dtype_size(rows[i].dt) == rows[i].size);
        CHECK_MSG(strcmp(nsa_dtype_name(rows[i].dt), rows[i].name) == 0, rows[i].name);
    }
}

void test_dtype_all(void)
{
    check_size_and_name();
    const fmt f16 = {"f16", 5, 10, nsa_f16_to_f32, nsa_f32_to_f16};
    const fmt bf16 = {"bf16", 8, 7, nsa_bf16_to_f32, nsa_f32_to_bf16};
    check_named();
    check_format(&f16);
    check_format(&bf16);
}
