/* kernels.h -- parameter blocks of the backend's kernels and their host launchers.
 * Kernels take their params struct by value; the host fills it from validated args. Every
 * launcher is a no-op in the sizing pass (g->dry) or after an earlier error. */
#ifndef NSA_CUDA_KERNELS_H
#define NSA_CUDA_KERNELS_H

#include "common.cuh"

enum { MODE_FWD = 0, MODE_DQ = 1 };
enum { RULE_WIN = 0, RULE_CMP = 1, RULE_SLC = 2 };

/* Which keys a query row sees: window/dense (wl, wr, causal), compressed (l, d) or
 * selected (block lp, causal inside the block). */
typedef struct rule_t {
    int kind;
    int64_t wl, wr;
    int causal;
    int cl, cd, lp;
    /* attention options the range forward tiles (qtile, qwg) apply themselves; 0 / NULL = off
     * (their backward runs the general kernels of xattn.cuh) */
    float cap;            /* logit softcap */
    const float *sinks;   /* [HQ] sink logits at stride sinks_s */
    int64_t sinks_s;
    int shift;            /* window rule, Tq != Tk (dense batch): query t's diagonal is key t + shift */
    int nk;               /* window rule: key count (Tk, 0 allowed); -1: the sequence's length */
} rule_t;

/* qtile: forward (o, lse) or dQ of one branch. */
typedef struct qparams {
    dview q, k, v, o, lse, dout;
    const float *Dw, *gw;  /* DQ: flat per-row D = g * rowsum(dout * o), gate g (NULL: 1) */
    float *dq;             /* DQ: flat fp32 [B*T*HQ*DK], added to */
    int64_t T, HQ, H, G;
    int DK, DV;
    float sl2, scale;      /* scale * log2(e), scale */
    rule_t rule;
    const int32_t *U, *ucnt; /* SLC: usable blocks [B*T*H][m] ascending, counts */
    int m;
    seqmap sm;
    int nw;                /* warps per CTA: tile rows = 16 * nw */
    int nst;               /* K/V buffers: 2 = double-buffered, 1 = single (less shared memory) */
    int bn;                /* keys per chunk: 64, or 32 (one-warp selected tiles) */
    int rp;                /* sfw: positions per warp (16 / G at G = 4 or 8: rows = positions x heads), else 1 */
    int ks;                /* sfw: warps sharing those rows on alternate chunks (2: the G = 4 forward) */
    /* qwg: Q (and dO in dQ) arrives as one TMA box of 128 / G positions x G heads (G divides
     * 128); forward O leaves each warpgroup as one of 64 / G positions (G divides 64; O in q's
     * dtype) */
    int qbox, obox;
    int64_t tiles, tasks;  /* qwg: tiles per kv head, tiles x H (set by its launcher) */
    dview dqo;             /* qwg dQ: .p set = write dq here (q's dtype or f32) instead of adding into dq */
    int *ctr;              /* qwg forward: zeroed task counter of a persistent walk (NULL: none) */
    int dyn;               /* (set by the launcher: the walk is persistent) */
} qparams;

/* ktile: dK, dV of one branch into flat fp32 [B, KR, H, D] buffers (added to). */
typedef struct kparams {
    dview q, k, v, dout, lse;
    const float *Dw, *gw;
    float *dk, *dv;
    int64_t T, HQ, H, G, KR;
    int DK, DV;
    float sl2, scale;
    rule_t rule;
    /* SLC: inverted selection, per (sequence, head) region: offs[nb + 1], list[len * m] */
    const int32_t *offs, *list;
    const int64_t *offs_pref, *list_pref; /* varlen region prefixes (NULL: dense) */
    int m, nsub;                          /* list width, 64-key tiles per block */
    /* Long lists are cut into segments of segp queries (0: never): the first segment adds
     * into dk/dv, each further one (enumerated by xoff over the flat offs array of nflat
     * entries) writes an fp32 partial that nsa_cu_slc_reduce adds in order afterwards. */
    int segp, extra;                      /* extra: this launch runs the further segments */
    const int32_t *xoff;
    int64_t nflat;
    float *part;
    /* Compressed keys are few (Nc / 64 tiles) and each is seen by most queries: nseg > 1
     * splits a tile's rows into nseg tasks; segment 0 adds into dk/dv, the others write the
     * partial of slot (task, head), added in order by nsa_cu_seg_reduce. */
    int nseg;
    int bk;                               /* keys per task: 64 (ktile), KWG_BK (kwg_kernel) */
    seqmap sm;
} kparams;

