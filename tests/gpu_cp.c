/* gpu_cp.c -- nsa_cp_forward / nsa_cp_backward (context parallelism over NCCL, nsa.h section
 * 10) on the machine's GPUs, one thread a rank on communicators from ncclCommInitAll, against
 * nsa_forward / nsa_backward over the whole sequences on GPU 0: every rank's rows of o and of dq,
 * dk, dv and the gate gradients within the bf16 rounding of two orders of summation; then the
 * refusals (NULL comm, a part that is not the rank's, a CPU context) with the outputs untouched.
 * Prints "N passed, N failed" last; with fewer than two GPUs or without NCCL it says so and
 * passes nothing (exit 0).
 *
 *   build/nsa_cp_tests [--T 3001] [--B 2]
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nsa.h"

static long g_pass, g_fail;
static void check(int ok, const char *what)
{
    if (ok) g_pass++;
    else g_fail++, printf("FAIL %s\n", what);
}

enum { HQ = 16, H = 2, D = 64, MAXP = 8 };

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint64_t g_rng = 0x2545F4914F6CDD1Dull;
static float rnd(float lo, float hi)
{
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return lo + (hi - lo) * (float)((g_rng >> 11) * (1.0 / 9007199254740992.0));
}

static void *dalloc(size_t bytes, const void *host)
{
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        printf("cudaMalloc of %zu bytes failed\n", bytes);
        exit(1);
    }
    if (host) cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice);
    else cudaMemset(p, 0, bytes ? bytes : 1);
    return p;
}

/* whole-sequence host arrays [B, T, X] (bf16 bits) */
typedef struct seqs {
    int64_t B, T;
    uint16_t *q, *k, *v, *g[3], *dout;
} seqs;

/* rows of rank r's part (zigzag, spec 15) of a [B, T, X] array into [B, L, X] */
static uint16_t *shard(const uint16_t *x, int64_t B, int64_t T, int64_t X, int r, int P, int64_t *L)
{
    const int64_t c[2] = {r, 2 * P - 1 - r};
    *L = nsa_cp_local_length(T, r, P);
    uint16_t *out = (uint16_t *)malloc((size_t)(B * *L * X + 1) * 2);
    for (int64_t b = 0; b < B; b++) {
        int64_t at = 0;
        for (int k = 0; k < 2; k++) {
            const int64_t lo = c[k] * T / (2 * P), hi = (c[k] + 1) * T / (2 * P);
            memcpy(out + (b * *L + at) * X, x + (b * T + lo) * X, (size_t)((hi - lo) * X) * 2);
            at += hi - lo;
        }
    }
    return out;
}

/* the position of local row i of rank r */
static int64_t position(int64_t i, int64_t T, int r, int P)
{
    const int64_t c0 = r, c1 = 2 * P - 1 - r, n0 = (c0 + 1) * T / (2 * P) - c0 * T / (2 * P);
    return i < n0 ? c0 * T / (2 * P) + i : c1 * T / (2 * P) + (i - n0);
}

typedef struct rank_job {
    int r, P, gates;
    void *comm;
    nsa_config cfg;
    const seqs *s;
    int64_t L;
    /* results, host [B, L, X] bf16 bits */
    uint16_t *o, *dq, *dk, *dv, *dg[3];
    nsa_status st_fwd, st_bwd;
} rank_job;

