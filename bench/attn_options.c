/* attn_options.c -- CPU cost of each nsa_attention option against the plain call.
 *
 *   make NSA_CUDA=0 build/libnsa.a
 *   cc -O2 -std=c11 -Iinclude -o build/attn_options bench/attn_options.c build/libnsa.a -fopenmp -lm
 *   ./build/attn_options [T] [threads] [reps]   (defaults 2048, 0 = OpenMP default, 3)
 *
 * B = 1, HQ = 8, H = 2, D = 128, f32, causal (Tq = Tk = T except the "Tq = T/2" row).
 * GFLOP/s count the visible pairs (about T^2 / 2): forward 4 * HQ * D per pair, backward
 * 2.5x that; one warm-up call, then the best of `reps` (best-of, as a shared machine is noisy). */
#define _POSIX_C_SOURCE 199309L
#include <nsa.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *rnd(size_t n)
{
    float *x = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    return x;
}

static int g_reps = 3;

static double best(nsa_context *ctx, const nsa_attention_bwd_args *g, int bwd, void *ws, size_t n)
{
    double b = 1e30;
    for (int rep = 0; rep <= g_reps; rep++) {
        const double t0 = now();
        nsa_status st = bwd ? nsa_attention_bwd(ctx, g, ws, n) : nsa_attention(ctx, &g->fwd, ws, n);
        const double t = now() - t0;
        if (st != NSA_STATUS_SUCCESS) {
            fprintf(stderr, "status %d: %s\n", (int)st, nsa_status_string(st));
            exit(1);
        }
        if (rep > 0 && t < b) b = t;
    }
    return b;
}

int main(int argc, char **argv)
{
    const int64_t T = argc > 1 ? atoll(argv[1]) : 2048, HQ = 8, H = 2, D = 128;
    nsa_context_desc d;
    memset(&d, 0, sizeof d);
    d.num_threads = argc > 2 ? atoi(argv[2]) : 0;
    g_reps = argc > 3 ? atoi(argv[3]) : 3;
    nsa_context *ctx = NULL;
    if (nsa_context_create(&ctx, &d) != NSA_STATUS_SUCCESS) return 1;
    const size_t nq = (size_t)(T * HQ * D), nk = (size_t)(T * H * D), np = (size_t)(HQ * T * T);
    float *q = rnd(nq), *k = rnd(nk), *v = rnd(nk), *o = rnd(nq), *lse = rnd((size_t)(T * HQ)), *dout = rnd(nq);
    float *dq = rnd(nq), *dk = rnd(nk), *dv = rnd(nk), *sinks = rnd((size_t)HQ), *dsinks = rnd((size_t)HQ);
    float *bias = rnd(np), *dbias = rnd(np);
    int32_t *seg = calloc((size_t)T, sizeof(int32_t));
    uint8_t *mask = malloc(np);
    for (int64_t i = 0; i < T; i++) seg[i] = (int32_t)(i / 512);
    for (size_t i = 0; i < np; i++) mask[i] = (uint8_t)(rand() % 8 != 0);
    const char *rows[] = {"plain (fast path)", "Tq = T/2", "softcap", "sinks", "segment ids", "bias",
                          "bias + dbias", "mask", "dropout 0.1", "softcap+sinks+bias+mask+dropout"};
    printf("T=%lld HQ=%lld H=%lld D=%lld f32 causal, threads=%d\n", (long long)T, (long long)HQ, (long long)H,
           (long long)D, d.num_threads);
    printf("%-34s %10s %10s %10s %10s\n", "option", "fwd ms", "GFLOP/s", "bwd ms", "GFLOP/s");
    for (int r = 0; r < (int)(sizeof rows / sizeof rows[0]); r++) {
        nsa_attention_bwd_args g;
        memset(&g, 0, sizeof g);
        nsa_attention_args *a = &g.fwd;
        const int64_t Tq = r == 1 ? T / 2 : T;
        const int64_t s_one[1] = {HQ}, s_seg[2] = {1, T}, s_segq[2] = {1, Tq}, s_pair[4] = {1, HQ, Tq, T};
        a->q = nsa_tensor_4d(q, NSA_DTYPE_F32, 1, Tq, HQ, D);
        a->k = nsa_tensor_4d(k, NSA_DTYPE_F32, 1, T, H, D);
        a->v = nsa_tensor_4d(v, NSA_DTYPE_F32, 1, T, H, D);
        a->o = nsa_tensor_4d(o, NSA_DTYPE_F32, 1, Tq, HQ, D);
        a->lse = nsa_tensor_3d(lse, NSA_DTYPE_F32, 1, Tq, HQ);
        a->causal = 1;
        a->window_left = a->window_right = -1;
        g.dout = nsa_tensor_4d(dout, NSA_DTYPE_F32, 1, Tq, HQ, D);
        g.dq = nsa_tensor_4d(dq, NSA_DTYPE_F32, 1, Tq, HQ, D);
        g.dk = nsa_tensor_4d(dk, NSA_DTYPE_F32, 1, T, H, D);
        g.dv = nsa_tensor_4d(dv, NSA_DTYPE_F32, 1, T, H, D);
        const int all = r == 9;
        if (r == 2 || all) a->softcap = 5.0f;
        if (r == 3 || all) {
            a->sinks = nsa_tensor_make(sinks, NSA_DTYPE_F32, 1, s_one);
            g.dsinks = nsa_tensor_make(dsinks, NSA_DTYPE_F32, 1, s_one);
        }
        if (r == 4) {
            a->q_segment_ids = nsa_tensor_make(seg, NSA_DTYPE_I32, 2, s_segq);
            a->k_segment_ids = nsa_tensor_make(seg, NSA_DTYPE_I32, 2, s_seg);
        }
        if (r == 5 || r == 6 || all) a->bias = nsa_tensor_make(bias, NSA_DTYPE_F32, 4, s_pair);
        if (r == 6) g.dbias = nsa_tensor_make(dbias, NSA_DTYPE_F32, 4, s_pair);
        if (r == 7 || all) a->mask = nsa_tensor_make(mask, NSA_DTYPE_U8, 4, s_pair);
        if (r == 8 || all) a->dropout_p = 0.1f, a->dropout_seed = 1;
        size_t n1 = 0, n2 = 0;
        nsa_attention_workspace_size(ctx, a, &n1);
        nsa_attention_bwd_workspace_size(ctx, &g, &n2);
        void *ws = malloc(n1 > n2 ? n1 : n2);
        /* causal pairs: sum over queries of the visible keys (bottom-right aligned) */
        double pairs = 0;
        for (int64_t i = 0; i < Tq; i++) pairs += (double)(i + T - Tq + 1);
        const double fl = 4.0 * HQ * D * pairs;
        const double tf = best(ctx, &g, 0, ws, n1), tb = best(ctx, &g, 1, ws, n2);
        printf("%-34s %10.1f %10.1f %10.1f %10.1f\n", rows[r], 1e3 * tf, fl / tf / 1e9, 1e3 * tb, 2.5 * fl / tb / 1e9);
        fflush(stdout);
        free(ws);
    }
    nsa_context_destroy(ctx);
    return 0;
}