/* select: importance of every candidate block, top-n per (position, kv head). */
typedef struct sparams {
    dview q, k, lse, idx, cnt;
    int64_t T, HQ, H, G;
    int DK;
    float sl2;
    int cl, cd, lp, n, n_init, n_local;
    int P, HC, JC; /* positions per CTA, heads per pass, selection blocks per key pass */
    seqmap sm;
} sparams;

/* Shared memory of each kernel (bytes); the kernels carve in the same order. */
static inline size_t qtile_smem(int DKP, int DVP, int nw, int mode, int nst, int bn)
{
    const size_t BM = 16 * (size_t)nw, LDK = DKP + 8, LDV = DVP + 8;
    /* one-warp forward: Q lives in registers (qtile_kernel's qreg) */
    const size_t el = (mode == MODE_FWD && nw == 1 ? 0 : BM * LDK) + (mode == MODE_DQ ? BM * LDV : 0) + (size_t)nst * bn * LDK + (size_t)nst * bn * LDV;
    return el * 2 + 2 * BM * 8 + 12 * 4 + 3 * 64;
}

static inline size_t ktile_smem(int DKP, int DVP)
{
    const size_t LDK = DKP + 8, LDV = DVP + 8;
    const size_t el = 3 * 64 * LDK + 3 * 64 * LDV;
    return el * 2 + 2 * 3 * 64 * 8 + 5 * 3 * 64 * 4 + 3 * 2 * 4;
}

static inline size_t select_smem(int DKP, int P, int JC, int n, int HC)
{
    const size_t LDK = DKP + 8;
    const size_t el = 64 * LDK + 64 * LDK;
    return el * 2 + (HC == 16 ? 0 : 64 * 65 * 4) + (size_t)P * JC * 4 + (size_t)P * n * 8 + (size_t)P * 4 + 64 * 4 + 64 * 4 + 16 + 64 * 8 +
           (size_t)P * 64 * 4;
}

/* Engine launchers, one set per head-dim class (engine_d64.cu, engine_d128.cu,
 * engine_d192.cu): 64 = DK, DV <= 64; 128 = DK, DV <= 128; 192 = DK <= 192, DV <= 128. */
void nsa_cu_qtile_64(grun *g, const qparams *P, int mode, int bf16, int64_t tiles);
void nsa_cu_qtile_128(grun *g, const qparams *P, int mode, int bf16, int64_t tiles);
void nsa_cu_qtile_192(grun *g, const qparams *P, int mode, int bf16, int64_t tiles);
void nsa_cu_ktile_64(grun *g, const kparams *P, int bf16, int64_t tiles);
void nsa_cu_ktile_128(grun *g, const kparams *P, int bf16, int64_t tiles);
void nsa_cu_ktile_192(grun *g, const kparams *P, int bf16, int64_t tiles);
void nsa_cu_select_64(grun *g, const sparams *P, int bf16, int64_t tiles);
void nsa_cu_select_128(grun *g, const sparams *P, int bf16, int64_t tiles);
void nsa_cu_select_192(grun *g, const sparams *P, int bf16, int64_t tiles);
#define QWG_BM 128 /* rows per CTA: two warpgroups */
/* keys per chunk: 128 in the forward; 64 for dQ, which holds S, dP and dQ in registers */
#define QWG_BN(mode) ((mode) == MODE_FWD ? 128 : 64)

