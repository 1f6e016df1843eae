/* step/tiled.cu -- the inference step on tensor cores (step.h explains the split): mma.sync
 * m16n8k16 products of an item's 16 query rows (its G heads, zero-padded) with 64-key tiles
 * staged by cp.async, two tiles in flight per CTA; an online softmax whose running maximum all
 * four warps of a CTA share, so their partial outputs add without rescaling. Lengths, pages and
 * selections are read on the device and the grid depends on capacities only, so a captured
 * graph replays for any lengths. Arithmetic in fp32; the probabilities enter the P V product
 * rounded to the storage dtype, as in the training tiles. */
#include "step.h"

#define TS_THREADS 128
#define TS_TARGET_CTAS 528 /* CTAs a launch aims at: four per SM of a 132-SM part, fixed so the
                              sizing pass (no device query) plans the same workspace */
#define TS_BATCH 4096      /* items per launch round: bounds the partials' workspace */
#define TS_KEYS_MAX 12288  /* selection blocks the top-n keeps in shared memory (96 KiB) */
#define TS_PS_LD 65

enum { BR_CMP = 0, BR_SLC = 1, BR_SWA = 2, BR_RANGE = 3 };

/* floats of one partial: 16 row maxima, 16 row sums, 16 x D unnormalised outputs */
static __host__ __device__ __forceinline__ int64_t ts_part_floats(int D) { return 32 + 16 * (int64_t)D; }

typedef struct ts_launch {
    int kind[2];
    int64_t tasks[2], tpc[2];
    int64_t ntask; /* tasks[0] + tasks[1] */
    int64_t item0; /* the round's first item */
    float *part;   /* [batch][ntask][ts_part_floats(D)] */
    float *bins;   /* IMP: [batch][tiles][16][JT + 1]: per block sums of p, then the reference max */
    int64_t tiles; /* compressed tiles per item (the bins' stride) */
    int JT;
    const int32_t *sel; /* BR_SLC: [batch][width] */
    int64_t width;
    int tpb;
} ts_launch;

/* NaN-propagating maximum (fmaxf drops a NaN) */
__device__ __forceinline__ float ts_max(float a, float b) { return a > b || a != a ? a : b; }

struct ts_item {
    int64_t b, i, h, pos, L;
    bool live;
};
__device__ __forceinline__ ts_item ts_item_of(const step_params &P, int64_t it)
{
    ts_item x;
    x.h = it % P.H, x.i = (it / P.H) % P.Tq, x.b = it / (P.H * P.Tq);
    x.pos = x.L = 0;
    x.live = P.ok[x.b] != 0;
    if (!x.live) return x;
    const step_seq_t s = step_seq(P, x.b);
    x.live = x.i < s.n;
    x.pos = s.L - s.n + x.i, x.L = s.L;
    return x;
}

/* The keys [lo, hi] a query sees in a contiguous branch. */
__device__ __forceinline__ void ts_range(const step_params &P, int kind, const ts_item &x, int64_t &lo, int64_t &hi)
{
    if (kind == BR_CMP) {
        lo = 0, hi = nsa_rule_cmp_visible_cap(x.pos, P.l, P.d, nsa_rule_num_cmp(x.L, P.l, P.d)) - 1;
    } else if (kind == BR_SWA) {
        lo = x.pos - P.w + 1 > 0 ? x.pos - P.w + 1 : 0, hi = x.pos;
    } else { /* BR_RANGE: the dense step's window, bottom-right causal */
        lo = P.wl < 0 || P.wl >= x.pos ? 0 : x.pos - P.wl;
        hi = P.causal ? x.pos : (P.wr < 0 || P.wr >= x.L - 1 - x.pos ? x.L - 1 : x.pos + P.wr);
    }
}

template <int D> struct ts_smem {
    static constexpr int LD = D + 8; /* padded rows: ldmatrix without bank conflicts */
    static constexpr size_t q = 0, k = q + 16 * LD * 2, v = k + 2 * 64 * LD * 2, roff = v + 2 * 64 * LD * 2,
                            red = roff + 256 * 8, qoff = red + 64 * 4, nrow = qoff + 16 * 8, mref = nrow + 16,
                            ps = mref + 16 * 4, end = ps, end_imp = ps + 16 * TS_PS_LD * 4;
};

