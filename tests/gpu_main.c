/* gpu_main.c -- the random sweep of tests/kit/sweep.c on the CUDA backend (CUDA builds only:
 * build/nsa_gpu_tests). The sweep's tensors and workspace live in device memory through
 * sweep_set_memory; every case runs in its own child process, so that a kernel fault (a
 * sticky CUDA error) fails that case alone and the others still report. Cases draw bf16 or
 * f16 storage (fp32 attention inputs are not supported on the GPU: one call checks that
 * they return NOT_SUPPORTED). Then the attention op's option tests of tests/test_attention.c
 * on the GPU (--no-attention skips them). Prints "N passed, N failed" last; exit 1 on any
 * failure.
 *
 *   nsa_gpu_tests [--seed N] [--cases N] [--max-T N] [--jobs N] [--no-fork] [--no-attention]
 *                 [--op NAME] [--hash-out FILE] [--hash-cmp FILE] [--variant KEY=VALUE]... [--nonfinite] [-v]
 *
 * --nonfinite: the sweep's non-finite mode (sweep.h, sweep_set_nonfinite): each op runs with
 *     NaN / +-inf planted in its inputs and must put non-finite values exactly where the
 *     float64 reference does; some cases scale q, k so that scores overflow f32. A few hundred
 *     tokens are enough (--max-T 300).
 * --op NAME: only that op's checks (names as the sweep prints them: nsa_forward, nsa_attention,
 *     nsa_slc_attn_bwd, ...; the option tests only with nsa_attention / nsa_attention_bwd).
 * --hash-out FILE: a 64-bit FNV-1a hash of every checked output, one line per case and output
 *     (tests/kit/hashlog.h); --hash-cmp FILE recomputes them and reports the first cases whose
 *     hashes differ from FILE's, then "N identical, M differ" (informational: not a failure).
 * --variant KEY=VALUE: set in the environment before any context exists (the planner's
 *     NSA_CUDA_* overrides, e.g. NSA_CUDA_WGMMA=0); repeatable. The header names every one. */
#define _POSIX_C_SOURCE 200809L

#include "devmem.h"
#include "harness.h"
#include "hashlog.h"
#include "sweep.h"
#include "variant.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* Whole reads and writes on a pipe (a case's report can exceed one pipe buffer). */
static int write_all(int fd, const void *buf, size_t n)
{
    const char *p = (const char *)buf;
    while (n) {
        const ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w, n -= (size_t)w;
    }
    return 0;
}

