/* range/hopper_fwd_dq.cuh -- qwg_kernel: the sm_90a forward and dQ of the range rules
 * (compressed, window, dense), head dims 64 / 128 / 192 (DV 128): 128 query rows per CTA (row
 * = position * G + head of one kv head, as in qtile), two consumer warpgroups of 64 rows and a
 * producer warp that issues the K / V chunks (128 keys forward, 64 dQ) by TMA into full /
 * empty-mbarrier stages; scores (and dP) by wgmma SS, O += P V or dQ += dS K by wgmma RS with
 * P / dS from registers and V / K read MN-major. One CTA per SM; the forward ping-pongs its
 * warpgroups on named barriers so that one's softmax overlaps the other's products (in its PIPE
 * form each warpgroup's softmax also overlaps its own previous P V: qwg_pipe_*), and walks its
 * tasks persistently (heaviest first) from a zeroed counter. The kernel body exists only in the
 * sm_90a build. */
#ifndef NSA_CUDA_RANGE_HOPPER_FWD_DQ_CUH
#define NSA_CUDA_RANGE_HOPPER_FWD_DQ_CUH

#include "range.h"
#include "../prim/softmax.cuh"
#include "../prim/wgmma.cuh"
#include "../prim/nonfinite.cuh"

#if defined(__CUDACC__)

/* Ping-pong of the two warpgroups' products on the tensor cores, per chunk A0, A1, B0, B1
 * (A: the score products, B: the accumulating ones), so that each warpgroup's elementwise
 * work between A and B overlaps the other's products instead of both idling the tensor
 * cores at once:  X: A1 after A0;  Y: B0 after A1;  Z: B1 after B0. has_b: whether the
 * chunk has B products (uniform over the CTA). Used by the forward only: dQ and dK / dV have
 * an elementwise phase too short next to their products to gain (bench/NOTES.md). */
__device__ __forceinline__ void pp_before_a(int wg) { if (wg == 1) nb_sync(NB_PP_A); }
__device__ __forceinline__ void pp_after_a(int wg, bool has_b)
{
    if (wg == 0) nb_arrive(NB_PP_A);
    else if (has_b) nb_arrive(NB_PP_B0);
}
__device__ __forceinline__ void pp_before_b(int wg) { if (wg == 0) nb_sync(NB_PP_B0); else nb_sync(NB_PP_B1); }
__device__ __forceinline__ void pp_after_b(int wg) { if (wg == 0) nb_arrive(NB_PP_B1); }

/* One forward chunk of qwg_kernel on NW keys (the BN-key stage's first NW rows): S = Q K^T by
 * wgmma SS, masked / scaled, online softmax, O += P V by wgmma RS (P from registers, V
 * MN-major), the warpgroups' products ping-ponged (pp_*). Qw: the warpgroup's 64 rows of Q. */
template <typename T, int BN, int NW, int KT, int DA, int BM>
__device__ __forceinline__ void qwg_fwd_chunk(const qparams &P, const unsigned char *Qw, const unsigned char *Kp,
                                              const unsigned char *Vp, int wg, int has_v, int c0, int c1,
                                              const int rlo[2], const int rhi[2], int lane, float m_[2], float l_[2],
                                              float (&acc)[DA / 8][4])
{
    constexpr int NT = NW / 8;
    float S[NT][4];
    pp_before_a(wg);
    wg_fence();
    wg_ss_kmajor<T, NW, KT, BM, BN>(&S[0][0], Qw, Kp);
    wg_commit();
    pp_after_a(wg, has_v);
    wg_wait<0>();

    const float f = sc_softcap<NT>(S, P.rule, P.scale, P.sl2);
    sc_mask<NT>(S, sc_chunk_whole(c0, c1, NW, rlo, rhi), c0, c1, rlo, rhi, lane);
    sc_softmax<NT, DA / 8>(S, m_, l_, acc, f);
    if (has_v) {
        uint32_t pa[NW / 16][4];
#pragma unroll
        for (int k2 = 0; k2 < NW / 16; k2++) sc_frag_a<T>(pa[k2], S[2 * k2], S[2 * k2 + 1]);
        pp_before_b(wg);
        wg_fence();
        wg_rs_mn<T, DA, NW, BN>(&acc[0][0], pa, Vp);
        wg_commit();
        pp_after_b(wg);
        wg_wait<0>();
    }
}

/* ---- the forward with V, pipelined inside each warpgroup ------------------------------------
 * FA3's schedule: a warpgroup issues chunk j's scores S_j = Q K_j^T and chunk j - 1's O += P V
 * as one batch, then runs chunk j's softmax while its own P V and the other warpgroup's batch
 * hold the tensor cores. The two warpgroups take turns to issue their batches (pp_turn_*), so
 * their softmaxes fall under each other's products. O's rescale by a chunk's softmax factor
 * waits for the next batch (its registers belong to the running P V until then). K and V of a
 * stage have barriers of their own (K at full / empty [st], V at [NS + st]): K is released
 * once its scores are done, a chunk before V. Every product is BN keys wide (a task's last
 * chunk masks its keys past the task's range). */
