/* hopper.cuh -- the sm_90a tiles: wgmma (warpgroup tensor-core products with operands in
 * shared memory) and TMA (tensor-map bulk copies completing on mbarriers) instead of mma.sync
 * and per-thread cp.async. Primitives (swizzled loaders, descriptors, fences, TMA, mbarriers)
 * in wgmma.cuh; the tensor maps are encoded on the host (branches.cu tmap_make).
 *
 *   qwg_kernel  forward and dQ of the contiguous-range rules (compressed, window, dense), head
 *               dims 64 / 128 / 192 (DV 128): 128 query rows per CTA (row = position * G +
 *               head of one kv head, as in qtile), two consumer warpgroups of 64 rows and a
 *               producer warp that issues the K / V chunks (128 keys forward, 64 dQ) by TMA
 *               into full / empty-mbarrier stages; scores (and dP) by wgmma SS, O += P V or
 *               dQ += dS K by wgmma RS with P / dS from registers and V / K read MN-major. One
 *               CTA per SM; the forward ping-pongs its warpgroups on named barriers so that
 *               one's softmax overlaps the other's products.
 *   kwp_kernel  dK and dV (range rules, and the selected rule over its inverted lists) when G
 *               divides 64, head dims 64 / 128: a producer warpgroup (one warp per stage) loads
 *               Q / dO chunks of 64 rows by TMA (whole positions x G heads) and fills the row
 *               slots; two consumer warpgroups (range: 64 keys each of a 128-key tile, every
 *               chunk; selected: the block's 64 keys, alternate chunks) never meet at a CTA
 *               barrier. Same tasks and ordered partials as ktile: deterministic.
 *   kwg_kernel  the same range-rule tasks for the other G (Q / dO rows by cp.async, the
 *               two warpgroups in step); its sums equal kwp's bit for bit.
 *   swg_kernel  the selection (importance + top-n, spec 3): 64 positions per CTA as the wgmma
 *               rows, the G heads' probabilities summed in the accumulator registers, the top-n
 *               as 64-bit rank keys through a register insertion network; no score matrix in
 *               memory.
 *   sfw_kernel  selected attention forward and dQ (DK = DV = 64 / 128, G >= 4): one warp per
 *               16 heads of one position (two neighbouring positions per CTA when G <= 16,
 *               sharing the stages of the blocks both selected; at G = 4, and for dQ at G = 8,
 *               a warp's rows are 16 / G positions over the union of their blocks), K / V by
 *               TMA in 32-key stages, mma.sync from the swizzled tiles.
 *
 * Shared tiles use the canonical 128-byte swizzle of wgmma (also TMA's SWIZZLE_128B): a tile
 * of R rows x D columns is D / 64 column blocks of R x 128 bytes; 16-byte chunk c of row r
 * sits at chunk c ^ (r % 8) of its row; every column block starts on 1024 bytes. cp.async
 * loads write those chunks (16 bytes per thread, eight threads per 128-byte row: no bank
 * conflicts), and fence.proxy.async makes them visible to the tensor cores before the barrier.
 *
 * The kernel bodies exist only in the sm_90a build; the host launches them only when the
 * loaded binary was compiled for it (nsa_cu_qwg_ready_*), else qtile / ktile / select_kernel
 * run. */
#ifndef NSA_CUDA_HOPPER_CUH
#define NSA_CUDA_HOPPER_CUH

#include "engine.cuh" /* ex2, rule_bounds, dtraits, loaders, kt_task; wgmma.cuh */

#include <cuda.h> /* CUtensorMap (the type only: the maps are encoded in branches.cu) */

#if defined(__CUDACC__)

/* Ping-pong of the two warpgroups' products on the tensor cores, per chunk A0, A1, B0, B1
 * (A: the score products, B: the accumulating ones), so that each warpgroup's elementwise
 * work between A and B overlaps the other's products instead of both idling the tensor
 * cores at once:  X: A1 after A0;  Y: B0 after A1;  Z: B1 after B0. has_b: whether the
 * chunk has B products (uniform over the CTA). Used by the forward only: measured on the H100
 * at 64k it took 8% off the compressed forward but added 2% to dQ and 4-8% to dK/dV, whose
 * elementwise phase is short next to their products (bench/cuda.md). */
__device__ __forceinline__ void pp_before_a(int wg) { if (wg == 1) nb_sync(1); }
__device__ __forceinline__ void pp_after_a(int wg, bool has_b)
{
    if (wg == 0) nb_arrive(1);
    else if (has_b) nb_arrive(2);
}
__device__ __forceinline__ void pp_before_b(int wg) { if (wg == 0) nb_sync(2); else nb_sync(3); }
__device__ __forceinline__ void pp_after_b(int wg) { if (wg == 0) nb_arrive(3); }

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

    sc_mask_scale<NT>(S, sc_chunk_whole(c0, c1, NW, rlo, rhi), c0, c1, rlo, rhi, lane,
                      sc_softcap<NT>(S, P.rule, P.scale, P.sl2));
    sc_softmax<NT, DA / 8>(S, m_, l_, acc);
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

template <int DKP, int DVP, typename T, int MODE>
__global__ void __launch_bounds__(384, 1) qwg_kernel(const qparams P, const __grid_constant__ CUtensorMap tk,
                                                     const __grid_constant__ CUtensorMap tv,
                                                     const __grid_constant__ CUtensorMap tq,
                                                     const __grid_constant__ CUtensorMap to) /* dQ: dO's */
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BM = QWG_BM, BN = QWG_BN(MODE), NT = BN / 8, KT = DKP / 16, VT = DVP / 16, NTHR = 256, NS = QWG_NS(MODE);
    constexpr int NQ = QWG_NQ(MODE, DKP); /* Q buffers: the next task's Q lands during this one */
    /* the accumulator: O [64 x DV] (forward) or dQ [64 x DK] per warpgroup */
    constexpr int DA = MODE == MODE_DQ ? DKP : DVP;
    constexpr int QB = BM * DKP * 2, OB = BM * DVP * 2, KB = BN * DKP * 2, VB = BN * DVP * 2; /* tile bytes */
    constexpr bool DQ = MODE == MODE_DQ;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_align1024(smem_raw);
    unsigned char *Qall = smem;                 /* [NQ] */
    unsigned char *Os = Qall + NQ * QB;         /* dO (dQ mode) */
    unsigned char *Ks = Os + (DQ ? OB : 0);     /* [NS] */
    unsigned char *Vs = Ks + NS * KB;           /* [NS] */
    int64_t *roff = (int64_t *)(Vs + NS * VB);  /* [BM] q rows */
    int64_t *roff2 = roff + BM;                 /* [BM] dout rows (dQ mode) */
    uint64_t *full = (uint64_t *)(roff2 + BM);  /* [NS] K / V chunk landed */
    uint64_t *empty = full + NS;                /* [NS] both warpgroups done with the stage */
    uint64_t *qfull = empty + NS;               /* [NQ] Q's box landed (P.qbox) */
    uint64_t *qempty = qfull + NQ;              /* [NQ] both warpgroups done with the Q buffer */
    qwg_task *qtask = (qwg_task *)(qempty + NQ); /* [NQ] the task whose Q is in the buffer (P.qbox) */

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

    if (threadIdx.x == 0) {
        for (int i = 0; i < NS; i++) {
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
                if (it >= NQ) mb_wait(&qempty[qb], ((it / NQ) & 1) ^ 1);
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
                const int st = ci % NS, c0 = t.kmin + c * BN;
                if (ci >= NS) mb_wait(&empty[st], ((ci / NS) & 1) ^ 1);
                mb_expect(&full[st], KB + (has_v ? VB : 0));
#pragma unroll
                for (int cb = 0; cb < DKP / 64; cb++)
                    tma_load4(Ks + st * KB + cb * BN * 128, &tk, cb * 64, t.h, (int)(key_row0 + c0), (int)t.sq.b, &full[st]);
                if (has_v)
#pragma unroll
                    for (int cb = 0; cb < DVP / 64; cb++)
                        tma_load4(Vs + st * VB + cb * BN * 128, &tv, cb * 64, t.h, (int)(key_row0 + c0), (int)t.sq.b,
                                  &full[st]);
            }
            task = P.dyn ? (int64_t)atomicAdd(P.ctr, 1) + gridDim.x : task + gridDim.x;
        }
        return;
    }
    regs_inc<WS_CREGS>();
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
            if (it > 0) nb_sync(4); /* both warpgroups done with the previous task's Q and rows */
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
            nb_sync(4); /* roff written */
            sw_load_rows<T, DKP, BM, NTHR>(Qs, (const T *)P.q.p, roff, tid);
            if (DQ) sw_load_rows<T, DVP, BM, NTHR>(Os, (const T *)P.dout.p, roff2, tid);
            cp_commit();
            cp_wait<0>();
            fence_async_smem();
            nb_sync(4); /* Q (dO) visible to both warpgroups' tensor cores */
        }

        /* forward: O [64 x DV] per warpgroup; dQ: dQ [64 x DK] */
        float acc[DA / 8][4];
#pragma unroll
        for (int i = 0; i < DA / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
        float m_[2] = {-INFINITY, -INFINITY}, l_[2] = {0.0f, 0.0f};
        /* this warpgroup's 64 rows of Q (and dO): at row offset wg * 64 in every column block */
        const unsigned char *Qw = Qs + wg * 64 * 128;
        const unsigned char *Ow = Os + wg * 64 * 128;

        for (int c = 0; c < t.nchunks; c++, ci++) {
            const int st = ci % NS;
            const int c0 = t.kmin + c * BN, c1 = c0 + BN < t.kmax + 1 ? c0 + BN : t.kmax + 1;
            mb_wait(&full[st], (ci / NS) & 1); /* the chunk landed */
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

                sc_mask_scale<NT>(S, sc_chunk_whole(c0, c1, BN, rlo, rhi), c0, c1, rlo, rhi, lane, P.sl2);
                /* P from the saved lse; dS = P (g dP - D) */
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) S[nt][e] = ex2(S[nt][e] - rl2[e >> 1]) * (dP[nt][e] * rg[e >> 1] - rD[e >> 1]);
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
            const float inv = sc_row_finish(m_[x], l, P.rule.sinks, P.rule.sinks_s, hq, &lse);
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
            nb_sync_wg(5 + wg);
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
    if (store_qb >= 0) tma_store_wait_read(); /* the CTA's shared memory outlives the stores' reads */
#endif
}

