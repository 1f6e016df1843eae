/* replay.c -- build/nsa_fuzz_replay: the fuzz inputs (files, or every regular file of a
 * folder) replayed through the decoding of the libFuzzer harness (decode.c) without libFuzzer,
 * on the CPU or the CUDA backend. The tensors, their guards and the workspace live in the
 * backend's memory (tests/kit/devmem), so on CUDA the same checks hold on device memory: a
 * failing call leaves every buffer untouched, a successful one writes only its output views,
 * no guard changes. Run it under compute-sanitizer to have the kernels' accesses checked too.
 *
 *   build/nsa_fuzz_replay [--backend cpu|cuda] [--verbose] PATH...
 *
 * One line per input with --verbose (else only failures), a breakdown of the statuses, and
 * "N passed, N failed" last: an input passes when every check held, whatever the status
 * (NOT_SUPPORTED on CUDA included, counted apart). Exit code 1 on any failure. */
#define _POSIX_C_SOURCE 200809L

#include "nsa.h"
#include "decode.h"
#include "devmem.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static nsa_backend g_backend = NSA_BACKEND_CPU;
static int g_verbose;
static long n_pass, n_fail, n_success, n_rejected, n_unsupported, n_skipped;

static void *mem_alloc(size_t bytes) { return devmem_alloc(g_backend, bytes, "a fuzz buffer"); }
static void mem_release(void *p) { devmem_free(g_backend, p); }
static void mem_upload(void *dev, const void *host, size_t bytes) { devmem_upload(g_backend, dev, host, bytes); }
static void mem_download(void *host, const void *dev, size_t bytes) { devmem_download(g_backend, host, dev, bytes); }
static void mem_sync(void) { devmem_sync(g_backend); }
static const fuzz_memory g_memory = {mem_alloc, mem_release, mem_upload, mem_download, mem_sync};

static const char *g_current = "";

/* A device error (a faulting kernel poisons the context): this input fails, and the totals so
 * far still end the output, since nothing after it can run. */
static void device_failed(const char *reason)
{
    printf("FAIL %s: %s\n", g_current, reason);
    printf("%ld passed, %ld failed\n", n_pass, n_fail + 1);
    fflush(stdout);
    _exit(1);
}

static int replay_file(nsa_context *ctx, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        printf("FAIL %s: cannot open\n", path);
        return 0;
    }
    size_t cap = 4096, n = 0;
    unsigned char *buf = (unsigned char *)malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            unsigned char *grown = (unsigned char *)realloc(buf, cap *= 2);
            if (!grown) free(buf);
            buf = grown;
        }
    }
    fclose(f);
    if (!buf) {
        printf("FAIL %s: out of memory reading it\n", path);
        return 0;
    }
    g_current = path;
    fuzz_result r = fuzz_run(buf, n, ctx, &g_memory);
    free(buf);
    const nsa_status st = r.ran ? r.status : r.query;
    if (!r.ran) n_skipped++;
    else if (st == NSA_STATUS_SUCCESS) n_success++;
    else if (st == NSA_STATUS_NOT_SUPPORTED) n_unsupported++;
    else n_rejected++;
    if (r.violations || g_verbose)
        printf("%s %s: %s, %s%s\n", r.violations ? "FAIL" : "ok", path, fuzz_op_name(r.op), nsa_status_string(st),
               r.ran ? "" : " (workspace too large to back; not called)");
    return r.violations == 0;
}

static void count(int ok) { ok ? n_pass++ : n_fail++; }

static int is_dir(const char *path)
{
    struct stat s;
    return stat(path, &s) == 0 && S_ISDIR(s.st_mode);
}

static int visible(const struct dirent *e) { return e->d_name[0] != '.'; }

static void replay_path(nsa_context *ctx, const char *path)
{
    if (!is_dir(path)) {
        count(replay_file(ctx, path));
        return;
    }
    struct dirent **names;
    const int n = scandir(path, &names, visible, alphasort);
    if (n < 0) {
        printf("FAIL %s: cannot list\n", path);
        count(0);
        return;
    }
    for (int i = 0; i < n; i++) {
        char file[4096];
        snprintf(file, sizeof file, "%s/%s", path, names[i]->d_name);
        if (!is_dir(file)) count(replay_file(ctx, file));
        free(names[i]);
    }
    free(names);
}

static int usage(void)
{
    fprintf(stderr, "usage: nsa_fuzz_replay [--backend cpu|cuda] [--verbose] PATH...\n"
                    "  replays fuzz inputs (files or folders of them, e.g. tests/fuzz/regressions tests/fuzz/corpus)\n");
    return 2;
}

int main(int argc, char **argv)
{
    int first = argc;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) {
            const char *b = argv[++i];
            if (!strcmp(b, "cpu")) g_backend = NSA_BACKEND_CPU;
            else if (!strcmp(b, "cuda")) g_backend = NSA_BACKEND_CUDA;
            else return usage();
        } else if (!strcmp(argv[i], "--verbose")) {
            g_verbose = 1;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h") || argv[i][0] == '-') {
            return usage();
        } else {
            first = i;
            break;
        }
    }
    if (first == argc) return usage();
    devmem_set_fail(device_failed);
    nsa_context *ctx = NULL;
    /* one thread: the CPU backend's result is the same, and runs under valgrind / sanitizers stay simple */
    const nsa_context_desc desc = {.backend = g_backend, .num_threads = 1};
    const nsa_status cs = nsa_context_create(&ctx, &desc);
    if (cs != NSA_STATUS_SUCCESS) {
        printf("FAIL cannot create a %s context: %s\n", g_backend == NSA_BACKEND_CUDA ? "cuda" : "cpu", nsa_status_string(cs));
        printf("0 passed, 1 failed\n");
        return 1;
    }
    for (int i = first; i < argc; i++) replay_path(ctx, argv[i]);
    nsa_context_destroy(ctx);
    printf("replay (%s): %ld inputs: %ld succeeded, %ld rejected, %ld not supported, %ld not called\n",
           g_backend == NSA_BACKEND_CUDA ? "cuda" : "cpu", n_pass + n_fail, n_success, n_rejected, n_unsupported, n_skipped);
    printf("%ld passed, %ld failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