static size_t read_all(int fd, void *buf, size_t n)
{
    char *p = (char *)buf;
    size_t got = 0;
    while (got < n) {
        const ssize_t r = read(fd, p + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    return got;
}

/* ---- one case ---------------------------------------------------------------------------- */

/* Runs case `index`; its outputs' hashes go to log (NULL: none). */
static void run_one(const sweep_case *c, long index, uint64_t seed, int verbose, hashlog *log, long *passed, long *failed)
{
    sweep_set_memory(devmem_sweep_memory());
    if (log) {
        sweep_set_hash(hashlog_sink, log);
        hashlog_begin_case(log, index, seed, c);
    }
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

void test_attention_on(nsa_backend backend, const sweep_memory *mem);
void test_step_on(nsa_backend backend, const sweep_memory *mem);
void test_flex_on(nsa_backend backend, const sweep_memory *mem);

/* The fixed cases of tests/test_attention.c, tests/test_step.c and tests/test_flex.c on the device. */
static void fixed_cases(void)
{
    test_attention_on(NSA_BACKEND_CUDA, devmem_sweep_memory());
    test_step_on(NSA_BACKEND_CUDA, devmem_sweep_memory());
    test_flex_on(NSA_BACKEND_CUDA, devmem_sweep_memory());
}

/* The attention op's options (tests/test_attention.c) on the CUDA backend, in a child
 * process like every sweep case (a kernel fault fails this part alone), or in this process
 * with --no-fork (what the sanitizers run: they see this process's kernels for sure). */
static void run_attention_tests(int fork_it, long *passed, long *failed)
{
    if (!fork_it) {
        const long p0 = g_tests_passed, f0 = g_tests_failed;
        fixed_cases();
        printf("attention options and the step: %5ld passed, %3ld failed\n", g_tests_passed - p0, g_tests_failed - f0);
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
        fixed_cases();
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
    printf("attention options and the step: %5ld passed, %3ld failed%s\n", res[0], res[1] + !ok, ok ? "" : " (crashed)");
    *passed += res[0];
    *failed += res[1] + !ok;
}

/* A forked case: its pid and the read end of its report pipe (counts, then its hash lines). */
typedef struct child {
    pid_t pid;
    int fd;
    long idx;
    uint64_t seed;
    char desc[480];
} child;

/* The child's side: counts, then the length and text of its hash lines. */
static void report(int fd, long passed, long failed, const hashlog *log)
{
    long res[2] = {passed, failed};
    size_t n = 0;
    const char *text = log ? hashlog_text(log, &n) : "";
    fflush(stdout), fflush(stderr);
    if (write_all(fd, res, sizeof res) || write_all(fd, &n, sizeof n) || write_all(fd, text, n)) _exit(4);
}

/* Waits for c and turns its report (or its crash) into counts; its hash lines go to log.
 * @return 1 if it crashed. */
static int reap(const child *c, hashlog *log, long *p, long *f)
{
    long res[2] = {0, 0};
    const int got = read_all(c->fd, res, sizeof res) == sizeof res;
    size_t n = 0;
    if (got && read_all(c->fd, &n, sizeof n) == sizeof n && n) {
        char *text = (char *)malloc(n);
        if (text && read_all(c->fd, text, n) == n && log) hashlog_append(log, text, n);
        free(text);
    }
    close(c->fd);
    int status = 0;
    waitpid(c->pid, &status, 0);
    const int ok = got && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    *p = got ? res[0] : 0;
    *f = got ? res[1] : 0;
    if (!ok) {
        fprintf(stderr, "FAIL case %ld crashed (status 0x%x): seed=%llu %s\n", c->idx, status, (unsigned long long)c->seed,
                c->desc);
        *f += 1;
    }
    printf("case %3ld: %5ld passed, %3ld failed%s  %s\n", c->idx, *p, *f, ok ? "" : " (crashed)", c->desc);
    fflush(stdout);
    return !ok;
}

static void usage(void)
{
    fprintf(stderr, "usage: nsa_gpu_tests [--seed N] [--cases N] [--max-T N] [--jobs N] [--no-fork] [--no-attention]\n"
                    "                     [--op NAME] [--hash-out FILE] [--hash-cmp FILE] [--variant KEY=VALUE]... [--nonfinite] [-v]\n"
                    "ops:");
    for (int i = 0; sweep_op_names[i]; i++) fprintf(stderr, " %s", sweep_op_names[i]);
    fprintf(stderr, "\n");
    exit(2);
}

int main(int argc, char **argv)
{
    uint64_t seed = 20260301;
    long cases = 60;
    int64_t max_T = 1000;
    int fork_cases = 1, verbose = 0, jobs = 1, attention = 1, nonfinite = 0;
    const char *op = NULL, *hash_out = NULL, *hash_cmp = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--cases") && i + 1 < argc) cases = strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--max-T") && i + 1 < argc) max_T = strtoll(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--jobs") && i + 1 < argc) jobs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--no-fork")) fork_cases = 0;
        else if (!strcmp(argv[i], "--nonfinite")) nonfinite = 1;
        else if (!strcmp(argv[i], "-v")) verbose = 1, g_tests_verbose = 1;
        else if (!strcmp(argv[i], "--no-attention")) attention = 0;
        else if (!strcmp(argv[i], "--op") && i + 1 < argc) {
            op = argv[++i];
            if (sweep_set_op(op) != 0) {
                fprintf(stderr, "nsa_gpu_tests: unknown op '%s'\n", op);
                usage();
            }
        } else if (!strcmp(argv[i], "--hash-out") && i + 1 < argc) hash_out = argv[++i];
        else if (!strcmp(argv[i], "--hash-cmp") && i + 1 < argc) hash_cmp = argv[++i];
        else if (!strcmp(argv[i], "--variant") && i + 1 < argc) {
            if (variant_set(argv[++i]) != 0) {
                fprintf(stderr, "nsa_gpu_tests: --variant takes KEY=VALUE, got '%s'\n", argv[i]);
                usage();
            }
        } else usage();
    }
    if (jobs < 1) jobs = 1;
    if (jobs > 64) jobs = 64;
    /* the option tests and the f32 call belong to nsa_attention: with another --op they stay out */
    const int attention_op = !op || !strncmp(op, "nsa_attention", 13);
    attention &= attention_op;
    hashlog *base = NULL, *run_log = hash_out || hash_cmp ? hashlog_new() : NULL;
    if (hash_cmp && !(base = hashlog_read(hash_cmp))) {
        fprintf(stderr, "nsa_gpu_tests: cannot read %s: %s\n", hash_cmp, strerror(errno));
        return 2;
    }
    char variants[1024];
    variant_describe(variants, sizeof variants);
    /* set before any fork: every child runs its case in the mode */
    sweep_set_nonfinite(nonfinite);
    printf("nsa_gpu_tests: seed %llu, %ld cases, max T %lld, %d jobs%s%s; op %s; variants: %s\n", (unsigned long long)seed,
           cases, (long long)max_T, jobs, fork_cases ? "" : " (no fork)", nonfinite ? ", non-finite mode" : "",
           op ? op : "all", variants);
    fflush(stdout);
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
            run_one(&c, i, case_seed, verbose, run_log, &p, &f);
            p -= p0, f -= f0;
            passed += p, failed += f;
            printf("case %3ld: %5ld passed, %3ld failed  %s\n", i, p, f, desc);
            fflush(stdout);
            continue;
        }
        if (nrun == jobs) { /* the oldest first: reports (and hash lines) stay in case order */
            crashed += reap(&run[0], run_log, &p, &f);
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
            hashlog *mine = run_log ? hashlog_new() : NULL; /* this case's lines only */
            long res[2];
            run_one(&c, i, case_seed, verbose, mine, &res[0], &res[1]);
            report(fd[1], res[0], res[1], mine);
            _exit(0);
        }
        close(fd[1]);
        child *ch = &run[nrun++];
        ch->pid = pid, ch->fd = fd[0], ch->idx = i, ch->seed = case_seed;
        snprintf(ch->desc, sizeof ch->desc, "seed=%llu %s", (unsigned long long)case_seed, desc);
    }
    for (int k = 0; k < nrun; k++) {
        long p = 0, f = 0;
        crashed += reap(&run[k], run_log, &p, &f);
        passed += p, failed += f;
    }
    if (attention) run_attention_tests(fork_cases, &passed, &failed);
    if (hash_out && hashlog_write(run_log, hash_out) != 0) {
        fprintf(stderr, "FAIL cannot write %s: %s\n", hash_out, strerror(errno));
        failed++;
    }
    if (hash_cmp) hashlog_compare(run_log, base, stdout, 10);
    hashlog_free(run_log);
    hashlog_free(base);
    printf("gpu sweep: %ld cases (%ld crashed), seed %llu, max T %lld\n", cases, crashed, (unsigned long long)seed,
           (long long)max_T);
    printf("%ld passed, %ld failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
