/* common.h -- what every CPU op file shares: sequences of a (varlen) batch, strided tensor
 * rows in any dtype, packed fp32 K/V panels, workspace carving, threads, and the fp32
 * attention core (core.c) that compressed, selected and windowed attention are built on. */
#ifndef NSA_CPU_COMMON_H
#define NSA_CPU_COMMON_H

#include "../internal.h"
#include "../rules.h"
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* This OpenMP thread's number (0 without OpenMP): picks its slice of the workspace. */
static inline int cpu_thread_id(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* ---- sequences ---------------------------------------------------------------------- */
/* One sequence of the call: batch index, first packed key row, key length, first compressed
 * row; and its queries: qlen of them from packed row qrow0, query i at position q0 + i. Whole
 * sequences have qlen = len, q0 = 0, qrow0 = row0; a query chunk (dense, nsa.h) is the last
 * qlen = T positions of len = Tk keys. */
typedef struct cpu_seq {
    int64_t b, row0, len, cmp_row0, ncmp;
    int64_t qrow0, qlen, q0;
} cpu_seq;

/* cu_cmp: varlen compressed offsets (num_seqs + 1), or NULL when not varlen. */
static inline cpu_seq cpu_seq_get(const nsa_problem *p, const int64_t *cu_cmp, int64_t s)
{
    cpu_seq q;
    if (p->cu_seqlens) {
        q.b = 0;
        q.row0 = p->cu_seqlens[s];
        q.len = p->cu_seqlens[s + 1] - p->cu_seqlens[s];
        q.cmp_row0 = cu_cmp ? cu_cmp[s] : 0;
    } else {
        q.b = s;
        q.row0 = 0;
        q.len = p->Tk;
        q.cmp_row0 = 0;
    }
    q.qrow0 = q.row0;
    q.qlen = p->cu_seqlens ? q.len : p->T; /* under varlen T == Tk (validate.c) */
    q.q0 = q.len - q.qlen;
    q.ncmp = p->cfg.cmp_stride > 0 ? nsa_rule_num_cmp(q.len, p->cfg.cmp_len, p->cfg.cmp_stride) : 0; /* attention has no config */
    return q;
}

/* ---- strided tensors ----------------------------------------------------------------- */

/* Element offset of [i0, i1, i2, 0] (rank 4) or [i0, i1, i2] (rank 3). */
static inline int64_t io_off(const nsa_tensor *t, int64_t i0, int64_t i1, int64_t i2)
{
    return i0 * t->stride[0] + i1 * t->stride[1] + i2 * t->stride[2];
}

void io_load(const nsa_tensor *t, int64_t off, int64_t n, float *dst);
void io_load_scaled(const nsa_tensor *t, int64_t off, int64_t n, float scale, float *dst);
void io_store(const nsa_tensor *t, int64_t off, int64_t n, const float *src);
float io_get(const nsa_tensor *t, int64_t off);
void io_set(const nsa_tensor *t, int64_t off, float v);
/* Rows of an I32 tensor. */
static inline const int32_t *io_i32(const nsa_tensor *t, int64_t off) { return (const int32_t *)t->data + off; }

/* Packed fp32 panel of a [B, R, H, D] tensor: panel[((b * H + h) * R + r) * D + d]. Each
 * (b, h) is then one contiguous [R, D] matrix, which is what the core wants. */
void cpu_pack_heads(const nsa_context *ctx, const nsa_tensor *x, float *panel);
static inline float *panel_at(float *panel, const nsa_tensor *x, int64_t b, int64_t h)
{
    return panel + ((b * x->shape[2] + h) * x->shape[1]) * x->shape[3];
}
/* Writes a panel back to a [B, R, H, D] tensor (storage dtype rounding). */
void cpu_unpack_heads(const nsa_context *ctx, const float *panel, const nsa_tensor *x);
static inline size_t panel_bytes(const nsa_tensor *x)
{
    return nsa_size_mul(nsa_size_elems(x->shape[0], x->shape[1], x->shape[2], x->shape[3]), sizeof(float));
}

/* ---- workspace ----------------------------------------------------------------------- */
/* A bump allocator over the caller's workspace; the same sequence of takes run with
 * base == NULL measures the size, so sizing and carving can never disagree. Its arithmetic
 * saturates (size.h): once a take overflows, `used` stays SIZE_MAX, which api.c turns into
 * NSA_STATUS_SIZE_OVERFLOW before the op runs, so a carving pass never sees it. */
typedef struct ws_arena {
    char *base;
    size_t used;
} ws_arena;

static inline void *ws_take(ws_arena *a, size_t bytes)
{
    const size_t at = nsa_size_align(a->used, 64);
    a->used = nsa_size_add(at, bytes);
    return a->base && a->used != SIZE_MAX ? (void *)(a->base + at) : NULL;
}

/* count elements of elem_bytes each: call sites pass counts, never their own products. */
static inline void *ws_take_n(ws_arena *a, size_t count, size_t elem_bytes)
{
    return ws_take(a, nsa_size_mul(count, elem_bytes));
}

/* rows x cols elements of elem_bytes each. */
static inline void *ws_take_2d(ws_arena *a, size_t rows, size_t cols, size_t elem_bytes)
{
    return ws_take(a, nsa_size_mul(nsa_size_mul(rows, cols), elem_bytes));
}

/* A size this backend cannot carve (e.g. a tile dimension past int): the call needs more
 * than can exist, as an overflow does. */
static inline void ws_fail(ws_arena *a) { a->used = SIZE_MAX; }

/* A thread's region after carving its scratch into `a`: rounded up to 64 bytes with 64 to
 * spare, so that every thread's region starts aligned. */
static inline size_t ws_region_bytes(const ws_arena *a) { return nsa_size_align(nsa_size_add(a->used, 64), 64); }

int cpu_threads(const nsa_context *ctx);

/* One region of `per` bytes for each of the call's threads. */
static inline char *ws_take_threads(ws_arena *a, const nsa_context *ctx, size_t per)
{
    return (char *)ws_take_n(a, (size_t)cpu_threads(ctx), per);
}

/* varlen compressed offsets in the arena (NULL when not varlen). */
int64_t *cpu_cmp_offsets(ws_arena *a, const nsa_problem *p);

/* ---- fp32 attention core (core.c) ------------------------------------------------------ */
/* A tile is R rows (query position x query head), each with its own visible key range
 * [lo[r], hi[r]] (inclusive, in the key panel's index space). Q is pre-multiplied by the
 * softmax scale, so s = Q . K. */
typedef struct core_tile {
    int R, DK, DV;
    float *Q;        /* [R, DK] scaled queries */
    int64_t *lo, *hi;/* [R] visible key range per row */
    float *m, *l;    /* [R] running max and sum (forward) */
    unsigned char *ninf; /* [R] the row saw keys and every score so far was -inf (m = -inf, l = 0):
                            NaN at the end unless a finite score follows, as in dense softmax */
    float *O;        /* [R, DV] unnormalised output accumulator (forward) */
    float *S;        /* [R, S_cap] scores / probabilities scratch */
    int64_t S_cap;
    float *xt;       /* [max(DK, DV), 16] keys transposed for the score micro-kernel */
    /* backward */
    float *dO;       /* [R, DV] upstream gradient (already gated) */
    float *lse;      /* [R] */
    float *Drow;     /* [R] rowsum(dO * O) */
    float *dQ;       /* [R, DK] accumulator of dS K (unscaled: multiply by scale at the end) */
} core_tile;

/* Carves a tile with R rows and S capacity s_cap from the arena; R, DK or DV past int fails
 * the arena (ws_fail). */
void core_tile_alloc(core_tile *t, ws_arena *a, int64_t R, int64_t DK, int64_t DV, int64_t s_cap, int backward);
/* Resets m = -inf, l = 0, O = 0. */
void core_fwd_begin(core_tile *t);
/* Online softmax over keys [c0, c1) of K [*, DK] / V [*, DV] (V may be NULL: scores only).
 * Afterwards S[r * S_cap + (c - c0)] holds exp(s - m_r) for visible keys (-0.0f otherwise),
 * relative to the row max m_r after this block. c1 - c0 <= S_cap. */
void core_fwd_block(core_tile *t, const float *K, const float *V, int64_t c0, int64_t c1);
/* Normalises: O /= l and lse = m + log(l); rows with no visible key get O = 0, lse = -inf; a
 * row whose visible scores were all -inf gets NaN (dense softmax's exp(-inf - max)); a row that
 * saw keys keeps whatever its arithmetic gave, NaN included. */
void core_fwd_end(core_tile *t, float *lse_out);
/* Backward over keys [c0, c1): P = exp(s - lse), dS = P * (dO V^T - Drow). Accumulates
 * t->dQ += dS K (if t->dQ), dK[c] += dS^T Q (if dK), dV[c] += P^T dO (if dV), with dK/dV
 * pointing at the panel rows of key c0. */
void core_bwd_block(core_tile *t, const float *K, const float *V, int64_t c0, int64_t c1, float *dK, float *dV);

/* The register-blocked products behind the tile, for attn_ext.c:
 * S[r * ldS + (c - c0)] = A[r] . X[c] (r < R, c in [c0, c1); X rows of D floats, xt scratch
 * [D, 16]); Acc[r] += sum_c W[r * ldW + c] X[c] (c < n); Acc[c] += sum_r W[r * ldW + c] Y[r]. */
void core_scores(const float *A, int R, int D, const float *X, int64_t c0, int64_t c1, float *S, int64_t ldS,
                 float *xt);
void core_accum(float *Acc, const float *W, const float *M, int64_t ldW, int R, const float *X, int D, int64_t n);
void core_accum_t(float *Acc, const float *W, const float *M, int64_t ldW, int R, const float *Y, int D, int64_t n);
/* Hidden (row, key) pairs carry the weight -0.0f; core_accum / core_accum_t skip the pairs whose
 * M entry (same layout as W) is that marker when X / Y holds a non-finite value (core.c).
 * core_fill_hidden writes the marker; core_all_finite scans n floats. */
void core_fill_hidden(float *s, int64_t n);
int core_all_finite(const float *x, int64_t n);
/* Rows of the general path, vis[c] == 0 = hidden (weight -0.0f, the marker core_accum reads;
 * dS 0): s = exp(s - shift), @return the sum; P = exp(p - lse), ds = P (ds * keep - D), p = P (or
 * P * keep with dropped_p); softcap: th = tanh(s / cap), s = cap * th, dcap = 1 - th^2
 * (tanh from the same exp: absolute error ~1e-7, exactly +-1 for large |s|). */
float core_exp_row_masked(float *s, const unsigned char *vis, int64_t n, float shift);
void core_grad_row_masked(float *p, float *ds, const float *keep, const unsigned char *vis, int64_t n, float lse,
                          float D, int dropped_p);
void core_softcap_row(float *s, float *dcap, int64_t n, float cap);

/* exp(x) in fp32 for the softmax, branch-free so the compiler vectorises it: the input is
 * clamped to [-87, 88], split as 2^n * e^f with |f| <= ln2/2, and e^f comes from a degree-7
 * polynomial (relative error ~1e-7); below -87 the result is exactly 0 (so a -inf score has
 * weight 0, and 0 * inf = NaN in P V as in dense attention, not a tiny weight times inf). */
static inline float core_exp(float x)
{
    const int under = x < -87.0f;
    x = under ? -87.0f : (x > 88.0f ? 88.0f : x); /* not fminf: that is a libm call */
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float f = (x - n * 0.693359375f) + n * 2.12194440e-4f; /* ln2 split in two: exact n*hi */
    const float p = 1.0f + f * (1.0f + f * (0.5f + f * (0.166666667f + f * (0.0416666667f + f * (0.00833333333f + f * (0.00138888889f + f * 0.000198412698f))))));
    /* a NaN input stays NaN through p; the exponent never converts a NaN to int */
    const int32_t ni = n == n ? (int32_t)n : 0;
    union { uint32_t u; float f; } scale = {(uint32_t)(ni + 127) << 23}; /* 2^n */
    return under ? 0.0f : p * scale.f;
}

/* ---- tasks over (sequence, kv head, tile) --------------------------------------------- */
/* Flattens a ragged set of per-sequence tiles into one index range, so that one OpenMP
 * loop balances short and long sequences alike. first[s] = first task of sequence s. */
typedef struct cpu_tasks {
    int64_t *first;   /* [num_seqs + 1] */
    int64_t total;
    int64_t H, nseq;
} cpu_tasks;

/* tiles_of(seq) tiles per (sequence, head); first[] carved from the arena. */
void cpu_tasks_build(cpu_tasks *tk, ws_arena *a, const nsa_problem *p, const int64_t *cu_cmp,
                     int64_t (*tiles_of)(const cpu_seq *, const void *), const void *arg);
/* Decodes a task into sequence, head and tile index. */
void cpu_tasks_decode(const cpu_tasks *tk, int64_t task, int64_t *s, int64_t *h, int64_t *tile);

/* Per-thread scratch: thread `tid` gets bytes [tid * per, (tid + 1) * per) of `base`, the
 * region ws_take_threads carved (tid < threads: the product was checked there). */
static inline ws_arena cpu_thread_arena(char *base, size_t per, int tid)
{
    ws_arena a = {base ? base + (size_t)tid * per : NULL, 0};
    return a;
}

/* The upstream gradient of one branch: dout (times the branch gate when present), the
 * branch's forward output o and lse. */
typedef struct grad_src {
    const nsa_tensor *dout, *gate, *o, *lse;
} grad_src;

/* Fills tile rows r0.. for query position `row` (packed), heads h*G .. h*G+G-1:
 * Q (scaled), and for the backward dO (gated), lse and Drow = rowsum(dO * O). */
void tile_load_rows(core_tile *t, int r0, const nsa_tensor *q, float scale, int64_t b, int64_t row, int64_t h,
                    int64_t G, const grad_src *g, float *tmp);
/* Writes rows r0.. (G of them) of O and lse back to o [B,T,HQ,DV] / lse [B,T,HQ]. */
void tile_store_rows(const core_tile *t, int r0, const nsa_tensor *o, const nsa_tensor *lse, const float *lse_rows,
                     int64_t b, int64_t row, int64_t h, int64_t G);
/* Adds scale * dQ rows r0.. into dq32 laid out as [B, T, HQ, DK] fp32. */
void tile_add_dq(const core_tile *t, int r0, float *dq32, const nsa_problem *p, int64_t b, int64_t row, int64_t h,
                 float scale);
/* Stores an fp32 [B, T, HQ, DK] accumulator into a strided tensor. */
void cpu_store_dense(const nsa_context *ctx, const float *acc, const nsa_tensor *x);

/* ---- selection (select.c) ---------------------------------------------------------------- */
/* Top-n of imp[0..cur] with the forced blocks first and ties to the lower index; writes the
 * kept indices ascending into out[0..n), -1 padded. @return the number kept. */
int64_t select_top_n(const float *imp, int64_t cur, const nsa_config *c, int32_t *out);

/* ---- branch drivers shared by the single ops and the whole pipeline -------------------- */
/* Masks of the range-attention branches: compressed (key i visible iff i*d + l - 1 <= t)
 * or window (t - wl <= s <= t + wr, causal: s <= t). */
typedef struct range_rule {
    int cmp;
    int64_t l, d;
    int64_t wl, wr;
    int causal;
} range_rule;

/* Selection outputs fused into the compressed forward (NULL members: no selection). */
typedef struct select_sink {
    const nsa_tensor *lse_in;      /* optional given lse_cmp */
    const nsa_tensor *indices;     /* [B,T,H,n] I32 out */
    const nsa_tensor *counts;      /* optional [B,T,H] I32 out */
} select_sink;

size_t range_fwd_ws(const nsa_context *ctx, const nsa_problem *p, const range_rule *rule, int with_select);
void range_fwd(const nsa_context *ctx, const nsa_problem *p, const range_rule *rule, const int64_t *cu_cmp,
               const nsa_tensor *q, const float *Kp, const float *Vp, int64_t key_rows,
               const nsa_tensor *o, const nsa_tensor *lse, const select_sink *sel, void *ws);
size_t range_bwd_ws(const nsa_context *ctx, const nsa_problem *p, const range_rule *rule);
void range_bwd(const nsa_context *ctx, const nsa_problem *p, const range_rule *rule, const int64_t *cu_cmp,
               const nsa_tensor *q, const float *Kp, const float *Vp, int64_t key_rows, const grad_src *g,
               float *dq32, float *dKp, float *dVp, void *ws);

/* The attention op with any option of nsa.h section 5 beyond the window branch's (Tq != Tk,
 * varlen_qk, softcap, sinks, segment ids, bias, mask, dropout): attn_ext.c. Kp/Vp are the
 * packed K/V panels ([B, H, Tk, D]); the backward adds into dq32/dKp/dVp and writes dsinks
 * and dbias itself. */
size_t ext_fwd_ws(const nsa_context *ctx, const nsa_problem *p);
void ext_fwd(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_args *a, const float *Kp,
             const float *Vp, void *ws);
size_t ext_bwd_ws(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_bwd_args *a);
void ext_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_bwd_args *a, const float *Kp,
             const float *Vp, float *dq32, float *dKp, float *dVp, void *ws);

size_t slc_fwd_ws(const nsa_context *ctx, const nsa_problem *p);
void slc_fwd(const nsa_context *ctx, const nsa_problem *p, const nsa_tensor *q, const float *Kp, const float *Vp,
             const nsa_tensor *idx, const nsa_tensor *counts, const nsa_tensor *o, const nsa_tensor *lse, void *ws);
size_t slc_bwd_ws(const nsa_context *ctx, const nsa_problem *p);
void slc_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_tensor *q, const float *Kp, const float *Vp,
             const nsa_tensor *idx, const nsa_tensor *counts, const grad_src *g, float *dq32, float *dKp,
             float *dVp, void *ws);

/* Mean pooling panel -> panel (fp32, [B,H,rows,D] layout) and its backward (adds). */
void compress_panel(const nsa_context *ctx, const nsa_problem *p, const int64_t *cu_cmp, const float *xp,
                    int64_t D, float *xcp);
void compress_panel_bwd(const nsa_context *ctx, const nsa_problem *p, const int64_t *cu_cmp, const float *dxcp,
                        int64_t D, float *dxp);

#endif