/* K / V stages: 2 of 128 keys in the forward (three do not fit at DK 192), 3 of 64 for dQ */
#define QWG_NS(mode) ((mode) == MODE_FWD ? 2 : 3)
/* Q buffers of qwg: two in the forward at head dims <= 128 (the next task's Q lands during
 * this one; at DK 192 they do not fit beside the stages), else one */
#define QWG_NQ(mode, dkp) ((mode) == MODE_FWD && (dkp) <= 128 ? 2 : 1)
/* bytes of one qwg_task (hopper.cuh; checked there) */
#define QWG_TASK_BYTES 96
/* Register budgets of the warp-specialised sm_90a kernels (qwg, kwp: 384 threads, one producer
 * and two consumer warpgroups; setmaxnreg: 128 x 40 + 256 x 232 <= 64k) */
#define WS_PREGS 40
#define WS_CREGS 232
/* Shared memory of qwg_kernel<DKP, DVP, MODE>: 1 KB alignment slack, Q (and dO), the K and V
 * stages, row offsets, the stages' and Q buffers' full / empty mbarriers. Must match the carving in the
 * kernel. */
static inline size_t qwg_smem(int DKP, int DVP, int mode)
{
    const size_t bn = QWG_BN(mode), ns = QWG_NS(mode);
    const size_t nq = QWG_NQ(mode, DKP);
    return 1024 + nq * QWG_BM * DKP * 2 + (mode == MODE_DQ ? (size_t)QWG_BM * DVP * 2 : 0) + ns * bn * (DKP + DVP) * 2 +
           2 * QWG_BM * sizeof(int64_t) + (2 * ns + 2 * nq) * sizeof(uint64_t) + nq * QWG_TASK_BYTES;
}

/* swg_kernel (hopper.cuh): positions per CTA (the wgmma rows) and compressed keys per pass;
 * the key tile's bytes, reused as the pass's probabilities p [BP][NK] f32 */
#define SWG_BP 64
#define SWG_NK 128
#define SWG_QST 3 /* Q tiles in flight (one head each) */
#define SWG_WMAX 8 /* compressed keys per selection block whose overlaps the importance pass keeps in registers */
#define SWG_KBYTES(DKP) (SWG_NK * (DKP) * 2 > SWG_BP * SWG_NK * 4 ? SWG_NK * (DKP) * 2 : SWG_BP * SWG_NK * 4)
/* Shared memory of swg_kernel<DKP, T, NR, MS>: slack, SWG_QST Q tiles, the key tile, rank
 * keys [NR][MS][BP] (NR >= n: 16 or 32; MS merge lanes per position), the Q stages' and the
 * key tile's mbarriers, importances [BP][JC | 1], the G heads' lse [G][BP], counts,
 * per-position block and visible keys. Must match the carving in the kernel. */
static inline size_t swg_smem(int DKP, int JC, int NR, int MS, int G)
{
    return 1024 + SWG_QST * (size_t)SWG_BP * DKP * 2 + (size_t)SWG_KBYTES(DKP) + (size_t)NR * MS * SWG_BP * 8 + (SWG_QST + 1) * 8 +
           (size_t)SWG_BP * (JC | 1) * 4 + (size_t)G * SWG_BP * 4 + 3 * SWG_BP * 4;
}

/* sfw_kernel (hopper.cuh): selected attention with TMA, one warp per position, one or two
 * positions per CTA; chunks of bn keys in ns stages (branches.cu sfw_bn). Shared memory:
 * slack, K and V stages, their full / empty mbarriers. */
static inline size_t sfw_smem(int DP, int bn, int ns)
{
    return 1024 + 2 * (size_t)ns * bn * DP * 2 + 2 * (size_t)ns * 8;
}

#define KWG_BK 128 /* keys per kwg_kernel task (ktile: 64) */
/* Shared memory of kwg_kernel<DP>: slack, K and V of 128 keys, two Q and two dO stages of 64
 * rows, the three row slots of ktile (offsets, lse, D, gate, ranges, whole-chunk flags). */