/* The dK / dV tiles' first two products for one chunk: S^T = K Q^T and dP^T = V dO^T (keys x
 * rows, wgmma SS, all operands K-major; A: 64 keys at byte offset aoff of the BK-key tile).
 * SPLIT commits S alone first (its consumer waits for S while dP runs). */
template <typename T, int DP, int BK, int BQ, bool SPLIT>
__device__ __forceinline__ void kw_products(float (*S)[4], float (*dP)[4], const unsigned char *Ks,
                                            const unsigned char *Vs, const unsigned char *Qp, const unsigned char *Dp,
                                            int aoff)
{
    constexpr int KT = DP / 16;
    wg_fence();
    wg_ss_kmajor<T, BQ, KT, BK, BQ>(&S[0][0], Ks + aoff, Qp);
    if (SPLIT) wg_commit();
    wg_ss_kmajor<T, BQ, KT, BK, BQ>(&dP[0][0], Vs + aoff, Dp);
    wg_commit();
}

/* The dK / dV tiles' epilogue (as ktile's): this thread's two keys' fp32 sums added into
 * dk / dv, or, for a further row segment, its partial of BK keys written whole (scale folded
 * into dK). */
template <int DP, int BK>
__device__ __forceinline__ void kwg_store(const kparams &P, const kt_task &t, const int kr[2], const float (*dK)[4],
                                          const float (*dV)[4], int lane)
{
    const int h = t.h, k0 = t.k0, k1 = t.k1;
#pragma unroll
    for (int x = 0; x < 2; x++) {
        const int key = kr[x];
        if (key >= k1) continue;
        float *pk, *pv;
        const int64_t slot = t.slot;
        if (slot >= 0) {
            pk = P.part + slot * BK * (P.DK + P.DV) + (int64_t)(key - k0) * P.DK;
            pv = P.part + slot * BK * (P.DK + P.DV) + (int64_t)BK * P.DK + (int64_t)(key - k0) * P.DV;
        } else {
            const int64_t row = (t.sq.b * P.KR + t.key_row0 + key) * P.H + h;
            pk = P.dk + row * P.DK, pv = P.dv + row * P.DV;
        }
#pragma unroll
        for (int d = 0; d < DP / 8; d++) {
            const int col = d * 8 + 2 * (lane & 3);
            float2 *k2p = (float2 *)(pk + col), *v2p = (float2 *)(pv + col);
            const float2 a = slot >= 0 ? make_float2(0.0f, 0.0f) : *k2p, b = slot >= 0 ? make_float2(0.0f, 0.0f) : *v2p;
            *k2p = make_float2(a.x + dK[d][2 * x] * P.scale, a.y + dK[d][2 * x + 1] * P.scale);
            *v2p = make_float2(b.x + dV[d][2 * x], b.y + dV[d][2 * x + 1]);
        }
    }
}

/* dK and dV of the range rules: ktile's tasks at 128 keys (two warpgroups of 64 keys share
 * every 64-row chunk of Q and dO they stream: half of ktile's L2 traffic per product; row
 * segments with ordered partials for the compressed branch), one CTA per SM:
 *   S^T = K Q^T, dP^T = V dO^T     (wgmma SS, all operands K-major)
 *   dV += (g P)^T dO, dK += dS^T Q (wgmma RS, dO / Q MN-major)
 * Deterministic as ktile: every key's sums run over its rows in one fixed order. */
template <int DP, typename T>
__global__ void __launch_bounds__(256, 1) kwg_kernel(const kparams P)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BK = KWG_BK, BQ = 64, NT = BQ / 8, NTHR = 256;
    constexpr int KB = BK * DP * 2, TB = BQ * DP * 2; /* key tile, row chunk */
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_align1024(smem_raw);
    unsigned char *Ks = smem, *Vs = Ks + KB;
    unsigned char *Qs = Vs + KB;     /* [2] */
    unsigned char *Ds = Qs + 2 * TB; /* [2] dO */
    int64_t *rq = (int64_t *)(Ds + 2 * TB); /* [3][BQ] row slots */
    int64_t *ro = rq + 3 * BQ;
    float *rl2 = (float *)(ro + 3 * BQ);
    float *rD = rl2 + 3 * BQ, *rg = rD + 3 * BQ;
    int *rlo = (int *)(rg + 3 * BQ), *rhi = rlo + 3 * BQ;
    int *rfull = rhi + 3 * BQ;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;

    /* the task lives in shared memory: the row fill of every chunk reads it there, so its
     * ~20 registers are not held through the products (they were spilled) */
    __shared__ kt_task ts;
    {
        kt_task t;
        if (!kt_task_get<BK, BQ>(P, &t, tid, NTHR)) return;
        if (tid == 0) ts = t;
    }
    __syncthreads();
    const kt_task &t = ts;
    const int h = t.h, k0 = t.k0, k1 = t.k1;
    const kt_rows R = {rq, ro, rl2, rD, rg, rlo, rhi, rfull};

    sw_load_lin<T, DP, BK, NTHR>(Ks, (const T *)P.k.p, t.sq.b * P.k.s0 + (t.key_row0 + k0) * P.k.s1 + (int64_t)h * P.k.s2,
                                 P.k.s1, k1 - k0, tid);
    sw_load_lin<T, DP, BK, NTHR>(Vs, (const T *)P.v.p, t.sq.b * P.v.s0 + (t.key_row0 + k0) * P.v.s1 + (int64_t)h * P.v.s2,
                                 P.v.s1, k1 - k0, tid);
    const int64_t nchunks = (t.nrows + BQ - 1) / BQ;
    /* rows of chunk c live in slot c % 3, filled two chunks ahead; data in stage c & 1 */
    kt_fill<BQ>(P, t, R, 0, 0, tid);
    if (nchunks > 1) kt_fill<BQ>(P, t, R, 1, 1, tid);
    __syncthreads();
    sw_load_rows<T, DP, BQ, NTHR>(Qs, (const T *)P.q.p, rq, tid);
    sw_load_rows<T, DP, BQ, NTHR>(Ds, (const T *)P.dout.p, ro, tid);
    cp_commit();

    float dK[DP / 8][4], dV[DP / 8][4];
#pragma unroll
    for (int i = 0; i < DP / 8; i++) {
        dK[i][0] = dK[i][1] = dK[i][2] = dK[i][3] = 0.0f;
        dV[i][0] = dV[i][1] = dV[i][2] = dV[i][3] = 0.0f;
    }
    int kr[2];
    kr[0] = k0 + warp * 16 + (lane >> 2);
    kr[1] = kr[0] + 8;

    for (int64_t c = 0; c < nchunks; c++) {
        const int st = (int)(c & 1), sl = (int)(c % 3);
        cp_wait<0>();
        fence_async_smem();
        __syncthreads(); /* chunk c landed; everyone is done with chunk c - 1 */
        if (c + 1 < nchunks) {
            const int ns = (int)((c + 1) % 3);
            sw_load_rows<T, DP, BQ, NTHR>(Qs + (st ^ 1) * TB, (const T *)P.q.p, rq + ns * BQ, tid);
            sw_load_rows<T, DP, BQ, NTHR>(Ds + (st ^ 1) * TB, (const T *)P.dout.p, ro + ns * BQ, tid);
        }
        cp_commit();
        if (c + 2 < nchunks) kt_fill<BQ>(P, t, R, (int)((c + 2) % 3), c + 2, tid);
        const unsigned char *Qp = Qs + st * TB, *Dp = Ds + st * TB;
        const float *l2 = rl2 + sl * BQ, *Dr = rD + sl * BQ, *gr = rg + sl * BQ;
        const int *lo = rlo + sl * BQ, *hi = rhi + sl * BQ;

        /* S^T = K Q^T and dP^T = V dO^T (keys x rows; this warpgroup's 64 keys) */
        float S[NT][4], dP[NT][4];
        kw_products<T, DP, BK, BQ, false>(S, dP, Ks, Vs, Qp, Dp, wg * 64 * 128);
        wg_wait<0>();

        /* P^T (masked), dS^T = P^T (g dP^T - D); S becomes g P^T for dV (as ktile) */
        if (k1 - k0 == BK && rfull[sl * 2] && rfull[sl * 2 + 1]) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int n = nt * 8 + 2 * (lane & 3) + (e & 1);
                    const float p = ex2(S[nt][e] * P.sl2 - kt_l2(l2[n]));
                    dP[nt][e] = p * (dP[nt][e] * gr[n] - Dr[n]);
                    S[nt][e] = p * gr[n];
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int n = nt * 8 + 2 * (lane & 3) + (e & 1), key = kr[e >> 1];
                    const int vis = key < k1 && key >= lo[n] && key <= hi[n];
                    const float p = vis ? ex2(S[nt][e] * P.sl2 - kt_l2(l2[n])) : 0.0f;
                    dP[nt][e] = p * (dP[nt][e] * gr[n] - Dr[n]);
                    S[nt][e] = p * gr[n];
                }
        }
        /* dV += (g P)^T dO, dK += dS^T Q: 16 rows per step, B MN-major (8-row groups 1024
         * bytes apart, 64-column blocks BQ * 128 bytes apart) */
        uint32_t pa[BQ / 16][4], da[BQ / 16][4];
#pragma unroll
        for (int k2 = 0; k2 < BQ / 16; k2++) {
            sc_frag_a<T>(pa[k2], S[2 * k2], S[2 * k2 + 1]);
            sc_frag_a<T>(da[k2], dP[2 * k2], dP[2 * k2 + 1]);
        }
        wg_fence();