/* One task: the tiles [t0, t1) of one branch of one item, as a partial. */
template <typename T, int D, bool IMP>
__global__ void __launch_bounds__(TS_THREADS) ts_split_kernel(const step_params P, const ts_launch A)
{
    typedef ts_smem<D> S;
    constexpr int LD = S::LD, KT = D / 16, NT = D / 8;
    extern __shared__ __align__(16) unsigned char ts_sm[];
    T *Qs = (T *)(ts_sm + S::q), *Ks = (T *)(ts_sm + S::k), *Vs = (T *)(ts_sm + S::v);
    int64_t *roff = (int64_t *)(ts_sm + S::roff), *qoff = (int64_t *)(ts_sm + S::qoff);
    float *red = (float *)(ts_sm + S::red), *mref = (float *)(ts_sm + S::mref), *Ps = (float *)(ts_sm + S::ps);
    int *nrow = (int *)(ts_sm + S::nrow);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t local = blockIdx.x / A.ntask, task = blockIdx.x % A.ntask, it = A.item0 + local;
    const ts_item x = ts_item_of(P, it);
    if (!x.live) return;
    const int bs = task < A.tasks[0] ? 0 : 1, kind = A.kind[bs];
    const int64_t c = bs ? task - A.tasks[0] : task;
    int64_t lo = 0, hi = -1, ntiles;
    if (kind == BR_SLC) {
        ntiles = A.width * A.tpb;
    } else {
        ts_range(P, kind, x, lo, hi);
        ntiles = hi >= lo ? (hi - lo + 64) / 64 : 0;
    }
    const int64_t t0 = c * A.tpc[bs], t1 = t0 + A.tpc[bs] < ntiles ? t0 + A.tpc[bs] : ntiles;
    float *out = A.part + (local * A.ntask + task) * ts_part_floats(D);
    if (t0 >= t1) {
        if (tid < 16) out[tid] = -INFINITY, out[16 + tid] = 0.0f;
        return;
    }
    const step_cache_t &C = kind == BR_CMP ? P.ckv : P.kv;
    const float scale = kind == BR_SWA ? P.swa_scale : P.scale, softcap = kind == BR_RANGE ? P.softcap : 0.0f;
    const bool pv = kind != BR_CMP || P.use_cmp; /* the compressed output is not wanted when only the selection is */

    /* rows [row0, row0 + n) of tile t (n = 0: an unused slot of the selection list) */
    auto tile_rows = [&](int64_t t, int64_t &row0) -> int {
        if (kind == BR_SLC) {
            const int64_t a = t / A.tpb, u = t % A.tpb;
            const int32_t j = A.sel[local * A.width + a];
            if (j < 0) return 0;
            row0 = (int64_t)j * P.lp + 64 * u;
            const int64_t end0 = (int64_t)j * P.lp + P.lp, end1 = nsa_rule_slc_hi(j, x.pos, P.lp, x.L) + 1;
            const int64_t n = (end0 < end1 ? end0 : end1) - row0;
            return n <= 0 ? 0 : n > 64 ? 64 : (int)n;
        }
        row0 = lo + 64 * t;
        const int64_t n = hi + 1 - row0;
        return n > 64 ? 64 : (int)n;
    };
    auto issue = [&](int64_t t, int buf) {
        if (tid < 64) {
            int64_t row0 = 0;
            const int n = tile_rows(t, row0);
            roff[buf * 128 + tid] = tid < n ? step_row(C, C.k, x.b, row0 + tid, x.h) : -1;
            roff[buf * 128 + 64 + tid] = tid < n ? step_row(C, C.v, x.b, row0 + tid, x.h) : -1;
            if (tid == 0) nrow[buf] = n;
        }
        __syncthreads();
        load_rows<T, D>(Ks + buf * 64 * LD, LD, (const T *)C.k.p, roff + buf * 128, 64, D, C.k.al, tid, TS_THREADS);
        if (pv) load_rows<T, D>(Vs + buf * 64 * LD, LD, (const T *)C.v.p, roff + buf * 128 + 64, 64, D, C.v.al, tid, TS_THREADS);
        cp_commit();
    };

    if (tid < 16) qoff[tid] = tid < P.G ? x.b * P.q.s0 + x.i * P.q.s1 + (x.h * P.G + tid) * P.q.s2 : -1;
    __syncthreads();
    load_rows<T, D>(Qs, LD, (const T *)P.q.p, qoff, 16, D, P.q.al, tid, TS_THREADS);
    cp_commit();
    issue(t0, 0);

    uint32_t qf[KT][4];
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float mrun[2] = {-INFINITY, -INFINITY}, lsum[2] = {0.0f, 0.0f};
    const int r0 = lane >> 2;
    for (int64_t t = t0; t < t1; t++) {
        const int buf = (int)((t - t0) & 1);
        if (t + 1 < t1) {
            issue(t + 1, buf ^ 1);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        if (t == t0) {
#pragma unroll
            for (int k = 0; k < KT; k++) ldsm4(qf[k], Qs + frag_a_off(lane, LD) + k * 16);
        }
        const int nr = nrow[buf];
        const T *Kb = Ks + buf * 64 * LD + warp * 16 * LD, *Vb = Vs + buf * 64 * LD + warp * 16 * LD;
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int k = 0; k < KT; k++) {
            uint32_t bb[4];
            ldsm4(bb, Kb + frag_bn_off(lane, LD) + k * 16);
            dtraits<T>::mma(s[0], qf[k], bb[0], bb[1]);
            dtraits<T>::mma(s[1], qf[k], bb[2], bb[3]);
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = warp * 16 + nt * 8 + 2 * (lane & 3) + (e & 1);
                float v = s[nt][e] * scale;
                if (softcap > 0.0f) v = softcap * tanhf(v / softcap);
                if (key >= nr) v = -INFINITY;
                s[nt][e] = v;
                mx[e >> 1] = ts_max(mx[e >> 1], v);
            }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = ts_max(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = ts_max(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        }
        if ((lane & 3) == 0) red[warp * 16 + r0] = mx[0], red[warp * 16 + r0 + 8] = mx[1];
        __syncthreads();
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int g = r0 + 8 * r;
            const float tm = ts_max(ts_max(red[g], red[16 + g]), ts_max(red[32 + g], red[48 + g]));
            const float mn = ts_max(mrun[r], tm);
            alpha[r] = mrun[r] == -INFINITY ? 0.0f : expf(mrun[r] - mn);
            mrun[r] = mn;
        }
        float ps[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float m = mrun[e >> 1];
                const float p = m == -INFINITY ? 0.0f : expf(s[nt][e] - m);
                s[nt][e] = p;
                ps[e >> 1] += p;
            }
        lsum[0] = lsum[0] * alpha[0] + ps[0], lsum[1] = lsum[1] * alpha[1] + ps[1];
        if (pv) {
#pragma unroll
            for (int n = 0; n < NT; n++) acc[n][0] *= alpha[0], acc[n][1] *= alpha[0], acc[n][2] *= alpha[1], acc[n][3] *= alpha[1];
            uint32_t a[4];
            a[0] = dtraits<T>::pack(s[0][0], s[0][1]), a[1] = dtraits<T>::pack(s[0][2], s[0][3]);
            a[2] = dtraits<T>::pack(s[1][0], s[1][1]), a[3] = dtraits<T>::pack(s[1][2], s[1][3]);
#pragma unroll
            for (int n = 0; n < D / 16; n++) {
                uint32_t vb[4];
                ldsm4t(vb, Vb + frag_bk_off(lane, LD) + n * 16);
                dtraits<T>::mma(acc[2 * n], a, vb[0], vb[1]);
                dtraits<T>::mma(acc[2 * n + 1], a, vb[2], vb[3]);
            }
        }
        if (IMP) { /* this tile's share of each block's importance, per head, against mrun */
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    Ps[(r0 + 8 * (e >> 1)) * TS_PS_LD + warp * 16 + nt * 8 + 2 * (lane & 3) + (e & 1)] = s[nt][e];
            if (warp == 0 && (lane & 3) == 0) mref[r0] = mrun[0], mref[r0 + 8] = mrun[1];
            __syncthreads();
            /* 32-bit rules: rows and blocks of a cache that fits int32 (the host checks) */
            const int32_t R0 = (int32_t)(64 * t), j0 = (int32_t)(R0 * P.d / P.lp), l = (int32_t)P.l, d = (int32_t)P.d,
                          lp = (int32_t)P.lp;
            float *bt = A.bins + (local * A.tiles + t) * 16 * (A.JT + 1);
            for (int pr = tid; pr < P.G * A.JT; pr += TS_THREADS) {
                const int g = pr / A.JT, jj = pr % A.JT;
                const int32_t j = j0 + jj;
                const int32_t fa = nsa_rule_slc_first_cmp32(j, l, d, lp), fb = nsa_rule_slc_last_cmp32(j, d, lp);
                const int32_t ra = fa > R0 ? fa : R0, rb = fb < R0 + nr - 1 ? fb : R0 + nr - 1;
                float sum = 0.0f;
                for (int32_t r = ra; r <= rb; r++) sum += Ps[g * TS_PS_LD + (r - R0)] * (float)nsa_rule_overlap32(r, j, l, d, lp);
                bt[g * (A.JT + 1) + jj] = sum;
            }
            if (tid < P.G) bt[tid * (A.JT + 1) + A.JT] = mref[tid];
        }
        __syncthreads();
    }

    /* the CTA's partial: l summed over the quad and the warps, O over the warps */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        lsum[r] += __shfl_xor_sync(0xffffffffu, lsum[r], 1);
        lsum[r] += __shfl_xor_sync(0xffffffffu, lsum[r], 2);
    }
    if ((lane & 3) == 0) red[warp * 16 + r0] = lsum[0], red[warp * 16 + r0 + 8] = lsum[1];
    if (warp == 0 && (lane & 3) == 0) out[r0] = mrun[0], out[r0 + 8] = mrun[1];
    float *Os = (float *)Ks; /* the tiles are done: their space holds the four warps' outputs */
    if (pv) {
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const int col = n * 8 + 2 * (lane & 3);
            Os[(warp * 16 + r0) * D + col] = acc[n][0], Os[(warp * 16 + r0) * D + col + 1] = acc[n][1];
            Os[(warp * 16 + r0 + 8) * D + col] = acc[n][2], Os[(warp * 16 + r0 + 8) * D + col + 1] = acc[n][3];
        }
    }
    __syncthreads();
    if (tid < 16) out[16 + tid] = red[tid] + red[16 + tid] + red[32 + tid] + red[48 + tid];
    if (pv)
        for (int e = tid; e < 16 * D; e += TS_THREADS) out[32 + e] = Os[e] + Os[16 * D + e] + Os[32 * D + e] + Os[48 * D + e];
}

