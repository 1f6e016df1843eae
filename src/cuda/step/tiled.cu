/* step/tiled.cu -- the inference step on tensor cores (step.h explains the split): mma.sync
 * m16n8k16 products of an item's 16 query rows (its G heads, zero-padded) with 16-key slices;
 * a CTA takes one kv head of one query at small batches, up to four at large ones
 * (ts_heads_per_cta), each warp one head's 16-key slice of every 64-row stage, with its own
 * cp.async pipeline (TS_STAGES slices in flight) and its own online softmax (log2 domain), the
 * warps of a head merged at the end. The top-n takes an item a CTA; the combine an item a CTA
 * (a warp a head) or, at small batches, a head a CTA (ts_comb). The kernels of a step are
 * programmatic dependents of each other on sm_90 (ts_wait_prior). Lengths, pages and selections
 * are read on the device and the grid depends on capacities only, so a captured graph replays
 * for any lengths. Arithmetic in fp32; the probabilities enter the P V product rounded to the
 * storage dtype, as in the training tiles. */
#include "step.h"

#define TS_THREADS 128
#define TS_COMBINE_THREADS 512 /* a warp per query head (G <= 16), or TS_COMBINE_SPLIT warps of one head */
#define TS_COMBINE_SPLIT 8
#define TS_TARGET_CTAS 264 /* CTAs a launch aims at: one wave (two per SM) of a 132-SM part, fixed so the
                              sizing pass (no device query) plans the same workspace */
#define TS_BATCH 4096      /* items per launch round: bounds the partials' workspace */
#define TS_SELECT_SMEM (160 * 1024) /* the top-n's shared memory at most (contexts to ~400k tokens
                                      in the paper's configuration; longer ones take the scalar step) */
#define TS_JT_MAX 16 /* blocks a 16-row group of compressed rows may overlap: two n8 tiles (the host checks) */
#define TS_STAGES 3 /* slices in flight per warp: two load while one is computed */
#define TS_MIN_ROWS 128 /* a contiguous branch's task reads at least this many rows a head: its partial
                           (16 x D floats) stays small beside the keys it read */

enum { BR_CMP = 0, BR_SLC = 1, BR_SWA = 2, BR_RANGE = 3, BR_SLC_SWA = 4 /* either of the two, read at run time */ };

/* floats of one partial: 16 row maxima, 16 row sums, 16 x D unnormalised outputs */
static __host__ __device__ __forceinline__ int64_t ts_part_floats(int D) { return 32 + 16 * (int64_t)D; }

typedef struct ts_launch {
    int kind[2];
    int64_t tasks[2], tpc[2];
    int64_t ntask; /* tasks[0] + tasks[1] */
    int64_t n;     /* items in this round (a multiple of hc) */
    int hc;        /* kv heads per CTA: 4, 2 or 1, dividing H */
    int64_t item0; /* the round's first item */
    float *part;   /* [batch][ntask][ts_part_floats(D)] */
    float *bins;   /* IMP: [batch][groups][JT + 1][16]: per 16-row group, block and head the sum of
                      overlap * p, then the reference max */
    int64_t tiles; /* 16-row groups of compressed rows per item (the bins' stride) */
    int JT;
    const int32_t *sel; /* BR_SLC: [batch][width] */
    int64_t width;
    int tpb;
    int early; /* the selected and window launch: a launch stands between it and the check kernel (ts_split_task) */
    int check; /* the step's first launch, no check kernel before it: each CTA checks its sequence (ts_item_check) */
} ts_launch;

/* Programmatic dependent launch (sm_90): each kernel of a step lets the next one be launched
 * once every CTA of its own has stored its results (ts_let_next_start, or the CTA's exit), and
 * the next one waits for it to finish, its writes visible, before reading or writing anything
 * of the step's (ts_wait_prior): the launch's latency overlaps the last CTAs' tails. Without
 * the launch attribute both are no-ops. */
__device__ __forceinline__ void ts_let_next_start()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void ts_wait_prior()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

/* NaN-propagating maximum (fmaxf drops a NaN) */
__device__ __forceinline__ float ts_max(float a, float b) { return a > b || a != a ? a : b; }

struct ts_item {
    int64_t b, i, h, pos, L;
    bool live;
};
/* An item's sequence, query and kv head, from its index alone (no memory read) */
__device__ __forceinline__ ts_item ts_item_index(const step_params &P, int64_t it)
{
    ts_item x;
    /* 32-bit: items = B * Tq * H fit (the host checks) */
    const uint32_t u = (uint32_t)it, H = (uint32_t)P.H, Tq = (uint32_t)P.Tq, bi = u / H;
    x.h = u - bi * H, x.b = bi / Tq, x.i = bi - (uint32_t)x.b * Tq;
    x.pos = x.L = 0, x.live = false;
    return x;
}
/* whether it runs, its query's position and its sequence's length (written by the step's first kernel) */
__device__ __forceinline__ void ts_item_lengths(const step_params &P, ts_item &x)
{
    /* the check's verdict and the lengths read together (b < B: in bounds whatever the verdict;
     * the lengths are used only when it is 1): one memory round trip where two were */
    const int32_t ok = P.ok[x.b];
    const step_seq_t s = step_seq(P, x.b);
    x.live = ok != 0 && x.i < s.n;
    if (x.live) x.pos = s.L - s.n + x.i, x.L = s.L;
}
/* ts_item_lengths for the first kernel of a step that has no check kernel: the CTA checks its
 * item's sequence itself (every thread: step_problem_cta's barriers; a CTA's warps share one
 * sequence and query), and the CTA of the sequence's first item and task records the verdict
 * and the error code for the kernels after it. */
__device__ __forceinline__ void ts_item_check(const step_params &P, ts_item &x, bool first_task)
{
    const step_seq_t s = step_seq(P, x.b);
    const int e = step_problem_cta(P, x.b, s);
    if (first_task && threadIdx.x == 0 && x.i == 0 && x.h == 0) { /* thread 0: warp 0's item, the group's first head */
        P.ok[x.b] = e == NSA_STEP_OK;
        if (P.errors) P.errors[x.b * P.errors_s] = e;
    }
    x.live = e == NSA_STEP_OK && x.i < s.n;
    if (x.live) x.pos = s.L - s.n + x.i, x.L = s.L;
}
__device__ __forceinline__ ts_item ts_item_of(const step_params &P, int64_t it)
{
    ts_item x = ts_item_index(P, it);
    ts_item_lengths(P, x);
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
    static constexpr size_t k = 0, v = k + TS_STAGES * 64 * LD * 2, ml = v + TS_STAGES * 64 * LD * 2, end = ml + 4 * 32 * 4;
};

/* What one warp reads: kv head h of item it (heads hg * Hc + w % Hc), the 16-key slice w / Hc
 * of each stage of KS = 64 / Hc keys. */
struct ts_warp {
    ts_item x;
    int64_t it, local; /* the head's item and its index in the round */
    int64_t vis;       /* contiguous branches: the first key seen (the stages start at a multiple of 16 below it) */
    int slice, KS;
};

/* A lane's fixed part of its copies' addresses, made once per task: each slice then costs a
 * row offset (and a page lookup) instead of the whole address per copy. The lane copies the
 * 16-byte column c of rows i0, i0 + RPP, ... of each slice. */
struct ts_lanes {
    int64_t k0, v0;       /* head (and, contiguous, sequence) offset + row i0 + column c */
    int64_t kstep, vstep; /* RPP rows */
    bool aligned;         /* pages (if any) hold whole 16-row slices: a slice starting on a multiple of 16 lies in one page */
};
template <int D> __device__ __forceinline__ ts_lanes ts_lanes_of(const step_cache_t &C, const ts_warp &W, int lane)
{
    constexpr int CH = D / 8, RPP = 32 / CH;
    const int c = (lane % CH) * 8, i0 = lane / CH;
    ts_lanes Ln;
    const int64_t bk = C.bt ? 0 : W.x.b * C.k.s0, bv = C.bt ? 0 : W.x.b * C.v.s0;
    Ln.k0 = bk + W.x.h * C.k.s2 + i0 * C.k.s1 + c, Ln.v0 = bv + W.x.h * C.v.s2 + i0 * C.v.s1 + c;
    Ln.kstep = RPP * C.k.s1, Ln.vstep = RPP * C.v.s1;
    Ln.aligned = !C.bt || (C.page & 15) == 0;
    return Ln;
}

/* Where a warp finds its rows' pages and its selected blocks without a global load inside the
 * loop: its lanes hold 32 entries of the block table (a window from page pbase, moved when a
 * slice leaves it: the contiguous branches' rows advance through it, one load per 32 pages) and,
 * for the selected branch, the task's slots from a0 (sj: the block, -1 none) and, when every
 * block lies in one page (the page size a multiple of l'), that block's page (spg). Both are
 * loaded once a task, so a slice's copies wait on no lookup: otherwise each selected block
 * costs two dependent loads (its index, then its page) inside the loop. */
struct ts_map {
    int64_t pbase, npg; /* the window's first page; pages in a block-table row */
    int32_t pheld;      /* the lane's page of the window */
    int32_t a0, sj, spg;
    bool slot_pages;
};
__device__ __forceinline__ ts_map ts_map_of(const step_params &P, const ts_launch &A, const step_cache_t &C, int kind, const ts_warp &W,
                                            int t0, int lane)
{
    ts_map M;
    M.pbase = -64, M.npg = C.bt ? C.cap / C.page : 0, M.pheld = 0;
    M.a0 = 0, M.sj = -1, M.spg = 0, M.slot_pages = false;
    if (kind == BR_SLC) {
        M.a0 = t0 / A.tpb;
        const int a = M.a0 + lane;
        M.sj = a < A.width ? A.sel[W.local * A.width + a] : -1;
        M.slot_pages = C.bt && C.page % P.lp == 0;
        /* sj <= the query's block, so its rows lie below the capacity: a row of the table */
        if (M.slot_pages && M.sj >= 0) M.spg = C.bt[W.x.b * C.bt0 + (int64_t)M.sj * P.lp / C.page * C.bt1];
    }
    return M;
}