#pragma unroll
        for (int k2 = 0; k2 < BQ / 16; k2++) {
            wgmma_op<T, DP>::template rs<1>(&dV[0][0], pa[k2], wg_desc(Dp + k2 * 16 * 128, BQ * 128, 1024), 1);
            wgmma_op<T, DP>::template rs<1>(&dK[0][0], da[k2], wg_desc(Qp + k2 * 16 * 128, BQ * 128, 1024), 1);
        }
        wg_commit();
        wg_wait<0>();
    }
    cp_wait<0>();

    kwg_store<DP, KWG_BK>(P, t, kr, dK, dV, lane);
#endif
}

/* dK and dV, warp-specialised: ktile's tasks (range rules: kwg's 128-key tiles; SLC: one
 * selected block's 64 keys over its inverted list), with the chunks of query rows streamed by a
 * producer warpgroup into KWP_NS stages guarded by mbarriers (full: the chunk and its row slots
 * landed; empty: every consuming thread is done with it), so that the two consumer warpgroups
 * never meet at a CTA barrier and drift apart: one's elementwise phase runs under the other's
 * products. Warp w of the producer owns stage w (a parity wait cannot tell phase u from u + 2,
 * so each barrier's phases must be driven in order). A chunk's 64 rows are 64 / G whole
 * positions x G heads (G divides 64; every chunk of a range task starts on a position): one TMA
 * box of the q / dout maps per 64 columns for the range rules, one box per listed position for
 * SLC; the row slots (lse, D, gate by cp.async, visible range) are filled by the producer's
 * lanes (kt_fill), which arrive once for their stores and once when their copies land. The key
 * tile rides on chunk 0's barrier. Rows past a task's end arrive as they are (masked, P = 0) or,
 * past the tensor, as zeros. Range rules: warpgroup c takes keys 64 c .. of every chunk; SLC:
 * both take the block's 64 keys on alternate chunks, summed at the end in a fixed order. Inside
 * a warpgroup the exponentials run under the dP product and dS under the dV product:
 *   S^T = K Q^T, dP^T = V dO^T   (wgmma SS; wait for S only)
 *   P^T, dV += (g P)^T dO        (wgmma RS; wait for dP only)
 *   dS^T, dK += dS^T Q           (wgmma RS)
 * Deterministic; for the range rules the same sums as kwg bit for bit. 384 threads: warpgroup 0
 * the producer (WS_PREGS registers), warpgroups 1 and 2 the consumers (WS_CREGS). */
template <int DP, typename T, bool SLC>
__global__ void __launch_bounds__(384, 1) kwp_kernel(const kparams P, const __grid_constant__ CUtensorMap tq,
                                                     const __grid_constant__ CUtensorMap tdo,
                                                     const __grid_constant__ CUtensorMap tk,
                                                     const __grid_constant__ CUtensorMap tv)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BK = SLC ? 64 : KWG_BK, BQ = 64, NT = BQ / 8, NS = SLC ? KWP_NS_SLC : KWP_NS;
    constexpr int KB = BK * DP * 2, TB = BQ * DP * 2; /* key tile, row chunk */
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_align1024(smem_raw);
    unsigned char *Ks = smem, *Vs = Ks + KB;
    unsigned char *Qs = Vs + KB;      /* [NS] */
    unsigned char *Ds = Qs + NS * TB; /* [NS] dO */
    uint64_t *full = (uint64_t *)(Ds + NS * TB), *empty = full + NS;
    float *rl2 = (float *)(empty + NS); /* [NS][BQ] row slots (no row offsets: TMA) */
    float *rD = rl2 + NS * BQ, *rg = rD + NS * BQ;
    int *rlo = (int *)(rg + NS * BQ), *rhi = rlo + NS * BQ;
    int *rfull = rhi + NS * BQ; /* [NS][2] */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;

    __shared__ kt_task ts; /* read from shared memory by the producer's fills (as kwg) */
    {
        kt_task t;
        if (!kt_task_get<BK, BQ>(P, &t, tid, 384)) return;
        if (tid == 0) ts = t;
    }
    if (tid == 0) {
        for (int s = 0; s < NS; s++) {
            mb_init(&full[s], 64); /* the producer's lanes: slot stores, slot copies (+ the bytes) */
            mb_init(&empty[s], SLC ? 128 : 256); /* every consuming thread, after its last read */
        }
        mb_init_fence();
    }
    __syncthreads();
    const kt_task &t = ts;
    const int h = t.h, k0 = t.k0, k1 = t.k1;
    const int64_t nchunks = (t.nrows + BQ - 1) / BQ;

    if (wg == 0) {
        /* the producer: warp w < NS of this warpgroup fills the chunks of stage w (one warp's
         * fills and address work per chunk were the pipeline's throughput); one warp per stage
         * keeps each barrier's phases in order (a parity wait cannot tell phase u from u + 2) */
        regs_dec<WS_PREGS>();
        if (warp >= NS) return;
        const kt_rows R = {nullptr, nullptr, rl2, rD, rg, rlo, rhi, rfull};
        const int G = (int)P.G, b = (int)t.sq.b, PP = BQ / G; /* positions per chunk */
        /* selected rule: this lane's list entries (lane, lane + 32 of a chunk) for this warp's
         * chunk (pe) and its next one (pn), loaded a round ahead; entries past the list repeat
         * its last (finite rows, masked) */
        const int64_t nlist = t.nrows / G;
        int pe[2] = {0, 0}, pn[2] = {0, 0};
        if (SLC)
            for (int x = 0; x < 2; x++)
                if (lane + 32 * x < PP) pn[x] = t.list[min((int64_t)warp * PP + lane + 32 * x, nlist - 1)];
        for (int64_t c = warp; c < nchunks; c += NS) {
            const int s = (int)(c % NS);
            if (c >= NS) mb_wait(&empty[s], (int)(((c / NS) & 1) ^ 1));
            if (lane == 0) mb_expect_tx(&full[s], 2 * TB + (c == 0 ? 2 * KB : 0));
            __syncwarp(); /* the bytes expected before any box of this phase lands */
            if (lane == 0 && c == 0)
#pragma unroll
                for (int cb = 0; cb < DP / 64; cb++) {
                    const int kr0 = (int)(t.key_row0 + k0);
                    tma_load4(Ks + cb * BK * 128, &tk, cb * 64, h, kr0, b, &full[0]);
                    tma_load4(Vs + cb * BK * 128, &tv, cb * 64, h, kr0, b, &full[0]);
                }
            if (!SLC) { /* the chunk's 64 / G positions are consecutive: one box per 64 columns */
                if (lane == 0) {
                    const int row = (int)(t.sq.row0 + (t.rbase + c * BQ) / G);
#pragma unroll
                    for (int cb = 0; cb < DP / 64; cb++) {
                        tma_load4(Qs + s * TB + cb * BQ * 128, &tq, cb * 64, h * G, row, b, &full[s]);
                        tma_load4(Ds + s * TB + cb * BQ * 128, &tdo, cb * 64, h * G, row, b, &full[s]);
                    }
                }
                kt_fill<BQ, false>(P, t, R, s, c, lane);
                kt_fill<BQ, false>(P, t, R, s, c, lane + 32);
            } else { /* one box of G heads per listed position, issued by the lane holding it */
                pe[0] = pn[0], pe[1] = pn[1];
#pragma unroll
                for (int x = 0; x < 2; x++)
                    if (lane + 32 * x < PP) {
                        const int row = (int)(t.sq.row0 + pe[x]), r0 = (lane + 32 * x) * G;
#pragma unroll
                        for (int cb = 0; cb < DP / 64; cb++) {
                            tma_load4(Qs + s * TB + cb * BQ * 128 + r0 * 128, &tq, cb * 64, h * G, row, b, &full[s]);
                            tma_load4(Ds + s * TB + cb * BQ * 128 + r0 * 128, &tdo, cb * 64, h * G, row, b, &full[s]);
                        }
                    }
                /* rows lane and lane + 32: positions from the lanes holding their entries */
                int rp[2];
#pragma unroll
                for (int x = 0; x < 2; x++) {
                    const int e = (lane + 32 * x) / G;
                    const int v0 = __shfl_sync(0xffffffffu, pe[0], e & 31), v1 = __shfl_sync(0xffffffffu, pe[1], e & 31);
                    rp[x] = e < 32 ? v0 : v1;
                }
#pragma unroll
                for (int x = 0; x < 2; x++)
                    if (c + NS < nchunks && lane + 32 * x < PP) pn[x] = t.list[min((c + NS) * PP + lane + 32 * x, nlist - 1)];
                kt_fill_at<BQ, false>(P, t, R, s, c, lane, rp[0]);
                kt_fill_at<BQ, false>(P, t, R, s, c, lane + 32, rp[1]);
            }
            /* lse, D, gate by cp.async (no load latency in this loop: it is the pipeline's
             * throughput), the rest by stores: each lane arrives once for its stores and once
             * when its copies land */
            mb_arrive_cp(&full[s]);
            mb_arrive(&full[s]);
        }
        return;
    }
    regs_inc<WS_CREGS>();
    /* consumer warpgroup cw: range rule, keys cw * 64 .. of every chunk; selected rule, all
     * 64 keys of chunks cw, cw + 2, .. (summed at the end in a fixed order) */
    const int cw = wg - 1, cwarp = warp - 4;

    float dK[DP / 8][4], dV[DP / 8][4];