__device__ __forceinline__ void pp_turn_wait(int wg) { nb_sync(NB_PP_TURN0 + wg); }
__device__ __forceinline__ void pp_turn_pass(int wg) { nb_arrive(NB_PP_TURN0 + (wg ^ 1)); }

/* The pipelined forward's state: the chunk in flight's scores / probabilities and factors. */
template <int BN> struct qwg_pipe {
    float S[BN / 8][4];
    uint32_t pa[BN / 16][4]; /* the previous chunk's P, the A fragments of its P V */
    float alpha[2];          /* its softmax factors, for O before that P V */
};

/* Chunk j's scores (keys c0 .. c1 - 1) in pp.S masked, scaled and through the online softmax;
 * pp.alpha its factors. Called once the scores landed. */
template <int BN>
__device__ __forceinline__ void qwg_pipe_softmax(const qparams &P, qwg_pipe<BN> &pp, int c0, int c1, const int rlo[2],
                                                 const int rhi[2], int lane, float m_[2], float l_[2])
{
    const float f = sc_softcap<BN / 8>(pp.S, P.rule, P.scale, P.sl2);
    sc_mask<BN / 8>(pp.S, sc_chunk_whole(c0, c1, BN, rlo, rhi), c0, c1, rlo, rhi, lane);
    sc_softmax_rows<BN / 8>(pp.S, m_, l_, pp.alpha, f);
}
template <typename T, int BN> __device__ __forceinline__ void qwg_pipe_pack(qwg_pipe<BN> &pp)
{
#pragma unroll
    for (int k2 = 0; k2 < BN / 16; k2++) sc_frag_a<T>(pp.pa[k2], pp.S[2 * k2], pp.S[2 * k2 + 1]);
}

/* A task's first chunk: its scores alone (no P V before it). */
template <typename T, int BN, int KT, int BM>
__device__ __forceinline__ void qwg_pipe_first(const qparams &P, qwg_pipe<BN> &pp, const unsigned char *Qw,
                                               const unsigned char *Kp, uint64_t *k_empty, int wg, int c0, int c1,
                                               const int rlo[2], const int rhi[2], int lane, float m_[2], float l_[2])
{
    pp_turn_wait(wg);
    wg_fence();
    wg_ss_kmajor<T, BN, KT, BM, BN>(&pp.S[0][0], Qw, Kp);
    wg_commit();
    pp_turn_pass(wg);
    wg_wait<0>();
    mb_arrive(k_empty); /* this thread's reads of K are done */
    qwg_pipe_softmax<BN>(P, pp, c0, c1, rlo, rhi, lane, m_, l_);
    qwg_pipe_pack<T, BN>(pp);
}

/* Chunk j (keys c0 .. c1 - 1, K at Kp) after chunk j - 1 (its V at Vprev): S_j and O += P_{j-1} V_{j-1}
 * in one batch, then S_j's softmax under the P V. */
template <typename T, int BN, int KT, int DA, int BM>
__device__ __forceinline__ void qwg_pipe_next(const qparams &P, qwg_pipe<BN> &pp, const unsigned char *Qw,
                                              const unsigned char *Kp, const unsigned char *Vprev, uint64_t *k_empty,
                                              uint64_t *v_empty_prev, int wg, int c0, int c1, const int rlo[2],
                                              const int rhi[2], int lane, float m_[2], float l_[2],
                                              float (&acc)[DA / 8][4])
{
    pp_turn_wait(wg);
    wg_fence();
    wg_ss_kmajor<T, BN, KT, BM, BN>(&pp.S[0][0], Qw, Kp);
    wg_commit();
    sc_rescale<DA / 8>(acc, pp.alpha);
    wg_fence();
    wg_rs_mn<T, DA, BN, BN>(&acc[0][0], pp.pa, Vprev);
    wg_commit();
    pp_turn_pass(wg);
    wg_wait<1>(); /* the scores */
    mb_arrive(k_empty);
    qwg_pipe_softmax<BN>(P, pp, c0, c1, rlo, rhi, lane, m_, l_);
    wg_wait<0>(); /* the P V: pa and V_{j-1} free */
    mb_arrive(v_empty_prev);
    qwg_pipe_pack<T, BN>(pp);
}

/* The task's last P V. */
template <typename T, int BN, int DA>
__device__ __forceinline__ void qwg_pipe_last(qwg_pipe<BN> &pp, const unsigned char *Vp, uint64_t *v_empty, int wg,
                                              float (&acc)[DA / 8][4])
{
    pp_turn_wait(wg);
    sc_rescale<DA / 8>(acc, pp.alpha);
    wg_fence();
    wg_rs_mn<T, DA, BN, BN>(&acc[0][0], pp.pa, Vp);
    wg_commit();
    pp_turn_pass(wg);
    wg_wait<0>();
    mb_arrive(v_empty);
}

/* A task's chunks pipelined: n chunks of BN keys from kmin (the last one's keys to kmax, the
 * rest masked); ci0 counts the chunks before it (the stages' index and phase). The previous
 * task's O stores (store_qb) are released under the first chunk. */
