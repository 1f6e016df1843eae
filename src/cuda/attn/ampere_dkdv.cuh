/* attn/ampere_dkdv.cuh -- ktile_kernel: dK and dV of any rule on mma.sync: a CTA owns 64 keys
 * (16 per warp) of a task (dkdv_tasks.cuh) and streams the 64-row chunks of Q and dO that see
 * them through a three-slot cp.async pipeline. */
#ifndef NSA_CUDA_ATTN_AMPERE_DKDV_CUH
#define NSA_CUDA_ATTN_AMPERE_DKDV_CUH

#include "dkdv_tasks.cuh"
#include "../prim/nonfinite.cuh"

#if defined(__CUDACC__)

/* Shared memory of ktile_kernel<DKP, DVP>: byte offsets in carving order (rows padded by 8
 * elements against bank conflicts); the host reserves bytes (ktile_smem, checked below). */
template <int DKP, int DVP> struct ktile_layout {
    static constexpr size_t BK = QT_BN, BQ = 64, LDK = DKP + 8, LDV = DVP + 8;
    static constexpr size_t k = 0, v = k + BK * LDK * 2;          /* the task's K and V */
    static constexpr size_t q = v + BK * LDV * 2;                 /* [2][BQ][LDK] Q stages */
    static constexpr size_t d = q + 2 * BQ * LDK * 2;             /* [2][BQ][LDV] dO stages */
    static constexpr size_t rq = d + 2 * BQ * LDV * 2;            /* [3][BQ] q row offsets */
    static constexpr size_t ro = rq + 3 * BQ * sizeof(int64_t);   /* [3][BQ] dout row offsets */
    static constexpr size_t rl2 = ro + 3 * BQ * sizeof(int64_t);  /* [3][BQ] lse */
    static constexpr size_t rD = rl2 + 3 * BQ * 4, rg = rD + 3 * BQ * 4; /* [3][BQ] D, gate */
    static constexpr size_t rlo = rg + 3 * BQ * 4, rhi = rlo + 3 * BQ * 4; /* [3][BQ] visible keys */
    static constexpr size_t rfull = rhi + 3 * BQ * 4;             /* [3][2] whole-chunk flags */
    static constexpr size_t bytes = rfull + 3 * 2 * 4;
    static_assert(bytes == ktile_smem(DKP, DVP), "ktile_smem reserves exactly this layout");
};