#pragma unroll
    for (int i = 0; i < DP / 8; i++) {
        dK[i][0] = dK[i][1] = dK[i][2] = dK[i][3] = 0.0f;
        dV[i][0] = dV[i][1] = dV[i][2] = dV[i][3] = 0.0f;
    }
    int kr[2];
    kr[0] = k0 + (SLC ? cwarp & 3 : cwarp) * 16 + (lane >> 2);
    kr[1] = kr[0] + 8;
    const int aoff = SLC ? 0 : cw * 64 * 128; /* this warpgroup's 64 rows of the key tile */

    for (int64_t c = SLC ? cw : 0; c < nchunks; c += SLC ? 2 : 1) {
        const int s = (int)(c % NS);
        mb_wait(&full[s], (int)((c / NS) & 1));
        const unsigned char *Qp = Qs + s * TB, *Dp = Ds + s * TB;
        const float *l2 = rl2 + s * BQ, *Dr = rD + s * BQ, *gr = rg + s * BQ;
        const int *lo = rlo + s * BQ, *hi = rhi + s * BQ;

        float S[NT][4], dP[NT][4];
        kw_products<T, DP, BK, BQ, true>(S, dP, Ks, Vs, Qp, Dp, aoff);
        wg_wait<1>(); /* S^T ready, dP^T still on the tensor cores */

        /* P^T (masked) in S; (g P)^T as the A fragments of dV */
        const bool whole = k1 - k0 == BK && rfull[s * 2] && rfull[s * 2 + 1];
        uint32_t pa[BQ / 16][4], da[BQ / 16][4];
        if (whole) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int n = nt * 8 + 2 * (lane & 3) + (e & 1);
                    S[nt][e] = ex2(S[nt][e] * P.sl2 - kt_l2(l2[n]));
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int n = nt * 8 + 2 * (lane & 3) + (e & 1), key = kr[e >> 1];
                    const int vis = key < k1 && key >= lo[n] && key <= hi[n];
                    S[nt][e] = vis ? ex2(S[nt][e] * P.sl2 - kt_l2(l2[n])) : 0.0f;
                }
        }
#pragma unroll
        for (int k2 = 0; k2 < BQ / 16; k2++) {
            float a[4], b[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                a[e] = S[2 * k2][e] * gr[2 * k2 * 8 + 2 * (lane & 3) + (e & 1)];
                b[e] = S[2 * k2 + 1][e] * gr[(2 * k2 + 1) * 8 + 2 * (lane & 3) + (e & 1)];
            }
            sc_frag_a<T>(pa[k2], a, b);
        }
        wg_fence();
#pragma unroll
        for (int k2 = 0; k2 < BQ / 16; k2++)
            wgmma_op<T, DP>::template rs<1>(&dV[0][0], pa[k2], wg_desc(Dp + k2 * 16 * 128, BQ * 128, 1024), 1);
        wg_commit();
        wg_wait<1>(); /* dP^T ready, dV on the tensor cores */

        /* dS^T = P^T (g dP^T - D) */
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int n = nt * 8 + 2 * (lane & 3) + (e & 1);
                dP[nt][e] = S[nt][e] * (dP[nt][e] * gr[n] - Dr[n]);
            }
#pragma unroll
        for (int k2 = 0; k2 < BQ / 16; k2++) sc_frag_a<T>(da[k2], dP[2 * k2], dP[2 * k2 + 1]);
        wg_fence();
#pragma unroll
        for (int k2 = 0; k2 < BQ / 16; k2++)
            wgmma_op<T, DP>::template rs<1>(&dK[0][0], da[k2], wg_desc(Qp + k2 * 16 * 128, BQ * 128, 1024), 1);
        wg_commit();
        wg_wait<0>();
        mb_arrive(&empty[s]); /* stage s free for chunk c + NS (each thread releases its own reads) */
    }

    if (SLC) { /* warpgroup 1's sums into warpgroup 0's (same fragment layout), in that order */
        float4 *red = (float4 *)Qs; /* the stages are free once both warpgroups are done */
        const int ct = tid - 128;   /* 0 .. 255 */
        nb_sync(1);
        if (cw == 1)
#pragma unroll
            for (int d = 0; d < DP / 8; d++) {
                red[(2 * d) * 128 + ct - 128] = make_float4(dK[d][0], dK[d][1], dK[d][2], dK[d][3]);
                red[(2 * d + 1) * 128 + ct - 128] = make_float4(dV[d][0], dV[d][1], dV[d][2], dV[d][3]);
            }
        nb_sync(1);
        if (cw == 1) return;
#pragma unroll
        for (int d = 0; d < DP / 8; d++) {
            const float4 a = red[(2 * d) * 128 + ct], v = red[(2 * d + 1) * 128 + ct];
            dK[d][0] += a.x, dK[d][1] += a.y, dK[d][2] += a.z, dK[d][3] += a.w;
            dV[d][0] += v.x, dV[d][1] += v.y, dV[d][2] += v.z, dV[d][3] += v.w;
        }
    }
    kwg_store<DP, BK>(P, t, kr, dK, dV, lane);
#endif
}

/* ==== swg_kernel: importance + top-n (spec 3) on wgmma ====================================== */

/* Rank key of candidate block j (importance v >= 0, forced f) for position-wise top-n: the
 * order (forced, importance, lower index) of spec 3 as one unsigned compare, since
 * non-negative floats order as their bit patterns. 0 is no block (every real key has the
 * index field > 0 or a set importance / forced bit). */
__device__ __forceinline__ uint64_t swg_key(int f, float v, int j)
{
    return ((uint64_t)(f != 0) << 63) | ((uint64_t)__float_as_uint(v) << 31) | (uint64_t)(0x7FFFFFFF - j);
}

/* c into the kept list L (best first, zeros = empty) by the branchless insertion network,
 * L[i] = max(L[i], min(c, L[i - 1])): the last entry drops out when c beats it, and c = 0
 * (no candidate) leaves L as it is. */
template <int NR>
__device__ __forceinline__ void swg_insert(uint64_t (&L)[NR], uint64_t c)
{
#pragma unroll
    for (int i = NR - 1; i > 0; i--) {
        const uint64_t lo = c < L[i - 1] ? c : L[i - 1];
        L[i] = L[i] > lo ? L[i] : lo;
    }
    L[0] = L[0] > c ? L[0] : c;
}

/* One pass of the top-n for the 32 positions of a warp (lane = position pp, its list at keys
 * [NR][MS][SWG_BP], best first, zeros = empty): the list in registers; each lane scans its own
 * candidates for the next one that beats its last entry (a compare each), and the warp runs
 * the insertion network (swg_insert) once per round, a no-op for lanes without a winner (c =
 * 0). Rounds = the most winners of any lane: all JC while the lists fill, a few once they hold
 * their top n (random scores: ~n / (keys seen) of a pass's candidates win). Keeping the top NR
 * >= n keeps the top n. MS lanes per position (half = 0 .. MS - 1) each keep the top of every
 * MS-th candidate in their own list, merged once at the end: with MS = 2 every warp of the CTA
 * merges and none waits at the barrier (one lane per position left two of four warps idle for
 * a sixth of the kernel). (The network run for every candidate a lane of the warp could use
 * was most of the merge: 16 steps of 64-bit min / max per candidate; a warp per position
 * merging by rank counts took 8 of the 17 ms of the selection at 64k; one thread per position
 * shifting a shared-memory list, 7.) */
template <int NR, int MS>
__device__ __forceinline__ void swg_merge(const sparams &P, const float *imp, int ims, uint64_t *keys, int p0, int npos,
                                          int jA, int JC, int pp, int half)
{
    uint64_t *K = keys + half * SWG_BP + pp; /* entry i at K[i * MS * SWG_BP] */
    uint64_t L[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) L[i] = K[i * MS * SWG_BP];
    const int cur = (p0 + pp) / P.lp;
    int m = cur - jA + 1 < JC ? cur - jA + 1 : JC;
    if (pp >= npos) m = 0;
    int jj = half;
    for (;;) {
        uint64_t c = 0;
        while (jj < m) {
            const int j = jA + jj;
            const uint64_t k = swg_key(nsa_rule_forced(j, cur, P.n_init, P.n_local), imp[pp * ims + jj], j);
            jj += MS;
            if (k > L[NR - 1]) {
                c = k;
                break;
            }
        }
        if (!__any_sync(0xffffffffu, c != 0)) break;
        swg_insert<NR>(L, c);
    }
#pragma unroll
    for (int i = 0; i < NR; i++) K[i * MS * SWG_BP] = L[i];
}

/* One warpgroup per CTA, 64 consecutive positions of one kv head (the wgmma rows are
 * positions, not position x head as in select_kernel). A pass takes the compressed keys
 * [iA, iB) (at most SWG_NK) that overlap JC selection blocks; for each of the G heads in
 * turn, S = Q_g K^T (wgmma SS) and p += 2^(S sl2 - lse_g): the head sum of the probabilities
 * accumulates elementwise in registers, with no cross-lane reduction. The products are
 * software-pipelined in halves of 64 keys: the next half's product runs on the tensor cores
 * while this half's exponentials run. Q tiles (one head each, the same for every pass)
 * and key tiles arrive by TMA, issued by thread 0, on mbarriers: the Q tiles cycle through
 * SWG_QST stages as one stream of G uses per pass (a stage is refilled once every warp is
 * past the product that read it), so the next pass's first heads load during this pass's
 * last ones. (Loading them by cp.async was a quarter of this kernel's instructions: the
 * address work of 8 copies per thread per head.) The heads' lse sit in shared memory, read
 * once per CTA. The pass then writes p to shared memory (over the key tile, free by then),
 * folds it into block importances, issues the next pass's key tile and merges the candidates
 * into the kept lists (swg_merge, MS lanes per position) while it loads. Two CTAs per SM
 * overlap one's merges with the other's products. Keys a position cannot see (or past the
 * pass, which the key box may hold) are never read back from p. NR: list registers, 16 or 32
 * (>= n); MS: merge lanes per position (swg_merge), 2 where that still fits two CTAs per SM. */
