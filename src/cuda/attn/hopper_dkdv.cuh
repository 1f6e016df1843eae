/* attn/hopper_dkdv.cuh -- the sm_90a dK / dV tiles on wgmma, the tasks of ktile at 128 keys
 * (dkdv_tasks.cuh):
 *   kwp_kernel  range rules, and the selected rule over its inverted lists, when G divides 64,
 *               head dims 64 / 128: a producer warpgroup loads Q / dO chunks of 64 rows by TMA
 *               (whole positions x G heads) and fills the row slots; two consumer warpgroups
 *               (range: 64 keys each of a 128-key tile, every chunk; selected: the block's 64
 *               keys, alternate chunks) never meet at a CTA barrier.
 *   kwg_kernel  the same range-rule tasks for the other G (Q / dO rows by cp.async, the two
 *               warpgroups in step); its sums equal kwp's bit for bit.
 * Deterministic: same tasks and ordered partials as ktile. The kernel bodies exist only in the
 * sm_90a build. */
#ifndef NSA_CUDA_ATTN_HOPPER_DKDV_CUH
#define NSA_CUDA_ATTN_HOPPER_DKDV_CUH

#include "dkdv_tasks.cuh"
#include "../prim/wgmma.cuh"
#include "../prim/nonfinite.cuh"

#if defined(__CUDACC__)

/* The dK / dV tiles' first two products for one chunk: S^T = K Q^T and dP^T = V dO^T (keys x
 * rows, wgmma SS, all operands K-major: descriptors of this warpgroup's 64 keys of the BK-key
 * K and V tiles and of the chunk's Q and dO). SPLIT commits S alone first (its consumer waits
 * for S while dP runs). */
template <typename T, int DP, int BK, int BQ, bool SPLIT>
__device__ __forceinline__ void kw_products(float (*S)[4], float (*dP)[4], uint64_t dk, uint64_t dv, uint64_t dq, uint64_t ddo)
{
    constexpr int KT = DP / 16;
    wg_fence();
    wg_ss_kd<T, BQ, KT, BK, BQ>(&S[0][0], dk, dq);
    if (SPLIT) wg_commit();
    wg_ss_kd<T, BQ, KT, BK, BQ>(&dP[0][0], dv, ddo);
    wg_commit();
}

/* Rows n and n + 1 (n even) of a row slot, one 8-byte shared load: a thread's columns of the
 * accumulator layout come in such pairs. (Only the range rules' tile reads its slots this way:
 * in the selected rule's, ptxas then spilled and serialised the products.) */
__device__ __forceinline__ float2 kw_pair(const float *slot, int n) { return *(const float2 *)(slot + n); }
__device__ __forceinline__ int2 kw_pair(const int *slot, int n) { return *(const int2 *)(slot + n); }

/* Two neighbouring columns of a dK / dV output row: the tile's dtype T, or f32. */
template <typename T>
__device__ __forceinline__ void kw_put2(const dview &o, int64_t off, float a, float b)
{
    if (o.dt == NSA_DTYPE_F32) *(float2 *)((float *)o.p + off) = make_float2(a, b);
    else *(uint32_t *)((T *)o.p + off) = dtraits<T>::pack(a, b);
}

/* The dK / dV tiles' epilogue (as ktile's): this thread's two keys' fp32 sums added into
 * dk / dv, or, for a further row segment, its partial of BK keys written whole (scale folded
 * into dK); with dko / dvo set, the sums are the keys' whole gradient, stored once. */