static void *rank_main(void *arg)
{
    rank_job *j = (rank_job *)arg;
    const seqs *s = j->s;
    const int64_t B = s->B, T = s->T, n = j->cfg.slc_topk;
    int64_t L = 0;
    cudaSetDevice(j->r);
    nsa_context *ctx = NULL;
    nsa_context_desc d = {NSA_BACKEND_CUDA, 0, j->r, NULL};
    if (nsa_context_create(&ctx, &d) != NSA_STATUS_SUCCESS) {
        j->st_fwd = NSA_STATUS_DEVICE_ERROR;
        return NULL;
    }
    uint16_t *hq = shard(s->q, B, T, HQ * D, j->r, j->P, &L), *hk = shard(s->k, B, T, H * D, j->r, j->P, &L);
    uint16_t *hv = shard(s->v, B, T, H * D, j->r, j->P, &L), *hdo = shard(s->dout, B, T, HQ * D, j->r, j->P, &L);
    j->L = L;
    nsa_cp_bwd_args a;
    memset(&a, 0, sizeof a);
    nsa_forward_args *f = &a.fwd.local;
    f->q = nsa_tensor_4d(dalloc((size_t)(B * L * HQ * D) * 2, hq), NSA_DTYPE_BF16, B, L, HQ, D);
    f->k = nsa_tensor_4d(dalloc((size_t)(B * L * H * D) * 2, hk), NSA_DTYPE_BF16, B, L, H, D);
    f->v = nsa_tensor_4d(dalloc((size_t)(B * L * H * D) * 2, hv), NSA_DTYPE_BF16, B, L, H, D);
    nsa_tensor *g[3] = {&f->g_cmp, &f->g_slc, &f->g_swa}, *so[3] = {&f->saved.o_cmp, &f->saved.o_slc, &f->saved.o_swa};
    nsa_tensor *sl[3] = {&f->saved.lse_cmp, &f->saved.lse_slc, &f->saved.lse_swa}, *dg[3] = {&a.dg_cmp, &a.dg_slc, &a.dg_swa};
    uint16_t *hg[3] = {NULL, NULL, NULL};
    for (int x = 0; x < 3; x++) {
        if (!(j->gates >> x & 1)) continue;
        hg[x] = shard(s->g[x], B, T, HQ, j->r, j->P, &L);
        *g[x] = nsa_tensor_3d(dalloc((size_t)(B * L * HQ) * 2, hg[x]), NSA_DTYPE_BF16, B, L, HQ);
        *so[x] = nsa_tensor_4d(dalloc((size_t)(B * L * HQ * D) * 2, NULL), NSA_DTYPE_BF16, B, L, HQ, D);
        *sl[x] = nsa_tensor_3d(dalloc((size_t)(B * L * HQ) * 4, NULL), NSA_DTYPE_F32, B, L, HQ);
        *dg[x] = nsa_tensor_3d(dalloc((size_t)(B * L * HQ) * 2, NULL), NSA_DTYPE_BF16, B, L, HQ);
    }
    if (j->gates & 2) f->saved.block_indices = nsa_tensor_4d(dalloc((size_t)(B * L * H * n) * 4, NULL), NSA_DTYPE_I32, B, L, H, n);
    f->o = nsa_tensor_4d(dalloc((size_t)(B * L * HQ * D) * 2, NULL), NSA_DTYPE_BF16, B, L, HQ, D);
    f->config = j->cfg;
    a.fwd.comm = j->comm;
    a.fwd.seq_len = T;
    a.dout = nsa_tensor_4d(dalloc((size_t)(B * L * HQ * D) * 2, hdo), NSA_DTYPE_BF16, B, L, HQ, D);
    a.dq = nsa_tensor_4d(dalloc((size_t)(B * L * HQ * D) * 2, NULL), NSA_DTYPE_BF16, B, L, HQ, D);
    a.dk = nsa_tensor_4d(dalloc((size_t)(B * L * H * D) * 2, NULL), NSA_DTYPE_BF16, B, L, H, D);
    a.dv = nsa_tensor_4d(dalloc((size_t)(B * L * H * D) * 2, NULL), NSA_DTYPE_BF16, B, L, H, D);
    size_t need = 0, need_b = 0;
    j->st_fwd = nsa_cp_forward_workspace_size(ctx, &a.fwd, &need);
    if (j->st_fwd == NSA_STATUS_SUCCESS) j->st_bwd = nsa_cp_backward_workspace_size(ctx, &a, &need_b);
    if (j->st_fwd == NSA_STATUS_SUCCESS && j->st_bwd == NSA_STATUS_SUCCESS) {
        void *ws = dalloc(need > need_b ? need : need_b, NULL);
        j->st_fwd = nsa_cp_forward(ctx, &a.fwd, ws, need > need_b ? need : need_b);
        if (j->st_fwd == NSA_STATUS_SUCCESS) j->st_bwd = nsa_cp_backward(ctx, &a, ws, need > need_b ? need : need_b);
        if (cudaDeviceSynchronize() != cudaSuccess) j->st_bwd = NSA_STATUS_DEVICE_ERROR;
        cudaFree(ws);
    } else if (j->st_fwd == NSA_STATUS_SUCCESS) {
        printf("rank %d: %s\n", j->r, nsa_last_error_detail());
    } else {
        printf("rank %d: %s\n", j->r, nsa_last_error_detail());
    }
    j->o = (uint16_t *)malloc((size_t)(B * L * HQ * D) * 2 + 2), j->dq = (uint16_t *)malloc((size_t)(B * L * HQ * D) * 2 + 2);
    j->dk = (uint16_t *)malloc((size_t)(B * L * H * D) * 2 + 2), j->dv = (uint16_t *)malloc((size_t)(B * L * H * D) * 2 + 2);
    cudaMemcpy(j->o, f->o.data, (size_t)(B * L * HQ * D) * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(j->dq, a.dq.data, (size_t)(B * L * HQ * D) * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(j->dk, a.dk.data, (size_t)(B * L * H * D) * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(j->dv, a.dv.data, (size_t)(B * L * H * D) * 2, cudaMemcpyDeviceToHost);
    for (int x = 0; x < 3; x++) {
        j->dg[x] = NULL;
        if (!hg[x]) continue;
        j->dg[x] = (uint16_t *)malloc((size_t)(B * L * HQ) * 2 + 2);
        cudaMemcpy(j->dg[x], dg[x]->data, (size_t)(B * L * HQ) * 2, cudaMemcpyDeviceToHost);
    }
    free(hq), free(hk), free(hv), free(hdo);
    for (int x = 0; x < 3; x++) free(hg[x]);
    nsa_context_destroy(ctx);
    return NULL;
}

/* max |got - want| over rank r's rows of a [B, T, X] whole result against its [B, L, X] part,
 * within 2e-2 of the whole's largest + 2e-3 */
static void compare(const char *what, const uint16_t *whole, const uint16_t *part, int64_t B, int64_t T, int64_t L,
                    int64_t X, int r, int P)
{
    double worst = 0, big = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < L; i++) {
            const int64_t t = position(i, T, r, P);
            for (int64_t e = 0; e < X; e++) {
                const double w = from_bf16(whole[(b * T + t) * X + e]), gv = from_bf16(part[(b * L + i) * X + e]);
                worst = fabs(w - gv) > worst || gv != gv ? (gv != gv ? INFINITY : fabs(w - gv)) : worst;
                big = fabs(w) > big ? fabs(w) : big;
            }
        }
    char msg[200];
    snprintf(msg, sizeof msg, "rank %d of %d: %s differs from the whole call's rows by %.3g (largest %.3g)", r, P, what, worst, big);
    check(worst <= 2e-2 * big + 2e-3, msg);
}

typedef int (*comm_init_all_fn)(void **, int, const int *);
typedef int (*comm_destroy_fn)(void *);

int main(int argc, char **argv)
{
    int64_t T = 3001, B = 2;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--T")) T = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--B")) B = atoll(argv[i + 1]);
    }
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess) ndev = 0;
    void *nccl = dlopen("libnccl.so.2", RTLD_NOW);
    if (ndev < 2 || !nccl || !nsa_cp_available()) {
        printf("context parallelism: %d GPU(s), NCCL %s: nothing to run\n0 passed, 0 failed\n", ndev,
               nccl && nsa_cp_available() ? "loaded" : "not found");
        return 0;
    }
    const int P = ndev < MAXP ? ndev : MAXP;
    comm_init_all_fn init_all = (comm_init_all_fn)dlsym(nccl, "ncclCommInitAll");
    comm_destroy_fn destroy = (comm_destroy_fn)dlsym(nccl, "ncclCommDestroy");
    void *comms[MAXP];
    int devs[MAXP];
    for (int i = 0; i < P; i++) devs[i] = i;
    if (!init_all || init_all(comms, P, devs) != 0) {
        printf("ncclCommInitAll failed\n0 passed, 1 failed\n");
        return 1;
    }
    nsa_config cfg = nsa_config_default();
    cfg.slc_topk = 8, cfg.window = 256;
    const int gates = 7;

    /* the whole sequences on the host, and the whole call on GPU 0 */
    seqs s = {B, T, NULL, NULL, NULL, {NULL, NULL, NULL}, NULL};
    const int64_t nq = B * T * HQ * D, nk = B * T * H * D, ng = B * T * HQ;
    s.q = (uint16_t *)malloc((size_t)nq * 2), s.k = (uint16_t *)malloc((size_t)nk * 2), s.v = (uint16_t *)malloc((size_t)nk * 2);
    s.dout = (uint16_t *)malloc((size_t)nq * 2);
    for (int64_t i = 0; i < nq; i++) s.q[i] = to_bf16(rnd(-1, 1)), s.dout[i] = to_bf16(rnd(-1, 1));
    for (int64_t i = 0; i < nk; i++) s.k[i] = to_bf16(rnd(-1, 1)), s.v[i] = to_bf16(rnd(-1, 1));
    for (int x = 0; x < 3; x++) {
        s.g[x] = (uint16_t *)malloc((size_t)ng * 2);
        for (int64_t i = 0; i < ng; i++) s.g[x][i] = to_bf16(rnd(0, 1));
    }
    cudaSetDevice(0);
    nsa_context *ctx0 = NULL;
    nsa_context_desc d0 = {NSA_BACKEND_CUDA, 0, 0, NULL};
    nsa_context_create(&ctx0, &d0);
    nsa_backward_args w;
    memset(&w, 0, sizeof w);
    nsa_forward_args *f = &w.fwd;
    f->q = nsa_tensor_4d(dalloc((size_t)nq * 2, s.q), NSA_DTYPE_BF16, B, T, HQ, D);
    f->k = nsa_tensor_4d(dalloc((size_t)nk * 2, s.k), NSA_DTYPE_BF16, B, T, H, D);
    f->v = nsa_tensor_4d(dalloc((size_t)nk * 2, s.v), NSA_DTYPE_BF16, B, T, H, D);
    nsa_tensor *g[3] = {&f->g_cmp, &f->g_slc, &f->g_swa}, *so[3] = {&f->saved.o_cmp, &f->saved.o_slc, &f->saved.o_swa};
    nsa_tensor *sl[3] = {&f->saved.lse_cmp, &f->saved.lse_slc, &f->saved.lse_swa}, *dg[3] = {&w.dg_cmp, &w.dg_slc, &w.dg_swa};
    for (int x = 0; x < 3; x++) {
        *g[x] = nsa_tensor_3d(dalloc((size_t)ng * 2, s.g[x]), NSA_DTYPE_BF16, B, T, HQ);
        *so[x] = nsa_tensor_4d(dalloc((size_t)nq * 2, NULL), NSA_DTYPE_BF16, B, T, HQ, D);
        *sl[x] = nsa_tensor_3d(dalloc((size_t)ng * 4, NULL), NSA_DTYPE_F32, B, T, HQ);
        *dg[x] = nsa_tensor_3d(dalloc((size_t)ng * 2, NULL), NSA_DTYPE_BF16, B, T, HQ);
    }
    f->saved.block_indices = nsa_tensor_4d(dalloc((size_t)(B * T * H * cfg.slc_topk) * 4, NULL), NSA_DTYPE_I32, B, T, H,
                                           cfg.slc_topk);
    f->o = nsa_tensor_4d(dalloc((size_t)nq * 2, NULL), NSA_DTYPE_BF16, B, T, HQ, D);
    f->config = cfg;
    w.dout = nsa_tensor_4d(dalloc((size_t)nq * 2, s.dout), NSA_DTYPE_BF16, B, T, HQ, D);
    w.dq = nsa_tensor_4d(dalloc((size_t)nq * 2, NULL), NSA_DTYPE_BF16, B, T, HQ, D);
    w.dk = nsa_tensor_4d(dalloc((size_t)nk * 2, NULL), NSA_DTYPE_BF16, B, T, H, D);
    w.dv = nsa_tensor_4d(dalloc((size_t)nk * 2, NULL), NSA_DTYPE_BF16, B, T, H, D);
    size_t n1 = 0, n2 = 0;
    check(nsa_forward_workspace_size(ctx0, f, &n1) == NSA_STATUS_SUCCESS && nsa_backward_workspace_size(ctx0, &w, &n2) ==
          NSA_STATUS_SUCCESS, "whole-sequence workspace queries");
    void *ws0 = dalloc(n1 > n2 ? n1 : n2, NULL);
    check(nsa_forward(ctx0, f, ws0, n1 > n2 ? n1 : n2) == NSA_STATUS_SUCCESS, "whole-sequence forward");
    check(nsa_backward(ctx0, &w, ws0, n1 > n2 ? n1 : n2) == NSA_STATUS_SUCCESS, "whole-sequence backward");
    cudaDeviceSynchronize();
    uint16_t *wo = (uint16_t *)malloc((size_t)nq * 2), *wdq = (uint16_t *)malloc((size_t)nq * 2);
    uint16_t *wdk = (uint16_t *)malloc((size_t)nk * 2), *wdv = (uint16_t *)malloc((size_t)nk * 2), *wdg[3];
    cudaMemcpy(wo, f->o.data, (size_t)nq * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(wdq, w.dq.data, (size_t)nq * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(wdk, w.dk.data, (size_t)nk * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(wdv, w.dv.data, (size_t)nk * 2, cudaMemcpyDeviceToHost);
    for (int x = 0; x < 3; x++) {
        wdg[x] = (uint16_t *)malloc((size_t)ng * 2);
        cudaMemcpy(wdg[x], dg[x]->data, (size_t)ng * 2, cudaMemcpyDeviceToHost);
    }

    /* the same on P ranks, one thread each */
    rank_job jobs[MAXP];
    pthread_t th[MAXP];
    for (int r = 0; r < P; r++) {
        memset(&jobs[r], 0, sizeof jobs[r]);
        jobs[r].r = r, jobs[r].P = P, jobs[r].gates = gates, jobs[r].comm = comms[r], jobs[r].cfg = cfg, jobs[r].s = &s;
        pthread_create(&th[r], NULL, rank_main, &jobs[r]);
    }
    for (int r = 0; r < P; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < P; r++) {
        rank_job *j = &jobs[r];
        char msg[160];
        snprintf(msg, sizeof msg, "rank %d: nsa_cp_forward / nsa_cp_backward returned %s / %s", r, nsa_status_string(j->st_fwd),
                 nsa_status_string(j->st_bwd));
        check(j->st_fwd == NSA_STATUS_SUCCESS && j->st_bwd == NSA_STATUS_SUCCESS, msg);
        if (j->st_fwd != NSA_STATUS_SUCCESS || j->st_bwd != NSA_STATUS_SUCCESS) continue;
        compare("o", wo, j->o, B, T, j->L, HQ * D, r, P);
        compare("dq", wdq, j->dq, B, T, j->L, HQ * D, r, P);
        compare("dk", wdk, j->dk, B, T, j->L, H * D, r, P);
        compare("dv", wdv, j->dv, B, T, j->L, H * D, r, P);
        static const char *const gn[3] = {"dg_cmp", "dg_slc", "dg_swa"};
        for (int x = 0; x < 3; x++)
            if (j->dg[x]) compare(gn[x], wdg[x], j->dg[x], B, T, j->L, HQ, r, P);
    }

    /* refusals, before any collective: the outputs stay as they were */
    {
        nsa_cp_args a;
        memset(&a, 0, sizeof a);
        a.local = *f; /* rank 0's view of GPU 0's whole tensors: T rows, not rank 0's L */
        a.comm = comms[0];
        a.seq_len = T;
        size_t need = 0;
        check(nsa_cp_forward_workspace_size(ctx0, &a, &need) == NSA_STATUS_BAD_SHAPE, "a part that is not the rank's: BAD_SHAPE");
        check(strstr(nsa_last_error_detail(), "local.q") != NULL, "the detail names local.q");
        a.comm = NULL;
        check(nsa_cp_forward(ctx0, &a, ws0, n1) == NSA_STATUS_NULL_POINTER, "NULL comm: NULL_POINTER");
        a.comm = comms[0], a.seq_len = -1;
        check(nsa_cp_forward(ctx0, &a, ws0, n1) == NSA_STATUS_BAD_ARGUMENT, "negative seq_len: BAD_ARGUMENT");
        uint16_t *after = (uint16_t *)malloc((size_t)nq * 2);
        cudaMemcpy(after, f->o.data, (size_t)nq * 2, cudaMemcpyDeviceToHost);
        check(!memcmp(after, wo, (size_t)nq * 2), "refused calls left o untouched");
        free(after);
        nsa_context *cpu = NULL;
        nsa_context_desc dc = {NSA_BACKEND_CPU, 1, 0, NULL};
        nsa_context_create(&cpu, &dc);
        check(nsa_cp_forward_workspace_size(cpu, &a, &need) == NSA_STATUS_NOT_SUPPORTED, "a CPU context: NOT_SUPPORTED");
        nsa_context_destroy(cpu);
    }
    for (int r = 0; r < P; r++) destroy(comms[r]);
    nsa_context_destroy(ctx0);
    printf("context parallelism on %d GPUs, B %lld, T %lld: %ld passed, %ld failed\n", P, (long long)B, (long long)T, g_pass, g_fail);
    printf("%ld passed, %ld failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