template <typename T, int BN, int KT, int DA, int BM, int NS, int KB, int VB>
__device__ __forceinline__ void qwg_pipe_task(const qparams &P, int kmin, int kmax, int n, int ci0,
                                              const unsigned char *Qw, const unsigned char *Ks,
                                              const unsigned char *Vs, uint64_t *full, uint64_t *empty,
                                              uint64_t *qempty, int &store_qb, int wg, const int rlo[2],
                                              const int rhi[2], int lane, float m_[2], float l_[2],
                                              float (&acc)[DA / 8][4])
{
    qwg_pipe<BN> pp;
    const int cl1 = kmax + 1; /* the last chunk's end */
    int st = ci0 % NS, ph = (ci0 / NS) & 1; /* chunk j's stage and phase */
    mb_wait(&full[st], ph);
    qwg_pipe_first<T, BN, KT, BM>(P, pp, Qw, Ks + st * KB, &empty[st], wg, kmin, n == 1 ? cl1 : kmin + BN, rlo, rhi, lane,
                                  m_, l_);
    if (store_qb >= 0) {
        tma_store_wait_read();
        mb_arrive(&qempty[store_qb]);
        store_qb = -1;
    }
    for (int j = 1; j < n; j++) {
        const int sp = st, pph = ph; /* chunk j - 1's */
        st = (ci0 + j) % NS, ph = ((ci0 + j) / NS) & 1;
        mb_wait(&full[st], ph);
        mb_wait(&full[NS + sp], pph);
        const int c0 = kmin + j * BN;
        qwg_pipe_next<T, BN, KT, DA, BM>(P, pp, Qw, Ks + st * KB, Vs + sp * VB, &empty[st], &empty[NS + sp], wg, c0,
                                         j < n - 1 ? c0 + BN : cl1, rlo, rhi, lane, m_, l_, acc);
    }
    mb_wait(&full[NS + st], ph);
    qwg_pipe_last<T, BN, DA>(pp, Vs + st * VB, &empty[NS + st], wg, acc);
}

/* One task of qwg_kernel: 128 rows (position * G + head) of one kv head of one sequence and
 * the chunks of keys they see. Task order: kv head major, then the sequence map's tiles
 * (heaviest first: latest positions, longest causal ranges). */
struct qwg_task {
    seqinfo sq;
    int h, g0, nrows, nkeys, kmin, kmax, nchunks;
    int64_t r0, pos0; /* first row; row r0 + r is head (g0 + r) % G of position pos0 + (g0 + r) / G */
};
static_assert(sizeof(qwg_task) <= QWG_TASK_BYTES, "qwg_smem's room for the task records");

template <int BM, int BN>
__device__ __forceinline__ qwg_task qwg_task_of(const qparams &P, int64_t task)
{
    qwg_task t;
    int64_t s, tile;
    t.h = (int)(task / P.tiles);
    seq_decode(P.sm, task - (int64_t)t.h * P.tiles, &s, &tile);
    t.sq = seq_get(P.sm, s);
    const int64_t G = P.G;
    const int64_t nrow_all = (int64_t)t.sq.len * G;
    tile = (nrow_all + BM - 1) / BM - 1 - tile;
    t.r0 = tile * BM;
    t.nrows = (int)(nrow_all - t.r0 < BM ? nrow_all - t.r0 : BM);
    t.pos0 = t.r0 / G; /* one 64-bit division per task, 32-bit ones per row */
    t.g0 = (int)(t.r0 - t.pos0 * G);
    t.nkeys = rule_nkeys(P.rule, t.sq);
    t.kmin = 0, t.kmax = -1;
    if (t.nrows > 0) {
        int lo0, hi0, lo1, hi1;
        rule_bounds(P.rule, (int)t.pos0, t.nkeys, &lo0, &hi0);
        rule_bounds(P.rule, (int)t.pos0 + (t.g0 + t.nrows - 1) / (int)G, t.nkeys, &lo1, &hi1);
        t.kmin = lo0;
        t.kmax = hi1;
    }
    t.nchunks = t.kmax >= t.kmin ? (t.kmax - t.kmin) / BN + 1 : 0;
    return t;
}

/* Shared memory of qwg_kernel<DKP, DVP, MODE>: byte offsets from the 1024-aligned base in carving
 * order; the host reserves bytes + 1024 of alignment slack (qwg_smem, checked below). */
