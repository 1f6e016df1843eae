/* test_backend.c -- the CPU backend against the float64 reference: the spec's edge cases
 * one by one, then a fixed-seed random sweep (see sweep.c for the tolerance rule). */
#include "harness.h"
#include "sweep.h"
#include <string.h>

static nsa_context *cpu_context(int threads)
{
    nsa_context_desc d;
    memset(&d, 0, sizeof d);
    d.backend = NSA_BACKEND_CPU;
    d.num_threads = threads;
    nsa_context *ctx = NULL;
    nsa_context_create(&ctx, &d);
    return ctx;
}

/* A fully specified case: every field set, so nothing is drawn at random. */
static sweep_case edge(int64_t B, int64_t T, int64_t HQ, int64_t H, int64_t DK, int64_t DV, nsa_dtype dt)
{
    sweep_case c;
    memset(&c, 0, sizeof c);
    c.B = B, c.T = T, c.HQ = HQ, c.H = H, c.DK = DK, c.DV = DV, c.dtype = dt;
    c.cfg = nsa_config_default();
    c.gates = 7;
    return c;
}

static void test_edge_cases(nsa_context *ctx)
{
    uint64_t seed = 1000;
    sweep_case c;
    /* T = 1 */
    c = edge(1, 1, 4, 2, 16, 16, NSA_DTYPE_F32);
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    /* T < l: no compressed block anywhere (o_cmp = 0, lse = -inf, no NaN) */
    c = edge(2, 20, 4, 1, 16, 8, NSA_DTYPE_BF16);
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    /* n larger than the candidates everywhere (T = 200, l' = 64: at most 4 blocks) */
    c = edge(1, 200, 2, 1, 32, 32, NSA_DTYPE_F32);
    c.cfg.slc_topk = 16;
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    /* all-equal scores: q = 0, the tie rule decides every selection */
    c = edge(1, 300, 4, 2, 16, 16, NSA_DTYPE_F32);
    c.cfg.cmp_len = c.cfg.cmp_stride = c.cfg.slc_block = 16;
    c.cfg.slc_topk = 4;
    c.zero_q = 1;
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    /* varlen with empty and length-1 sequences, paper config */
    c = edge(1, 0, 4, 1, 16, 16, NSA_DTYPE_BF16);
    c.varlen = 1, c.num_seqs = 5;
    c.lens[0] = 0, c.lens[1] = 1, c.lens[2] = 150, c.lens[3] = 0, c.lens[4] = 77;
    c.T = 228;
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    /* strided views of every kind, both layouts, G = 16, DK != DV */
    c = edge(2, 65, 16, 1, 192 / 4, 128 / 4, NSA_DTYPE_BF16);
    c.strided = 1;
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    c.strided = 2;
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    /* fla's configuration l = d = l' = 64 with caller compression and caller selection */
    c = edge(1, 300, 2, 2, 32, 32, NSA_DTYPE_F32);
    c.cfg.cmp_len = c.cfg.cmp_stride = c.cfg.slc_block = 64;
    c.own_cmp = 1, c.own_idx = 1, c.sep_slc = 1, c.sep_swa = 1;
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    /* full head dims of the paper: 128/128 and 192/128, f16 storage */
    c = edge(1, 130, 2, 1, 128, 128, NSA_DTYPE_F16);
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
    c = edge(1, 130, 2, 2, 192, 128, NSA_DTYPE_BF16);
    sweep_run_case(ctx, &c, seed++, g_tests_verbose);
}

void test_backend_all(void)
{
    nsa_context *ctx = cpu_context(0);
    CHECK(ctx != NULL);
    if (!ctx) return;
    test_edge_cases(ctx);
    nsa_context_destroy(ctx);
    sweep_opts o;
    memset(&o, 0, sizeof o);
    o.seed = 20261122;
    o.max_cases = 60;
    o.backend = NSA_BACKEND_CPU;
    o.verbose = g_tests_verbose ? 2 : 0;
    sweep_run(&o);
}
