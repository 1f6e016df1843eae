/* gpu_main.c -- the random sweep of tests/sweep.c on the CUDA backend (CUDA builds only:
 * build/nsa_gpu_tests). The sweep's tensors and workspace live in device memory through
 * sweep_set_memory; every case runs in its own child process, so that a kernel fault (a
 * sticky CUDA error) fails that case alone and the others still report. Cases draw bf16 or
 * f16 storage (fp32 attention inputs are not supported on the GPU: one call checks that
 * they return NOT_SUPPORTED). Then the attention op's option tests of tests/test_attention.c
 * on the GPU (--no-attention skips them). Prints "N passed, N failed" last; exit 1 on any
 * failure.
 *
 *   nsa_gpu_tests [--seed N] [--cases N] [--max-T N] [--jobs N] [--no-fork] [--no-attention] [-v] */
#define _POSIX_C_SOURCE 200809L

#include "devmem.h"
#include "harness.h"
#include "sweep.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- one case ---------------------------------------------------------------------------- */

static void run_one(const sweep_case *c, uint64_t seed, int verbose, long *passed, long *failed)
{
    sweep_set_memory(devmem_sweep_memory());
    nsa_context_desc d;
    memset(&d, 0, sizeof d);
    d.backend = NSA_BACKEND_CUDA;
    nsa_context *ctx = NULL;
    nsa_status st = nsa_context_create(&ctx, &d);
    CHECK_STATUS(st, NSA_STATUS_SUCCESS);
    if (st == NSA_STATUS_SUCCESS) {
        sweep_run_case(ctx, c, seed, verbose);
        nsa_context_destroy(ctx);
    }
    *passed = g_tests_passed;
    *failed = g_tests_failed;
}

/* fp32 attention inputs: a valid request the GPU declines. */
static void check_f32_declined(void)
{
    const int64_t T = 8, H = 1, D = 16;
    const nsa_backend be = NSA_BACKEND_CUDA;
    float *q = (float *)devmem_alloc(be, (size_t)(T * H * D) * 4, "q"), *o = (float *)devmem_alloc(be, (size_t)(T * H * D) * 4, "o");
    float *lse = (float *)devmem_alloc(be, (size_t)(T * H) * 4, "lse");
    nsa_context_desc d;
    memset(&d, 0, sizeof d);
    d.backend = NSA_BACKEND_CUDA;
    nsa_context *ctx = NULL;
    CHECK_STATUS(nsa_context_create(&ctx, &d), NSA_STATUS_SUCCESS);
    nsa_attention_args a;
    memset(&a, 0, sizeof a);
    a.q = nsa_tensor_4d(q, NSA_DTYPE_F32, 1, T, H, D);
    a.k = a.q, a.v = a.q;
    a.o = nsa_tensor_4d(o, NSA_DTYPE_F32, 1, T, H, D);
    a.lse = nsa_tensor_3d(lse, NSA_DTYPE_F32, 1, T, H);
    a.causal = 1;
    a.window_left = -1, a.window_right = -1;
    size_t need = 0;
    CHECK_STATUS(nsa_attention_workspace_size(ctx, &a, &need), NSA_STATUS_SUCCESS);
    void *ws = devmem_alloc(be, need, "the workspace");
    CHECK_STATUS(nsa_attention(ctx, &a, ws, need), NSA_STATUS_NOT_SUPPORTED);
    nsa_context_destroy(ctx);
    devmem_free(be, ws), devmem_free(be, q), devmem_free(be, o), devmem_free(be, lse);
}

void test_attention_on(nsa_backend backend, const sweep_memory *mem);

/* The attention op's options (tests/test_attention.c) on the CUDA backend, in a child
 * process like every sweep case (a kernel fault fails this part alone), or in this process
 * with --no-fork (what the sanitizers run: they see this process's kernels for sure). */
