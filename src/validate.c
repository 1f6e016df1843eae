/* validate.c -- argument validation of every op (nsa.h conventions, spec/nsa.md).
 *
 * Each validator lists its tensors, in argument order, as rows of a table (role, dtype rule,
 * symbolic shape) and hands the table to one engine, check_tensors(). The checks run in this
 * order and the first failure wins:
 *   a. scalars: config (or attention's scale, windows, softcap, dropout_p), then which optional
 *      tensors must come together (BAD_ARGUMENT); done by each validator before the engine runs;
 *   b. each tensor alone, in argument order: rank, dtype, shape >= 0, strides, sizes, data;
 *   c. across tensors: one value per symbolic dimension, head counts >= 1, HQ % H, then the
 *      broadcast dims (1 or the full size);
 *   d. varlen cu_seqlens, then the compressed row count and the tensors that carry it
 *      (attention: then its varlen_qk, and dbias against bias);
 *   e. required outputs that are absent.
 * Nothing here reads tensor data except the host cu_seqlens, and nothing writes to a tensor.
 * Every failure writes its detail (nsa_fail) naming the argument as the args struct does, with
 * a "fwd." prefix for the forward args embedded in a backward's. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "mod/expr.h"
#include "rules.h"

/* Symbolic dimensions. The first described tensor carrying a symbol fixes its value and every
 * later one must agree, so each op's shape rules are just its table rows. */
enum dim_sym {
    Z_NONE = 0, /* past the tensor's rank */
    Z_B, Z_T, Z_HQ, Z_H, Z_DK, Z_DV,
    Z_NC,       /* compressed rows: known only once cu_seqlens is checked (stage d) */
    Z_M,        /* block_indices width chosen by the caller, >= 1 */
    Z_N,        /* block_indices width fixed to config.slc_topk */
    Z_TK,       /* key rows: attention's (Tq may differ), a query chunk's key side (Tk >= T) */
    Z_C0, Z_CR, /* a step's token cache: dim 0 (B, or pages when paged) and rows per entry */
    Z_C0C, Z_CRC, /* ... its compressed cache */
    Z_MP, Z_MPC,  /* ... their block tables' widths (pages per sequence) */
    Z_NQB, Z_W, Z_WF, /* a block mask: query blocks, partial and full list widths */
    Z_COUNT,
    /* broadcast dims, checked after the others (stage c): 1 or the full size */
    Z_B1,       /* 1 or B */
    Z_HQ1       /* 1 or HQ */
};

/* The symbols as the details print them. */
static const char *const DIM_NAME[] = {
    [Z_NONE] = "?", [Z_B] = "B", [Z_T] = "T", [Z_HQ] = "HQ", [Z_H] = "H", [Z_DK] = "DK", [Z_DV] = "DV",
    [Z_NC] = "Nc", [Z_M] = "m", [Z_N] = "n", [Z_TK] = "Tk", [Z_C0] = "B or pages", [Z_CR] = "capacity or page size",
    [Z_C0C] = "B or pages", [Z_CRC] = "capacity or page size", [Z_MP] = "max pages", [Z_MPC] = "max pages",
    [Z_NQB] = "query blocks", [Z_W] = "list width", [Z_WF] = "full list width",
    [Z_COUNT] = "?", [Z_B1] = "B or 1", [Z_HQ1] = "HQ or 1",
};

enum shape_id { S_Q, S_K, S_V, S_O, S_ROW, S_KC, S_VC, S_IDX_M, S_IDX_N, S_CNT, S_AK, S_AV, S_HEAD, S_SEGQ, S_SEGK,
                S_PAIR, S_CK, S_CV, S_CCK, S_CCV, S_BT, S_BTC, S_LEN, S_BMN, S_BMI, S_BMF };

static const unsigned char SHAPES[][NSA_MAX_RANK] = {
    [S_Q] = {Z_B, Z_T, Z_HQ, Z_DK},    /* q, dq */
    [S_K] = {Z_B, Z_T, Z_H, Z_DK},     /* compress x with D as DK; a step's k_new */
    [S_V] = {Z_B, Z_T, Z_H, Z_DV},     /* a step's v_new */
    [S_O] = {Z_B, Z_T, Z_HQ, Z_DV},    /* o, dout, branch outputs */
    [S_ROW] = {Z_B, Z_T, Z_HQ},        /* lse, gates */
    [S_KC] = {Z_B, Z_NC, Z_H, Z_DK},   /* k_cmp, x_cmp */
    [S_VC] = {Z_B, Z_NC, Z_H, Z_DV},   /* v_cmp */
    [S_IDX_M] = {Z_B, Z_T, Z_H, Z_M},  /* block_indices given by the caller */
    [S_IDX_N] = {Z_B, Z_T, Z_H, Z_N},  /* block_indices written by the selection */
    [S_CNT] = {Z_B, Z_T, Z_H},         /* block_counts */
    [S_AK] = {Z_B, Z_TK, Z_H, Z_DK},   /* k, dk of attention, selected attention, NSA */
    [S_AV] = {Z_B, Z_TK, Z_H, Z_DV},   /* v, dv */
    [S_HEAD] = {Z_HQ},                 /* sinks, dsinks */
    [S_SEGQ] = {Z_B, Z_T},             /* q_segment_ids */
    [S_SEGK] = {Z_B, Z_TK},            /* k_segment_ids */
    [S_PAIR] = {Z_B1, Z_HQ1, Z_T, Z_TK}, /* bias, dbias, mask */
    [S_CK] = {Z_C0, Z_CR, Z_H, Z_DK},    /* step: cache.k */
    [S_CV] = {Z_C0, Z_CR, Z_H, Z_DV},    /* cache.v */
    [S_CCK] = {Z_C0C, Z_CRC, Z_H, Z_DK}, /* cmp_cache.k */
    [S_CCV] = {Z_C0C, Z_CRC, Z_H, Z_DV}, /* cmp_cache.v */
    [S_BT] = {Z_B, Z_MP},                /* cache.block_table */
    [S_BTC] = {Z_B, Z_MPC},              /* cmp_cache.block_table */
    [S_LEN] = {Z_B},                     /* seqlens, q_lens */
    [S_BMN] = {Z_B1, Z_HQ1, Z_NQB},      /* block_mask counts */
    [S_BMI] = {Z_B1, Z_HQ1, Z_NQB, Z_W}, /* block_mask.kv_indices */
    [S_BMF] = {Z_B1, Z_HQ1, Z_NQB, Z_WF}, /* block_mask.full_kv_indices */
};

typedef enum tensor_role {
    R_SKIP = 0, /* not read by this call: nothing about it is checked */
    R_IN,       /* required input: NULL data only with 0 elements */
    R_OPT_IN,   /* optional input, absent when data == NULL */
    R_DESC,     /* only shape and dtype are read; data may be NULL */
    R_OUT,      /* required output: absent -> MISSING_OUTPUT (stage e) unless it is empty */
    R_OPT_OUT   /* optional output, absent when data == NULL */
} tensor_role;

typedef enum dtype_rule {
    K_REF,   /* a float dtype, the same as the op's reference tensor (q, x or the gated o) */
    K_FLOAT, /* any float dtype (branch outputs of the gate and of nsa_saved) */
    K_F32,   /* lse, sinks */
    K_I32,   /* block_indices, block_counts, segment ids */
    K_U8     /* the attention mask */
} dtype_rule;

typedef struct tspec {
    const nsa_tensor *t;
    tensor_role role;
    dtype_rule rule;
    enum shape_id shape;
    const char *name; /* the args field, for the detail: "k", "fwd.o", "saved.lse_cmp" */
} tspec;

/* A field's name in the forward args (bwd = 0) or in a backward's embedded fwd (bwd = 1). */
#define NM(bwd, field) ((bwd) ? "fwd." field : field)
#define PRE(bwd) ((bwd) ? "fwd." : "")

/* The largest table (nsa_backward) has 35 rows. */
enum { MAX_SPECS = 40 };
#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* The role of a tensor that only matters when `gate` (a branch gate, or a K/V override)
 * is given. */
static tensor_role when(const nsa_tensor *gate, tensor_role r) { return nsa_present(gate) ? r : R_SKIP; }

static int append(tspec *s, int n, const tspec *more, int count)
{
    memcpy(s + n, more, (size_t)count * sizeof *more);
    return n + count;
}

static int rank_of(enum shape_id id)
{
    int r = 0;
    while (r < NSA_MAX_RANK && SHAPES[id][r] != Z_NONE) r++;
    return r;
}

/* Does stage b check this tensor, and do its dims count in stage c? */
static int described(const tspec *s)
{
    switch (s->role) {
    case R_SKIP: return 0;
    case R_IN:
    case R_DESC: return 1;
    default: return nsa_present(s->t);
    }
}

/* Counts and offsets are computed with size.h's saturating arithmetic and must end up in
 * int64 (the backends index with int64 and trust it). Every term is >= 0, so the partial
 * results only grow and checking the final one is checking them all. */
static int fits_int64(size_t v) { return v != SIZE_MAX && (uint64_t)v <= (uint64_t)INT64_MAX; }

static int is_float(nsa_dtype dt) { return dt == NSA_DTYPE_F32 || dt == NSA_DTYPE_F16 || dt == NSA_DTYPE_BF16; }


/* "[B, T, H, DK]": the symbolic shape a table row expects. */
static const char *shape_sym(enum shape_id id, char *buf, size_t size)
{
    size_t at = (size_t)snprintf(buf, size, "[");
    for (int j = 0; j < rank_of(id) && at < size; j++)
        at += (size_t)snprintf(buf + at, size - at, "%s%s", j ? ", " : "", DIM_NAME[SHAPES[id][j]]);
    if (at < size) snprintf(buf + at, size - at, "]");
    return buf;
}

