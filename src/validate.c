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
 * Nothing here reads tensor data except the host cu_seqlens, and nothing writes to a tensor. */
#include <math.h>
#include <string.h>

#include "internal.h"
#include "rules.h"

/* Symbolic dimensions. The first described tensor carrying a symbol fixes its value and every
 * later one must agree, so each op's shape rules are just its table rows. */
enum dim_sym {
    Z_NONE = 0, /* past the tensor's rank */
    Z_B, Z_T, Z_HQ, Z_H, Z_DK, Z_DV,
    Z_NC,       /* compressed rows: known only once cu_seqlens is checked (stage d) */
    Z_M,        /* block_indices width chosen by the caller, >= 1 */
    Z_N,        /* block_indices width fixed to config.slc_topk */
    Z_TK,       /* attention's key rows (Tq may differ from Tk there) */
    Z_COUNT,
    /* broadcast dims, checked after the others (stage c): 1 or the full size */
    Z_B1,       /* 1 or B */
    Z_HQ1       /* 1 or HQ */
};

enum shape_id { S_Q, S_K, S_V, S_O, S_ROW, S_KC, S_VC, S_IDX_M, S_IDX_N, S_CNT, S_AK, S_AV, S_HEAD, S_SEGQ, S_SEGK,
                S_PAIR };

static const unsigned char SHAPES[][NSA_MAX_RANK] = {
    [S_Q] = {Z_B, Z_T, Z_HQ, Z_DK},    /* q, dq */
    [S_K] = {Z_B, Z_T, Z_H, Z_DK},     /* k, dk; compress x with D as DK */
    [S_V] = {Z_B, Z_T, Z_H, Z_DV},     /* v, dv */
    [S_O] = {Z_B, Z_T, Z_HQ, Z_DV},    /* o, dout, branch outputs */
    [S_ROW] = {Z_B, Z_T, Z_HQ},        /* lse, gates */
    [S_KC] = {Z_B, Z_NC, Z_H, Z_DK},   /* k_cmp, x_cmp */
    [S_VC] = {Z_B, Z_NC, Z_H, Z_DV},   /* v_cmp */
    [S_IDX_M] = {Z_B, Z_T, Z_H, Z_M},  /* block_indices given by the caller */
    [S_IDX_N] = {Z_B, Z_T, Z_H, Z_N},  /* block_indices written by the selection */
    [S_CNT] = {Z_B, Z_T, Z_H},         /* block_counts */
    [S_AK] = {Z_B, Z_TK, Z_H, Z_DK},   /* attention k, dk */
    [S_AV] = {Z_B, Z_TK, Z_H, Z_DV},   /* attention v, dv */
    [S_HEAD] = {Z_HQ},                 /* sinks, dsinks */
    [S_SEGQ] = {Z_B, Z_T},             /* q_segment_ids */
    [S_SEGK] = {Z_B, Z_TK},            /* k_segment_ids */
    [S_PAIR] = {Z_B1, Z_HQ1, Z_T, Z_TK}, /* bias, dbias, mask */
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
} tspec;

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

static int dtype_ok(nsa_dtype dt, dtype_rule rule, nsa_dtype ref)
{
    int is_float = dt == NSA_DTYPE_F32 || dt == NSA_DTYPE_F16 || dt == NSA_DTYPE_BF16;
    switch (rule) {
    case K_REF: return is_float && dt == ref;
    case K_FLOAT: return is_float;
    case K_F32: return dt == NSA_DTYPE_F32;
    case K_U8: return dt == NSA_DTYPE_U8;
    default: return dt == NSA_DTYPE_I32;
    }
}

/* Stage b for one view: well-formed alone, and every offset it implies fits in int64 (the
 * backends index with int64 and trust it). *count = its element count. */