template <int DKP, typename T, int NR, int MS>
__global__ void __launch_bounds__(128, 2) swg_kernel(const sparams P, const __grid_constant__ CUtensorMap tq,
                                                     const __grid_constant__ CUtensorMap tk)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BP = SWG_BP, NK = SWG_NK, NT = NK / 8, KT = DKP / 16, NTHR = 128, NQ = SWG_QST;
    constexpr int QB = BP * DKP * 2, KB = SWG_KBYTES(DKP);
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_align1024(smem_raw);
    unsigned char *Qs = smem;                /* [NQ] Q tiles of one head each */
    unsigned char *Ks = Qs + NQ * QB;        /* key tile; then p [BP][NK] f32 (swizzled) */
    float *Ps = (float *)Ks;
    const int JC = P.JC, IMS = JC | 1;       /* odd row stride: swg_merge's lanes on distinct banks */
    const int G = (int)P.G;
    uint64_t *keys = (uint64_t *)(Ks + KB);  /* [NR][MS][BP] rank keys, best first */
    uint64_t *qfull = keys + NR * MS * BP;   /* [NQ] a Q stage landed */
    uint64_t *kfull = qfull + NQ;            /* the pass's key tile landed */
    float *imp = (float *)(kfull + 1);       /* [BP][IMS] */
    float *lsl = imp + BP * IMS;             /* [G][BP] lse * log2(e) (+inf: no keys, p = 0) */
    int *kept = (int *)(lsl + G * BP);       /* [BP] */
    int *pcur = kept + BP, *pnv = pcur + BP; /* [BP] each: block of the position, its visible keys */

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int64_t s, tile;
    seq_decode(P.sm, blockIdx.x, &s, &tile);
    const seqinfo sq = seq_get(P.sm, s);
    const int h = blockIdx.y;
    /* heaviest tiles (latest positions, most passes) first */
    tile = (sq.len + BP - 1) / BP - 1 - tile;
    const int p0 = (int)tile * BP;
    const int npos = sq.len - p0 < BP ? sq.len - p0 : BP;
    const int lp = P.lp, cl = P.cl, cd = P.cd;
    const int cur_max = (p0 + npos - 1) / lp;
    const int last_t = p0 + npos - 1;
    /* nsa_rule_cmp_visible in 32-bit arithmetic: calling the int64 helper here changed this
     * register-bound kernel's code and the 64k forward measured 0.2 ms slower (H100, A/B in
     * one call) */
    int nv_max = last_t + 1 >= cl ? (last_t + 1 - cl) / cd + 1 : 0;
    nv_max = nv_max < sq.ncmp ? nv_max : sq.ncmp;
    const float inv_d = 1.0f / (float)cd;
    /* this lane's two rows (positions) of its warp's 16 */
    int rp[2];
#pragma unroll
    for (int x = 0; x < 2; x++) rp[x] = warp * 16 + (lane >> 2) + x * 8;

    if (tid == 0) {
        for (int i = 0; i < NQ; i++) mb_init(&qfull[i], 1);
        mb_init(kfull, 1);
        mb_init_fence();
    }
    for (int i = tid; i < NR * MS * BP; i += NTHR) keys[i] = 0;
    if (tid < BP) {
        const int t = p0 + tid;
        pcur[tid] = tid < npos ? t / lp : -1;
        pnv[tid] = t + 1 >= cl ? (t + 1 - cl) / cd + 1 : 0; /* (as nv_max) */
    }
    {
        const float *lsep = (const float *)P.lse.p;
        const int64_t l0 = sq.b * P.lse.s0 + (sq.row0 + p0) * P.lse.s1 + (int64_t)h * G * P.lse.s2;
        for (int i = tid; i < G * BP; i += NTHR) {
            const int g = i / BP, r = i - g * BP;
            const float lse = r < npos ? lsep[l0 + r * P.lse.s1 + g * P.lse.s2] : -INFINITY;
            lsl[i] = lse == -INFINITY ? INFINITY : lse * NSA_LOG2E;
        }
    }

    /* compressed keys [iA_, iB_) overlapping selection blocks [jA_, jA_ + JC) */
    auto range = [&](int jA_, int *iA_, int *iB_) {
        const int64_t a0 = (int64_t)jA_ * lp - cl;
        *iA_ = a0 < 0 ? 0 : (int)(div_nn(a0, cd) + 1);
        const int b = (int)(div_nn((int64_t)(jA_ + JC) * lp - 1, cd) + 1);
        *iB_ = b < nv_max ? b : nv_max;
    };
    /* the Q stream: use u is head u % G in stage u % NQ; passes without keys use none */
    int npass = 0;
    for (int jA = 0; jA <= cur_max; jA += JC) {
        int a, b;
        range(jA, &a, &b);
        npass += a < b;
    }
    const int uses = npass * G;
    auto issue_q = [&](int u_) {
        const int st = u_ % NQ, hq = h * G + u_ % G;
        mb_expect(&qfull[st], QB);
#pragma unroll
        for (int cb = 0; cb < DKP / 64; cb++)
            tma_load4(Qs + st * QB + cb * BP * 128, &tq, cb * 64, hq, (int)(sq.row0 + p0), (int)sq.b, &qfull[st]);
    };
    auto issue_k = [&](int iA_) {
        mb_expect(kfull, NK * DKP * 2);
#pragma unroll
        for (int cb = 0; cb < DKP / 64; cb++)
            tma_load4(Ks + cb * NK * 128, &tk, cb * 64, h, (int)(sq.cmp0 + iA_), (int)sq.b, kfull);
    };
    /* half x (keys 64 x .. 64 x + 63 of the tile) of S = Q K^T for use u_ into S_, left
     * running; the first half waits for the use's Q stage */
    auto product = [&](float (&S_)[NT / 2][4], int u_, int x) {
        if (x == 0) mb_wait(&qfull[u_ % NQ], (u_ / NQ) & 1);
        const unsigned char *Qw = Qs + (u_ % NQ) * QB;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            const uint64_t da = wg_desc(Qw + (kk >> 2) * BP * 128 + (kk & 3) * 32, 16, 1024);
            const uint64_t db = wg_desc(Ks + (kk >> 2) * NK * 128 + x * (NK / 2) * 128 + (kk & 3) * 32, 16, 1024);
            wgmma_op<T, NK / 2>::template ss<0>(&S_[0][0], da, db, kk > 0);
        }
        wg_commit();
    };

    int iA, iB;
    range(0, &iA, &iB);
    __syncthreads(); /* barriers initialised; lse, lists and row facts written */
    if (tid == 0) {
        for (int x = 0; x < NQ && x < uses; x++) issue_q(x);
        if (iA < iB) issue_k(iA);
    }
    int u = 0, kp = 0; /* next Q use, key tiles consumed */
    for (int jA = 0; jA <= cur_max; jA += JC) {
        if (iA < iB) {
            float acc[NT][4];
#pragma unroll
            for (int i = 0; i < NT; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
            mb_wait(kfull, kp & 1);
            kp++;
            /* Each head's product in two halves of 64 keys, issued one ahead: a half's
             * exponentials run while the next half's product does. Two heads per iteration,
             * every product waited for by its end: carrying one across the loop's back edge
             * made ptxas serialise every wgmma (C7514), so one half in four runs its
             * exponentials alone (the other CTA on the SM fills that gap). */
            float SA[NT / 2][4], SB[NT / 2][4];
            auto exps = [&](float (&S_)[NT / 2][4], int x, int g) {
                const float l2[2] = {lsl[g * BP + rp[0]], lsl[g * BP + rp[1]]};
#pragma unroll
                for (int nt = 0; nt < NT / 2; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        acc[x * (NT / 2) + nt][e] += ex2(fmaf(S_[nt][e], P.sl2, -l2[e >> 1]));
            };
            /* use uu's stage is free once every warp is past its second half */
            auto release = [&](int uu) {
                __syncthreads();
                if (tid == 0 && uu + NQ < uses) issue_q(uu + NQ);
            };
            int g = 0;
            for (; g + 1 < G; g += 2, u += 2) { /* two heads: only the last half's exponentials run alone */
                product(SA, u, 0);
                product(SB, u, 1);
                wg_wait<1>();
                exps(SA, 0, g);
                product(SA, u + 1, 0);
                wg_wait<1>();
                release(u);
                exps(SB, 1, g);
                product(SB, u + 1, 1);
                wg_wait<1>();
                exps(SA, 0, g + 1);
                wg_wait<0>();
                release(u + 1);
                exps(SB, 1, g + 1);
            }
            if (g < G) { /* odd G: the last head alone */
                product(SA, u, 0);
                product(SB, u, 1);
                wg_wait<1>();
                exps(SA, 0, g);
                wg_wait<0>();
                release(u);
                exps(SB, 1, g);
                u++;
            }
            /* (the last step's barrier came after every product of the pass: the key tile
             * becomes p) */
            /* p[r][c] at r * NK + (c ^ 8 (r % 4)): the float2 stores of a half-warp (rows
             * r..r+3) fall in distinct banks */
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int x = 0; x < 2; x++) {
                    const int r = rp[x], c = (nt * 8 + 2 * (lane & 3)) ^ ((r & 3) << 3);
                    *(float2 *)(Ps + r * NK + c) = make_float2(acc[nt][2 * x], acc[nt][2 * x + 1]);
                }
            __syncthreads();
            /* importance of block j for position t: p of each compressed key i < nv(t) it
             * overlaps, times the shared tokens / d (spec 3). Lane = block (its keys [ia, ib)
             * are the same for every position, cut at each one's nv), warps over positions:
             * the divisions run once per block and pass, not per (position, block) pair
             * (integer work was a third of this kernel's instructions). */
            for (int jj = lane; jj < JC; jj += 32) {
                const int j = jA + jj, jlo = j * lp, jhi = jlo + lp;
                const int64_t b0 = (int64_t)jlo - cl;
                int ia = b0 < 0 ? 0 : (int)(div_nn(b0, cd) + 1);
                int ib = (int)(div_nn((int64_t)jhi - 1, cd) + 1);
                ia = ia > iA ? ia : iA;
                ib = ib < iB ? ib : iB;
                if (ib - ia <= SWG_WMAX) {
                    /* the block's overlaps (the same for every position) in registers */
                    float w[SWG_WMAX];
#pragma unroll
                    for (int q = 0; q < SWG_WMAX; q++) {
                        const int x = (ia + q) * cd, lo = x > jlo ? x : jlo, hi = x + cl < jhi ? x + cl : jhi;
                        w[q] = (float)(hi - lo);
                    }
                    for (int pp = warp; pp < npos; pp += 4) {
                        if (j > pcur[pp]) continue;
                        const int e = (ib < pnv[pp] ? ib : pnv[pp]) - ia, sw = (pp & 3) << 3;
                        const float *row = Ps + pp * NK;
                        float a = 0.0f;
#pragma unroll
                        for (int q = 0; q < SWG_WMAX; q++)
                            if (q < e) a += row[(ia + q - iA) ^ sw] * w[q];
                        imp[pp * IMS + jj] = a * inv_d;
                    }
                    continue;
                }
                for (int pp = warp; pp < npos; pp += 4) {
                    if (j > pcur[pp]) continue;
                    const int e = ib < pnv[pp] ? ib : pnv[pp], sw = (pp & 3) << 3;
                    float a = 0.0f;
                    for (int i = ia, x = ia * cd; i < e; i++, x += cd) {
                        const int lo = x > jlo ? x : jlo, hi = x + cl < jhi ? x + cl : jhi;
                        a += Ps[pp * NK + ((i - iA) ^ sw)] * (float)(hi - lo);
                    }
                    imp[pp * IMS + jj] = a * inv_d;
                }
            }
            fence_async_smem(); /* the generic reads and writes of p before the next key box */
        } else {
            for (int idx = tid; idx < npos * JC; idx += NTHR) imp[(idx / JC) * IMS + idx % JC] = 0.0f;
        }
        __syncthreads(); /* imp written; p read: the tile is free for the next pass */
        const int jn = jA + JC;
        int nA = 0, nB = 0;
        if (jn <= cur_max) {
            range(jn, &nA, &nB);
            if (tid == 0 && nA < nB) issue_k(nA);
        }
        if (tid < MS * BP) swg_merge<NR, MS>(P, imp, IMS, keys, p0, npos, jA, JC, tid % BP, tid / BP);
        __syncthreads();
        iA = nA, iB = nB;
    }
    /* the first n keys (nonzero ones: blocks) as block indices, entry-major over the keys;
     * with MS = 2 the second list's entries (best first) go through the network into the
     * first until one no longer beats its last */
    uint64_t L[NR];
    if (tid < BP) {
#pragma unroll
        for (int i = 0; i < NR; i++) L[i] = keys[i * MS * BP + tid];
        for (int x = 1; x < MS; x++)
            for (int e = 0; e < NR; e++) {
                const uint64_t c = keys[(e * MS + x) * BP + tid];
                if (c <= L[NR - 1]) break;
                swg_insert<NR>(L, c);
            }
    }
    __syncthreads();
    int *LJ = (int *)keys;
    if (tid < npos) {
        int k = 0;
#pragma unroll
        for (int i = 0; i < NR; i++)
            if (i < P.n && L[i] != 0) LJ[k++ * BP + tid] = 0x7FFFFFFF - (int)(L[i] & 0x7FFFFFFF);
        kept[tid] = k;
    }
    sel_write(P, sq, h, LJ, kept, BP, p0, npos, tid);
#endif
}