static int dtype_ok(nsa_dtype dt, dtype_rule rule, nsa_dtype ref)
{
    switch (rule) {
    case K_REF: return is_float(dt) && dt == ref;
    case K_FLOAT: return is_float(dt);
    case K_F32: return dt == NSA_DTYPE_F32;
    case K_U8: return dt == NSA_DTYPE_U8;
    default: return dt == NSA_DTYPE_I32;
    }
}

static nsa_status dtype_fail(const tspec *s, nsa_dtype ref, const char *ref_name)
{
    const char *got = nsa_dtype_name(s->t->dtype), *name = s->name;
    switch (s->rule) {
    case K_REF:
        if (!is_float(s->t->dtype) || !is_float(ref))
            return nsa_fail(NSA_STATUS_BAD_DTYPE, "%s: dtype %s, must be a float dtype (f32, f16, bf16) and the same as %s's",
                            name, got, ref_name);
        return nsa_fail(NSA_STATUS_BAD_DTYPE, "%s: dtype %s, must be %s like %s", name, got, nsa_dtype_name(ref), ref_name);
    case K_FLOAT: return nsa_fail(NSA_STATUS_BAD_DTYPE, "%s: dtype %s, must be f32, f16 or bf16", name, got);
    case K_F32: return nsa_fail(NSA_STATUS_BAD_DTYPE, "%s: dtype %s, must be f32", name, got);
    case K_U8: return nsa_fail(NSA_STATUS_BAD_DTYPE, "%s: dtype %s, must be u8", name, got);
    default: return nsa_fail(NSA_STATUS_BAD_DTYPE, "%s: dtype %s, must be i32", name, got);
    }
}

/* Stage b for one view: well-formed alone, and every offset it implies fits in int64 (the
 * backends index with int64 and trust it). *count = its element count. */
static nsa_status check_tensor(const tspec *s, nsa_dtype ref, const char *ref_name, int64_t *count)
{
    const nsa_tensor *t = s->t;
    const int rank = rank_of(s->shape);
    size_t n = 1, dims = 1, last = 0;
    const size_t es = nsa_dtype_size(t->dtype);
    char sym[64], shape[64];
    int i;

    if (t->rank != rank)
        return nsa_fail(NSA_STATUS_BAD_RANK, "%s: rank %d, must be %d: %s", s->name, (int)t->rank, rank,
                        shape_sym(s->shape, sym, sizeof sym));
    if (!dtype_ok(t->dtype, s->rule, ref)) return dtype_fail(s, ref, ref_name);
    for (i = 0; i < rank; i++)
        if (t->shape[i] < 0)
            return nsa_fail(NSA_STATUS_BAD_SHAPE, "%s: dim %d (%s) is %" PRId64 ", must be >= 0", s->name, i,
                            DIM_NAME[SHAPES[s->shape][i]], t->shape[i]);
    if (t->stride[rank - 1] != 1)
        return nsa_fail(NSA_STATUS_BAD_STRIDE, "%s: stride[%d] is %" PRId64 ", must be 1 (the last dim is contiguous)",
                        s->name, rank - 1, t->stride[rank - 1]);
    for (i = 0; i < rank; i++)
        if (t->stride[i] < 0)
            return nsa_fail(NSA_STATUS_BAD_STRIDE, "%s: stride[%d] is %" PRId64 ", must be >= 0", s->name, i, t->stride[i]);
    /* Empty dims count as 1 in `dims`, so that no product of an empty tensor's sizes (a
     * backend's loop bounds or scratch sizes) overflows either; n <= dims. */
    for (i = 0; i < rank; i++) {
        n = nsa_size_mul(n, nsa_size_of(t->shape[i]));
        dims = nsa_size_mul(dims, t->shape[i] ? nsa_size_of(t->shape[i]) : 1);
    }
    if (!fits_int64(dims))
        return nsa_fail(NSA_STATUS_SIZE_OVERFLOW, "%s: the element count of shape %s overflows int64", s->name,
                        nsa_shape_text(t, shape, sizeof shape));
    if (n > 0) { /* the last element's offset + 1, in elements and in bytes; the bytes of n */
        for (i = 0; i < rank; i++)
            last = nsa_size_add(last, nsa_size_mul(nsa_size_of(t->stride[i]), nsa_size_of(t->shape[i] - 1)));
        last = nsa_size_add(last, 1);
        if (!fits_int64(nsa_size_mul(last, es)) || !fits_int64(nsa_size_mul(n, es)))
            return nsa_fail(NSA_STATUS_SIZE_OVERFLOW, "%s: shape %s with its strides reaches a byte offset beyond int64",
                            s->name, nsa_shape_text(t, shape, sizeof shape));
    }
    *count = (int64_t)n;
    return NSA_STATUS_SUCCESS;
}

static nsa_status check_one(const tspec *s, nsa_dtype ref, const char *ref_name)
{
    const nsa_tensor *t = s->t;
    int64_t count = 0;
    nsa_status st;
    char shape[64];

    if (!described(s)) return NSA_STATUS_SUCCESS;
    /* A required input left zero-initialised was forgotten: "NULL" says more than "rank". */
    if (s->role == R_IN && !nsa_present(t) && t->rank == 0)
        return nsa_fail(NSA_STATUS_NULL_POINTER, "%s: data is NULL and rank 0 (the tensor was never set)", s->name);
    st = check_tensor(s, ref, ref_name, &count);
    if (st != NSA_STATUS_SUCCESS) return st;
    if (s->role == R_IN && !nsa_present(t) && count > 0)
        return nsa_fail(NSA_STATUS_NULL_POINTER, "%s: data is NULL but the shape %s is not empty", s->name,
                        nsa_shape_text(t, shape, sizeof shape));
    return NSA_STATUS_SUCCESS;
}

/* Stage d, and the compressed row count of dense and packed inputs alike. cu_seqlens is host
 * memory (nsa.h), the one array this file reads. */
static nsa_status check_varlen(const nsa_varlen *vl, int64_t B, int64_t T, int64_t Tk, const nsa_config *cfg,
                               const char *pre, nsa_problem *p)
{
    const int32_t *cu = vl ? vl->cu_seqlens : NULL;
    int64_t N, s, rows = 0;

    p->num_seqs = B;
    p->cmp_rows = cfg ? nsa_rule_num_cmp(Tk, cfg->cmp_len, cfg->cmp_stride) : 0;
    if (!cu) return NSA_STATUS_SUCCESS;
    N = vl->num_seqs;
    if (B != 1)
        return nsa_fail(NSA_STATUS_BAD_CU_SEQLENS, "%svarlen.cu_seqlens: packed input needs B == 1, B is %" PRId64, pre, B);
    if (N < 0) return nsa_fail(NSA_STATUS_BAD_CU_SEQLENS, "%svarlen.num_seqs: %" PRId64 " is negative", pre, N);
    if (cu[0] != 0)
        return nsa_fail(NSA_STATUS_BAD_CU_SEQLENS, "%svarlen.cu_seqlens: cu_seqlens[0] is %d, must be 0", pre, (int)cu[0]);
    for (s = 0; s < N; s++) {
        if (cu[s + 1] < cu[s])
            return nsa_fail(NSA_STATUS_BAD_CU_SEQLENS,
                            "%svarlen.cu_seqlens: cu_seqlens[%" PRId64 "] = %d < cu_seqlens[%" PRId64 "] = %d (must not decrease)",
                            pre, s + 1, (int)cu[s + 1], s, (int)cu[s]);
        if (cfg) rows += nsa_rule_num_cmp(cu[s + 1] - cu[s], cfg->cmp_len, cfg->cmp_stride);
    }
    if (cu[N] != T)
        return nsa_fail(NSA_STATUS_BAD_CU_SEQLENS,
                        "%svarlen.cu_seqlens: cu_seqlens[%" PRId64 "] (the last) is %d, must equal T = %" PRId64, pre, N,
                        (int)cu[N], T);
    p->num_seqs = N;
    p->cu_seqlens = cu;
    p->cmp_rows = cfg ? rows : 0;
    return NSA_STATUS_SUCCESS;
}

/* An absent output is fine only when it would hold no element: nothing is owed to it. */
static int expected_empty(enum shape_id id, const int64_t *dim)
{
    int j;
    for (j = 0; j < rank_of(id); j++)
        if (SHAPES[id][j] < Z_COUNT && dim[SHAPES[id][j]] == 0) return 1;
    return 0;
}

static int64_t fixed(int64_t v) { return v < 0 ? 0 : v; }

/* No element in the view's own shape (rank 0, or a dim <= 0). */
static int view_empty(const nsa_tensor *t)
{
    if (t->rank <= 0) return 1;
    for (int j = 0; j < t->rank && j < NSA_MAX_RANK; j++)
        if (t->shape[j] <= 0) return 1;
    return 0;
}

/* What one op's engine run needs besides its table: the reference tensor of K_REF (its
 * dtype and name), the varlen and config (NULL for ops without them), the caller's scale
 * (0 = 1/sqrt(DK)) and the name prefix of the config and varlen fields ("" or "fwd."). */
typedef struct engine_in {
    nsa_dtype ref;
    const char *ref_name;
    const nsa_varlen *vl;
    const nsa_config *cfg;
    float scale;
    const char *pre;
    int64_t kv_len; /* nsa_cmp_attn / nsa_select: the caller's Tk (0 = T); others 0 */
} engine_in;