static inline size_t kwg_smem(int DP)
{
    return 1024 + 2 * (size_t)KWG_BK * DP * 2 + 4 * (size_t)64 * DP * 2 + 3 * 64 * (2 * sizeof(int64_t) + 5 * 4) + 6 * 4;
}

/* kwp_kernel (hopper.cuh): kwg's tasks with a TMA producer warpgroup; row-chunk stages */
#define KWP_NS 3     /* range rules: both warpgroups on every chunk */
#define KWP_NS_SLC 4 /* selected rule: the warpgroups take alternate chunks */
/* slack, K and V of 128 keys (selected: 64), the stages of Q and dO (64 rows each), their
 * full / empty mbarriers, as many row slots (lse, D, gate, ranges: TMA needs no row offsets)
 * and whole-chunk flags */
static inline size_t kwp_smem(int DP, int slc)
{
    const size_t ns = slc ? KWP_NS_SLC : KWP_NS, bk = slc ? 64 : KWG_BK;
    return 1024 + 2 * bk * DP * 2 + 2 * ns * 64 * DP * 2 + 2 * ns * 8 + ns * 64 * 5 * 4 + ns * 2 * 4;
}

/* sm_90a forward / dQ tile for the range rules (hopper.cuh), head dims exactly 64 / 128;
 * ready: whether the loaded binary holds its sm_90a body (1) or it must not run (0). */
/* sm_90a selected attention (forward / dQ) with TMA, DK == DV == 64 / 128, G >= 4;
 * tk, tv: host CUtensorMap (4-D over the K / V views, box 64 x 1 x bn x 1, 128-byte swizzle) */
void nsa_cu_sfw_64(grun *g, const qparams *P, int mode, int bf16, int64_t tiles, const void *tk, const void *tv);
void nsa_cu_sfw_128(grun *g, const qparams *P, int mode, int bf16, int64_t tiles, const void *tk, const void *tv);
/* sm_90a selection (importance + top-n) on wgmma, head dims exactly 64 / 128 / 192; maps:
 * two host CUtensorMap, Q (box 64 x 1 head x SWG_BP rows) and the compressed K (box 64 x 1 x
 * SWG_NK) */
void nsa_cu_swg_64(grun *g, const sparams *P, int bf16, int64_t tiles, const void *maps);
void nsa_cu_swg_128(grun *g, const sparams *P, int bf16, int64_t tiles, const void *maps);
void nsa_cu_swg_192(grun *g, const sparams *P, int bf16, int64_t tiles, const void *maps);
void nsa_cu_qwg_64(grun *g, const qparams *P, int mode, int bf16, int64_t tiles, const void *maps);
void nsa_cu_qwg_128(grun *g, const qparams *P, int mode, int bf16, int64_t tiles, const void *maps);
void nsa_cu_qwg_192(grun *g, const qparams *P, int mode, int bf16, int64_t tiles, const void *maps); /* DK 192, DV 128 */
/* (maps: four CUtensorMaps, QWG_MAP_K .. QWG_MAP_O; Q's and O's (dO's in dQ) only read when
 * P->qbox / obox) */
enum { QWG_MAP_K = 0, QWG_MAP_V = 1, QWG_MAP_Q = 2, QWG_MAP_O = 3 };
/* sm_90a dK / dV of the range rules (hopper.cuh), kparams as ktile */
void nsa_cu_kwg_64(grun *g, const kparams *P, int bf16, int64_t tiles);
void nsa_cu_kwg_128(grun *g, const kparams *P, int bf16, int64_t tiles);
/* ... the same with a producer warp and TMA (kwp_kernel; range rules: bit for bit kwg's sums),
 * and, slc = 1, the selected rule's dK / dV over the inverted lists (ktile's tasks and
 * partials); maps: four host CUtensorMap (q, dout: box 64 x G x (slc ? 1 : 64 / G) x 1; k, v:
 * box 64 x 1 x (slc ? 64 : 128) x 1) */