static void run_attention_tests(int fork_it, long *passed, long *failed)
{
    if (!fork_it) {
        const long p0 = g_tests_passed, f0 = g_tests_failed;
        test_attention_on(NSA_BACKEND_CUDA, devmem_sweep_memory());
        printf("attention options: %5ld passed, %3ld failed\n", g_tests_passed - p0, g_tests_failed - f0);
        *passed += g_tests_passed - p0;
        *failed += g_tests_failed - f0;
        return;
    }
    int fd[2];
    if (pipe(fd) != 0) {
        *failed += 1;
        return;
    }
    fflush(stdout), fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        const long p0 = g_tests_passed, f0 = g_tests_failed;
        test_attention_on(NSA_BACKEND_CUDA, devmem_sweep_memory());
        long res[2] = {g_tests_passed - p0, g_tests_failed - f0};
        fflush(stdout), fflush(stderr);
        if (write(fd[1], res, sizeof res) != (ssize_t)sizeof res) _exit(4);
        _exit(0);
    }
    close(fd[1]);
    long res[2] = {0, 0};
    const ssize_t got = read(fd[0], res, sizeof res);
    close(fd[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    const int ok = got == (ssize_t)sizeof res && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    printf("attention options: %5ld passed, %3ld failed%s\n", res[0], res[1] + !ok, ok ? "" : " (crashed)");
    *passed += res[0];
    *failed += res[1] + !ok;
}

/* A forked case: its pid and the read end of its result pipe. */
typedef struct child {
    pid_t pid;
    int fd;
    long idx;
    uint64_t seed;
    char desc[480];
} child;

/* Waits for c and turns its report (or its crash) into counts. @return 1 if it crashed. */
static int reap(const child *c, long *p, long *f)
{
    long res[2] = {0, 0};
    const ssize_t got = read(c->fd, res, sizeof res);
    close(c->fd);
    int status = 0;
    waitpid(c->pid, &status, 0);
    const int ok = got == (ssize_t)sizeof res && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    *p = got == (ssize_t)sizeof res ? res[0] : 0;
    *f = got == (ssize_t)sizeof res ? res[1] : 0;
    if (!ok) {
        fprintf(stderr, "FAIL case %ld crashed (status 0x%x): seed=%llu %s\n", c->idx, status, (unsigned long long)c->seed,
                c->desc);
        *f += 1;
    }
    printf("case %3ld: %5ld passed, %3ld failed%s  %s\n", c->idx, *p, *f, ok ? "" : " (crashed)", c->desc);
    fflush(stdout);
    return !ok;
}

int main(int argc, char **argv)
{
    uint64_t seed = 20260301;
    long cases = 60;
    int64_t max_T = 1000;
    int fork_cases = 1, verbose = 0, jobs = 1, attention = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--cases") && i + 1 < argc) cases = strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--max-T") && i + 1 < argc) max_T = strtoll(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--jobs") && i + 1 < argc) jobs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--no-fork")) fork_cases = 0;
        else if (!strcmp(argv[i], "-v")) verbose = 1, g_tests_verbose = 1;
        else if (!strcmp(argv[i], "--no-attention")) attention = 0;
        else {
            fprintf(stderr, "usage: nsa_gpu_tests [--seed N] [--cases N] [--max-T N] [--jobs N] [--no-fork] [--no-attention] [-v]\n");
            return 2;
        }
    }
    if (jobs < 1) jobs = 1;
    if (jobs > 64) jobs = 64;
    /* the parent makes no CUDA call before the children are done (a forked child must not
     * inherit a CUDA context) */
    long passed = 0, failed = 0, crashed = 0;
    uint64_t state = seed;
    child run[64];
    int nrun = 0;
    for (long i = 0; i < cases; i++) {
        sweep_case c;
        const uint64_t case_seed = state;
        sweep_case_next(&c, &state, i, NSA_BACKEND_CUDA, max_T);
        char desc[400];
        sweep_case_describe(&c, desc, sizeof desc);
        if (verbose) fprintf(stderr, "case %ld: seed=%llu %s\n", i, (unsigned long long)case_seed, desc);
        long p = 0, f = 0;
        if (!fork_cases) {
            const long p0 = g_tests_passed, f0 = g_tests_failed;
            run_one(&c, case_seed, verbose, &p, &f);
            p -= p0, f -= f0;
            passed += p, failed += f;
            printf("case %3ld: %5ld passed, %3ld failed  %s\n", i, p, f, desc);
            fflush(stdout);
            continue;
        }
        if (nrun == jobs) { /* the oldest first: reports stay in case order */
            crashed += reap(&run[0], &p, &f);
            passed += p, failed += f;
            memmove(run, run + 1, sizeof run[0] * (size_t)(nrun - 1));
            nrun--;
        }
        int fd[2];
        if (pipe(fd) != 0) return 2;
        fflush(stdout), fflush(stderr);
        pid_t pid = fork();
        if (pid == 0) {
            close(fd[0]);
            long res[2];
            run_one(&c, case_seed, verbose, &res[0], &res[1]);
            fflush(stdout), fflush(stderr);
            if (write(fd[1], res, sizeof res) != (ssize_t)sizeof res) _exit(4);
            _exit(0);
        }
        close(fd[1]);
        child *ch = &run[nrun++];
        ch->pid = pid, ch->fd = fd[0], ch->idx = i, ch->seed = case_seed;
        snprintf(ch->desc, sizeof ch->desc, "seed=%llu %s", (unsigned long long)case_seed, desc);
    }
    for (int k = 0; k < nrun; k++) {
        long p = 0, f = 0;
        crashed += reap(&run[k], &p, &f);
        passed += p, failed += f;
    }
    if (attention) run_attention_tests(fork_cases, &passed, &failed);
    const long p0 = g_tests_passed, f0 = g_tests_failed;
    check_f32_declined();
    passed += g_tests_passed - p0, failed += g_tests_failed - f0;
    printf("gpu sweep: %ld cases (%ld crashed), seed %llu, max T %lld\n", cases, crashed, (unsigned long long)seed,
           (long long)max_T);
    printf("%ld passed, %ld failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