/* Stage d's compressed rows disagree with a tensor's dim j; the key side's T came from t_name. */
static nsa_status nc_fail(const tspec *s, int j, const nsa_problem *p, const engine_in *e, int64_t T, const char *t_name)
{
    if (p->cu_seqlens)
        return nsa_fail(NSA_STATUS_BAD_SHAPE, "%s: dim %d (Nc) is %" PRId64 ", the %" PRId64 " sequences of %svarlen.cu_seqlens "
                        "have %" PRId64 " compressed rows", s->name, j, s->t->shape[j], p->num_seqs, e->pre, p->cmp_rows);
    return nsa_fail(NSA_STATUS_BAD_SHAPE, "%s: dim %d (Nc) is %" PRId64 ", T = %" PRId64 " (%s) has %" PRId64 " compressed "
                    "blocks (cmp_len %" PRId64 ", cmp_stride %" PRId64 ")", s->name, j, s->t->shape[j], T, t_name, p->cmp_rows,
                    e->cfg ? e->cfg->cmp_len : 0, e->cfg ? e->cfg->cmp_stride : 0);
}

/* Stages b to e over one op's table; fills *p from the agreed dimensions. */
static nsa_status check_tensors(const tspec *s, int n, const engine_in *e, nsa_problem *p)
{
    int64_t dim[Z_COUNT];
    int who[Z_COUNT], at[Z_COUNT]; /* the row and dim that fixed each symbol (-1: the config) */
    const nsa_config *cfg = e->cfg;
    char shape[64];
    nsa_status st;
    int i, j, z;

    memset(p, 0, sizeof *p);
    for (i = 0; i < n; i++)
        if ((st = check_one(&s[i], e->ref, e->ref_name)) != NSA_STATUS_SUCCESS) return st;

    for (z = 0; z < Z_COUNT; z++) dim[z] = -1, who[z] = -1, at[z] = 0; /* not fixed yet */
    if (cfg) dim[Z_N] = cfg->slc_topk;
    for (i = 0; i < n; i++) {
        if (!described(&s[i])) continue;
        for (j = 0; j < s[i].t->rank; j++) {
            z = SHAPES[s[i].shape][j];
            if (z == Z_NC || z >= Z_COUNT) continue;
            if (dim[z] < 0) {
                dim[z] = s[i].t->shape[j], who[z] = i, at[z] = j;
            } else if (dim[z] != s[i].t->shape[j]) {
                if (who[z] < 0)
                    return nsa_fail(NSA_STATUS_BAD_SHAPE, "%s: dim %d (%s) is %" PRId64 ", %sconfig.slc_topk is %" PRId64,
                                    s[i].name, j, DIM_NAME[z], s[i].t->shape[j], e->pre, dim[z]);
                return nsa_fail(NSA_STATUS_BAD_SHAPE, "%s: dim %d (%s) is %" PRId64 ", %s has %" PRId64, s[i].name, j,
                                DIM_NAME[z], s[i].t->shape[j], s[who[z]].name, dim[z]);
            }
        }
    }
    /* A call without heads (HQ = H = 0, a shard that holds none) is empty: it succeeds and
     * writes nothing. One count 0 and not the other leaves G undefined. */
    if (dim[Z_HQ] == 0 && dim[Z_H] > 0)
        return nsa_fail(NSA_STATUS_BAD_GQA, "%s: dim %d (HQ) is 0 with H = %" PRId64 " (%s dim %d): G = HQ / H must be >= 1 "
                        "(a call without heads has H = 0 too)", s[who[Z_HQ]].name, at[Z_HQ], dim[Z_H], s[who[Z_H]].name, at[Z_H]);
    if (dim[Z_H] == 0 && dim[Z_HQ] > 0)
        return nsa_fail(NSA_STATUS_BAD_GQA, "%s: dim %d (H) is 0 with HQ = %" PRId64 " (%s dim %d): G = HQ / H must be >= 1 "
                        "(a call without heads has HQ = 0 too)", s[who[Z_H]].name, at[Z_H], dim[Z_HQ], s[who[Z_HQ]].name,
                        at[Z_HQ]);
    /* a zero head dim makes the default scale infinite */
    {
        static const int positive[] = {Z_DK, Z_DV, Z_M};
        for (i = 0; i < COUNT(positive); i++) {
            z = positive[i];
            if (dim[z] == 0)
                return nsa_fail(NSA_STATUS_BAD_SHAPE, "%s: dim %d (%s) is 0, must be >= 1", s[who[z]].name, at[z], DIM_NAME[z]);
        }
    }
    if (dim[Z_HQ] > 0 && dim[Z_H] > 0 && dim[Z_HQ] % dim[Z_H] != 0)
        return nsa_fail(NSA_STATUS_BAD_GQA, "%s: dim %d (HQ) is %" PRId64 ", not a multiple of H = %" PRId64 " (%s dim %d)",
                        s[who[Z_HQ]].name, at[Z_HQ], dim[Z_HQ], dim[Z_H], s[who[Z_H]].name, at[Z_H]);
    for (i = 0; i < n; i++) { /* broadcast dims: 1 or the size the other tensors fixed */
        if (!described(&s[i])) continue;
        for (j = 0; j < s[i].t->rank; j++) {
            z = SHAPES[s[i].shape][j];
            if (z < Z_COUNT) continue;
            const int64_t full = dim[z == Z_B1 ? Z_B : Z_HQ], got = s[i].t->shape[j];
            if (got != 1 && got != full)
                return nsa_fail(NSA_STATUS_BAD_SHAPE, "%s: dim %d (%s) is %" PRId64 ", must be 1 or %" PRId64, s[i].name, j,
                                DIM_NAME[z], got, full);
        }
    }

    /* The key side of the NSA operations (those with a config): the whole sequence (Tk = T)
     * or the prefix of a query chunk (Tk > T, dense batches only); nsa_cmp_attn and nsa_select
     * have no k and take it from kv_len. */
    char tk_name[32];
    snprintf(tk_name, sizeof tk_name, "%skv_len", e->pre);
    if (cfg) {
        if (dim[Z_TK] >= 0) snprintf(tk_name, sizeof tk_name, "%s", s[who[Z_TK]].name);
        else if (e->kv_len > 0) dim[Z_TK] = e->kv_len;
        else dim[Z_TK] = dim[Z_T], snprintf(tk_name, sizeof tk_name, "%s", who[Z_T] >= 0 ? s[who[Z_T]].name : "T");
        if (dim[Z_T] >= 0 && dim[Z_TK] < dim[Z_T])
            return nsa_fail(NSA_STATUS_BAD_SHAPE, "%s: Tk is %" PRId64 ", less than the T = %" PRId64 " queries (%s): a query "
                            "chunk reads its sequence's whole prefix", tk_name, dim[Z_TK], dim[Z_T], s[who[Z_T]].name);
        if (e->vl && e->vl->cu_seqlens && dim[Z_TK] != dim[Z_T])
            return nsa_fail(NSA_STATUS_BAD_SHAPE, "%s: Tk is %" PRId64 " and T %" PRId64 " under %svarlen.cu_seqlens: a query "
                            "chunk (Tk > T) needs a dense batch", tk_name, dim[Z_TK], dim[Z_T], e->pre);
    }

    if ((st = check_varlen(e->vl, dim[Z_B], dim[Z_T], dim[Z_TK] >= 0 ? dim[Z_TK] : dim[Z_T], cfg, e->pre, p)) !=
        NSA_STATUS_SUCCESS)
        return st;
    dim[Z_NC] = p->cmp_rows;
    for (i = 0; i < n; i++) {
        if (!described(&s[i])) continue;
        for (j = 0; j < s[i].t->rank; j++)
            if (SHAPES[s[i].shape][j] == Z_NC && s[i].t->shape[j] != p->cmp_rows)
                return nc_fail(&s[i], j, p, e, dim[Z_TK] >= 0 ? dim[Z_TK] : dim[Z_T],
                               cfg ? tk_name : who[Z_T] >= 0 ? s[who[Z_T]].name : "T");
    }

    for (i = 0; i < n; i++) {
        if (s[i].role != R_OUT || nsa_present(s[i].t)) continue;
        if (!expected_empty(s[i].shape, dim))
            return nsa_fail(NSA_STATUS_MISSING_OUTPUT, "%s: a required output is absent (data NULL)", s[i].name);
        /* an absent output is an empty one: a view whose own shape holds elements would have a
         * backend that walks its shape write through NULL */
        if (!view_empty(s[i].t))
            return nsa_fail(NSA_STATUS_NULL_POINTER, "%s: data is NULL but the shape %s is not empty", s[i].name,
                            nsa_shape_text(s[i].t, shape, sizeof shape));
    }

    p->B = fixed(dim[Z_B]);
    p->T = fixed(dim[Z_T]);
    p->HQ = fixed(dim[Z_HQ]);
    p->H = fixed(dim[Z_H]);
    p->G = p->H > 0 ? p->HQ / p->H : 0;
    p->DK = fixed(dim[Z_DK]);
    p->DV = fixed(dim[Z_DV]);
    p->m = fixed(dim[Z_M]);
    p->Tk = dim[Z_TK] >= 0 ? dim[Z_TK] : p->T;
    p->scale = e->scale != 0.0f ? e->scale : p->DK > 0 ? 1.0f / sqrtf((float)p->DK) : 0.0f;
    p->swa_scale = cfg && cfg->swa_scale != 0.0f ? cfg->swa_scale : p->scale;
    if (cfg) p->cfg = *cfg;
    return NSA_STATUS_SUCCESS;
}

/* isfinite() rejects NaN and both infinities; -0 reads as 0, the default. */
static int scale_ok(float scale) { return isfinite(scale) && scale >= 0.0f; }

/* Block sizes and counts: block indices are int32 and the GPU counts positions, blocks and
 * their products in 32 bits, so they stay within int32. The window alone is unbounded above
 * (longer than the sequence: the whole prefix; rules.h clamps it without overflow). */
static int in_int32(int64_t v, int64_t lo) { return v >= lo && v <= INT32_MAX; }

/* A field outside [lo, INT32_MAX]. */
static nsa_status range_fail(nsa_status st, const char *cfg, const char *field, int64_t v, int64_t lo)
{
    return nsa_fail(st, "%s.%s: %" PRId64 ", must be in [%" PRId64 ", INT32_MAX]", cfg, field, v, lo);
}