template <int DKP, int DVP, int MODE> struct qwg_layout {
    static constexpr size_t NQ = QWG_NQ(MODE, DKP), NS = QWG_NS(MODE), BM = QWG_BM, BN = QWG_BN(MODE);
    static constexpr size_t QB = BM * DKP * 2, OB = BM * DVP * 2, KB = BN * DKP * 2, VB = BN * DVP * 2; /* tile bytes */
    static constexpr size_t q = 0;                                     /* [NQ] Q tiles */
    static constexpr size_t o = q + NQ * QB;                           /* dO tile (dQ mode) */
    static constexpr size_t k = o + (MODE == MODE_DQ ? OB : 0);        /* [NS] K stages */
    static constexpr size_t v = k + NS * KB;                           /* [NS] V stages */
    static constexpr size_t roff = v + NS * VB;                        /* [BM] q row offsets */
    static constexpr size_t roff2 = roff + BM * sizeof(int64_t);       /* [BM] dout row offsets (dQ mode) */
    /* K / V chunk landed, both warpgroups done with the stage: [NS] for K and V together, or
     * (the forward with V) [NS] for K and [NS] more for V */
    static constexpr size_t full = roff2 + BM * sizeof(int64_t);       /* [2 NS] */
    static constexpr size_t empty = full + 2 * NS * sizeof(uint64_t);  /* [2 NS] */
    static constexpr size_t qfull = empty + 2 * NS * sizeof(uint64_t); /* [NQ] Q's box landed */
    static constexpr size_t qempty = qfull + NQ * sizeof(uint64_t);    /* [NQ] both warpgroups done with the Q buffer */
    static constexpr size_t task = qempty + NQ * sizeof(uint64_t);     /* [NQ] the task whose Q is in the buffer */
    static constexpr size_t bytes = task + NQ * QWG_TASK_BYTES;
    static_assert(bytes + 1024 == qwg_smem(DKP, DVP, MODE), "qwg_smem reserves exactly this layout");
};