/* rows [row0, row0 + n) of the warp's slice of stage t (n = 0: nothing, e.g. an unused slot
 * of the selection list); the first *skip of them precede the branch's first key (masked);
 * *slot: the selected branch's slot of the stage */
__device__ __forceinline__ int ts_slice_rows(const step_params &P, const ts_launch &A, int kind, const ts_warp &W, const ts_map &M, int64_t lo,
                                             int64_t hi, int t, int64_t &row0, int &skip, int &slot)
{
    int64_t end;
    skip = 0, slot = 0;
    if (kind == BR_SLC) {
        const int tpb = A.tpb, a = t / tpb, u = t - a * tpb;
        slot = a;
        /* the warp agrees on a: the shuffle is uniform */
        const int32_t j = (unsigned)(a - M.a0) < 32u ? __shfl_sync(0xffffffffu, M.sj, a - M.a0) : A.sel[W.local * A.width + a];
        if (j < 0) return 0;
        row0 = (int64_t)j * P.lp + W.KS * u + 16 * W.slice;
        const int64_t end0 = (int64_t)j * P.lp + P.lp, end1 = nsa_rule_slc_hi(j, W.x.pos, P.lp, W.x.L) + 1;
        end = end0 < end1 ? end0 : end1;
    } else {
        row0 = lo + (int64_t)W.KS * t + 16 * W.slice;
        end = hi + 1;
        const int64_t sk = W.vis - row0;
        skip = sk <= 0 ? 0 : sk > 16 ? 16 : (int)sk;
    }
    const int64_t n = end - row0;
    return n <= 0 ? 0 : n > 16 ? 16 : (int)n;
}

/* The warp's 16 keys of stage t (those past its rows zero-filled) into its 16-row slot of
 * buffer Kb / Vb by cp.async, one commit group. A slice that starts on a multiple of 16 of a
 * contiguous cache or of pages of a multiple of 16 rows lies in one page: one lookup, then
 * every lane steps from its fixed offset (Ln) by the row stride, without predicates when the
 * slice is whole. Otherwise lanes 0-15 find the K rows' addresses, lanes 16-31 the V rows',
 * shuffled to the lanes that copy. Returns the slice's key count and (skip) the keys before
 * the branch's first. */
template <typename T, int D, bool PV>
__device__ __forceinline__ int ts_issue(const step_params &P, const ts_launch &A, const step_cache_t &C, int kind, const ts_warp &W,
                                        const ts_lanes &Ln, ts_map &M, int64_t lo, int64_t hi, int t, T *Kb, T *Vb, int lane, int &skip)
{
    constexpr int LD = D + 8, CH = D / 8, RPP = 32 / CH;
    int64_t row0 = 0;
    int slot;
    const int n = ts_slice_rows(P, A, kind, W, M, lo, hi, t, row0, skip, slot);
    const T *kp = (const T *)C.k.p, *vp = (const T *)C.v.p;
    const int c = (lane % CH) * 8, i0 = lane / CH;
    if ((row0 & 15) == 0 && Ln.aligned) {
        int64_t kb = 0, vb = 0; /* 32-bit page arithmetic (the host checks) */
        if (n > 0) {
            const uint32_t row = (uint32_t)row0;
            if (!C.bt) {
                kb = (int64_t)row * C.k.s1, vb = (int64_t)row * C.v.s1;
            } else {
                const uint32_t pi = row / (uint32_t)C.page, in = row - pi * (uint32_t)C.page;
                int64_t pg;
                if (kind == BR_SLC && M.slot_pages && (unsigned)(slot - M.a0) < 32u) {
                    pg = __shfl_sync(0xffffffffu, M.spg, slot - M.a0);
                } else { /* the window (moved when the slice leaves it; pi is the warp's) */
                    if ((uint64_t)((int64_t)pi - M.pbase) >= 32u) {
                        M.pbase = pi;
                        const int64_t q = (int64_t)pi + lane;
                        M.pheld = q < M.npg ? C.bt[W.x.b * C.bt0 + q * C.bt1] : 0;
                    }
                    pg = __shfl_sync(0xffffffffu, M.pheld, (int)((int64_t)pi - M.pbase));
                }
                kb = pg * C.k.s0 + (int64_t)in * C.k.s1, vb = pg * C.v.s0 + (int64_t)in * C.v.s1;
            }
        }
        const T *ks = kp + Ln.k0 + kb, *vs = vp + Ln.v0 + vb;
        T *kd = Kb + i0 * LD + c, *vd = Vb + i0 * LD + c;
        if (n == 16) {
#pragma unroll
            for (int k = 0; k < 16 / RPP; k++) {
                cp16_full(kd + k * RPP * LD, ks + k * Ln.kstep);
                if (PV) cp16_full(vd + k * RPP * LD, vs + k * Ln.vstep);
            }
        } else {
#pragma unroll
            for (int k = 0; k < 16 / RPP; k++) {
                const bool ok = k * RPP + i0 < n;
                cp16(kd + k * RPP * LD, ok ? ks + k * Ln.kstep : kp, ok ? 16 : 0);
                if (PV) cp16(vd + k * RPP * LD, ok ? vs + k * Ln.vstep : vp, ok ? 16 : 0);
            }
        }
        cp_commit();
        return n;
    }
    const int r = lane & 15;
    int64_t off = -1;
    if (r < n) { /* row row0 + r of K (lanes 0-15) or V (16-31); 32-bit page arithmetic (the host checks) */
        const bool kk = lane < 16;
        const int64_t s0 = kk ? C.k.s0 : C.v.s0, s1 = kk ? C.k.s1 : C.v.s1, s2 = kk ? C.k.s2 : C.v.s2;
        const uint32_t row = (uint32_t)(row0 + r);
        if (!C.bt) {
            off = W.x.b * s0 + (int64_t)row * s1 + W.x.h * s2;
        } else {
            const uint32_t pi = row / (uint32_t)C.page, in = row - pi * (uint32_t)C.page;
            off = (int64_t)C.bt[W.x.b * C.bt0 + (int64_t)pi * C.bt1] * s0 + (int64_t)in * s1 + W.x.h * s2;
        }
    }
#pragma unroll
    for (int k = 0; k < 16 / RPP; k++) {
        const int i = k * RPP + i0;
        const int64_t ko = __shfl_sync(0xffffffffu, off, i), vo = __shfl_sync(0xffffffffu, off, 16 + i);
        cp16(Kb + i * LD + c, ko >= 0 ? kp + ko + c : kp, ko >= 0 ? 16 : 0);
        if (PV) cp16(Vb + i * LD + c, vo >= 0 ? vp + vo + c : vp, vo >= 0 ? 16 : 0);
    }
    cp_commit();
    return n;
}

/* One task of branch KIND: the stages [t0, t1) of a group of Hc kv heads of one (sequence,
 * query), as one partial per head. Each warp runs alone over its slice of every stage (its
 * own cp.async pipeline and online softmax, no block barrier in the loop) and the warps of a
 * head merge at the end. A stage is 64 (token, head) rows: with Hc = 4 the four heads of 16
 * tokens, which sit side by side in the cache, so the CTA reads whole spans of it. IMP (the
 * compressed branch of a selecting step): each warp also leaves, per 16-row group and query
 * head, the sums over the blocks its rows overlap of overlap * exp(s - ref), and ref (its
 * running max then). PV: the output is wanted (not when the compressed branch runs only for
 * the selection). The branch, IMP and PV are template arguments so each instance carries only
 * its own address, mask and softcap work (bench/NOTES.md has the measurements). */