template <int DKP, int DVP, typename T>
__global__ void __launch_bounds__(128) ktile_kernel(const kparams P)
{
    if (nf_set(P.nf)) return; /* a non-finite input: the scalar kernels run this call (nonfinite.cuh) */
    constexpr int LDK = DKP + 8, LDV = DVP + 8, BK = QT_BN, BQ = 64, NT = BQ / 8, KT = DKP / 16, VT = DVP / 16;
    extern __shared__ __align__(16) unsigned char smem[];
    const int nthr = 128, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    using L = ktile_layout<DKP, DVP>;
    T *Ks = (T *)(smem + L::k), *Vs = (T *)(smem + L::v);
    T *Qs = (T *)(smem + L::q), *Ds = (T *)(smem + L::d);
    int64_t *rq = (int64_t *)(smem + L::rq), *ro = (int64_t *)(smem + L::ro);
    float *rl2 = (float *)(smem + L::rl2), *rD = (float *)(smem + L::rD), *rg = (float *)(smem + L::rg);
    int *rlo = (int *)(smem + L::rlo), *rhi = (int *)(smem + L::rhi);
    int *rfull = (int *)(smem + L::rfull); /* [3][2]: every row of the slot's warp half sees all BK keys */

    /* the task lives in shared memory: the row fill of every chunk reads it there instead of
     * holding its ~20 registers through the products (spilled otherwise) */
    __shared__ kt_task ts;
    {
        kt_task t;
        if (!kt_task_get<BK, BQ>(P, &t, tid, nthr)) return;
        if (tid == 0) ts = t;
    }
    __syncthreads();
    const kt_task &t = ts;
    const int h = t.h, k0 = t.k0, k1 = t.k1;
    const kt_rows R = {rq, ro, rl2, rD, rg, rlo, rhi, rfull};

    const int64_t kb = t.sq.b * P.k.s0 + (t.key_row0 + k0) * P.k.s1 + (int64_t)h * P.k.s2;
    const int64_t vb = t.sq.b * P.v.s0 + (t.key_row0 + k0) * P.v.s1 + (int64_t)h * P.v.s2;
    load_rows_lin<T, DKP>(Ks, LDK, (const T *)P.k.p, kb, P.k.s1, k1 - k0, BK, P.DK, P.k.al, tid, nthr);
    load_rows_lin<T, DVP>(Vs, LDV, (const T *)P.v.p, vb, P.v.s1, k1 - k0, BK, P.DV, P.v.al, tid, nthr);

    const int64_t nchunks = (t.nrows + BQ - 1) / BQ;

#define KT_ISSUE(stage, rs)                                                                      \
    do {                                                                                         \
        load_rows<T, DKP>(Qs + (stage) * BQ * LDK, LDK, (const T *)P.q.p, rq + (rs) * BQ, BQ, P.DK, P.q.al, tid, nthr); \
        load_rows<T, DVP>(Ds + (stage) * BQ * LDV, LDV, (const T *)P.dout.p, ro + (rs) * BQ, BQ, P.DV, P.dout.al, tid, nthr); \
    } while (0)

    /* rows of chunk c live in slot c % 3, filled two chunks ahead; data in stage c & 1 */
    kt_fill<BQ>(P, t, R, 0, 0, tid);
    if (nchunks > 1) kt_fill<BQ>(P, t, R, 1, 1, tid);
    __syncthreads();
    KT_ISSUE(0, 0);
    cp_commit();

    float dK[DKP / 8][4], dV[DVP / 8][4];
#pragma unroll
    for (int i = 0; i < DKP / 8; i++) dK[i][0] = dK[i][1] = dK[i][2] = dK[i][3] = 0.0f;
#pragma unroll
    for (int i = 0; i < DVP / 8; i++) dV[i][0] = dV[i][1] = dV[i][2] = dV[i][3] = 0.0f;
    int kr[2];
    kr[0] = k0 + warp * 16 + (lane >> 2);
    kr[1] = kr[0] + 8;

    const sc_capbw cap = sc_capbw_of(P.rule, P.scale); /* (all 0 without a softcap) */
    for (int64_t c = 0; c < nchunks; c++) {
        const int st = (int)(c & 1), sl = (int)(c % 3);
        cp_wait<0>();
        __syncthreads(); /* chunk c landed; everyone is done with chunk c - 1 */
        if (c + 1 < nchunks) KT_ISSUE(st ^ 1, (int)((c + 1) % 3));
        cp_commit();
        if (c + 2 < nchunks) kt_fill<BQ>(P, t, R, (int)((c + 2) % 3), c + 2, tid);
        const T *Qp = Qs + st * BQ * LDK, *Dp = Ds + st * BQ * LDV;
        const float *l2 = rl2 + sl * BQ, *Dr = rD + sl * BQ, *gr = rg + sl * BQ;
        const int *lo = rlo + sl * BQ, *hi = rhi + sl * BQ;

        float S[NT][4], dP[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
            dP[nt][0] = dP[nt][1] = dP[nt][2] = dP[nt][3] = 0.0f;
        }
        /* S^T = K Q^T (keys x rows) */
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            uint32_t a[4];
            ldsm4(a, Ks + warp * 16 * LDK + kk * 16 + frag_a_off(lane, LDK));
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                uint32_t b[4];
                ldsm4(b, Qp + np * 16 * LDK + kk * 16 + frag_bn_off(lane, LDK));
                dtraits<T>::mma(S[2 * np], a, b[0], b[1]);
                dtraits<T>::mma(S[2 * np + 1], a, b[2], b[3]);
            }
        }
        /* dP^T = V dO^T */