template <int DP, int BK, typename T>
__device__ __forceinline__ void kwg_store(const kparams &P, const kt_task &t, const int kr[2], const float (*dK)[4],
                                          const float (*dV)[4], int lane)
{
    const int h = t.h, k0 = t.k0, k1 = t.k1;
#pragma unroll
    for (int x = 0; x < 2; x++) {
        const int key = kr[x];
        if (key >= k1) continue;
        if (P.dko.p) {
            const int64_t row = t.sq.b * P.dko.s0 + (t.key_row0 + key) * P.dko.s1 + (int64_t)h * P.dko.s2;
            const int64_t rowv = t.sq.b * P.dvo.s0 + (t.key_row0 + key) * P.dvo.s1 + (int64_t)h * P.dvo.s2;
#pragma unroll
            for (int d = 0; d < DP / 8; d++) {
                const int col = d * 8 + 2 * (lane & 3);
                kw_put2<T>(P.dko, row + col, dK[d][2 * x] * P.scale, dK[d][2 * x + 1] * P.scale);
                kw_put2<T>(P.dvo, rowv + col, dV[d][2 * x], dV[d][2 * x + 1]);
            }
            continue;
        }
        float *pk, *pv;
        const int64_t slot = t.slot;
        if (slot >= 0) {
            pk = P.part + slot * BK * (P.DK + P.DV) + kt_part_off(BK, P.DK, P.DV, key - k0, 0);
            pv = P.part + slot * BK * (P.DK + P.DV) + kt_part_off(BK, P.DK, P.DV, key - k0, P.DK);
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
/* Shared memory of kwg_kernel<DP>: byte offsets from the 1024-aligned base in carving order;
 * the host reserves bytes + 1024 (kwg_smem, checked below). Row slots: three stages of BQ. */
template <int DP> struct kwg_layout {
    static constexpr size_t BK = KWG_BK, BQ = 64, KB = BK * DP * 2, TB = BQ * DP * 2; /* key tile, row chunk */
    static constexpr size_t k = 0, v = k + KB;                  /* K and V of the task's keys */
    static constexpr size_t q = v + KB;                         /* [2] Q chunks */
    static constexpr size_t d = q + 2 * TB;                     /* [2] dO chunks */
    static constexpr size_t rq = d + 2 * TB;                    /* [3][BQ] q row offsets */
    static constexpr size_t ro = rq + 3 * BQ * sizeof(int64_t); /* [3][BQ] dout row offsets */
    static constexpr size_t rl2 = ro + 3 * BQ * sizeof(int64_t); /* [3][BQ] lse */
    static constexpr size_t rD = rl2 + 3 * BQ * 4, rg = rD + 3 * BQ * 4; /* [3][BQ] D, gate */
    static constexpr size_t rlo = rg + 3 * BQ * 4, rhi = rlo + 3 * BQ * 4; /* [3][BQ] visible keys */
    static constexpr size_t rfull = rhi + 3 * BQ * 4;           /* [3][2] whole-chunk flags */
    static constexpr size_t bytes = rfull + 3 * 2 * 4;
    static_assert(bytes + 1024 == kwg_smem(DP), "kwg_smem reserves exactly this layout");
};

template <int DP, typename T>
__global__ void __launch_bounds__(256, 1) kwg_kernel(const kparams P)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if (nf_set(P.nf)) return; /* a non-finite input: the scalar kernels run this call (nonfinite.cuh) */
    constexpr int BK = KWG_BK, BQ = 64, NT = BQ / 8, NTHR = 256;
    constexpr int TB = BQ * DP * 2; /* row chunk */
    using L = kwg_layout<DP>;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_align1024(smem_raw);
    unsigned char *Ks = smem + L::k, *Vs = smem + L::v;
    unsigned char *Qs = smem + L::q, *Ds = smem + L::d;
    int64_t *rq = (int64_t *)(smem + L::rq), *ro = (int64_t *)(smem + L::ro);
    float *rl2 = (float *)(smem + L::rl2), *rD = (float *)(smem + L::rD), *rg = (float *)(smem + L::rg);
    int *rlo = (int *)(smem + L::rlo), *rhi = (int *)(smem + L::rhi), *rfull = (int *)(smem + L::rfull);
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

    const sc_capbw cap = sc_capbw_of(P.rule, P.scale); /* (all 0 without a softcap) */
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
        kw_products<T, DP, BK, BQ, false>(S, dP, wg_desc_k(Ks + wg * 64 * 128), wg_desc_k(Vs + wg * 64 * 128),
                                          wg_desc_k(Qp), wg_desc_k(Dp));
        wg_wait<0>();

        /* P^T (masked), dS^T = P^T (g dP^T - D); S becomes g P^T for dV (as ktile) */
        const bool whole = k1 - k0 == BK && rfull[sl * 2] && rfull[sl * 2 + 1];
        if (cap.k != 0.0f) { /* a softcap: its factor on dS */
            if (whole) kt_cap_prob_ds<true, NT>(S, dP, cap, l2, gr, Dr, lo, hi, kr, k1, lane);
            else kt_cap_prob_ds<false, NT>(S, dP, cap, l2, gr, Dr, lo, hi, kr, k1, lane);
        } else if (whole) { /* (written out: dkdv_tasks.cuh says why) */
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
        wg_rs_mn<T, DP, BQ, BQ>(&dV[0][0], pa, Dp);
        wg_rs_mn<T, DP, BQ, BQ>(&dK[0][0], da, Qp);
        wg_commit();
        wg_wait<0>();
    }
    cp_wait<0>();

    kwg_store<DP, KWG_BK, T>(P, t, kr, dK, dV, lane);
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
/* Shared memory of kwp_kernel<DP, SLC>: byte offsets from the 1024-aligned base in carving
 * order; the host reserves bytes + 1024 (kwp_smem, checked below). NS stages of Q / dO rows,
 * each with its full / empty mbarrier and row slots (no row offsets: TMA). */
template <int DP, bool SLC> struct kwp_layout {
    static constexpr size_t BK = SLC ? 64 : KWG_BK, BQ = 64, NS = SLC ? KWP_NS_SLC : KWP_NS;
    static constexpr size_t KB = BK * DP * 2, TB = BQ * DP * 2; /* key tile, row chunk */
    static constexpr size_t k = 0, v = k + KB;                  /* K and V of the task's keys */
    static constexpr size_t q = v + KB;                         /* [NS] Q chunks */
    static constexpr size_t d = q + NS * TB;                    /* [NS] dO chunks */
    static constexpr size_t full = d + NS * TB;                 /* [NS] chunk landed */
    static constexpr size_t empty = full + NS * sizeof(uint64_t); /* [NS] chunk released */
    static constexpr size_t rl2 = empty + NS * sizeof(uint64_t); /* [NS][BQ] lse */
    static constexpr size_t rD = rl2 + NS * BQ * 4, rg = rD + NS * BQ * 4; /* [NS][BQ] D, gate */
    static constexpr size_t rlo = rg + NS * BQ * 4, rhi = rlo + NS * BQ * 4; /* [NS][BQ] visible keys */
    static constexpr size_t rfull = rhi + NS * BQ * 4;          /* [NS][2] whole-chunk flags */
    static constexpr size_t bytes = rfull + NS * 2 * 4;
    static_assert(bytes + 1024 == kwp_smem(DP, SLC), "kwp_smem reserves exactly this layout");
};

template <int DP, typename T, bool SLC>
__global__ void __launch_bounds__(384, 1) kwp_kernel(const kparams P, const __grid_constant__ CUtensorMap tq,
                                                     const __grid_constant__ CUtensorMap tdo,
                                                     const __grid_constant__ CUtensorMap tk,
                                                     const __grid_constant__ CUtensorMap tv)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if (nf_set(P.nf)) return; /* a non-finite input: the scalar kernels run this call (nonfinite.cuh) */
    constexpr int BK = SLC ? 64 : KWG_BK, BQ = 64, NT = BQ / 8, NS = SLC ? KWP_NS_SLC : KWP_NS;
    constexpr int KB = BK * DP * 2, TB = BQ * DP * 2; /* key tile, row chunk */
    using L = kwp_layout<DP, SLC>;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_align1024(smem_raw);
    unsigned char *Ks = smem + L::k, *Vs = smem + L::v;
    unsigned char *Qs = smem + L::q, *Ds = smem + L::d;
    uint64_t *full = (uint64_t *)(smem + L::full), *empty = (uint64_t *)(smem + L::empty);
    float *rl2 = (float *)(smem + L::rl2), *rD = (float *)(smem + L::rD), *rg = (float *)(smem + L::rg);
    int *rlo = (int *)(smem + L::rlo), *rhi = (int *)(smem + L::rhi), *rfull = (int *)(smem + L::rfull);
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
            if (c >= NS) mb_wait_sleep(&empty[s], (int)(((c / NS) & 1) ^ 1));
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
    /* the products' descriptors, all from the two of the shared base (every tile sits at a
     * fixed offset from it): K and V fixed, Q and dO of stage s at s * TB from stage 0's */
    const uint64_t bk = wg_desc_k(smem), bm = wg_desc_mn<BQ>(smem);
    const uint64_t dk = wg_desc_at(bk, L::k + aoff), dv = wg_desc_at(bk, L::v + aoff);
    /* the softcap's constants (all 0 without one; the selected rule never has one) */
    const sc_capbw cap = SLC ? sc_capbw{0.0f, 0.0f, 0.0f} : sc_capbw_of(P.rule, P.scale);
    const int c0 = 2 * (lane & 3); /* this thread's first column of each 8-column block */

    for (int64_t c = SLC ? cw : 0; c < nchunks; c += SLC ? 2 : 1) {
        const int s = (int)(c % NS);
        mb_wait(&full[s], (int)((c / NS) & 1));
        const uint32_t so = (uint32_t)s * TB; /* stage s's chunk, from stage 0's */
        const float *l2 = rl2 + s * BQ, *Dr = rD + s * BQ, *gr = rg + s * BQ;
        const int *lo = rlo + s * BQ, *hi = rhi + s * BQ;

        /* the range rules read the whole-chunk flags before the products, so that their
         * shared-memory latency does not sit between S landing and its exponentials (the
         * selected rule reads them after: held across the products, the flag made it spill) */
        bool whole = false;
        if constexpr (!SLC) whole = k1 - k0 == BK && rfull[s * 2] && rfull[s * 2 + 1];
        float S[NT][4], dP[NT][4];
        kw_products<T, DP, BK, BQ, true>(S, dP, dk, dv, wg_desc_at(bk, L::q + so), wg_desc_at(bk, L::d + so));
        wg_wait<1>(); /* S^T ready, dP^T still on the tensor cores */
        if constexpr (SLC) whole = k1 - k0 == BK && rfull[s * 2] && rfull[s * 2 + 1];

        /* P^T (masked) in S; (g P)^T as the A fragments of dV. Row values in pairs (rows c0 + 8 nt
         * and the next: columns e & 1 of the accumulator layout). */
        uint32_t pa[BQ / 16][4], da[BQ / 16][4];
        if (!SLC && cap.k != 0.0f) { /* a softcap (the selected rule has none) */
            if (whole) kt_cap_prob<true, NT>(S, cap, l2, lo, hi, kr, k1, lane);
            else kt_cap_prob<false, NT>(S, cap, l2, lo, hi, kr, k1, lane);
        } else if (SLC && whole) { /* (written out: dkdv_tasks.cuh says why) */
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int n = nt * 8 + 2 * (lane & 3) + (e & 1);
                    S[nt][e] = ex2(S[nt][e] * P.sl2 - kt_l2(l2[n]));
                }
        } else if (SLC) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int n = nt * 8 + 2 * (lane & 3) + (e & 1), key = kr[e >> 1];
                    const int vis = key < k1 && key >= lo[n] && key <= hi[n];
                    S[nt][e] = vis ? ex2(S[nt][e] * P.sl2 - kt_l2(l2[n])) : 0.0f;
                }
        } else if (whole) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const float2 l = kw_pair(l2, nt * 8 + c0);
                const float m[2] = {kt_l2(l.x), kt_l2(l.y)};
#pragma unroll
                for (int e = 0; e < 4; e++) S[nt][e] = ex2(S[nt][e] * P.sl2 - m[e & 1]);
            }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const float2 l = kw_pair(l2, nt * 8 + c0);
                const int2 a = kw_pair(lo, nt * 8 + c0), z = kw_pair(hi, nt * 8 + c0);
                const float m[2] = {kt_l2(l.x), kt_l2(l.y)};
                const int vlo[2] = {a.x, a.y}, vhi[2] = {z.x, z.y};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = kr[e >> 1];
                    const int vis = key < k1 && key >= vlo[e & 1] && key <= vhi[e & 1];
                    S[nt][e] = vis ? ex2(S[nt][e] * P.sl2 - m[e & 1]) : 0.0f;
                }
            }
        }