template <typename T, int D, int KIND, bool IMP, bool PV>
__device__ __forceinline__ void ts_split_task(const step_params &P, const ts_launch &A, unsigned char *sm, int64_t lg, int64_t task,
                                              int bs)
{
    /* the selected and window branches share one instance (they share a launch, and two
     * bodies on one SM would compete for the instruction cache): their kind is read here */
    /* (selects: indexing the parameters at run time would copy them to local memory) */
    const int kind = KIND == BR_SLC_SWA ? (bs ? A.kind[1] : A.kind[0]) : KIND;
    typedef ts_smem<D> S;
    constexpr int LD = S::LD, KT = D / 16, NT = D / 8;
    T *Ks = (T *)(sm + S::k), *Vs = (T *)(sm + S::v);
    float *ml = (float *)(sm + S::ml);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, Hc = A.hc;
    ts_warp W;
    W.vis = 0;
    W.local = lg * Hc + warp % Hc, W.it = A.item0 + W.local, W.slice = warp / Hc, W.KS = 64 / Hc;
    W.x = ts_item_index(P, W.it);
    const int r0 = lane >> 2;
    /* the head's 16 query rows (G heads, the rest zero) as A fragments, straight from q: an
     * input of the step, so read before the kernel before this one has finished (b < B, i < Tq:
     * in bounds whether or not the item runs) */
    uint32_t qf[KT][4];
    {
        const int64_t qb = W.x.b * P.q.s0 + W.x.i * P.q.s1 + W.x.h * P.G * P.q.s2;
        const T *qp = (const T *)P.q.p;
#pragma unroll
        for (int k = 0; k < KT; k++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int g = r0 + 8 * (e & 1), col = 16 * k + 2 * (lane & 3) + 8 * (e >> 1);
                qf[k][e] = g < P.G ? *(const uint32_t *)(qp + qb + g * P.q.s2 + col) : 0u;
            }
    }
    /* What this kernel may read before the one before it has finished (ts_wait_prior): when
     * the selected and window branches' launch follows the top-n or the compressed branch, the
     * lengths and the caches, written by the check and append kernel two or more launches back,
     * are complete and visible (the launch before let this one start only after its own wait);
     * only the selection itself is not. A launch that follows the check kernel directly (the
     * others; a window-only step's) waits first. */
    const bool early = KIND == BR_SLC_SWA && A.early;
    if (!early) ts_wait_prior();
    if (A.check) ts_item_check(P, W.x, task == 0);
    else ts_item_lengths(P, W.x);
    if (!W.x.live) return; /* the same for every head of a (sequence, query) */
    if (early && kind == BR_SLC) ts_wait_prior();
    const int64_t c = bs ? task - A.tasks[0] : task;
    int64_t lo = 0, hi = -1, ntiles;
    if (kind == BR_SLC) {
        ntiles = A.width * A.tpb;
    } else {
        ts_range(P, kind, W.x, lo, hi);
        /* the stages start on a multiple of 16 (whole slices of a page: ts_issue's fast path),
         * the keys before the first visible one masked */
        W.vis = lo, lo &= ~(int64_t)15;
        ntiles = hi >= lo ? (hi - lo + W.KS) / W.KS : 0;
    }
    /* stage numbers fit 32 bits: a head's rows are at most 2^31 (the host checks capacities) */
    const int64_t tpc = bs ? A.tpc[1] : A.tpc[0];
    const int t0 = (int)(c * tpc), t1 = (int)(t0 + tpc < ntiles ? t0 + tpc : ntiles);
    if (t0 >= t1) {
        if (tid < 16 * Hc) {
            float *out = A.part + ((lg * Hc + tid / 16) * A.ntask + task) * ts_part_floats(D);
            out[tid % 16] = -INFINITY, out[16 + tid % 16] = 0.0f;
        }
        return;
    }
    const step_cache_t C = KIND == BR_CMP ? P.ckv : P.kv; /* by value: a reference into the parameters would put them in local memory */
    const ts_lanes Ln = ts_lanes_of<D>(C, W, lane);
    ts_map M = ts_map_of(P, A, C, kind, W, t0, lane); /* loads in flight beside the queries' */
    /* scores in the log2 domain (exp2 is one instruction): s * scale * log2(e); maxima and the
     * importance's reference go out in natural units */
    const float scale = kind == BR_SWA ? P.swa_scale : P.scale, softcap = KIND == BR_RANGE ? P.softcap : 0.0f;
    const float scale2 = scale * NSA_LOG2E, cap_in = softcap > 0.0f ? scale / softcap : 0.0f, cap_out = softcap * NSA_LOG2E;

    /* IMP: the B fragments of the overlap table W[k][jj] = overlap(row k, block jj) of a 16-row
     * group (the same for every group: 16 d is a multiple of l', the host checks) */
    uint32_t wb[2][2] = {{0u, 0u}, {0u, 0u}};
    if (IMP) {
        const int32_t l = (int32_t)P.l, d = (int32_t)P.d, lp = (int32_t)P.lp;
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int hlf = 0; hlf < 2; hlf++) {
                const int k = 2 * (lane & 3) + 8 * hlf, jj = nt * 8 + (lane >> 2);
                wb[nt][hlf] = dtraits<__half>::pack((float)nsa_rule_overlap32(k, jj, l, d, lp), (float)nsa_rule_overlap32(k + 1, jj, l, d, lp));
            }
    }
    T *Kw = Ks + warp * 16 * LD, *Vw = Vs + warp * 16 * LD; /* the warp's 16-row slot of each buffer */
    /* each stage's key count n and first visible key skip, as n | skip << 5 */
    int sk, nr1 = 0, nr2 = 0;
    int nr0 = ts_issue<T, D, PV>(P, A, C, kind, W, Ln, M, lo, hi, t0, Kw, Vw, lane, sk);
    nr0 |= sk << 5;
    if (t0 + 1 < t1) nr1 = ts_issue<T, D, PV>(P, A, C, kind, W, Ln, M, lo, hi, t0 + 1, Kw + 64 * LD, Vw + 64 * LD, lane, sk) | sk << 5;
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float mrun[2] = {-INFINITY, -INFINITY}, lsum[2] = {0.0f, 0.0f};
    int buf = 0;
    for (int t = t0; t < t1; t++) {
        if (t + 2 < t1) {
            const int nb = buf == 0 ? 2 : buf - 1; /* (buf + 2) % 3 */
            const int nn = ts_issue<T, D, PV>(P, A, C, kind, W, Ln, M, lo, hi, t + 2, Kw + nb * 64 * LD, Vw + nb * 64 * LD, lane, sk) | sk << 5;
            if (nb == 0) nr0 = nn;
            else if (nb == 1) nr1 = nn;
            else nr2 = nn;
            cp_wait<2>();
        } else if (t + 1 < t1) {
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncwarp();
        const int nsk = buf == 0 ? nr0 : buf == 1 ? nr1 : nr2, n = nsk & 31, skip = nsk >> 5;
        const T *Kb = Kw + buf * 64 * LD, *Vb = Vw + buf * 64 * LD;
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int k = 0; k < KT; k++) {
            uint32_t bb[4];
            ldsm4(bb, Kb + frag_bn_off(lane, LD) + k * 16);
            dtraits<T>::mma(s[0], qf[k], bb[0], bb[1]);
            dtraits<T>::mma(s[1], qf[k], bb[2], bb[3]);
        }
        /* scaled scores; the masks only on a slice with keys outside the branch (the warp
         * agrees: n and skip are the warp's), the softcap only where the dense step has one */
        if (KIND == BR_RANGE && softcap > 0.0f) {
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] = cap_out * tanhf(s[nt][e] * cap_in);
        } else {
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] *= scale2;
        }
        if (n != 16 || skip != 0) {
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = nt * 8 + 2 * (lane & 3) + (e & 1);
                    if (key >= n || key < skip) s[nt][e] = -INFINITY;
                }
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) mx[e >> 1] = ts_max(mx[e >> 1], s[nt][e]);
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = ts_max(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = ts_max(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float mn = ts_max(mrun[r], mx[r]);
            alpha[r] = mrun[r] == -INFINITY ? 0.0f : exp2f(mrun[r] - mn);
            mrun[r] = mn;
        }
        float ps[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float m = mrun[e >> 1];
                const float p = m == -INFINITY ? 0.0f : exp2f(s[nt][e] - m);
                s[nt][e] = p;
                ps[e >> 1] += p;
            }
        lsum[0] = lsum[0] * alpha[0] + ps[0], lsum[1] = lsum[1] * alpha[1] + ps[1];
        if (PV) {
            if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) /* the max moved (rarely, after the first keys) */
#pragma unroll
                for (int q = 0; q < NT; q++) acc[q][0] *= alpha[0], acc[q][1] *= alpha[0], acc[q][2] *= alpha[1], acc[q][3] *= alpha[1];
            uint32_t a[4];
            a[0] = dtraits<T>::pack(s[0][0], s[0][1]), a[1] = dtraits<T>::pack(s[0][2], s[0][3]);
            a[2] = dtraits<T>::pack(s[1][0], s[1][1]), a[3] = dtraits<T>::pack(s[1][2], s[1][3]);
#pragma unroll
            for (int q = 0; q < D / 16; q++) {
                uint32_t vb[4];
                ldsm4t(vb, Vb + frag_bk_off(lane, LD) + q * 16);
                dtraits<T>::mma(acc[2 * q], a, vb[0], vb[1]);
                dtraits<T>::mma(acc[2 * q + 1], a, vb[2], vb[3]);
            }
        }
        if (IMP && n > 0) { /* this slice's share of each block's importance, per query head */
            /* bins[jj][g] = sum over the slice's rows k of p[g][k] * overlap(row k, block j0 + jj):
             * one m16n8k16 product per 8 blocks, p in f16 (in [0, 1]: 11 bits where bf16 has 8),
             * the overlaps (whole tokens, exact) from the table wb made once per warp */
            const int32_t gr = (W.KS * t) / 16 + W.slice;
            uint32_t a[4];
            a[0] = dtraits<__half>::pack(s[0][0], s[0][1]), a[1] = dtraits<__half>::pack(s[0][2], s[0][3]);
            a[2] = dtraits<__half>::pack(s[1][0], s[1][1]), a[3] = dtraits<__half>::pack(s[1][2], s[1][3]);
            float bc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
            dtraits<__half>::mma(bc[0], a, wb[0][0], wb[0][1]);
            if (A.JT > 8) dtraits<__half>::mma(bc[1], a, wb[1][0], wb[1][1]); /* the paper's shapes touch 5 */
            float *bt = A.bins + (W.local * A.tiles + gr) * 16 * (A.JT + 1);
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int g = r0 + 8 * (e >> 1), jj = nt * 8 + 2 * (lane & 3) + (e & 1);
                    if (g < P.G && jj < A.JT) bt[jj * 16 + g] = bc[nt][e];
                }
            if ((lane & 3) == 0) { /* the heads' references: row JT */
                if (r0 < P.G) bt[A.JT * 16 + r0] = mrun[0] * NSA_LN2;
                if (r0 + 8 < P.G) bt[A.JT * 16 + r0 + 8] = mrun[1] * NSA_LN2;
            }
        }
        __syncwarp();
        buf = buf == TS_STAGES - 1 ? 0 : buf + 1;
    }

    /* the warps of each head merged: each row's max over them, the others rescaled to it */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        lsum[r] += __shfl_xor_sync(0xffffffffu, lsum[r], 1);
        lsum[r] += __shfl_xor_sync(0xffffffffu, lsum[r], 2);
    }
    const int hl = warp % Hc, per = 4 / Hc; /* the warps of head hl: hl, hl + Hc, ... */
    float *const part = A.part + ((lg * Hc + hl) * A.ntask + task) * ts_part_floats(D);
    if (per == 1) { /* a warp per head: its own state is the partial, stored from registers */
        if ((lane & 3) == 0) {
            part[r0] = mrun[0] * NSA_LN2, part[r0 + 8] = mrun[1] * NSA_LN2; /* the max in natural units */
            part[16 + r0] = lsum[0], part[16 + r0 + 8] = lsum[1];
        }
        if (PV)
#pragma unroll
            for (int q = 0; q < NT; q++) {
                const int col = q * 8 + 2 * (lane & 3);
                *(float2 *)(part + 32 + r0 * D + col) = make_float2(acc[q][0], acc[q][1]);
                *(float2 *)(part + 32 + (r0 + 8) * D + col) = make_float2(acc[q][2], acc[q][3]);
            }
        ts_let_next_start();
        return;
    }
    if ((lane & 3) == 0) {
        ml[warp * 32 + r0] = mrun[0], ml[warp * 32 + r0 + 8] = mrun[1];
        ml[warp * 32 + 16 + r0] = lsum[0], ml[warp * 32 + 16 + r0 + 8] = lsum[1];
    }
    __syncthreads();
    float fw[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int g = r0 + 8 * r;
        float M = -INFINITY;
        for (int q = 0; q < per; q++) M = ts_max(M, ml[(hl + q * Hc) * 32 + g]);
        fw[r] = mrun[r] == -INFINITY ? 0.0f : exp2f(mrun[r] - M);
    }
    float *Os = (float *)Ks; /* the tiles are done: their space holds the four warps' outputs */
    if (PV) {
#pragma unroll
        for (int q = 0; q < NT; q++) {
            const int col = q * 8 + 2 * (lane & 3);
            *(float2 *)(Os + (warp * 16 + r0) * D + col) = make_float2(acc[q][0] * fw[0], acc[q][1] * fw[0]);
            *(float2 *)(Os + (warp * 16 + r0 + 8) * D + col) = make_float2(acc[q][2] * fw[1], acc[q][3] * fw[1]);
        }
    }
    __syncthreads();
    if (tid < 16 * Hc) {
        const int h2 = tid / 16, g = tid % 16;
        float m = -INFINITY, l = 0.0f;
        for (int q = 0; q < per; q++) m = ts_max(m, ml[(h2 + q * Hc) * 32 + g]);
        if (m != -INFINITY)
            for (int q = 0; q < per; q++) {
                const float mw = ml[(h2 + q * Hc) * 32 + g];
                if (mw != -INFINITY) l += exp2f(mw - m) * ml[(h2 + q * Hc) * 32 + 16 + g];
            }
        float *out = A.part + ((lg * Hc + h2) * A.ntask + task) * ts_part_floats(D);
        out[g] = m * NSA_LN2, out[16 + g] = l; /* the max in natural units */
    }
    if (PV)
        for (int e = tid; e < Hc * 4 * D; e += TS_THREADS) { /* four floats a thread */
            const int h2 = e / (4 * D), rc = 4 * (e - h2 * 4 * D);
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int q = 0; q < per; q++) {
                const float4 o = *(const float4 *)(Os + (h2 + q * Hc) * 16 * D + rc);
                v.x += o.x, v.y += o.y, v.z += o.z, v.w += o.w;
            }
            *(float4 *)(A.part + ((lg * Hc + h2) * A.ntask + task) * ts_part_floats(D) + 32 + rc) = v;
        }
    ts_let_next_start();
}