#pragma unroll
        for (int kk = 0; kk < VT; kk++) {
            uint32_t a[4];
            ldsm4(a, Vs + warp * 16 * LDV + kk * 16 + frag_a_off(lane, LDV));
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                uint32_t b[4];
                ldsm4(b, Dp + np * 16 * LDV + kk * 16 + frag_bn_off(lane, LDV));
                dtraits<T>::mma(dP[2 * np], a, b[0], b[1]);
                dtraits<T>::mma(dP[2 * np + 1], a, b[2], b[3]);
            }
        }
        /* P^T (masked), dS^T = P^T (g dP^T - D); S becomes g P^T for dV. Most chunks of a
         * range rule are whole (every row sees all BK keys: the compressed branch's rows past
         * the first ~BK * d positions, the window's interior): those skip the per-element
         * bounds (two shared loads and compares each) for the same values. */
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
        /* dV += (g P)^T dO, dK += dS^T Q */
#pragma unroll
        for (int k2 = 0; k2 < NT / 2; k2++) {
            uint32_t a[4], d[4];
            sc_frag_a<T>(a, S[2 * k2], S[2 * k2 + 1]);
            sc_frag_a<T>(d, dP[2 * k2], dP[2 * k2 + 1]);
#pragma unroll
            for (int vp = 0; vp < VT; vp++) {
                uint32_t b[4];
                ldsm4t(b, Dp + k2 * 16 * LDV + vp * 16 + frag_bk_off(lane, LDV));
                dtraits<T>::mma(dV[2 * vp], a, b[0], b[1]);
                dtraits<T>::mma(dV[2 * vp + 1], a, b[2], b[3]);
            }
#pragma unroll
            for (int dp = 0; dp < KT; dp++) {
                uint32_t b[4];
                ldsm4t(b, Qp + k2 * 16 * LDK + dp * 16 + frag_bk_off(lane, LDK));
                dtraits<T>::mma(dK[2 * dp], d, b[0], b[1]);
                dtraits<T>::mma(dK[2 * dp + 1], d, b[2], b[3]);
            }
        }
    }
    cp_wait<0>();
#undef KT_ISSUE

#pragma unroll
    for (int x = 0; x < 2; x++) {
        const int key = kr[x];
        if (key >= k1) continue;
        const int64_t row = (t.sq.b * P.KR + t.key_row0 + key) * P.H + h, slot = t.slot;
        if (slot >= 0) { /* this segment's partial, written whole (the reduce adds them in order) */
            float *pk = P.part + slot * BK * (P.DK + P.DV) + kt_part_off(BK, P.DK, P.DV, key - k0, 0);
            float *pv = P.part + slot * BK * (P.DK + P.DV) + kt_part_off(BK, P.DK, P.DV, key - k0, P.DK);
#pragma unroll
            for (int d = 0; d < DKP / 8; d++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int col = d * 8 + 2 * (lane & 3) + e;
                    if (col < P.DK) pk[col] = dK[d][2 * x + e] * P.scale;
                }
#pragma unroll
            for (int d = 0; d < DVP / 8; d++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int col = d * 8 + 2 * (lane & 3) + e;
                    if (col < P.DV) pv[col] = dV[d][2 * x + e];
                }
            continue;
        }
        float *dk = P.dk + row * P.DK, *dv = P.dv + row * P.DV;
#pragma unroll
        for (int d = 0; d < DKP / 8; d++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = d * 8 + 2 * (lane & 3) + e;
                if (col < P.DK) dk[col] += dK[d][2 * x + e] * P.scale;
            }
#pragma unroll
        for (int d = 0; d < DVP / 8; d++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = d * 8 + 2 * (lane & 3) + e;
                if (col < P.DV) dv[col] += dV[d][2 * x + e];
            }
    }
}

/* ---- launcher ---- */

template <int DKP, int DVP, typename T>
static void launch_ktile_t(grun *g, const kparams *P, int64_t tiles)
{
    const size_t smem = ktile_layout<DKP, DVP>::bytes;
    g_smem_optin(g, (const void *)ktile_kernel<DKP, DVP, T>, smem);
    if (g->err != NSA_STATUS_SUCCESS) return;
    ktile_kernel<DKP, DVP, T><<<dim3((unsigned)tiles, P->extra ? 1u : (unsigned)P->H), 128, smem, g->st>>>(*P);
    g_launched(g);
}

#endif /* __CUDACC__ */

#endif