#pragma unroll
        for (int k2 = 0; k2 < BQ / 16; k2++) {
            float a[4], b[4];
            if constexpr (SLC) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    a[e] = S[2 * k2][e] * gr[2 * k2 * 8 + 2 * (lane & 3) + (e & 1)];
                    b[e] = S[2 * k2 + 1][e] * gr[(2 * k2 + 1) * 8 + 2 * (lane & 3) + (e & 1)];
                }
            } else {
                const float2 ga = kw_pair(gr, 2 * k2 * 8 + c0), gb = kw_pair(gr, (2 * k2 + 1) * 8 + c0);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    a[e] = S[2 * k2][e] * (e & 1 ? ga.y : ga.x);
                    b[e] = S[2 * k2 + 1][e] * (e & 1 ? gb.y : gb.x);
                }
            }
            sc_frag_a<T>(pa[k2], a, b);
        }
        wg_fence();
        wg_rs_md<T, DP, BQ>(&dV[0][0], pa, wg_desc_at(bm, L::d + so));
        wg_commit();
        wg_wait<1>(); /* dP^T ready, dV on the tensor cores */

        /* dS^T = P^T (g dP^T - D) (times the softcap's factor) */
        if (!SLC && cap.k != 0.0f) {
            kt_cap_ds<NT>(dP, S, cap, l2, gr, Dr, lane);
        } else if (SLC) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int n = nt * 8 + 2 * (lane & 3) + (e & 1);
                    dP[nt][e] = S[nt][e] * (dP[nt][e] * gr[n] - Dr[n]);
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const float2 g = kw_pair(gr, nt * 8 + c0), d = kw_pair(Dr, nt * 8 + c0);
#pragma unroll
                for (int e = 0; e < 4; e++) dP[nt][e] = S[nt][e] * (dP[nt][e] * (e & 1 ? g.y : g.x) - (e & 1 ? d.y : d.x));
            }
        }