/* The contiguous and selected branches' launch: a CTA a task of one branch (the launch's
 * first or second, ts_launch.kind), sent to that branch's instance of ts_split_task. IMP: the
 * compressed branch of a selecting step (with or without its output, P.use_cmp). Two CTAs an
 * SM, as the shared memory allows anyway: the bound lets ptxas keep every value in registers
 * (left to itself it chose 168 and spilled). */
template <typename T, int D, bool IMP>
__global__ void __launch_bounds__(TS_THREADS, 2) ts_split_kernel(const step_params P, const ts_launch A)
{
    extern __shared__ __align__(16) unsigned char ts_sm[];
    /* (ts_split_task waits for the kernel before, where its reads need it) */
    /* consecutive CTAs take the same task of neighbouring head groups */
    const int64_t ng = A.n / A.hc, lg = blockIdx.x % ng, task = blockIdx.x / ng;
    const int bs = task < A.tasks[0] ? 0 : 1, kind = bs ? A.kind[1] : A.kind[0];
    if (IMP) {
        if (P.use_cmp) ts_split_task<T, D, BR_CMP, true, true>(P, A, ts_sm, lg, task, bs);
        else ts_split_task<T, D, BR_CMP, true, false>(P, A, ts_sm, lg, task, bs);
    } else if (kind == BR_CMP) {
        ts_split_task<T, D, BR_CMP, false, true>(P, A, ts_sm, lg, task, bs);
    } else if (kind == BR_SLC || kind == BR_SWA) {
        ts_split_task<T, D, BR_SLC_SWA, false, true>(P, A, ts_sm, lg, task, bs);
    } else {
        ts_split_task<T, D, BR_RANGE, false, true>(P, A, ts_sm, lg, task, bs);
    }
}

#define TS_MAX_TASKS (2 * TS_TARGET_CTAS + 8) /* the tasks of one item, all branches */

/* The partials of one item as two runs: n0 at b0 (the compressed branch's), n1 at b1 (the
 * selected and window branches', one after the other). */
struct ts_runs {
    const float *b0, *b1;
    int n0, n1;
    int64_t stride;
    __device__ __forceinline__ const float *at(int s) const { return s < n0 ? b0 + s * stride : b1 + (s - n0) * stride; }
};
__device__ __forceinline__ ts_runs ts_runs_of(const float *b0, int n0, const float *b1, int n1, int64_t stride)
{
    ts_runs R;
    R.b0 = b0, R.n0 = n0, R.b1 = b1, R.n1 = n1, R.stride = stride;
    return R;
}

/* (M, L) merged with a partial's (m, l), online (m = -inf: a task without a key; NaN propagates) */
__device__ __forceinline__ void ts_ml_add(float &M, float &L, float m, float l)
{
    if (m == -INFINITY) return;
    if (m > M || m != m) L = (M == -INFINITY ? 0.0f : L * expf(M - m)) + l, M = m;
    else L += l * expf(m - M);
}

/* the lanes' (M, L) merged across the warp, the result in every lane */
__device__ __forceinline__ void ts_ml_warp(float &M, float &L)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float Mo = __shfl_xor_sync(0xffffffffu, M, o), Lo = __shfl_xor_sync(0xffffffffu, L, o);
        const float Mn = ts_max(M, Mo);
        L = (M == -INFINITY ? 0.0f : L * expf(M - Mn)) + (Mo == -INFINITY ? 0.0f : Lo * expf(Mo - Mn));
        M = Mn;
    }
}

/* Row g's softmax max M[b] and sum L[b] over the partials [start[b], end[b]) of NB branches
 * (consecutive runs; each partial a max m and a sum l relative to it, -inf: a task without a
 * key; NaN propagates), by one warp in one pass: lane s % 32 takes partial s (from start[0]) in
 * order, online, then the lanes are merged. A lane's first two partials are loaded before any is
 * used: the combine's memory round trips are this one and the outputs' (one branch after the
 * other made it one a branch, each after the last). Each partial's max is left in ms[s] for the
 * weights. */