void nsa_cu_kwp_64(grun *g, const kparams *P, int bf16, int slc, int64_t tiles, const void *maps);
void nsa_cu_kwp_128(grun *g, const kparams *P, int bf16, int slc, int64_t tiles, const void *maps);
int nsa_cu_qwg_ready_64(void);
int nsa_cu_qwg_ready_128(void);
int nsa_cu_qwg_ready_192(void);

/* ---- xattn (xattn.cuh): the attention op with every option of nsa.h section 5 ---------- */
/* A 4-D view [d0, d1, d2, d3] with explicit strides (elements); a size-1 dim that broadcasts
 * has stride 0 here, so the kernels index every tensor alike. */
typedef struct pview {
    const void *p;
    int dt;
    int64_t s0, s1, s2, s3;
} pview;

enum { XK_FWD = 0, XK_DQ = 1, XK_DKV = 2 };
enum { XW_DV = 1, XW_DK = 2 }; /* xdkv_kernel: which gradients one pass computes */

typedef struct xparams {
    dview q, k, v, o, lse, dout, dq, dk, dv;
    pview bias, mask, qseg, kseg;  /* p NULL: absent; qseg / kseg: [B, T] (s0, s1) */
    const float *sinks;            /* [HQ] at stride sinks_s, or NULL */
    int64_t sinks_s;
    float *dbias;                  /* fp32 [dbB, dbH, Tq, Tk], added to; NULL: not wanted */
    int64_t dbB, dbH;
    float *Dw;                     /* [B, Tq, HQ] rowsum(dout * o); with sinks xdq_kernel writes
                                      sum_j P z dP~ there instead (backward) */
    /* sequences: device cu_q / cu_k [nseq + 1] and the tile prefix of this launch (query
     * tiles for XK_FWD / XK_DQ, key tiles for XK_DKV); NULL: dense batch, sequence = z */
    const int64_t *cuq, *cuk, *first;
    int64_t nseq, B, Tq, Tk, HQ, H, G;
    int DK, DV;
    float scale, cap;
    int causal;
    int64_t wl, wr;
    int dropout;
    uint32_t thresh;               /* keep iff Philox word >= thresh */
    float rp;                      /* 1 / (1 - p) */
    uint64_t seed, offset;
    int loop_b, loop_h;            /* XK_DQ with a broadcast dbias: batch / heads looped in a CTA */
    int which;                     /* XK_DKV: XW_DV | XW_DK */
} xparams;

#define XQ_BM 64 /* query rows per forward / dQ CTA; keys per dK / dV CTA */
/* keys per chunk (forward, dQ) and query rows per chunk (dK / dV): fewer at DP 256, whose
 * accumulators already take 128 registers a thread */
#define XQ_BN(DP) ((DP) == 256 ? 32 : 64)
#define XQ_BQ(DP) ((DP) == 64 ? 64 : 32)
/* Two stages of every chunk (the next one loads during this one's products); side: the call
 * has bias, mask or dropout, whose per-chunk table (64 x 64 floats and bytes) comes last */
static inline size_t xattn_smem(int DP, int kind, int side)
{
    const size_t LD = (size_t)DP + 8, tab = side ? 64 * 64 * 5 : 0;
    if (kind == XK_FWD) return (XQ_BM + 4 * (size_t)XQ_BN(DP)) * LD * 2 + 2 * (size_t)XQ_BN(DP) * 4 + tab;
    if (kind == XK_DQ) return (2 * XQ_BM + 4 * (size_t)XQ_BN(DP)) * LD * 2 + 2 * (size_t)XQ_BN(DP) * 4 + tab;
    return (2 * XQ_BM + 4 * (size_t)XQ_BQ(DP)) * LD * 2 + 2 * (size_t)XQ_BQ(DP) * 5 * 4 + tab;
}
/* One launch of kernel `kind` on `grid` (x, y, z), head dims padded to 64 / 128 / 256. */
void nsa_cu_xattn_64(grun *g, const xparams *P, int kind, int bf16, const int64_t grid[3]);
void nsa_cu_xattn_128(grun *g, const xparams *P, int kind, int bf16, const int64_t grid[3]);
void nsa_cu_xattn_256(grun *g, const xparams *P, int kind, int bf16, const int64_t grid[3]);
/* dsinks[hq] = -sum over rows of exp(sink - lse) * Dw (deterministic order). */
void nsa_cu_xsinks(grun *g, const xparams *P, float *dsinks, int64_t ds_stride);
/* the fp32 dbias accumulator [dbB, dbH, Tq, Tk] -> the caller's dbias (any float dtype) */
void nsa_cu_xdbias_store(grun *g, const xparams *P, const pview *dst);

