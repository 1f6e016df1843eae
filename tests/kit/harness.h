/* harness.h -- the tiny test harness shared by the test suites and the CLI.
 * A test is a void function registered in tests/main.c; CHECK records one pass or fail
 * and prints the failing expression with its location. main() prints
 * "N passed, N failed" last. */
#ifndef NSA_TEST_HARNESS_H
#define NSA_TEST_HARNESS_H

#include <stdio.h>
#include <stdint.h>

extern long g_tests_passed;
extern long g_tests_failed;
extern int g_tests_verbose;

/* Records a check; on failure prints where and what (at most the first few per test). */
void harness_record(int ok, const char *file, int line, const char *expr, const char *detail);

#define CHECK(cond) harness_record((cond) != 0, __FILE__, __LINE__, #cond, NULL)
#define CHECK_MSG(cond, msg) harness_record((cond) != 0, __FILE__, __LINE__, #cond, (msg))
/* Status equality, printing both status strings when it fails. */
#define CHECK_STATUS(got, want) harness_check_status((got), (want), __FILE__, __LINE__, #got)
void harness_check_status(int got, int want, const char *file, int line, const char *expr);
/* After a failing call: nsa_last_error_detail() names `arg` (an args field such as "k",
 * "fwd.dout" or "config.slc_block") as a whole word; prints the detail when it does not. */
#define CHECK_DETAIL(arg) harness_check_detail((arg), __FILE__, __LINE__)
void harness_check_detail(const char *arg, const char *file, int line);
/* Whether `detail` names `arg` as a whole word (not inside a longer name: "k" is not in "dk"). */
int harness_detail_names(const char *detail, const char *arg);

/* A CPU-backend context with `threads` worker threads (0: OpenMP's default); its creation is a
 * check. NULL when it failed. */
struct nsa_context *harness_cpu_context(int threads);

/* Deterministic random numbers (splitmix64), so a printed seed reproduces a failure. */
typedef struct test_rng { uint64_t s; } test_rng;
uint64_t rng_next(test_rng *r);
double rng_uniform(test_rng *r);              /* [0, 1) */
double rng_normal(test_rng *r);               /* N(0, 1) */
int64_t rng_int(test_rng *r, int64_t lo, int64_t hi); /* [lo, hi] inclusive */

#endif