template <int NB>
__device__ __forceinline__ void ts_rows_ml(const ts_runs &R, int g, const int (&start)[NB], const int (&end)[NB], int lane, float *ms,
                                           float (&M)[NB], float (&L)[NB])
{
    const int N = end[NB - 1];
#pragma unroll
    for (int b = 0; b < NB; b++) M[b] = -INFINITY, L[b] = 0.0f;
    for (int s0 = start[0]; s0 < N; s0 += 64) {
        float m[2], l[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int s = s0 + 32 * u + lane;
            const float *p = R.at(s < N ? s : 0);
            m[u] = s < N ? p[g] : -INFINITY, l[u] = s < N ? p[16 + g] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int s = s0 + 32 * u + lane;
            if (s < N) ms[s] = m[u];
#pragma unroll
            for (int b = 0; b < NB; b++)
                if (s >= start[b] && s < end[b]) ts_ml_add(M[b], L[b], m[u], l[u]);
        }
    }
#pragma unroll
    for (int b = 0; b < NB; b++) ts_ml_warp(M[b], L[b]);
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

/* The warp's largest key: the high words' maximum, then the low words' among the lanes that
 * hold it (two redux instructions where a shuffle tree of 64-bit values takes ten). */
__device__ __forceinline__ unsigned long long ts_warp_max(unsigned long long k)
{
    const unsigned hi = __reduce_max_sync(0xffffffffu, (unsigned)(k >> 32));
    const unsigned lo = __reduce_max_sync(0xffffffffu, (unsigned)(k >> 32) == hi ? (unsigned)k : 0u);
    return (unsigned long long)hi << 32 | lo;
}

/* Each 16-row group's share of each block it overlaps, summed over the heads with each head's
 * factor exp(ref - M) / L, into gs[group][jj] (a row of 16 floats a group), in two passes over
 * the CTA: the factors, a thread a (group, head), into gs[group][head]; then a thread a (group,
 * block), its 16 heads' bins (a contiguous row of 16: four 16-byte loads) times their factors,
 * summed in the order of a half-warp's xor tree over the heads (8, 4, 2, 1), which is the order
 * the importance has always been summed in, and stored over the factors once every thread of
 * the CTA has read the rows of its round (so the sums need no shared memory of their own). A
 * half-warp a group with the heads summed by shuffles took five times the instructions
 * (bench/NOTES.md). */
__device__ __forceinline__ void ts_group_sums(const float *bins, int ntl, int JT, int G, const float *Mg, const float *Lg, float *gs)
{
    const int tid = threadIdx.x, nt = (int)blockDim.x;
    const int g = tid & 15; /* blockDim.x is a multiple of 16: a thread's head is the same in every round */
    const float Mh = g < G ? Mg[g] : 0.0f, Lh = g < G ? Lg[g] : 1.0f;
    for (int e0 = 0; e0 < ntl * 16; e0 += 4 * nt) { /* four factors' loads in flight a thread */
        float r[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int e = e0 + u * nt + tid;
            r[u] = e < ntl * 16 && g < G ? bins[(int64_t)(e >> 4) * 16 * (JT + 1) + JT * 16 + g] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int e = e0 + u * nt + tid;
            if (e < ntl * 16) gs[e] = g < G ? expf(r[u] - Mh) / Lh : 0.0f;
        }
    }
    const int rows = 2 * nt / JT; /* groups a round: two sums a thread */
    for (int t0 = 0; t0 < ntl; t0 += rows) { /* the same trip count in the whole CTA */
        __syncthreads(); /* the factors (first round), or the last round's sums, stored */
        const int n = (ntl - t0 < rows ? ntl - t0 : rows) * JT;
        float4 b[2][4];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int e = u * nt + tid, t = t0 + e / JT, jj = e % JT;
            const float4 *bt = (const float4 *)(bins + ((int64_t)t * (JT + 1) + jj) * 16);
#pragma unroll
            for (int q = 0; q < 4; q++) b[u][q] = e < n ? bt[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        float sum[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int e = u * nt + tid, t = t0 + e / JT;
            sum[u] = 0.0f;
            if (e >= n) continue;
            const float4 *f4 = (const float4 *)(gs + t * 16);
            float v[16];
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const float4 f = f4[q], x = b[u][q];
                /* a head past G has no bins (never written); one with no overlap adds nothing, whatever its factor */
                v[4 * q + 0] = 4 * q + 0 < G && x.x != 0.0f ? x.x * f.x : 0.0f;
                v[4 * q + 1] = 4 * q + 1 < G && x.y != 0.0f ? x.y * f.y : 0.0f;
                v[4 * q + 2] = 4 * q + 2 < G && x.z != 0.0f ? x.z * f.z : 0.0f;
                v[4 * q + 3] = 4 * q + 3 < G && x.w != 0.0f ? x.w * f.w : 0.0f;
            }
            /* lane 0 of a half-warp after xor 8, 4, 2, 1: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), a_k = v_k + v_k+8 */
            float a8[8];
#pragma unroll
            for (int k = 0; k < 8; k++) a8[k] = v[k] + v[k + 8];
            sum[u] = ((a8[0] + a8[4]) + (a8[2] + a8[6])) + ((a8[1] + a8[5]) + (a8[3] + a8[7]));
        }
        __syncthreads(); /* every factor of the round's groups read */
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int e = u * nt + tid;
            if (e < n) gs[(t0 + e / JT) * 16 + e % JT] = sum[u];
        }
    }
}

/* The n largest of the nc keys cand[0 ..) (0: no key) into chosen[rank], by the CTA: each
 * candidate's rank among all is counted by `split` neighbouring lanes; the keys are distinct, so
 * each rank has one. Ends with the CTA synchronised. */
__device__ __forceinline__ void ts_rank_candidates(const unsigned long long *cand, int nc, int n, unsigned long long *chosen)
{
    const int tid = threadIdx.x;
    int split = 1;
    while (split < 32 && nc * split * 2 <= (int)blockDim.x) split *= 2;
    const int total = (nc * split + 31) & ~31; /* whole warps: the shuffles below are uniform */
    for (int u = tid; u < total; u += blockDim.x) {
        const int c = u / split, part = u & (split - 1);
        const unsigned long long key = c < nc ? cand[c] : 0;
        int rank = 0;
        if (key != 0)
            for (int e = part; e < nc; e += split) rank += cand[e] > key;
        for (int o = 1; o < split; o <<= 1) rank += __shfl_xor_sync(0xffffffffu, rank, o);
        if (key != 0 && part == 0 && rank < n) chosen[rank] = key;
    }
    __syncthreads();
}

/* One CTA per item: the blocks its query reads, ascending, -1 after (the caller's, cleaned as
 * the CPU step does, or the top-n of the importance the compressed tiles left in bins). A warp
 * per query head (G <= 16). The CTA's time is mostly a chain of dependent steps whatever its
 * size (~12 us an item at 16k and 64k alike): 512 or 256 threads, or an item split over 4-16
 * CTAs whose candidates the last one merges, measured slower (bench/NOTES.md). */
#define TS_SELECT_THREADS 1024
__global__ void __launch_bounds__(TS_SELECT_THREADS, 1) ts_select_kernel(const step_params P, const ts_launch A1, int32_t *sel, int64_t width)
{
    extern __shared__ __align__(16) unsigned long long ts_keys[];
    __shared__ float Mg[16], Lg[16];
    __shared__ unsigned long long cand[TS_SELECT_THREADS / 32 * 64], chosen[64], wmax[TS_SELECT_THREADS / 32], theta_s;
    __shared__ int ncand, all_nan_s;
    ts_wait_prior();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t local = blockIdx.x, it = A1.item0 + local;
    /* head `warp`'s first 64 compressed partials (the tasks' row maxima and sums) loaded beside
     * the item's lengths: their addresses need neither, so both cost one round trip */
    const ts_runs R1 = ts_runs_of(A1.part + local * A1.ntask * ts_part_floats(P.DK), (int)A1.ntask, nullptr, 0, ts_part_floats(P.DK));
    const int ntask = P.selects ? (int)A1.ntask : 0;
    float pm[2], pl[2];
#pragma unroll
    for (int u = 0; u < 2; u++) {
        const int s = 32 * u + lane;
        const bool on = warp < P.G && s < ntask;
        const float *pp = R1.at(on ? s : 0);
        pm[u] = on ? pp[warp] : -INFINITY, pl[u] = on ? pp[16 + warp] : 0.0f;
    }
    const ts_item x = ts_item_of(P, it);
    if (!x.live) { /* no query here (past n_b, or the sequence skipped): no selection */
        if (P.idx.p)
            for (int64_t a = tid; a < P.n; a += blockDim.x) ((int32_t *)P.idx.p)[x.b * P.idx.s0 + x.i * P.idx.s1 + x.h * P.idx.s2 + a] = -1;
        return;
    }
    /* 32-bit: positions and blocks below the capacity (the host checks) */
    const int32_t cur = nsa_rule_slc_of32((int32_t)x.pos, (int32_t)P.lp);
    int32_t *out = sel + local * width;
    const int32_t nj = cur + 1;
    if (!P.selects) { /* the caller's blocks the query can use: in [0, cur], once, ascending */
        if (tid == 0) step_caller_blocks(P, x.b, x.i, x.h, cur, out, width);
    } else if (nj <= P.n) { /* every block the query can see */
        for (int64_t a = tid; a < width; a += blockDim.x) out[a] = a < nj ? (int32_t)a : -1;
    } else {
        const int32_t l = (int32_t)P.l, d = (int32_t)P.d, lp = (int32_t)P.lp, JT = A1.JT;
        const int32_t nv = nsa_rule_cmp_visible_cap32((int32_t)x.pos, l, d, nsa_rule_num_cmp32((int32_t)x.L, l, d));
        const int G = (int)P.G, n = (int)P.n, ntl = (nv + 15) / 16;
        const float *bins = A1.bins + local * A1.tiles * 16 * (JT + 1); /* the item's */
        /* each head's softmax over the compressed rows, from the tasks' partials: a warp a head
         * (ts_rows_ml's merge order, with the first loads moved above the item's) */
        if (warp < G) {
            float M = -INFINITY, L = 0.0f;
            ts_ml_add(M, L, pm[0], pl[0]), ts_ml_add(M, L, pm[1], pl[1]);
            for (int s = 64 + lane; s < ntask; s += 32) {
                const float *pp = R1.at(s);
                ts_ml_add(M, L, pp[warp], pp[16 + warp]);
            }
            ts_ml_warp(M, L);
            if (lane == 0) Mg[warp] = M, Lg[warp] = L;
        }
        __syncthreads();
        /* a head whose compressed scores are all -inf or NaN makes every p NaN on the CPU (0 / 0
         * or NaN), so every importance NaN: the blocks then rank by index (ranks_above) */
        if (warp == 0) {
            const bool bad = lane < G && (Mg[lane] == -INFINITY || Mg[lane] != Mg[lane] || Lg[lane] != Lg[lane]);
            const bool any = __any_sync(0xffffffffu, bad);
            if (lane == 0) all_nan_s = nv > 0 && any;
        }
        float *gs = (float *)(ts_keys + ((nj + 1) & ~1)); /* read as float4: 16-byte aligned */
        ts_group_sums(bins, ntl, JT, G, Mg, Lg, gs);
        __syncthreads();
        const float inv_d = 1.0f / (float)P.d;
        const bool all_nan = all_nan_s != 0;
        unsigned long long best = 0;
        for (int32_t j = tid; j < nj; j += blockDim.x) {
            const int32_t ra = nsa_rule_slc_first_cmp32(j, l, d, lp);
            int32_t rb = nsa_rule_slc_last_cmp32(j, d, lp);
            rb = rb < nv - 1 ? rb : nv - 1;
            float acc = 0.0f;
            if (ra <= rb)
                for (int32_t t = ra / 16; t <= rb / 16; t++) { /* the groups in order: one sum for every run */
                    const int32_t jj = j - 16 * t * d / lp;
                    if (jj >= 0 && jj < JT) acc += gs[t * 16 + jj];
                }
            const unsigned long long key = ts_rank_key(nsa_rule_forced(j, cur, P.n_init, P.n_local), all_nan && ra <= rb ? NAN : acc * inv_d, j);
            ts_keys[j] = key;
            best = ts_umax(best, key);
        }
        /* the top n in two levels. A bound first: theta, the n-th largest of the warps' maxima
         * (those n warps each hold a key at least that large, so no key below it is among the n
         * largest; 0, no bound, when fewer warps hold keys). Each warp then takes its own keys
         * down to theta, at most n, without block barriers (a warp maximum per round; the lane
         * that held it drops it and rescans its keys), and every candidate's rank among all
         * candidates is counted, by `split` neighbouring lanes a candidate; rank r goes to
         * chosen[r]. On random importances theta leaves a few candidates a warp, not n. */
        const int nw = (int)(blockDim.x >> 5);
        {
            const unsigned long long top = ts_warp_max(best);
            if (lane == 0) wmax[warp] = top;
            if (tid == 0) theta_s = 0, ncand = 0;
        }
        __syncthreads();
        if (warp == 0 && nw >= n) {
            const unsigned long long v = lane < nw ? wmax[lane] : 0;
            int above = 0;
            for (int u = 0; u < nw; u++) above += wmax[u] > v;
            if (lane < nw && above == n - 1) theta_s = v; /* at most one lane: the maxima are distinct or 0 */
        }
        __syncthreads();
        const unsigned long long theta = theta_s;
        for (int round = 0; round < n; round++) {
            const unsigned long long top = ts_warp_max(best);
            if (top == 0 || top < theta) break; /* the same in every lane */
            if (lane == 0) cand[atomicAdd(&ncand, 1)] = top;
            if (best == top) {
                ts_keys[0x7fffffffu - (uint32_t)(top & 0x7fffffffull)] = 0;
                best = 0;
                for (int32_t j = tid; j < nj; j += blockDim.x) best = ts_umax(best, ts_keys[j]);
            }
        }
        __syncthreads();
        ts_rank_candidates(cand, ncand, n, chosen);
        if (tid < n) { /* ascending (each block's place: the chosen blocks below it), then -1 */
            const int32_t v = (int32_t)(0x7fffffffu - (uint32_t)(chosen[tid] & 0x7fffffffull));
            int at = 0;
            for (int a = 0; a < n; a++) at += (int32_t)(0x7fffffffu - (uint32_t)(chosen[a] & 0x7fffffffull)) < v;
            out[at] = v;
        }
        for (int64_t a = P.n + tid; a < width; a += blockDim.x) out[a] = -1;
    }
    __syncthreads();
    if (P.idx.p)
        for (int64_t a = tid; a < P.n; a += blockDim.x)
            ((int32_t *)P.idx.p)[x.b * P.idx.s0 + x.i * P.idx.s1 + x.h * P.idx.s2 + a] = a < width ? out[a] : -1;
    ts_let_next_start();
}