/* ---- prep.cu: the small kernels ------------------------------------------------------- */

/* x [B, T, H, D] -> mean-pooled x_cmp [B, cmp_rows, H, D] into `out` (any float view). */
void nsa_cu_compress(grun *g, const dview *x, int64_t D, const dview *out);
/* dx [B, T, H, D] from dx_cmp: src is a view (src32 NULL) or a flat fp32 buffer (src32);
 * the result is stored into `dx` (a view) or added to the flat fp32 buffer dx32. */
void nsa_cu_compress_bwd(grun *g, const dview *src, const float *src32, int64_t D, const dview *dx, float *dx32);
/* o = sum of g_x * o_x over present gates (gs[x].p != NULL). */
void nsa_cu_gate(grun *g, const dview os[3], const dview gs[3], const dview *o, int64_t B, int64_t T, int64_t HQ,
                 int64_t DV);
/* dg_x = rowsum(dout * o_x), do_x = g_x * dout, each when its view is given; with Dw/gw
 * (flat [B*T*HQ] per branch, used for present gates) also each branch's backward row terms
 * Dw_x = g_x * dg_x and gw_x = g_x (what nsa_cu_dprep computes), in the same pass. */
void nsa_cu_gate_bwd(grun *g, const dview *dout, const dview os[3], const dview gs[3], const dview dos[3],
                     const dview dgs[3], float *const Dw[3], float *const gw[3], int64_t B, int64_t T, int64_t HQ,
                     int64_t DV);
/* Per row of a branch's backward: Dw = g * rowsum(dout * o), gw = g (when gate given). */
void nsa_cu_dprep(grun *g, const dview *dout, const dview *o, const dview *gate, float *Dw, float *gw, int64_t B,
                  int64_t T, int64_t HQ, int64_t DV);
/* Flat fp32 [B, R, H, D] -> a view of the same shape. */
void nsa_cu_store32(grun *g, const float *src, const dview *dst, int64_t B, int64_t R, int64_t H, int64_t D);
/* Usable blocks per (b, t, h) row (spec 4): -1, out of range, not yet started, duplicates
 * removed, ascending -> U [B*T*H][m], ucnt. */
void nsa_cu_usable(grun *g, const dview *idx, const dview *counts, int64_t m, int64_t lp, int32_t *U, int32_t *ucnt);
/* Inverted selection per (sequence, head): offs[nb + 1] and the ascending query lists. */
typedef struct inv_index {
    int32_t *offs, *list;
    const int64_t *offs_pref, *list_pref;
} inv_index;
void nsa_cu_invert(grun *g, const int32_t *U, const int32_t *ucnt, int64_t m, int64_t lp, inv_index *ix);
/* xoff[f] = further segments before flat offs entry f (nflat + 1 entries). */
void nsa_cu_slc_segments(grun *g, const inv_index *ix, int64_t nflat, int64_t segp, int32_t *xoff);
/* dk32/dv32 of every key tile += its further segments' partials, in segment order. */
void nsa_cu_slc_reduce(grun *g, const kparams *P, int64_t tiles);
/* The same for the row segments of compressed key tiles (P: the ktile launch's params;
 * tiles over seqmap tm = compressed key tiles, one per task). */
void nsa_cu_seg_reduce(grun *g, const kparams *P, seqmap tm, int64_t tiles);

#endif