#pragma unroll
        for (int k2 = 0; k2 < BQ / 16; k2++) sc_frag_a<T>(da[k2], dP[2 * k2], dP[2 * k2 + 1]);
        wg_fence();
        wg_rs_md<T, DP, BQ>(&dK[0][0], da, wg_desc_at(bm, L::q + so));
        wg_commit();
        wg_wait<0>();
        mb_arrive(&empty[s]); /* stage s free for chunk c + NS (each thread releases its own reads) */
    }

    if (SLC) { /* warpgroup 1's sums into warpgroup 0's (same fragment layout), in that order */
        float4 *red = (float4 *)Qs; /* the stages are free once both warpgroups are done */
        const int ct = tid - 128;   /* 0 .. 255 */
        nb_sync(NB_DKDV_SUM);
        if (cw == 1)
#pragma unroll
            for (int d = 0; d < DP / 8; d++) {
                red[(2 * d) * 128 + ct - 128] = make_float4(dK[d][0], dK[d][1], dK[d][2], dK[d][3]);
                red[(2 * d + 1) * 128 + ct - 128] = make_float4(dV[d][0], dV[d][1], dV[d][2], dV[d][3]);
            }
        nb_sync(NB_DKDV_SUM);
        if (cw == 1) return;
#pragma unroll
        for (int d = 0; d < DP / 8; d++) {
            const float4 a = red[(2 * d) * 128 + ct], v = red[(2 * d + 1) * 128 + ct];
            dK[d][0] += a.x, dK[d][1] += a.y, dK[d][2] += a.z, dK[d][3] += a.w;
            dV[d][0] += v.x, dV[d][1] += v.y, dV[d][2] += v.z, dV[d][3] += v.w;
        }
    }
    kwg_store<DP, BK, T>(P, t, kr, dK, dV, lane);