nsa_status nsa_config_check(const nsa_config *c, const char *name)
{
    if (!c) return nsa_fail(NSA_STATUS_NULL_POINTER, "%s is NULL", name);
    if (!in_int32(c->cmp_stride, 1)) return range_fail(NSA_STATUS_BAD_CMP_STRIDE, name, "cmp_stride", c->cmp_stride, 1);
    if (!in_int32(c->cmp_len, 1)) return range_fail(NSA_STATUS_BAD_CMP_LEN, name, "cmp_len", c->cmp_len, 1);
    if (c->cmp_len % c->cmp_stride != 0)
        return nsa_fail(NSA_STATUS_BAD_CMP_STRIDE, "%s.cmp_stride: %" PRId64 " does not divide cmp_len %" PRId64, name,
                        c->cmp_stride, c->cmp_len);
    if (c->cmp_len > c->slc_block)
        return nsa_fail(NSA_STATUS_BAD_CMP_LEN, "%s.cmp_len: %" PRId64 " > slc_block %" PRId64, name, c->cmp_len, c->slc_block);
    if (!in_int32(c->slc_block, 1)) return range_fail(NSA_STATUS_BAD_SLC_BLOCK, name, "slc_block", c->slc_block, 1);
    if (c->slc_block % c->cmp_stride != 0)
        return nsa_fail(NSA_STATUS_BAD_SLC_BLOCK, "%s.slc_block: %" PRId64 " is not a multiple of cmp_stride %" PRId64, name,
                        c->slc_block, c->cmp_stride);
    if (!in_int32(c->n_init, 0)) return range_fail(NSA_STATUS_BAD_TOPK, name, "n_init", c->n_init, 0);
    if (!in_int32(c->n_local, 0)) return range_fail(NSA_STATUS_BAD_TOPK, name, "n_local", c->n_local, 0);
    if (!in_int32(c->slc_topk, 1)) return range_fail(NSA_STATUS_BAD_TOPK, name, "slc_topk", c->slc_topk, 1);
    /* n - n_init cannot overflow once n >= 1 and n_init >= 0; n_init + n_local could. */
    if (c->slc_topk - c->n_init < c->n_local)
        return nsa_fail(NSA_STATUS_BAD_TOPK, "%s.slc_topk: %" PRId64 " < n_init %" PRId64 " + n_local %" PRId64, name,
                        c->slc_topk, c->n_init, c->n_local);
    if (c->window < 1) return nsa_fail(NSA_STATUS_BAD_WINDOW, "%s.window: %" PRId64 ", must be >= 1", name, c->window);
    if (!scale_ok(c->scale))
        return nsa_fail(NSA_STATUS_BAD_SCALE, "%s.scale: %g, must be finite and >= 0 (0 = 1/sqrt(DK))", name, (double)c->scale);
    if (!scale_ok(c->swa_scale))
        return nsa_fail(NSA_STATUS_BAD_SCALE, "%s.swa_scale: %g, must be finite and >= 0 (0 = scale)", name,
                        (double)c->swa_scale);
    return NSA_STATUS_SUCCESS;
}

nsa_status nsa_config_validate(const nsa_config *c)
{
    nsa_detail_clear();
    return nsa_config_check(c, "config");
}

/* The engine for ops that carry an nsa_config, after the config itself. */
static nsa_status check_with_config(const tspec *s, int n, const tspec *ref, const nsa_varlen *vl, const nsa_config *cfg,
                                    int64_t kv_len, int bwd, nsa_problem *p)
{
    nsa_status st = nsa_config_check(cfg, NM(bwd, "config"));
    if (st != NSA_STATUS_SUCCESS) return st;
    if (kv_len < 0)
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%s: %" PRId64 " is negative, must be 0 (the queries' T) or >= T",
                        NM(bwd, "kv_len"), kv_len);
    const engine_in e = {ref->t->dtype, ref->name, vl, cfg, cfg->scale, PRE(bwd), kv_len};
    return check_tensors(s, n, &e, p);
}

/* ---- 1. Compression: x is its own query, so HQ = H and DK = DV = D. ------------------ */
static nsa_status check_compress(const tspec *s, int n, const nsa_compress_args *a, int bwd, nsa_problem *p)
{
    nsa_status st = check_with_config(s, n, &s[0], &a->varlen, &a->config, 0, bwd, p);
    if (st != NSA_STATUS_SUCCESS) return st;
    p->HQ = p->H;
    p->G = 1;
    p->DV = p->DK;
    return NSA_STATUS_SUCCESS;
}

nsa_status nsa_validate_compress(const nsa_compress_args *a, nsa_problem *p)
{
    const tspec s[] = {
        {&a->x, R_IN, K_REF, S_K, "x"},
        {&a->x_cmp, R_OUT, K_REF, S_KC, "x_cmp"},
    };
    return check_compress(s, COUNT(s), a, 0, p);
}

nsa_status nsa_validate_compress_bwd(const nsa_compress_bwd_args *a, nsa_problem *p)
{
    const tspec s[] = {
        {&a->fwd.x, R_DESC, K_REF, S_K, "fwd.x"}, /* the backward is linear: x's values are never read */
        {&a->dx_cmp, R_IN, K_REF, S_KC, "dx_cmp"},
        {&a->dx, R_OUT, K_REF, S_K, "dx"},
    };
    return check_compress(s, COUNT(s), &a->fwd, 1, p);
}

/* ---- 2. Compressed attention. In the backward the forward's outputs are inputs. ------- */
static int cmp_attn_specs(const nsa_cmp_attn_args *a, int bwd, tspec *s)
{
    const tensor_role out = bwd ? R_IN : R_OUT;
    const tspec t[] = {
        {&a->q, R_IN, K_REF, S_Q, NM(bwd, "q")},
        {&a->k_cmp, R_IN, K_REF, S_KC, NM(bwd, "k_cmp")},
        {&a->v_cmp, R_IN, K_REF, S_VC, NM(bwd, "v_cmp")},
        {&a->o, out, K_REF, S_O, NM(bwd, "o")},
        {&a->lse, out, K_F32, S_ROW, NM(bwd, "lse")},
    };
    return append(s, 0, t, COUNT(t));
}

nsa_status nsa_validate_cmp_attn(const nsa_cmp_attn_args *a, nsa_problem *p)
{
    tspec s[MAX_SPECS];
    int n = cmp_attn_specs(a, 0, s);
    return check_with_config(s, n, &s[0], &a->varlen, &a->config, a->kv_len, 0, p);
}

nsa_status nsa_validate_cmp_attn_bwd(const nsa_cmp_attn_bwd_args *a, nsa_problem *p)
{
    const tspec g[] = {
        {&a->dout, R_IN, K_REF, S_O, "dout"},
        {&a->dq, R_OUT, K_REF, S_Q, "dq"},
        {&a->dk_cmp, R_OUT, K_REF, S_KC, "dk_cmp"},
        {&a->dv_cmp, R_OUT, K_REF, S_VC, "dv_cmp"},
    };
    tspec s[MAX_SPECS];
    int n = append(s, cmp_attn_specs(&a->fwd, 1, s), g, COUNT(g));
    return check_with_config(s, n, &s[0], &a->fwd.varlen, &a->fwd.config, a->fwd.kv_len, 1, p);
}

/* ---- 3. Selection: writes exactly n = slc_topk indices per row. ---------------------- */
nsa_status nsa_validate_select(const nsa_select_args *a, nsa_problem *p)
{
    const tspec s[] = {
        {&a->q, R_IN, K_REF, S_Q, "q"},
        {&a->k_cmp, R_IN, K_REF, S_KC, "k_cmp"},
        {&a->lse_cmp, R_OPT_IN, K_F32, S_ROW, "lse_cmp"},
        {&a->block_indices, R_OUT, K_I32, S_IDX_N, "block_indices"},
        {&a->block_counts, R_OPT_OUT, K_I32, S_CNT, "block_counts"},
    };
    nsa_status st = check_with_config(s, COUNT(s), &s[0], &a->varlen, &a->config, a->kv_len, 0, p);
    if (st == NSA_STATUS_SUCCESS) p->m = a->config.slc_topk;
    return st;
}

/* ---- 4. Selected attention ----------------------------------------------------------- */
static int slc_attn_specs(const nsa_slc_attn_args *a, int bwd, tspec *s)
{
    const tensor_role out = bwd ? R_IN : R_OUT;
    const tspec t[] = {
        {&a->q, R_IN, K_REF, S_Q, NM(bwd, "q")},
        {&a->k, R_IN, K_REF, S_AK, NM(bwd, "k")},
        {&a->v, R_IN, K_REF, S_AV, NM(bwd, "v")},
        {&a->block_indices, R_IN, K_I32, S_IDX_M, NM(bwd, "block_indices")},
        {&a->block_counts, R_OPT_IN, K_I32, S_CNT, NM(bwd, "block_counts")},
        {&a->o, out, K_REF, S_O, NM(bwd, "o")},
        {&a->lse, out, K_F32, S_ROW, NM(bwd, "lse")},
    };
    return append(s, 0, t, COUNT(t));
}

/* Gradients of q, k, v: shared by the selected and the dense attention backward. */
static int qkv_grad_specs(const nsa_tensor *dout, const nsa_tensor *dq, const nsa_tensor *dk, const nsa_tensor *dv,
                          tspec *s, int n)
{
    const tspec g[] = {
        {dout, R_IN, K_REF, S_O, "dout"},
        {dq, R_OUT, K_REF, S_Q, "dq"},
        {dk, R_OUT, K_REF, S_AK, "dk"},
        {dv, R_OUT, K_REF, S_AV, "dv"},
    };
    return append(s, n, g, COUNT(g));
}

