/* flex/flex.cu -- block-sparse attention with mods on the GPU (spec 14): the kernel is generated
 * for each (mask_mod, score_mod, dtype) from the expressions' C source (mod/expr.c expr_to_c),
 * compiled at run time by NVRTC (loaded with dlopen: a machine without it runs the CPU backend
 * and gets NOT_SUPPORTED here, with the reason), loaded with cudaLibraryLoadData and cached per
 * context in memory and on disk by a hash of its source and the architecture.
 *
 * The forward's kernels, in the order a call looks for them: on sm_90 the Hopper one
 * (FLEX_WG_FWD: f16 / bf16, head dims 64 / 128, q blocks of whole 128-row tiles, key blocks of
 * whole 64-key slices; TMA and wgmma); else the mma.sync ones (FLEX_TC_KERNEL: block sizes
 * multiples of 16; 64 query rows a CTA or 16 a warp); the scalar one takes every other call and
 * the calls whose V holds a non-finite value: one warp per (batch entry, query head, query row),
 * the visible keys walked twice (the max, then the weights) as the CPU's flex_row does. The
 * backward likewise: FLEX_WG_BWD (q and key blocks of whole 128-row tiles), FLEX_TC_BWD, the
 * scalar pair. The lists are checked on the host first (copied back: the same check as the
 * CPU's, so a bad list is a status and nothing is written). */
#include <dlfcn.h>
#include <nvrtc.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../prim/run.h"
#include "../prim/simt.cuh"
#include "../prim/tmap.h"
#include "../cuda_backend.h"
extern "C" {
#include "../../mod/expr.h"
#include "../../flex_route.h"
}

/* ---- the parameter block: one definition for the host and for the generated source ---------- */
#define FLEX_PARAM_FIELDS                                                                          \
    const void *q; const void *k; const void *v; void *o; float *lse;                              \
    long long qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2, ls0, ls1, ls2;           \
    const int *num; const int *idx; const int *fnum; const int *fidx;                              \
    long long ns0, ns1, ns2, is0, is1, is2, is3, fns0, fns1, fns2, fis0, fis1, fis2, fis3;         \
    long long nB, nH, iB, iH, fnB, fnH, fiB, fiH;                                                  \
    long long B, Tq, Tk, HQ, G, DK, DV, q_block, kv_block, nkb;                                    \
    const int *nf; int nf_role;                                                                    \
    float scale;
#define FLEX_STR2(...) #__VA_ARGS__
#define FLEX_STR(x) FLEX_STR2(x)

struct flex_params {
    FLEX_PARAM_FIELDS
};

/* The backward's own arguments beside flex_params (whose o and lse are the forward's outputs):
 * dout, the three gradients, the rows' D = dout . o (workspace, [B, HQ, Tq]) and whether a
 * score_mod tensor's gradient is wanted. */
#define FLEX_GRAD_FIELDS                                                                           \
    const void *dout; void *dq; void *dk; void *dv; float *D;                                      \
    long long dos0, dos1, dos2, dqs0, dqs1, dqs2, dks0, dks1, dks2, dvs0, dvs1, dvs2;              \
    int scatter;                                                                                   \
    float *L2; long long tpad; const unsigned char *kinds; long long kB, kH;
struct flex_grads {
    FLEX_GRAD_FIELDS
};

/* Where the score_mod's tensor gradients go: per float capture wanted, an exact accumulator of
 * FLEX_ACC_WORDS words an element (NULL: not wanted). Sums of floats in integers are exact and
 * so the same in any order: the atomics that scatter them leave the result deterministic. */
#define FLEX_ACC_WORDS 13
struct flex_sink {
    unsigned long long *acc[NSA_MOD_MAX_TENSORS];
};

/* The tensor-core kernels' warps a CTA and cp.async stages, given to their source as TC_WARPS
 * and TC_STAGES (one value for the kernels and for the host's grid and shared-memory sizes). */
#define FLEX_TC_WARPS 4
#define FLEX_TC_STAGES 3
/* The Hopper forward's K / V stages (WG_NS), and its shared memory: Q's 128 rows, the stages of
 * bn keys, the 2 stages + 1 mbarriers and the slack that aligns the swizzled tiles to 1024 bytes. */
#define FLEX_WG_STAGES 2
/* Mods of at most this many instructions (both together) are unrolled over a slice's every
 * score in the tensor-core kernels (NSA_MOD_UNROLL); larger ones run in a rolled loop that keeps
 * their code, and a new mod's compile time, small. */
#define FLEX_MOD_UNROLL_MAX 24
static size_t flex_wg_smem(int64_t dk, int64_t dv, int bn)
{
    return (size_t)(128 * dk * 2 + FLEX_WG_STAGES * bn * (dk + dv) * 2) + (2 * FLEX_WG_STAGES + 1) * 8 + 1024;
}

/* What every generated source holds after the prelude and the two mod functions (nsa_flex_mask,
 * nsa_flex_score): the parameter block, element loads and stores, the walk over a row's keys. */
static const char FLEX_COMMON[] =
    "struct flex_params { " FLEX_STR(FLEX_PARAM_FIELDS) " };\n"
    "#define COLS 8\n"
    "__device__ __forceinline__ float ld_elem(const void *p, long long i)\n"
    "{\n"
    "#if NSA_ELEM == 0\n"
    "    return ((const float *)p)[i];\n"
    "#elif NSA_ELEM == 1\n"
    "    return nsa_mod_f16(((const unsigned short *)p)[i]);\n"
    "#else\n"
    "    return nsa_mod_fbits((unsigned int)((const unsigned short *)p)[i] << 16);\n"
    "#endif\n"
    "}\n"
    "__device__ __forceinline__ unsigned int fbits(float f) { union { float f; unsigned int u; } x; x.f = f; return x.u; }\n"
    "__device__ __forceinline__ void st_elem(void *p, long long i, float f)\n"
    "{\n"
    "#if NSA_ELEM == 0\n"
    "    ((float *)p)[i] = f;\n"
    "#elif NSA_ELEM == 1\n"
    "    unsigned int u = fbits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu, h;\n"
    "    if (a > 0x7f800000u) h = sign | 0x7e00u;\n"
    "    else if (a >= 0x477ff000u) h = sign | 0x7c00u;\n"
    "    else if (a < 0x38800000u) {\n"
    "        float af = nsa_mod_fbits(a) * 16777216.0f;\n"
    "        unsigned int m = (unsigned int)af;\n"
    "        float rem = af - (float)m;\n"
    "        if (rem > 0.5f || (rem == 0.5f && (m & 1u))) m++;\n"
    "        h = sign | m;\n"
    "    } else h = sign | ((a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u) >> 13);\n"
    "    ((unsigned short *)p)[i] = (unsigned short)h;\n"
    "#else\n"
    "    unsigned int u = fbits(f);\n"
    "    ((unsigned short *)p)[i] = (unsigned short)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u\n"
    "                                                : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);\n"
    "#endif\n"
    "}\n"
    "__device__ __forceinline__ long long clampll(long long x, long long lo, long long hi) { return x < lo ? lo : x > hi ? hi : x; }\n"
    "/* the key-block list of one query block: n_part partial entries then n_full full ones (each\n"
    " * checked on the host: in range, listed once) */\n"
    "struct block_list {\n"
    "    const int *part, *full;\n"
    "    long long n_part, n_full, step_part, step_full;\n"
    "    __device__ __forceinline__ long long block(long long e) const\n"
    "    {\n"
    "        return e < n_part ? (part ? (long long)part[e * step_part] : e) : (long long)full[(e - n_part) * step_full];\n"
    "    }\n"
    "};\n"
    "/* the lists of (b, hq, query block qb) (no block mask: every key block, partial) */\n"
    "__device__ __forceinline__ block_list block_list_of(const flex_params &P, long long b, long long hq, long long qb)\n"
    "{\n"
    "    block_list L;\n"
    "    L.part = 0, L.full = 0, L.n_part = P.nkb, L.n_full = 0, L.step_part = 1, L.step_full = 1;\n"
    "    if (P.num) {\n"
    "        const long long bb = P.nB == 1 ? 0 : b, hh = P.nH == 1 ? 0 : hq, ib = P.iB == 1 ? 0 : b, ih = P.iH == 1 ? 0 : hq;\n"
    "        L.n_part = P.num[bb * P.ns0 + hh * P.ns1 + qb * P.ns2];\n"
    "        L.part = P.idx + ib * P.is0 + ih * P.is1 + qb * P.is2, L.step_part = P.is3;\n"
    "        if (P.fnum) {\n"
    "            const long long fb = P.fnB == 1 ? 0 : b, fh = P.fnH == 1 ? 0 : hq, fib = P.fiB == 1 ? 0 : b, fih = P.fiH == 1 ? 0 : hq;\n"
    "            L.n_full = P.fnum[fb * P.fns0 + fh * P.fns1 + qb * P.fns2];\n"
    "            L.full = P.fidx + fib * P.fis0 + fih * P.fis1 + qb * P.fis2, L.step_full = P.fis3;\n"
    "        }\n"
    "    }\n"
    "    return L;\n"
    "}\n"
    "/* the visible keys of row i of (b, hq), in the CPU's order: partial blocks, then full ones */\n"
    "template <class F>\n"
    "__device__ void visit(const flex_params &P, const nsa_mod_caps *mc, long long b, long long hq, long long i, F f)\n"
    "{\n"
    "    const block_list L = block_list_of(P, b, hq, i / P.q_block);\n"
    "    for (long long e = 0; e < L.n_part + L.n_full; e++) {\n"
    "        const int full = e >= L.n_part;\n"
    "        const long long k0 = L.block(e) * P.kv_block, k1 = k0 + P.kv_block < P.Tk ? k0 + P.kv_block : P.Tk;\n"
    "        for (long long kv = k0; kv < k1; kv++)\n"
    "            if (full || nsa_flex_mask(mc, b, hq, i, kv)) f(kv);\n"
    "    }\n"
    "}\n";

/* The scalar forward (after FLEX_COMMON). */
static const char FLEX_KERNEL[] =
    "#if NSA_KERNEL == 0\n"
    "extern \"C\" __global__ void nsa_flex_fwd(const flex_params P, const nsa_mod_caps mc, const nsa_mod_caps sc)\n"
    "{\n"
    "    if (P.nf_role == 2 && *(const volatile int *)P.nf == 0) return; /* beside the tensor-core kernel: finite inputs */\n"
    "    const int lane = threadIdx.x & 31;\n"
    "    const long long nw = (long long)gridDim.x * (blockDim.x >> 5);\n"
    "    const long long items = P.B * P.HQ * P.Tq;\n"
    "    const float NEG_INF = nsa_mod_fbits(0xff800000u);\n"
    "    for (long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < items; w += nw) {\n"
    "        const long long i = w % P.Tq, hq = (w / P.Tq) % P.HQ, b = w / (P.Tq * P.HQ), h = hq / P.G;\n"
    "        float q[COLS], acc[COLS];\n"
    "        for (int c = 0; c < COLS; c++) {\n"
    "            const long long d = lane + 32 * c;\n"
    "            q[c] = d < P.DK ? ld_elem(P.q, b * P.qs0 + i * P.qs1 + hq * P.qs2 + d) : 0.0f;\n"
    "            acc[c] = 0.0f;\n"
    "        }\n"
    "        float m = NEG_INF, l = 0.0f;\n"
    "        for (int pass = 0; pass < 2; pass++) {\n"
    "            if (pass == 1 && m == NEG_INF) break; /* no key, or only -inf scores: an empty row */\n"
    "            visit(P, &mc, b, hq, i, [&](long long kv) {\n"
    "                float s = 0.0f;\n"
    "                for (int c = 0; c < COLS; c++) {\n"
    "                    const long long d = lane + 32 * c;\n"
    "                    if (d < P.DK) s += q[c] * ld_elem(P.k, b * P.ks0 + kv * P.ks1 + h * P.ks2 + d);\n"
    "                }\n"
    "                for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);\n"
    "                s = nsa_flex_score(&sc, b, hq, i, kv, s * P.scale);\n"
    "                if (pass == 0) {\n"
    "                    m = s > m || s != s || m != m ? (m != m ? m : s) : m; /* NaN wins */\n"
    "                    return;\n"
    "                }\n"
    "                const float wgt = expf(s - m);\n"
    "                if (wgt == 0.0f) return; /* a -inf score hides its pair */\n"
    "                l += wgt;\n"
    "                for (int c = 0; c < COLS; c++) {\n"
    "                    const long long d = lane + 32 * c;\n"
    "                    if (d < P.DV) acc[c] += wgt * ld_elem(P.v, b * P.vs0 + kv * P.vs1 + h * P.vs2 + d);\n"
    "                }\n"
    "            });\n"
    "        }\n"
    "        const int empty = m == NEG_INF;\n"
    "        for (int c = 0; c < COLS; c++) {\n"
    "            const long long d = lane + 32 * c;\n"
    "            if (d < P.DV) st_elem(P.o, b * P.os0 + i * P.os1 + hq * P.os2 + d, empty ? 0.0f : acc[c] / l);\n"
    "        }\n"
    "        if (P.lse && lane == 0) P.lse[b * P.ls0 + i * P.ls1 + hq * P.ls2] = empty ? NEG_INF : m + logf(l);\n"
    "    }\n"
    "}\n"
    "#endif\n";

/* What both tensor-core backward forms end with (after FLEX_TC_COMMON): a thread's two rows of dq,
 * and its two keys of dk and dv, from the accumulator fragments (the mma C order; rows or keys
 * `first` and `first + 8`), dq and dk times the scale. */
static const char FLEX_TB_COMMON[] = R"NSA(
__device__ __forceinline__ void tb_store_dq(const flex_params &P, const flex_grads &R, const float (&acc)[NSA_DK / 8][4], long long b,
                                            long long hq, long long first, int lane)
{
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const long long i = first + 8 * r;
        if (i >= P.Tq) continue;
        const long long ob = b * R.dqs0 + i * R.dqs1 + hq * R.dqs2;
#pragma unroll
        for (int q = 0; q < NSA_DK / 8; q++) {
            const int col = q * 8 + 2 * (lane & 3);
            st_elem(R.dq, ob + col, acc[q][2 * r] * P.scale);
            st_elem(R.dq, ob + col + 1, acc[q][2 * r + 1] * P.scale);
        }
    }
}
__device__ __forceinline__ void tb_store_dkdv(const flex_params &P, const flex_grads &R, const float (&dk)[NSA_DK / 8][4],
                                              const float (&dv)[NSA_DV / 8][4], long long b, long long h, long long first, int lane)
{
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const long long kv = first + 8 * r;
        if (kv >= P.Tk) continue;
#pragma unroll
        for (int q = 0; q < NSA_DK / 8; q++) {
            const int col = q * 8 + 2 * (lane & 3);
            st_elem(R.dk, b * R.dks0 + kv * R.dks1 + h * R.dks2 + col, dk[q][2 * r] * P.scale);
            st_elem(R.dk, b * R.dks0 + kv * R.dks1 + h * R.dks2 + col + 1, dk[q][2 * r + 1] * P.scale);
        }
#pragma unroll
        for (int q = 0; q < NSA_DV / 8; q++) {
            const int col = q * 8 + 2 * (lane & 3);
            st_elem(R.dv, b * R.dvs0 + kv * R.dvs1 + h * R.dvs2 + col, dv[q][2 * r]);
            st_elem(R.dv, b * R.dvs0 + kv * R.dvs1 + h * R.dvs2 + col + 1, dv[q][2 * r + 1]);
        }
    }
}
)NSA";

/* The Hopper backward (after FLEX_WG_COMMON; the same scores, probabilities and dU as the
 * mma.sync backward, on wgmma tiles). Two kernels, each CTA owning what it writes (deterministic):
 * nsa_flex_bwd_dq_tc, 128 query rows of one (b, hq) in two consumer warpgroups, Q and dout loaded
 * once, 64-key slices of K and V from the row block's list: S = Q K^T and dP = dout V^T by wgmma,
 * dQ += dU K with dU from registers; it also writes each row's D = dout . o and lse in log2 units
 * (+inf for a row that saw no key, and for the rows past Tq) into R.D and R.L2, [B, HQ, R.tpad].
 * nsa_flex_bwd_dkdv_tc, 128 keys of one key block and kv head (K, V loaded once), walking the
 * query blocks that list the key block (R.kinds, the transposed lists: 0 not listed, 1 partial,
 * 2 full; NULL: every block partial) over the group's query heads in 64-row slices of Q, dout,
 * lse and D: S^T = K Q^T, dP^T = V dout^T, dV += P^T dout, dK += dU^T Q. */
static const char FLEX_WG_BWD[] = R"NSA(
#define WB_SR 64  /* keys a dq slice, query rows a dk / dv slice */
#define WB_BM 128 /* query rows a dq CTA, keys a dk / dv CTA */
#define WB_SS WG_CAT(wg_ss, 64)
#define WB_RS_K WG_CAT(wg_rs, NSA_DK)
#define WB_RS_V WG_CAT(wg_rs, NSA_DV)
#define WB_INF nsa_mod_fbits(0x7f800000u)
/* the A fragments of 16-column steps of an accumulator x[NF][4] (rounded to the storage type) */
template <int NF>
__device__ __forceinline__ void wb_frags(unsigned (&pa)[NF / 2][4], const float (&x)[NF][4])
{
#pragma unroll
    for (int k = 0; k < NF / 2; k++) {
        pa[k][0] = tc_pack(x[2 * k][0], x[2 * k][1]), pa[k][1] = tc_pack(x[2 * k][2], x[2 * k][3]);
        pa[k][2] = tc_pack(x[2 * k + 1][0], x[2 * k + 1][1]), pa[k][3] = tc_pack(x[2 * k + 1][2], x[2 * k + 1][3]);
    }
}
/* x (NF fragments) = A B^T over D columns: A 64 rows of a tile of RA rows at a, B 64 rows of a tile at b */
template <int NF, int D, int RA, int RB>
__device__ __forceinline__ void wb_abt(float (&x)[NF][4], const unsigned char *a, const unsigned char *b)
{
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        WB_SS(&x[0][0], wg_desc(a + (kk >> 2) * RA * 128 + (kk & 3) * 32, 16, 1024), wg_desc(b + (kk >> 2) * RB * 128 + (kk & 3) * 32, 16, 1024),
              kk > 0);
}
/* One pair's probability p (0 when hidden) and dU = dS d(score_mod)/d(score), dS = p (dp - D),
 * from the scaled product u, the row's lse in log2 units l2 and D; a scattering call (R.scatter:
 * the score_mod's tensor gradients) pushes dS through the reverse mode into the sink. */
__device__ __forceinline__ void wb_pair(const flex_grads &R, const nsa_mod_caps &sc, const nsa_mod_sink *sink, long long b,
                                        long long hq, flex_idx qi, flex_idx kv, int seen, float u, float dp, float l2, float Dr,
                                        float *p_out, float *du_out)
{
    float d1 = 1.0f;
    const float val = NSA_SCORE_ID ? u : nsa_mod_score_grad(&sc, 0, b, hq, qi, kv, u, 1.0f, &d1);
    const float p = seen && l2 != WB_INF ? tc_exp2(val * TC_LOG2E - l2) : 0.0f;
    const float ds = p * (dp - Dr);
    float du = ds == 0.0f ? 0.0f : ds * d1; /* (0 whatever d1: the reverse mode's rule) */
    if (sink && R.scatter && p != 0.0f) nsa_mod_score_grad(&sc, sink, b, hq, qi, kv, u, ds, &du);
    *p_out = p, *du_out = du;
}

/* f(x, y, col, e) on each score x of a slice's NS fragments and its partner y (column col =
 * 8 n8 + 2 (lane % 4) + e % 2 of the fragment's 8, row by e / 2): unrolled (UNROLL), or two
 * fragments a turn with the others rotated into place (the forward's reason: the mods' code
 * 8 times in the kernel, not 4 NS) */