/* The weighted sum over the partials s = k * nparts + part (k = 0, 1, ...) of one item of row
 * g of their outputs, by one warp: four columns a lane (D = 64: two half-warps over alternate
 * k), eight partials' loads in flight; a partial of weight 0 is not read (an empty task leaves no
 * output). The result is in lanes < D / 4. */
__device__ __forceinline__ float4 ts_weighted_sum(const ts_runs &R, int g, int D, const float *w, int lane, int part, int nparts)
{
    const int C4 = D / 4, NG = 32 / C4, c4 = lane % C4, grp = lane / C4, n = R.n0 + R.n1;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int k0 = grp; k0 * nparts + part < n; k0 += 8 * NG) {
        float ws[8];
        float4 o[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int s = (k0 + u * NG) * nparts + part;
            ws[u] = s < n ? w[s] : 0.0f;
            o[u] = ws[u] != 0.0f ? *(const float4 *)(R.at(s) + 32 + g * D + 4 * c4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < 8; u++) acc.x += ws[u] * o[u].x, acc.y += ws[u] * o[u].y, acc.z += ws[u] * o[u].z, acc.w += ws[u] * o[u].w;
    }
    if (NG == 2) {
        acc.x += __shfl_down_sync(0xffffffffu, acc.x, 16), acc.y += __shfl_down_sync(0xffffffffu, acc.y, 16);
        acc.z += __shfl_down_sync(0xffffffffu, acc.z, 16), acc.w += __shfl_down_sync(0xffffffffu, acc.w, 16);
    }
    return acc;
}

/* weights w[s] = mul * exp(m_s - M) / L of the partials s in [s0, s1) that are warp sub's of
 * a head's wph warps (s % wph == sub: the ones ts_weighted_sum reads there), 0 where m_s or M is
 * -inf, in place of their maxima ms[s] = w[s] (ts_rows_ml), by one warp */
__device__ __forceinline__ void ts_weights_of(float *w, int s0, int s1, float M, float L, float mul, int lane, int sub, int wph)
{
    const int first = s0 + ((sub - s0) % wph + wph) % wph; /* the first s >= s0 of the warp's */
    for (int s = first + wph * lane; s < s1; s += 32 * wph) {
        const float m = w[s];
        w[s] = M == -INFINITY || m == -INFINITY ? 0.0f : mul * expf(m - M) / L;
    }
}

/* How a combine CTA is laid out: `hpc` query heads of one item, `wph` warps a head (the
 * partials split over them, summed in shared memory). Many items: a CTA an item, a warp a head
 * (at B = 32 the 2048 short CTAs of a CTA per head took four times what their loads need);
 * few items: a CTA a head, eight warps over its partials (at B = 1 a head has ~60 of them). */
struct ts_comb {
    int hpc, wph;
    int64_t local;
    int g, sub, lane, hl; /* hl: the head's slot in the CTA */
    ts_item x;            /* the item (launch-local index `local`, global item0 + local) */
    int64_t hq, stride;   /* the query head; floats a partial */
};
__device__ __forceinline__ ts_comb ts_comb_of(const step_params &P, int64_t item0)
{
    ts_comb c;
    c.wph = (int)(blockDim.x >> 5) == (int)P.G ? 1 : TS_COMBINE_SPLIT;
    c.hpc = c.wph == 1 ? (int)P.G : 1;
    const int64_t per = P.G / c.hpc; /* CTAs an item */
    const int warp = threadIdx.x >> 5;
    c.local = blockIdx.x / per, c.g = (int)(blockIdx.x % per) * c.hpc + warp / c.wph, c.sub = warp % c.wph;
    c.lane = threadIdx.x & 31, c.hl = c.g % c.hpc;
    c.x = ts_item_of(P, item0 + c.local);
    c.hq = c.x.h * P.G + c.g, c.stride = ts_part_floats(P.DV);
    return c;
}

/* The row's sum over its partials by the head's wph warps, in warp sub 0 (its lanes < D / 4). */
__device__ __forceinline__ float4 ts_sum_parts(const ts_runs &R, const ts_comb &c, int D, const float *w, float4 *red)
{
    float4 v = ts_weighted_sum(R, c.g, D, w, c.lane, c.sub, c.wph);
    if (c.wph == 1) return v;
    if (c.lane < D / 4) red[c.sub * 32 + c.lane] = v;
    __syncthreads();
    if (c.sub == 0)
        for (int q = 1; q < c.wph; q++) {
            const float4 o = red[q * 32 + c.lane];
            v.x += o.x, v.y += o.y, v.z += o.z, v.w += o.w;
        }
    return v;
}

/* Stores a lane's four columns of row hq of o (lanes < D / 4). */
__device__ __forceinline__ void ts_store4(const step_params &P, const ts_item &x, int64_t hq, int D, int lane, float4 v)
{
    if (lane >= D / 4) return;
    const int64_t at = x.b * P.o.s0 + x.i * P.o.s1 + hq * P.o.s2 + 4 * lane;
    st_any(P.o.p, P.o.dt, at, v.x), st_any(P.o.p, P.o.dt, at + 1, v.y);
    st_any(P.o.p, P.o.dt, at + 2, v.z), st_any(P.o.p, P.o.dt, at + 3, v.w);
}

/* The NSA step's branches merged with one weight per partial (the gate times exp(m - M) / L; a
 * branch without a key gives 0, as on the CPU) and stored (layout: ts_comb). Every load of a
 * branch's softmax -- the gate, its partials' maxima and sums, whether the item is live -- is
 * issued before any is used. A warp a head takes the three branches itself; with several warps
 * a head, warps 0, 1, 2 take one branch each and share (M, L) through shared memory, then each
 * warp weighs and sums its own share of the partials. */