nsa_status nsa_validate_slc_attn(const nsa_slc_attn_args *a, nsa_problem *p)
{
    tspec s[MAX_SPECS];
    int n = slc_attn_specs(a, 0, s);
    return check_with_config(s, n, &s[0], &a->varlen, &a->config, 0, 0, p);
}

nsa_status nsa_validate_slc_attn_bwd(const nsa_slc_attn_bwd_args *a, nsa_problem *p)
{
    tspec s[MAX_SPECS];
    int n = qkv_grad_specs(&a->dout, &a->dq, &a->dk, &a->dv, s, slc_attn_specs(&a->fwd, 1, s));
    return check_with_config(s, n, &s[0], &a->fwd.varlen, &a->fwd.config, 0, 1, p);
}

/* ---- 5. Dense / windowed attention: no nsa_config, its scalars are fields. ------------- */
/* Stage a: the scalars and which options must come together. */
static nsa_status attention_scalars(const nsa_attention_args *a, int bwd)
{
    const nsa_varlen_qk *vq = &a->varlen_qk;
    const char *pre = PRE(bwd);
    if (!scale_ok(a->scale))
        return nsa_fail(NSA_STATUS_BAD_SCALE, "%sscale: %g, must be finite and >= 0 (0 = 1/sqrt(DK))", pre, (double)a->scale);
    if (a->window_left < -1)
        return nsa_fail(NSA_STATUS_BAD_WINDOW, "%swindow_left: %" PRId64 ", must be >= -1 (-1 = unbounded)", pre, a->window_left);
    if (a->window_right < -1)
        return nsa_fail(NSA_STATUS_BAD_WINDOW, "%swindow_right: %" PRId64 ", must be >= -1 (-1 = unbounded)", pre,
                        a->window_right);
    if (!isfinite(a->softcap) || a->softcap < 0.0f)
        return nsa_fail(NSA_STATUS_BAD_SOFTCAP, "%ssoftcap: %g, must be finite and >= 0 (0 = off)", pre, (double)a->softcap);
    if (!(a->dropout_p >= 0.0f && a->dropout_p < 1.0f)) /* NaN fails too */
        return nsa_fail(NSA_STATUS_BAD_DROPOUT, "%sdropout_p: %g, must be in [0, 1)", pre, (double)a->dropout_p);
    if (nsa_present(&a->q_segment_ids) != nsa_present(&a->k_segment_ids))
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%s%s: given without %s (both or neither)", pre,
                        nsa_present(&a->q_segment_ids) ? "q_segment_ids" : "k_segment_ids",
                        nsa_present(&a->q_segment_ids) ? "k_segment_ids" : "q_segment_ids");
    if ((vq->cu_seqlens_q != NULL) != (vq->cu_seqlens_k != NULL))
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%svarlen_qk.%s: given without %s (both or neither)", pre,
                        vq->cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k", vq->cu_seqlens_q ? "cu_seqlens_k" : "cu_seqlens_q");
    if (vq->cu_seqlens_q && a->varlen.cu_seqlens) /* one packing only */
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%svarlen_qk: given together with varlen.cu_seqlens (one packing only)", pre);
    return NSA_STATUS_SUCCESS;
}

/* One packing: cu[0] == 0, non-decreasing, cu[N] == total (of rows named `rows`). */
static nsa_status cu64_check(const int64_t *cu, int64_t N, int64_t total, const char *pre, const char *name,
                             const char *rows)
{
    if (cu[0] != 0)
        return nsa_fail(NSA_STATUS_BAD_CU_SEQLENS, "%svarlen_qk.%s: %s[0] is %" PRId64 ", must be 0", pre, name, name, cu[0]);
    for (int64_t s = 0; s < N; s++)
        if (cu[s + 1] < cu[s])
            return nsa_fail(NSA_STATUS_BAD_CU_SEQLENS,
                            "%svarlen_qk.%s: %s[%" PRId64 "] = %" PRId64 " < %s[%" PRId64 "] = %" PRId64 " (must not decrease)",
                            pre, name, name, s + 1, cu[s + 1], name, s, cu[s]);
    if (cu[N] != total)
        return nsa_fail(NSA_STATUS_BAD_CU_SEQLENS, "%svarlen_qk.%s: %s[%" PRId64 "] (the last) is %" PRId64 ", must equal %s = %" PRId64,
                        pre, name, name, N, cu[N], rows, total);
    return NSA_STATUS_SUCCESS;
}

/* Stage d for the attention's own varlen forms, and the rules tying dbias to bias. */
static nsa_status attention_finish(const nsa_attention_args *a, const nsa_tensor *dbias, int bwd, nsa_problem *p)
{
    const nsa_varlen_qk *vq = &a->varlen_qk;
    const char *pre = PRE(bwd);
    nsa_status st;
    /* the int32 packing is one for q and k alike: it cannot describe Tq != Tk */
    if (a->varlen.cu_seqlens && p->Tk != p->T)
        return nsa_fail(NSA_STATUS_BAD_CU_SEQLENS, "%svarlen.cu_seqlens: one packing for q and k, but Tq = %" PRId64
                        " and Tk = %" PRId64 " differ (varlen_qk packs them apart)", pre, p->T, p->Tk);
    if (vq->cu_seqlens_q) {
        if (p->B != 1)
            return nsa_fail(NSA_STATUS_BAD_CU_SEQLENS, "%svarlen_qk: packed input needs B == 1, B is %" PRId64, pre, p->B);
        if (vq->num_seqs < 0)
            return nsa_fail(NSA_STATUS_BAD_CU_SEQLENS, "%svarlen_qk.num_seqs: %" PRId64 " is negative", pre, vq->num_seqs);
        if ((st = cu64_check(vq->cu_seqlens_q, vq->num_seqs, p->T, pre, "cu_seqlens_q", "Tq")) != NSA_STATUS_SUCCESS ||
            (st = cu64_check(vq->cu_seqlens_k, vq->num_seqs, p->Tk, pre, "cu_seqlens_k", "Tk")) != NSA_STATUS_SUCCESS)
            return st;
        p->num_seqs = vq->num_seqs;
        p->cu_seqlens_q = vq->cu_seqlens_q;
        p->cu_seqlens_k = vq->cu_seqlens_k;
    }
    if (dbias && nsa_present(dbias)) {
        for (int j = 0; j < 4; j++)
            if (dbias->shape[j] != a->bias.shape[j])
                return nsa_fail(NSA_STATUS_BAD_SHAPE, "dbias: dim %d is %" PRId64 ", fwd.bias has %" PRId64 " (same shape)", j,
                                dbias->shape[j], a->bias.shape[j]);
        for (int j = 0; j < 4; j++) /* an output dim of stride 0 would write one element twice */
            if (dbias->shape[j] > 1 && dbias->stride[j] == 0)
                return nsa_fail(NSA_STATUS_BAD_STRIDE, "dbias: stride[%d] is 0 on a dim of size %" PRId64
                                " (an output element would be written twice)", j, dbias->shape[j]);
    }
    p->extended = p->T != p->Tk || a->softcap != 0.0f || nsa_present(&a->sinks) || nsa_present(&a->q_segment_ids) ||
                  nsa_present(&a->bias) || nsa_present(&a->mask) || a->dropout_p != 0.0f || vq->cu_seqlens_q != NULL;
    return NSA_STATUS_SUCCESS;
}

static int attention_specs(const nsa_attention_args *a, int bwd, tspec *s)
{
    const tensor_role out = bwd ? R_IN : R_OUT;
    const tspec t[] = {
        {&a->q, R_IN, K_REF, S_Q, NM(bwd, "q")},
        {&a->k, R_IN, K_REF, S_AK, NM(bwd, "k")},
        {&a->v, R_IN, K_REF, S_AV, NM(bwd, "v")},
        {&a->o, out, K_REF, S_O, NM(bwd, "o")},
        {&a->lse, out, K_F32, S_ROW, NM(bwd, "lse")},
        {&a->sinks, R_OPT_IN, K_F32, S_HEAD, NM(bwd, "sinks")},
        {&a->q_segment_ids, R_OPT_IN, K_I32, S_SEGQ, NM(bwd, "q_segment_ids")},
        {&a->k_segment_ids, R_OPT_IN, K_I32, S_SEGK, NM(bwd, "k_segment_ids")},
        {&a->bias, R_OPT_IN, K_FLOAT, S_PAIR, NM(bwd, "bias")},
        {&a->mask, R_OPT_IN, K_U8, S_PAIR, NM(bwd, "mask")},
    };
    return append(s, 0, t, COUNT(t));
}

nsa_status nsa_validate_attention(const nsa_attention_args *a, nsa_problem *p)
{
    tspec s[MAX_SPECS];
    int n = attention_specs(a, 0, s);
    nsa_status st = attention_scalars(a, 0);
    if (st != NSA_STATUS_SUCCESS) return st;
    const engine_in e = {a->q.dtype, "q", &a->varlen, NULL, a->scale, "", 0};
    st = check_tensors(s, n, &e, p);
    if (st != NSA_STATUS_SUCCESS) return st;
    return attention_finish(a, NULL, 0, p);
}