static nsa_status check_tensor(const nsa_tensor *t, int rank, dtype_rule rule, nsa_dtype ref, int64_t *count)
{
    size_t n = 1, dims = 1, last = 0;
    const size_t es = nsa_dtype_size(t->dtype);
    int i;

    if (t->rank != rank) return NSA_STATUS_BAD_RANK;
    if (!dtype_ok(t->dtype, rule, ref)) return NSA_STATUS_BAD_DTYPE;
    for (i = 0; i < rank; i++)
        if (t->shape[i] < 0) return NSA_STATUS_BAD_SHAPE;
    if (t->stride[rank - 1] != 1) return NSA_STATUS_BAD_STRIDE;
    for (i = 0; i < rank; i++)
        if (t->stride[i] < 0) return NSA_STATUS_BAD_STRIDE;
    /* Empty dims count as 1 in `dims`, so that no product of an empty tensor's sizes (a
     * backend's loop bounds or scratch sizes) overflows either; n <= dims. */
    for (i = 0; i < rank; i++) {
        n = nsa_size_mul(n, nsa_size_of(t->shape[i]));
        dims = nsa_size_mul(dims, t->shape[i] ? nsa_size_of(t->shape[i]) : 1);
    }
    if (!fits_int64(dims)) return NSA_STATUS_SIZE_OVERFLOW;
    if (n > 0) { /* the last element's offset + 1, in elements and in bytes; the bytes of n */
        for (i = 0; i < rank; i++)
            last = nsa_size_add(last, nsa_size_mul(nsa_size_of(t->stride[i]), nsa_size_of(t->shape[i] - 1)));
        last = nsa_size_add(last, 1);
        if (!fits_int64(nsa_size_mul(last, es)) || !fits_int64(nsa_size_mul(n, es))) return NSA_STATUS_SIZE_OVERFLOW;
    }
    *count = (int64_t)n;
    return NSA_STATUS_SUCCESS;
}

static nsa_status check_one(const tspec *s, nsa_dtype ref)
{
    const nsa_tensor *t = s->t;
    int64_t count = 0;
    nsa_status st;

    if (!described(s)) return NSA_STATUS_SUCCESS;
    /* A required input left zero-initialised was forgotten: "NULL" says more than "rank". */
    if (s->role == R_IN && !nsa_present(t) && t->rank == 0) return NSA_STATUS_NULL_POINTER;
    st = check_tensor(t, rank_of(s->shape), s->rule, ref, &count);
    if (st != NSA_STATUS_SUCCESS) return st;
    if (s->role == R_IN && !nsa_present(t) && count > 0) return NSA_STATUS_NULL_POINTER;
    return NSA_STATUS_SUCCESS;
}

/* Stage d, and the compressed row count of dense and packed inputs alike. cu_seqlens is host
 * memory (nsa.h), the one array this file reads. */