#endif
}

/* ---- launchers ---- */

template <int DP, typename T>
static void launch_kwg_t(grun *g, const kparams *P, int64_t tiles)
{
    const size_t smem = kwg_layout<DP>::bytes + 1024;
    g_smem_optin(g, (const void *)kwg_kernel<DP, T>, smem);
    if (g->err != NSA_STATUS_SUCCESS) return;
    kwg_kernel<DP, T><<<dim3((unsigned)tiles, (unsigned)P->H), 256, smem, g->st>>>(*P);
    g_launched(g);
}

template <int DP, typename T, bool SLC>
static void launch_kwp_t(grun *g, const kparams *P, int64_t tiles, const void *maps)
{
    const size_t smem = kwp_layout<DP, SLC>::bytes + 1024;
    g_smem_optin(g, (const void *)kwp_kernel<DP, T, SLC>, smem);
    if (g->err != NSA_STATUS_SUCCESS) return;
    const CUtensorMap *m = (const CUtensorMap *)maps; /* q, dout, k, v */
    /* a further-segments launch finds each task's head from its segment (as ktile) */
    kwp_kernel<DP, T, SLC><<<dim3((unsigned)tiles, P->extra ? 1u : (unsigned)P->H), 384, smem, g->st>>>(*P, m[0], m[1], m[2],
                                                                                                       m[3]);
    g_launched(g);
}

#endif /* __CUDACC__ */

#endif