nsa_status nsa_validate_attention_bwd(const nsa_attention_bwd_args *a, nsa_problem *p)
{
    const nsa_attention_args *f = &a->fwd;
    const tspec g[] = {
        {&a->dout, R_IN, K_REF, S_O, "dout"},
        {&a->dq, R_OUT, K_REF, S_Q, "dq"},
        {&a->dk, R_OUT, K_REF, S_AK, "dk"},
        {&a->dv, R_OUT, K_REF, S_AV, "dv"},
        {&a->dsinks, when(&f->sinks, R_OUT), K_F32, S_HEAD, "dsinks"},
        {&a->dbias, when(&f->bias, R_OPT_OUT), K_FLOAT, S_PAIR, "dbias"},
    };
    tspec s[MAX_SPECS];
    int n = append(s, attention_specs(f, 1, s), g, COUNT(g));
    nsa_status st = attention_scalars(f, 1);
    if (st != NSA_STATUS_SUCCESS) return st;
    if (nsa_present(&a->dbias) && !nsa_present(&f->bias))
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "dbias: given but fwd.bias is absent");
    const engine_in e = {f->q.dtype, "fwd.q", &f->varlen, NULL, f->scale, "fwd.", 0};
    st = check_tensors(s, n, &e, p);
    if (st != NSA_STATUS_SUCCESS) return st;
    return attention_finish(f, &a->dbias, 1, p);
}

/* ---- 6. Gating: o (not q) sets the sizes and the dtype of the gates. ------------------ */
static nsa_status need_gate(const nsa_tensor *g_cmp, const nsa_tensor *g_slc, const nsa_tensor *g_swa, int bwd)
{
    if (nsa_present(g_cmp) || nsa_present(g_slc) || nsa_present(g_swa)) return NSA_STATUS_SUCCESS;
    const char *pre = PRE(bwd);
    return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%sg_cmp, %sg_slc, %sg_swa: all absent, at least one gate is needed", pre, pre,
                    pre);
}

static int gate_specs(const nsa_gate_args *a, int bwd, tspec *s)
{
    const tspec t[] = {
        {&a->o_cmp, when(&a->g_cmp, R_IN), K_FLOAT, S_O, NM(bwd, "o_cmp")},
        {&a->o_slc, when(&a->g_slc, R_IN), K_FLOAT, S_O, NM(bwd, "o_slc")},
        {&a->o_swa, when(&a->g_swa, R_IN), K_FLOAT, S_O, NM(bwd, "o_swa")},
        {&a->g_cmp, R_OPT_IN, K_REF, S_ROW, NM(bwd, "g_cmp")},
        {&a->g_slc, R_OPT_IN, K_REF, S_ROW, NM(bwd, "g_slc")},
        {&a->g_swa, R_OPT_IN, K_REF, S_ROW, NM(bwd, "g_swa")},
        /* the backward reads o's shape and dtype only */
        {&a->o, bwd ? R_DESC : R_OUT, K_REF, S_O, NM(bwd, "o")},
    };
    return append(s, 0, t, COUNT(t));
}

nsa_status nsa_validate_gate(const nsa_gate_args *a, nsa_problem *p)
{
    tspec s[MAX_SPECS];
    int n = gate_specs(a, 0, s);
    /* While o is absent (MISSING_OUTPUT, stage e) the first gate stands in for its dtype. */
    const nsa_tensor *ref = nsa_present(&a->o) ? &a->o : nsa_present(&a->g_cmp) ? &a->g_cmp
                          : nsa_present(&a->g_slc) ? &a->g_slc : &a->g_swa;
    const char *ref_name = ref == &a->o ? "o" : ref == &a->g_cmp ? "g_cmp" : ref == &a->g_slc ? "g_slc" : "g_swa";
    nsa_status st = need_gate(&a->g_cmp, &a->g_slc, &a->g_swa, 0);
    if (st != NSA_STATUS_SUCCESS) return st;
    const engine_in e = {ref->dtype, ref_name, NULL, NULL, 0.0f, "", 0};
    return check_tensors(s, n, &e, p);
}

nsa_status nsa_validate_gate_bwd(const nsa_gate_bwd_args *a, nsa_problem *p)
{
    const nsa_gate_args *f = &a->fwd;
    const tspec g[] = {
        {&a->dout, R_IN, K_REF, S_O, "dout"},
        {&a->do_cmp, when(&f->g_cmp, R_OUT), K_FLOAT, S_O, "do_cmp"},
        {&a->do_slc, when(&f->g_slc, R_OUT), K_FLOAT, S_O, "do_slc"},
        {&a->do_swa, when(&f->g_swa, R_OUT), K_FLOAT, S_O, "do_swa"},
        {&a->dg_cmp, when(&f->g_cmp, R_OUT), K_REF, S_ROW, "dg_cmp"},
        {&a->dg_slc, when(&f->g_slc, R_OUT), K_REF, S_ROW, "dg_slc"},
        {&a->dg_swa, when(&f->g_swa, R_OUT), K_REF, S_ROW, "dg_swa"},
    };
    tspec s[MAX_SPECS];
    int n = append(s, gate_specs(f, 1, s), g, COUNT(g));
    nsa_status st = need_gate(&f->g_cmp, &f->g_slc, &f->g_swa, 1);
    if (st != NSA_STATUS_SUCCESS) return st;
    const engine_in e = {f->o.dtype, "fwd.o", NULL, NULL, 0.0f, "fwd.", 0};
    return check_tensors(s, n, &e, p);
}

/* ---- 7. Whole NSA. What the forward writes to `saved` the backward reads back. -------- */
/* K/V overrides come in pairs: `b` must be present exactly when `a` is. */
static nsa_status pair_check(const nsa_tensor *a, const nsa_tensor *b, const char *pre, const char *an, const char *bn)
{
    if (nsa_present(a) == nsa_present(b)) return NSA_STATUS_SUCCESS;
    return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%s%s: given without %s%s (both or neither)", pre, nsa_present(a) ? an : bn, pre,
                    nsa_present(a) ? bn : an);
}

static nsa_status forward_scalars(const nsa_forward_args *a, int bwd)
{
    const char *pre = PRE(bwd);
    nsa_status st = nsa_config_check(&a->config, NM(bwd, "config"));
    if (st != NSA_STATUS_SUCCESS) return st;
    if ((st = pair_check(&a->k_slc, &a->v_slc, pre, "k_slc", "v_slc")) != NSA_STATUS_SUCCESS ||
        (st = pair_check(&a->k_swa, &a->v_swa, pre, "k_swa", "v_swa")) != NSA_STATUS_SUCCESS ||
        (st = pair_check(&a->k_cmp, &a->v_cmp, pre, "k_cmp", "v_cmp")) != NSA_STATUS_SUCCESS)
        return st;
    if ((st = need_gate(&a->g_cmp, &a->g_slc, &a->g_swa, bwd)) != NSA_STATUS_SUCCESS) return st;
    if (nsa_present(&a->block_counts) && !nsa_present(&a->block_indices))
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%sblock_counts: given without %sblock_indices", pre, pre);
    return NSA_STATUS_SUCCESS;
}

static int forward_specs(const nsa_forward_args *a, int bwd, tspec *s)
{
    const tensor_role sv = bwd ? R_IN : R_OUT;
    /* The forward selects (and saves the indices) only when the caller gave none. */
    const tensor_role sel = nsa_present(&a->g_slc) && !nsa_present(&a->block_indices) ? sv : R_SKIP;
    const tspec t[] = {
        {&a->q, R_IN, K_REF, S_Q, NM(bwd, "q")},
        {&a->k, R_IN, K_REF, S_AK, NM(bwd, "k")},
        {&a->v, R_IN, K_REF, S_AV, NM(bwd, "v")},
        {&a->k_slc, R_OPT_IN, K_REF, S_AK, NM(bwd, "k_slc")},
        {&a->v_slc, R_OPT_IN, K_REF, S_AV, NM(bwd, "v_slc")},
        {&a->k_swa, R_OPT_IN, K_REF, S_AK, NM(bwd, "k_swa")},
        {&a->v_swa, R_OPT_IN, K_REF, S_AV, NM(bwd, "v_swa")},
        {&a->k_cmp, R_OPT_IN, K_REF, S_KC, NM(bwd, "k_cmp")},
        {&a->v_cmp, R_OPT_IN, K_REF, S_VC, NM(bwd, "v_cmp")},
        {&a->g_cmp, R_OPT_IN, K_REF, S_ROW, NM(bwd, "g_cmp")},
        {&a->g_slc, R_OPT_IN, K_REF, S_ROW, NM(bwd, "g_slc")},
        {&a->g_swa, R_OPT_IN, K_REF, S_ROW, NM(bwd, "g_swa")},
        {&a->block_indices, R_OPT_IN, K_I32, S_IDX_M, NM(bwd, "block_indices")},
        {&a->block_counts, R_OPT_IN, K_I32, S_CNT, NM(bwd, "block_counts")},
        {&a->o, bwd ? R_SKIP : R_OUT, K_REF, S_O, NM(bwd, "o")},
        {&a->saved.block_indices, sel, K_I32, S_IDX_N, NM(bwd, "saved.block_indices")},
        {&a->saved.o_cmp, when(&a->g_cmp, sv), K_FLOAT, S_O, NM(bwd, "saved.o_cmp")},
        {&a->saved.o_slc, when(&a->g_slc, sv), K_FLOAT, S_O, NM(bwd, "saved.o_slc")},
        {&a->saved.o_swa, when(&a->g_swa, sv), K_FLOAT, S_O, NM(bwd, "saved.o_swa")},
        {&a->saved.lse_cmp, when(&a->g_cmp, sv), K_F32, S_ROW, NM(bwd, "saved.lse_cmp")},
        {&a->saved.lse_slc, when(&a->g_slc, sv), K_F32, S_ROW, NM(bwd, "saved.lse_slc")},
        {&a->saved.lse_swa, when(&a->g_swa, sv), K_F32, S_ROW, NM(bwd, "saved.lse_swa")},
    };
    return append(s, 0, t, COUNT(t));
}

/* Without caller indices the selection width is n. */
static nsa_status finish_forward(nsa_status st, const nsa_forward_args *a, nsa_problem *p)
{
    if (st == NSA_STATUS_SUCCESS && p->m == 0) p->m = a->config.slc_topk;
    return st;
}