template <int NS, bool UNROLL, class F>
__device__ __forceinline__ void wb_walk(float (&x)[NS][4], float (&y)[NS][4], int lane, F f)
{
    if (UNROLL) {
#pragma unroll
        for (int n8 = 0; n8 < NS; n8++)
#pragma unroll
            for (int e = 0; e < 4; e++) f(x[n8][e], y[n8][e], n8 * 8 + 2 * (lane & 3) + (e & 1), e);
        return;
    }
#pragma unroll 1
    for (int q2 = 0; q2 < NS / 2; q2++) {
#pragma unroll
        for (int n8 = 0; n8 < 2; n8++)
#pragma unroll
            for (int e = 0; e < 4; e++) f(x[n8][e], y[n8][e], (2 * q2 + n8) * 8 + 2 * (lane & 3) + (e & 1), e);
        float t2[2][4], t3[2][4];
#pragma unroll
        for (int e = 0; e < 4; e++) t2[0][e] = x[0][e], t2[1][e] = x[1][e], t3[0][e] = y[0][e], t3[1][e] = y[1][e];
#pragma unroll
        for (int m = 0; m + 2 < NS; m++)
#pragma unroll
            for (int e = 0; e < 4; e++) x[m][e] = x[m + 2][e], y[m][e] = y[m + 2][e];
#pragma unroll
        for (int e = 0; e < 4; e++)
            x[NS - 2][e] = t2[0][e], x[NS - 1][e] = t2[1][e], y[NS - 2][e] = t3[0][e], y[NS - 1][e] = t3[1][e];
    }
}

#if NSA_KERNEL == 2
extern "C" __global__ void __launch_bounds__(384, 1) nsa_flex_bwd_dq_tc(const flex_params P, const flex_grads R,
                                                                       const nsa_mod_caps mc, const nsa_mod_caps sc,
                                                                       const nsa_mod_sink sink, const __grid_constant__ wg_tmap tq,
                                                                       const __grid_constant__ wg_tmap tdo,
                                                                       const __grid_constant__ wg_tmap tk,
                                                                       const __grid_constant__ wg_tmap tv)
{
    constexpr int NS = WB_SR / 8, QB = WB_BM * NSA_DK * 2, OB = WB_BM * NSA_DV * 2, KB = WB_SR * NSA_DK * 2, VB = WB_SR * NSA_DV * 2;
    if (P.nf && *(const volatile int *)P.nf != 0) return; /* a non-finite input: the scalar kernels compute the call */
    extern __shared__ unsigned char wg_raw[];
    unsigned char *Qs = wg_align(wg_raw), *Os = Qs + QB, *Ks = Os + OB, *Vs = Ks + WG_NS * KB;
    unsigned long long *full = (unsigned long long *)(Vs + WG_NS * VB), *empty = full + WG_NS, *qfull = empty + WG_NS;
    const wg_rows W = wg_rows_of(P, WB_SR);
    const long long hq = W.hq, b = W.b, u0 = W.u0, nt = W.nt;
    wg_init_barriers(full, empty, qfull);
    if (threadIdx.x >= 256) { /* the producer warpgroup: one thread issues every copy */
        WG_REGS_PRODUCER();
        if (threadIdx.x != 256) return;
        mb_expect(qfull, QB + OB);
        tma_tile(Qs, &tq, NSA_DK, WB_BM, u0, hq, b, qfull);
        tma_tile(Os, &tdo, NSA_DV, WB_BM, u0, hq, b, qfull);
        wg_produce_kv(P, W, WB_SR, Ks, Vs, KB, VB, &tk, &tv, full, empty);
        return;
    }
    WG_REGS_CONSUMER();
    const int lane = threadIdx.x & 31, wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3;
    const long long row = u0 + 64 * wg + 16 * warp + (lane >> 2); /* this thread's rows: row, row + 8 */
    const flex_idx r0 = (flex_idx)(row < P.Tq ? row : P.Tq - 1), r1 = (flex_idx)(row + 8 < P.Tq ? row + 8 : P.Tq - 1);
    /* the rows' D = dout . o (the quad's columns, then summed over it) and lse in log2 units */
    float l2[2], Dr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const long long i = row + 8 * r;
        float d = 0.0f;
        if (i < P.Tq)
#pragma unroll
            for (int q = 0; q < NSA_DV / 8; q++)
#pragma unroll
                for (int x = 0; x < 2; x++) {
                    const int col = q * 8 + 2 * (lane & 3) + x;
                    d += ld_elem(R.dout, b * R.dos0 + i * R.dos1 + hq * R.dos2 + col) * ld_elem(P.o, b * P.os0 + i * P.os1 + hq * P.os2 + col);
                }
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        d += __shfl_xor_sync(0xffffffffu, d, 2);
        const float lse = i < P.Tq ? P.lse[b * P.ls0 + i * P.ls1 + hq * P.ls2] : -WB_INF;
        Dr[r] = d, l2[r] = lse == -WB_INF ? WB_INF : lse * TC_LOG2E;
        if ((lane & 3) == 0) R.D[(b * P.HQ + hq) * R.tpad + i] = d, R.L2[(b * P.HQ + hq) * R.tpad + i] = l2[r];
    }
    float acc[NSA_DK / 8][4];
#pragma unroll
    for (int n = 0; n < NSA_DK / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    const unsigned char *Qw = Qs + wg * 64 * 128, *Ow = Os + wg * 64 * 128; /* the warpgroup's 64 rows */
    mb_wait(qfull, 0);
    for (long long t = 0; t < nt; t++) {
        const int st = (int)(t % WG_NS);
        long long e;
        const long long k0 = W.key0(P, t, WB_SR, &e), left = P.Tk - k0;
        const int n = (int)(left <= 0 ? 0 : left < WB_SR ? left : WB_SR), full_block = e >= W.L.n_part;
        const unsigned char *Kp = Ks + st * KB, *Vp = Vs + st * VB;
        mb_wait(&full[st], (int)((t / WG_NS) & 1));
        float s[NS][4], dp[NS][4];
        wg_fence();
        wb_abt<NS, NSA_DK, WB_BM, WB_SR>(s, Qw, Kp);  /* S = Q K^T */
        wb_abt<NS, NSA_DV, WB_BM, WB_SR>(dp, Ow, Vp); /* dP = dout V^T */
        wg_commit();
        wg_wait0();
        /* score (row r0 or r1 by e, key k0 + key): dU into x; snk: the sink of a scattering call */
        auto one = [&](float &x, float &y, int key, int e, const nsa_mod_sink *snk) {
            const int r = e >> 1;
            const flex_idx qi = r ? r1 : r0, kv = (flex_idx)k0 + key;
            const int seen = (key < n) & (full_block | nsa_flex_mask(&mc, b, hq, qi, kv));
            float p;
            wb_pair(R, sc, snk, b, hq, qi, kv, seen, x * P.scale, y, l2[r], Dr[r], &p, &x);
        };
        if (NSA_SCORE_ID && full_block && n == WB_SR) {
            /* a full block's whole slice and no score_mod: no mod code */
#pragma unroll
            for (int n8 = 0; n8 < NS; n8++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float p;
                    wb_pair(R, sc, 0, b, hq, 0, 0, 1, s[n8][e] * P.scale, dp[n8][e], l2[e >> 1], Dr[e >> 1], &p, &s[n8][e]);
                }
        } else if (R.scatter) {
            /* the score_mod's tensor gradients too: a loop of its own (its scatter code, unrolled
             * into the common path, spread that path over four times the instruction memory) */
            wb_walk<NS, false>(s, dp, lane, [&](float &x, float &y, int key, int e) { one(x, y, key, e, &sink); });
        } else {
            wb_walk<NS, NSA_MOD_UNROLL != 0>(s, dp, lane, [&](float &x, float &y, int key, int e) { one(x, y, key, e, 0); });
        }
        unsigned pa[NS / 2][4];
        wb_frags<NS>(pa, s);
        wg_fence();
#pragma unroll
        for (int k16 = 0; k16 < NS / 2; k16++) /* dQ += dU K, K MN-major: 64-column blocks WB_SR rows apart */
            WB_RS_K(&acc[0][0], pa[k16], wg_desc(Kp + k16 * 16 * 128, WB_SR * 128, 1024));
        wg_commit();
        wg_wait0();
        mb_arrive(&empty[st]);
    }
    tb_store_dq(P, R, acc, b, hq, row, lane);
}
#endif

#if NSA_KERNEL == 3
/* a 1-D bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) completing on bar */
__device__ __forceinline__ void bulk_load(void *dst, const void *src, unsigned bytes, unsigned long long *bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(tc_smem(dst)), "l"(src), "r"(bytes), "r"(tc_smem(bar)) : "memory");
}
extern "C" __global__ void __launch_bounds__(384, 1) nsa_flex_bwd_dkdv_tc(const flex_params P, const flex_grads R,
                                                                         const nsa_mod_caps mc, const nsa_mod_caps sc,
                                                                         const __grid_constant__ wg_tmap tq,
                                                                         const __grid_constant__ wg_tmap tdo,
                                                                         const __grid_constant__ wg_tmap tk,
                                                                         const __grid_constant__ wg_tmap tv)
{
    constexpr int NS = WB_SR / 8, KB = WB_BM * NSA_DK * 2, VB = WB_BM * NSA_DV * 2, QB = WB_SR * NSA_DK * 2, OB = WB_SR * NSA_DV * 2;
    if (P.nf && *(const volatile int *)P.nf != 0) return;
    extern __shared__ unsigned char wg_raw[];
    unsigned char *Ks = wg_align(wg_raw), *Vs = Ks + KB, *Qs = Vs + VB, *Os = Qs + WG_NS * QB;
    float *LD = (float *)(Os + WG_NS * OB);               /* [WG_NS][2][WB_SR]: the slice's lse (log2) and D */
    int *meta = (int *)(LD + WG_NS * 2 * WB_SR);         /* [WG_NS][4]: query head (-1: the end), first row, row end, kind */
    unsigned long long *full = (unsigned long long *)(meta + WG_NS * 4), *empty = full + WG_NS, *kvfull = empty + WG_NS;
    const long long H = P.HQ / P.G, bh = P.B * H;
    const long long w = blockIdx.x, tile = w / bh, h = (w % bh) % H, b = (w % bh) / H; /* the first key tiles first */
    const long long k0 = WB_BM * tile, kb = k0 / P.kv_block, nqb = (P.Tq + P.q_block - 1) / P.q_block;
    wg_init_barriers(full, empty, kvfull);
    if (threadIdx.x >= 256) { /* the producer warp: the walk's kinds 32 query blocks at a time, lane 0 issuing */
        WG_REGS_PRODUCER();
        if (threadIdx.x >= 288) return;
        const int pl = threadIdx.x & 31;
        if (pl == 0) {
            mb_expect(kvfull, KB + VB);
            tma_tile(Ks, &tk, NSA_DK, WB_BM, k0, h, b, kvfull);
            tma_tile(Vs, &tv, NSA_DV, WB_BM, k0, h, b, kvfull);
        }
        long long c = 0;
        for (long long hq = h * P.G; hq < (h + 1) * P.G; hq++) {
            const unsigned char *kr = R.kinds ? R.kinds + (((R.kB == 1 ? 0 : b) * R.kH + (R.kH == 1 ? 0 : hq)) * P.nkb + kb) * nqb : 0;
            for (long long qb0 = 0; qb0 < nqb; qb0 += 32) {
                const int mine = qb0 + pl < nqb ? (kr ? kr[qb0 + pl] : 1) : 0;
                unsigned m = __ballot_sync(0xffffffffu, mine != 0);
                while (m) {
                    const int bit = __ffs(m) - 1, kind = __shfl_sync(0xffffffffu, mine, bit);
                    m &= m - 1;
                    if (pl != 0) continue;
                    const long long qb = qb0 + bit, i1 = (qb + 1) * P.q_block < P.Tq ? (qb + 1) * P.q_block : P.Tq;
                    for (long long i0 = qb * P.q_block; i0 < i1; i0 += WB_SR, c++) {
                        const int st = (int)(c % WG_NS);
                        if (c >= WG_NS) mb_wait(&empty[st], (int)((c / WG_NS) & 1) ^ 1);
                        meta[st * 4 + 0] = (int)hq, meta[st * 4 + 1] = (int)i0, meta[st * 4 + 2] = (int)i1, meta[st * 4 + 3] = kind;
                        mb_expect(&full[st], QB + OB + 2 * WB_SR * 4);
                        tma_tile(Qs + st * QB, &tq, NSA_DK, WB_SR, i0, hq, b, &full[st]);
                        tma_tile(Os + st * OB, &tdo, NSA_DV, WB_SR, i0, hq, b, &full[st]);
                        const long long at = (b * P.HQ + hq) * R.tpad + i0;
                        bulk_load(LD + st * 2 * WB_SR, R.L2 + at, WB_SR * 4, &full[st]);
                        bulk_load(LD + st * 2 * WB_SR + WB_SR, R.D + at, WB_SR * 4, &full[st]);
                    }
                }
                __syncwarp();
            }
        }
        if (pl == 0) { /* the end of the walk */
            const int st = (int)(c % WG_NS);
            if (c >= WG_NS) mb_wait(&empty[st], (int)((c / WG_NS) & 1) ^ 1);
            meta[st * 4] = -1;
            mb_arrive(&full[st]);
        }
        return;
    }
    WG_REGS_CONSUMER();
    const int lane = threadIdx.x & 31, wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3;
    const long long key = k0 + 64 * wg + 16 * warp + (lane >> 2); /* this thread's keys: key, key + 8 */
    float dk[NSA_DK / 8][4], dv[NSA_DV / 8][4];
#pragma unroll
    for (int n = 0; n < NSA_DK / 8; n++) dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.0f;
#pragma unroll
    for (int n = 0; n < NSA_DV / 8; n++) dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;
    const unsigned char *Kw = Ks + wg * 64 * 128, *Vw = Vs + wg * 64 * 128; /* the warpgroup's 64 keys */
    mb_wait(kvfull, 0);
    /* the walk's stages until the producer's end record; the wait for each stage at the loop's
     * bottom, so that the loop leaves at its head (ptxas serialises every wgmma of a kernel whose
     * loop leaves from between two of them) */
    long long c = 0;
    mb_wait(&full[0], 0);
    while (meta[(c % WG_NS) * 4] >= 0) {
        const int st = (int)(c % WG_NS);
        const int hq = meta[st * 4 + 0], i0 = meta[st * 4 + 1], i1 = meta[st * 4 + 2], kind = meta[st * 4 + 3];
        const unsigned char *Qp = Qs + st * QB, *Op = Os + st * OB;
        const float *l2s = LD + st * 2 * WB_SR, *Ds = l2s + WB_SR;
        float s[NS][4], dp[NS][4];
        wg_fence();
        wb_abt<NS, NSA_DK, WB_BM, WB_SR>(s, Kw, Qp);  /* S^T = K Q^T */
        wb_abt<NS, NSA_DV, WB_BM, WB_SR>(dp, Vw, Op); /* dP^T = V dout^T */
        wg_commit();
        wg_wait0();
        /* score (key + 8 (e / 2), query i0 + col): p into x, dU into y */
        auto one = [&](float &x, float &y, int col, int e) {
            const flex_idx kv = (flex_idx)(key + 8 * (e >> 1)), qi = (flex_idx)(i0 + col);
            const int seen = (kv < P.Tk) & (i0 + col < i1) & ((kind == 2) | nsa_flex_mask(&mc, b, hq, qi, kv));
            wb_pair(R, sc, 0, b, hq, qi, kv, seen, x * P.scale, y, l2s[col], Ds[col], &x, &y);
        };
        if (NSA_SCORE_ID && kind == 2 && k0 + WB_BM <= P.Tk && i0 + WB_SR <= i1) {
            /* a full block's keys and rows, no score_mod: no mod code, no index */
#pragma unroll
            for (int n8 = 0; n8 < NS; n8++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int col = n8 * 8 + 2 * (lane & 3) + (e & 1);
                    wb_pair(R, sc, 0, b, hq, 0, 0, 1, s[n8][e] * P.scale, dp[n8][e], l2s[col], Ds[col], &s[n8][e], &dp[n8][e]);
                }
        } else {
            wb_walk<NS, NSA_MOD_UNROLL != 0>(s, dp, lane, one);
        }
        unsigned pp[NS / 2][4], pu[NS / 2][4];
        wb_frags<NS>(pp, s);
        wb_frags<NS>(pu, dp);
        wg_fence();
#pragma unroll
        for (int k16 = 0; k16 < NS / 2; k16++) { /* dout and Q MN-major: 64-column blocks WB_SR rows apart */
            WB_RS_V(&dv[0][0], pp[k16], wg_desc(Op + k16 * 16 * 128, WB_SR * 128, 1024));
            WB_RS_K(&dk[0][0], pu[k16], wg_desc(Qp + k16 * 16 * 128, WB_SR * 128, 1024));
        }
        wg_commit();
        wg_wait0();
        mb_arrive(&empty[st]);
        c++;
        mb_wait(&full[c % WG_NS], (int)((c / WG_NS) & 1));
    }
    tb_store_dkdv(P, R, dk, dv, b, h, key, lane);
}
#endif
)NSA";

/* The tensor-core kernels (f16 / bf16, DK and DV in {64, 128}, block sizes multiples of 16), one
 * body in two layouts. nsa_flex_fwd_tc64 (q and kv blocks multiples of 64): a CTA takes 64 query
 * rows of one (batch entry, query head) -- one q block's, so one list of key blocks -- and its
 * four warps share each 64-key slice of K and V, loaded by all of its threads (a 3-stage cp.async
 * pipeline, one block barrier a slice). nsa_flex_fwd_tc16 (other multiples of 16): a warp takes
 * 16 rows and walks 16-key slices alone (its own pipeline, no block barrier). Per warp: S = Q K^T
 * by mma.sync m16n8k16 with Q's fragments held in registers, the mask_mod applied on partial
 * blocks and the score_mod on every visible score of the fragment, an online softmax (natural
 * units, expf, NaN propagating as in the scalar kernel), P rounded to the storage type for P V.
 * Compiled with NSA_DK / NSA_DV defined. */
