/* main.c -- the CPU test suite: every group in order, then "N passed, N failed".
 *
 *   nsa_tests [-v] [--group NAME]... [--list]
 * --group runs only the named groups (repeatable); --list prints the group names, one a line. */
#include "harness.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void test_ref_all(void);
void test_dtype_all(void);
void test_validation_all(void);
void test_backend_all(void);
void test_backend_sweep_all(void);
void test_backend_nonfinite_all(void);
void test_attention_all(void);
void test_rules_all(void);
void test_plan_all(void);
void test_safety_all(void);
void test_step_all(void);
void test_expr_all(void);
void test_flex_all(void);
void test_chunk_all(void);

static void test_readme_example(void)
{
    /* built from README.md by the Makefile; it exits 0 only if its own checks hold */
    int rc = system("./build/readme_example > /dev/null");
    CHECK_MSG(rc == 0, "README example failed (see ./build/readme_example)");
}

static const struct group {
    const char *name;
    void (*fn)(void);
} GROUPS[] = {
    {"reference", test_ref_all},
    {"dtype", test_dtype_all},
    {"validation", test_validation_all},
    {"backend", test_backend_all},
    {"sweep", test_backend_sweep_all},
    {"nonfinite", test_backend_nonfinite_all},
    {"attention", test_attention_all},
    {"rules", test_rules_all},
    {"plan", test_plan_all},
    {"safety", test_safety_all},
    {"step", test_step_all},
    {"expr", test_expr_all},
    {"flex", test_flex_all},
    {"chunk", test_chunk_all},
    {"readme", test_readme_example},
};
enum { NGROUPS = sizeof GROUPS / sizeof GROUPS[0] };

int main(int argc, char **argv)
{
    int chosen[NGROUPS] = {0}, any_chosen = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-v")) g_tests_verbose = 1;
        else if (!strcmp(argv[i], "--list")) {
            for (int g = 0; g < NGROUPS; g++) printf("%s\n", GROUPS[g].name);
            return 0;
        } else if (!strcmp(argv[i], "--group") && i + 1 < argc) {
            int g = 0;
            while (g < NGROUPS && strcmp(GROUPS[g].name, argv[i + 1])) g++;
            if (g == NGROUPS) {
                fprintf(stderr, "nsa_tests: unknown group '%s' (--list names them)\n", argv[i + 1]);
                return 2;
            }
            chosen[g] = any_chosen = 1, i++;
        } else {
            fprintf(stderr, "usage: nsa_tests [-v] [--group NAME]... [--list]\n");
            return 2;
        }
    }
    for (int g = 0; g < NGROUPS; g++) {
        if (any_chosen && !chosen[g]) continue;
        long p0 = g_tests_passed, f0 = g_tests_failed;
        GROUPS[g].fn();
        printf("[%s] %ld passed, %ld failed\n", GROUPS[g].name, g_tests_passed - p0, g_tests_failed - f0);
        fflush(stdout);
    }
    printf("%ld passed, %ld failed\n", g_tests_passed, g_tests_failed);
    return g_tests_failed == 0 ? 0 : 1;
}