/* The order of the selection as one integer per block: forced first, then a number before a
 * NaN, then larger importance, then the lower index (nsa_rule_ranks_above); never 0. */
__device__ __forceinline__ unsigned long long ts_rank_key(int forced, float imp, int64_t j)
{
    unsigned long long k = (unsigned long long)forced << 63;
    if (imp == imp) {
        const uint32_t bits = imp > 0.0f ? __float_as_uint(imp) & 0x7fffffffu : 0u;
        k |= 1ull << 62 | (unsigned long long)bits << 31;
    }
    return k | (unsigned long long)(0x7fffffffu - (uint32_t)j);
}

__device__ __forceinline__ unsigned long long ts_umax(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

/* One CTA per item: the blocks its query reads, ascending, -1 after (the caller's, cleaned as
 * the CPU step does, or the top-n of the importance the compressed tiles left in bins). */
__global__ void __launch_bounds__(256) ts_select_kernel(const step_params P, const ts_launch A1, int32_t *sel, int64_t width)
{
    extern __shared__ unsigned long long ts_keys[];
    __shared__ float Mg[16], Lg[16];
    __shared__ unsigned long long wbest[8], chosen[64];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t local = blockIdx.x, it = A1.item0 + local;
    const ts_item x = ts_item_of(P, it);
    if (!x.live) return;
    const int64_t cur = x.pos / P.lp;
    int32_t *out = sel + local * width;
    if (!P.selects) { /* the caller's blocks the query can use: in [0, cur], once, ascending */
        if (tid == 0) {
            const int64_t cnt = P.bc.p ? ((const int32_t *)P.bc.p)[x.b * P.bc.s0 + x.i * P.bc.s1 + x.h * P.bc.s2] : P.m;
            const int32_t *ix = (const int32_t *)P.bi.p + x.b * P.bi.s0 + x.i * P.bi.s1 + x.h * P.bi.s2;
            int kept = 0;
            for (int64_t e = 0; e < (cnt < 0 ? 0 : cnt > P.m ? P.m : cnt); e++) {
                const int32_t j = ix[e];
                if (j < 0 || j > cur) continue;
                int at = kept;
                while (at > 0 && out[at - 1] > j) at--;
                if (at > 0 && out[at - 1] == j) continue;
                for (int q = kept; q > at; q--) out[q] = out[q - 1];
                out[at] = j;
                kept++;
            }
            for (int64_t a = kept; a < width; a++) out[a] = -1;
        }
        return;
    }
    const int64_t nj = cur + 1;
    if (nj <= P.n) { /* every block the query can see */
        for (int64_t a = tid; a < width; a += blockDim.x) out[a] = a < nj ? (int32_t)a : -1;
    } else {
        if (tid < 16) { /* each head's softmax over the compressed rows, from the tasks' partials */
            float M = -INFINITY, L = 0.0f;
            if (tid < P.G) {
                for (int64_t s = 0; s < A1.ntask; s++) {
                    const float m = A1.part[(local * A1.ntask + s) * ts_part_floats(P.DK) + tid];
                    if (m != -INFINITY) M = ts_max(M, m);
                }
                for (int64_t s = 0; s < A1.ntask; s++) {
                    const float *pp = A1.part + (local * A1.ntask + s) * ts_part_floats(P.DK);
                    if (pp[tid] != -INFINITY) L += expf(pp[tid] - M) * pp[16 + tid];
                }
            }
            Mg[tid] = M, Lg[tid] = L;
        }
        __syncthreads();
        const int32_t nv = (int32_t)nsa_rule_cmp_visible_cap(x.pos, P.l, P.d, nsa_rule_num_cmp(x.L, P.l, P.d));
        const int32_t l = (int32_t)P.l, d = (int32_t)P.d, lp = (int32_t)P.lp, JT1 = A1.JT + 1;
        /* each (tile, head)'s bins times exp(ref - M) / L, kept after the keys */
        float *fac = (float *)(ts_keys + nj);
        const int ntl = (nv + 63) / 64;
        for (int e = tid; e < ntl * P.G; e += blockDim.x) {
            const int t = e / P.G, g = e % P.G;
            fac[e] = expf(A1.bins[((local * A1.tiles + t) * 16 + g) * JT1 + A1.JT] - Mg[g]) / Lg[g];
        }
        __syncthreads();
        const float inv_d = 1.0f / (float)P.d;
        unsigned long long best = 0;
        for (int32_t j = tid; j < nj; j += blockDim.x) {
            const int32_t ra = nsa_rule_slc_first_cmp32(j, l, d, lp);
            int32_t rb = nsa_rule_slc_last_cmp32(j, d, lp);
            rb = rb < nv - 1 ? rb : nv - 1;
            float acc = 0.0f;
            if (ra <= rb)
                for (int32_t t = ra / 64; t <= rb / 64; t++) {
                    const float *bt = A1.bins + (local * A1.tiles + t) * 16 * JT1 + (j - 64 * t * d / lp);
#pragma unroll 4
                    for (int g = 0; g < P.G; g++) {
                        const float b = bt[g * JT1];
                        if (b != 0.0f) acc += b * fac[t * P.G + g];
                    }
                }
            const unsigned long long key = ts_rank_key(nsa_rule_forced(j, cur, P.n_init, P.n_local), acc * inv_d, j);
            ts_keys[j] = key;
            best = ts_umax(best, key);
        }
        /* n rounds of the block's largest key; the owner of the winner rescans its slice */
        for (int64_t round = 0; round < P.n; round++) {
            unsigned long long w = best;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) w = ts_umax(w, __shfl_xor_sync(0xffffffffu, w, o));
            if (lane == 0) wbest[warp] = w;
            __syncthreads();
            unsigned long long top = 0;
            for (int q = 0; q < (int)(blockDim.x >> 5); q++) top = ts_umax(top, wbest[q]);
            if (tid == 0) chosen[round] = top;
            if (best == top && top != 0) {
                ts_keys[0x7fffffffu - (uint32_t)(top & 0x7fffffffull)] = 0;
                best = 0;
                for (int64_t j = tid; j < nj; j += blockDim.x) best = ts_umax(best, ts_keys[j]);
            }
            __syncthreads();
        }
        if (tid == 0) { /* ascending, then -1 */
            for (int a = 0; a < (int)P.n; a++) {
                const int32_t v = (int32_t)(0x7fffffffu - (uint32_t)(chosen[a] & 0x7fffffffull));
                int k = a;
                while (k > 0 && out[k - 1] > v) out[k] = out[k - 1], k--;
                out[k] = v;
            }
            for (int64_t a = P.n; a < width; a++) out[a] = -1;
        }
    }
    __syncthreads();
    if (P.idx.p)
        for (int64_t a = tid; a < P.n; a += blockDim.x)
            ((int32_t *)P.idx.p)[x.b * P.idx.s0 + x.i * P.idx.s1 + x.h * P.idx.s2 + a] = a < width ? out[a] : -1;
}