static const char FLEX_TC_COMMON[] = R"NSA(
#if NSA_IDX32
typedef int flex_idx; /* a query row or key index handed to the mods (flex_idx32: all below 2^31) */
#else
typedef long long flex_idx;
#endif
#define LDK (NSA_DK + 8)
#define LDV (NSA_DV + 8)
#if NSA_ELEM == 1
#define TC_T "f16"
#else
#define TC_T "bf16"
#endif
__device__ __forceinline__ unsigned tc_smem(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void tc_cp16(void *dst, const void *src, int bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tc_smem(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void tc_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void tc_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void tc_ldsm4(unsigned r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(tc_smem(p)));
}
__device__ __forceinline__ void tc_ldsm4t(unsigned r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(tc_smem(p)));
}
__device__ __forceinline__ void tc_mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TC_T "." TC_T ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* two floats to the storage type, lo in the low half */
__device__ __forceinline__ unsigned tc_pack(float lo, float hi)
{
    unsigned d;
    asm("cvt.rn." TC_T "x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
/* the tiles' exponential: ex2.approx of x log2(e) (a few ulp for the arguments softmax meets,
 * far below the storage type's rounding of P; exp(-inf) = 0, NaN stays NaN) */
__device__ __forceinline__ float tc_exp(float x) { return __expf(x); }
/* 2^x by ex2.approx (the forward keeps its scores in the log2 domain) */
__device__ __forceinline__ float tc_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
#define TC_LOG2E 1.4426950408889634f
#define TC_LN2 0.6931471805599453f
__device__ __forceinline__ float tc_max(float a, float b) { return a > b || a != a ? a : b; } /* NaN wins */

/* the KS keys of slice t into the buffers Kb, Vb, by NT threads (thread `me`), rows past the block
 * or Tk zero-filled, one commit group; returns the first key, and through *nk how many are real,
 * *isfull whether the block is a full one */
template <int KS, int NT>
__device__ __forceinline__ long long tc_issue(const flex_params &P, const block_list &L, long long t, long long b, long long h,
                                              unsigned short *Kb, unsigned short *Vb, int me, int *nk, int *isfull)
{
    const long long S = P.kv_block / KS, e = t / S, u = t - e * S, j = L.block(e);
    const long long k0 = j * P.kv_block + KS * u, end0 = (j + 1) * P.kv_block, end = end0 < P.Tk ? end0 : P.Tk;
    const long long n = end - k0;
    *nk = n <= 0 ? 0 : n > KS ? KS : (int)n;
    *isfull = e >= L.n_part;
    const unsigned short *kp = (const unsigned short *)P.k + b * P.ks0 + h * P.ks2;
    const unsigned short *vp = (const unsigned short *)P.v + b * P.vs0 + h * P.vs2;
#pragma unroll
    for (int x = 0; x < KS * NSA_DK / 8 / NT; x++) { /* KS rows x DK / 8 chunks over NT threads */
        const int c = me + NT * x, r = c / (NSA_DK / 8), col = (c % (NSA_DK / 8)) * 8;
        const bool ok = r < *nk;
        tc_cp16(Kb + r * LDK + col, ok ? (const void *)(kp + (k0 + r) * P.ks1 + col) : P.k, ok ? 16 : 0);
    }
#pragma unroll
    for (int x = 0; x < KS * NSA_DV / 8 / NT; x++) {
        const int c = me + NT * x, r = c / (NSA_DV / 8), col = (c % (NSA_DV / 8)) * 8;
        const bool ok = r < *nk;
        tc_cp16(Vb + r * LDV + col, ok ? (const void *)(vp + (k0 + r) * P.vs1 + col) : P.v, ok ? 16 : 0);
    }
    tc_commit();
    return k0;
}

/* A fragments of 16 rows (row0 ..) of a [rows, D] view at p with row stride rs (rows from `end` on zero) */
template <int D>
__device__ __forceinline__ void tc_frags(unsigned f[D / 16][4], const unsigned short *p, long long rs, long long row0, long long end,
                                         int lane)
{
#pragma unroll
    for (int k = 0; k < D / 16; k++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const long long i = row0 + (lane >> 2) + 8 * (e & 1);
            const int col = 16 * k + 2 * (lane & 3) + 8 * (e >> 1);
            f[k][e] = i < end ? *(const unsigned *)(p + i * rs + col) : 0u;
        }
}

/* The KS-key slices of a list through TC_STAGES buffers at Ks, Vs (kb, nk, fl: each buffer's
 * first key, real keys, and whether its block is full): begin() issues the first stages;
 * at(t) waits for slice t (then the block's or the warp's barrier: every thread's copies are
 * in and every warp is done with slice t - 1, whose buffer comes next), issues slice
 * t + TC_STAGES - 1 and returns slice t's buffer. */
template <int KS, int NT, bool SHARED>
struct tc_pipe {
    unsigned short *Ks, *Vs;
    long long nt, kb[TC_STAGES];
    int nk[TC_STAGES], fl[TC_STAGES];
    __device__ __forceinline__ void begin(const flex_params &P, const block_list &L, long long b, long long h, int me)
    {
#pragma unroll
        for (int st = 0; st < TC_STAGES - 1; st++)
            if (st < nt) kb[st] = tc_issue<KS, NT>(P, L, st, b, h, Ks + st * KS * LDK, Vs + st * KS * LDV, me, &nk[st], &fl[st]);
    }
    __device__ __forceinline__ int at(const flex_params &P, const block_list &L, long long t, long long b, long long h, int me)
    {
        if (t + 1 < nt) tc_wait<TC_STAGES - 2>();
        else tc_wait<0>();
        if (SHARED) __syncthreads();
        else __syncwarp();
        if (t + TC_STAGES - 1 < nt) {
            const int nb = (int)((t + TC_STAGES - 1) % TC_STAGES);
            kb[nb] = tc_issue<KS, NT>(P, L, t + TC_STAGES - 1, b, h, Ks + nb * KS * LDK, Vs + nb * KS * LDV, me, &nk[nb], &fl[nb]);
        }
        return (int)(t % TC_STAGES);
    }
};

/* One slice's scores to probabilities, for a warp's two rows `row` and `row + 8` (fragments s
 * in the mma C order: key 8 n8 + 2 (lane % 4) + e % 2 of the slice's first k0, n of them real):
 * scaled into the log2 domain (the exponentials are one ex2 each), the mask_mod on a partial
 * block's keys and the score_mod on every visible score, then the online softmax -- the running
 * maxima mrun, sums lsum and the NQ accumulator fragments rescaled when a maximum moves. */
template <int NS, int NQ>
__device__ __forceinline__ void tc_scores_to_p(const flex_params &P, const nsa_mod_caps &mc, const nsa_mod_caps &sc,
                                               float (&s)[NS][4], long long b, long long hq, long long row, long long k0,
                                               int n, int full, int lane, float mrun[2], float lsum[2], float (&acc)[NQ][4])
{
    const float NEG_INF = nsa_mod_fbits(0xff800000u);
    /* scores kept in the log2 domain (s * scale * log2(e)): the exponentials are one ex2 each */
    float mx[2] = {NEG_INF, NEG_INF};
    if (NSA_SCORE_ID && full && n == 8 * NS) {
        /* a full block's whole slice and no score_mod: no mod code, no index (most of a
         * causal, window or document mask's slices) */
        const float scale2 = P.scale * TC_LOG2E;
#pragma unroll
        for (int n8 = 0; n8 < NS; n8++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[n8][e] *= scale2;
                mx[e >> 1] = tc_max(mx[e >> 1], s[n8][e]);
            }
    } else {
        /* the mods on 16 keys at a time in a loop that is not unrolled: the fragments in
         * s[0], s[1], then s rotated by two (constant indices: s stays in registers), NS / 2
         * times (the order back as it was). The mods' code then stands 8 times in the
         * kernel where full unrolling put it NS * 4 times (32 in the wide layout): half the
         * compile time of a new mod, the first call's wait. Both mods are evaluated on every
         * key and the hidden ones dropped after (their reads clamp, their divisions are
         * guarded: a mod has no fault to skip): straight-line code, in which the compiler
         * shares what the eight scores have in common -- a read of slope[h], doc[q_idx] --
         * where a branch a score had kept each read apart. */
        const flex_idx r0 = (flex_idx)(row < P.Tq ? row : P.Tq - 1), r1 = (flex_idx)(row + 8 < P.Tq ? row + 8 : P.Tq - 1);
        /* score x of key `key` (of the slice) and row r0 or r1 (e >= 2; rows past Tq: any valid
         * index, their results are dropped) */
        auto mod_one = [&](float &x, int key, int e) {
            const flex_idx qi = e >> 1 ? r1 : r0, kv = (flex_idx)k0 + key;
            const int seen = (key < n) & (full | nsa_flex_mask(&mc, b, hq, qi, kv));
            const float v = nsa_flex_score(&sc, b, hq, qi, kv, x * P.scale) * TC_LOG2E;
            x = seen ? v : NEG_INF;
            mx[e >> 1] = tc_max(mx[e >> 1], x);
        };
#if NSA_MOD_UNROLL
        /* small mods (NSA_MOD_UNROLL: the host's choice by their size) unrolled over every
         * fragment: no rotation, whose moves cost as much as a small mod's own instructions */
#pragma unroll
        for (int n8 = 0; n8 < NS; n8++)
#pragma unroll
            for (int e = 0; e < 4; e++) mod_one(s[n8][e], n8 * 8 + 2 * (lane & 3) + (e & 1), e);
#else
#pragma unroll 1
        for (int q2 = 0; q2 < NS / 2; q2++) {
#pragma unroll
            for (int n8 = 0; n8 < 2; n8++)
#pragma unroll
                for (int e = 0; e < 4; e++) mod_one(s[n8][e], (2 * q2 + n8) * 8 + 2 * (lane & 3) + (e & 1), e);
            float t2[2][4];
#pragma unroll
            for (int e = 0; e < 4; e++) t2[0][e] = s[0][e], t2[1][e] = s[1][e];
#pragma unroll
            for (int m = 0; m + 2 < NS; m++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[m][e] = s[m + 2][e];
#pragma unroll
            for (int e = 0; e < 4; e++) s[NS - 2][e] = t2[0][e], s[NS - 1][e] = t2[1][e];
        }
#endif
    }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = tc_max(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = tc_max(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float mn = tc_max(mrun[r], mx[r]);
        alpha[r] = mrun[r] == NEG_INF ? 0.0f : tc_exp2(mrun[r] - mn);
        mrun[r] = mn;
    }
    float ps[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n8 = 0; n8 < NS; n8++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float m = mrun[e >> 1];
            const float p = m == NEG_INF ? 0.0f : tc_exp2(s[n8][e] - m);
            s[n8][e] = p;
            ps[e >> 1] += p;
        }
    lsum[0] = lsum[0] * alpha[0] + ps[0], lsum[1] = lsum[1] * alpha[1] + ps[1];
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) /* the max moved (mostly in the first slices) */
#pragma unroll
        for (int q = 0; q < NQ; q++) acc[q][0] *= alpha[0], acc[q][1] *= alpha[0], acc[q][2] *= alpha[1], acc[q][3] *= alpha[1];
}

/* A warp's rows `row` and `row + 8` finished: o = acc / lsum and lse (the quads' partial sums
 * added first), rows past Tq dropped; a row that saw no key (or only -inf scores) gets 0 and -inf. */
template <int NQ>
__device__ __forceinline__ void tc_store_rows(const flex_params &P, const float (&acc)[NQ][4], const float mrun[2], float lsum[2],
                                              long long b, long long hq, long long row, int lane)
{
    const float NEG_INF = nsa_mod_fbits(0xff800000u);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        lsum[r] += __shfl_xor_sync(0xffffffffu, lsum[r], 1);
        lsum[r] += __shfl_xor_sync(0xffffffffu, lsum[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const long long i = row + 8 * r;
        if (i >= P.Tq) continue;
        const int empty = mrun[r] == NEG_INF; /* no key, or only -inf scores: 0 and -inf */
        const float inv = empty ? 0.0f : 1.0f / lsum[r];
        const long long ob = b * P.os0 + i * P.os1 + hq * P.os2;
#pragma unroll
        for (int q = 0; q < NQ; q++) {
            const int col = q * 8 + 2 * (lane & 3);
            st_elem(P.o, ob + col, empty ? 0.0f : acc[q][2 * r] * inv);
            st_elem(P.o, ob + col + 1, empty ? 0.0f : acc[q][2 * r + 1] * inv);
        }
        if (P.lse && (lane & 3) == 0) P.lse[b * P.ls0 + i * P.ls1 + hq * P.ls2] = empty ? NEG_INF : mrun[r] * TC_LN2 + logf(lsum[r]);
    }
}

)NSA";

/* The tensor-core forward (after FLEX_TC_COMMON). */
/* The Hopper kernels' primitives (after FLEX_TC_COMMON and flex_wgmma_source's wrappers): wgmma
 * fences and descriptors, mbarriers, TMA loads. The kernels have a producer warp that copies tiles
 * by TMA (128-byte swizzle, rows past a tensor as zeros) into stages guarded by full / empty
 * mbarriers, and two consumer warpgroups of 64 rows doing the products and the elementwise work. */
static const char FLEX_WG_COMMON[] = R"NSA(
#define WG_CAT2(a, b) a##b
#define WG_CAT(a, b) WG_CAT2(a, b)
struct __align__(64) wg_tmap { unsigned long long w[16]; };
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
/* shared-memory matrix descriptor, 128-byte swizzle (layout type 1 in bits 62-63) */
__device__ __forceinline__ unsigned long long wg_desc(const void *p, unsigned lbo, unsigned sbo)
{
    const unsigned long long a = tc_smem(p);
    return ((a & 0x3FFFFull) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
/* the first 1024-byte boundary in the dynamic shared memory (the swizzled tiles' alignment) */
__device__ __forceinline__ unsigned char *wg_align(unsigned char *raw) { return raw + ((1024u - (tc_smem(raw) & 1023u)) & 1023u); }
__device__ __forceinline__ void mb_init(unsigned long long *bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(tc_smem(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mb_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
/* one arrival that also expects `bytes` of copies (release: the thread's earlier shared-memory
 * stores are seen by whoever waits on the phase it completes) */
__device__ __forceinline__ void mb_expect(unsigned long long *bar, unsigned bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(tc_smem(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mb_arrive(unsigned long long *bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(tc_smem(bar)) : "memory");
}
__device__ __forceinline__ void mb_wait(unsigned long long *bar, int parity)
{
    asm volatile("{\n.reg .pred p;\nWG_MB_WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WG_MB_WAIT_%=;\n}\n" ::"r"(tc_smem(bar)), "r"(parity) : "memory");
}
/* the box at (c0 innermost .. c3) of a 4-D tensor map into dst, completing on bar */
__device__ __forceinline__ void tma_load4(void *dst, const wg_tmap *map, int c0, int c1, int c2, int c3, unsigned long long *bar)
{
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 ::"r"(tc_smem(dst)), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(tc_smem(bar))
                 : "memory");
}
/* the rows of a [R, D] tile (D / 64 boxes of 64 columns, R * 128 bytes apart) at (row, head h, batch b) */
__device__ __forceinline__ void tma_tile(unsigned char *dst, const wg_tmap *map, int D, int R, long long row, long long h, long long b,
                                         unsigned long long *bar)
{
    for (int cb = 0; cb < D / 64; cb++) tma_load4(dst + cb * R * 128, map, cb * 64, (int)h, (int)row, (int)b, bar);
}
#define WG_REGS_PRODUCER() asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n")
#define WG_REGS_CONSUMER() asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n")
/* The stages' full / empty barriers (one arrival of the producer; the 256 consumer threads) and
 * the once-loaded tile's, initialised by thread 0 before every thread goes on. */
__device__ __forceinline__ void wg_init_barriers(unsigned long long *full, unsigned long long *empty, unsigned long long *once)
{
    if (threadIdx.x == 0) {
        for (int i = 0; i < WG_NS; i++) mb_init(&full[i], 1), mb_init(&empty[i], 256);
        mb_init(once, 1);
        mb_init_fence();
    }
    __syncthreads();
}
/* A row CTA's work (the forward, dq): 128 query rows from u0 of (b, hq) -- the last tiles first,
 * the longest lists of a causal-like mask -- and its query block's key blocks in nt slices of bn
 * keys, per_block a block. */
struct wg_rows {
    long long hq, b, h, u0, per_block, nt;
    block_list L;
    /* slice t's first key, and its list entry (full blocks come after the partial ones) */
    __device__ __forceinline__ long long key0(const flex_params &P, long long t, int bn, long long *e) const
    {
        *e = t / per_block;
        return L.block(*e) * P.kv_block + bn * (t - *e * per_block);
    }
};
__device__ __forceinline__ wg_rows wg_rows_of(const flex_params &P, int bn)
{
    wg_rows r;
    const long long ntile = (P.Tq + 127) / 128, bh = P.B * P.HQ, w = blockIdx.x;
    r.hq = (w % bh) % P.HQ, r.b = (w % bh) / P.HQ, r.h = r.hq / P.G, r.u0 = 128 * (ntile - 1 - w / bh);
    r.L = block_list_of(P, r.b, r.hq, r.u0 / P.q_block);
    r.per_block = P.kv_block / bn, r.nt = (r.L.n_part + r.L.n_full) * r.per_block;
    return r;
}
/* The producer's walk of a row CTA's slices: K and V of bn keys into the WG_NS stages (kb, vb
 * bytes apart), each once the consumers released it. */
__device__ __forceinline__ void wg_produce_kv(const flex_params &P, const wg_rows &r, int bn, unsigned char *Ks, unsigned char *Vs,
                                              int kb, int vb, const wg_tmap *tk, const wg_tmap *tv, unsigned long long *full,
                                              unsigned long long *empty)
{
    for (long long t = 0; t < r.nt; t++) {
        const int st = (int)(t % WG_NS);
        if (t >= WG_NS) mb_wait(&empty[st], (int)((t / WG_NS) & 1) ^ 1);
        long long e;
        const long long k0 = r.key0(P, t, bn, &e);
        mb_expect(&full[st], kb + vb);
        tma_tile(Ks + st * kb, tk, NSA_DK, bn, k0, r.h, r.b, &full[st]);
        tma_tile(Vs + st * vb, tv, NSA_DV, bn, k0, r.h, r.b, &full[st]);
    }
}
)NSA";

/* The Hopper forward (after FLEX_WG_COMMON). */
static const char FLEX_WG_FWD[] = R"NSA(
/* The Hopper forward (sm_90a). A CTA takes 128 query rows of one (batch entry, query head) --
 * inside one q block, so one list of key blocks -- in two consumer warpgroups of 64 rows, and a
 * producer warp that copies Q once and each WG_BN-key slice of K and V into WG_NS stages. Per
 * warpgroup: S = Q K^T by wgmma from shared memory, the mods and the online softmax on the
 * accumulator fragments (the mma.sync C order, as the mma.sync kernel's: tc_scores_to_p),
 * O += P V by wgmma with P from registers. */
#define WG_BM 128
#define WG_QB (WG_BM * NSA_DK * 2)
#define WG_KB (WG_BN * NSA_DK * 2)
#define WG_VB (WG_BN * NSA_DV * 2)
#define WG_SS_S WG_CAT(wg_ss, WG_BN)
#define WG_RS_O WG_CAT(wg_rs, NSA_DV)
#if NSA_KERNEL == 1
extern "C" __global__ void __launch_bounds__(384, 1) nsa_flex_fwd_tc(const flex_params P, const nsa_mod_caps mc,
                                                                    const nsa_mod_caps sc, const __grid_constant__ wg_tmap tq,
                                                                    const __grid_constant__ wg_tmap tk,
                                                                    const __grid_constant__ wg_tmap tv)
{
    constexpr int NS = WG_BN / 8;
    /* a non-finite value in V: the scalar kernel beside this one computes the call */
    if (P.nf_role == 1 && *(const volatile int *)P.nf != 0) return;
    extern __shared__ unsigned char wg_raw[];
    unsigned char *Qs = wg_align(wg_raw), *Ks = Qs + WG_QB, *Vs = Ks + WG_NS * WG_KB;
    unsigned long long *full = (unsigned long long *)(Vs + WG_NS * WG_VB), *empty = full + WG_NS, *qfull = empty + WG_NS;

    const wg_rows W = wg_rows_of(P, WG_BN);
    const long long hq = W.hq, b = W.b, u0 = W.u0, nt = W.nt;
    wg_init_barriers(full, empty, qfull);
    if (threadIdx.x >= 256) { /* the producer warpgroup: one thread issues every copy */
        WG_REGS_PRODUCER();
        if (threadIdx.x != 256) return;
        mb_expect(qfull, WG_QB);
        tma_tile(Qs, &tq, NSA_DK, WG_BM, u0, hq, b, qfull);
        wg_produce_kv(P, W, WG_BN, Ks, Vs, WG_KB, WG_VB, &tk, &tv, full, empty);
        return;
    }
    WG_REGS_CONSUMER();
    const int lane = threadIdx.x & 31, wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3;
    const long long row = u0 + 64 * wg + 16 * warp + (lane >> 2); /* this thread's rows: row, row + 8 */
    const float NEG_INF = nsa_mod_fbits(0xff800000u);
    float acc[NSA_DV / 8][4];
#pragma unroll
    for (int n = 0; n < NSA_DV / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float mrun[2] = {NEG_INF, NEG_INF}, lsum[2] = {0.0f, 0.0f};
    const unsigned char *Qw = Qs + wg * 64 * 128; /* the warpgroup's 64 rows in each 64-column block */
    mb_wait(qfull, 0);
    for (long long t = 0; t < nt; t++) {
        const int st = (int)(t % WG_NS);
        long long e;
        const long long k0 = W.key0(P, t, WG_BN, &e), left = P.Tk - k0;
        const int n = (int)(left <= 0 ? 0 : left < WG_BN ? left : WG_BN); /* real keys (a slice lies inside its block) */
        const unsigned char *Kp = Ks + st * WG_KB, *Vp = Vs + st * WG_VB;
        mb_wait(&full[st], (int)((t / WG_NS) & 1));
        float s[NS][4];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < NSA_DK / 16; kk++)
            WG_SS_S(&s[0][0], wg_desc(Qw + (kk >> 2) * WG_BM * 128 + (kk & 3) * 32, 16, 1024),
                    wg_desc(Kp + (kk >> 2) * WG_BN * 128 + (kk & 3) * 32, 16, 1024), kk > 0);
        wg_commit();
        wg_wait0();
        tc_scores_to_p<NS, NSA_DV / 8>(P, mc, sc, s, b, hq, row, k0, n, e >= W.L.n_part, lane, mrun, lsum, acc);
        unsigned pa[WG_BN / 16][4];
#pragma unroll
        for (int k16 = 0; k16 < WG_BN / 16; k16++) {
            pa[k16][0] = tc_pack(s[2 * k16][0], s[2 * k16][1]), pa[k16][1] = tc_pack(s[2 * k16][2], s[2 * k16][3]);
            pa[k16][2] = tc_pack(s[2 * k16 + 1][0], s[2 * k16 + 1][1]), pa[k16][3] = tc_pack(s[2 * k16 + 1][2], s[2 * k16 + 1][3]);
        }
        wg_fence();
#pragma unroll
        for (int k16 = 0; k16 < WG_BN / 16; k16++) /* V MN-major: 64-column blocks WG_BN rows apart */
            WG_RS_O(&acc[0][0], pa[k16], wg_desc(Vp + k16 * 16 * 128, WG_BN * 128, 1024));
        wg_commit();
        wg_wait0();
        mb_arrive(&empty[st]); /* this thread is done with the stage */
    }
    tc_store_rows<NSA_DV / 8>(P, acc, mrun, lsum, b, hq, row, lane);
}
#endif
)NSA";

static const char FLEX_TC_KERNEL[] = R"NSA(
/* ROWS query rows a unit (a CTA of TC_WARPS warps sharing KS-key slices, or a warp alone), the
 * warp's 16 of them computed here */
template <int KS, bool SHARED>
__device__ __forceinline__ void tc_body(const flex_params &P, const nsa_mod_caps &mc, const nsa_mod_caps &sc)
{
    constexpr int ROWS = SHARED ? 16 * TC_WARPS : 16, NT = SHARED ? 32 * TC_WARPS : 32, NS = KS / 8;
    extern __shared__ __align__(16) unsigned short tc_sm[];
    /* a non-finite value in V would reach, through P = 0, rows that do not see its key: the
     * scalar kernel beside this one computes such a call (the same rule as the attention tiles') */
    if (P.nf_role == 1 && *(const volatile int *)P.nf != 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r0 = lane >> 2;
    const long long ntile = (P.Tq + ROWS - 1) / ROWS, w = SHARED ? (long long)blockIdx.x : (long long)blockIdx.x * TC_WARPS + warp;
    if (w >= P.B * P.HQ * ntile) return; /* (SHARED: the whole CTA) */
    const long long tile = w % ntile, hq = (w / ntile) % P.HQ, b = w / (ntile * P.HQ), h = hq / P.G;
    const long long u0 = ROWS * tile, i0 = u0 + (SHARED ? 16 * warp : 0); /* the unit's first row, the warp's */
    const int me = SHARED ? threadIdx.x : lane;
    const float NEG_INF = nsa_mod_fbits(0xff800000u);
    unsigned short *Ks = tc_sm + (SHARED ? 0 : (long long)warp * TC_STAGES * KS * (LDK + LDV)), *Vs = Ks + TC_STAGES * KS * LDK;

    const block_list L = block_list_of(P, b, hq, u0 / P.q_block);
    const long long nt = (L.n_part + L.n_full) * (P.kv_block / KS);

    /* Q's 16 rows as A fragments (rows past Tq zero) */
    unsigned qf[NSA_DK / 16][4];
    tc_frags<NSA_DK>(qf, (const unsigned short *)P.q + b * P.qs0 + hq * P.qs2, P.qs1, i0, P.Tq, lane);
    float acc[NSA_DV / 8][4];
#pragma unroll
    for (int n = 0; n < NSA_DV / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float mrun[2] = {NEG_INF, NEG_INF}, lsum[2] = {0.0f, 0.0f};
    tc_pipe<KS, NT, SHARED> pipe;
    pipe.Ks = Ks, pipe.Vs = Vs, pipe.nt = nt;
    pipe.begin(P, L, b, h, me);
    for (long long t = 0; t < nt; t++) {
        const int buf = pipe.at(P, L, t, b, h, me);
        const unsigned short *Kb = Ks + buf * KS * LDK, *Vb = Vs + buf * KS * LDV;
        float s[NS][4];
#pragma unroll
        for (int n = 0; n < NS; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int k = 0; k < NSA_DK / 16; k++)
#pragma unroll
            for (int n2 = 0; n2 < NS / 2; n2++) {
                unsigned bb[4];
                tc_ldsm4(bb, Kb + (16 * n2 + (lane & 7) + (lane >> 4) * 8) * LDK + ((lane >> 3) & 1) * 8 + k * 16);
                tc_mma(s[2 * n2], qf[k], bb[0], bb[1]);
                tc_mma(s[2 * n2 + 1], qf[k], bb[2], bb[3]);
            }
        tc_scores_to_p<NS, NSA_DV / 8>(P, mc, sc, s, b, hq, i0 + r0, pipe.kb[buf], pipe.nk[buf], pipe.fl[buf], lane, mrun, lsum,
                                       acc);
#pragma unroll
        for (int k16 = 0; k16 < KS / 16; k16++) { /* P's 16-key steps as A fragments */
            unsigned a[4];
            a[0] = tc_pack(s[2 * k16][0], s[2 * k16][1]), a[1] = tc_pack(s[2 * k16][2], s[2 * k16][3]);
            a[2] = tc_pack(s[2 * k16 + 1][0], s[2 * k16 + 1][1]), a[3] = tc_pack(s[2 * k16 + 1][2], s[2 * k16 + 1][3]);
#pragma unroll
            for (int q = 0; q < NSA_DV / 16; q++) {
                unsigned vb[4];
                tc_ldsm4t(vb, Vb + (16 * k16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDV + (lane >> 4) * 8 + q * 16);
                tc_mma(acc[2 * q], a, vb[0], vb[1]);
                tc_mma(acc[2 * q + 1], a, vb[2], vb[3]);
            }
        }
    }
    tc_store_rows<NSA_DV / 8>(P, acc, mrun, lsum, b, hq, i0 + r0, lane);
}

/* one layout a source (NSA_TC_WIDE): each compile builds only the kernel the call runs */
#if NSA_KERNEL == 1
extern "C" __global__ void __launch_bounds__(32 * TC_WARPS) nsa_flex_fwd_tc(const flex_params P, const nsa_mod_caps mc,
                                                                           const nsa_mod_caps sc)
{
#if NSA_TC_WIDE
    tc_body<64, true>(P, mc, sc);
#else
    tc_body<16, false>(P, mc, sc);
#endif
}
#endif
)NSA";

/* The tensor-core backward (after FLEX_TC_COMMON and the scalar backward; f16 / bf16, head dims
 * 64 / 128, block sizes multiples of 16, finite q, k, v and dout -- else the scalar kernels).
 * nsa_flex_bwd_dq_tc: a warp takes 16 query rows (so one q block and one list), holds Q's and
 * dout's fragments, walks its 16-key slices as the forward does (3-stage cp.async pipeline):
 * S = Q K^T, dP = dout V^T, per visible pair P = exp(s - lse), dS = P (dP - D), dU through the
 * score_mod's reverse mode (which scatters the tensor gradients), dQ += dU K with dU rounded to
 * the storage type; it also writes the rows' D. nsa_flex_bwd_dkdv_tc: a warp takes 16 keys of
 * one key block, holds K's and V's fragments and walks, for each of the G query heads, the query
 * blocks that list the block in ascending order, 16 rows at a time (2-stage pipeline of Q and
 * dout slices): S^T = K Q^T, dP^T = V dout^T, dV += P^T dout, dK += dU^T Q. Fixed orders:
 * deterministic. */
static const char FLEX_TC_BWD[] = R"NSA(
/* SR rows i0 .. of (b, hq) of Q and dout into Qb, Ob by NT threads (thread me; rows from i1 on
 * zero-filled), one commit group */
template <int SR, int NT>
__device__ __forceinline__ void tb_issue_rows(const flex_params &P, const flex_grads &R, long long b, long long hq, long long i0,
                                              long long i1, unsigned short *Qb, unsigned short *Ob, int me)
{
    const unsigned short *qp = (const unsigned short *)P.q + b * P.qs0 + hq * P.qs2;
    const unsigned short *op = (const unsigned short *)R.dout + b * R.dos0 + hq * R.dos2;
#pragma unroll
    for (int x = 0; x < SR * NSA_DK / 8 / NT; x++) {
        const int c = me + NT * x, r = c / (NSA_DK / 8), col = (c % (NSA_DK / 8)) * 8;
        const bool ok = i0 + r < i1;
        tc_cp16(Qb + r * LDK + col, ok ? (const void *)(qp + (i0 + r) * P.qs1 + col) : P.q, ok ? 16 : 0);
    }
#pragma unroll
    for (int x = 0; x < SR * NSA_DV / 8 / NT; x++) {
        const int c = me + NT * x, r = c / (NSA_DV / 8), col = (c % (NSA_DV / 8)) * 8;
        const bool ok = i0 + r < i1;
        tc_cp16(Ob + r * LDV + col, ok ? (const void *)(op + (i0 + r) * R.dos1 + col) : R.dout, ok ? 16 : 0);
    }
    tc_commit();
}

/* c[2][4] += A (16 x D fragments) times the 16 rows of B (a [16, D] tile in shared memory, row
 * stride ld) transposed: the 16 x 16 product A B^T */
template <int D>
__device__ __forceinline__ void tb_abt(float c[2][4], const unsigned a[D / 16][4], const unsigned short *B, int ld, int lane)
{
#pragma unroll
    for (int k = 0; k < D / 16; k++) {
        unsigned bb[4];
        tc_ldsm4(bb, B + ((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8 + k * 16);
        tc_mma(c[0], a[k], bb[0], bb[1]);
        tc_mma(c[1], a[k], bb[2], bb[3]);
    }
}

/* dU from dS and the score_mod's derivative d1 = d(value)/d(score) at the pair (its reverse mode
 * run once with g = 1, which also gave the value): dS d1, and 0 for dS = 0 as the reverse mode
 * with g = dS gives it whatever d1 is */
__device__ __forceinline__ float tb_chain(float ds, float d1) { return ds == 0.0f ? 0.0f : ds * d1; }

/* The backward's two 16 x 16 products of a step: s = A_k B_k^T over DK, dp = A_v B_v^T over DV
 * (dq: Q against K and dout against V; dk / dv: K against Q and V against dout) */
__device__ __forceinline__ void tb_s_dp(float s[2][4], float dp[2][4], const unsigned ak[NSA_DK / 16][4], const unsigned short *bk,
                                        const unsigned av[NSA_DV / 16][4], const unsigned short *bv, int lane)
{
#pragma unroll
    for (int x = 0; x < 2; x++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[x][e] = dp[x][e] = 0.0f;
    tb_abt<NSA_DK>(s, ak, bk, LDK, lane);
    tb_abt<NSA_DV>(dp, av, bv, LDV, lane);
}

/* acc[D / 8][4] += X B, X the 16 x 16 tile x[2][4] (rounded to the storage type), B a [16, D]
 * tile in shared memory (row stride ld) */
template <int D>
__device__ __forceinline__ void tb_xb(float acc[D / 8][4], const float x[2][4], const unsigned short *B, int ld, int lane)
{
    unsigned a[4];
    a[0] = tc_pack(x[0][0], x[0][1]), a[1] = tc_pack(x[0][2], x[0][3]);
    a[2] = tc_pack(x[1][0], x[1][1]), a[3] = tc_pack(x[1][2], x[1][3]);
#pragma unroll
    for (int q = 0; q < D / 16; q++) {
        unsigned bb[4];
        tc_ldsm4t(bb, B + ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8 + q * 16);
        tc_mma(acc[2 * q], a, bb[0], bb[1]);
        tc_mma(acc[2 * q + 1], a, bb[2], bb[3]);
    }
}

/* dq: 16 rows a warp; SHARED: the CTA's four warps take 64 rows of one q block and share each
 * KS-key slice (KS = 64), a warp working through it 16 keys at a time */
template <int KS, bool SHARED>
__device__ __forceinline__ void tb_dq(const flex_params &P, const flex_grads &R, const nsa_mod_caps &mc, const nsa_mod_caps &sc,
                                      const nsa_mod_sink &sink)
{
    constexpr int ROWS = SHARED ? 16 * TC_WARPS : 16, NT = SHARED ? 32 * TC_WARPS : 32;
    extern __shared__ __align__(16) unsigned short tc_sm[];
    if (P.nf && *(const volatile int *)P.nf != 0) return; /* a non-finite input: the scalar kernels compute the call */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r0 = lane >> 2;
    const long long ntile = (P.Tq + ROWS - 1) / ROWS, w = SHARED ? (long long)blockIdx.x : (long long)blockIdx.x * TC_WARPS + warp;
    if (w >= P.B * P.HQ * ntile) return; /* (SHARED: the whole CTA) */
    const long long tile = w % ntile, hq = (w / ntile) % P.HQ, b = w / (ntile * P.HQ), h = hq / P.G;
    const long long u0 = ROWS * tile, i0 = u0 + (SHARED ? 16 * warp : 0);
    const int me = SHARED ? threadIdx.x : lane;
    const float NEG_INF = nsa_mod_fbits(0xff800000u);
    unsigned short *Ks = tc_sm + (SHARED ? 0 : (long long)warp * TC_STAGES * KS * (LDK + LDV)), *Vs = Ks + TC_STAGES * KS * LDK;
    const block_list L = block_list_of(P, b, hq, u0 / P.q_block);
    const long long nt = (L.n_part + L.n_full) * (P.kv_block / KS);
    unsigned qf[NSA_DK / 16][4], of[NSA_DV / 16][4];
    tc_frags<NSA_DK>(qf, (const unsigned short *)P.q + b * P.qs0 + hq * P.qs2, P.qs1, i0, P.Tq, lane);
    tc_frags<NSA_DV>(of, (const unsigned short *)R.dout + b * R.dos0 + hq * R.dos2, R.dos1, i0, P.Tq, lane);
    /* the lane's two rows (r0, r0 + 8): lse, and D = dout . o summed over the quad's columns */
    float lse[2], Dr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const long long i = i0 + r0 + 8 * r;
        float d = 0.0f;
        if (i < P.Tq)
            for (int col = 2 * (lane & 3); col < NSA_DV; col += 8)
                for (int x = 0; x < 2; x++)
                    d += ld_elem(R.dout, b * R.dos0 + i * R.dos1 + hq * R.dos2 + col + x) *
                         ld_elem(P.o, b * P.os0 + i * P.os1 + hq * P.os2 + col + x);
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        d += __shfl_xor_sync(0xffffffffu, d, 2);
        Dr[r] = d;
        lse[r] = i < P.Tq ? P.lse[b * P.ls0 + i * P.ls1 + hq * P.ls2] : NEG_INF;
        if (i < P.Tq && (lane & 3) == 0) R.D[(b * P.HQ + hq) * P.Tq + i] = d;
    }
    float acc[NSA_DK / 8][4];
#pragma unroll
    for (int n = 0; n < NSA_DK / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    tc_pipe<KS, NT, SHARED> pipe;
    pipe.Ks = Ks, pipe.Vs = Vs, pipe.nt = nt;
    pipe.begin(P, L, b, h, me);
    for (long long t = 0; t < nt; t++) {
        const int buf = pipe.at(P, L, t, b, h, me);
        const long long k0 = pipe.kb[buf];
        const int n = pipe.nk[buf], full = pipe.fl[buf];
#pragma unroll 1
        for (int sub = 0; sub < KS / 16 && 16 * sub < n; sub++) {
            const unsigned short *Kb = Ks + (buf * KS + 16 * sub) * LDK, *Vb = Vs + (buf * KS + 16 * sub) * LDV;
            float s[2][4], dp[2][4];
            tb_s_dp(s, dp, qf, Kb, of, Vb, lane); /* S = Q K^T, dP = dout V^T */
            if (NSA_SCORE_ID && !R.scatter && full && 16 * sub + 16 <= n && i0 + 16 <= P.Tq) {
                /* 16 keys of a full block, 16 rows, no score_mod: no mod code, no index */
#pragma unroll
                for (int n8 = 0; n8 < 2; n8++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int r = e >> 1;
                        float du = 0.0f;
                        if (lse[r] != NEG_INF) {
                            const float p = tc_exp(s[n8][e] * P.scale - lse[r]);
                            if (p != 0.0f) du = tb_chain(p * (dp[n8][e] - Dr[r]), 1.0f);
                        }
                        s[n8][e] = du;
                    }
                tb_xb<NSA_DK>(acc, s, Kb, LDK, lane);
                continue;
            }
            /* the mods on one n8 fragment at a time, the fragments swapped after each (constant
             * indices: they stay in registers), as in the forward: the mods' code twice fewer
             * times in the kernel */
#pragma unroll 1
            for (int n8 = 0; n8 < 2; n8++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = 16 * sub + n8 * 8 + 2 * (lane & 3) + (e & 1), r = e >> 1;
                    const long long qi = i0 + r0 + 8 * r, kv = k0 + key;
                    float du = 0.0f;
                    if (key < n && qi < P.Tq && lse[r] != NEG_INF && (full || nsa_flex_mask(&mc, b, hq, qi, kv))) {
                        const float u = s[0][e] * P.scale;
                        float d1;
                        const float p = tc_exp(nsa_mod_score_grad(&sc, 0, b, hq, qi, kv, u, 1.0f, &d1) - lse[r]);
                        if (p != 0.0f) {
                            const float ds = p * (dp[0][e] - Dr[r]);
                            if (R.scatter) nsa_mod_score_grad(&sc, &sink, b, hq, qi, kv, u, ds, &du);
                            else du = tb_chain(ds, d1);
                        }
                    }
                    s[0][e] = du;
                }
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float a = s[0][e], c = dp[0][e];
                    s[0][e] = s[1][e], s[1][e] = a, dp[0][e] = dp[1][e], dp[1][e] = c;
                }
            }
            tb_xb<NSA_DK>(acc, s, Kb, LDK, lane);
        }
    }
    tb_store_dq(P, R, acc, b, hq, i0 + r0, lane);
}

/* The dk / dv walk: (query head, query block, first row) of the next SR-row slice of a query
 * block that lists key block kb; 0 past the last */
struct tb_slice {
    long long hq, qb, i0, i1;
    int kind;
};
template <int SR>
__device__ __forceinline__ int tb_next(const flex_params &P, tb_slice &sl, long long b, long long h, long long kb, int lane)
{
    if (sl.qb >= 0 && sl.i0 + SR < sl.i1) {
        sl.i0 += SR;
        return 1;
    }
    const long long nqb = (P.Tq + P.q_block - 1) / P.q_block;
    for (;;) {
        if (++sl.qb >= nqb) {
            sl.qb = 0;
            if (++sl.hq >= (h + 1) * P.G || nqb == 0) return 0;
        }
        sl.kind = listed_as(P, b, sl.hq, sl.qb, kb, lane);
        if (sl.kind) {
            sl.i0 = sl.qb * P.q_block;
            sl.i1 = sl.i0 + P.q_block < P.Tq ? sl.i0 + P.q_block : P.Tq;
            return 1;
        }
    }
}

/* dk, dv: 16 keys a warp; SHARED: the CTA's four warps take 64 keys of one key block and share
 * each SR-row slice of Q and dout (SR = 64), a warp working through it 16 rows at a time */
template <int SR, bool SHARED>
__device__ __forceinline__ void tb_dkdv(const flex_params &P, const flex_grads &R, const nsa_mod_caps &mc, const nsa_mod_caps &sc)
{
    constexpr int KEYS = SHARED ? 16 * TC_WARPS : 16, NT = SHARED ? 32 * TC_WARPS : 32;
    extern __shared__ __align__(16) unsigned short tc_sm[];
    if (P.nf && *(const volatile int *)P.nf != 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r0 = lane >> 2;
    const long long H = P.HQ / P.G, ntile = (P.Tk + KEYS - 1) / KEYS;
    const long long w = SHARED ? (long long)blockIdx.x : (long long)blockIdx.x * TC_WARPS + warp;
    if (w >= P.B * H * ntile) return;
    const long long tile = w % ntile, h = (w / ntile) % H, b = w / (ntile * H), u0 = KEYS * tile, kb = u0 / P.kv_block;
    const long long k0 = u0 + (SHARED ? 16 * warp : 0);
    const int me = SHARED ? threadIdx.x : lane;
    const float NEG_INF = nsa_mod_fbits(0xff800000u);
    unsigned short *Qs = tc_sm + (SHARED ? 0 : (long long)warp * 2 * SR * (LDK + LDV)), *Os = Qs + 2 * SR * LDK;
    unsigned kf[NSA_DK / 16][4], vf[NSA_DV / 16][4];
    tc_frags<NSA_DK>(kf, (const unsigned short *)P.k + b * P.ks0 + h * P.ks2, P.ks1, k0, P.Tk, lane);
    tc_frags<NSA_DV>(vf, (const unsigned short *)P.v + b * P.vs0 + h * P.vs2, P.vs1, k0, P.Tk, lane);
    float dk[NSA_DK / 8][4], dv[NSA_DV / 8][4];
#pragma unroll
    for (int n = 0; n < NSA_DK / 8; n++) dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.0f;
#pragma unroll
    for (int n = 0; n < NSA_DV / 8; n++) dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;
    tb_slice cur;
    cur.hq = h * P.G, cur.qb = -1, cur.i0 = cur.i1 = 0, cur.kind = 0;
    int have = tb_next<SR>(P, cur, b, h, kb, lane), buf = 0;
    if (have) tb_issue_rows<SR, NT>(P, R, b, cur.hq, cur.i0, cur.i1, Qs, Os, me);
    while (have) {
        tb_slice nxt = cur;
        const int more = tb_next<SR>(P, nxt, b, h, kb, lane);
        if (more) tb_issue_rows<SR, NT>(P, R, b, nxt.hq, nxt.i0, nxt.i1, Qs + (buf ^ 1) * SR * LDK, Os + (buf ^ 1) * SR * LDV, me);
        if (more) tc_wait<1>();
        else tc_wait<0>();
        if (SHARED) __syncthreads(); /* the slice is in for every thread's copies */
        else __syncwarp();
#pragma unroll 1
        for (int sub = 0; sub < SR / 16 && cur.i0 + 16 * sub < cur.i1; sub++) {
            const unsigned short *Qb = Qs + (buf * SR + 16 * sub) * LDK, *Ob = Os + (buf * SR + 16 * sub) * LDV;
            const long long j0 = cur.i0 + 16 * sub; /* the 16 rows' first */
            /* the lane's four rows (columns 2 (lane & 3) + {0, 1} + {0, 8}): lse and D */
            float lse[2][2], Dr[2][2];
#pragma unroll
            for (int n8 = 0; n8 < 2; n8++)
#pragma unroll
                for (int x = 0; x < 2; x++) {
                    const long long i = j0 + n8 * 8 + 2 * (lane & 3) + x;
                    lse[n8][x] = i < cur.i1 ? P.lse[b * P.ls0 + i * P.ls1 + cur.hq * P.ls2] : NEG_INF;
                    Dr[n8][x] = i < cur.i1 ? R.D[(b * P.HQ + cur.hq) * P.Tq + i] : 0.0f;
                }
            float s[2][4], dp[2][4];
            tb_s_dp(s, dp, kf, Qb, vf, Ob, lane); /* S^T = K Q^T, dP^T = V dout^T */
            if (NSA_SCORE_ID && !R.scatter && cur.kind == 2 && k0 + 16 <= P.Tk && j0 + 16 <= cur.i1) {
                /* a full block's 16 keys and 16 rows, no score_mod: no mod code, no index */
#pragma unroll
                for (int n8 = 0; n8 < 2; n8++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        float p = 0.0f, du = 0.0f;
                        if (lse[n8][e & 1] != NEG_INF) {
                            p = tc_exp(s[n8][e] * P.scale - lse[n8][e & 1]);
                            if (p != 0.0f) du = tb_chain(p * (dp[n8][e] - Dr[n8][e & 1]), 1.0f);
                        }
                        s[n8][e] = p, dp[n8][e] = du;
                    }
                tb_xb<NSA_DV>(dv, s, Ob, LDV, lane);
                tb_xb<NSA_DK>(dk, dp, Qb, LDK, lane);
                continue;
            }
            /* one n8 fragment at a time, then swapped (as in dq) */
#pragma unroll 1
            for (int n8 = 0; n8 < 2; n8++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const long long kv = k0 + r0 + 8 * (e >> 1), i = j0 + n8 * 8 + 2 * (lane & 3) + (e & 1);
                    float p = 0.0f, du = 0.0f;
                    if (kv < P.Tk && i < cur.i1 && lse[0][e & 1] != NEG_INF &&
                        (cur.kind == 2 || nsa_flex_mask(&mc, b, cur.hq, i, kv))) {
                        const float u = s[0][e] * P.scale;
                        float d1;
                        p = tc_exp(nsa_mod_score_grad(&sc, 0, b, cur.hq, i, kv, u, 1.0f, &d1) - lse[0][e & 1]);
                        if (p != 0.0f) du = tb_chain(p * (dp[0][e] - Dr[0][e & 1]), d1);
                    }
                    s[0][e] = p, dp[0][e] = du;
                }
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float a = s[0][e], c = dp[0][e];
                    s[0][e] = s[1][e], s[1][e] = a, dp[0][e] = dp[1][e], dp[1][e] = c;
                }
#pragma unroll
                for (int x = 0; x < 2; x++) {
                    const float a = lse[0][x], c = Dr[0][x];
                    lse[0][x] = lse[1][x], lse[1][x] = a, Dr[0][x] = Dr[1][x], Dr[1][x] = c;
                }
            }
            tb_xb<NSA_DV>(dv, s, Ob, LDV, lane);
            tb_xb<NSA_DK>(dk, dp, Qb, LDK, lane);
        }
        if (SHARED) __syncthreads(); /* every thread done with this buffer before the next slice's copy lands in it */
        else __syncwarp();
        cur = nxt, buf ^= 1, have = more;
    }
    tb_store_dkdv(P, R, dk, dv, b, h, k0 + r0, lane);
}

/* one layout a source (NSA_TC_WIDE), as the forward */
#if NSA_KERNEL == 2
extern "C" __global__ void __launch_bounds__(32 * TC_WARPS) nsa_flex_bwd_dq_tc(const flex_params P, const flex_grads R,
                                                                              const nsa_mod_caps mc, const nsa_mod_caps sc,
                                                                              const nsa_mod_sink sink)
{
#if NSA_TC_WIDE
    tb_dq<64, true>(P, R, mc, sc, sink);
#else
    tb_dq<16, false>(P, R, mc, sc, sink);
#endif
}
#endif
#if NSA_KERNEL == 3
extern "C" __global__ void __launch_bounds__(32 * TC_WARPS) nsa_flex_bwd_dkdv_tc(const flex_params P, const flex_grads R,
                                                                                const nsa_mod_caps mc, const nsa_mod_caps sc)
{
#if NSA_TC_WIDE
    tb_dkdv<64, true>(P, R, mc, sc);
#else
    tb_dkdv<16, false>(P, R, mc, sc);
#endif
}
#endif
)NSA";

/* The backward (after FLEX_COMMON): every float a score_mod's gradient sends to an element of a
 * captured tensor is added exactly -- the value split into 24-bit pieces added as integers to
 * 12 words covering 2^-149 .. 2^139, word 12 noting +inf (1), -inf (2) and NaN (4) -- so the
 * atomics from any number of threads give one result. Then two scalar kernels, a warp a row as
 * the scalar forward: nsa_flex_bwd_dq (a query row's keys in the forward's order: dq, the row's
 * D, the tensor gradients) and nsa_flex_bwd_dkdv (a key's rows over the G query heads and the
 * query blocks that list its block, ascending: dk, dv). Every sum has a fixed order: the
 * backward is deterministic. */
static const char FLEX_BWD_SINK[] = R"NSA(
struct nsa_mod_sink { unsigned long long *acc[16]; };
__device__ __forceinline__ void nsa_mod_grad(const nsa_mod_sink *s, int c, long long lin, float a)
{
    if (!s || !s->acc[c]) return;
    unsigned long long *w = s->acc[c] + lin * 13;
    union { float f; unsigned int u; } x;
    x.f = a;
    const unsigned int e = (x.u >> 23) & 0xffu, m = x.u & 0x7fffffu;
    if (e == 0xffu) {
        atomicOr(w + 12, m ? 4ull : (x.u >> 31) ? 2ull : 1ull);
        return;
    }
    if (e == 0u && m == 0u) return;
    const int at = e ? (int)e - 1 : 0; /* |a| = M * 2^(at - 149), M the 24-bit significand */
    const unsigned long long v = (unsigned long long)(e ? (m | 0x800000u) : m) << (at % 24);
    int lo = (int)(v & 0xffffffull), hi = (int)(v >> 24);
    if (x.u >> 31) lo = -lo, hi = -hi;
    unsigned long long *word = w + at / 24;
#if __CUDA_ARCH__ >= 800
    /* the lanes here together that add to the same word add their pieces first (integers: the
       grouping cannot change the sum), and one of them adds the total */
    const unsigned peers = __match_any_sync(__activemask(), (unsigned long long)word);
    lo = (int)__reduce_add_sync(peers, (unsigned)lo), hi = (int)__reduce_add_sync(peers, (unsigned)hi);
    if ((int)(threadIdx.x & 31) != __ffs(peers) - 1) return;
#endif
    if (lo) atomicAdd(word, (unsigned long long)(long long)lo);
    if (hi) atomicAdd(word + 1, (unsigned long long)(long long)hi);
}
)NSA";

static const char FLEX_BWD_KERNEL[] = "struct flex_grads { " FLEX_STR(FLEX_GRAD_FIELDS) " };\n" R"NSA(
__device__ __forceinline__ float warp_sum(float x)
{
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
#if NSA_KERNEL == 0
extern "C" __global__ void nsa_flex_bwd_dq(const flex_params P, const flex_grads R, const nsa_mod_caps mc, const nsa_mod_caps sc,
                                           const nsa_mod_sink sink)
{
    if (P.nf_role == 2 && *(const volatile int *)P.nf == 0) return; /* beside the tensor-core kernels: finite inputs */
    const int lane = threadIdx.x & 31;
    const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
    const long long items = P.B * P.HQ * P.Tq;
    const float NEG_INF = nsa_mod_fbits(0xff800000u);
    for (long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < items; w += nw) {
        const long long i = w % P.Tq, hq = (w / P.Tq) % P.HQ, b = w / (P.Tq * P.HQ), h = hq / P.G;
        const float lse = P.lse[b * P.ls0 + i * P.ls1 + hq * P.ls2];
        float q[COLS], dout[COLS], dq[COLS], Drow = 0.0f;
        for (int c = 0; c < COLS; c++) {
            const long long d = lane + 32 * c;
            q[c] = d < P.DK ? ld_elem(P.q, b * P.qs0 + i * P.qs1 + hq * P.qs2 + d) : 0.0f;
            dout[c] = d < P.DV ? ld_elem(R.dout, b * R.dos0 + i * R.dos1 + hq * R.dos2 + d) : 0.0f;
            if (d < P.DV) Drow += dout[c] * ld_elem(P.o, b * P.os0 + i * P.os1 + hq * P.os2 + d);
            dq[c] = 0.0f;
        }
        Drow = warp_sum(Drow);
        if (lane == 0) R.D[w] = Drow;
        if (lse != NEG_INF) /* (an empty row has no gradient) */
            visit(P, &mc, b, hq, i, [&](long long kv) {
                float kr[COLS], u = 0.0f;
                for (int c = 0; c < COLS; c++) {
                    const long long d = lane + 32 * c;
                    kr[c] = d < P.DK ? ld_elem(P.k, b * P.ks0 + kv * P.ks1 + h * P.ks2 + d) : 0.0f;
                    u += q[c] * kr[c];
                }
                u = warp_sum(u) * P.scale;
                const float p = expf(nsa_flex_score(&sc, b, hq, i, kv, u) - lse);
                if (p == 0.0f) return; /* a -inf score: a hidden pair */
                float dp = 0.0f;
                for (int c = 0; c < COLS; c++) {
                    const long long d = lane + 32 * c;
                    if (d < P.DV) dp += dout[c] * ld_elem(P.v, b * P.vs0 + kv * P.vs1 + h * P.vs2 + d);
                }
                const float ds = p * (warp_sum(dp) - Drow);
                float du = ds;
                nsa_mod_score_grad(&sc, lane == 0 ? &sink : 0, b, hq, i, kv, u, ds, &du); /* one lane scatters */
                const float wgt = du * P.scale;
                for (int c = 0; c < COLS; c++) dq[c] += wgt * kr[c];
            });
        for (int c = 0; c < COLS; c++) {
            const long long d = lane + 32 * c;
            if (d < P.DK) st_elem(R.dq, b * R.dqs0 + i * R.dqs1 + hq * R.dqs2 + d, dq[c]);
        }
    }
}
#endif
/* whether key block kb is listed for (b, hq, query block qb): 0 no, 1 partial, 2 full (lanes
 * search the lists side by side) */
__device__ int listed_as(const flex_params &P, long long b, long long hq, long long qb, long long kb, int lane)
{
    if (!P.num) return 1; /* no block mask: every key block partial */
    const block_list L = block_list_of(P, b, hq, qb);
    for (long long e0 = 0; e0 < L.n_part + L.n_full; e0 += 32) {
        const long long e = e0 + lane;
        const unsigned hit = __ballot_sync(0xffffffffu, e < L.n_part + L.n_full && L.block(e) == kb);
        if (hit) return e0 + __ffs(hit) - 1 >= L.n_part ? 2 : 1;
    }
    return 0;
}
#if NSA_KERNEL == 1
extern "C" __global__ void nsa_flex_bwd_dkdv(const flex_params P, const flex_grads R, const nsa_mod_caps mc, const nsa_mod_caps sc)
{
    if (P.nf_role == 2 && *(const volatile int *)P.nf == 0) return;
    const int lane = threadIdx.x & 31;
    const long long H = P.HQ / P.G, nw = (long long)gridDim.x * (blockDim.x >> 5);
    const long long items = P.B * H * P.Tk, nqb = (P.Tq + P.q_block - 1) / P.q_block;
    const float NEG_INF = nsa_mod_fbits(0xff800000u);
    for (long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < items; w += nw) {
        const long long kv = w % P.Tk, h = (w / P.Tk) % H, b = w / (P.Tk * H), kb = kv / P.kv_block;
        float kr[COLS], vr[COLS], dk[COLS], dv[COLS];
        for (int c = 0; c < COLS; c++) {
            const long long d = lane + 32 * c;
            kr[c] = d < P.DK ? ld_elem(P.k, b * P.ks0 + kv * P.ks1 + h * P.ks2 + d) : 0.0f;
            vr[c] = d < P.DV ? ld_elem(P.v, b * P.vs0 + kv * P.vs1 + h * P.vs2 + d) : 0.0f;
            dk[c] = dv[c] = 0.0f;
        }
        for (long long hq = h * P.G; hq < (h + 1) * P.G; hq++)
            for (long long qb = 0; qb < nqb; qb++) {
                const int kind = listed_as(P, b, hq, qb, kb, lane);
                if (!kind) continue;
                const long long i1 = (qb + 1) * P.q_block < P.Tq ? (qb + 1) * P.q_block : P.Tq;
                for (long long i = qb * P.q_block; i < i1; i++) {
                    if (kind == 1 && !nsa_flex_mask(&mc, b, hq, i, kv)) continue;
                    const float lse = P.lse[b * P.ls0 + i * P.ls1 + hq * P.ls2];
                    if (lse == NEG_INF) continue;
                    float qr[COLS], u = 0.0f;
                    for (int c = 0; c < COLS; c++) {
                        const long long d = lane + 32 * c;
                        qr[c] = d < P.DK ? ld_elem(P.q, b * P.qs0 + i * P.qs1 + hq * P.qs2 + d) : 0.0f;
                        u += qr[c] * kr[c];
                    }
                    u = warp_sum(u) * P.scale;
                    const float p = expf(nsa_flex_score(&sc, b, hq, i, kv, u) - lse);
                    if (p == 0.0f) continue;
                    float dout[COLS], dp = 0.0f;
                    for (int c = 0; c < COLS; c++) {
                        const long long d = lane + 32 * c;
                        dout[c] = d < P.DV ? ld_elem(R.dout, b * R.dos0 + i * R.dos1 + hq * R.dos2 + d) : 0.0f;
                        dp += dout[c] * vr[c];
                    }
                    const float ds = p * (warp_sum(dp) - R.D[(b * P.HQ + hq) * P.Tq + i]);
                    float du = ds;
                    nsa_mod_score_grad(&sc, 0, b, hq, i, kv, u, ds, &du);
                    const float wgt = du * P.scale;
                    for (int c = 0; c < COLS; c++) dv[c] += p * dout[c], dk[c] += wgt * qr[c];
                }
            }
        for (int c = 0; c < COLS; c++) {
            const long long d = lane + 32 * c;
            if (d < P.DK) st_elem(R.dk, b * R.dks0 + kv * R.dks1 + h * R.dks2 + d, dk[c]);
            if (d < P.DV) st_elem(R.dv, b * R.dvs0 + kv * R.dvs1 + h * R.dvs2 + d, dv[c]);
        }
    }
}
#endif
)NSA";

/* ---- NVRTC, loaded on first use ------------------------------------------------------------- */
typedef struct nvrtc_api {
    void *handle;
    nvrtcResult (*create)(nvrtcProgram *, const char *, const char *, int, const char *const *, const char *const *);
    nvrtcResult (*compile)(nvrtcProgram, int, const char *const *);
    nvrtcResult (*log_size)(nvrtcProgram, size_t *);
    nvrtcResult (*log)(nvrtcProgram, char *);
    nvrtcResult (*cubin_size)(nvrtcProgram, size_t *);
    nvrtcResult (*cubin)(nvrtcProgram, char *);
    nvrtcResult (*destroy)(nvrtcProgram *);
} nvrtc_api;

static int nvrtc_open(nvrtc_api *api, char *why, size_t n)
{
    static const char *const NAMES[] = {"libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"};
    memset(api, 0, sizeof *api);
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0] && !api->handle; i++) api->handle = dlopen(NAMES[i], RTLD_NOW | RTLD_LOCAL);
    if (!api->handle) {
        snprintf(why, n, "NVRTC (libnvrtc.so) not found: %s", dlerror());
        return 0;
    }
#define FLEX_SYM(field, name) *(void **)&api->field = dlsym(api->handle, name)
    FLEX_SYM(create, "nvrtcCreateProgram");
    FLEX_SYM(compile, "nvrtcCompileProgram");
    FLEX_SYM(log_size, "nvrtcGetProgramLogSize");
    FLEX_SYM(log, "nvrtcGetProgramLog");
    FLEX_SYM(cubin_size, "nvrtcGetCUBINSize");
    FLEX_SYM(cubin, "nvrtcGetCUBIN");
    FLEX_SYM(destroy, "nvrtcDestroyProgram");
#undef FLEX_SYM
    if (!api->create || !api->compile || !api->log_size || !api->log || !api->cubin_size || !api->cubin || !api->destroy) {
        snprintf(why, n, "NVRTC lacks a function this library calls");
        dlclose(api->handle);
        api->handle = NULL;
        return 0;
    }
    return 1;
}

/* The Hopper kernels' wgmma wrappers, m64nNk16 with f32 accumulators d[N / 2] (the mma.sync C
 * order) in the type TC_T names: wg_ss<N> (D = A B^T, both operands K-major in shared memory;
 * scale_d 0 overwrites d) for N in ss[0 .. nss), and wg_rs<N> (D += A B, A's fragments from
 * registers, B MN-major) for N in rs[0 .. nrs) (a repeated N written once). Written into buf
 * (size bytes, NUL included); @return the length needed, as snprintf. */
static size_t flex_wgmma_source(char *buf, size_t size, const int *ss, int nss, const int *rs, int nrs)
{
    size_t at = 0;
#define WG_PUT(...) at += (size_t)snprintf(buf ? buf + (at < size ? at : size) : NULL, buf && at < size ? size - at : 0, __VA_ARGS__)
    for (int x = 0; x < nss + nrs; x++) {
        const int form = x >= nss, n = form ? rs[x - nss] : ss[x], nd = n / 2;
        int seen = 0;
        for (int y = form ? nss : 0; y < x; y++) seen |= (y >= nss ? rs[y - nss] : ss[y]) == n;
        if (seen) continue;
        if (form == 0)
            WG_PUT("__device__ __forceinline__ void wg_ss%d(float *d, unsigned long long da, unsigned long long db, int scale_d)\n{\n"
                   "    asm volatile(\"{\\n.reg .pred p;\\nsetp.ne.b32 p, %%%d, 0;\\n\"\n"
                   "                 \"wgmma.mma_async.sync.aligned.m64n%dk16.f32.\" TC_T \".\" TC_T \" {", n, nd + 2, n);
        else
            WG_PUT("__device__ __forceinline__ void wg_rs%d(float *d, const unsigned a[4], unsigned long long db)\n{\n"
                   "    asm volatile(\"{\\n.reg .pred p;\\nsetp.ne.b32 p, %%%d, 0;\\n\"\n"
                   "                 \"wgmma.mma_async.sync.aligned.m64n%dk16.f32.\" TC_T \".\" TC_T \" {", n, nd + 5, n);
        for (int i = 0; i < nd; i++) WG_PUT("%s%%%d", i ? ", " : "", i);
        if (form == 0) WG_PUT("}, %%%d, %%%d, p, 1, 1, 0, 0;\\n}\\n\"\n                 : ", nd, nd + 1);
        else WG_PUT("}, {%%%d, %%%d, %%%d, %%%d}, %%%d, p, 1, 1, 1;\\n}\\n\"\n                 : ", nd, nd + 1, nd + 2, nd + 3, nd + 4);
        for (int i = 0; i < nd; i++) WG_PUT("%s\"+f\"(d[%d])", i ? ", " : "", i);
        if (form == 0) WG_PUT("\n                 : \"l\"(da), \"l\"(db), \"r\"(scale_d));\n}\n");
        else WG_PUT("\n                 : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(db), \"r\"(1));\n}\n");
    }
#undef WG_PUT
    return at;
}

/* The source of one (mask, score, element type): the expressions' prelude, the element type, the
 * two mods, then for the forward (bwd 0) the scalar kernel and, with head dims dk, dv (0: none),
 * the tensor-core kernel in the layout `wide`: 0 16 rows a warp, 1 64 rows a CTA, 2 / 3 the
 * Hopper kernel with 64- / 128-key slices; for the backward (bwd 1) the score_mod's reverse mode,
 * the two scalar kernels and, with dk, dv, the two tensor-core ones (wide 0 or 1). idx32: the call's
 * b, h, q_idx and kv_idx all lie in [0, 2^31) (expr_to_c's 32-bit ints; NSA_IDX32 in the kernels). */
static const char NO_SCORE_GRAD[] =
    "NSA_MOD_FN float nsa_mod_score_grad(const nsa_mod_caps *caps, const nsa_mod_sink *sink, long long b, long long h,\n"
    "                                    long long q_idx, long long kv_idx, float score, float g, float *dscore)\n"
    "{\n    *dscore = g;\n    return score;\n}\n";

/* The fixed texts of a kernel's source. A cache key hashes the source with each of them written
 * as a marker (flex_source with full 0: the mods' C, the defines and the wgmma wrappers, a few
 * KB) and, once per process, the texts themselves (flex_texts_hash): a call that finds its
 * kernels cached never writes or hashes the whole source (~100 KB). */
static const char *const FLEX_TEXTS[] = {EXPR_C_PRELUDE, FLEX_COMMON,    FLEX_KERNEL,     FLEX_TC_COMMON, FLEX_TC_KERNEL,
                                         FLEX_WG_COMMON, FLEX_WG_FWD,    FLEX_WG_BWD,     FLEX_TB_COMMON, FLEX_BWD_SINK,
                                         FLEX_BWD_KERNEL, FLEX_TC_BWD,   NO_SCORE_GRAD};

/* t, or (full 0) the marker of a fixed text in buf (16 bytes). */
static const char *flex_text(const char *t, int full, char *buf)
{
    if (full) return t;
    for (size_t i = 0; i < sizeof FLEX_TEXTS / sizeof FLEX_TEXTS[0]; i++)
        if (FLEX_TEXTS[i] == t) {
            snprintf(buf, 16, "#%u\n", (unsigned)i);
            return buf;
        }
    return t;
}

static char *flex_source(const nsa_mod *mask, const nsa_mod *score, int elem, int dk, int dv, int wide, int bwd, int idx32,
                         int full)
{
    char mk[4][16];
    const size_t nm = mask ? expr_to_c(mask, idx32, NULL, 0) : 0, ns = score ? expr_to_c(score, idx32, NULL, 0) : 0;
    const size_t ng = bwd && score ? expr_grad_to_c(score, idx32, NULL, 0) : sizeof NO_SCORE_GRAD;
    const int hopper = dk > 0 && wide >= 2, wg_bn = wide == 3 ? 128 : 64;
    /* the wgmma shapes: forward S (wg_bn keys) and O (dv); backward S, dP (64) and dQ, dK, dV */
    const int ss[1] = {bwd ? 64 : wg_bn}, rs[2] = {bwd ? dk : dv, dv};
    const size_t nw = hopper ? flex_wgmma_source(NULL, 0, ss, 1, rs, 1 + bwd) : 0;
    const size_t cap = strlen(EXPR_C_PRELUDE) + sizeof FLEX_COMMON + sizeof FLEX_KERNEL + sizeof FLEX_TC_COMMON +
                       sizeof FLEX_TC_KERNEL + sizeof FLEX_WG_COMMON + sizeof FLEX_WG_FWD + sizeof FLEX_WG_BWD + sizeof FLEX_TB_COMMON + sizeof FLEX_BWD_SINK + sizeof FLEX_BWD_KERNEL +
                       sizeof FLEX_TC_BWD + nm + ns + ng + nw + 1024;
    char *src = (char *)malloc(cap), *me = (char *)malloc(nm + 1), *se = (char *)malloc(ns + 1), *ge = (char *)malloc(ng + 1);
    if (!src || !me || !se || !ge || (bwd && score && ng == 0)) {
        free(src), free(me), free(se), free(ge);
        return NULL;
    }
    if (mask) expr_to_c(mask, idx32, me, nm + 1);
    if (score) expr_to_c(score, idx32, se, ns + 1);
    if (bwd && score) expr_grad_to_c(score, idx32, ge, ng + 1);
    snprintf(src, cap,
             "#define NSA_MOD_FN __device__ __forceinline__\n#define NSA_ELEM %d\n#define NSA_SCORE_ID %d\n#define NSA_IDX32 %d\n"
             "#define NSA_MOD_UNROLL %d\n%s"
             "NSA_MOD_FN int nsa_flex_mask(const nsa_mod_caps *caps, long long b, long long h, long long q_idx, "
             "long long kv_idx)\n{\n    (void)caps, (void)b, (void)h, (void)q_idx, (void)kv_idx;\n    return %s;\n}\n"
             "NSA_MOD_FN float nsa_flex_score(const nsa_mod_caps *caps, long long b, long long h, long long q_idx, "
             "long long kv_idx, float score)\n{\n    (void)caps, (void)b, (void)h, (void)q_idx, (void)kv_idx;\n"
             "    return (float)(%s);\n}\n%s",
             elem, score ? 0 : 1, idx32, expr_size(mask) + expr_size(score) <= FLEX_MOD_UNROLL_MAX,
             flex_text(EXPR_C_PRELUDE, full, mk[0]), mask ? me : "1", score ? se : "score", flex_text(FLEX_COMMON, full, mk[1]));
    size_t at = strlen(src);
    if (bwd)
        snprintf(src + at, cap - at, "%s%s%s", flex_text(FLEX_BWD_SINK, full, mk[0]),
                 score ? ge : flex_text(NO_SCORE_GRAD, full, mk[1]), flex_text(FLEX_BWD_KERNEL, full, mk[2]));
    else snprintf(src + at, cap - at, "%s", flex_text(FLEX_KERNEL, full, mk[0]));
    if (dk > 0) {
        at = strlen(src);
        snprintf(src + at, cap - at, "#define NSA_DK %d\n#define NSA_DV %d\n#define NSA_TC_WIDE %d\n#define TC_WARPS %d\n"
                 "#define TC_STAGES %d\n%s", dk, dv, wide, FLEX_TC_WARPS, FLEX_TC_STAGES, flex_text(FLEX_TC_COMMON, full, mk[0]));
        at = strlen(src);
        if (hopper) {
            at += (size_t)snprintf(src + at, cap - at, "#define WG_BN %d\n#define WG_NS %d\n", wg_bn, FLEX_WG_STAGES);
            flex_wgmma_source(src + at, cap - at, ss, 1, rs, 1 + bwd);
            at = strlen(src);
        }
        snprintf(src + at, cap - at, "%s%s%s", hopper ? flex_text(FLEX_WG_COMMON, full, mk[0]) : "",
                 bwd ? flex_text(FLEX_TB_COMMON, full, mk[1]) : "",
                 flex_text(bwd ? (hopper ? FLEX_WG_BWD : FLEX_TC_BWD) : hopper ? FLEX_WG_FWD : FLEX_TC_KERNEL, full, mk[2]));
    }
    free(me), free(se), free(ge);
    return src;
}

static uint64_t fnv1a(const char *s, uint64_t h)
{
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* The hash of FLEX_TEXTS, once per process (a race computes the same value twice). */
static uint64_t flex_texts_hash(void)
{
    static uint64_t done;
    uint64_t h = __atomic_load_n(&done, __ATOMIC_RELAXED);
    if (!h) {
        h = 1469598103934665603ull;
        for (size_t i = 0; i < sizeof FLEX_TEXTS / sizeof FLEX_TEXTS[0]; i++) h = fnv1a(FLEX_TEXTS[i], h);
        h |= 1; /* (never 0: 0 means not yet) */
        __atomic_store_n(&done, h, __ATOMIC_RELAXED);
    }
    return h;
}

/* Compiles src for compute capability major.minor into a cubin (malloc'd). @return 1, or 0 with
 * the reason in why (the compiler's log on a compile error). */
static int flex_compile(nvrtc_api *api, const char *src, int major, int minor, int kernel, char **cubin, size_t *bytes,
                        char *why, size_t n)
{
    char arch[48], which[32];
    snprintf(arch, sizeof arch, "--gpu-architecture=sm_%d%d%s", major, minor, major == 9 && minor == 0 ? "a" : "");
    snprintf(which, sizeof which, "-DNSA_KERNEL=%d", kernel);
    const char *opts[] = {arch, "--std=c++17", "-default-device", which};
    nvrtcProgram prog;
    if (api->create(&prog, src, "nsa_flex.cu", 0, NULL, NULL) != NVRTC_SUCCESS) {
        snprintf(why, n, "nvrtcCreateProgram failed");
        return 0;
    }
    const nvrtcResult rc = api->compile(prog, 4, opts);
    if (rc != NVRTC_SUCCESS) {
        size_t ls = 0;
        api->log_size(prog, &ls);
        char *log = (char *)malloc(ls + 1);
        if (log && api->log(prog, log) == NVRTC_SUCCESS) snprintf(why, n, "NVRTC: %.200s", log);
        else snprintf(why, n, "NVRTC compile failed (%d)", (int)rc);
        free(log);
        api->destroy(&prog);
        return 0;
    }
    *bytes = 0;
    api->cubin_size(prog, bytes);
    *cubin = (char *)malloc(*bytes ? *bytes : 1);
    const int ok = *cubin && api->cubin(prog, *cubin) == NVRTC_SUCCESS;
    api->destroy(&prog);
    if (!ok) snprintf(why, n, "nvrtcGetCUBIN failed");
    return ok;
}

/* The kernels of one source are compiled apart (-DNSA_KERNEL=k keeps one) and side by side, a
 * thread each: a first call's wait is its slowest kernel's compile, not their sum. */
typedef struct flex_job {
    nvrtc_api *api;
    const char *src;
    int major, minor, kernel, ok;
    char *cubin;
    size_t bytes;
    char why[256];
} flex_job;

static void *flex_job_run(void *arg)
{
    flex_job *j = (flex_job *)arg;
    j->ok = flex_compile(j->api, j->src, j->major, j->minor, j->kernel, &j->cubin, &j->bytes, j->why, sizeof j->why);
    return NULL;
}

/* Runs jobs[0 .. n) (those with cubin NULL), in threads where they start, else in this one.
 * @return whether all of them compiled (else the first failure's reason in why). */
static int flex_compile_jobs(flex_job *jobs, int n, char *why, size_t nwhy)
{
    pthread_t th[4];
    int started[4] = {0, 0, 0, 0};
    for (int x = 0; x < n; x++) {
        jobs[x].ok = jobs[x].cubin != NULL;
        if (!jobs[x].ok) started[x] = pthread_create(&th[x], NULL, flex_job_run, &jobs[x]) == 0;
    }
    for (int x = 0; x < n; x++) {
        if (started[x]) pthread_join(th[x], NULL);
        else if (!jobs[x].ok) flex_job_run(&jobs[x]);
    }
    for (int x = 0; x < n; x++)
        if (!jobs[x].ok) {
            snprintf(why, nwhy, "%s", jobs[x].why);
            return 0;
        }
    return 1;
}

/* Kernels a source holds (NSA_KERNEL 0 ..): the forward's scalar one and, with head dims, its
 * tensor-core one; the backward's scalar dq and dk / dv and, with head dims, their tensor-core
 * forms. */
static int flex_kernel_count(int dk, int bwd) { return (bwd ? 2 : 1) * (dk > 0 ? 2 : 1); }

/* Compiles the kernels of (mask, score, elem; the forward's tensor-core one for f16 / bf16, or
 * with bwd the backward's) for an architecture without a GPU: what the tests run on a machine
 * with the toolkit (the generated source must compile) and what times the first compile of a
 * new mod. @return SUCCESS or NOT_SUPPORTED / BAD_ARGUMENT with the reason. */
extern "C" nsa_status nsa_cuda_flex_compile_check(const nsa_mod *mask, const nsa_mod *score, int elem, int bwd, int major,
                                                  int minor, size_t *cubin_bytes, double *seconds)
{
    nvrtc_api api;
    char why[256];
    if (!nvrtc_open(&api, why, sizeof why)) return nsa_fail(NSA_STATUS_NOT_SUPPORTED, "ctx: %s", why);
    const int dk = elem ? 128 : 0; /* (both head dims; a layout an arch) */
    char *src = flex_source(mask, score, elem, dk, 64, major == 9 && minor == 0 ? 3 : 1, bwd, 1, 1);
    if (!src) {
        dlclose(api.handle);
        return nsa_fail(NSA_STATUS_OUT_OF_MEMORY, "ctx: no memory for the kernel source");
    }
    flex_job jobs[4];
    const int n = flex_kernel_count(dk, bwd);
    memset(jobs, 0, sizeof jobs);
    for (int x = 0; x < n; x++) jobs[x].api = &api, jobs[x].src = src, jobs[x].major = major, jobs[x].minor = minor, jobs[x].kernel = x;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    const int ok = flex_compile_jobs(jobs, n, why, sizeof why);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (seconds) *seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    if (cubin_bytes) *cubin_bytes = 0;
    for (int x = 0; x < n; x++) {
        if (cubin_bytes && jobs[x].ok) *cubin_bytes += jobs[x].bytes;
        free(jobs[x].cubin);
    }
    free(src);
    dlclose(api.handle);
    return ok ? NSA_STATUS_SUCCESS : nsa_fail(NSA_STATUS_NOT_SUPPORTED, "ctx: %s", why);
}

/* ---- the per-context cache ------------------------------------------------------------------ */
enum { FLEX_CACHE_ENTRIES = 64 };
struct flex_cache {
    pthread_mutex_t lock;
    nvrtc_api api;
    int opened;
    int n;
    struct {
        uint64_t hash;
        cudaLibrary_t lib[4]; /* a library a kernel (NULL past the source's count) */
        cudaKernel_t k[4]; /* forward: scalar, tensor-core (NULL: not in this source); backward: dq, dk / dv (scalar, then
                              tensor-core) */
    } e[FLEX_CACHE_ENTRIES];
};

extern "C" void *nsa_cuda_flex_cache_new(void)
{
    flex_cache *c = (flex_cache *)calloc(1, sizeof *c);
    if (c) pthread_mutex_init(&c->lock, NULL);
    return c;
}

extern "C" void nsa_cuda_flex_cache_free(void *cache)
{
    flex_cache *c = (flex_cache *)cache;
    if (!c) return;
    for (int i = 0; i < c->n; i++)
        for (int x = 0; x < 4; x++)
            if (c->e[i].lib[x]) cudaLibraryUnload(c->e[i].lib[x]);
    if (c->api.handle) dlclose(c->api.handle);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

/* The disk cache's folder: NSA_CACHE_DIR, else $XDG_CACHE_HOME/nsa, else $HOME/.cache/nsa
 * (made if absent; no folder: no disk cache). */
static int cache_dir(char *buf, size_t n)
{
    const char *d = getenv("NSA_CACHE_DIR"), *x = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (d && *d) snprintf(buf, n, "%s", d);
    else if (x && *x) snprintf(buf, n, "%s/nsa", x);
    else if (home && *home) snprintf(buf, n, "%s/.cache/nsa", home);
    else return 0;
    mkdir(buf, 0755); /* (its parent may need making too for the $HOME form) */
    struct stat st;
    return stat(buf, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The kernels of (mask, score, elem) on this device, from the memory cache, the disk cache or
 * compiled: the forward's (bwd 0: k[0] the scalar one, k[1] the tensor-core one) or the
 * backward's (bwd 1: k[0] dq, k[1] dk / dv, k[2] and k[3] their tensor-core forms); the
 * tensor-core ones for head dims dk, dv (NULL with dk 0), the forward's in the layout `wide`.
 * @return whether k[0] is there (else the failure is in g). */
static int flex_kernel(grun *g, flex_cache *c, const nsa_mod *mask, const nsa_mod *score, int elem, int dk, int dv, int wide,
                       int bwd, int idx32, cudaKernel_t k[4])
{
    static const char *const NAMES[2][4] = {{"nsa_flex_fwd", "nsa_flex_fwd_tc", NULL, NULL},
                                            {"nsa_flex_bwd_dq", "nsa_flex_bwd_dkdv", "nsa_flex_bwd_dq_tc", "nsa_flex_bwd_dkdv_tc"}};
    k[0] = k[1] = k[2] = k[3] = NULL;
    char *key = flex_source(mask, score, elem, dk, dv, wide, bwd, idx32, 0), *src = NULL;
    if (!key) {
        g_fail(g, NSA_STATUS_OUT_OF_MEMORY, "ctx: no memory for the kernel source");
        return 0;
    }
    int major = 0, minor = 0, dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    char tag[32];
    snprintf(tag, sizeof tag, "sm_%d%d", major, minor);
    const uint64_t hash = fnv1a(tag, fnv1a(key, flex_texts_hash()));
    free(key);
    pthread_mutex_lock(&c->lock);
    for (int i = 0; i < c->n && !k[0]; i++)
        if (c->e[i].hash == hash) memcpy(k, c->e[i].k, sizeof c->e[i].k);
    if (!k[0] && !(src = flex_source(mask, score, elem, dk, dv, wide, bwd, idx32, 1)))
        g_fail(g, NSA_STATUS_OUT_OF_MEMORY, "ctx: no memory for the kernel source");
    if (!k[0] && src) {
        char dir[512], path[4][600], why[256];
        const int have_dir = cache_dir(dir, sizeof dir), n = flex_kernel_count(dk, bwd);
        flex_job jobs[4];
        memset(jobs, 0, sizeof jobs);
        for (int x = 0; x < n; x++) {
            jobs[x].api = &c->api, jobs[x].src = src, jobs[x].major = major, jobs[x].minor = minor, jobs[x].kernel = x;
            snprintf(path[x], sizeof path[x], "%s/flex-%016llx-%d.cubin", dir, (unsigned long long)hash, x);
            FILE *f = have_dir ? fopen(path[x], "rb") : NULL;
            if (f) { /* a cubin compiled earlier for this source, kernel and architecture */
                fseek(f, 0, SEEK_END);
                const long len = ftell(f);
                fseek(f, 0, SEEK_SET);
                jobs[x].cubin = len > 0 ? (char *)malloc((size_t)len) : NULL;
                if (jobs[x].cubin && fread(jobs[x].cubin, 1, (size_t)len, f) == (size_t)len) jobs[x].bytes = (size_t)len;
                else free(jobs[x].cubin), jobs[x].cubin = NULL;
                fclose(f);
            }
        }
        int missing = 0, from_disk[4] = {0, 0, 0, 0};
        for (int x = 0; x < n; x++) missing |= jobs[x].cubin == NULL, from_disk[x] = jobs[x].cubin != NULL;
        if (missing && !c->opened) c->opened = nvrtc_open(&c->api, why, sizeof why) ? 1 : -1;
        const int compiled = missing ? c->opened > 0 && flex_compile_jobs(jobs, n, why, sizeof why) : 1;
        if (!compiled) g_fail(g, NSA_STATUS_NOT_SUPPORTED, "ctx: %s", c->opened < 0 ? "NVRTC (libnvrtc.so) not found" : why);
        cudaLibrary_t lib[4] = {NULL, NULL, NULL, NULL};
        for (int x = 0; x < n && g_live(g); x++) {
            if (!from_disk[x] && have_dir) { /* the compiled ones only; written aside, then renamed: another process never reads half a file */
                char tmp[640];
                snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path[x], (long)getpid());
                FILE *w = fopen(tmp, "wb");
                const int whole = w && fwrite(jobs[x].cubin, 1, jobs[x].bytes, w) == jobs[x].bytes;
                if (w) fclose(w);
                if (!whole || rename(tmp, path[x]) != 0) remove(tmp);
            }
            g_check(g, cudaLibraryLoadData(&lib[x], jobs[x].cubin, NULL, NULL, 0, NULL, NULL, 0));
            if (g_live(g)) g_check(g, cudaLibraryGetKernel(&k[x], lib[x], NAMES[bwd][x]));
        }
        if (g_live(g)) {
            if (c->n == FLEX_CACHE_ENTRIES) { /* full: the oldest goes */
                for (int x = 0; x < 4; x++)
                    if (c->e[0].lib[x]) cudaLibraryUnload(c->e[0].lib[x]);
                memmove(&c->e[0], &c->e[1], sizeof c->e[0] * (FLEX_CACHE_ENTRIES - 1));
                c->n--;
            }
            c->e[c->n].hash = hash;
            memcpy(c->e[c->n].lib, lib, sizeof lib);
            memcpy(c->e[c->n].k, k, sizeof c->e[c->n].k);
            c->n++;
        } else {
            for (int x = 0; x < 4; x++)
                if (lib[x]) cudaLibraryUnload(lib[x]);
            k[0] = k[1] = k[2] = k[3] = NULL;
        }
        for (int x = 0; x < n; x++) free(jobs[x].cubin);
    }
    pthread_mutex_unlock(&c->lock);
    free(src);
    return k[0] != NULL && g_live(g);
}

/* ---- the call -------------------------------------------------------------------------------- */
static void caps_of(const nsa_mod *m, nsa_mod_caps *c)
{
    if (m) expr_caps(m, c);
    else memset(c, 0, sizeof *c);
}

/* The elements a view spans (its largest offset + 1; validated strides are >= 0), 0 when empty. */
static int64_t view_span(const nsa_tensor *t)
{
    for (int d = 0; d < t->rank; d++)
        if (t->shape[d] == 0) return 0; /* (first: an empty view's strides are unchecked) */
    int64_t span = 1;
    for (int d = 0; d < t->rank; d++) span += (t->shape[d] - 1) * t->stride[d];
    return span;
}

/* Copies of a block mask's four lists queued into host buffers (host[t], malloc'd; free them),
 * m's tensors pointed at them: complete once the stream is synchronised. */
static void lists_to_host(grun *g, nsa_block_mask *m, void *host[4])
{
    nsa_tensor *lists[4] = {&m->kv_num_blocks, &m->kv_indices, &m->full_kv_num_blocks, &m->full_kv_indices};
    for (int t = 0; t < 4 && g_live(g); t++) {
        const int64_t span = nsa_present(lists[t]) ? view_span(lists[t]) : 0;
        if (span == 0) continue;
        host[t] = malloc((size_t)span * 4);
        if (!host[t]) {
            g_fail(g, NSA_STATUS_OUT_OF_MEMORY, "block_mask: no host memory to check the lists");
            break;
        }
        g_check(g, cudaMemcpyAsync(host[t], lists[t]->data, (size_t)span * 4, cudaMemcpyDeviceToHost, g->st));
        lists[t]->data = host[t];
    }
}

/* The block lists copied to the host and checked as the CPU checks them (before any write). */
static void check_lists(grun *g, const nsa_flex_args *a)
{
    if (!nsa_present(&a->block_mask.kv_num_blocks)) return;
    nsa_flex_args h = *a;
    void *host[4] = {NULL, NULL, NULL, NULL};
    lists_to_host(g, &h.block_mask, host);
    if (g_live(g)) g_check(g, cudaStreamSynchronize(g->st));
    if (g_live(g)) {
        const nsa_status st = nsa_flex_lists_check(&h, g->p);
        if (st != NSA_STATUS_SUCCESS) g->err = st; /* (its detail is written) */
    }
    for (int t = 0; t < 4; t++) free(host[t]);
}

/* The mods read their tensors on the device: memory the device cannot address (plain host
 * memory) is refused, naming the tensor, instead of faulting in the kernel. Only the live pass
 * asks the runtime. */
static void check_mod_memory(grun *g, const nsa_mod *m, const char *which)
{
    if (!m || !g_live(g)) return;
    for (int i = 0; i < expr_num_captures(m); i++) {
        const nsa_tensor *t = expr_capture_tensor(m, i);
        cudaPointerAttributes at;
        memset(&at, 0, sizeof at);
        const cudaError_t e = cudaPointerGetAttributes(&at, t->data);
        if (e != cudaSuccess) (void)cudaGetLastError(); /* an unknown pointer: not an error of the call */
        if (e != cudaSuccess || at.type == cudaMemoryTypeUnregistered || (at.type == cudaMemoryTypeHost && !at.devicePointer)) {
            g_fail(g, NSA_STATUS_BAD_ARGUMENT, "%s: tensor '%s' is host memory; on the CUDA backend a mod's tensors must be "
                                               "device (or mapped) memory",
                   which, expr_capture_name(m, i));
            return;
        }
    }
}

/* ---- the dense route's inputs (flex_route.h; api.c decides) ------------------------------------ */

/* The block lists and a document mask's ids copied to the host: one synchronisation of the
 * stream, none when the call has neither. The magnitudes of q and k are not read: the attention
 * kernels keep a row of all -inf scores empty themselves (nsa_problem.flex_rows). */
extern "C" nsa_status nsa_cuda_flex_route_read(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_args *a,
                                               const flex_route *r, void *ws, flex_route_host *h)
{
    memset(h, 0, sizeof *h);
    h->lists = a->block_mask;
    grun g;
    g_init(&g, ctx, p, ws, 0);
    if (g.err != NSA_STATUS_SUCCESS) return g.err;
    check_mod_memory(&g, a->mask_mod, "mask_mod"); /* (host memory refused as the engine refuses it) */
    check_mod_memory(&g, a->score_mod, "score_mod");
    if (g.err != NSA_STATUS_SUCCESS) return g.err;
    /* what the decision reads needs a synchronisation, and a document mask's varlen call uploads
     * its sequence tables from host memory; a stream being captured into a CUDA graph allows
     * neither: there the engine's path runs (as it would have) */
    h->scores_on_device = 1;
    const int reads = (r->doc && !a->doc_runs) || nsa_present(&a->block_mask.kv_num_blocks);
    if (!reads && !r->doc) return NSA_STATUS_SUCCESS;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    g_check(&g, cudaStreamIsCapturing(g.st, &capture));
    if (g.err != NSA_STATUS_SUCCESS) return g.err;
    if (capture != cudaStreamCaptureStatusNone) {
        h->decline = 1;
        return NSA_STATUS_SUCCESS;
    }
    if (!reads) return NSA_STATUS_SUCCESS;
    lists_to_host(&g, &h->lists, h->owned);
    const int ids = r->doc && !a->doc_runs; /* (the caller's runs: no ids to read) */
    const int64_t dspan = ids ? view_span(r->doc) : 0, dn = dspan > p->T ? dspan : p->T;
    if (ids && g_live(&g)) {
        h->doc = (int32_t *)malloc((size_t)dn * 4);
        h->owned[4] = h->doc;
        if (!h->doc) g_fail(&g, NSA_STATUS_OUT_OF_MEMORY, "mask_mod: no host memory for the document ids");
        else g_check(&g, cudaMemcpyAsync(h->doc, r->doc->data, (size_t)dspan * 4, cudaMemcpyDeviceToHost, g.st));
    }
    if (g_live(&g)) g_check(&g, cudaStreamSynchronize(g.st));
    if (g.err != NSA_STATUS_SUCCESS) {
        flex_route_host_free(h);
        return g.err;
    }
    if (ids) /* doc[0 .. T) gathered from the strided copy, in place (i * stride >= i) */
        for (int64_t i = 0; i < p->T; i++) h->doc[i] = h->doc[i * r->doc->stride[0]];
    return NSA_STATUS_SUCCESS;
}


/* Whether the tensor-core kernel takes the call: f16 / bf16, DK and DV in {64, 128}, block sizes
 * multiples of 16 (a warp's 16 query rows in one q block, a 16-key slice in one key block), Q
 * read four bytes at a time and K, V sixteen (the views' alignment and strides). */
static int flex_tc_fits(const grun *g, const nsa_flex_args *a, const nsa_problem *p)
{
    if (!g->ovr->flex_tc || a->q.dtype == NSA_DTYPE_F32) return 0;
    if ((p->DK != 64 && p->DK != 128) || (p->DV != 64 && p->DV != 128)) return 0;
    const nsa_block_mask *m = &a->block_mask;
    if (m->q_block % 16 != 0 || m->kv_block % 16 != 0) return 0;
    if ((uintptr_t)a->q.data % 4 != 0 || a->q.stride[0] % 2 || a->q.stride[1] % 2 || a->q.stride[2] % 2 || a->q.stride[3] != 1)
        return 0;
    if (p->B * p->HQ * ((p->T + 15) / 16) > INT32_MAX) return 0; /* a grid dimension (the scalar kernel strides) */
    const nsa_tensor *kv[2] = {&a->k, &a->v};
    for (int t = 0; t < 2; t++)
        if ((uintptr_t)kv[t]->data % 16 != 0 || kv[t]->stride[0] % 8 || kv[t]->stride[1] % 8 || kv[t]->stride[2] % 8 ||
            kv[t]->stride[3] != 1)
            return 0;
    return 1;
}

/* Whether the Hopper kernels may run: an sm_90 device (the sm_90a build NVRTC makes) and the
 * sm_90a tiles allowed (NSA_CUDA_WGMMA). Asked of the device itself, since the sizing pass, which
 * must decide alike, has no device limits in g. */
static int flex_hopper(const grun *g)
{
    int dev = 0, major = 0, minor = 0;
    if (!g->ovr->wgmma || cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return major == 9 && minor == 0;
}

/* Whether the Hopper forward takes a call the tensor-core kernels take: an sm_90 device (the
 * sm_90a build NVRTC makes), the sm_90a tiles allowed (NSA_CUDA_WGMMA), a q block of whole
 * 128-row tiles, key blocks of whole 64-key slices, and TMA maps over Q, K and V (16-byte aligned
 * rows and strides; every coordinate in 32 bits). @return the keys a slice (128 where the key
 * block allows, else 64) with maps[] made for Q, K and V, or 0. */
static int flex_wg_bn(const grun *g, const nsa_flex_args *a, const nsa_problem *p, CUtensorMap maps[3])
{
    if (!flex_hopper(g)) return 0;
    const nsa_block_mask *m = &a->block_mask;
    if (m->q_block % 128 != 0 || m->kv_block % 64 != 0) return 0;
    if (p->B * p->HQ * ((p->T + 127) / 128) > INT32_MAX || p->T + 128 > INT32_MAX || p->Tk + m->kv_block > INT32_MAX) return 0;
    const int bn = m->kv_block % 128 == 0 ? 128 : 64;
    const dview qv = dv_of(&a->q), kv = dv_of(&a->k), vv = dv_of(&a->v);
    const nsa_dtype dt = a->q.dtype;
    if (!tmap_make(&maps[0], &qv, dt, p->B, p->T, p->HQ, p->DK, 128) || !tmap_make(&maps[1], &kv, dt, p->B, p->Tk, p->H, p->DK, bn) ||
        !tmap_make(&maps[2], &vv, dt, p->B, p->Tk, p->H, p->DV, bn))
        return 0;
    return bn;
}

/* Whether every (b, h, q_idx, kv_idx) a kernel hands the mods lies in [0, 2^31): batch entries,
 * query heads, query rows, and keys up to the end of the last key block (the tiles evaluate the
 * mods on a slice's every key, the real ones kept). Then the mods' ints may run in 32 bits. */
static int flex_idx32(const nsa_problem *p, const nsa_block_mask *m)
{
    const int64_t kv_end = (p->Tk + m->kv_block - 1) / m->kv_block * m->kv_block;
    return p->B <= INT32_MAX && p->HQ <= INT32_MAX && p->T <= INT32_MAX && kv_end <= INT32_MAX;
}

/* The generated kernels' element type: 0 f32, 1 f16, 2 bf16 (NSA_ELEM). */
static int elem_of(const nsa_flex_args *a) { return a->q.dtype == NSA_DTYPE_F32 ? 0 : a->q.dtype == NSA_DTYPE_F16 ? 1 : 2; }

/* The parameter block of a call (the forward's tensors and lists; the backward reads o and lse). */
static void params_of(const nsa_flex_args *a, const nsa_problem *p, flex_params *out)
{
    flex_params P;
    memset(&P, 0, sizeof P);
    P.q = a->q.data, P.k = a->k.data, P.v = a->v.data, P.o = a->o.data;
    P.qs0 = a->q.stride[0], P.qs1 = a->q.stride[1], P.qs2 = a->q.stride[2];
    P.ks0 = a->k.stride[0], P.ks1 = a->k.stride[1], P.ks2 = a->k.stride[2];
    P.vs0 = a->v.stride[0], P.vs1 = a->v.stride[1], P.vs2 = a->v.stride[2];
    P.os0 = a->o.stride[0], P.os1 = a->o.stride[1], P.os2 = a->o.stride[2];
    if (nsa_present(&a->lse)) P.lse = (float *)a->lse.data, P.ls0 = a->lse.stride[0], P.ls1 = a->lse.stride[1], P.ls2 = a->lse.stride[2];
    const nsa_block_mask *m = &a->block_mask;
    if (nsa_present(&m->kv_num_blocks)) {
        P.num = (const int *)m->kv_num_blocks.data, P.idx = (const int *)m->kv_indices.data;
        P.ns0 = m->kv_num_blocks.stride[0], P.ns1 = m->kv_num_blocks.stride[1], P.ns2 = m->kv_num_blocks.stride[2];
        P.is0 = m->kv_indices.stride[0], P.is1 = m->kv_indices.stride[1], P.is2 = m->kv_indices.stride[2];
        P.is3 = m->kv_indices.stride[3];
        P.nB = m->kv_num_blocks.shape[0], P.nH = m->kv_num_blocks.shape[1];
        P.iB = m->kv_indices.shape[0], P.iH = m->kv_indices.shape[1];
        if (nsa_present(&m->full_kv_num_blocks)) {
            P.fnum = (const int *)m->full_kv_num_blocks.data, P.fidx = (const int *)m->full_kv_indices.data;
            P.fns0 = m->full_kv_num_blocks.stride[0], P.fns1 = m->full_kv_num_blocks.stride[1];
            P.fns2 = m->full_kv_num_blocks.stride[2];
            P.fis0 = m->full_kv_indices.stride[0], P.fis1 = m->full_kv_indices.stride[1], P.fis2 = m->full_kv_indices.stride[2];
            P.fis3 = m->full_kv_indices.stride[3];
            P.fnB = m->full_kv_num_blocks.shape[0], P.fnH = m->full_kv_num_blocks.shape[1];
            P.fiB = m->full_kv_indices.shape[0], P.fiH = m->full_kv_indices.shape[1];
        }
    }
    P.B = p->B, P.Tq = p->T, P.Tk = p->Tk, P.HQ = p->HQ, P.G = p->G, P.DK = p->DK, P.DV = p->DV;
    P.q_block = m->q_block, P.kv_block = m->kv_block, P.nkb = p->Tk / m->kv_block + (p->Tk % m->kv_block != 0);
    P.scale = p->scale;
    *out = P;
}


static void run_flex(grun *g, const nsa_flex_args *a)
{
    flex_cache *c = (flex_cache *)g->flex_cache;
    const nsa_problem *p = g->p;
    if (p->DK > 256 || p->DV > 256) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "q: DK %lld and DV %lld, the CUDA block-sparse kernel takes head dims up to 256",
               (long long)p->DK, (long long)p->DV);
        return;
    }
    check_mod_memory(g, a->mask_mod, "mask_mod");
    check_mod_memory(g, a->score_mod, "score_mod");
    check_lists(g, a);
    const int tc = flex_tc_fits(g, a, p);
    const int *nf = NULL;
    if (tc) { /* the flag (workspace: both passes) and the scan of V, the one operand a masked pair reads */
        const dview vv = dv_of(&a->v);
        cu_scan_nonfinite(g, &vv, p->B, p->Tk, p->H, p->DV);
        nf = g_nf_tiles(g);
    }
    if (!g_live(g)) return;
    if (!c) {
        g_fail(g, NSA_STATUS_OUT_OF_MEMORY, "ctx: no memory for the kernel cache");
        return;
    }
    const int elem = elem_of(a);
    /* on sm_90a, the Hopper kernel where its tensor maps can be made; else 64 rows a CTA sharing
     * 64-key slices where both block sizes allow, else 16 rows a warp */
    CUtensorMap maps[3];
    const int wg_bn = tc ? flex_wg_bn(g, a, p, maps) : 0;
    const int wide = wg_bn ? (wg_bn == 128 ? 3 : 2) : a->block_mask.q_block % 64 == 0 && a->block_mask.kv_block % 64 == 0;
    cudaKernel_t kk[4];
    if (!flex_kernel(g, c, a->mask_mod, a->score_mod, elem, tc ? (int)p->DK : 0, tc ? (int)p->DV : 0, wide, 0,
                     flex_idx32(p, &a->block_mask), kk))
        return;
    const cudaKernel_t k = kk[0], ktc = kk[1];
    if (tc && !ktc) return;
    flex_params P;
    params_of(a, p, &P);
    nsa_mod_caps mc, sc;
    caps_of(a->mask_mod, &mc), caps_of(a->score_mod, &sc);
    const int64_t items = p->B * p->HQ * p->T;
    if (items == 0) return;
    void *args[] = {&P, &mc, &sc, &maps[0], &maps[1], &maps[2]};
    if (wg_bn) {
        const size_t smem = flex_wg_smem(p->DK, p->DV, wg_bn);
        P.nf = nf, P.nf_role = nf ? 1 : 0;
        g_check(g, cudaFuncSetAttribute((const void *)ktc, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        if (g_live(g))
            g_check(g, cudaLaunchKernel((const void *)ktc, dim3((unsigned)(p->B * p->HQ * ((p->T + 127) / 128))), dim3(384), args,
                                        smem, g->st));
        if (!nf || !g_live(g)) return;
        P.nf_role = 2;
    } else if (tc) {
        const int64_t units = wide ? p->B * p->HQ * ((p->T + 63) / 64) : cdiv64(p->B * p->HQ * ((p->T + 15) / 16), FLEX_TC_WARPS);
        /* 64 rows of K and V a stage either way: a CTA's shared slice, or four warps' own */
        const size_t smem = (size_t)FLEX_TC_STAGES * 64 * (size_t)(p->DK + 8 + p->DV + 8) * 2;
        P.nf = nf, P.nf_role = nf ? 1 : 0;
        g_check(g, cudaFuncSetAttribute((const void *)ktc, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        if (g_live(g))
            g_check(g, cudaLaunchKernel((const void *)ktc, dim3((unsigned)units), dim3(32 * FLEX_TC_WARPS), args, smem, g->st));
        if (!nf || !g_live(g)) return;
        P.nf_role = 2; /* the scalar kernel computes the call when V holds a non-finite value */
    }
    g_check(g, cudaLaunchKernel((const void *)k, dim3(simt_grid(items)), dim3(32 * SIMT_WARPS), args, 0, g->st));
}

extern "C" size_t nsa_cuda_flex_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_args *a)
{
    return cu_op_workspace(ctx, p, run_flex, a); /* the sizing pass: only the non-finite flag is taken */
}

extern "C" nsa_status nsa_cuda_flex(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_flex, a, ws);
}

/* ---- the backward ---------------------------------------------------------------------------- */
/* A score_mod tensor's gradient from its exact accumulators: the words' carries propagated (each
 * word then holds 24 bits, the top one the sign), the sum rounded once to double and once to
 * float; +inf, -inf and NaN as an IEEE sum of the added values would give them. Written through
 * the output's strides (row-major element e of its shape). */
__global__ void flex_acc_finish(const unsigned long long *acc, int64_t n, float *out, int rank, int64_t s0, int64_t s1, int64_t s2,
                                int64_t s3, int64_t t0, int64_t t1, int64_t t2, int64_t t3)
{
    const int64_t shape[4] = {s0, s1, s2, s3}, stride[4] = {t0, t1, t2, t3};
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const unsigned long long *w = acc + e * FLEX_ACC_WORDS;
        long long word[FLEX_ACC_WORDS - 1];
        for (int i = 0; i < FLEX_ACC_WORDS - 1; i++) word[i] = (long long)w[i];
        for (int i = 0; i < FLEX_ACC_WORDS - 2; i++) { /* carry: word i into [0, 2^24) */
            const long long carry = word[i] >> 24;
            word[i] -= carry * (1ll << 24), word[i + 1] += carry;
        }
        double sum = 0.0;
        for (int i = FLEX_ACC_WORDS - 2; i >= 0; i--) sum += ldexp((double)word[i], 24 * i - 149);
        const unsigned long long special = w[FLEX_ACC_WORDS - 1];
        float r = (float)sum;
        if ((special & 4ull) || (special & 3ull) == 3ull) r = __int_as_float(0x7fc00000);
        else if (special & 1ull) r = __int_as_float(0x7f800000);
        else if (special & 2ull) r = __int_as_float((int)0xff800000u);
        int64_t off = 0, rest = e;
        for (int d = rank - 1; d >= 0; d--) off += (rest % shape[d]) * stride[d], rest /= shape[d];
        out[off] = r;
    }
}

/* Whether the tensor-core backward takes the call: the forward's conditions, and Q and dout read
 * sixteen bytes at a time too (their slices are copied like K's and V's). */
static int flex_bwd_tc_fits(const grun *g, const nsa_flex_bwd_args *a, const nsa_problem *p)
{
    if (!flex_tc_fits(g, &a->fwd, p)) return 0;
    const nsa_tensor *rows[2] = {&a->fwd.q, &a->dout};
    for (int t = 0; t < 2; t++)
        if ((uintptr_t)rows[t]->data % 16 != 0 || rows[t]->stride[0] % 8 || rows[t]->stride[1] % 8 || rows[t]->stride[2] % 8 ||
            rows[t]->stride[3] != 1)
            return 0;
    return p->B * p->H * ((p->Tk + 15) / 16) <= INT32_MAX; /* (a grid dimension, as the forward's rows) */
}

/* The transposed lists of the Hopper dk / dv walk: kinds[((b, h) of the lists' batch and head
 * extents kB, kH, key block, query block] = 1 (listed partial), 2 (listed full), 0 (not listed);
 * one thread a (b, h, query block) row of the lists, which are checked (a block listed once). */
__global__ void flex_kinds_kernel(const flex_params P, unsigned char *kinds, int64_t kB, int64_t kH, int64_t nqb)
{
    const int64_t rows = kB * kH * nqb;
    for (int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += (int64_t)gridDim.x * blockDim.x) {
        const int64_t qb = r % nqb, hh = (r / nqb) % kH, bb = r / (nqb * kH);
        unsigned char *row = kinds + (bb * kH + hh) * P.nkb * nqb + qb;
        const int *num = P.num + (P.nB == 1 ? 0 : bb) * P.ns0 + (P.nH == 1 ? 0 : hh) * P.ns1 + qb * P.ns2;
        const int *idx = P.idx + (P.iB == 1 ? 0 : bb) * P.is0 + (P.iH == 1 ? 0 : hh) * P.is1 + qb * P.is2;
        for (int e = 0; e < *num; e++) row[(int64_t)idx[e * P.is3] * nqb] = 1;
        if (!P.fnum) continue;
        num = P.fnum + (P.fnB == 1 ? 0 : bb) * P.fns0 + (P.fnH == 1 ? 0 : hh) * P.fns1 + qb * P.fns2;
        idx = P.fidx + (P.fiB == 1 ? 0 : bb) * P.fis0 + (P.fiH == 1 ? 0 : hh) * P.fis1 + qb * P.fis2;
        for (int e = 0; e < *num; e++) row[(int64_t)idx[e * P.fis3] * nqb] = 2;
    }
}

/* Whether the Hopper backward takes a call the tensor-core backward takes (its shape rules,
 * independent of the data, so the sizing pass decides alike): an sm_90 device, the sm_90a tiles
 * allowed, q and key blocks of whole 128-row tiles, every coordinate in 32 bits, and the
 * transposed lists' map (one byte a key block a query block a listed (b, h)) at most 1 GiB. */
static int flex_bwd_wg_fits(const grun *g, const nsa_flex_bwd_args *a, const nsa_problem *p, int64_t *kB, int64_t *kH)
{
    const nsa_flex_args *f = &a->fwd;
    const nsa_block_mask *m = &f->block_mask;
    *kB = *kH = 0;
    if (!flex_hopper(g)) return 0;
    if (m->q_block % 128 != 0 || m->kv_block % 128 != 0 || p->T + 256 > INT32_MAX || p->Tk + m->kv_block > INT32_MAX ||
        p->B * p->HQ * ((p->T + 127) / 128) > INT32_MAX || p->B * p->H * ((p->Tk + 127) / 128) > INT32_MAX)
        return 0;
    if (nsa_present(&m->kv_num_blocks)) {
        const int fl = nsa_present(&m->full_kv_num_blocks);
        /* (0 with no batch entry or no head: a size-1 list dim may broadcast over an empty partner) */
        const int empty = p->B == 0 || p->HQ == 0;
        *kB = empty ? 0 : m->kv_num_blocks.shape[0] > 1 || (fl && m->full_kv_num_blocks.shape[0] > 1) ? p->B : 1;
        *kH = empty ? 0 : m->kv_num_blocks.shape[1] > 1 || (fl && m->full_kv_num_blocks.shape[1] > 1) ? p->HQ : 1;
        const int64_t nqb = (p->T + m->q_block - 1) / m->q_block, nkb = (p->Tk + m->kv_block - 1) / m->kv_block;
        if ((double)*kB * (double)*kH * (double)nqb * (double)nkb > (double)(1 << 30)) return 0;
    }
    return 1;
}

/* The Hopper backward's tensor maps: Q and dout in boxes of 128 rows (dq) and 64 (dk / dv), K and
 * V in boxes of 64 (dq) and 128 (dk / dv). @return 0 when one cannot be made. */
static int flex_bwd_maps(const nsa_flex_bwd_args *a, const nsa_problem *p, CUtensorMap dq_maps[4], CUtensorMap kv_maps[4])
{
    const nsa_flex_args *f = &a->fwd;
    const dview qv = dv_of(&f->q), ov = dv_of(&a->dout), kv = dv_of(&f->k), vv = dv_of(&f->v);
    const nsa_dtype dt = f->q.dtype;
    int ok = 1;
    for (int x = 0; x < 2; x++) {
        CUtensorMap *m = x ? kv_maps : dq_maps;
        const int rows = x ? 64 : 128, keys = x ? 128 : 64;
        ok = ok && tmap_make(&m[0], &qv, dt, p->B, p->T, p->HQ, p->DK, rows) && tmap_make(&m[1], &ov, dt, p->B, p->T, p->HQ, p->DV, rows) &&
             tmap_make(&m[2], &kv, dt, p->B, p->Tk, p->H, p->DK, keys) && tmap_make(&m[3], &vv, dt, p->B, p->Tk, p->H, p->DV, keys);
    }
    return ok;
}

/* The Hopper backward's shared memory: dq (Q and dout of 128 rows, 2 stages of 64 keys of K and
 * V, 3 barriers) and dk / dv (K and V of 128 keys, 2 stages of 64 rows of Q and dout with their
 * lse and D, the stages' records, 5 barriers), each with the 1024-byte alignment's slack. */
static size_t flex_wb_smem(int64_t dk, int64_t dv, int dkdv)
{
    if (!dkdv) return (size_t)(128 * (dk + dv) * 2 + FLEX_WG_STAGES * 64 * (dk + dv) * 2) + (2 * FLEX_WG_STAGES + 1) * 8 + 1024;
    return (size_t)(128 * (dk + dv) * 2 + FLEX_WG_STAGES * (64 * (dk + dv) * 2 + 2 * 64 * 4 + 4 * 4)) + (2 * FLEX_WG_STAGES + 1) * 8 +
           1024;
}

static void run_flex_bwd(grun *g, const nsa_flex_bwd_args *a)
{
    flex_cache *c = (flex_cache *)g->flex_cache;
    const nsa_problem *p = g->p;
    const nsa_flex_args *f = &a->fwd;
    if (p->DK > 256 || p->DV > 256) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "fwd.q: DK %lld and DV %lld, the CUDA block-sparse kernel takes head dims up to 256",
               (long long)p->DK, (long long)p->DV);
        return;
    }
    check_mod_memory(g, f->mask_mod, "fwd.mask_mod");
    check_mod_memory(g, f->score_mod, "fwd.score_mod");
    check_lists(g, f);
    flex_grads R;
    memset(&R, 0, sizeof R);
    /* the rows' D (and, for the Hopper kernels, lse in log2 units) in rows of tpad: the Hopper
       kernels' layout, which the others' [B, HQ, T] fits inside */
    int64_t kB = 0, kH = 0;
    const int wg_shape = flex_bwd_tc_fits(g, a, p) && flex_bwd_wg_fits(g, a, p, &kB, &kH);
    R.tpad = (p->T + 127) / 128 * 128;
    R.D = (float *)g_take_n(g, (size_t)(p->B * p->HQ * R.tpad), sizeof(float));
    if (wg_shape) R.L2 = (float *)g_take_n(g, (size_t)(p->B * p->HQ * R.tpad), sizeof(float));
    const int64_t nqb = (p->T + f->block_mask.q_block - 1) / f->block_mask.q_block;
    const int64_t nkb = (p->Tk + f->block_mask.kv_block - 1) / f->block_mask.kv_block;
    unsigned char *kinds = NULL;
    if (wg_shape && kB > 0) kinds = (unsigned char *)g_take(g, (size_t)(kB * kH * nkb * nqb));
    flex_sink sink;
    memset(&sink, 0, sizeof sink);
    int64_t elems[NSA_MOD_MAX_TENSORS] = {0};
    const int ncap = f->score_mod ? expr_num_captures(f->score_mod) : 0;
    for (int t = 0; t < ncap; t++) { /* (validated: only float tensors of the score_mod) */
        if (!nsa_present(&a->dscore_tensors[t])) continue;
        const nsa_tensor *d = &a->dscore_tensors[t];
        elems[t] = 1;
        for (int j = 0; j < d->rank; j++) elems[t] *= d->shape[j];
        const size_t bytes = nsa_size_mul(nsa_size_of(elems[t]), FLEX_ACC_WORDS * sizeof(unsigned long long));
        sink.acc[t] = (unsigned long long *)g_take(g, bytes);
        g_zero(g, sink.acc[t], bytes);
    }
    const int tc = flex_bwd_tc_fits(g, a, p);
    if (tc) { /* the flag and the scans: a non-finite q, k, v or dout would reach, through P = 0 or dU = 0 in
                 the tiles' products, pairs that do not see it; the scalar kernels compute such a call */
        const dview vq = dv_of(&f->q), vk = dv_of(&f->k), vv = dv_of(&f->v), vo = dv_of(&a->dout);
        cu_scan_nonfinite(g, &vq, p->B, p->T, p->HQ, p->DK);
        cu_scan_nonfinite(g, &vk, p->B, p->Tk, p->H, p->DK);
        cu_scan_nonfinite(g, &vv, p->B, p->Tk, p->H, p->DV);
        cu_scan_nonfinite(g, &vo, p->B, p->T, p->HQ, p->DV);
    }
    const int *nf = tc ? g_nf_tiles(g) : NULL;
    if (!g_live(g)) return;
    if (!c) {
        g_fail(g, NSA_STATUS_OUT_OF_MEMORY, "ctx: no memory for the kernel cache");
        return;
    }
    cudaKernel_t k[4];
    /* the Hopper kernels where their maps can be made; else 64 rows (dq) or keys (dk / dv) a CTA
       sharing 64-row or 64-key slices where both block sizes allow */
    CUtensorMap dq_maps[4], kv_maps[4];
    const int hopper = wg_shape && flex_bwd_maps(a, p, dq_maps, kv_maps);
    const int wide = hopper ? 2 : f->block_mask.q_block % 64 == 0 && f->block_mask.kv_block % 64 == 0;
    if (!flex_kernel(g, c, f->mask_mod, f->score_mod, elem_of(f), tc ? (int)p->DK : 0, tc ? (int)p->DV : 0, wide, 1,
                     flex_idx32(p, &f->block_mask), k) || !k[1] ||
        (tc && (!k[2] || !k[3])))
        return;
    flex_params P;
    params_of(f, p, &P);
    R.dout = a->dout.data, R.dq = a->dq.data, R.dk = a->dk.data, R.dv = a->dv.data;
    R.dos0 = a->dout.stride[0], R.dos1 = a->dout.stride[1], R.dos2 = a->dout.stride[2];
    R.dqs0 = a->dq.stride[0], R.dqs1 = a->dq.stride[1], R.dqs2 = a->dq.stride[2];
    R.dks0 = a->dk.stride[0], R.dks1 = a->dk.stride[1], R.dks2 = a->dk.stride[2];
    R.dvs0 = a->dv.stride[0], R.dvs1 = a->dv.stride[1], R.dvs2 = a->dv.stride[2];
    for (int t = 0; t < ncap; t++) R.scatter |= sink.acc[t] != NULL;
    nsa_mod_caps mc, sc;
    caps_of(f->mask_mod, &mc), caps_of(f->score_mod, &sc);
    const int64_t rows = p->B * p->HQ * p->T, keys = p->B * p->H * p->Tk;
    void *dq_args[] = {&P, &R, &mc, &sc, &sink, &dq_maps[0], &dq_maps[1], &dq_maps[2], &dq_maps[3]};
    void *dkdv_args[] = {&P, &R, &mc, &sc, &kv_maps[0], &kv_maps[1], &kv_maps[2], &kv_maps[3]};
    /* dq first: it writes the rows' D that dk / dv read. With the tensor-core kernels, each pair of
       kernels launches and the flag lets one of them compute (no host round trip). */
    if (hopper) {
        P.nf = nf, P.nf_role = nf ? 2 : 0;
        if (kinds) { /* the transposed lists */
            R.kinds = kinds, R.kB = kB, R.kH = kH;
            g_zero(g, kinds, (size_t)(kB * kH * nkb * nqb));
            const int64_t lrows = kB * kH * nqb;
            if (g_live(g) && lrows > 0) {
                flex_kinds_kernel<<<(unsigned)(lrows / 128 + 1 < 65536 ? lrows / 128 + 1 : 65536), 128, 0, g->st>>>(P, kinds, kB, kH, nqb);
                g_launched(g);
            }
        }
        const size_t smem_dq = flex_wb_smem(p->DK, p->DV, 0), smem_kv = flex_wb_smem(p->DK, p->DV, 1);
        const int64_t dq_units = p->B * p->HQ * ((p->T + 127) / 128), kv_units = p->B * p->H * ((p->Tk + 127) / 128);
        g_check(g, cudaFuncSetAttribute((const void *)k[2], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_dq));
        if (g_live(g)) g_check(g, cudaFuncSetAttribute((const void *)k[3], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_kv));
        if (rows > 0 && g_live(g))
            g_check(g, cudaLaunchKernel((const void *)k[2], dim3((unsigned)dq_units), dim3(384), dq_args, smem_dq, g->st));
        if (rows > 0 && nf && g_live(g))
            g_check(g, cudaLaunchKernel((const void *)k[0], dim3(simt_grid(rows)), dim3(32 * SIMT_WARPS), dq_args, 0, g->st));
        if (keys > 0 && g_live(g))
            g_check(g, cudaLaunchKernel((const void *)k[3], dim3((unsigned)kv_units), dim3(384), dkdv_args, smem_kv, g->st));
        if (keys > 0 && nf && g_live(g))
            g_check(g, cudaLaunchKernel((const void *)k[1], dim3(simt_grid(keys)), dim3(32 * SIMT_WARPS), dkdv_args, 0, g->st));
    } else if (tc) {
        P.nf = nf, P.nf_role = nf ? 2 : 0;
        /* 64 rows of K and V (dq) or of Q and dout (dk / dv) a stage either way: a CTA's shared slice or
           four warps' own */
        const size_t smem_dq = (size_t)FLEX_TC_STAGES * 64 * (size_t)(p->DK + 8 + p->DV + 8) * 2;
        const size_t smem_kv = (size_t)2 * 64 * (size_t)(p->DK + 8 + p->DV + 8) * 2;
        const int64_t dq_units = wide ? p->B * p->HQ * ((p->T + 63) / 64) : cdiv64(p->B * p->HQ * ((p->T + 15) / 16), FLEX_TC_WARPS);
        const int64_t kv_units = wide ? p->B * p->H * ((p->Tk + 63) / 64) : cdiv64(p->B * p->H * ((p->Tk + 15) / 16), FLEX_TC_WARPS);
        g_check(g, cudaFuncSetAttribute((const void *)k[2], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_dq));
        if (g_live(g)) g_check(g, cudaFuncSetAttribute((const void *)k[3], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_kv));
        if (rows > 0 && g_live(g))
            g_check(g, cudaLaunchKernel((const void *)k[2], dim3((unsigned)dq_units), dim3(32 * FLEX_TC_WARPS), dq_args, smem_dq, g->st));
        if (rows > 0 && nf && g_live(g))
            g_check(g, cudaLaunchKernel((const void *)k[0], dim3(simt_grid(rows)), dim3(32 * SIMT_WARPS), dq_args, 0, g->st));
        if (keys > 0 && g_live(g))
            g_check(g, cudaLaunchKernel((const void *)k[3], dim3((unsigned)kv_units), dim3(32 * FLEX_TC_WARPS), dkdv_args, smem_kv, g->st));
        if (keys > 0 && nf && g_live(g))
            g_check(g, cudaLaunchKernel((const void *)k[1], dim3(simt_grid(keys)), dim3(32 * SIMT_WARPS), dkdv_args, 0, g->st));
    } else {
        if (rows > 0) g_check(g, cudaLaunchKernel((const void *)k[0], dim3(simt_grid(rows)), dim3(32 * SIMT_WARPS), dq_args, 0, g->st));
        if (keys > 0 && g_live(g))
            g_check(g, cudaLaunchKernel((const void *)k[1], dim3(simt_grid(keys)), dim3(32 * SIMT_WARPS), dkdv_args, 0, g->st));
    }
    for (int t = 0; t < ncap && g_live(g); t++) {
        if (!sink.acc[t]) continue;
        const nsa_tensor *d = &a->dscore_tensors[t];
        int64_t sh[4] = {1, 1, 1, 1}, st[4] = {0, 0, 0, 0};
        for (int j = 0; j < d->rank; j++) sh[j] = d->shape[j], st[j] = d->stride[j];
        const unsigned blocks = (unsigned)(elems[t] / 256 + 1 < 4096 ? elems[t] / 256 + 1 : 4096);
        flex_acc_finish<<<blocks, 256, 0, g->st>>>(sink.acc[t], elems[t], (float *)d->data, (int)d->rank, sh[0], sh[1], sh[2], sh[3],
                                                   st[0], st[1], st[2], st[3]);
        g_launched(g);
    }
}

extern "C" size_t nsa_cuda_flex_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_bwd_args *a)
{
    return cu_op_workspace(ctx, p, run_flex_bwd, a); /* the sizing pass: D and the accumulators */
}

extern "C" nsa_status nsa_cuda_flex_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_bwd_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_flex_bwd, a, ws);
}