static nsa_status check_varlen(const nsa_varlen *vl, int64_t B, int64_t T, const nsa_config *cfg, nsa_problem *p)
{
    const int32_t *cu = vl ? vl->cu_seqlens : NULL;
    int64_t N, s, rows = 0;

    p->num_seqs = B;
    p->cmp_rows = cfg ? nsa_rule_num_cmp(T, cfg->cmp_len, cfg->cmp_stride) : 0;
    if (!cu) return NSA_STATUS_SUCCESS;
    N = vl->num_seqs;
    if (B != 1 || N < 0 || cu[0] != 0) return NSA_STATUS_BAD_CU_SEQLENS;
    for (s = 0; s < N; s++) {
        if (cu[s + 1] < cu[s]) return NSA_STATUS_BAD_CU_SEQLENS;
        if (cfg) rows += nsa_rule_num_cmp(cu[s + 1] - cu[s], cfg->cmp_len, cfg->cmp_stride);
    }
    if (cu[N] != T) return NSA_STATUS_BAD_CU_SEQLENS;
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

/* Stages b to e over one op's table; fills *p from the agreed dimensions. `scale` is the
 * caller's (0 = 1/sqrt(DK)); vl and cfg are NULL for ops without them. */
static nsa_status check_tensors(const tspec *s, int n, nsa_dtype ref, const nsa_varlen *vl, const nsa_config *cfg,
                                float scale, nsa_problem *p)
{
    int64_t dim[Z_COUNT];
    nsa_status st;
    int i, j, z;

    memset(p, 0, sizeof *p);
    for (i = 0; i < n; i++)
        if ((st = check_one(&s[i], ref)) != NSA_STATUS_SUCCESS) return st;

    for (z = 0; z < Z_COUNT; z++) dim[z] = -1; /* not fixed yet */
    if (cfg) dim[Z_N] = cfg->slc_topk;
    for (i = 0; i < n; i++) {
        if (!described(&s[i])) continue;
        for (j = 0; j < s[i].t->rank; j++) {
            z = SHAPES[s[i].shape][j];
            if (z == Z_NC || z >= Z_COUNT) continue;
            if (dim[z] < 0) dim[z] = s[i].t->shape[j];
            else if (dim[z] != s[i].t->shape[j]) return NSA_STATUS_BAD_SHAPE;
        }
    }
    /* Zero heads leave G undefined; a zero head dim makes the default scale infinite. */
    if (dim[Z_HQ] == 0 || dim[Z_H] == 0 || dim[Z_DK] == 0 || dim[Z_DV] == 0 || dim[Z_M] == 0)
        return NSA_STATUS_BAD_SHAPE;
    if (dim[Z_HQ] > 0 && dim[Z_H] > 0 && dim[Z_HQ] % dim[Z_H] != 0) return NSA_STATUS_BAD_GQA;
    for (i = 0; i < n; i++) { /* broadcast dims: 1 or the size the other tensors fixed */
        if (!described(&s[i])) continue;
        for (j = 0; j < s[i].t->rank; j++) {
            z = SHAPES[s[i].shape][j];
            if (z < Z_COUNT) continue;
            const int64_t full = dim[z == Z_B1 ? Z_B : Z_HQ], got = s[i].t->shape[j];
            if (got != 1 && got != full) return NSA_STATUS_BAD_SHAPE;
        }
    }

    if ((st = check_varlen(vl, dim[Z_B], dim[Z_T], cfg, p)) != NSA_STATUS_SUCCESS) return st;
    dim[Z_NC] = p->cmp_rows;
    for (i = 0; i < n; i++) {
        if (!described(&s[i])) continue;
        for (j = 0; j < s[i].t->rank; j++)
            if (SHAPES[s[i].shape][j] == Z_NC && s[i].t->shape[j] != p->cmp_rows) return NSA_STATUS_BAD_SHAPE;
    }

    for (i = 0; i < n; i++) {
        if (s[i].role != R_OUT || nsa_present(s[i].t)) continue;
        if (!expected_empty(s[i].shape, dim)) return NSA_STATUS_MISSING_OUTPUT;
        /* an absent output is an empty one: a view whose own shape holds elements would have a
         * backend that walks its shape write through NULL */
        if (!view_empty(s[i].t)) return NSA_STATUS_NULL_POINTER;
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
    p->scale = scale != 0.0f ? scale : p->DK > 0 ? 1.0f / sqrtf((float)p->DK) : 0.0f;
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

nsa_status nsa_config_validate(const nsa_config *c)
{
    if (!c) return NSA_STATUS_NULL_POINTER;
    if (!in_int32(c->cmp_stride, 1)) return NSA_STATUS_BAD_CMP_STRIDE;
    if (!in_int32(c->cmp_len, 1)) return NSA_STATUS_BAD_CMP_LEN;
    if (c->cmp_len % c->cmp_stride != 0) return NSA_STATUS_BAD_CMP_STRIDE;
    if (c->cmp_len > c->slc_block) return NSA_STATUS_BAD_CMP_LEN;
    if (!in_int32(c->slc_block, 1) || c->slc_block % c->cmp_stride != 0) return NSA_STATUS_BAD_SLC_BLOCK;
    /* n - n_init cannot overflow once n >= 1 and n_init >= 0; n_init + n_local could. */
    if (!in_int32(c->slc_topk, 1) || !in_int32(c->n_init, 0) || !in_int32(c->n_local, 0) ||
        c->slc_topk - c->n_init < c->n_local)
        return NSA_STATUS_BAD_TOPK;
    if (c->window < 1) return NSA_STATUS_BAD_WINDOW;
    if (!scale_ok(c->scale) || !scale_ok(c->swa_scale)) return NSA_STATUS_BAD_SCALE;
    return NSA_STATUS_SUCCESS;
}

/* The engine for ops that carry an nsa_config, after the config itself. */
static nsa_status check_with_config(const tspec *s, int n, nsa_dtype ref, const nsa_varlen *vl, const nsa_config *cfg,
                                    nsa_problem *p)
{
    nsa_status st = nsa_config_validate(cfg);
    if (st != NSA_STATUS_SUCCESS) return st;
    return check_tensors(s, n, ref, vl, cfg, cfg->scale, p);
}

/* ---- 1. Compression: x is its own query, so HQ = H and DK = DV = D. ------------------ */
static nsa_status check_compress(const tspec *s, int n, const nsa_compress_args *a, nsa_problem *p)
{
    nsa_status st = check_with_config(s, n, a->x.dtype, &a->varlen, &a->config, p);
    if (st != NSA_STATUS_SUCCESS) return st;
    p->HQ = p->H;
    p->G = 1;
    p->DV = p->DK;
    return NSA_STATUS_SUCCESS;
}

nsa_status nsa_validate_compress(const nsa_compress_args *a, nsa_problem *p)
{
    const tspec s[] = {
        {&a->x, R_IN, K_REF, S_K},
        {&a->x_cmp, R_OUT, K_REF, S_KC},
    };
    return check_compress(s, COUNT(s), a, p);
}

nsa_status nsa_validate_compress_bwd(const nsa_compress_bwd_args *a, nsa_problem *p)
{
    const tspec s[] = {
        {&a->fwd.x, R_DESC, K_REF, S_K}, /* the backward is linear: x's values are never read */
        {&a->dx_cmp, R_IN, K_REF, S_KC},
        {&a->dx, R_OUT, K_REF, S_K},
    };
    return check_compress(s, COUNT(s), &a->fwd, p);
}

/* ---- 2. Compressed attention. In the backward the forward's outputs are inputs. ------- */
static int cmp_attn_specs(const nsa_cmp_attn_args *a, int bwd, tspec *s)
{
    const tensor_role out = bwd ? R_IN : R_OUT;
    const tspec t[] = {
        {&a->q, R_IN, K_REF, S_Q},     {&a->k_cmp, R_IN, K_REF, S_KC}, {&a->v_cmp, R_IN, K_REF, S_VC},
        {&a->o, out, K_REF, S_O},      {&a->lse, out, K_F32, S_ROW},
    };
    return append(s, 0, t, COUNT(t));
}

nsa_status nsa_validate_cmp_attn(const nsa_cmp_attn_args *a, nsa_problem *p)
{
    tspec s[MAX_SPECS];
    int n = cmp_attn_specs(a, 0, s);
    return check_with_config(s, n, a->q.dtype, &a->varlen, &a->config, p);
}

nsa_status nsa_validate_cmp_attn_bwd(const nsa_cmp_attn_bwd_args *a, nsa_problem *p)
{
    const tspec g[] = {
        {&a->dout, R_IN, K_REF, S_O},      {&a->dq, R_OUT, K_REF, S_Q},
        {&a->dk_cmp, R_OUT, K_REF, S_KC},  {&a->dv_cmp, R_OUT, K_REF, S_VC},
    };
    tspec s[MAX_SPECS];
    int n = append(s, cmp_attn_specs(&a->fwd, 1, s), g, COUNT(g));
    return check_with_config(s, n, a->fwd.q.dtype, &a->fwd.varlen, &a->fwd.config, p);
}

/* ---- 3. Selection: writes exactly n = slc_topk indices per row. ---------------------- */
nsa_status nsa_validate_select(const nsa_select_args *a, nsa_problem *p)
{
    const tspec s[] = {
        {&a->q, R_IN, K_REF, S_Q},
        {&a->k_cmp, R_IN, K_REF, S_KC},
        {&a->lse_cmp, R_OPT_IN, K_F32, S_ROW},
        {&a->block_indices, R_OUT, K_I32, S_IDX_N},
        {&a->block_counts, R_OPT_OUT, K_I32, S_CNT},
    };
    nsa_status st = check_with_config(s, COUNT(s), a->q.dtype, &a->varlen, &a->config, p);
    if (st == NSA_STATUS_SUCCESS) p->m = a->config.slc_topk;
    return st;
}

/* ---- 4. Selected attention ----------------------------------------------------------- */
static int slc_attn_specs(const nsa_slc_attn_args *a, int bwd, tspec *s)
{
    const tensor_role out = bwd ? R_IN : R_OUT;
    const tspec t[] = {
        {&a->q, R_IN, K_REF, S_Q},
        {&a->k, R_IN, K_REF, S_K},
        {&a->v, R_IN, K_REF, S_V},
        {&a->block_indices, R_IN, K_I32, S_IDX_M},
        {&a->block_counts, R_OPT_IN, K_I32, S_CNT},
        {&a->o, out, K_REF, S_O},
        {&a->lse, out, K_F32, S_ROW},
    };
    return append(s, 0, t, COUNT(t));
}

/* Gradients of q, k, v: shared by the selected and the dense attention backward. */
static int qkv_grad_specs(const nsa_tensor *dout, const nsa_tensor *dq, const nsa_tensor *dk, const nsa_tensor *dv,
                          tspec *s, int n)
{
    const tspec g[] = {
        {dout, R_IN, K_REF, S_O}, {dq, R_OUT, K_REF, S_Q}, {dk, R_OUT, K_REF, S_K}, {dv, R_OUT, K_REF, S_V},
    };
    return append(s, n, g, COUNT(g));
}

nsa_status nsa_validate_slc_attn(const nsa_slc_attn_args *a, nsa_problem *p)
{
    tspec s[MAX_SPECS];
    int n = slc_attn_specs(a, 0, s);
    return check_with_config(s, n, a->q.dtype, &a->varlen, &a->config, p);
}

nsa_status nsa_validate_slc_attn_bwd(const nsa_slc_attn_bwd_args *a, nsa_problem *p)
{
    tspec s[MAX_SPECS];
    int n = qkv_grad_specs(&a->dout, &a->dq, &a->dk, &a->dv, s, slc_attn_specs(&a->fwd, 1, s));
    return check_with_config(s, n, a->fwd.q.dtype, &a->fwd.varlen, &a->fwd.config, p);
}

/* ---- 5. Dense / windowed attention: no nsa_config, its scalars are fields. ------------- */
/* Stage a: the scalars and which options must come together. */
static nsa_status attention_scalars(const nsa_attention_args *a)
{
    const nsa_varlen_qk *vq = &a->varlen_qk;
    if (!scale_ok(a->scale)) return NSA_STATUS_BAD_SCALE;
    if (a->window_left < -1 || a->window_right < -1) return NSA_STATUS_BAD_WINDOW;
    if (!isfinite(a->softcap) || a->softcap < 0.0f) return NSA_STATUS_BAD_SOFTCAP;
    if (!(a->dropout_p >= 0.0f && a->dropout_p < 1.0f)) return NSA_STATUS_BAD_DROPOUT; /* NaN fails too */
    if (nsa_present(&a->q_segment_ids) != nsa_present(&a->k_segment_ids)) return NSA_STATUS_BAD_ARGUMENT;
    if ((vq->cu_seqlens_q != NULL) != (vq->cu_seqlens_k != NULL)) return NSA_STATUS_BAD_ARGUMENT;
    if (vq->cu_seqlens_q && a->varlen.cu_seqlens) return NSA_STATUS_BAD_ARGUMENT; /* one packing only */
    return NSA_STATUS_SUCCESS;
}

/* One packing: cu[0] == 0, non-decreasing, cu[N] == total. */
static int cu64_ok(const int64_t *cu, int64_t N, int64_t total)
{
    if (cu[0] != 0) return 0;
    for (int64_t s = 0; s < N; s++)
        if (cu[s + 1] < cu[s]) return 0;
    return cu[N] == total;
}

/* Stage d for the attention's own varlen forms, and the rules tying dbias to bias. */
static nsa_status attention_finish(const nsa_attention_args *a, const nsa_tensor *dbias, nsa_problem *p)
{
    const nsa_varlen_qk *vq = &a->varlen_qk;
    /* the int32 packing is one for q and k alike: it cannot describe Tq != Tk */
    if (a->varlen.cu_seqlens && p->Tk != p->T) return NSA_STATUS_BAD_CU_SEQLENS;
    if (vq->cu_seqlens_q) {
        if (p->B != 1 || vq->num_seqs < 0 || !cu64_ok(vq->cu_seqlens_q, vq->num_seqs, p->T) ||
            !cu64_ok(vq->cu_seqlens_k, vq->num_seqs, p->Tk))
            return NSA_STATUS_BAD_CU_SEQLENS;
        p->num_seqs = vq->num_seqs;
        p->cu_seqlens_q = vq->cu_seqlens_q;
        p->cu_seqlens_k = vq->cu_seqlens_k;
    }
    if (dbias && nsa_present(dbias)) {
        for (int j = 0; j < 4; j++)
            if (dbias->shape[j] != a->bias.shape[j]) return NSA_STATUS_BAD_SHAPE;
        for (int j = 0; j < 4; j++) /* an output dim of stride 0 would write one element twice */
            if (dbias->shape[j] > 1 && dbias->stride[j] == 0) return NSA_STATUS_BAD_STRIDE;
    }
    p->extended = p->T != p->Tk || a->softcap != 0.0f || nsa_present(&a->sinks) || nsa_present(&a->q_segment_ids) ||
                  nsa_present(&a->bias) || nsa_present(&a->mask) || a->dropout_p != 0.0f || vq->cu_seqlens_q != NULL;
    return NSA_STATUS_SUCCESS;
}

static int attention_specs(const nsa_attention_args *a, int bwd, tspec *s)
{
    const tensor_role out = bwd ? R_IN : R_OUT;
    const tspec t[] = {
        {&a->q, R_IN, K_REF, S_Q},
        {&a->k, R_IN, K_REF, S_AK},
        {&a->v, R_IN, K_REF, S_AV},
        {&a->o, out, K_REF, S_O},
        {&a->lse, out, K_F32, S_ROW},
        {&a->sinks, R_OPT_IN, K_F32, S_HEAD},
        {&a->q_segment_ids, R_OPT_IN, K_I32, S_SEGQ},
        {&a->k_segment_ids, R_OPT_IN, K_I32, S_SEGK},
        {&a->bias, R_OPT_IN, K_FLOAT, S_PAIR},
        {&a->mask, R_OPT_IN, K_U8, S_PAIR},
    };
    return append(s, 0, t, COUNT(t));
}

nsa_status nsa_validate_attention(const nsa_attention_args *a, nsa_problem *p)
{
    tspec s[MAX_SPECS];
    int n = attention_specs(a, 0, s);
    nsa_status st = attention_scalars(a);
    if (st != NSA_STATUS_SUCCESS) return st;
    st = check_tensors(s, n, a->q.dtype, &a->varlen, NULL, a->scale, p);
    if (st != NSA_STATUS_SUCCESS) return st;
    return attention_finish(a, NULL, p);
}

nsa_status nsa_validate_attention_bwd(const nsa_attention_bwd_args *a, nsa_problem *p)
{
    const nsa_attention_args *f = &a->fwd;
    const tspec g[] = {
        {&a->dout, R_IN, K_REF, S_O},
        {&a->dq, R_OUT, K_REF, S_Q},
        {&a->dk, R_OUT, K_REF, S_AK},
        {&a->dv, R_OUT, K_REF, S_AV},
        {&a->dsinks, when(&f->sinks, R_OUT), K_F32, S_HEAD},
        {&a->dbias, when(&f->bias, R_OPT_OUT), K_FLOAT, S_PAIR},
    };
    tspec s[MAX_SPECS];
    int n = append(s, attention_specs(f, 1, s), g, COUNT(g));
    nsa_status st = attention_scalars(f);
    if (st != NSA_STATUS_SUCCESS) return st;
    if (nsa_present(&a->dbias) && !nsa_present(&f->bias)) return NSA_STATUS_BAD_ARGUMENT;
    st = check_tensors(s, n, f->q.dtype, &f->varlen, NULL, f->scale, p);
    if (st != NSA_STATUS_SUCCESS) return st;
    return attention_finish(f, &a->dbias, p);
}

/* ---- 6. Gating: o (not q) sets the sizes and the dtype of the gates. ------------------ */
static int any_gate(const nsa_tensor *g_cmp, const nsa_tensor *g_slc, const nsa_tensor *g_swa)
{
    return nsa_present(g_cmp) || nsa_present(g_slc) || nsa_present(g_swa);
}

static int gate_specs(const nsa_gate_args *a, int bwd, tspec *s)
{
    const tspec t[] = {
        {&a->o_cmp, when(&a->g_cmp, R_IN), K_FLOAT, S_O},
        {&a->o_slc, when(&a->g_slc, R_IN), K_FLOAT, S_O},
        {&a->o_swa, when(&a->g_swa, R_IN), K_FLOAT, S_O},
        {&a->g_cmp, R_OPT_IN, K_REF, S_ROW},
        {&a->g_slc, R_OPT_IN, K_REF, S_ROW},
        {&a->g_swa, R_OPT_IN, K_REF, S_ROW},
        {&a->o, bwd ? R_DESC : R_OUT, K_REF, S_O}, /* the backward reads o's shape and dtype only */
    };
    return append(s, 0, t, COUNT(t));
}

nsa_status nsa_validate_gate(const nsa_gate_args *a, nsa_problem *p)
{
    tspec s[MAX_SPECS];
    int n = gate_specs(a, 0, s);
    /* While o is absent (MISSING_OUTPUT, stage e) the first gate stands in for its dtype. */
    nsa_dtype ref = nsa_present(&a->o) ? a->o.dtype : nsa_present(&a->g_cmp) ? a->g_cmp.dtype : nsa_present(&a->g_slc) ? a->g_slc.dtype : a->g_swa.dtype;
    if (!any_gate(&a->g_cmp, &a->g_slc, &a->g_swa)) return NSA_STATUS_BAD_ARGUMENT;
    return check_tensors(s, n, ref, NULL, NULL, 0.0f, p);
}

nsa_status nsa_validate_gate_bwd(const nsa_gate_bwd_args *a, nsa_problem *p)
{
    const nsa_gate_args *f = &a->fwd;
    const tspec g[] = {
        {&a->dout, R_IN, K_REF, S_O},
        {&a->do_cmp, when(&f->g_cmp, R_OUT), K_FLOAT, S_O},
        {&a->do_slc, when(&f->g_slc, R_OUT), K_FLOAT, S_O},
        {&a->do_swa, when(&f->g_swa, R_OUT), K_FLOAT, S_O},
        {&a->dg_cmp, when(&f->g_cmp, R_OUT), K_REF, S_ROW},
        {&a->dg_slc, when(&f->g_slc, R_OUT), K_REF, S_ROW},
        {&a->dg_swa, when(&f->g_swa, R_OUT), K_REF, S_ROW},
    };
    tspec s[MAX_SPECS];
    int n = append(s, gate_specs(f, 1, s), g, COUNT(g));
    if (!any_gate(&f->g_cmp, &f->g_slc, &f->g_swa)) return NSA_STATUS_BAD_ARGUMENT;
    return check_tensors(s, n, f->o.dtype, NULL, NULL, 0.0f, p);
}

/* ---- 7. Whole NSA. What the forward writes to `saved` the backward reads back. -------- */
static nsa_status forward_scalars(const nsa_forward_args *a)
{
    nsa_status st = nsa_config_validate(&a->config);
    if (st != NSA_STATUS_SUCCESS) return st;
    if (nsa_present(&a->k_slc) != nsa_present(&a->v_slc) || nsa_present(&a->k_swa) != nsa_present(&a->v_swa) || nsa_present(&a->k_cmp) != nsa_present(&a->v_cmp))
        return NSA_STATUS_BAD_ARGUMENT;
    if (!any_gate(&a->g_cmp, &a->g_slc, &a->g_swa)) return NSA_STATUS_BAD_ARGUMENT;
    if (nsa_present(&a->block_counts) && !nsa_present(&a->block_indices)) return NSA_STATUS_BAD_ARGUMENT;
    return NSA_STATUS_SUCCESS;
}

static int forward_specs(const nsa_forward_args *a, int bwd, tspec *s)
{
    const tensor_role sv = bwd ? R_IN : R_OUT;
    /* The forward selects (and saves the indices) only when the caller gave none. */
    const tensor_role sel = nsa_present(&a->g_slc) && !nsa_present(&a->block_indices) ? sv : R_SKIP;
    const tspec t[] = {
        {&a->q, R_IN, K_REF, S_Q},
        {&a->k, R_IN, K_REF, S_K},
        {&a->v, R_IN, K_REF, S_V},
        {&a->k_slc, R_OPT_IN, K_REF, S_K},
        {&a->v_slc, R_OPT_IN, K_REF, S_V},
        {&a->k_swa, R_OPT_IN, K_REF, S_K},
        {&a->v_swa, R_OPT_IN, K_REF, S_V},
        {&a->k_cmp, R_OPT_IN, K_REF, S_KC},
        {&a->v_cmp, R_OPT_IN, K_REF, S_VC},
        {&a->g_cmp, R_OPT_IN, K_REF, S_ROW},
        {&a->g_slc, R_OPT_IN, K_REF, S_ROW},
        {&a->g_swa, R_OPT_IN, K_REF, S_ROW},
        {&a->block_indices, R_OPT_IN, K_I32, S_IDX_M},
        {&a->block_counts, R_OPT_IN, K_I32, S_CNT},
        {&a->o, bwd ? R_SKIP : R_OUT, K_REF, S_O},
        {&a->saved.block_indices, sel, K_I32, S_IDX_N},
        {&a->saved.o_cmp, when(&a->g_cmp, sv), K_FLOAT, S_O},
        {&a->saved.o_slc, when(&a->g_slc, sv), K_FLOAT, S_O},
        {&a->saved.o_swa, when(&a->g_swa, sv), K_FLOAT, S_O},
        {&a->saved.lse_cmp, when(&a->g_cmp, sv), K_F32, S_ROW},
        {&a->saved.lse_slc, when(&a->g_slc, sv), K_F32, S_ROW},
        {&a->saved.lse_swa, when(&a->g_swa, sv), K_F32, S_ROW},
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
    nsa_status st = forward_scalars(a);
    if (st != NSA_STATUS_SUCCESS) return st;
    return finish_forward(check_tensors(s, n, a->q.dtype, &a->varlen, &a->config, a->config.scale, p), a, p);
}

nsa_status nsa_validate_backward(const nsa_backward_args *a, nsa_problem *p)
{
    const nsa_forward_args *f = &a->fwd;
    const tspec g[] = {
        {&a->dk_slc, when(&f->k_slc, R_OUT), K_REF, S_K},
        {&a->dv_slc, when(&f->v_slc, R_OUT), K_REF, S_V},
        {&a->dk_swa, when(&f->k_swa, R_OUT), K_REF, S_K},
        {&a->dv_swa, when(&f->v_swa, R_OUT), K_REF, S_V},
        {&a->dk_cmp, when(&f->k_cmp, R_OUT), K_REF, S_KC},
        {&a->dv_cmp, when(&f->v_cmp, R_OUT), K_REF, S_VC},
        {&a->dg_cmp, when(&f->g_cmp, R_OUT), K_REF, S_ROW},
        {&a->dg_slc, when(&f->g_slc, R_OUT), K_REF, S_ROW},
        {&a->dg_swa, when(&f->g_swa, R_OUT), K_REF, S_ROW},
    };
    tspec s[MAX_SPECS];
    int n = qkv_grad_specs(&a->dout, &a->dq, &a->dk, &a->dv, s, forward_specs(f, 1, s));
    nsa_status st = forward_scalars(f);
    if (st != NSA_STATUS_SUCCESS) return st;
    n = append(s, n, g, COUNT(g));
    return finish_forward(check_tensors(s, n, f->q.dtype, &f->varlen, &f->config, f->config.scale, p), f, p);
}