template <int DKP, int DVP, typename T, int MODE, bool PIPE = false>
__global__ void __launch_bounds__(384, 1) qwg_kernel(const qparams P, const __grid_constant__ CUtensorMap tk,
                                                     const __grid_constant__ CUtensorMap tv,
                                                     const __grid_constant__ CUtensorMap tq,
                                                     const __grid_constant__ CUtensorMap to) /* dQ: dO's */
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if (nf_set(P.nf)) return; /* a non-finite input: the scalar kernels run this call (nonfinite.cuh) */
    constexpr int BM = QWG_BM, BN = QWG_BN(MODE), NT = BN / 8, KT = DKP / 16, VT = DVP / 16, NTHR = 256, NS = QWG_NS(MODE);
    constexpr int NQ = QWG_NQ(MODE, DKP); /* Q buffers: the next task's Q lands during this one */
    /* the accumulator: O [64 x DV] (forward) or dQ [64 x DK] per warpgroup */
    constexpr int DA = MODE == MODE_DQ ? DKP : DVP;
    constexpr int QB = BM * DKP * 2, OB = BM * DVP * 2, KB = BN * DKP * 2, VB = BN * DVP * 2; /* tile bytes */
    constexpr bool DQ = MODE == MODE_DQ;
    using L = qwg_layout<DKP, DVP, MODE>;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_align1024(smem_raw);
    unsigned char *Qall = smem + L::q;
    unsigned char *Os = smem + L::o;
    unsigned char *Ks = smem + L::k;
    unsigned char *Vs = smem + L::v;
    int64_t *roff = (int64_t *)(smem + L::roff);
    int64_t *roff2 = (int64_t *)(smem + L::roff2);
    uint64_t *full = (uint64_t *)(smem + L::full);
    uint64_t *empty = (uint64_t *)(smem + L::empty);
    uint64_t *qfull = (uint64_t *)(smem + L::qfull);   /* (P.qbox) */
    uint64_t *qempty = (uint64_t *)(smem + L::qempty);
    qwg_task *qtask = (qwg_task *)(smem + L::task);    /* (P.qbox) */

    /* warpgroup 0: the producer (one warp issues the Q and K / V boxes); warpgroups 1, 2: the
     * consumers, 64 rows each (wg, warp, tid below count the consumers from 0). The CTA walks
     * tasks blockIdx.x, + gridDim.x, ...: one each when the grid covers them; or, persistent
     * (P.dyn: one CTA per SM), blockIdx.x and then the next unclaimed task of a counter, in
     * order (heaviest first), handed to the consumers with the Q buffer, a record with h < 0
     * ending the walk. The producer runs ahead across tasks: the chunk count ci and the task
     * count it, over the whole walk, give the stages' and Q buffers' phases. */
    const int wg_all = threadIdx.x >> 7;
    const int tid = (int)threadIdx.x - 128, warp = tid >> 5, lane = threadIdx.x & 31, wg = warp >> 2;
    const int64_t G = P.G;
    const int G32 = (int)G;
    /* Q (and dO) by TMA (the producer's boxes) and O by TMA (each warpgroup's 64 rows when they
     * are whole positions of the sequence): the forward's per-task prologue and epilogue were
     * 40% of a 512-key window task when the consumers loaded Q and stored O themselves */
    const bool qbox = P.qbox;
    const int is_cmp = P.rule.kind == RULE_CMP;
    const int has_v = DQ || P.v.p != nullptr;
    /* the forward with V runs pipelined (qwg_pipe_*): K and V of a stage on barriers of their own */
    const bool kv_split = PIPE && !DQ && has_v;

    if (threadIdx.x == 0) {
        for (int i = 0; i < 2 * NS; i++) {
            mb_init(&full[i], 1);
            mb_init(&empty[i], NTHR);
        }
        for (int i = 0; i < NQ; i++) {
            mb_init(&qfull[i], 1);
            mb_init(&qempty[i], NTHR);
        }
        mb_init_fence();
    }
    __syncthreads(); /* barriers initialised */

    /* K / V chunks by TMA (the host's maps over the key views) into NS stages: the producer
     * warp issues a chunk's boxes once both consumer warpgroups released its stage (empty),
     * the consumers wait for its bytes (full); no CTA barrier per chunk. Keys past kmax
     * inside the tensor arrive as they are (masked: P = 0), past its end as zeros. */
    if (wg_all == 0) {
        regs_dec<WS_PREGS>();
        if (threadIdx.x != 0) return;
        int ci = 0, it = 0;
        for (int64_t task = blockIdx.x;; it++) {
            const bool done = task >= P.tasks;
            if (done && !P.dyn) break;
            qwg_task t = {};
            if (!done) t = qwg_task_of<BM, BN>(P, task);
            else t.h = -1;
            const int64_t key_row0 = is_cmp ? t.sq.cmp0 : t.sq.row0;
            if (qbox) { /* 128 / G positions x G heads: rows past the tensor land as zeros */
                const int qb = it % NQ;
                if (it >= NQ) mb_wait_sleep(&qempty[qb], ((it / NQ) & 1) ^ 1);
                qtask[qb] = t; /* for the consumers, who see it once the phase completes */
                if (done) { /* the end of a persistent walk */
                    mb_arrive(&qfull[qb]);
                    break;
                }
                mb_expect(&qfull[qb], QB + (DQ ? OB : 0));
#pragma unroll
                for (int cb = 0; cb < DKP / 64; cb++)
                    tma_load4(Qall + qb * QB + cb * BM * 128, &tq, cb * 64, t.h * G32, (int)(t.sq.row0 + t.pos0),
                              (int)t.sq.b, &qfull[qb]);
                if (DQ)
#pragma unroll
                    for (int cb = 0; cb < DVP / 64; cb++)
                        tma_load4(Os + cb * BM * 128, &to, cb * 64, t.h * G32, (int)(t.sq.row0 + t.pos0), (int)t.sq.b,
                                  &qfull[qb]);
            }
            for (int c = 0; c < t.nchunks; c++, ci++) {
                const int st = ci % NS, c0 = t.kmin + c * BN, vst = kv_split ? NS + st : st;
                if (ci >= NS) mb_wait_sleep(&empty[st], ((ci / NS) & 1) ^ 1);
                mb_expect(&full[st], KB + (has_v && !kv_split ? VB : 0));
#pragma unroll
                for (int cb = 0; cb < DKP / 64; cb++)
                    tma_load4(Ks + st * KB + cb * BN * 128, &tk, cb * 64, t.h, (int)(key_row0 + c0), (int)t.sq.b, &full[st]);
                if (kv_split) {
                    if (ci >= NS) mb_wait_sleep(&empty[vst], ((ci / NS) & 1) ^ 1);
                    mb_expect(&full[vst], VB);
                }
                if (has_v)
#pragma unroll
                    for (int cb = 0; cb < DVP / 64; cb++)
                        tma_load4(Vs + st * VB + cb * BN * 128, &tv, cb * 64, t.h, (int)(key_row0 + c0), (int)t.sq.b,
                                  &full[vst]);
            }
            task = P.dyn ? (int64_t)atomicAdd(P.ctr, 1) + gridDim.x : task + gridDim.x;
        }
        return;
    }
    regs_inc<WS_CREGS>();
    if (kv_split && wg == 1) pp_turn_pass(1); /* warpgroup 0 issues first */
    int ci = 0, it = 0;
    /* the Q buffer whose O this thread's TMA stores still read: with two buffers, released
     * under the next task's first chunk instead of waiting for the reads at the task's end */
    int store_qb = -1;
    for (int64_t task = blockIdx.x;; task += gridDim.x, it++) {
        if (!P.dyn && task >= P.tasks) break;
        const int qb = it % NQ;
        /* with two Q buffers the producer runs a task ahead and hands over its record; with one
         * the consumers work it out themselves and start their row loads before Q lands */
        constexpr bool ahead = NQ > 1;
        if (qbox && ahead) mb_wait(&qfull[qb], (it / NQ) & 1); /* Q and its task landed */
        if (P.dyn && qtask[qb].h < 0) break; /* (P.dyn: qbox and two buffers) */
        const qwg_task t = qbox && ahead ? qtask[qb] : qwg_task_of<BM, BN>(P, task);
        const seqinfo sq = t.sq;
        const int h = t.h, nrows = t.nrows, g0 = t.g0;
        const int64_t pos0 = t.pos0;
        unsigned char *Qs = Qall + qb * QB;

        /* this lane's two rows: lane / 4 and lane / 4 + 8 of its warp's 16 */
        int rlo[2], rhi[2];
        float rl2[2], rD[2], rg[2];
#pragma unroll
        for (int x = 0; x < 2; x++) {
            const int r = warp * 16 + (lane >> 2) + x * 8;
            rlo[x] = 1, rhi[x] = 0, rl2[x] = INFINITY, rD[x] = 0.0f, rg[x] = 1.0f;
            if (r < nrows) {
                const int pos = (int)pos0 + (g0 + r) / G32, g = (g0 + r) % G32;
                rule_bounds(P.rule, pos, t.nkeys, &rlo[x], &rhi[x]);
                if (DQ) {
                    const int64_t flat = (sq.b * P.T + sq.row0 + pos) * P.HQ + h * G + g;
                    const float lse = ((const float *)P.lse.p)[sq.b * P.lse.s0 + (sq.row0 + pos) * P.lse.s1 + (h * G + g) * P.lse.s2];
                    rl2[x] = lse == -INFINITY ? INFINITY : lse * NSA_LOG2E;
                    rD[x] = P.Dw[flat];
                    rg[x] = P.gw ? P.gw[flat] : 1.0f;
                }
            }
        }

        if (qbox) {
            if (!ahead) mb_wait(&qfull[qb], (it / NQ) & 1);
        } else { /* Q (and dO), gathered rows, by the consumers' cp.async */
            if (it > 0) nb_sync(NB_TASK); /* both warpgroups done with the previous task's Q and rows */
            for (int r = tid; r < BM; r += NTHR) {
                int64_t off = -1, off2 = -1;
                if (r < nrows) {
                    const int64_t pos = pos0 + (g0 + r) / G32, g = (g0 + r) % G32;
                    off = sq.b * P.q.s0 + (sq.row0 + pos) * P.q.s1 + (h * G + g) * P.q.s2;
                    if (DQ) off2 = sq.b * P.dout.s0 + (sq.row0 + pos) * P.dout.s1 + (h * G + g) * P.dout.s2;
                }
                roff[r] = off;
                if (DQ) roff2[r] = off2;
            }
            nb_sync(NB_TASK); /* roff written */
            sw_load_rows<T, DKP, BM, NTHR>(Qs, (const T *)P.q.p, roff, tid);
            if (DQ) sw_load_rows<T, DVP, BM, NTHR>(Os, (const T *)P.dout.p, roff2, tid);
            cp_commit();
            cp_wait<0>();
            fence_async_smem();
            nb_sync(NB_TASK); /* Q (dO) visible to both warpgroups' tensor cores */
        }

        /* forward: O [64 x DV] per warpgroup; dQ: dQ [64 x DK] */
        float acc[DA / 8][4];
#pragma unroll
        for (int i = 0; i < DA / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
        float m_[2] = {-INFINITY, -INFINITY}, l_[2] = {0.0f, 0.0f};
        /* this warpgroup's 64 rows of Q (and dO): at row offset wg * 64 in every column block */
        const unsigned char *Qw = Qs + wg * 64 * 128;
        const unsigned char *Ow = Os + wg * 64 * 128;

        /* the forward with V pipelined, where the last chunk's full-width products cost little
         * (a short last chunk takes products of its width on the path below) */
        bool pipe = false;
        if constexpr (!DQ && PIPE) {
            const int wl = (t.kmax + 1 - t.kmin) - (t.nchunks - 1) * BN; /* the last chunk's keys */
            pipe = kv_split && t.nchunks > 0 && (wl > 64 || t.nchunks >= QWG_PIPE_MIN_CHUNKS);
            if (pipe) {
                qwg_pipe_task<T, BN, KT, DA, BM, NS, KB, VB>(P, t.kmin, t.kmax, t.nchunks, ci, Qw, Ks, Vs, full, empty,
                                                             qempty, store_qb, wg, rlo, rhi, lane, m_, l_, acc);
                ci += t.nchunks;
            }
        }
        for (int c = 0; c < (pipe ? 0 : t.nchunks); c++, ci++) {
            const int st = ci % NS;
            const int c0 = t.kmin + c * BN, c1 = c0 + BN < t.kmax + 1 ? c0 + BN : t.kmax + 1;
            mb_wait(&full[st], (ci / NS) & 1); /* the chunk landed */
            if (kv_split) mb_wait(&full[NS + st], (ci / NS) & 1); /* (its V on a barrier of its own) */
            const unsigned char *Kp = Ks + st * KB;
            const unsigned char *Vp = Vs + st * VB;
            if constexpr (!DQ) {
                /* a short chunk takes products of its width: a window tile of p positions sees
                 * 511 + p keys, four chunks and p - 1 (16 positions at G = 8 .. 64 at G = 2) */
                const int w = c1 - c0;
                if (w <= 16)
                    qwg_fwd_chunk<T, BN, 16, KT, DA, BM>(P, Qw, Kp, Vp, wg, has_v, c0, c1, rlo, rhi, lane, m_, l_, acc);
                else if (w <= 32)
                    qwg_fwd_chunk<T, BN, 32, KT, DA, BM>(P, Qw, Kp, Vp, wg, has_v, c0, c1, rlo, rhi, lane, m_, l_, acc);
                else if (w <= 64)
                    qwg_fwd_chunk<T, BN, 64, KT, DA, BM>(P, Qw, Kp, Vp, wg, has_v, c0, c1, rlo, rhi, lane, m_, l_, acc);
                else
                    qwg_fwd_chunk<T, BN, BN, KT, DA, BM>(P, Qw, Kp, Vp, wg, has_v, c0, c1, rlo, rhi, lane, m_, l_, acc);
            } else {
                /* S = Q K^T and dP = dO V^T */
                float S[NT][4];
                float dP[NT][4];
                wg_fence();
                wg_ss_kmajor<T, BN, KT, BM, BN>(&S[0][0], Qw, Kp);
                wg_ss_kmajor<T, BN, VT, BM, BN>(&dP[0][0], Ow, Vp);
                wg_commit();
                wg_wait<0>();

                const float f = sc_softcap<NT>(S, P.rule, P.scale, P.sl2);
                sc_mask<NT>(S, sc_chunk_whole(c0, c1, BN, rlo, rhi), c0, c1, rlo, rhi, lane);
                /* P from the saved lse; dS = P (g dP - D) (times the softcap's factor) */
                if (P.rule.cap > 0.0f) {
                    const float ic2 = sc_capbw_of(P.rule, P.scale).ic2;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            S[nt][e] = ex2(__fmaf_rn(S[nt][e], f, -rl2[e >> 1])) *
                                       (dP[nt][e] * rg[e >> 1] - rD[e >> 1]) * sc_cap_grad(S[nt][e], ic2);
                } else {
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            S[nt][e] = ex2(__fmaf_rn(S[nt][e], f, -rl2[e >> 1])) * (dP[nt][e] * rg[e >> 1] - rD[e >> 1]);
                }
                /* dQ += dS K: the A fragments from S (its accumulator layout is the A-fragment layout) */
                uint32_t pa[BN / 16][4];
#pragma unroll
                for (int k2 = 0; k2 < BN / 16; k2++) sc_frag_a<T>(pa[k2], S[2 * k2], S[2 * k2 + 1]);
                wg_fence();
                wg_rs_mn<T, DA, BN, BN>(&acc[0][0], pa, Kp);
                wg_commit();
                wg_wait<0>();
            }
            mb_arrive(&empty[st]); /* this thread's reads of the stage are done */
            if (kv_split) mb_arrive(&empty[NS + st]);
            if (store_qb >= 0) { /* the previous task's O stores */
                tma_store_wait_read();
                mb_arrive(&qempty[store_qb]);
                store_qb = -1;
            }
        }

        /* epilogue: O into this warpgroup's rows of the Q buffer (its last product that read
         * them is done), then one TMA box per 64 columns; else per-thread stores as qtile's */
        const bool obox = !DQ && P.obox && P.o.p && wg * 64 + 64 <= nrows;
#pragma unroll
        for (int x = 0; x < 2; x++) {
            const int r = warp * 16 + (lane >> 2) + x * 8;
            const float l = sc_quad_sum(l_[x]);
            if (r >= nrows) continue;
            const int64_t pos = pos0 + (g0 + r) / G32, g = (g0 + r) % G32, hq = h * G + g;
            if constexpr (DQ) {
                if (P.dqo.p) { /* the only term of dq: written once, in its own dtype */
                    const int64_t qo = sq.b * P.dqo.s0 + (sq.row0 + pos) * P.dqo.s1 + hq * P.dqo.s2;
#pragma unroll
                    for (int d = 0; d < DA / 8; d++) {
                        const int col = d * 8 + 2 * (lane & 3);
                        const float a0 = acc[d][2 * x] * P.scale, a1 = acc[d][2 * x + 1] * P.scale;
                        if (P.dqo.dt == NSA_DTYPE_F32) *(float2 *)((float *)P.dqo.p + qo + col) = make_float2(a0, a1);
                        else *(uint32_t *)((T *)P.dqo.p + qo + col) = dtraits<T>::pack(a0, a1);
                    }
                    continue;
                }
                float *dq = P.dq + ((sq.b * P.T + sq.row0 + pos) * P.HQ + hq) * P.DK;
#pragma unroll
                for (int d = 0; d < DA / 8; d++) {
                    float2 *q2 = (float2 *)(dq + d * 8 + 2 * (lane & 3));
                    const float2 o = *q2;
                    *q2 = make_float2(o.x + acc[d][2 * x] * P.scale, o.y + acc[d][2 * x + 1] * P.scale);
                }
                continue;
            }
            float lse;
            /* the tiles walk the union of the rows' ranges: a row with a range saw a key (under
             * flex_rows, one whose scores were all -inf saw none) */
            const int seen = rlo[x] <= rhi[x] && !(P.rule.flex_rows && l == 0.0f);
            const float inv = sc_row_finish(m_[x], l, seen, P.rule.sinks, P.rule.sinks_s, hq, &lse);
            sc_row_clear(acc, x, seen);
            if (obox) {
                /* 4 bytes of row r in its swizzled 16-byte chunk: the warp's 8 rows x 16 bytes
                 * fall in 8 different chunk slots (no bank conflicts) */
#pragma unroll
                for (int d = 0; d < DA / 8; d++)
                    *(uint32_t *)(Qs + (d >> 3) * BM * 128 + r * 128 + (((d & 7) ^ (r & 7)) << 4) + (lane & 3) * 4) =
                        dtraits<T>::pack(acc[d][2 * x] * inv, acc[d][2 * x + 1] * inv);
            } else if (P.o.p) {
                const int64_t ob = sq.b * P.o.s0 + (sq.row0 + pos) * P.o.s1 + hq * P.o.s2;
                if (P.o.dt == NSA_DTYPE_F32) {
#pragma unroll
                    for (int d = 0; d < DA / 8; d++) {
                        const int col = d * 8 + 2 * (lane & 3);
                        *(float2 *)((float *)P.o.p + ob + col) = make_float2(acc[d][2 * x] * inv, acc[d][2 * x + 1] * inv);
                    }
                } else {
#pragma unroll
                    for (int d = 0; d < DA / 8; d++) {
                        const int col = d * 8 + 2 * (lane & 3);
                        *(uint32_t *)((T *)P.o.p + ob + col) = dtraits<T>::pack(acc[d][2 * x] * inv, acc[d][2 * x + 1] * inv);
                    }
                }
            }
            if ((lane & 3) == 0 && P.lse.p)
                ((float *)P.lse.p)[sq.b * P.lse.s0 + (sq.row0 + pos) * P.lse.s1 + hq * P.lse.s2] = lse;
        }
        if (obox) {
            fence_async_smem(); /* this thread's O writes -> the copy engine */
            nb_sync_wg(NB_WG0 + wg);
            if ((tid & 127) == 0) {
#pragma unroll
                for (int cb = 0; cb < DVP / 64; cb++)
                    tma_store4(&to, Qs + cb * BM * 128 + wg * 64 * 128, cb * 64, h * G32,
                               (int)(sq.row0 + pos0 + (g0 + wg * 64) / G32), (int)sq.b);
                tma_store_commit();
                if (NQ > 1) {
                    if (store_qb >= 0) { /* (a task without chunks left it pending) */
                        tma_store_wait_read();
                        mb_arrive(&qempty[store_qb]);
                    }
                    store_qb = qb;
                } else {
                    tma_store_wait_read(); /* before the producer may load the next Q */
                }
            }
        }
        if (store_qb >= 0 && store_qb != qb) {
            /* an earlier task's stores still pending (this task had no chunk and stored nothing):
             * released now, or the producer could wait on that buffer for the task after next
             * while this thread waits on the producer */
            tma_store_wait_read();
            mb_arrive(&qempty[store_qb]);
            store_qb = -1;
        }
        if (qbox && store_qb != qb) mb_arrive(&qempty[qb]); /* this thread is done with the Q buffer */
    }
    if (kv_split && wg == 0) pp_turn_wait(0); /* warpgroup 1's last pass: every turn taken */
    if (store_qb >= 0) tma_store_wait_read(); /* the CTA's shared memory outlives the stores' reads */
#endif
}