template <int DKP, typename T, int NR, int MS>
static void launch_swg_nr(grun *g, const sparams *P, int64_t tiles, const void *maps)
{
    const size_t smem = swg_smem(DKP, P->JC, NR, MS, (int)P->G);
    g_check(g, cudaFuncSetAttribute(swg_kernel<DKP, T, NR, MS>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (g->err != NSA_STATUS_SUCCESS) return;
    const CUtensorMap *m = (const CUtensorMap *)maps;
    swg_kernel<DKP, T, NR, MS><<<dim3((unsigned)tiles, (unsigned)P->H), 128, smem, g->st>>>(*P, m[0], m[1]);
    g_launched(g);
}

/* two merge lanes per position (n <= 16) unless their lists would cost the second CTA per SM
 * (sm_90: 228 KB of shared memory per SM, 1 KB of it reserved per CTA) or not fit at all */
template <int DKP, typename T>
static void launch_swg_t(grun *g, const sparams *P, int64_t tiles, const void *maps)
{
    const size_t s2 = swg_smem(DKP, P->JC, 16, 2, (int)P->G), s1 = swg_smem(DKP, P->JC, 16, 1, (int)P->G);
    const int two = 2 * (s2 + 1024) <= 228 * 1024 || (2 * (s1 + 1024) > 228 * 1024 && s2 <= (size_t)g->smem_max);
    if (P->n <= 16 && two) launch_swg_nr<DKP, T, 16, 2>(g, P, tiles, maps);
    else if (P->n <= 16) launch_swg_nr<DKP, T, 16, 1>(g, P, tiles, maps);
    else launch_swg_nr<DKP, T, 32, 1>(g, P, tiles, maps);
}

/* ==== sfw_kernel helpers: one warp's mma.sync products on the swizzled TMA tiles ========== */

/* C = A B^T for the warp's 16 rows: A fragments in registers (KT steps of 16 columns), B the
 * BN rows of a swizzled tile (S = Q K^T, dP = dO V^T) */
template <typename T, int NT, int KT, int BN>
__device__ __forceinline__ void sfw_abt(float (&C)[NT][4], const uint32_t (&A)[KT][4], const unsigned char *B, int lane)
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++) C[nt][0] = C[nt][1] = C[nt][2] = C[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KT; kk++)
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t b[4];
            const int r = np * 16 + (lane & 7) + (lane >> 4) * 8;
            ldsm4(b, B + sw_off(BN, r, kk * 2 + ((lane >> 3) & 1)));
            dtraits<T>::mma(C[2 * np], A[kk], b[0], b[1]);
            dtraits<T>::mma(C[2 * np + 1], A[kk], b[2], b[3]);
        }
}

/* acc += P B for the warp's 16 rows: P the fp32 scores of the chunk's BN keys (as A
 * fragments), B the chunk's swizzled tile read transposed (O += P V, dQ += dS K) */
template <typename T, int NT, int KT, int BN>
__device__ __forceinline__ void sfw_pb(float (&acc)[2 * KT][4], const float (&Pm)[NT][4], const unsigned char *B, int lane)
{
#pragma unroll
    for (int k2 = 0; k2 < NT / 2; k2++) {
        uint32_t a[4];
        sc_frag_a<T>(a, Pm[2 * k2], Pm[2 * k2 + 1]);
#pragma unroll
        for (int vp = 0; vp < KT; vp++) {
            uint32_t b[4];
            const int r = k2 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            ldsm4t(b, B + sw_off(BN, r, vp * 2 + (lane >> 4)));
            dtraits<T>::mma(acc[2 * vp], a, b[0], b[1]);
            dtraits<T>::mma(acc[2 * vp + 1], a, b[2], b[3]);
        }
    }
}

/* ==== sfw_kernel: selected attention, forward and dQ, TMA ===================================
 * One warp per CTA: 16 query heads g0 .. g0 + 15 of one position (heads past G are padding
 * rows: at G = 4 three quarters of the products are wasted, but the branch is bound by moving
 * each position's blocks, which a tile over several positions would multiply by the union of
 * their selections) against the blocks that position selected. Their K / V arrive in chunks of BN keys through
 * TMA (4-D tensor maps over the [B, T, H, D] views, 128-byte swizzle, built by the host) into
 * NS stages, NS - 1 chunks ahead of the products, each stage completing on its own mbarrier:
 * the copy engine moves the bytes while the warp computes, where qtile's one warp spent its
 * issue slots on 16-byte cp.async copies and its barriers (64k paper forward: 26.8 ms). The
 * products stay mma.sync (16 rows are one m16 tile; wgmma needs 64), reading the swizzled
 * tiles with ldmatrix at swizzled addresses (conflict-free: 8 rows, one chunk each). Same
 * arithmetic as qtile's path (scores, masks, online softmax, epilogue).
 * RP > 1 (G = 16 / RP, i.e. 4 or 8): each warp's 16 rows are RP neighbouring positions x G
 * heads instead of one position's 16 (padded) heads, walking the union of their blocks, rows
 * of a position that did not select a chunk's block masked: at G = 4 the union of four
 * positions (~55 blocks with random selections: the forced ones shared) is fewer K / V bytes
 * than four 16-block walks, and no padding rows. NP positions per CTA, NP / RP warps of rows.
 * KS > 1 (forward): KS warps share each warp's rows and take alternate chunks of the walk,
 * each with its own running max / sum / accumulators, combined at the end in a fixed order:
 * the union's ~55 chunks at G = 4 are a chain of online-softmax steps that one warp per CTA
 * ran latency-bound. */
template <int DP, typename T, int MODE, int BN, int NS, int NP, int RP, int KS>
__global__ void __launch_bounds__(32 * (NP / RP) * KS) sfw_kernel(const qparams P, const __grid_constant__ CUtensorMap tk,
                                                      const __grid_constant__ CUtensorMap tv)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int NT = BN / 8, KT = DP / 16, TB = BN * DP * 2; /* tile bytes (K or V of a chunk) */
    constexpr bool DQ = MODE == MODE_DQ;
    constexpr int W = NP / RP, GR = 16 / RP; /* warps; rows per position in a warp's 16 */
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_align1024(smem_raw);
    unsigned char *Ks = smem;                     /* [NS] */
    unsigned char *Vs = Ks + NS * TB;             /* [NS] */
    uint64_t *full = (uint64_t *)(Vs + NS * TB);  /* [NS] the chunk landed */
    uint64_t *empty = full + NS;                  /* [NS] every warp is done with the stage */
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) / KS, ks = (threadIdx.x >> 5) % KS;
    int64_t s, tile;
    seq_decode(P.sm, blockIdx.x, &s, &tile);
    const seqinfo sq = seq_get(P.sm, s);
    const int h = blockIdx.y;
    /* NP = 1: tile = position * ceil(G / 16) + head group, heads g0 .. g0 + 15, those >= G
     * padding (zero Q rows, nothing written). NP > 1 (G <= 16): tile = NP neighbouring
     * positions, one warp each, sharing the stages of the blocks they both selected (the
     * forced first and local blocks at least): fewer K / V bytes from L2, the bound. */
    const int64_t G = P.G, ngr = NP == 1 ? (G + 15) / 16 : 1;
    const int t0 = (int)(tile / ngr) * NP, t = t0 + warp * RP; /* the warp's first position */
    const int64_t g0 = (tile % ngr) * 16;
    const int rows = G - g0 < 16 ? (int)(G - g0) : 16;
    const int lp = P.rule.lp, nsub = (lp + BN - 1) / BN;
    /* the usable-block lists (ascending) of the CTA's positions; none past the sequence */
    const int32_t *U[NP];
    int cnt[NP], tp[NP];
