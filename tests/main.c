/* main.c -- the CPU test suite: every group in order, then "N passed, N failed". */
#include "harness.h"
#include <stdlib.h>
#include <string.h>

void test_ref_all(void);
void test_validation_all(void);
void test_backend_all(void);
void test_attention_all(void);
void test_rules_all(void);
void test_plan_all(void);

static void test_readme_example(void)
{
    /* built from README.md by the Makefile; it exits 0 only if its own checks hold */
    int rc = system("./build/readme_example > /dev/null");
    CHECK_MSG(rc == 0, "README example failed (see ./build/readme_example)");
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "-v")) g_tests_verbose = 1;
    struct { const char *name; void (*fn)(void); } groups[] = {
        {"reference", test_ref_all},
        {"validation", test_validation_all},
        {"backend", test_backend_all},
        {"attention", test_attention_all},
        {"rules", test_rules_all},
        {"plan", test_plan_all},
        {"readme", test_readme_example},
    };
    for (size_t i = 0; i < sizeof groups / sizeof groups[0]; i++) {
        long p0 = g_tests_passed, f0 = g_tests_failed;
        groups[i].fn();
        printf("[%s] %ld passed, %ld failed\n", groups[i].name, g_tests_passed - p0, g_tests_failed - f0);
        fflush(stdout);
    }
    printf("%ld passed, %ld failed\n", g_tests_passed, g_tests_failed);
    return g_tests_failed == 0 ? 0 : 1;
}