nsa_status nsa_validate_forward(const nsa_forward_args *a, nsa_problem *p)
{
    tspec s[MAX_SPECS];
    int n = forward_specs(a, 0, s);
    nsa_status st = forward_scalars(a, 0);
    if (st != NSA_STATUS_SUCCESS) return st;
    const engine_in e = {a->q.dtype, "q", &a->varlen, &a->config, a->config.scale, "", 0};
    return finish_forward(check_tensors(s, n, &e, p), a, p);
}

nsa_status nsa_validate_backward(const nsa_backward_args *a, nsa_problem *p)
{
    const nsa_forward_args *f = &a->fwd;
    const tspec g[] = {
        {&a->dk_slc, when(&f->k_slc, R_OUT), K_REF, S_AK, "dk_slc"},
        {&a->dv_slc, when(&f->v_slc, R_OUT), K_REF, S_AV, "dv_slc"},
        {&a->dk_swa, when(&f->k_swa, R_OUT), K_REF, S_AK, "dk_swa"},
        {&a->dv_swa, when(&f->v_swa, R_OUT), K_REF, S_AV, "dv_swa"},
        {&a->dk_cmp, when(&f->k_cmp, R_OUT), K_REF, S_KC, "dk_cmp"},
        {&a->dv_cmp, when(&f->v_cmp, R_OUT), K_REF, S_VC, "dv_cmp"},
        {&a->dg_cmp, when(&f->g_cmp, R_OUT), K_REF, S_ROW, "dg_cmp"},
        {&a->dg_slc, when(&f->g_slc, R_OUT), K_REF, S_ROW, "dg_slc"},
        {&a->dg_swa, when(&f->g_swa, R_OUT), K_REF, S_ROW, "dg_swa"},
    };
    tspec s[MAX_SPECS];
    int n = qkv_grad_specs(&a->dout, &a->dq, &a->dk, &a->dv, s, forward_specs(f, 1, s));
    nsa_status st = forward_scalars(f, 1);
    if (st != NSA_STATUS_SUCCESS) return st;
    n = append(s, n, g, COUNT(g));
    const engine_in e = {f->q.dtype, "fwd.q", &f->varlen, &f->config, f->config.scale, "fwd.", 0};
    return finish_forward(check_tensors(s, n, &e, p), f, p);
}

/* ---- 8. Inference step. The caches' own dims are free (capacity, pages); a contiguous
 * cache's dim 0 is B, a paged one's page size is >= 1. Lengths, counts and page indices are
 * data, checked by the backend before it writes (they live in the context's memory). ----- */
static nsa_status cache_dims(const nsa_kv_cache *c, const char *name, int64_t B, int64_t *cap)
{
    const int64_t d0 = c->k.shape[0], rows = c->k.shape[1];
    if (!nsa_present(&c->block_table)) {
        if (d0 != B)
            return nsa_fail(NSA_STATUS_BAD_SHAPE, "%s.k: dim 0 (B) is %" PRId64 ", q has B = %" PRId64
                            " (a contiguous cache holds one sequence per entry; give %s.block_table for pages)",
                            name, d0, B, name);
        *cap = rows;
        return NSA_STATUS_SUCCESS;
    }
    if (rows < 1)
        return nsa_fail(NSA_STATUS_BAD_SHAPE, "%s.k: dim 1 (page size) is %" PRId64 ", must be >= 1", name, rows);
    const size_t c64 = nsa_size_mul(nsa_size_of(c->block_table.shape[1]), nsa_size_of(rows));
    if (!fits_int64(c64))
        return nsa_fail(NSA_STATUS_SIZE_OVERFLOW, "%s.block_table: %" PRId64 " pages of %" PRId64 " rows overflow int64", name,
                        c->block_table.shape[1], rows);
    *cap = (int64_t)c64;
    return NSA_STATUS_SUCCESS;
}

nsa_status nsa_validate_step(const nsa_step_args *a, nsa_problem *p)
{
    nsa_status st = nsa_config_check(&a->config, "config");
    if (st != NSA_STATUS_SUCCESS) return st;
    if (a->cmp_by_caller != 0 && a->cmp_by_caller != 1)
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "cmp_by_caller: %d, must be 0 (the step pools) or 1 (the caller keeps "
                        "cmp_cache)", (int)a->cmp_by_caller);
    if ((st = pair_check(&a->k_new, &a->v_new, "", "k_new", "v_new")) != NSA_STATUS_SUCCESS) return st;
    if ((st = need_gate(&a->g_cmp, &a->g_slc, &a->g_swa, 0)) != NSA_STATUS_SUCCESS) return st;
    if (nsa_present(&a->block_counts) && !nsa_present(&a->block_indices))
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "block_counts: given without block_indices");
    /* the compressed rows feed the compressed branch and the selection's importance */
    const int selects = nsa_present(&a->g_slc) && !nsa_present(&a->block_indices);
    const tensor_role cmp = nsa_present(&a->g_cmp) || selects ? R_IN : R_SKIP;
    const tspec s[] = {
        {&a->q, R_IN, K_REF, S_Q, "q"},
        {&a->q_lens, R_OPT_IN, K_I32, S_LEN, "q_lens"},
        {&a->seqlens, R_IN, K_I32, S_LEN, "seqlens"},
        {&a->k_new, R_OPT_IN, K_REF, S_K, "k_new"},
        {&a->v_new, R_OPT_IN, K_REF, S_V, "v_new"},
        {&a->cache.k, R_IN, K_REF, S_CK, "cache.k"},
        {&a->cache.v, R_IN, K_REF, S_CV, "cache.v"},
        {&a->cache.block_table, R_OPT_IN, K_I32, S_BT, "cache.block_table"},
        {&a->cmp_cache.k, cmp, K_REF, S_CCK, "cmp_cache.k"},
        {&a->cmp_cache.v, cmp, K_REF, S_CCV, "cmp_cache.v"},
        {&a->cmp_cache.block_table, cmp == R_IN ? R_OPT_IN : R_SKIP, K_I32, S_BTC, "cmp_cache.block_table"},
        {&a->g_cmp, R_OPT_IN, K_REF, S_ROW, "g_cmp"},
        {&a->g_slc, R_OPT_IN, K_REF, S_ROW, "g_slc"},
        {&a->g_swa, R_OPT_IN, K_REF, S_ROW, "g_swa"},
        {&a->block_indices, nsa_present(&a->g_slc) ? R_OPT_IN : R_SKIP, K_I32, S_IDX_M, "block_indices"},
        {&a->block_counts, nsa_present(&a->g_slc) ? R_OPT_IN : R_SKIP, K_I32, S_CNT, "block_counts"},
        {&a->o, R_OUT, K_REF, S_O, "o"},
        {&a->selected, selects ? R_OPT_OUT : R_SKIP, K_I32, S_IDX_N, "selected"},
        {&a->errors, R_OPT_OUT, K_I32, S_LEN, "errors"},
    };
    const engine_in e = {a->q.dtype, "q", NULL, &a->config, a->config.scale, "", 0};
    if ((st = check_tensors(s, COUNT(s), &e, p)) != NSA_STATUS_SUCCESS) return st;
    if ((st = cache_dims(&a->cache, "cache", p->B, &p->cache_cap)) != NSA_STATUS_SUCCESS) return st;
    if (cmp == R_IN && (st = cache_dims(&a->cmp_cache, "cmp_cache", p->B, &p->cmp_cap)) != NSA_STATUS_SUCCESS) return st;
    if (p->m == 0) p->m = a->config.slc_topk; /* (caller indices: their width) */
    return NSA_STATUS_SUCCESS;
}


nsa_step_args nsa_step_common(const nsa_attention_step_args *a)
{
    nsa_step_args s;
    memset(&s, 0, sizeof s);
    s.q = a->q, s.q_lens = a->q_lens, s.seqlens = a->seqlens, s.k_new = a->k_new, s.v_new = a->v_new;
    s.cache = a->cache, s.o = a->o, s.errors = a->errors;
    s.config = nsa_config_default(); /* (no compressed rows: only the token cache is read) */
    return s;
}

nsa_status nsa_validate_attention_step(const nsa_attention_step_args *a, nsa_problem *p)
{
    nsa_attention_args opt; /* the scalar rules are nsa_attention's */
    memset(&opt, 0, sizeof opt);
    opt.scale = a->scale, opt.causal = a->causal, opt.window_left = a->window_left, opt.window_right = a->window_right;
    opt.softcap = a->softcap;
    nsa_status st = attention_scalars(&opt, 0);
    if (st != NSA_STATUS_SUCCESS) return st;
    if ((st = pair_check(&a->k_new, &a->v_new, "", "k_new", "v_new")) != NSA_STATUS_SUCCESS) return st;
    const tspec s[] = {
        {&a->q, R_IN, K_REF, S_Q, "q"},
        {&a->q_lens, R_OPT_IN, K_I32, S_LEN, "q_lens"},
        {&a->seqlens, R_IN, K_I32, S_LEN, "seqlens"},
        {&a->k_new, R_OPT_IN, K_REF, S_K, "k_new"},
        {&a->v_new, R_OPT_IN, K_REF, S_V, "v_new"},
        {&a->cache.k, R_IN, K_REF, S_CK, "cache.k"},
        {&a->cache.v, R_IN, K_REF, S_CV, "cache.v"},
        {&a->cache.block_table, R_OPT_IN, K_I32, S_BT, "cache.block_table"},
        {&a->o, R_OUT, K_REF, S_O, "o"},
        {&a->lse, R_OPT_OUT, K_F32, S_ROW, "lse"},
        {&a->errors, R_OPT_OUT, K_I32, S_LEN, "errors"},
        {&a->sinks, R_OPT_IN, K_F32, S_HEAD, "sinks"},
    };
    const engine_in e = {a->q.dtype, "q", NULL, NULL, a->scale, "", 0};
    if ((st = check_tensors(s, COUNT(s), &e, p)) != NSA_STATUS_SUCCESS) return st;
    return cache_dims(&a->cache, "cache", p->B, &p->cache_cap);
}