/* ---- launcher ---- */

template <int DKP, int DVP, typename T, int MODE, bool PIPE>
static void launch_qwg_k(grun *g, const qparams *P, int64_t tiles, const void *maps)
{
    const size_t smem = qwg_layout<DKP, DVP, MODE>::bytes + 1024;
    g_smem_optin(g, (const void *)qwg_kernel<DKP, DVP, T, MODE, PIPE>, smem);
    if (g->err != NSA_STATUS_SUCCESS) return;
    const CUtensorMap *m = (const CUtensorMap *)maps;
    qparams Pl = *P;
    Pl.tiles = tiles;
    Pl.tasks = tiles * P->H;
    /* persistent (one CTA per SM, tasks claimed from the zeroed counter P->ctr in order, the
     * heaviest first) in the forward with Q by TMA into two buffers */
    int64_t grid = Pl.tasks;
    Pl.dyn = MODE == MODE_FWD && QWG_NQ(MODE, DKP) == 2 && P->qbox && P->ctr;
    if (Pl.dyn) {
        int dev = 0, sms = 0;
        g_check(g, cudaGetDevice(&dev));
        g_check(g, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
        if (sms > 0 && grid > sms) grid = sms;
    }
    if (g->err != NSA_STATUS_SUCCESS || grid > INT32_MAX) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "q: %lld tasks exceed the CUDA grid limit", (long long)grid);
        return;
    }
    qwg_kernel<DKP, DVP, T, MODE, PIPE><<<(unsigned)grid, 384, smem, g->st>>>(Pl, m[QWG_MAP_K], m[QWG_MAP_V],
                                                                              m[QWG_MAP_Q], m[QWG_MAP_O]);
    g_launched(g);
}

/* the forward with V pipelined inside each warpgroup where the planner chose it (P->pipe) */
template <int DKP, int DVP, typename T, int MODE>
static void launch_qwg_t(grun *g, const qparams *P, int64_t tiles, const void *maps)
{
    if (MODE == MODE_FWD && P->pipe) launch_qwg_k<DKP, DVP, T, MODE_FWD, true>(g, P, tiles, maps);
    else launch_qwg_k<DKP, DVP, T, MODE, false>(g, P, tiles, maps);
}

/* Whether this binary carries the sm_90a body of qwg_kernel<DP> for the current device (not
 * a PTX JIT of the sm_80 build, where the body is empty). */
template <int DKP, int DVP>
static int qwg_ready_t()
{
    cudaFuncAttributes a;
    if (cudaFuncGetAttributes(&a, qwg_kernel<DKP, DVP, __nv_bfloat16, MODE_FWD>) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return a.binaryVersion == 90 && a.ptxVersion >= 90;
}

#endif /* __CUDACC__ */

#endif