__global__ void __launch_bounds__(TS_COMBINE_THREADS, 1) ts_combine_kernel(const step_params P, const ts_launch A1, const ts_launch A3)
{
    __shared__ float wsm[16 * TS_MAX_TASKS];
    __shared__ float4 red[TS_COMBINE_SPLIT * 32];
    __shared__ float ml_s[3][2];
    ts_wait_prior();
    const ts_comb c = ts_comb_of(P, A1.item0);
    const ts_item &x = c.x; /* b and i in range whether or not the item is live */
    const int lane = c.lane, g = c.g, D = P.DV;
    const int64_t local = c.local, stride = c.stride, hq = c.hq;
    /* the runs: compressed (A1), selected then window (A3); a branch switched off has none */
    const int nc = P.use_cmp ? (int)A1.ntask : 0, ns = P.use_slc ? (int)A3.tasks[0] : 0,
              nw = P.use_swa ? (int)(P.use_slc ? A3.tasks[1] : A3.tasks[0]) : 0;
    const ts_runs R = ts_runs_of(A1.part + local * A1.ntask * stride, nc, A3.part + local * A3.ntask * stride, ns + nw, stride);
    const int start[3] = {0, nc, nc + ns}, end[3] = {nc, nc + ns, nc + ns + nw};
    /* the gates of the branches that are on */
    const float gv[3] = {nc ? ld_any(P.gc.p, P.gc.dt, x.b * P.gc.s0 + x.i * P.gc.s1 + hq * P.gc.s2) : 0.0f,
                         ns ? ld_any(P.gs.p, P.gs.dt, x.b * P.gs.s0 + x.i * P.gs.s1 + hq * P.gs.s2) : 0.0f,
                         nw ? ld_any(P.gw.p, P.gw.dt, x.b * P.gw.s0 + x.i * P.gw.s1 + hq * P.gw.s2) : 0.0f};
    float *w = wsm + c.hl * TS_MAX_TASKS; /* the head's partials' maxima, then their weights */
    float M[3], L[3];
    if (c.wph == 1) {
        ts_rows_ml<3>(R, g, start, end, lane, w, M, L);
    } else { /* a head a CTA (hl = 0) */
        if (c.sub < 3) {
            const int br = c.sub, st[1] = {br == 0 ? 0 : br == 1 ? nc : nc + ns}, en[1] = {br == 0 ? nc : br == 1 ? nc + ns : nc + ns + nw};
            float Mb[1], Lb[1];
            ts_rows_ml<1>(R, g, st, en, lane, w, Mb, Lb);
            if (lane == 0) ml_s[br][0] = Mb[0], ml_s[br][1] = Lb[0];
        }
        __syncthreads();
#pragma unroll
        for (int br = 0; br < 3; br++) M[br] = ml_s[br][0], L[br] = ml_s[br][1];
    }
    if (!x.live) { /* the same in the whole CTA: no query here (past n_b, or the sequence skipped), o = 0 */
        if (c.sub == 0) ts_store4(P, x, hq, D, lane, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
        return;
    }
    /* the weights of the partials this warp sums (ts_weighted_sum: s = k * wph + sub), a branch at a time */
#pragma unroll
    for (int br = 0; br < 3; br++) ts_weights_of(w, start[br], end[br], M[br], L[br], gv[br], lane, c.sub, c.wph);
    bool dead = false; /* a branch that saw keys whose scores were all -inf: 0 / 0, as the CPU's */
#pragma unroll
    for (int br = 0; br < 3; br++) {
        if (end[br] == start[br] || M[br] != -INFINITY) continue;
        /* no finite score: did the branch see a key at all? */
        bool seen = br == 2; /* the window sees the query's own token */
        if (br == 0) seen = nsa_rule_cmp_visible_cap(x.pos, P.l, P.d, nsa_rule_num_cmp(x.L, P.l, P.d)) > 0;
        if (br == 1) {
            bool any = false;
            for (int64_t a = lane; a < A3.width; a += 32) any |= A3.sel[local * A3.width + a] >= 0;
            seen = __any_sync(0xffffffffu, any);
        }
        dead |= seen;
    }
    __syncwarp();
    float4 v = ts_sum_parts(R, c, D, w, red);
    if (c.sub != 0) return;
    if (dead) v = make_float4(NAN, NAN, NAN, NAN);
    ts_store4(P, x, hq, D, lane, v);
    ts_let_next_start();
}

/* The dense step's partials merged with the sink, stored with the lse (the scalar kernel's rules
 * for rows without a finite score; layout and load order: ts_combine_kernel's). */
__global__ void __launch_bounds__(TS_COMBINE_THREADS, 1) ts_dense_combine_kernel(const step_params P, const ts_launch A)
{
    __shared__ float wsm[16 * TS_MAX_TASKS];
    __shared__ float4 red[TS_COMBINE_SPLIT * 32];
    ts_wait_prior();
    const ts_comb c = ts_comb_of(P, A.item0);
    const ts_item &x = c.x;
    const int lane = c.lane, g = c.g, D = P.DV;
    const int64_t local = c.local, stride = c.stride, hq = c.hq;
    const ts_runs R = ts_runs_of(A.part + local * A.ntask * stride, (int)A.ntask, nullptr, 0, stride);
    const bool sink = P.sinks != nullptr;
    const float sk = sink ? P.sinks[hq * P.sinks_s] : -INFINITY;
    float *w = wsm + (c.wph > 1 ? c.sub : c.hl) * TS_MAX_TASKS;
    const int start[1] = {0}, end[1] = {(int)A.ntask};
    float Ms[1], Ls[1];
    ts_rows_ml<1>(R, g, start, end, lane, w, Ms, Ls);
    if (!x.live) { /* no query here (past n_b, or the sequence skipped): o = 0, lse = -inf */
        if (c.sub != 0) return;
        if (lane == 0 && P.lse.p) ((float *)P.lse.p)[x.b * P.lse.s0 + x.i * P.lse.s1 + hq * P.lse.s2] = -INFINITY;
        ts_store4(P, x, hq, D, lane, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
        return;
    }
    const float M = Ms[0], L = Ls[0];
    int64_t lo, hi;
    ts_range(P, BR_RANGE, x, lo, hi);
    const bool seen = hi >= lo;
    const float m = sink && sk > M ? sk : M;
    float lse, fill, mul = 0.0f; /* fill: 1 (the merged row), else the row's value: NaN when keys were seen, else 0 */
    if (m == -INFINITY) { /* no key and no finite sink: o = 0; keys all at -inf: 0 / 0 as dense softmax */
        lse = seen ? NAN : sink ? sk : -INFINITY, fill = seen ? NAN : 0.0f;
    } else { /* the weights exp(m_s - M) / L become exp(m_s - m) / (L e + the sink's term) */
        const float e = M == -INFINITY ? 0.0f : expf(M - m), Lt = L * e + (sink ? expf(sk - m) : 0.0f);
        lse = m + logf(Lt), fill = 1.0f, mul = L * e / Lt;
    }
    ts_weights_of(w, 0, end[0], M, L, mul, lane, c.sub, c.wph);
    if (c.sub == 0 && lane == 0 && P.lse.p) ((float *)P.lse.p)[x.b * P.lse.s0 + x.i * P.lse.s1 + hq * P.lse.s2] = lse;
    __syncwarp();
    float4 v = ts_sum_parts(R, c, D, w, red);
    if (c.sub != 0) return;
    if (fill != 1.0f) v = make_float4(fill, fill, fill, fill);
    ts_store4(P, x, hq, D, lane, v);
    ts_let_next_start();
}

/* ---- host ---------------------------------------------------------------------------- */

static int64_t ts_tasks(int64_t tiles, int64_t items, int64_t min_tpc, int64_t *tpc)
{
    /* whole waves: rounding the tasks per item up would leave the last wave part empty */
    const int64_t want = items >= TS_TARGET_CTAS ? 1 : TS_TARGET_CTAS / items;
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
    if (P->B * P->Tq * P->H > INT32_MAX) return 0; /* items counted in 32 bits (ts_item_of) */
    /* rows, pages and stages counted in 32 bits (ts_issue, ts_split_task): longer caches take the scalar step */
    if (P->kv.cap > INT32_MAX / 2 || P->ckv.cap > INT32_MAX / 2) return 0;
    const int dt = P->q.dt;
    if (dt != NSA_DTYPE_BF16 && dt != NSA_DTYPE_F16) return 0;
    /* the tiles copy 16-byte pieces: rows must start on 16 bytes */
    return P->kv.k.dt == dt && P->kv.v.dt == dt && P->q.al && P->kv.k.al && P->kv.v.al;
}

/* Selection blocks the 16 compressed rows of a group overlap (rows 0 .. 15 of the first). */
static int64_t ts_blocks_per_group(const step_params *P) { return (15 * P->d + P->l - 1) / P->lp + 1; }

/* kv heads per CTA (a stage holds their rows of 64 / hc tokens, side by side in the cache).
 * Every CTA leaves one partial per head, so for the same CTAs four heads write four times the
 * partials one head does: below a wave of items (small batches, where a head's keys are split
 * over many CTAs) one head a CTA; above, the most of 4, 2, 1 that divides H. */
static int ts_heads_per_cta(const grun *g, int64_t H, int64_t items)
{
    const int want = g->ovr->step_hc ? g->ovr->step_hc : items < TS_TARGET_CTAS ? 1 : 4;
    return want == 4 && H % 4 == 0 ? 4 : want >= 2 && H % 2 == 0 ? 2 : 1;
}

/* 16-row groups of the compressed cache (the importance sums' unit) */
static int64_t ts_groups(const step_params *P) { return cdiv64(P->ckv.cap, 16); }

/* The top-n's shared memory: a key per selection block (an even count), then per 16-row group
 * its 16 heads' factors, which its sums per block it overlaps (at most 16) replace. */
static size_t ts_select_smem(const step_params *P)
{
    return (size_t)(cdiv64(P->kv.cap, P->lp) + 1) * 8 + (size_t)ts_groups(P) * 16 * 4;
}

int step_tiled_fits(const grun *g, const step_params *P)
{
    if (!ts_common_fits(g, P)) return 0;
    if ((P->use_cmp || P->selects) && (P->ckv.k.dt != P->q.dt || P->ckv.v.dt != P->q.dt || !P->ckv.k.al || !P->ckv.v.al)) return 0;
    if (P->selects) {
        if (ts_select_smem(P) > TS_SELECT_SMEM || P->n > 64 || P->kv.cap > INT32_MAX / 2 ||
            ts_blocks_per_group(P) > TS_JT_MAX || (16 * P->d) % P->lp != 0)
            return 0;
    }
    return 1;
}

int attention_step_tiled_fits(const grun *g, const step_params *P) { return ts_common_fits(g, P); }

void step_tiled_take(grun *g, const step_params *P, ts_plan *pl)
{
    memset(pl, 0, sizeof *pl);
    pl->D = P->DK;
    pl->items = P->B * P->Tq * P->H;
    pl->batch = pl->items < TS_BATCH ? pl->items : TS_BATCH;
    pl->hc = ts_heads_per_cta(g, P->H, pl->batch);
    const int64_t pf = ts_part_floats(pl->D), KS = 64 / pl->hc, groups = pl->batch / pl->hc;
    if (P->use_cmp || P->selects) {
        pl->tiles1 = cdiv64(P->ckv.cap, KS);
        pl->nt1 = ts_tasks(pl->tiles1, groups, TS_MIN_ROWS / KS, &pl->tpc1);
        pl->part1 = cu_take_f32(g, nsa_size_mul(nsa_size_of(pl->batch * pl->nt1), nsa_size_of(pf)), 0);
    }
    if (P->selects) {
        pl->JT = (int)ts_blocks_per_group(P);
        pl->bins = cu_take_f32(g, nsa_size_mul(nsa_size_of(pl->batch * ts_groups(P) * 16), nsa_size_of(pl->JT + 1)), 0);
    }
    pl->width = P->m > P->n ? P->m : P->n;
    pl->tpb = (int)cdiv64(P->lp, KS);
    if (P->use_slc) pl->sel = (int32_t *)g_take_n(g, nsa_size_mul(nsa_size_of(pl->batch), nsa_size_of(pl->width)), sizeof(int32_t));
    const int64_t tiles_slc = P->use_slc ? pl->width * pl->tpb : 0, tiles_swa = P->use_swa ? cdiv64(P->w + 15, KS) : 0; /* from a multiple of 16 */
    if (tiles_slc + tiles_swa > 0) {
        /* one launch's tasks shared between the branches in proportion to their stages, each
         * branch rounded on its own: one length for both made a third task of the item's
         * short remainder, and a launch of two waves where one would do (B = 32: 384 CTAs) */
        const int64_t want = groups >= TS_TARGET_CTAS ? 1 : TS_TARGET_CTAS / groups, all = tiles_slc + tiles_swa;
        int64_t w_slc = tiles_slc ? (want * tiles_slc + all / 2) / all : 0;
        if (tiles_slc && w_slc < 1) w_slc = 1;
        if (tiles_swa && w_slc >= want && want > 1) w_slc = want - 1;
        const int64_t w_swa = tiles_swa ? (want - w_slc > 1 ? want - w_slc : 1) : 0;
        pl->tpc_slc = tiles_slc ? cdiv64(tiles_slc, w_slc) : 1;
        pl->tpc_swa = tiles_swa ? cdiv64(tiles_swa, w_swa) : 1;
        pl->nt_slc = tiles_slc ? cdiv64(tiles_slc, pl->tpc_slc) : 0;
        pl->nt_swa = tiles_swa ? cdiv64(tiles_swa, pl->tpc_swa) : 0;
        pl->part3 = cu_take_f32(g, nsa_size_mul(nsa_size_of(pl->batch * (pl->nt_slc + pl->nt_swa)), nsa_size_of(pf)), 0);
    }
}

/* The combine's layout (ts_comb): a CTA an item, a warp a head; or, below a quarter wave of
 * items that have more than 32 partials each (B = 1: ~60), a CTA a head with TS_COMBINE_SPLIT
 * warps over its partials (at B = 8, 15 partials an item, that layout's 512 CTAs took longer
 * than 32 of the former). G = TS_COMBINE_SPLIT reads as the former (the kernel tells the two
 * apart by the block size), so it takes the latter only as the same layout. */
static bool ts_comb_split(const step_params *P, int64_t n, int64_t parts)
{
    return n < TS_TARGET_CTAS / 4 && parts > 32 && P->G != TS_COMBINE_SPLIT;
}
static unsigned ts_comb_grid(const step_params *P, int64_t n, int64_t parts)
{
    return (unsigned)(ts_comb_split(P, n, parts) ? n * P->G : n);
}
static unsigned ts_comb_block(const step_params *P, int64_t n, int64_t parts)
{
    return (unsigned)(32 * (ts_comb_split(P, n, parts) ? TS_COMBINE_SPLIT : P->G));
}

/* Launches kernel k on the call's stream, as a programmatic dependent of the kernel before it
 * on sm_90 parts (see ts_wait_prior) unless NSA_CUDA_STEP_PDL=0 or it is the step's first
 * (after = 0: it reads the step's inputs, which the work before it on the stream may write). */
template <typename... KArgs, typename... Args>
static void ts_launch_k(grun *g, int after, void (*k)(KArgs...), unsigned grid, unsigned block, size_t smem, Args... args)
{
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDim = dim3(grid), cfg.blockDim = dim3(block), cfg.dynamicSmemBytes = smem, cfg.stream = g->st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at, cfg.numAttrs = after && g->dev.cc_major >= 9 && g->ovr->step_pdl ? 1 : 0;
    g_check(g, cudaLaunchKernelEx(&cfg, k, args...));
}

template <typename T, int D, bool IMP> static void ts_launch_split(grun *g, const step_params &P, const ts_launch &A, int64_t n)
{
    const size_t smem = ts_smem<D>::end;
    g_smem_optin(g, (const void *)ts_split_kernel<T, D, IMP>, smem);
    if (!g_live(g)) return;
    ts_launch_k(g, !A.check, ts_split_kernel<T, D, IMP>, (unsigned)(n / A.hc * A.ntask), TS_THREADS, smem, P, A);
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

/* Whether the step can go without its check kernel: nothing to write before the reads (no
 * append, no pooling), one launch round (the check is per round's CTAs), and a split kernel as
 * the first launch (the compressed one, or the window's; the caller's selection without the
 * compressed branch starts with the top-n, which does not check). */
int step_tiled_checks(const step_params *P, const ts_plan *pl)
{
    return !P->append && !P->pool && pl->items <= pl->batch && (P->use_cmp || P->selects || !P->use_slc);
}

void step_tiled_launch(grun *g, const step_params *P, const ts_plan *pl, int checks)
{
    const int cmp = P->use_cmp || P->selects;
    for (int64_t i0 = 0; i0 < pl->items && g_live(g); i0 += pl->batch) {
        const int64_t n = pl->items - i0 < pl->batch ? pl->items - i0 : pl->batch;
        ts_launch A1, A3;
        memset(&A1, 0, sizeof A1), memset(&A3, 0, sizeof A3);
        A1.item0 = A3.item0 = i0;
        A1.kind[0] = BR_CMP, A1.tasks[0] = pl->nt1, A1.tpc[0] = pl->tpc1, A1.ntask = pl->nt1;
        A1.part = pl->part1, A1.bins = pl->bins, A1.tiles = ts_groups(P), A1.JT = pl->JT, A1.n = A3.n = n;
        A1.hc = A3.hc = pl->hc;
        A1.check = checks && cmp, A3.check = checks && !cmp; /* the first launch checks */
        if (cmp) ts_split_any(g, *P, A1, n, pl->D, P->selects != 0);
        if (P->use_slc) {
            const size_t smem = P->selects ? ts_select_smem(P) : 0;
            g_smem_optin(g, (const void *)ts_select_kernel, smem);
            if (!g_live(g)) return;
            ts_launch_k(g, 1, ts_select_kernel, (unsigned)n, TS_SELECT_THREADS, smem, *P, A1, pl->sel, pl->width);
        }
        int nb = 0;
        if (P->use_slc) A3.kind[nb] = BR_SLC, A3.tasks[nb] = pl->nt_slc, A3.tpc[nb] = pl->tpc_slc, nb++;
        if (P->use_swa) A3.kind[nb] = BR_SWA, A3.tasks[nb] = pl->nt_swa, A3.tpc[nb] = pl->tpc_swa, nb++;
        A3.ntask = A3.tasks[0] + A3.tasks[1];
        A3.part = pl->part3, A3.sel = pl->sel, A3.width = pl->width, A3.tpb = pl->tpb;
        /* a launch stands between it and the one that checks (the check kernel, or the compressed
         * launch when that checks): the lengths and verdicts are then complete before it starts */
        A3.early = checks ? cmp && P->use_slc : cmp || P->use_slc;
        if (nb) ts_split_any(g, *P, A3, n, pl->D, false);
        if (!g_live(g)) return;
        const int64_t parts = (P->use_cmp ? A1.ntask : 0) + A3.ntask;
        ts_launch_k(g, 1, ts_combine_kernel, ts_comb_grid(P, n, parts), ts_comb_block(P, n, parts), 0, *P, A1, A3);
    }
}

void attention_step_tiled_take(grun *g, const step_params *P, ts_plan *pl)
{
    memset(pl, 0, sizeof *pl);
    pl->D = P->DK;
    pl->items = P->B * P->Tq * P->H;
    pl->batch = pl->items < TS_BATCH ? pl->items : TS_BATCH;
    pl->hc = ts_heads_per_cta(g, P->H, pl->batch);
    pl->tiles1 = cdiv64(P->kv.cap, 64 / pl->hc);
    pl->nt1 = ts_tasks(pl->tiles1, pl->batch / pl->hc, TS_MIN_ROWS / (64 / pl->hc), &pl->tpc1);
    pl->part1 = cu_take_f32(g, nsa_size_mul(nsa_size_of(pl->batch * pl->nt1), nsa_size_of(ts_part_floats(pl->D))), 0);
}

/* As step_tiled_checks: no append and one launch round. */
int attention_step_tiled_checks(const step_params *P, const ts_plan *pl) { return !P->append && pl->items <= pl->batch; }

void attention_step_tiled_launch(grun *g, const step_params *P, const ts_plan *pl, int checks)
{
    for (int64_t i0 = 0; i0 < pl->items && g_live(g); i0 += pl->batch) {
        const int64_t n = pl->items - i0 < pl->batch ? pl->items - i0 : pl->batch;
        ts_launch A;
        memset(&A, 0, sizeof A);
        A.item0 = i0;
        A.kind[0] = BR_RANGE, A.tasks[0] = pl->nt1, A.tpc[0] = pl->tpc1, A.ntask = pl->nt1, A.part = pl->part1, A.n = n;
        A.hc = pl->hc, A.check = checks;
        ts_split_any(g, *P, A, n, pl->D, false);
        if (!g_live(g)) return;
        ts_launch_k(g, 1, ts_dense_combine_kernel, ts_comb_grid(P, n, A.ntask), ts_comb_block(P, n, A.ntask), 0, *P, A);
    }
}