/* ---- 9. Block-sparse attention with mods. The block lists' contents are data, checked by the
 * backend before it writes (as a step's lengths). ---------------------------------------- */
/* Shared by the forward and the backward (bwd: names under "fwd.", o and lse inputs). */
static nsa_status flex_scalars(const nsa_flex_args *a, int bwd)
{
    const nsa_block_mask *m = &a->block_mask;
    const char *pre = PRE(bwd);
    nsa_attention_args opt; /* the scale rule is nsa_attention's */
    memset(&opt, 0, sizeof opt);
    opt.scale = a->scale;
    nsa_status st = attention_scalars(&opt, bwd);
    if (st != NSA_STATUS_SUCCESS) return st;
    if (a->mask_mod && expr_kind_of(a->mask_mod) != EXPR_MASK)
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%smask_mod: a score_mod (NSA_MOD_SCORE) given as the mask_mod", pre);
    if (a->score_mod && expr_kind_of(a->score_mod) != EXPR_SCORE)
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%sscore_mod: a mask_mod (NSA_MOD_MASK) given as the score_mod", pre);
    if (m->q_block < 1 || m->q_block > INT32_MAX || m->kv_block < 1 || m->kv_block > INT32_MAX)
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%sblock_mask.%s: %" PRId64 ", must be in [1, INT32_MAX]", pre,
                        m->q_block < 1 || m->q_block > INT32_MAX ? "q_block" : "kv_block",
                        m->q_block < 1 || m->q_block > INT32_MAX ? m->q_block : m->kv_block);
    const char *bm = bwd ? "fwd.block_mask." : "block_mask.";
    if ((st = pair_check(&m->kv_num_blocks, &m->kv_indices, bm, "kv_num_blocks", "kv_indices")) != NSA_STATUS_SUCCESS ||
        (st = pair_check(&m->full_kv_num_blocks, &m->full_kv_indices, bm, "full_kv_num_blocks", "full_kv_indices")) !=
            NSA_STATUS_SUCCESS)
        return st;
    if (nsa_present(&m->full_kv_num_blocks) && !nsa_present(&m->kv_num_blocks))
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%sfull_kv_num_blocks: given without kv_num_blocks (both lists or the "
                        "partial one alone)", bm);
    return NSA_STATUS_SUCCESS;
}

static int flex_specs(const nsa_flex_args *a, int bwd, tspec *s)
{
    const nsa_block_mask *m = &a->block_mask;
    const tspec t[] = {
        {&a->q, R_IN, K_REF, S_Q, NM(bwd, "q")},
        {&a->k, R_IN, K_REF, S_AK, NM(bwd, "k")},
        {&a->v, R_IN, K_REF, S_AV, NM(bwd, "v")},
        {&a->o, bwd ? R_IN : R_OUT, K_REF, S_O, NM(bwd, "o")},
        {&a->lse, bwd ? R_IN : R_OPT_OUT, K_F32, S_ROW, NM(bwd, "lse")},
        {&m->kv_num_blocks, R_OPT_IN, K_I32, S_BMN, NM(bwd, "block_mask.kv_num_blocks")},
        {&m->kv_indices, R_OPT_IN, K_I32, S_BMI, NM(bwd, "block_mask.kv_indices")},
        {&m->full_kv_num_blocks, R_OPT_IN, K_I32, S_BMN, NM(bwd, "block_mask.full_kv_num_blocks")},
        {&m->full_kv_indices, R_OPT_IN, K_I32, S_BMF, NM(bwd, "block_mask.full_kv_indices")},
    };
    return append(s, 0, t, COUNT(t));
}

static nsa_status flex_finish(const nsa_flex_args *a, int bwd, const nsa_problem *p)
{
    if (!a->doc_runs && a->num_doc_runs != 0)
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%snum_doc_runs: %" PRId64 " without doc_runs", PRE(bwd), a->num_doc_runs);
    if (a->doc_runs) { /* (host memory: bounds 0 = r_0 < r_1 < ... < r_n = Tq) */
        const int64_t n = a->num_doc_runs;
        if (n < 1 || n > p->T)
            return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%snum_doc_runs: %" PRId64 ", must be in [1, Tq = %" PRId64 "]", PRE(bwd), n,
                            p->T);
        if (a->doc_runs[0] != 0 || a->doc_runs[n] != p->T)
            return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%sdoc_runs: the bounds run from %" PRId32 " to %" PRId32 ", must run from 0 "
                            "to Tq = %" PRId64, PRE(bwd), a->doc_runs[0], a->doc_runs[n], p->T);
        for (int64_t s = 0; s < n; s++)
            if (a->doc_runs[s + 1] <= a->doc_runs[s])
                return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%sdoc_runs[%" PRId64 "]: %" PRId32 " after %" PRId32 ", the bounds must "
                                "increase", PRE(bwd), s + 1, a->doc_runs[s + 1], a->doc_runs[s]);
    }
    const nsa_block_mask *m = &a->block_mask;
    const int64_t nqb = p->T / m->q_block + (p->T % m->q_block != 0);
    if (nsa_present(&m->kv_num_blocks) && m->kv_num_blocks.shape[2] != nqb)
        return nsa_fail(NSA_STATUS_BAD_SHAPE, "%sblock_mask.kv_num_blocks: dim 2 (query blocks) is %" PRId64 ", Tq = %" PRId64
                        " rows in blocks of %" PRId64 " make %" PRId64, PRE(bwd), m->kv_num_blocks.shape[2], p->T, m->q_block, nqb);
    return NSA_STATUS_SUCCESS;
}

nsa_status nsa_validate_flex(const nsa_flex_args *a, nsa_problem *p)
{
    nsa_status st = flex_scalars(a, 0);
    if (st != NSA_STATUS_SUCCESS) return st;
    tspec s[MAX_SPECS];
    const int n = flex_specs(a, 0, s);
    const engine_in e = {a->q.dtype, "q", NULL, NULL, a->scale, "", 0};
    if ((st = check_tensors(s, n, &e, p)) != NSA_STATUS_SUCCESS) return st;
    return flex_finish(a, 0, p);
}

nsa_status nsa_validate_flex_bwd(const nsa_flex_bwd_args *a, nsa_problem *p)
{
    const nsa_flex_args *f = &a->fwd;
    nsa_status st = flex_scalars(f, 1);
    if (st != NSA_STATUS_SUCCESS) return st;
    tspec s[MAX_SPECS];
    const tspec g[] = {
        {&a->dout, R_IN, K_REF, S_O, "dout"},
        {&a->dq, R_OUT, K_REF, S_Q, "dq"},
        {&a->dk, R_OUT, K_REF, S_AK, "dk"},
        {&a->dv, R_OUT, K_REF, S_AV, "dv"},
    };
    const int n = append(s, flex_specs(f, 1, s), g, COUNT(g));
    const engine_in e = {f->q.dtype, "fwd.q", NULL, NULL, f->scale, "fwd.", 0};
    if ((st = check_tensors(s, n, &e, p)) != NSA_STATUS_SUCCESS) return st;
    if ((st = flex_finish(f, 1, p)) != NSA_STATUS_SUCCESS) return st;
    /* the score_mod's tensor gradients: float tensors of the mod, same shape, F32, every element once */
    const int ncap = f->score_mod ? expr_num_captures(f->score_mod) : 0;
    for (int t = 0; t < NSA_MOD_MAX_TENSORS; t++) {
        const nsa_tensor *d = &a->dscore_tensors[t];
        if (!nsa_present(d)) continue;
        if (t >= ncap)
            return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "dscore_tensors[%d]: given, but the score_mod has %d tensor%s", t, ncap,
                            ncap == 1 ? "" : "s");
        const nsa_tensor *c = expr_capture_tensor(f->score_mod, t);
        if (c->dtype != NSA_DTYPE_F32 && c->dtype != NSA_DTYPE_F16 && c->dtype != NSA_DTYPE_BF16)
            return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "dscore_tensors[%d]: the score_mod's tensor '%s' is %s (no gradient: not a "
                            "float)", t, expr_capture_name(f->score_mod, t), nsa_dtype_name(c->dtype));
        if (d->dtype != NSA_DTYPE_F32)
            return nsa_fail(NSA_STATUS_BAD_DTYPE, "dscore_tensors[%d]: %s, must be f32", t, nsa_dtype_name(d->dtype));
        if (d->rank != c->rank)
            return nsa_fail(NSA_STATUS_BAD_RANK, "dscore_tensors[%d]: rank %d, the tensor '%s' has %d", t, (int)d->rank,
                            expr_capture_name(f->score_mod, t), (int)c->rank);
        for (int j = 0; j < c->rank; j++) {
            if (d->shape[j] != c->shape[j])
                return nsa_fail(NSA_STATUS_BAD_SHAPE, "dscore_tensors[%d]: dim %d is %" PRId64 ", the tensor '%s' has %" PRId64, t, j,
                                d->shape[j], expr_capture_name(f->score_mod, t), c->shape[j]);
            if (d->stride[j] < 0 || (d->shape[j] > 1 && d->stride[j] == 0))
                return nsa_fail(NSA_STATUS_BAD_STRIDE, "dscore_tensors[%d]: stride[%d] is %" PRId64 " (an element would be written "
                                "twice, or backwards)", t, j, d->stride[j]);
        }
        if (d->stride[d->rank - 1] != 1 && d->shape[d->rank - 1] > 1)
            return nsa_fail(NSA_STATUS_BAD_STRIDE, "dscore_tensors[%d]: last-dim stride %" PRId64 ", must be 1", t,
                            d->stride[d->rank - 1]);
    }
    return NSA_STATUS_SUCCESS;
}