#pragma unroll
    for (int w = 0; w < NP; w++) {
        tp[w] = t0 + w;
        const int64_t uid = (sq.b * P.T + sq.row0 + tp[w]) * P.H + h;
        U[w] = P.U + uid * P.m;
        cnt[w] = tp[w] < sq.len ? P.ucnt[uid] : 0;
    }

    if (threadIdx.x == 0) {
        for (int i = 0; i < NS; i++) {
            mb_init(&full[i], 1);
            mb_init(&empty[i], 32 * W * KS);
        }
        mb_init_fence();
    }
    __syncthreads();

    /* the chunk sequence: sub-chunks of each block of the lists' union (ascending) that start
     * at or before the last position that selected it; walked by the producer (NS - 1 ahead)
     * and by every warp, which computes the chunks its own position needs (mask bit) */
    struct walk {
        int u[NP], sub;
    };
    auto next = [&](walk &w, int *c0, int *bend, int *mask) -> bool {
        for (;;) {
            int j = INT_MAX;
#pragma unroll
            for (int x = 0; x < NP; x++)
                if (w.u[x] < cnt[x]) j = min(j, U[x][w.u[x]]);
            if (j == INT_MAX) return false;
            const int c = j * lp + w.sub * BN;
            int m = 0;
#pragma unroll
            for (int x = 0; x < NP; x++)
                if (w.u[x] < cnt[x] && U[x][w.u[x]] == j && c <= tp[x]) m |= 1 << x;
            const bool last = w.sub + 1 >= nsub || !m;
            if (m) *c0 = c, *bend = j * lp + lp, *mask = m, w.sub++;
            if (last) {
#pragma unroll
                for (int x = 0; x < NP; x++)
                    if (w.u[x] < cnt[x] && U[x][w.u[x]] == j) w.u[x]++;
                w.sub = 0;
            }
            if (m) return true;
        }
    };
    auto issue = [&](int st, int c0) {
        mb_expect(&full[st], 2 * TB);
#pragma unroll
        for (int cb = 0; cb < DP / 64; cb++) {
            tma_load4(Ks + st * TB + cb * BN * 128, &tk, cb * 64, h, (int)(sq.row0 + c0), (int)sq.b, &full[st]);
            tma_load4(Vs + st * TB + cb * BN * 128, &tv, cb * 64, h, (int)(sq.row0 + c0), (int)sq.b, &full[st]);
        }
    };
    const bool producer = threadIdx.x == 0;
    walk pw, cw;
#pragma unroll
    for (int x = 0; x < NP; x++) pw.u[x] = cw.u[x] = 0;
    pw.sub = cw.sub = 0;
    int pc0, pend, pmask;
    if (producer)
        for (int i = 0; i < NS - 1; i++)
            if (next(pw, &pc0, &pend, &pmask)) issue(i, pc0);
    const bool live = t < sq.len; /* (a warp past the sequence walks along, computing nothing) */
    /* this lane's rows (lane / 4, + 8): position index in the warp, position, head, realness
     * (padding heads past G, or positions past the sequence: zero Q / dO, nothing written) */
    int rpx[2], rt[2];
    int64_t rhq[2];
    bool rreal[2];
#pragma unroll
    for (int x = 0; x < 2; x++) {
        const int r = (lane >> 2) + x * 8;
        rpx[x] = r / GR, rt[x] = t + rpx[x], rhq[x] = h * G + g0 + r % GR;
        rreal[x] = rt[x] < sq.len && r % GR < rows;
    }

    /* A fragments of Q (and dO) straight from global memory (qtile's qreg layout): a[i] = row
     * lane / 4 (+ 8 for odd i), columns 2 (lane % 4) (+ 8 for i >= 2) and the next one */
    uint32_t qf[KT][4], of[DQ ? KT : 1][4];
    {
        const unsigned short *qp = (const unsigned short *)P.q.p, *op = (const unsigned short *)P.dout.p;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int x = i & 1;
            const int64_t qo = sq.b * P.q.s0 + (sq.row0 + rt[x]) * P.q.s1 + rhq[x] * P.q.s2;
            const int64_t oo = DQ ? sq.b * P.dout.s0 + (sq.row0 + rt[x]) * P.dout.s1 + rhq[x] * P.dout.s2 : 0;
#pragma unroll
            for (int kk = 0; kk < KT; kk++) {
                const int c = kk * 16 + (i >> 1) * 8 + 2 * (lane & 3);
                qf[kk][i] = rreal[x] ? qp[qo + c] | (uint32_t)qp[qo + c + 1] << 16 : 0u;
                if constexpr (DQ) of[kk][i] = rreal[x] ? op[oo + c] | (uint32_t)op[oo + c + 1] << 16 : 0u;
            }
        }
    }
    float rl2[2] = {0.0f, 0.0f}, rD[2] = {0.0f, 0.0f}, rg[2] = {1.0f, 1.0f};
    if constexpr (DQ) {
#pragma unroll
        for (int x = 0; x < 2; x++) {
            if (!rreal[x]) continue; /* padding: dO rows and D are 0, so dS = 0 */
            const int64_t hq = rhq[x], flat = (sq.b * P.T + sq.row0 + rt[x]) * P.HQ + hq;
            const float lse = ((const float *)P.lse.p)[sq.b * P.lse.s0 + (sq.row0 + rt[x]) * P.lse.s1 + hq * P.lse.s2];
            rl2[x] = lse == -INFINITY ? INFINITY : lse * NSA_LOG2E;
            rD[x] = P.Dw[flat];
            rg[x] = P.gw ? P.gw[flat] : 1.0f;
        }
    }
    float acc[DP / 8][4];
#pragma unroll
    for (int i = 0; i < DP / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    float m_[2] = {-INFINITY, -INFINITY}, l_[2] = {0.0f, 0.0f};
    const int lo2[2] = {0, 0};

    int c0, bend, mask;
    for (int ci = 0; next(cw, &c0, &bend, &mask); ci++) {
        /* refill the stage chunk ci - 1 used, once every warp released it */
        if (producer && next(pw, &pc0, &pend, &pmask)) {
            const int rs = (ci + NS - 1) % NS;
            if (ci >= 1) mb_wait(&empty[rs], ((ci - 1) / NS) & 1);
            issue(rs, pc0);
        }
        const int st = ci % NS;
        /* every warp waits for every chunk, needed or not: a parity wait on a barrier two
         * phases ahead would pass */
        mb_wait(&full[st], (ci / NS) & 1);
        const int wm = (mask >> (warp * RP)) & ((1 << RP) - 1); /* this warp's positions that need it */
        if (!wm || ci % KS != ks) {
            mb_arrive(&empty[st]);
            continue;
        }
        const unsigned char *Kp = Ks + st * TB, *Vp = Vs + st * TB;

        float S[NT][4];
        sfw_abt<T, NT, KT, BN>(S, qf, Kp, lane);
        const int c1 = c0 + BN < bend ? c0 + BN : bend;
        /* rows of a position that did not select this block see none of its keys */
        const int hi2[2] = {wm >> rpx[0] & 1 ? rt[0] : -1, wm >> rpx[1] & 1 ? rt[1] : -1};
        const int full = c1 - c0 == BN && wm == (1 << RP) - 1 && c1 - 1 <= t;
        sc_mask_scale<NT>(S, full, c0, c1, lo2, hi2, lane, P.sl2);
        if constexpr (!DQ) {
            sc_softmax<NT, DP / 8>(S, m_, l_, acc);
            sfw_pb<T, NT, KT, BN>(acc, S, Vp, lane);
        } else {
            /* P from the saved lse; dP = dO V^T; dS = P (g dP - D); dQ += dS K */
            float dP[NT][4];
            sfw_abt<T, NT, KT, BN>(dP, of, Vp, lane);
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) dP[nt][e] = ex2(S[nt][e] - rl2[e >> 1]) * (dP[nt][e] * rg[e >> 1] - rD[e >> 1]);
            sfw_pb<T, NT, KT, BN>(acc, dP, Kp, lane);
        }
        fence_async_smem(); /* this thread's ldmatrix reads before the stage's next TMA write */
        mb_arrive(&empty[st]);
    }
    if constexpr (KS > 1) {
        static_assert(!DQ, "split chunks are the forward's (dQ on two warps measured slower: branches.cu sfw_try)");
        /* every chunk landed and was read by every warp: the stages hold the partner warps'
         * state, [value][lane] (acc, then m and l), merged into split 0's in split order */
        constexpr int NV = DP / 2 + 4;
        float *xs = (float *)Ks + warp * (KS - 1) * NV * 32;
        __syncthreads();
        if (ks > 0) {
            float *mine = xs + (ks - 1) * NV * 32 + lane;
#pragma unroll
            for (int d = 0; d < DP / 8; d++)
#pragma unroll
                for (int e = 0; e < 4; e++) mine[(d * 4 + e) * 32] = acc[d][e];
#pragma unroll
            for (int x = 0; x < 2; x++) mine[(DP / 2 + x) * 32] = m_[x], mine[(DP / 2 + 2 + x) * 32] = l_[x];
        }
        __syncthreads();
        if (ks > 0) return;
        for (int k = 1; k < KS; k++) {
            const float *other = xs + (k - 1) * NV * 32 + lane;
#pragma unroll
            for (int x = 0; x < 2; x++) {
                const float m1 = other[(DP / 2 + x) * 32], l1 = other[(DP / 2 + 2 + x) * 32];
                const float mn = fmaxf(m_[x], m1), mu = mn == -INFINITY ? 0.0f : mn;
                const float a0 = ex2(m_[x] - mu), a1 = ex2(m1 - mu);
                m_[x] = mn, l_[x] = l_[x] * a0 + l1 * a1;
#pragma unroll
                for (int d = 0; d < DP / 8; d++)
#pragma unroll
                    for (int e = 2 * x; e < 2 * x + 2; e++) acc[d][e] = acc[d][e] * a0 + other[(d * 4 + e) * 32] * a1;
            }
        }
    }
    if (!live) return;

    /* epilogue (qtile's) */