/* A branch's row max M and sum L for head g over its n partials (tasks with no key skipped),
 * by one warp; then each task's weight mul * exp(m - M) / L into w (0 for a task with no key).
 * Returns M (-inf: no key anywhere) through *Mo and L through *Lo. */
__device__ __forceinline__ void ts_weights(const float *base, int64_t n, int64_t stride, int g, float mul, float *w,
                                           int lane, float *Mo, float *Lo)
{
    float M = -INFINITY;
    for (int64_t s = lane; s < n; s += 32) {
        const float m = base[s * stride + g];
        if (m != -INFINITY) M = ts_max(M, m);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = ts_max(M, __shfl_xor_sync(0xffffffffu, M, o));
    float L = 0.0f;
    if (M != -INFINITY)
        for (int64_t s = lane; s < n; s += 32) {
            const float m = base[s * stride + g];
            if (m != -INFINITY) L += expf(m - M) * base[s * stride + 16 + g];
        }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
    for (int64_t s = lane; s < n; s += 32) {
        const float m = base[s * stride + g];
        w[s] = M == -INFINITY || m == -INFINITY ? 0.0f : mul * expf(m - M) / L;
    }
    *Mo = M, *Lo = L;
}

#define TS_MAX_TASKS (2 * TS_TARGET_CTAS + 8) /* the tasks of one item, all branches */

/* sum over the item's partials of w[s] * O_s[g, :], 4 columns a thread, the tasks split over
 * the thread groups, into out (D floats of shared memory) */
__device__ __forceinline__ void ts_accumulate(const float *const *seg_base, const int64_t *seg_n, int nseg, int64_t stride,
                                              int g, int D, const float *w, float *red, float *out)
{
    const int tid = threadIdx.x, C4 = D / 4, NG = TS_THREADS / C4, c4 = tid % C4, grp = tid / C4;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    int64_t w0 = 0;
    for (int q = 0; q < nseg; q++) {
        const float *base = seg_base[q] + 32 + g * D + 4 * c4;
#pragma unroll 4
        for (int64_t s = grp; s < seg_n[q]; s += NG) {
            const float ws = w[w0 + s];
            if (ws != 0.0f) {
                const float4 o = *(const float4 *)(base + s * stride);
                acc.x += ws * o.x, acc.y += ws * o.y, acc.z += ws * o.z, acc.w += ws * o.w;
            }
        }
        w0 += seg_n[q];
    }
    *(float4 *)(red + grp * D + 4 * c4) = acc;
    __syncthreads();
    for (int c = tid; c < D; c += TS_THREADS) {
        float v = 0.0f;
        for (int q = 0; q < NG; q++) v += red[q * D + c];
        out[c] = v;
    }
    __syncthreads();
}

/* One CTA per (item, query head): the NSA step's branches merged with one weight per partial
 * (the gate times exp(m - M) / L; a branch without a key gives 0, as on the CPU) and stored. */
__global__ void __launch_bounds__(TS_THREADS) ts_combine_kernel(const step_params P, const ts_launch A1, const ts_launch A3)
{
    __shared__ float w[TS_MAX_TASKS];
    __shared__ __align__(16) float red[TS_THREADS * 4], outv[128];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, D = P.DV;
    const int64_t local = blockIdx.x / P.G, g = blockIdx.x % P.G, it = A1.item0 + local;
    const ts_item x = ts_item_of(P, it);
    if (!x.live) return;
    const int64_t stride = ts_part_floats(D), hq = x.h * P.G + g;
    /* the segments: compressed (A1), selected and window (A3), those switched on */
    const float *seg_base[3];
    int64_t seg_n[3];
    const dview *seg_gate[3];
    int nseg = 0;
    if (P.use_cmp) seg_base[nseg] = A1.part + local * A1.ntask * stride, seg_n[nseg] = A1.ntask, seg_gate[nseg++] = &P.gc;
    if (P.use_slc) seg_base[nseg] = A3.part + local * A3.ntask * stride, seg_n[nseg] = A3.tasks[0], seg_gate[nseg++] = &P.gs;
    if (P.use_swa) {
        const int64_t at = P.use_slc ? A3.tasks[0] : 0;
        seg_base[nseg] = A3.part + (local * A3.ntask + at) * stride, seg_n[nseg] = A3.tasks[P.use_slc ? 1 : 0], seg_gate[nseg++] = &P.gw;
    }
    if (warp < nseg) {
        int64_t w0 = 0;
        for (int q = 0; q < warp; q++) w0 += seg_n[q];
        const dview &gt = *seg_gate[warp];
        const float gv = ld_any(gt.p, gt.dt, x.b * gt.s0 + x.i * gt.s1 + hq * gt.s2);
        float M, L;
        ts_weights(seg_base[warp], seg_n[warp], stride, (int)g, gv, w + w0, lane, &M, &L);
    }
    __syncthreads();
    ts_accumulate(seg_base, seg_n, nseg, stride, (int)g, D, w, red, outv);
    for (int c = tid; c < D; c += TS_THREADS) st_any(P.o.p, P.o.dt, x.b * P.o.s0 + x.i * P.o.s1 + hq * P.o.s2 + c, outv[c]);
}

/* One CTA per (item, query head): the dense step's partials merged with the sink, stored with
 * the lse (the scalar kernel's rules for rows without a finite score). */
__global__ void __launch_bounds__(TS_THREADS) ts_dense_combine_kernel(const step_params P, const ts_launch A)
{
    __shared__ float w[TS_MAX_TASKS];
    __shared__ __align__(16) float red[TS_THREADS * 4], outv[128];
    __shared__ float fill, lse;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, D = P.DV;
    const int64_t local = blockIdx.x / P.G, g = blockIdx.x % P.G, it = A.item0 + local;
    const ts_item x = ts_item_of(P, it);
    if (!x.live) return;
    const int64_t stride = ts_part_floats(D), hq = x.h * P.G + g;
    const float *base = A.part + local * A.ntask * stride;
    if (warp == 0) {
        float M, L;
        ts_weights(base, A.ntask, stride, (int)g, 1.0f, w, lane, &M, &L);
        int64_t lo, hi;
        ts_range(P, BR_RANGE, x, lo, hi);
        const bool seen = hi >= lo, sink = P.sinks != nullptr;
        const float sk = sink ? P.sinks[hq * P.sinks_s] : -INFINITY;
        float m = M;
        if (sink && sk > m) m = sk;
        float rescale = 0.0f; /* w holds exp(m_s - M) / L: to exp(m_s - m) / (L e + the sink's term) */
        if (m == -INFINITY) { /* no key and no finite sink: o = 0; keys all at -inf: 0 / 0 as dense softmax */
            if (lane == 0) lse = seen ? NAN : sink ? sk : -INFINITY, fill = seen ? NAN : 0.0f;
        } else {
            const float e = M == -INFINITY ? 0.0f : expf(M - m), Lt = L * e + (sink ? expf(sk - m) : 0.0f);
            rescale = L * e / Lt;
            if (lane == 0) lse = m + logf(Lt), fill = 1.0f;
        }
        for (int64_t s = lane; s < A.ntask; s += 32) w[s] *= rescale;
    }
    __syncthreads();
    const int64_t nseg = 1;
    ts_accumulate(&base, &A.ntask, (int)nseg, stride, (int)g, D, w, red, outv);
    for (int c = tid; c < D; c += TS_THREADS) {
        const float v = fill == 1.0f ? outv[c] : fill; /* NaN when keys were seen, else 0 */
        st_any(P.o.p, P.o.dt, x.b * P.o.s0 + x.i * P.o.s1 + hq * P.o.s2 + c, v);
    }
    if (tid == 0 && P.lse.p) ((float *)P.lse.p)[x.b * P.lse.s0 + x.i * P.lse.s1 + hq * P.lse.s2] = lse;
}

/* ---- host ---------------------------------------------------------------------------- */

static int64_t ts_tasks(int64_t tiles, int64_t items, int64_t min_tpc, int64_t *tpc)
{
    const int64_t want = items >= TS_TARGET_CTAS ? 1 : cdiv64(TS_TARGET_CTAS, items);
    int64_t t = cdiv64(tiles, want);
    if (t < min_tpc) t = min_tpc;
    if (t < 1) t = 1;
    *tpc = t;
    return tiles > 0 ? cdiv64(tiles, t) : 1;
}

/* The shapes both tiled steps need: storage, head dims, heads per group. */
static int ts_common_fits(const grun *g, const step_params *P)
{
    if (g->ovr->step_tiled == 0 || g->ovr->nonfinite == 1) return 0;
    if (P->DK != P->DV || (P->DK != 64 && P->DK != 128)) return 0;
    if (P->G < 1 || P->G > 16) return 0;
    const int dt = P->q.dt;
    if (dt != NSA_DTYPE_BF16 && dt != NSA_DTYPE_F16) return 0;
    return P->kv.k.dt == dt && P->kv.v.dt == dt;
}

int step_tiled_fits(const grun *g, const step_params *P)
{
    if (!ts_common_fits(g, P)) return 0;
    if ((P->use_cmp || P->selects) && (P->ckv.k.dt != P->q.dt || P->ckv.v.dt != P->q.dt)) return 0;
    if (P->selects && (cdiv64(P->kv.cap, P->lp) > TS_KEYS_MAX || P->n > 64)) return 0;
    return 1;
}

int attention_step_tiled_fits(const grun *g, const step_params *P) { return ts_common_fits(g, P); }

void step_tiled_take(grun *g, const step_params *P, ts_plan *pl)
{
    memset(pl, 0, sizeof *pl);
    pl->D = P->DK;
    pl->items = P->B * P->Tq * P->H;
    pl->batch = pl->items < TS_BATCH ? pl->items : TS_BATCH;
    const int64_t pf = ts_part_floats(pl->D);
    if (P->use_cmp || P->selects) {
        pl->tiles1 = cdiv64(P->ckv.cap, 64);
        pl->nt1 = ts_tasks(pl->tiles1, pl->batch, 2, &pl->tpc1);
        pl->part1 = cu_take_f32(g, nsa_size_mul(nsa_size_of(pl->batch * pl->nt1), nsa_size_of(pf)), 0);
    }
    if (P->selects) {
        pl->JT = (int)((63 * P->d + P->l - 1) / P->lp + 2);
        pl->bins = cu_take_f32(g, nsa_size_mul(nsa_size_of(pl->batch * pl->tiles1 * 16), nsa_size_of(pl->JT + 1)), 0);
    }
    pl->width = P->m > P->n ? P->m : P->n;
    pl->tpb = (int)cdiv64(P->lp, 64);
    if (P->use_slc) pl->sel = (int32_t *)g_take_n(g, nsa_size_mul(nsa_size_of(pl->batch), nsa_size_of(pl->width)), sizeof(int32_t));
    const int64_t tiles_slc = P->use_slc ? pl->width * pl->tpb : 0, tiles_swa = P->use_swa ? cdiv64(P->w, 64) : 0;
    if (tiles_slc + tiles_swa > 0) {
        int64_t tpc;
        ts_tasks(tiles_slc + tiles_swa, pl->batch, 1, &tpc);
        pl->tpc_slc = pl->tpc_swa = tpc;
        pl->nt_slc = tiles_slc ? cdiv64(tiles_slc, tpc) : 0;
        pl->nt_swa = tiles_swa ? cdiv64(tiles_swa, tpc) : 0;
        pl->part3 = cu_take_f32(g, nsa_size_mul(nsa_size_of(pl->batch * (pl->nt_slc + pl->nt_swa)), nsa_size_of(pf)), 0);
    }
}

template <typename T, int D, bool IMP> static void ts_launch_split(grun *g, const step_params &P, const ts_launch &A, int64_t n)
{
    const size_t smem = IMP ? ts_smem<D>::end_imp : ts_smem<D>::end;
    g_check(g, cudaFuncSetAttribute(ts_split_kernel<T, D, IMP>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (!g_live(g)) return;
    ts_split_kernel<T, D, IMP><<<(unsigned)(n * A.ntask), TS_THREADS, smem, g->st>>>(P, A);
    g_launched(g);
}

template <typename T> static void ts_split(grun *g, const step_params &P, const ts_launch &A, int64_t n, int D, bool imp)
{
    if (D == 64) imp ? ts_launch_split<T, 64, true>(g, P, A, n) : ts_launch_split<T, 64, false>(g, P, A, n);
    else imp ? ts_launch_split<T, 128, true>(g, P, A, n) : ts_launch_split<T, 128, false>(g, P, A, n);
}

static void ts_split_any(grun *g, const step_params &P, const ts_launch &A, int64_t n, int D, bool imp)
{
    if (P.q.dt == NSA_DTYPE_BF16) ts_split<__nv_bfloat16>(g, P, A, n, D, imp);
    else ts_split<__half>(g, P, A, n, D, imp);
}

void step_tiled_launch(grun *g, const step_params *P, const ts_plan *pl)
{
    for (int64_t i0 = 0; i0 < pl->items && g_live(g); i0 += pl->batch) {
        const int64_t n = pl->items - i0 < pl->batch ? pl->items - i0 : pl->batch;
        ts_launch A1, A3;
        memset(&A1, 0, sizeof A1), memset(&A3, 0, sizeof A3);
        A1.item0 = A3.item0 = i0;
        A1.kind[0] = BR_CMP, A1.tasks[0] = pl->nt1, A1.tpc[0] = pl->tpc1, A1.ntask = pl->nt1;
        A1.part = pl->part1, A1.bins = pl->bins, A1.tiles = pl->tiles1, A1.JT = pl->JT;
        if (P->use_cmp || P->selects) ts_split_any(g, *P, A1, n, pl->D, P->selects != 0);
        if (P->use_slc) {
            const size_t smem = P->selects ? (size_t)cdiv64(P->kv.cap, P->lp) * 8 + (size_t)pl->tiles1 * 16 * 4 : 0;
            g_check(g, cudaFuncSetAttribute(ts_select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
            if (!g_live(g)) return;
            ts_select_kernel<<<(unsigned)n, 256, smem, g->st>>>(*P, A1, pl->sel, pl->width);
            g_launched(g);
        }
        int nb = 0;
        if (P->use_slc) A3.kind[nb] = BR_SLC, A3.tasks[nb] = pl->nt_slc, A3.tpc[nb] = pl->tpc_slc, nb++;
        if (P->use_swa) A3.kind[nb] = BR_SWA, A3.tasks[nb] = pl->nt_swa, A3.tpc[nb] = pl->tpc_swa, nb++;
        A3.ntask = A3.tasks[0] + A3.tasks[1];
        A3.part = pl->part3, A3.sel = pl->sel, A3.width = pl->width, A3.tpb = pl->tpb;
        if (nb) ts_split_any(g, *P, A3, n, pl->D, false);
        if (!g_live(g)) return;
        ts_combine_kernel<<<(unsigned)(n * P->G), TS_THREADS, 0, g->st>>>(*P, A1, A3);
        g_launched(g);
    }
}

void attention_step_tiled_take(grun *g, const step_params *P, ts_plan *pl)
{
    memset(pl, 0, sizeof *pl);
    pl->D = P->DK;
    pl->items = P->B * P->Tq * P->H;
    pl->batch = pl->items < TS_BATCH ? pl->items : TS_BATCH;
    pl->tiles1 = cdiv64(P->kv.cap, 64);
    pl->nt1 = ts_tasks(pl->tiles1, pl->batch, 2, &pl->tpc1);
    pl->part1 = cu_take_f32(g, nsa_size_mul(nsa_size_of(pl->batch * pl->nt1), nsa_size_of(ts_part_floats(pl->D))), 0);
}

void attention_step_tiled_launch(grun *g, const step_params *P, const ts_plan *pl)
{
    for (int64_t i0 = 0; i0 < pl->items && g_live(g); i0 += pl->batch) {
        const int64_t n = pl->items - i0 < pl->batch ? pl->items - i0 : pl->batch;
        ts_launch A;
        memset(&A, 0, sizeof A);
        A.item0 = i0;
        A.kind[0] = BR_RANGE, A.tasks[0] = pl->nt1, A.tpc[0] = pl->tpc1, A.ntask = pl->nt1, A.part = pl->part1;
        ts_split_any(g, *P, A, n, pl->D, false);
        if (!g_live(g)) return;
        ts_dense_combine_kernel<<<(unsigned)(n * P->G), TS_THREADS, 0, g->st>>>(*P, A);
        g_launched(g);
    }
}
