/* harness.c -- counters, failure printing and the seeded random generator. */
#include "harness.h"
#include "nsa.h"
#include <ctype.h>
#include <math.h>
#include <string.h>

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
    /* Every failure the library reports carries its detail (nsa.h): a failing status without
     * one is a path that forgot to say what is wrong. The detail is read right after the call,
     * as CHECK_STATUS(nsa_x(...), ...) evaluates it. */
    if (got == want && want != NSA_STATUS_SUCCESS) {
        const char *d = nsa_last_error_detail();
        snprintf(msg, sizeof msg, "status %d came with an empty detail", got);
        harness_record(d[0] != '\0', file, line, expr, msg);
    }
}

/* Characters that continue a field name: "k" inside "dk", "k_cmp" or "k2" is not "k"; the
 * dot is not one, so "fwd.k" and "config.window" name "k" and "config" too. */
static int name_char(char c) { return isalnum((unsigned char)c) || c == '_'; }

int harness_detail_names(const char *detail, const char *arg)
{
    const size_t n = strlen(arg);
    if (n == 0) return 0;
    for (const char *p = strstr(detail, arg); p; p = strstr(p + 1, arg))
        if ((p == detail || !name_char(p[-1])) && !name_char(p[n])) return 1;
    return 0;
}

void harness_check_detail(const char *arg, const char *file, int line)
{
    const char *d = nsa_last_error_detail();
    char msg[400];
    snprintf(msg, sizeof msg, "detail \"%s\" does not name %s", d, arg);
    harness_record(harness_detail_names(d, arg), file, line, "CHECK_DETAIL", msg);
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

struct nsa_context *harness_cpu_context(int threads)
{
    nsa_context_desc d;
    memset(&d, 0, sizeof d);
    d.backend = NSA_BACKEND_CPU;
    d.num_threads = threads;
    nsa_context *ctx = NULL;
    CHECK_STATUS(nsa_context_create(&ctx, &d), NSA_STATUS_SUCCESS);
    return ctx;
}