#pragma unroll
    for (int x = 0; x < 2; x++) {
        const int64_t hq = rhq[x];
        const int tr = rt[x];
        if (!rreal[x]) { /* padding rows: nothing to write (shuffles below stay uniform) */
            if constexpr (!DQ) (void)sc_quad_sum(l_[x]);
            continue;
        }
        if constexpr (DQ) {
            float *dq = P.dq + ((sq.b * P.T + sq.row0 + tr) * P.HQ + hq) * P.DK;
#pragma unroll
            for (int d = 0; d < DP / 8; d++) {
                float2 *q2 = (float2 *)(dq + d * 8 + 2 * (lane & 3));
                const float2 o = *q2;
                *q2 = make_float2(o.x + acc[d][2 * x] * P.scale, o.y + acc[d][2 * x + 1] * P.scale);
            }
        } else {
            const float l = sc_quad_sum(l_[x]);
            float lse;
            const float inv = sc_row_finish(m_[x], l, nullptr, 0, hq, &lse);
            const int64_t ob = sq.b * P.o.s0 + (sq.row0 + tr) * P.o.s1 + hq * P.o.s2;
#pragma unroll
            for (int d = 0; d < DP / 8; d++) {
                const int col = d * 8 + 2 * (lane & 3);
                if (P.o.dt == NSA_DTYPE_F32) *(float2 *)((float *)P.o.p + ob + col) = make_float2(acc[d][2 * x] * inv, acc[d][2 * x + 1] * inv);
                else *(uint32_t *)((T *)P.o.p + ob + col) = dtraits<T>::pack(acc[d][2 * x] * inv, acc[d][2 * x + 1] * inv);
            }
            if ((lane & 3) == 0 && P.lse.p) ((float *)P.lse.p)[sq.b * P.lse.s0 + (sq.row0 + tr) * P.lse.s1 + hq * P.lse.s2] = lse;
        }
    }
#endif
}

template <int DP, typename T, int MODE, int BN, int NS, int NP, int RP = 1, int KS = 1>
static void launch_sfw_t(grun *g, const qparams *P, int64_t tiles, const void *tk, const void *tv)
{
    const size_t smem = sfw_smem(DP, BN, NS);
    auto kern = sfw_kernel<DP, T, MODE, BN, NS, NP, RP, KS>;
    g_check(g, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (g->err != NSA_STATUS_SUCCESS) return;
    kern<<<dim3((unsigned)tiles, (unsigned)P->H), 32 * (NP / RP) * KS, smem, g->st>>>(*P, *(const CUtensorMap *)tk,
                                                                         *(const CUtensorMap *)tv);
    g_launched(g);
}

template <int DP, typename T, int MODE>
static void launch_sfw_m(grun *g, const qparams *P, int64_t tiles, const void *tk, const void *tv)
{
    /* union tiles (branches.cu sfw_try): forward at G = 4 on two warps taking alternate
     * chunks; dQ at G = 4 / 8 on one warp of four / two positions */
    if constexpr (MODE == MODE_FWD) {
        if (P->rp == 4) return launch_sfw_t<DP, T, MODE, 32, 2, 4, 4, 2>(g, P, tiles, tk, tv);
    } else {
        if (P->rp == 4) return launch_sfw_t<DP, T, MODE, 32, 2, 4, 4>(g, P, tiles, tk, tv);
        if (P->rp == 2) return launch_sfw_t<DP, T, MODE, 32, 2, 2, 2>(g, P, tiles, tk, tv);
    }
    if (P->nw == 2) launch_sfw_t<DP, T, MODE, 32, 2, 2>(g, P, tiles, tk, tv); /* two positions per CTA */
    else if (P->bn == 64) launch_sfw_t<DP, T, MODE, 64, 2, 1>(g, P, tiles, tk, tv);
    else if (P->nst == 3) launch_sfw_t<DP, T, MODE, 32, 3, 1>(g, P, tiles, tk, tv);
    else launch_sfw_t<DP, T, MODE, 32, 2, 1>(g, P, tiles, tk, tv);
}

template <int DP, typename T>
static void launch_kwg_t(grun *g, const kparams *P, int64_t tiles)
{
    const size_t smem = kwg_smem(DP);
    g_check(g, cudaFuncSetAttribute(kwg_kernel<DP, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (g->err != NSA_STATUS_SUCCESS) return;
    kwg_kernel<DP, T><<<dim3((unsigned)tiles, (unsigned)P->H), 256, smem, g->st>>>(*P);
    g_launched(g);
}

template <int DP, typename T, bool SLC>
static void launch_kwp_t(grun *g, const kparams *P, int64_t tiles, const void *maps)
{
    const size_t smem = kwp_smem(DP, SLC);
    g_check(g, cudaFuncSetAttribute(kwp_kernel<DP, T, SLC>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (g->err != NSA_STATUS_SUCCESS) return;
    const CUtensorMap *m = (const CUtensorMap *)maps; /* q, dout, k, v */
    /* a further-segments launch finds each task's head from its segment (as ktile) */
    kwp_kernel<DP, T, SLC><<<dim3((unsigned)tiles, P->extra ? 1u : (unsigned)P->H), 384, smem, g->st>>>(*P, m[0], m[1], m[2],
                                                                                                       m[3]);
    g_launched(g);
}

template <int DKP, int DVP, typename T, int MODE>
static void launch_qwg_t(grun *g, const qparams *P, int64_t tiles, const void *maps)
{
    const size_t smem = qwg_smem(DKP, DVP, MODE);
    g_check(g, cudaFuncSetAttribute(qwg_kernel<DKP, DVP, T, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
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
        g_fail(g, NSA_STATUS_NOT_SUPPORTED);
        return;
    }
    qwg_kernel<DKP, DVP, T, MODE><<<(unsigned)grid, 384, smem, g->st>>>(Pl, m[QWG_MAP_K], m[QWG_MAP_V], m[QWG_MAP_Q],
                                                                        m[QWG_MAP_O]);
    g_launched(g);
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

/* The forward / dQ tile of one head-dim class (DKP x DVP) */
#define NSA_HOPPER_QWG_INSTANCE(DKP, DVP)                                                        \
    void nsa_cu_qwg_##DKP(grun *g, const qparams *P, int mode, int bf16, int64_t tiles, const void *maps) \
    {                                                                                            \
        if (bf16) {                                                                              \
            if (mode == MODE_FWD) launch_qwg_t<DKP, DVP, __nv_bfloat16, MODE_FWD>(g, P, tiles, maps); \
            else launch_qwg_t<DKP, DVP, __nv_bfloat16, MODE_DQ>(g, P, tiles, maps);            \
        } else {                                                                                 \
            if (mode == MODE_FWD) launch_qwg_t<DKP, DVP, __half, MODE_FWD>(g, P, tiles, maps); \
            else launch_qwg_t<DKP, DVP, __half, MODE_DQ>(g, P, tiles, maps);                   \
        }                                                                                        \
    }                                                                                            \
    int nsa_cu_qwg_ready_##DKP(void) { return qwg_ready_t<DKP, DVP>(); }

/* ... and its dK / dV tile (DK == DV only: at 192 / 128 the accumulators would not fit) */
#define NSA_HOPPER_SWG_INSTANCE(DKP)                                                             \
    void nsa_cu_swg_##DKP(grun *g, const sparams *P, int bf16, int64_t tiles, const void *maps)  \
    {                                                                                            \
        if (bf16) launch_swg_t<DKP, __nv_bfloat16>(g, P, tiles, maps);                           \
        else launch_swg_t<DKP, __half>(g, P, tiles, maps);                                       \
    }

/* ... the selected-attention tile (DK == DV) */
#define NSA_HOPPER_SFW_INSTANCE(DP)                                                              \
    void nsa_cu_sfw_##DP(grun *g, const qparams *P, int mode, int bf16, int64_t tiles, const void *tk, const void *tv) \
    {                                                                                            \
        if (bf16) {                                                                              \
            if (mode == MODE_FWD) launch_sfw_m<DP, __nv_bfloat16, MODE_FWD>(g, P, tiles, tk, tv);\
            else launch_sfw_m<DP, __nv_bfloat16, MODE_DQ>(g, P, tiles, tk, tv);                  \
        } else {                                                                                 \
            if (mode == MODE_FWD) launch_sfw_m<DP, __half, MODE_FWD>(g, P, tiles, tk, tv);       \
            else launch_sfw_m<DP, __half, MODE_DQ>(g, P, tiles, tk, tv);                         \
        }                                                                                        \
    }

#define NSA_HOPPER_INSTANCE(DP)                                                                  \
    NSA_HOPPER_QWG_INSTANCE(DP, DP)                                                              \
    NSA_HOPPER_SWG_INSTANCE(DP)                                                                  \
    NSA_HOPPER_SFW_INSTANCE(DP)                                                                  \
    void nsa_cu_kwg_##DP(grun *g, const kparams *P, int bf16, int64_t tiles)                     \
    {                                                                                            \
        if (bf16) launch_kwg_t<DP, __nv_bfloat16>(g, P, tiles);                                  \
        else launch_kwg_t<DP, __half>(g, P, tiles);                                              \
    }                                                                                            \
    void nsa_cu_kwp_##DP(grun *g, const kparams *P, int bf16, int slc, int64_t tiles, const void *maps) \
    {                                                                                            \
        if (slc) {                                                                               \
            if (bf16) launch_kwp_t<DP, __nv_bfloat16, true>(g, P, tiles, maps);                  \
            else launch_kwp_t<DP, __half, true>(g, P, tiles, maps);                              \
        } else {                                                                                 \
            if (bf16) launch_kwp_t<DP, __nv_bfloat16, false>(g, P, tiles, maps);                 \
            else launch_kwp_t<DP, __half, false>(g, P, tiles, maps);                             \
        }                                                                                        \
    }

#endif /* __CUDACC__ */
#endif
