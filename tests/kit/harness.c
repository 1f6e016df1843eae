/* harness.c -- counters, failure printing and the seeded random generator. */
#include "harness.h"
#include "nsa.h"
#include <math.h>

long g_tests_passed = 0;
long g_tests_failed = 0;
int g_tests_verbose = 0;

/* Past this many failures the details stop: the first few mismatches say enough. */
enum { MAX_PRINTED_FAILURES = 25 };

void harness_record(int ok, const char *file, int line, const char *expr, const char *detail)
{
    if (ok) {
        g_tests_passed++;
        return;
    }
    g_tests_failed++;
    if (g_tests_failed <= MAX_PRINTED_FAILURES)
        fprintf(stderr, "FAIL %s:%d: %s%s%s\n", file, line, expr, detail ? " -- " : "", detail ? detail : "");
}

void harness_check_status(int got, int want, const char *file, int line, const char *expr)
{
    char msg[256];
    snprintf(msg, sizeof msg, "got %d (%s), want %d (%s)", got, nsa_status_string((nsa_status)got), want,
             nsa_status_string((nsa_status)want));
    harness_record(got == want, file, line, expr, msg);
}

uint64_t rng_next(test_rng *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double rng_uniform(test_rng *r) { return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0); }

double rng_normal(test_rng *r)
{
    double u1 = rng_uniform(r), u2 = rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

int64_t rng_int(test_rng *r, int64_t lo, int64_t hi)
{
    return lo + (int64_t)(rng_next(r) % (uint64_t)(hi - lo + 1));
}
