/* test_validation.c -- argument validation, through the public API only.
 *
 * Every op is first called on a small valid problem (dense and varlen): it must succeed and
 * write exactly its outputs, every element of them and no other byte. Then one thing at a time
 * is broken and the exact status is checked. Before each call every output buffer of the test
 * world is filled with a sentinel, and after a failed call each is compared whole: a call that
 * fails must not have written anything. The workspace query must give the same status as the
 * call. Generic breakages (rank, dtype, shape, strides, sizes, NULL data, missing outputs,
 * config, cu_seqlens, GQA, workspace, NULL context / args) run over every tensor of every op;
 * the op-specific rules follow them. */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "nsa.h"
#include "op_calls.h"

void test_validation_all(void);

/* The problem: small, every head count and head dim distinct, T - l even so that T - 1 changes
 * Nc, and l' < T so that selection has a choice. Varlen packs lengths 5, 0 and 15. */
enum { B_ = 2, T_ = 20, HQ_ = 6, H_ = 3, DK_ = 8, DV_ = 5, N_ = 4, NB_ = 5 };
enum { NC_ = 9 /* Nc(20) */, NC_PACKED = 7 /* Nc(5) + Nc(0) + Nc(15) = 1 + 0 + 6 */ };
static const int32_t CU_OK[] = {0, 5, 5, 20};

static nsa_config test_config(void)
{
    nsa_config c = nsa_config_default();
    c.cmp_len = 4;
    c.cmp_stride = 2;
    c.slc_block = 4;
    c.slc_topk = N_;
    c.n_init = 1;
    c.n_local = 1;
    c.window = 6;
    return c;
}

/* ---- the world: every buffer any op uses, inputs random, outputs sentinel-filled ------ */
enum { SENTINEL_BYTE = 0xA5 };
static const uint32_t SENTINEL_WORD = 0xA5A5A5A5u; /* no output value is ever this float/int */

enum tag { TAG_NONE, TAG_HQ, TAG_NC }; /* the dim a mode may narrow: HQ (dim 2) or Nc (dim 1) */

typedef struct named {
    nsa_tensor t; /* contiguous view of the whole buffer */
    int tag;
} named;

typedef struct buffer {
    void *data;
    size_t bytes;
    int out;
} buffer;

enum { MAX_BUFFERS = 64 };
static buffer g_buf[MAX_BUFFERS];
static int g_nbuf;
static test_rng g_rng = {20251122u};

static struct world {
    named q, k, v, k2, v2, k3, v3, kc, vc, g[3], oi[3], li[3], bi, bc, dout;              /* inputs */
    named o, lse, xc, dx, dq, dk, dv, dk2, dv2, dk3, dv3, dkc, dvc, dg[3], dos[3], bio, bco, /* outputs */
        so[3], sl[3], sbi, biw;
    named sinks, qseg, kseg, bias, mask, dsinks, dbias; /* the attention op's options (nsa.h section 5) */
} W;

static named make_named(int out, nsa_dtype dt, int tag, int rank, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    const int64_t shape[4] = {d0, d1, d2, d3};
    int64_t count = d0 * d1 * d2 * (rank == 4 ? d3 : 1), i;
    buffer *b = &g_buf[g_nbuf++];
    named n;

    b->bytes = (size_t)count * 4; /* F32 or I32 only */
    b->data = malloc(b->bytes);
    b->out = out;
    for (i = 0; i < count && !out; i++) {
        if (dt == NSA_DTYPE_F32) {
            ((float *)b->data)[i] = (float)(0.5 * rng_normal(&g_rng));
        } else if (rank == 4) { /* block_indices: in range or -1 */
            ((int32_t *)b->data)[i] = (int32_t)rng_int(&g_rng, -1, NB_ - 1);
        } else { /* block_counts */
            ((int32_t *)b->data)[i] = (int32_t)rng_int(&g_rng, 0, N_);
        }
    }
    n.t = nsa_tensor_make(b->data, dt, rank, shape);
    n.tag = tag;
    return n;
}

#define IN4(tag, a, b, c, d) make_named(0, NSA_DTYPE_F32, tag, 4, a, b, c, d)
#define OUT4(tag, a, b, c, d) make_named(1, NSA_DTYPE_F32, tag, 4, a, b, c, d)

static void world_create(void)
{
    const nsa_dtype F = NSA_DTYPE_F32, I = NSA_DTYPE_I32;
    int x;
    W.q = IN4(TAG_HQ, B_, T_, HQ_, DK_);
    W.k = IN4(TAG_NONE, B_, T_, H_, DK_);
    W.v = IN4(TAG_NONE, B_, T_, H_, DV_);
    W.k2 = IN4(TAG_NONE, B_, T_, H_, DK_);
    W.v2 = IN4(TAG_NONE, B_, T_, H_, DV_);
    W.k3 = IN4(TAG_NONE, B_, T_, H_, DK_);
    W.v3 = IN4(TAG_NONE, B_, T_, H_, DV_);
    W.kc = IN4(TAG_NC, B_, NC_, H_, DK_);
    W.vc = IN4(TAG_NC, B_, NC_, H_, DV_);
    for (x = 0; x < 3; x++) {
        W.g[x] = make_named(0, F, TAG_HQ, 3, B_, T_, HQ_, 0);
        W.oi[x] = IN4(TAG_HQ, B_, T_, HQ_, DV_);
        W.li[x] = make_named(0, F, TAG_HQ, 3, B_, T_, HQ_, 0);
    }
    W.bi = make_named(0, I, TAG_NONE, 4, B_, T_, H_, N_);
    W.bc = make_named(0, I, TAG_NONE, 3, B_, T_, H_, 0);
    W.dout = IN4(TAG_HQ, B_, T_, HQ_, DV_);

    W.o = OUT4(TAG_HQ, B_, T_, HQ_, DV_);
    W.lse = make_named(1, F, TAG_HQ, 3, B_, T_, HQ_, 0);
    W.xc = OUT4(TAG_NC, B_, NC_, H_, DK_);
    W.dx = OUT4(TAG_NONE, B_, T_, H_, DK_);
    W.dq = OUT4(TAG_HQ, B_, T_, HQ_, DK_);
    W.dk = OUT4(TAG_NONE, B_, T_, H_, DK_);
    W.dv = OUT4(TAG_NONE, B_, T_, H_, DV_);
    W.dk2 = OUT4(TAG_NONE, B_, T_, H_, DK_);
    W.dv2 = OUT4(TAG_NONE, B_, T_, H_, DV_);
    W.dk3 = OUT4(TAG_NONE, B_, T_, H_, DK_);
    W.dv3 = OUT4(TAG_NONE, B_, T_, H_, DV_);
    W.dkc = OUT4(TAG_NC, B_, NC_, H_, DK_);
    W.dvc = OUT4(TAG_NC, B_, NC_, H_, DV_);
    for (x = 0; x < 3; x++) {
        W.dg[x] = make_named(1, F, TAG_HQ, 3, B_, T_, HQ_, 0);
        W.dos[x] = OUT4(TAG_HQ, B_, T_, HQ_, DV_);
        W.so[x] = OUT4(TAG_HQ, B_, T_, HQ_, DV_);
        W.sl[x] = make_named(1, F, TAG_HQ, 3, B_, T_, HQ_, 0);
    }
    W.bio = make_named(1, I, TAG_NONE, 4, B_, T_, H_, N_);
    W.bco = make_named(1, I, TAG_NONE, 3, B_, T_, H_, 0);
    W.sbi = make_named(1, I, TAG_NONE, 4, B_, T_, H_, N_);
    W.biw = make_named(1, I, TAG_NONE, 4, B_, T_, H_, N_ + 1); /* one wider than n */
    /* the attention options: bias broadcast over the batch, mask over batch and heads */
    W.sinks = make_named(0, F, TAG_NONE, 1, HQ_, 1, 1, 0);
    W.qseg = make_named(0, I, TAG_NONE, 2, B_, T_, 1, 0);
    W.kseg = make_named(0, I, TAG_NONE, 2, B_, T_, 1, 0);
    W.bias = make_named(0, F, TAG_NONE, 4, 1, HQ_, T_, T_);
    W.mask = make_named(0, I, TAG_NONE, 4, 1, 1, T_, T_); /* random bytes, viewed as U8 */
    W.mask.t.dtype = NSA_DTYPE_U8;
    W.dsinks = make_named(1, F, TAG_NONE, 1, HQ_, 1, 1, 0);
    W.dbias = make_named(1, F, TAG_NONE, 4, 1, HQ_, T_, T_);
}

static void world_destroy(void)
{
    while (g_nbuf > 0) free(g_buf[--g_nbuf].data);
}

static void fill_sentinels(void)
{
    int i;
    for (i = 0; i < g_nbuf; i++)
        if (g_buf[i].out) memset(g_buf[i].data, SENTINEL_BYTE, g_buf[i].bytes);
}

/* Whole buffers, every byte: a check on a prefix would miss a stray write. */
static int sentinels_intact(void)
{
    int i;
    size_t j;
    for (i = 0; i < g_nbuf; i++) {
        const unsigned char *p = (const unsigned char *)g_buf[i].data;
        if (!g_buf[i].out) continue;
        for (j = 0; j < g_buf[i].bytes; j++)
            if (p[j] != SENTINEL_BYTE) return 0;
    }
    return 1;
}

/* ---- modes: how the valid problem is viewed (dense / packed, narrowed dims, config) ---- */
static struct mode {
    int packed;            /* varlen views: B = 1 and NC_PACKED compressed rows */
    const int32_t *cu;     /* varlen.cu_seqlens of every op that has one */
    int64_t num_seqs;
    int64_t hq;            /* >= 0: every HQ dim narrowed to this (a valid sub-view); -1 off */
    int64_t nc;            /* > 0: compressed row count of the views instead of the right one */
    nsa_config cfg;
} M;

static void mode_dense(void)
{
    memset(&M, 0, sizeof M);
    M.hq = -1;
    M.cfg = test_config();
}

static void mode_packed(void)
{
    mode_dense();
    M.packed = 1;
    M.cu = CU_OK;
    M.num_seqs = 3;
}

static nsa_tensor view(const named *n)
{
    nsa_tensor t = n->t;
    if (M.packed && t.rank >= 2) t.shape[0] = 1; /* dim 0 of rank-1 sinks is HQ, not B */
    if (n->tag == TAG_NC) t.shape[1] = M.nc > 0 ? M.nc : M.packed ? NC_PACKED : NC_;
    if (n->tag == TAG_HQ && M.hq >= 0) t.shape[2] = M.hq;
    return t;
}

static nsa_varlen mode_varlen(void)
{
    nsa_varlen v;
    v.cu_seqlens = M.cu;
    v.num_seqs = M.num_seqs;
    return v;
}

/* ---- ops: one valid call per op, and the list of the tensors it passes ---------------- */
typedef union any_args {
    nsa_compress_args compress;
    nsa_compress_bwd_args compress_bwd;
    nsa_cmp_attn_args cmp_attn;
    nsa_cmp_attn_bwd_args cmp_attn_bwd;
    nsa_select_args select;
    nsa_slc_attn_args slc_attn;
    nsa_slc_attn_bwd_args slc_attn_bwd;
    nsa_attention_args attention;
    nsa_attention_bwd_args attention_bwd;
    nsa_gate_args gate;
    nsa_gate_bwd_args gate_bwd;
    nsa_forward_args forward;
    nsa_backward_args backward;
} any_args;

enum use_kind {
    USE_IN,      /* required input */
    USE_OPT,     /* optional input given, or a tensor of which only shape and dtype are read */
    USE_OUT,     /* required output */
    USE_OUT_OPT  /* optional output given */
};

typedef struct use {
    nsa_tensor *t; /* the field inside the args */
    int kind;
    const char *name;
} use;

typedef struct tlist {
    use u[40];
    int n;
} tlist;

static void put(tlist *l, nsa_tensor *field, const named *src, int kind, const char *name)
{
    *field = view(src);
    l->u[l->n].t = field;
    l->u[l->n].kind = kind;
    l->u[l->n].name = name;
    l->n++;
}
#define PUT(l, field, src, kind) put((l), &(field), &(src), (kind), #field)

/* Forward o and lse are outputs; in a backward they are the forward's results, inputs. */
static void put_o_lse(tlist *l, nsa_tensor *o, nsa_tensor *lse, int bwd)
{
    put(l, o, bwd ? &W.oi[0] : &W.o, bwd ? USE_IN : USE_OUT, bwd ? "fwd.o" : "o");
    put(l, lse, bwd ? &W.li[0] : &W.lse, bwd ? USE_IN : USE_OUT, bwd ? "fwd.lse" : "lse");
}

static void put_qkv_grads(tlist *l, nsa_tensor *dout, nsa_tensor *dq, nsa_tensor *dk, nsa_tensor *dv)
{
    put(l, dout, &W.dout, USE_IN, "dout");
    put(l, dq, &W.dq, USE_OUT, "dq");
    put(l, dk, &W.dk, USE_OUT, "dk");
    put(l, dv, &W.dv, USE_OUT, "dv");
}

static void fill_compress(nsa_compress_args *a, tlist *l, int bwd)
{
    PUT(l, a->x, W.k, bwd ? USE_OPT : USE_IN);
    if (!bwd) PUT(l, a->x_cmp, W.xc, USE_OUT); /* the backward never reads x_cmp */
    a->varlen = mode_varlen();
    a->config = M.cfg;
}

static void mk_compress(any_args *a, tlist *l) { fill_compress(&a->compress, l, 0); }

static void mk_compress_bwd(any_args *a, tlist *l)
{
    fill_compress(&a->compress_bwd.fwd, l, 1);
    PUT(l, a->compress_bwd.dx_cmp, W.kc, USE_IN);
    PUT(l, a->compress_bwd.dx, W.dx, USE_OUT);
}

static void fill_cmp_attn(nsa_cmp_attn_args *a, tlist *l, int bwd)
{
    PUT(l, a->q, W.q, USE_IN);
    PUT(l, a->k_cmp, W.kc, USE_IN);
    PUT(l, a->v_cmp, W.vc, USE_IN);
    put_o_lse(l, &a->o, &a->lse, bwd);
    a->varlen = mode_varlen();
    a->config = M.cfg;
}

static void mk_cmp_attn(any_args *a, tlist *l) { fill_cmp_attn(&a->cmp_attn, l, 0); }

static void mk_cmp_attn_bwd(any_args *a, tlist *l)
{
    nsa_cmp_attn_bwd_args *b = &a->cmp_attn_bwd;
    fill_cmp_attn(&b->fwd, l, 1);
    PUT(l, b->dout, W.dout, USE_IN);
    PUT(l, b->dq, W.dq, USE_OUT);
    PUT(l, b->dk_cmp, W.dkc, USE_OUT);
    PUT(l, b->dv_cmp, W.dvc, USE_OUT);
}

static void mk_select(any_args *a, tlist *l)
{
    nsa_select_args *s = &a->select;
    PUT(l, s->q, W.q, USE_IN);
    PUT(l, s->k_cmp, W.kc, USE_IN);
    PUT(l, s->lse_cmp, W.li[0], USE_OPT);
    PUT(l, s->block_indices, W.bio, USE_OUT);
    PUT(l, s->block_counts, W.bco, USE_OUT_OPT);
    s->varlen = mode_varlen();
    s->config = M.cfg;
}

static void fill_slc_attn(nsa_slc_attn_args *a, tlist *l, int bwd)
{
    PUT(l, a->q, W.q, USE_IN);
    PUT(l, a->k, W.k, USE_IN);
    PUT(l, a->v, W.v, USE_IN);
    PUT(l, a->block_indices, W.bi, USE_IN);
    PUT(l, a->block_counts, W.bc, USE_OPT);
    put_o_lse(l, &a->o, &a->lse, bwd);
    a->varlen = mode_varlen();
    a->config = M.cfg;
}

static void mk_slc_attn(any_args *a, tlist *l) { fill_slc_attn(&a->slc_attn, l, 0); }

static void mk_slc_attn_bwd(any_args *a, tlist *l)
{
    nsa_slc_attn_bwd_args *b = &a->slc_attn_bwd;
    fill_slc_attn(&b->fwd, l, 1);
    put_qkv_grads(l, &b->dout, &b->dq, &b->dk, &b->dv);
}

static void fill_attention(nsa_attention_args *a, tlist *l, int bwd)
{
    PUT(l, a->q, W.q, USE_IN);
    PUT(l, a->k, W.k, USE_IN);
    PUT(l, a->v, W.v, USE_IN);
    put_o_lse(l, &a->o, &a->lse, bwd);
    a->varlen = mode_varlen();
    a->causal = 1;
    a->window_left = 5;
    a->window_right = -1;
}

static void mk_attention(any_args *a, tlist *l) { fill_attention(&a->attention, l, 0); }

static void mk_attention_bwd(any_args *a, tlist *l)
{
    nsa_attention_bwd_args *b = &a->attention_bwd;
    fill_attention(&b->fwd, l, 1);
    put_qkv_grads(l, &b->dout, &b->dq, &b->dk, &b->dv);
}

/* The attention op with every option of nsa.h section 5 (the CPU's general path). */
static void fill_attention_ext(nsa_attention_args *a, tlist *l, int bwd)
{
    fill_attention(a, l, bwd);
    PUT(l, a->sinks, W.sinks, USE_OPT);
    PUT(l, a->q_segment_ids, W.qseg, USE_OPT);
    PUT(l, a->k_segment_ids, W.kseg, USE_OPT);
    PUT(l, a->bias, W.bias, USE_OPT);
    PUT(l, a->mask, W.mask, USE_OPT);
    a->softcap = 1.5f;
    a->dropout_p = 0.1f;
    a->dropout_seed = 7;
}

static void mk_attention_ext(any_args *a, tlist *l) { fill_attention_ext(&a->attention, l, 0); }

static void mk_attention_ext_bwd(any_args *a, tlist *l)
{
    nsa_attention_bwd_args *b = &a->attention_bwd;
    fill_attention_ext(&b->fwd, l, 1);
    put_qkv_grads(l, &b->dout, &b->dq, &b->dk, &b->dv);
    PUT(l, b->dsinks, W.dsinks, USE_OUT);
    PUT(l, b->dbias, W.dbias, USE_OUT_OPT);
}

static void fill_gate(nsa_gate_args *a, tlist *l, int bwd)
{
    PUT(l, a->o_cmp, W.oi[0], USE_IN);
    PUT(l, a->o_slc, W.oi[1], USE_IN);
    PUT(l, a->o_swa, W.oi[2], USE_IN);
    PUT(l, a->g_cmp, W.g[0], USE_OPT);
    PUT(l, a->g_slc, W.g[1], USE_OPT);
    PUT(l, a->g_swa, W.g[2], USE_OPT);
    if (bwd) PUT(l, a->o, W.oi[0], USE_OPT); /* shape and dtype only */
    else PUT(l, a->o, W.o, USE_OUT);
}

static void mk_gate(any_args *a, tlist *l) { fill_gate(&a->gate, l, 0); }

static void mk_gate_bwd(any_args *a, tlist *l)
{
    nsa_gate_bwd_args *b = &a->gate_bwd;
    fill_gate(&b->fwd, l, 1);
    PUT(l, b->dout, W.dout, USE_IN);
    PUT(l, b->do_cmp, W.dos[0], USE_OUT);
    PUT(l, b->do_slc, W.dos[1], USE_OUT);
    PUT(l, b->do_swa, W.dos[2], USE_OUT);
    PUT(l, b->dg_cmp, W.dg[0], USE_OUT);
    PUT(l, b->dg_slc, W.dg[1], USE_OUT);
    PUT(l, b->dg_swa, W.dg[2], USE_OUT);
}

/* All three branches, a separate K/V for the selection, the selection computed here. */
static void fill_forward(nsa_forward_args *a, tlist *l, int bwd)
{
    const int sv = bwd ? USE_IN : USE_OUT;
    int x;
    PUT(l, a->q, W.q, USE_IN);
    PUT(l, a->k, W.k, USE_IN);
    PUT(l, a->v, W.v, USE_IN);
    PUT(l, a->k_slc, W.k2, USE_OPT);
    PUT(l, a->v_slc, W.v2, USE_OPT);
    PUT(l, a->g_cmp, W.g[0], USE_OPT);
    PUT(l, a->g_slc, W.g[1], USE_OPT);
    PUT(l, a->g_swa, W.g[2], USE_OPT);
    if (!bwd) PUT(l, a->o, W.o, USE_OUT); /* the backward ignores fwd.o */
    put(l, &a->saved.block_indices, bwd ? &W.bi : &W.sbi, sv, "saved.block_indices");
    for (x = 0; x < 3; x++) {
        nsa_tensor *o = x == 0 ? &a->saved.o_cmp : x == 1 ? &a->saved.o_slc : &a->saved.o_swa;
        nsa_tensor *lse = x == 0 ? &a->saved.lse_cmp : x == 1 ? &a->saved.lse_slc : &a->saved.lse_swa;
        static const char *const O_NAME[] = {"saved.o_cmp", "saved.o_slc", "saved.o_swa"};
        static const char *const LSE_NAME[] = {"saved.lse_cmp", "saved.lse_slc", "saved.lse_swa"};
        put(l, o, bwd ? &W.oi[x] : &W.so[x], sv, O_NAME[x]);
        put(l, lse, bwd ? &W.li[x] : &W.sl[x], sv, LSE_NAME[x]);
    }
    a->varlen = mode_varlen();
    a->config = M.cfg;
}

static void mk_forward(any_args *a, tlist *l) { fill_forward(&a->forward, l, 0); }

static void mk_backward(any_args *a, tlist *l)
{
    nsa_backward_args *b = &a->backward;
    fill_forward(&b->fwd, l, 1);
    put_qkv_grads(l, &b->dout, &b->dq, &b->dk, &b->dv);
    PUT(l, b->dk_slc, W.dk2, USE_OUT);
    PUT(l, b->dv_slc, W.dv2, USE_OUT);
    PUT(l, b->dg_cmp, W.dg[0], USE_OUT);
    PUT(l, b->dg_slc, W.dg[1], USE_OUT);
    PUT(l, b->dg_swa, W.dg[2], USE_OUT);
}


enum op_flags {
    F_CFG = 1,    /* carries an nsa_config */
    F_VARLEN = 2, /* carries an nsa_varlen */
    F_GQA = 4,    /* has both HQ and H tensors */
    F_HQ = 8,     /* has HQ tensors */
    F_NC = 16     /* its valid call passes compressed-row tensors */
};

typedef struct op_case {
    const char *name;
    void (*make)(any_args *a, tlist *l);
    op_ws_fn ws;
    op_run_fn run;
    int flags;
} op_case;

#define OP(op, flags) {#op, mk_##op, op_ws_##op, op_run_##op, flags}
enum { OP_COMPRESS, OP_COMPRESS_BWD, OP_CMP_ATTN, OP_CMP_ATTN_BWD, OP_SELECT, OP_SLC_ATTN, OP_SLC_ATTN_BWD,
       OP_ATTENTION, OP_ATTENTION_BWD, OP_GATE, OP_GATE_BWD, OP_FORWARD, OP_BACKWARD, OP_ATTENTION_EXT,
       OP_ATTENTION_EXT_BWD, OP_COUNT };
static const op_case OPS[OP_COUNT] = {
    OP(compress, F_CFG | F_VARLEN | F_NC),
    OP(compress_bwd, F_CFG | F_VARLEN | F_NC),
    OP(cmp_attn, F_CFG | F_VARLEN | F_GQA | F_HQ | F_NC),
    OP(cmp_attn_bwd, F_CFG | F_VARLEN | F_GQA | F_HQ | F_NC),
    OP(select, F_CFG | F_VARLEN | F_GQA | F_HQ | F_NC),
    OP(slc_attn, F_CFG | F_VARLEN | F_GQA | F_HQ),
    OP(slc_attn_bwd, F_CFG | F_VARLEN | F_GQA | F_HQ),
    OP(attention, F_VARLEN | F_GQA | F_HQ),
    OP(attention_bwd, F_VARLEN | F_GQA | F_HQ),
    OP(gate, F_HQ),
    OP(gate_bwd, F_HQ),
    OP(forward, F_CFG | F_VARLEN | F_GQA | F_HQ),
    OP(backward, F_CFG | F_VARLEN | F_GQA | F_HQ),
    /* head counts are covered by the plain attention rows: sinks and bias carry HQ elsewhere */
    {"attention (all options)", mk_attention_ext, op_ws_attention, op_run_attention, F_VARLEN},
    {"attention_bwd (all options)", mk_attention_ext_bwd, op_ws_attention_bwd, op_run_attention_bwd, F_VARLEN},
};

static void build(const op_case *op, any_args *a, tlist *l)
{
    memset(a, 0, sizeof *a);
    memset(l, 0, sizeof *l);
    op->make(a, l);
}

/* ---- calls and their checks ----------------------------------------------------------- */
static nsa_context *g_ctx;
static void *g_ws;
static size_t g_ws_bytes;
static long g_cases;      /* validation cases run (each: status, query status, sentinels) */
static int g_ws_ops;      /* ops whose valid call needed workspace */

static void ensure_ws(size_t bytes)
{
    if (bytes <= g_ws_bytes) return;
    free(g_ws);
    g_ws = malloc(bytes);
    g_ws_bytes = g_ws ? bytes : 0;
}

/* A call that must fail with `want` and write nothing; its workspace query must agree. */
/* A call that must fail with `want`, its workspace query too, each leaving a detail that names
 * `arg` (the field at fault; a dimension symbol where the fault is a head count). */
static void expect_at(const op_case *op, const any_args *a, nsa_status want, const char *arg, const char *what,
                      int line)
{
    char desc[192];
    size_t bytes = 0;
    nsa_status got, query;

    snprintf(desc, sizeof desc, "nsa_%s: %s", op->name, what);
    fill_sentinels();
    query = op->ws(g_ctx, a, &bytes);
    harness_check_status(query, want, __FILE__, line, "(its workspace query)");
    if (query == want) harness_check_detail(arg, __FILE__, line);
    got = op->run(g_ctx, a, g_ws, g_ws_bytes);
    harness_check_status(got, want, __FILE__, line, desc);
    if (got == want) harness_check_detail(arg, __FILE__, line);
    harness_record(sentinels_intact(), __FILE__, line, desc, "a failed call wrote to an output");
    g_cases++;
}
#define EXPECT(op, a, want, arg, what) expect_at((op), (a), (want), (arg), (what), __LINE__)

/* Marks the 4-byte words of buffer b that the view t covers. */
static void mark_view(const nsa_tensor *t, const buffer *b, unsigned char *mask)
{
    int64_t shape[4] = {1, 1, 1, 1}, stride[4] = {0, 0, 0, 0}, i0, i1, i2, i3, base;
    int d;
    /* a view of another buffer, or one the call must ignore (garbage rank): nothing owed */
    if (t->rank < 1 || t->rank > NSA_MAX_RANK || !t->data || (char *)t->data < (char *)b->data ||
        (char *)t->data >= (char *)b->data + b->bytes)
        return;
    for (d = 0; d < t->rank; d++) {
        shape[d] = t->shape[d];
        stride[d] = t->stride[d];
    }
    base = ((char *)t->data - (char *)b->data) / 4;
    for (i0 = 0; i0 < shape[0]; i0++)
        for (i1 = 0; i1 < shape[1]; i1++)
            for (i2 = 0; i2 < shape[2]; i2++)
                for (i3 = 0; i3 < shape[3]; i3++)
                    mask[base + i0 * stride[0] + i1 * stride[1] + i2 * stride[2] + i3 * stride[3]] = 1;
}

/* After a successful call: every element of each output view differs from the sentinel (all
 * test outputs are 4-byte) and every other word of every output buffer is still sentinel. */
static int writes_exact(const tlist *l)
{
    int ok = 1, i, j;
    for (i = 0; i < g_nbuf; i++) {
        const buffer *b = &g_buf[i];
        size_t w, words = b->bytes / 4;
        unsigned char *mask;
        if (!b->out) continue;
        mask = (unsigned char *)calloc(words ? words : 1, 1);
        for (j = 0; j < l->n; j++)
            if (l->u[j].kind == USE_OUT || l->u[j].kind == USE_OUT_OPT) mark_view(l->u[j].t, b, mask);
        for (w = 0; w < words; w++) {
            uint32_t v;
            memcpy(&v, (const char *)b->data + 4 * w, 4);
            if (mask[w] ? v == SENTINEL_WORD : v != SENTINEL_WORD) ok = 0;
        }
        free(mask);
    }
    return ok;
}

/* A call that must succeed, with exactly `bytes` of workspace, writing exactly l's outputs. */
static void expect_ok_at(const op_case *op, const any_args *a, const tlist *l, const char *what, int line)
{
    char desc[192];
    size_t bytes = 0;
    nsa_status st;

    snprintf(desc, sizeof desc, "nsa_%s: %s", op->name, what);
    fill_sentinels();
    st = op->ws(g_ctx, a, &bytes);
    harness_check_status(st, NSA_STATUS_SUCCESS, __FILE__, line, desc);
    if (st != NSA_STATUS_SUCCESS) return;
    ensure_ws(bytes);
    st = op->run(g_ctx, a, bytes ? g_ws : NULL, bytes);
    harness_check_status(st, NSA_STATUS_SUCCESS, __FILE__, line, desc);
    harness_record(st != NSA_STATUS_SUCCESS || writes_exact(l), __FILE__, line, desc,
                   "outputs not fully written, or a byte outside them written");
}
#define EXPECT_OK(op, a, l, what) expect_ok_at((op), (a), (l), (what), __LINE__)

/* ---- generic breakages, over every tensor of every op ----------------------------------- */
enum mutation {
    MUT_RANK_LESS, MUT_RANK_MORE, MUT_DTYPE_CLASS, MUT_DTYPE_BOGUS, MUT_SHAPE_NEG, MUT_STRIDE_LAST,
    MUT_STRIDE_NEG, MUT_COUNT_OVF, MUT_OFFSET_OVF, MUT_BYTES_OVF, MUT_NULL_DATA, MUT_ZEROED,
    MUT_SHRINK /* + dim */
};
static const char *const MUT_NAMES[] = {
    "rank - 1", "rank 5", "dtype of the wrong class", "dtype 42", "shape[1] = -1", "last stride 2",
    "stride[0] negative", "element count overflows", "largest offset overflows", "byte size overflows",
    "data NULL", "zero-initialised", "shape[0] - 1", "shape[1] - 1", "shape[2] - 1", "shape[3] - 1",
};
enum { MUT_COUNT = MUT_SHRINK + NSA_MAX_RANK };

/* Breaks *t one way. @return the status that must come back, or -1 where it does not apply. */
static int mutate(nsa_tensor *t, int kind, int m)
{
    const int required = kind == USE_IN || kind == USE_OUT;
    switch (m) {
    case MUT_RANK_LESS: t->rank -= 1; return NSA_STATUS_BAD_RANK;
    case MUT_RANK_MORE: t->rank = NSA_MAX_RANK + 1; return NSA_STATUS_BAD_RANK;
    case MUT_DTYPE_CLASS: t->dtype = t->dtype == NSA_DTYPE_I32 ? NSA_DTYPE_F32 : NSA_DTYPE_I32; return NSA_STATUS_BAD_DTYPE;
    case MUT_DTYPE_BOGUS: t->dtype = (nsa_dtype)42; return NSA_STATUS_BAD_DTYPE;
    case MUT_SHAPE_NEG:
        if (t->rank < 2) return -1; /* sinks: no dim 1 */
        t->shape[1] = -1;
        return NSA_STATUS_BAD_SHAPE;
    case MUT_STRIDE_LAST: t->stride[t->rank - 1] = 2; return NSA_STATUS_BAD_STRIDE;
    case MUT_STRIDE_NEG: t->stride[0] = -t->stride[0]; return NSA_STATUS_BAD_STRIDE;
    case MUT_COUNT_OVF: t->shape[0] = INT64_MAX / 2; return NSA_STATUS_SIZE_OVERFLOW;
    case MUT_OFFSET_OVF: /* x (shape[1] - 1) >= 8; dim 1 must not be the last nor of size 1 */
        if (t->rank < 3 || t->shape[1] < 2) return -1;
        t->stride[1] = INT64_MAX / 4;
        return NSA_STATUS_SIZE_OVERFLOW;
    case MUT_BYTES_OVF: /* offsets fit, bytes don't; dim 0 must not be the last nor of size 1 */
        if (t->rank < 2 || t->shape[0] < 2) return -1;
        t->stride[0] = INT64_MAX / 2;
        return NSA_STATUS_SIZE_OVERFLOW;
    case MUT_NULL_DATA:
    case MUT_ZEROED:
        if (!required) return -1;
        if (m == MUT_NULL_DATA) t->data = NULL;
        else memset(t, 0, sizeof *t);
        return kind == USE_IN ? NSA_STATUS_NULL_POINTER : NSA_STATUS_MISSING_OUTPUT;
    default: {
        /* Every dim is shared with another tensor or fixes Nc, except a block_indices width. */
        const int d = m - MUT_SHRINK;
        if (d >= t->rank || (d == 3 && t->dtype == NSA_DTYPE_I32)) return -1;
        t->shape[d] -= 1;
        return NSA_STATUS_BAD_SHAPE;
    }
    }
}

/* The field a tlist name ends with ("a->saved.o_cmp" -> "o_cmp"): the detail names it, as
 * "o_cmp", "saved.o_cmp" or "fwd.saved.o_cmp". */
static const char *field_of(const char *name)
{
    const char *dot = strrchr(name, '.'), *arrow = strrchr(name, '>');
    const char *last = dot > arrow ? dot : arrow;
    return last ? last + 1 : name;
}

static void tensor_cases(const op_case *op)
{
    any_args a;
    tlist l;
    char what[160];
    int i, m, n;

    build(op, &a, &l);
    n = l.n;
    for (i = 0; i < n; i++)
        for (m = 0; m < MUT_COUNT; m++) {
            int want;
            build(op, &a, &l);
            want = mutate(l.u[i].t, l.u[i].kind, m);
            if (want < 0) continue;
            snprintf(what, sizeof what, "%s: %s", l.u[i].name, MUT_NAMES[m]);
            EXPECT(op, &a, (nsa_status)want, field_of(l.u[i].name), what);
        }
}

static void null_cases(const op_case *op)
{
    any_args a;
    tlist l;
    size_t bytes = 0;

    build(op, &a, &l);
    fill_sentinels();
    CHECK_STATUS(op->run(NULL, &a, g_ws, g_ws_bytes), NSA_STATUS_NULL_POINTER);
    CHECK_DETAIL("ctx");
    CHECK_STATUS(op->ws(NULL, &a, &bytes), NSA_STATUS_NULL_POINTER);
    CHECK_DETAIL("ctx");
    CHECK_STATUS(op->run(g_ctx, NULL, g_ws, g_ws_bytes), NSA_STATUS_NULL_POINTER);
    CHECK_DETAIL("args");
    CHECK_STATUS(op->ws(g_ctx, NULL, &bytes), NSA_STATUS_NULL_POINTER);
    CHECK_DETAIL("args");
    CHECK_STATUS(op->ws(g_ctx, &a, NULL), NSA_STATUS_NULL_POINTER);
    CHECK_DETAIL("bytes");
    CHECK(sentinels_intact());
    g_cases += 5;
}

static void workspace_case(const op_case *op)
{
    any_args a;
    tlist l;
    size_t need = 0;

    build(op, &a, &l);
    CHECK_STATUS(op->ws(g_ctx, &a, &need), NSA_STATUS_SUCCESS);
    if (need == 0) return;
    g_ws_ops++;
    ensure_ws(need);
    fill_sentinels();
    CHECK_STATUS(op->run(g_ctx, &a, g_ws, need - 1), NSA_STATUS_WORKSPACE_TOO_SMALL);
    CHECK_DETAIL("workspace_bytes");
    CHECK(sentinels_intact());
    g_cases++;
}

/* Config rows: each breaks one rule (or two, to pin down which one is reported first). */
typedef struct bad_config {
    const char *what;
    int64_t l, d, lp, n, n_init, n_local, w;
    float scale;
    nsa_status want;
    const char *arg; /* the field the detail must name */
    float swa_scale;  /* the window branch's scale (0 = scale) */
} bad_config;

#define B31 ((int64_t)INT32_MAX + 1)
#define B32 ((int64_t)1 << 32)
static const bad_config BAD_CONFIGS[] = {
    {"d = 0", 4, 0, 4, N_, 1, 1, 6, 0.0f, NSA_STATUS_BAD_CMP_STRIDE, "config.cmp_stride", 0.0f},
    {"d < 0", 4, -2, 4, N_, 1, 1, 6, 0.0f, NSA_STATUS_BAD_CMP_STRIDE, "config.cmp_stride", 0.0f},
    {"l = 0", 0, 2, 4, N_, 1, 1, 6, 0.0f, NSA_STATUS_BAD_CMP_LEN, "config.cmp_len", 0.0f},
    {"l % d != 0", 5, 2, 8, N_, 1, 1, 6, 0.0f, NSA_STATUS_BAD_CMP_STRIDE, "config.cmp_stride", 0.0f},
    {"l' % d != 0", 4, 2, 5, N_, 1, 1, 6, 0.0f, NSA_STATUS_BAD_SLC_BLOCK, "config.slc_block", 0.0f},
    {"l > l'", 8, 2, 4, N_, 1, 1, 6, 0.0f, NSA_STATUS_BAD_CMP_LEN, "config.cmp_len", 0.0f},
    {"l' = 0 (l > l' first)", 4, 2, 0, N_, 1, 1, 6, 0.0f, NSA_STATUS_BAD_CMP_LEN, "config.cmp_len", 0.0f},
    {"n = 0", 4, 2, 4, 0, 0, 0, 6, 0.0f, NSA_STATUS_BAD_TOPK, "config.slc_topk", 0.0f},
    {"n_init < 0", 4, 2, 4, N_, -1, 1, 6, 0.0f, NSA_STATUS_BAD_TOPK, "config.n_init", 0.0f},
    {"n_local < 0", 4, 2, 4, N_, 1, -1, 6, 0.0f, NSA_STATUS_BAD_TOPK, "config.n_local", 0.0f},
    {"n < n_init + n_local", 4, 2, 4, 3, 2, 2, 6, 0.0f, NSA_STATUS_BAD_TOPK, "config.slc_topk", 0.0f},
    {"n_init + n_local overflows", 4, 2, 4, N_, INT64_MAX, INT64_MAX, 6, 0.0f, NSA_STATUS_BAD_TOPK, "config.n_init", 0.0f},
    /* every size of the config fits int32 (block indices are int32); here the one field past it */
    {"d > INT32_MAX (l, l' too: d first)", B31, B31, B31, N_, 1, 1, 6, 0.0f, NSA_STATUS_BAD_CMP_STRIDE, "config.cmp_stride", 0.0f},
    {"l > INT32_MAX (l' too: l first)", B32, 2, B32, N_, 1, 1, 6, 0.0f, NSA_STATUS_BAD_CMP_LEN, "config.cmp_len", 0.0f},
    {"l' > INT32_MAX", 4, 2, B31, N_, 1, 1, 6, 0.0f, NSA_STATUS_BAD_SLC_BLOCK, "config.slc_block", 0.0f},
    {"l' = INT64_MAX - 1", 4, 2, INT64_MAX - 1, N_, 1, 1, 6, 0.0f, NSA_STATUS_BAD_SLC_BLOCK, "config.slc_block", 0.0f},
    {"n > INT32_MAX", 4, 2, 4, B31, 1, 1, 6, 0.0f, NSA_STATUS_BAD_TOPK, "config.slc_topk", 0.0f},
    {"n_init > INT32_MAX", 4, 2, 4, INT64_MAX, B31, 0, 6, 0.0f, NSA_STATUS_BAD_TOPK, "config.n_init", 0.0f},
    {"n_local > INT32_MAX", 4, 2, 4, INT64_MAX, 0, B31, 6, 0.0f, NSA_STATUS_BAD_TOPK, "config.n_local", 0.0f},
    {"w = 0", 4, 2, 4, N_, 1, 1, 0, 0.0f, NSA_STATUS_BAD_WINDOW, "config.window", 0.0f},
    {"w < 0", 4, 2, 4, N_, 1, 1, -5, 0.0f, NSA_STATUS_BAD_WINDOW, "config.window", 0.0f},
    {"scale NaN", 4, 2, 4, N_, 1, 1, 6, NAN, NSA_STATUS_BAD_SCALE, "config.scale", 0.0f},
    {"scale +inf", 4, 2, 4, N_, 1, 1, 6, INFINITY, NSA_STATUS_BAD_SCALE, "config.scale", 0.0f},
    {"scale -inf", 4, 2, 4, N_, 1, 1, 6, -INFINITY, NSA_STATUS_BAD_SCALE, "config.scale", 0.0f},
    {"scale < 0", 4, 2, 4, N_, 1, 1, 6, -0.5f, NSA_STATUS_BAD_SCALE, "config.scale", 0.0f},
    {"swa_scale NaN", 4, 2, 4, N_, 1, 1, 6, 0.0f, NSA_STATUS_BAD_SCALE, "config.swa_scale", NAN},
    {"swa_scale +inf", 4, 2, 4, N_, 1, 1, 6, 0.0f, NSA_STATUS_BAD_SCALE, "config.swa_scale", INFINITY},
    {"swa_scale < 0", 4, 2, 4, N_, 1, 1, 6, 0.0f, NSA_STATUS_BAD_SCALE, "config.swa_scale", -0.5f},
    {"scale < 0 before swa_scale", 4, 2, 4, N_, 1, 1, 6, -1.0f, NSA_STATUS_BAD_SCALE, "config.scale", -0.5f},
    {"d = 0 and w = 0: d first", 4, 0, 4, N_, 1, 1, 0, 0.0f, NSA_STATUS_BAD_CMP_STRIDE, "config.cmp_stride", 0.0f},
    {"n = 0 and scale NaN: n first", 4, 2, 4, 0, 1, 1, 6, NAN, NSA_STATUS_BAD_TOPK, "config.slc_topk", 0.0f},
};

static nsa_config config_of(const bad_config *r)
{
    nsa_config c = test_config();
    c.cmp_len = r->l;
    c.cmp_stride = r->d;
    c.slc_block = r->lp;
    c.slc_topk = r->n;
    c.n_init = r->n_init;
    c.n_local = r->n_local;
    c.window = r->w;
    c.scale = r->scale;
    c.swa_scale = r->swa_scale;
    return c;
}

static void config_cases(const op_case *op)
{
    any_args a;
    tlist l;
    size_t i;
    for (i = 0; i < sizeof BAD_CONFIGS / sizeof BAD_CONFIGS[0]; i++) {
        mode_dense();
        M.cfg = config_of(&BAD_CONFIGS[i]);
        build(op, &a, &l);
        /* a broken tensor too: the config is checked first */
        l.u[0].t->rank = 1;
        EXPECT(op, &a, BAD_CONFIGS[i].want, BAD_CONFIGS[i].arg, BAD_CONFIGS[i].what);
    }
    mode_dense();
}

static void varlen_cases(const op_case *op)
{
    static const int32_t cu_start[] = {1, 5, 5, 20}, cu_down[] = {0, 5, 4, 20}, cu_short[] = {0, 5, 5, 19},
                         cu_long[] = {0, 5, 5, 21};
    const struct { const int32_t *cu; int64_t n; int packed; const char *what, *arg; } rows[] = {
        {cu_start, 3, 1, "cu[0] != 0", "varlen.cu_seqlens"},
        {cu_down, 3, 1, "cu decreasing", "varlen.cu_seqlens"},
        {cu_short, 3, 1, "cu[N] < T", "varlen.cu_seqlens"},
        {cu_long, 3, 1, "cu[N] > T", "varlen.cu_seqlens"},
        {CU_OK, -1, 1, "num_seqs < 0", "varlen.num_seqs"},
        {CU_OK, 3, 0, "B != 1", "varlen.cu_seqlens"},
    };
    any_args a;
    tlist l;
    char what[96];
    size_t i;
    int j;

    for (i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        mode_packed();
        M.packed = rows[i].packed;
        M.cu = rows[i].cu;
        M.num_seqs = rows[i].n;
        build(op, &a, &l);
        EXPECT(op, &a, NSA_STATUS_BAD_CU_SEQLENS, rows[i].arg, rows[i].what);
        /* with an output missing too: cu_seqlens is checked before outputs */
        j = 0;
        while (l.u[j].kind != USE_OUT) j++; /* every op has one */
        l.u[j].t->data = NULL;
        snprintf(what, sizeof what, "%s, and %s missing", rows[i].what, l.u[j].name);
        EXPECT(op, &a, NSA_STATUS_BAD_CU_SEQLENS, rows[i].arg, what);
    }
    if (op->flags & F_NC) {
        mode_packed();
        M.nc = NC_; /* the dense count, not the packed one */
        build(op, &a, &l);
        EXPECT(op, &a, NSA_STATUS_BAD_SHAPE, "varlen.cu_seqlens", "packed compressed rows = Nc(T)");
    }
    mode_dense();
}

/* Every HQ dim narrowed at once, so that the shapes agree and the head rule itself fails. */
static void head_cases(const op_case *op)
{
    static const int32_t cu_bad[] = {1, 5, 5, 20};
    any_args a;
    tlist l;
    if (op->flags & F_GQA) {
        mode_dense();
        M.hq = 4; /* H = 3 */
        build(op, &a, &l);
        EXPECT(op, &a, NSA_STATUS_BAD_GQA, "HQ", "HQ % H != 0");
        mode_packed();
        M.hq = 4;
        M.cu = cu_bad;
        build(op, &a, &l);
        EXPECT(op, &a, NSA_STATUS_BAD_GQA, "HQ", "HQ % H != 0 before bad cu_seqlens");
    }
    if (op->flags & F_HQ) {
        mode_dense();
        M.hq = 0;
        build(op, &a, &l);
        if (op->flags & F_GQA) EXPECT(op, &a, NSA_STATUS_BAD_GQA, "HQ", "HQ = 0 with H = 3 (no heads: both 0)");
        else EXPECT_OK(op, &a, &l, "HQ = 0: no heads, nothing to write");
    }
    mode_dense();
}

/* Valid calls, dense and packed, then every generic breakage. */
static void generic_cases(const op_case *op)
{
    any_args a;
    tlist l;

    mode_dense();
    build(op, &a, &l);
    EXPECT_OK(op, &a, &l, "valid dense call");
    if (op->flags & F_VARLEN) {
        mode_packed();
        build(op, &a, &l);
        EXPECT_OK(op, &a, &l, "valid varlen call");
        mode_dense();
    }
    null_cases(op);
    workspace_case(op);
    tensor_cases(op);
    if (op->flags & F_CFG) config_cases(op);
    if (op->flags & F_VARLEN) varlen_cases(op);
    head_cases(op);
}

/* ---- op-specific rules -------------------------------------------------------------------- */
static void status_and_config_tests(void)
{
    enum { LAST = NSA_STATUS_BAD_EXPRESSION };
    const char *s[LAST + 1];
    int i, j;
    nsa_config c = nsa_config_default();
    size_t k;

    for (i = 0; i <= LAST; i++) {
        s[i] = nsa_status_string((nsa_status)i);
        CHECK(s[i] != NULL && s[i][0] != '\0');
    }
    for (i = 0; i <= LAST; i++)
        for (j = 0; j < i; j++) CHECK_MSG(strcmp(s[i], s[j]) != 0, s[i]);
    CHECK(strcmp(nsa_status_string((nsa_status)(LAST + 1)), "unknown status") == 0);
    CHECK(nsa_status_string((nsa_status)-1) != NULL);
    CHECK(strcmp(nsa_status_string((nsa_status)999), s[0]) != 0);

    CHECK(c.cmp_len == 32 && c.cmp_stride == 16 && c.slc_block == 64 && c.slc_topk == 16);
    CHECK(c.n_init == 1 && c.n_local == 2 && c.window == 512 && c.scale == 0.0f);
    CHECK_STATUS(nsa_config_validate(&c), NSA_STATUS_SUCCESS);
    CHECK_STATUS(nsa_config_validate(NULL), NSA_STATUS_NULL_POINTER);
    CHECK_DETAIL("config");
    for (k = 0; k < sizeof BAD_CONFIGS / sizeof BAD_CONFIGS[0]; k++) {
        nsa_config b = config_of(&BAD_CONFIGS[k]);
        harness_check_status(nsa_config_validate(&b), BAD_CONFIGS[k].want, __FILE__, __LINE__, BAD_CONFIGS[k].what);
        CHECK_DETAIL(BAD_CONFIGS[k].arg);
    }
    /* edges that are valid: l = d = l' (fla), no forced blocks, explicit scale, -0 */
    c.cmp_len = c.cmp_stride = c.slc_block = 64;
    CHECK_STATUS(nsa_config_validate(&c), NSA_STATUS_SUCCESS);
    c.n_init = c.n_local = 0;
    c.slc_topk = 1;
    CHECK_STATUS(nsa_config_validate(&c), NSA_STATUS_SUCCESS);
    c.scale = 0.125f;
    CHECK_STATUS(nsa_config_validate(&c), NSA_STATUS_SUCCESS);
    c.scale = -0.0f;
    CHECK_STATUS(nsa_config_validate(&c), NSA_STATUS_SUCCESS);
    /* the largest sizes: INT32_MAX everywhere, and a window of any length */
    c.cmp_len = c.cmp_stride = c.slc_block = c.slc_topk = c.n_init = INT32_MAX;
    c.n_local = 0;
    c.window = INT64_MAX;
    CHECK_STATUS(nsa_config_validate(&c), NSA_STATUS_SUCCESS);
    c.n_init = 0, c.n_local = INT32_MAX;
    CHECK_STATUS(nsa_config_validate(&c), NSA_STATUS_SUCCESS);
}

static void attention_tests(void)
{
    const op_case *op = &OPS[OP_ATTENTION];
    any_args a;
    tlist l;
    nsa_attention_args *x = &a.attention;

    mode_dense();
    build(op, &a, &l);
    x->window_left = -2;
    EXPECT(op, &a, NSA_STATUS_BAD_WINDOW, "window_left", "window_left = -2");
    build(op, &a, &l);
    x->causal = 0;
    x->window_right = -2;
    EXPECT(op, &a, NSA_STATUS_BAD_WINDOW, "window_right", "window_right = -2");
    build(op, &a, &l);
    x->scale = NAN;
    EXPECT(op, &a, NSA_STATUS_BAD_SCALE, "scale", "scale NaN");
    build(op, &a, &l);
    x->scale = -1.0f;
    EXPECT(op, &a, NSA_STATUS_BAD_SCALE, "scale", "scale < 0");
    build(op, &a, &l);
    x->scale = INFINITY;
    EXPECT(op, &a, NSA_STATUS_BAD_SCALE, "scale", "scale +inf");
    build(op, &a, &l);
    x->window_left = -1;
    x->window_right = -1;
    x->causal = 0;
    x->scale = 0.25f;
    EXPECT_OK(op, &a, &l, "unbounded window, explicit scale");

    /* dtype: q's is the reference; lse is F32 whatever q is */
    build(op, &a, &l);
    x->k.dtype = NSA_DTYPE_F16;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "k", "k F16, q F32");
    build(op, &a, &l);
    x->q.dtype = NSA_DTYPE_BF16;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "k", "q BF16, k F32");
    build(op, &a, &l);
    x->lse.dtype = NSA_DTYPE_F16;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "lse", "lse F16");
    build(op, &a, &l);
    x->q.dtype = NSA_DTYPE_I32;
    x->k.dtype = NSA_DTYPE_I32;
    x->v.dtype = NSA_DTYPE_I32;
    x->o.dtype = NSA_DTYPE_I32;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "q", "all I32");

    /* the first failure wins: per tensor in argument order, then across tensors, outputs last */
    build(op, &a, &l);
    x->q.rank = 3;
    x->k.dtype = NSA_DTYPE_F16;
    EXPECT(op, &a, NSA_STATUS_BAD_RANK, "q", "q rank and k dtype");
    build(op, &a, &l);
    x->q.shape[1] = T_ - 1;
    x->v.stride[3] = 3;
    EXPECT(op, &a, NSA_STATUS_BAD_STRIDE, "v", "q shape (cross) and v stride (alone)");
    build(op, &a, &l);
    x->k.shape[1] = T_ - 1;
    x->o.data = NULL;
    EXPECT(op, &a, NSA_STATUS_BAD_SHAPE, "k", "k shape and o missing");
    build(op, &a, &l);
    x->q.data = NULL;
    x->o.data = NULL;
    EXPECT(op, &a, NSA_STATUS_NULL_POINTER, "q", "q NULL and o missing");

    /* zero elements: NULL data is fine for inputs and outputs alike */
    build(op, &a, &l);
    x->q.shape[1] = x->k.shape[1] = x->v.shape[1] = x->o.shape[1] = x->lse.shape[1] = 0;
    x->q.data = x->k.data = x->v.data = x->o.data = x->lse.data = NULL;
    EXPECT_OK(op, &a, &l, "T = 0, all data NULL");
    /* offsets: a sub-view with padded strides is fine (q narrowed to half its heads) */
    build(op, &a, &l);
    x->q.shape[3] = DK_ / 2;
    x->k.shape[3] = DK_ / 2;
    EXPECT_OK(op, &a, &l, "DK narrowed to a strided sub-view");
    build(op, &a, &l);
    x->q.stride[1] = INT64_MAX / 16;
    EXPECT(op, &a, NSA_STATUS_SIZE_OVERFLOW, "q", "q stride[1] huge");
}

/* The attention op's options (nsa.h section 5): each rule broken alone, then the Tq != Tk and varlen_qk forms. */
static void attention_ext_tests(void)
{
    const op_case *op = &OPS[OP_ATTENTION_EXT], *bop = &OPS[OP_ATTENTION_EXT_BWD];
    static const int64_t CQ[] = {0, 3, 3, 12}, CK[] = {0, 5, 5, 20}, CK_BAD0[] = {1, 5, 5, 20},
                         CK_DOWN[] = {0, 5, 4, 20}, CQ_SHORT[] = {0, 3, 3, 11};
    static const int32_t CU12[] = {0, 3, 3, 12};
    any_args a;
    tlist l;
    nsa_attention_args *x = &a.attention;
    nsa_attention_bwd_args *y = &a.attention_bwd;
    const float bad_caps[] = {-1.0f, NAN, INFINITY, -INFINITY};
    const float bad_ps[] = {-0.1f, 1.0f, 1.5f, NAN, INFINITY};
    size_t i;

    mode_dense();
    for (i = 0; i < sizeof bad_caps / sizeof bad_caps[0]; i++) {
        build(op, &a, &l);
        x->softcap = bad_caps[i];
        x->q.rank = 1; /* scalars come first */
        EXPECT(op, &a, NSA_STATUS_BAD_SOFTCAP, "softcap", "softcap negative or not finite");
    }
    for (i = 0; i < sizeof bad_ps / sizeof bad_ps[0]; i++) {
        build(op, &a, &l);
        x->dropout_p = bad_ps[i];
        EXPECT(op, &a, NSA_STATUS_BAD_DROPOUT, "dropout_p", "dropout_p outside [0, 1)");
    }
    build(op, &a, &l);
    x->softcap = -1.0f;
    x->dropout_p = 2.0f;
    EXPECT(op, &a, NSA_STATUS_BAD_SOFTCAP, "softcap", "softcap and dropout_p: softcap first");
    build(op, &a, &l);
    x->k_segment_ids.data = NULL;
    EXPECT(op, &a, NSA_STATUS_BAD_ARGUMENT, "q_segment_ids", "q_segment_ids without k_segment_ids");
    build(op, &a, &l);
    x->q_segment_ids.data = NULL;
    EXPECT(op, &a, NSA_STATUS_BAD_ARGUMENT, "k_segment_ids", "k_segment_ids without q_segment_ids");
    build(bop, &a, &l);
    y->fwd.bias.data = NULL;
    EXPECT(bop, &a, NSA_STATUS_BAD_ARGUMENT, "dbias", "dbias without bias");

    /* dtypes: sinks F32, segment ids I32, mask U8; bias and dbias any float dtype */
    build(op, &a, &l);
    x->sinks.dtype = NSA_DTYPE_F16;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "sinks", "sinks F16");
    build(op, &a, &l);
    x->q_segment_ids.dtype = NSA_DTYPE_F32;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "q_segment_ids", "q_segment_ids F32");
    build(op, &a, &l);
    x->mask.dtype = NSA_DTYPE_I32;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "mask", "mask I32");
    build(op, &a, &l);
    x->mask.dtype = NSA_DTYPE_F32;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "mask", "mask F32");
    build(op, &a, &l);
    x->bias.dtype = NSA_DTYPE_U8;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "bias", "bias U8");
    build(bop, &a, &l);
    y->dbias.dtype = NSA_DTYPE_I32;
    EXPECT(bop, &a, NSA_STATUS_BAD_DTYPE, "dbias", "dbias I32");
    build(bop, &a, &l);
    y->dsinks.dtype = NSA_DTYPE_BF16;
    EXPECT(bop, &a, NSA_STATUS_BAD_DTYPE, "dsinks", "dsinks BF16");
    build(op, &a, &l);
    x->bias.dtype = NSA_DTYPE_F16; /* the buffer is only read through a narrower view: fine */
    EXPECT_OK(op, &a, &l, "bias F16 with q F32");

    /* shapes: sinks [HQ], segment ids [B, T], bias/mask [1 or B, 1 or HQ, Tq, Tk] */
    build(op, &a, &l);
    x->sinks.rank = 2;
    EXPECT(op, &a, NSA_STATUS_BAD_RANK, "sinks", "sinks rank 2");
    build(op, &a, &l);
    x->sinks.shape[0] = HQ_ / 2;
    EXPECT(op, &a, NSA_STATUS_BAD_SHAPE, "sinks", "sinks [HQ / 2]");
    build(op, &a, &l);
    x->sinks.stride[0] = 2;
    EXPECT(op, &a, NSA_STATUS_BAD_STRIDE, "sinks", "sinks stride 2");
    build(op, &a, &l);
    x->k_segment_ids.shape[1] = T_ - 1;
    EXPECT(op, &a, NSA_STATUS_BAD_SHAPE, "k_segment_ids", "k_segment_ids [B, Tk - 1]");
    build(op, &a, &l);
    x->q_segment_ids.rank = 3;
    EXPECT(op, &a, NSA_STATUS_BAD_RANK, "q_segment_ids", "q_segment_ids rank 3");
    build(op, &a, &l);
    x->bias.shape[1] = 2;
    x->bias.shape[3] = T_ / 2;
    EXPECT(op, &a, NSA_STATUS_BAD_SHAPE, "bias", "bias heads 2 (neither 1 nor HQ)");
    build(op, &a, &l);
    x->bias.shape[0] = 3;
    x->bias.stride[0] = 0;
    EXPECT(op, &a, NSA_STATUS_BAD_SHAPE, "bias", "bias batch 3 (neither 1 nor B)");
    build(op, &a, &l);
    x->bias.shape[0] = B_;
    x->bias.stride[0] = 0;
    EXPECT_OK(op, &a, &l, "bias batch B by stride 0");
    build(op, &a, &l);
    x->bias.shape[1] = 1;
    EXPECT_OK(op, &a, &l, "bias [1, 1, T, T]");
    build(op, &a, &l);
    x->mask.shape[1] = HQ_;
    x->mask.stride[1] = 0;
    EXPECT_OK(op, &a, &l, "mask heads HQ by stride 0");
    build(op, &a, &l);
    x->mask.shape[2] = T_ - 1;
    EXPECT(op, &a, NSA_STATUS_BAD_SHAPE, "mask", "mask [.., Tq - 1, Tk]");
    build(op, &a, &l);
    x->bias.stride[3] = 0;
    EXPECT(op, &a, NSA_STATUS_BAD_STRIDE, "bias", "bias last stride 0");
    /* dbias: the shape of bias, and no stride 0 on a dim of size > 1 */
    build(bop, &a, &l);
    y->dbias.shape[1] = 1;
    EXPECT(bop, &a, NSA_STATUS_BAD_SHAPE, "dbias", "dbias [1, 1, T, T] for bias [1, HQ, T, T]");
    build(bop, &a, &l);
    y->fwd.bias.shape[1] = 1;
    y->dbias.shape[1] = 1;
    EXPECT_OK(bop, &a, &l, "bias and dbias [1, 1, T, T]");
    build(bop, &a, &l);
    y->dbias.stride[1] = 0;
    EXPECT(bop, &a, NSA_STATUS_BAD_STRIDE, "dbias", "dbias stride 0 on HQ");
    build(bop, &a, &l);
    y->dbias.data = NULL;
    EXPECT_OK(bop, &a, &l, "dbias absent (optional)");
    build(bop, &a, &l);
    y->dsinks.data = NULL;
    EXPECT(bop, &a, NSA_STATUS_MISSING_OUTPUT, "dsinks", "dsinks absent with sinks");
    build(bop, &a, &l);
    y->fwd.sinks.data = NULL;
    y->dsinks.dtype = (nsa_dtype)42; /* neither checked nor written without sinks */
    for (i = 0; i < (size_t)l.n; i++)
        if (l.u[i].t == &y->dsinks) l.u[i].kind = USE_OPT; /* its buffer must stay sentinel */
    EXPECT_OK(bop, &a, &l, "no sinks: dsinks ignored");

    /* Tq != Tk: q, o, lse, q_segment_ids and bias/mask dim 2 narrowed to 12 query rows */
    build(bop, &a, &l);
    y->fwd.q.shape[1] = y->fwd.o.shape[1] = y->fwd.lse.shape[1] = y->fwd.q_segment_ids.shape[1] = 12;
    y->fwd.bias.shape[2] = y->fwd.mask.shape[2] = y->dbias.shape[2] = 12;
    y->dout.shape[1] = y->dq.shape[1] = 12;
    EXPECT_OK(bop, &a, &l, "Tq = 12, Tk = 20");
    y->fwd.bias.shape[2] = 13;
    EXPECT(bop, &a, NSA_STATUS_BAD_SHAPE, "bias", "Tq = 12, bias for 13 rows");
    y->fwd.bias.shape[2] = 12;
    y->fwd.k_segment_ids.shape[1] = 12;
    EXPECT(bop, &a, NSA_STATUS_BAD_SHAPE, "k_segment_ids", "Tq = 12, k_segment_ids for 12 keys");
    y->fwd.k_segment_ids.shape[1] = T_;
    /* int32 varlen is one packing for both: Tq != Tk cannot use it */
    mode_packed();
    M.cu = CU12;
    build(op, &a, &l);
    x->q.shape[1] = x->o.shape[1] = x->lse.shape[1] = x->q_segment_ids.shape[1] = 12;
    x->bias.shape[2] = x->mask.shape[2] = 12;
    EXPECT(op, &a, NSA_STATUS_BAD_CU_SEQLENS, "varlen.cu_seqlens", "varlen.cu_seqlens with Tq != Tk");
    /* varlen_qk: separate packings */
    x->varlen.cu_seqlens = NULL;
    x->varlen_qk.cu_seqlens_q = CQ;
    x->varlen_qk.cu_seqlens_k = CK;
    x->varlen_qk.num_seqs = 3;
    EXPECT_OK(op, &a, &l, "varlen_qk, Tq = 12, Tk = 20");
    x->varlen.cu_seqlens = CU12;
    x->varlen.num_seqs = 3;
    EXPECT(op, &a, NSA_STATUS_BAD_ARGUMENT, "varlen_qk", "varlen and varlen_qk both");
    x->varlen.cu_seqlens = NULL;
    x->varlen_qk.cu_seqlens_k = NULL;
    EXPECT(op, &a, NSA_STATUS_BAD_ARGUMENT, "cu_seqlens_q", "cu_seqlens_q without cu_seqlens_k");
    x->varlen_qk.cu_seqlens_k = CK_BAD0;
    EXPECT(op, &a, NSA_STATUS_BAD_CU_SEQLENS, "cu_seqlens_k", "cu_seqlens_k[0] != 0");
    x->varlen_qk.cu_seqlens_k = CK_DOWN;
    EXPECT(op, &a, NSA_STATUS_BAD_CU_SEQLENS, "cu_seqlens_k", "cu_seqlens_k decreasing");
    x->varlen_qk.cu_seqlens_k = CK;
    x->varlen_qk.cu_seqlens_q = CQ_SHORT;
    EXPECT(op, &a, NSA_STATUS_BAD_CU_SEQLENS, "cu_seqlens_q", "cu_seqlens_q[N] != Tq");
    x->varlen_qk.cu_seqlens_q = CK;
    EXPECT(op, &a, NSA_STATUS_BAD_CU_SEQLENS, "cu_seqlens_q", "cu_seqlens_q[N] = Tk != Tq");
    x->varlen_qk.cu_seqlens_q = CQ;
    x->varlen_qk.num_seqs = -1;
    EXPECT(op, &a, NSA_STATUS_BAD_CU_SEQLENS, "varlen_qk.num_seqs", "varlen_qk num_seqs < 0");
    x->varlen_qk.num_seqs = 3;
    x->q.shape[0] = x->k.shape[0] = x->v.shape[0] = x->o.shape[0] = x->lse.shape[0] = B_;
    x->q_segment_ids.shape[0] = x->k_segment_ids.shape[0] = B_;
    EXPECT(op, &a, NSA_STATUS_BAD_CU_SEQLENS, "varlen_qk", "varlen_qk with B != 1");
    mode_dense();
}

static void compress_tests(void)
{
    const op_case *op = &OPS[OP_COMPRESS], *bop = &OPS[OP_COMPRESS_BWD];
    any_args a;
    tlist l;

    mode_dense();
    /* T < l: no compressed row; the empty output may have NULL data, or not */
    build(op, &a, &l);
    a.compress.x.shape[1] = 3;
    a.compress.x_cmp.shape[1] = 0;
    EXPECT_OK(op, &a, &l, "T < l, empty x_cmp with data");
    a.compress.x_cmp.data = NULL;
    EXPECT_OK(op, &a, &l, "T < l, empty x_cmp without data");
    a.compress.x_cmp.shape[1] = 1;
    a.compress.x_cmp.data = W.xc.t.data;
    EXPECT(op, &a, NSA_STATUS_BAD_SHAPE, "x_cmp", "T < l, x_cmp with one row");
    build(op, &a, &l);
    a.compress.x_cmp.dtype = NSA_DTYPE_F16;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "x_cmp", "x_cmp F16, x F32");

    /* the backward reads x's shape and dtype only, and never x_cmp */
    build(bop, &a, &l);
    a.compress_bwd.fwd.x.data = NULL;
    a.compress_bwd.fwd.x_cmp.rank = 9;
    a.compress_bwd.fwd.x_cmp.data = W.kc.t.data;
    EXPECT_OK(bop, &a, &l, "fwd.x without data, fwd.x_cmp garbage");
    build(bop, &a, &l);
    a.compress_bwd.fwd.x.dtype = NSA_DTYPE_BF16;
    EXPECT(bop, &a, NSA_STATUS_BAD_DTYPE, "dx_cmp", "fwd.x BF16, dx_cmp F32");
}

static void selection_tests(void)
{
    const op_case *sel = &OPS[OP_SELECT], *slc = &OPS[OP_SLC_ATTN];
    any_args a;
    tlist l;

    mode_dense();
    /* nsa_select writes exactly n indices per row */
    build(sel, &a, &l);
    a.select.block_indices.shape[3] = N_ - 1;
    EXPECT(sel, &a, NSA_STATUS_BAD_SHAPE, "block_indices", "block_indices width n - 1");
    build(sel, &a, &l);
    a.select.block_indices = view(&W.biw);
    EXPECT(sel, &a, NSA_STATUS_BAD_SHAPE, "block_indices", "block_indices width n + 1");
    build(sel, &a, &l);
    a.select.lse_cmp.dtype = NSA_DTYPE_F16;
    EXPECT(sel, &a, NSA_STATUS_BAD_DTYPE, "lse_cmp", "lse_cmp F16");
    build(sel, &a, &l);
    a.select.block_counts.dtype = NSA_DTYPE_F32;
    EXPECT(sel, &a, NSA_STATUS_BAD_DTYPE, "block_counts", "block_counts F32");
    build(sel, &a, &l);
    a.select.lse_cmp.data = NULL;
    a.select.block_counts.data = NULL;
    EXPECT_OK(sel, &a, &l, "without lse_cmp and block_counts");

    /* nsa_slc_attn takes any width m >= 1 */
    build(slc, &a, &l);
    a.slc_attn.block_indices.shape[3] = 0;
    EXPECT(slc, &a, NSA_STATUS_BAD_SHAPE, "block_indices", "block_indices width 0");
    build(slc, &a, &l);
    a.slc_attn.block_indices.shape[3] = 2;
    a.slc_attn.block_counts.data = NULL;
    EXPECT_OK(slc, &a, &l, "block_indices width 2 (a strided sub-view), no counts");
    build(slc, &a, &l);
    a.slc_attn.block_indices.dtype = NSA_DTYPE_F32;
    EXPECT(slc, &a, NSA_STATUS_BAD_DTYPE, "block_indices", "block_indices F32");
}

static void gate_tests(void)
{
    const op_case *op = &OPS[OP_GATE], *bop = &OPS[OP_GATE_BWD];
    any_args a;
    tlist l;
    nsa_gate_args *g = &a.gate;

    mode_dense();
    build(op, &a, &l);
    g->g_cmp.data = g->g_slc.data = g->g_swa.data = NULL;
    EXPECT(op, &a, NSA_STATUS_BAD_ARGUMENT, "g_cmp", "no gate");
    build(op, &a, &l);
    g->g_cmp.data = g->g_slc.data = NULL;
    memset(&g->o_cmp, 0, sizeof g->o_cmp); /* a disabled branch's o_* may be absent */
    g->o_slc.rank = 9;                   /* ... or anything: it is not read */
    EXPECT_OK(op, &a, &l, "only the window gate");
    build(op, &a, &l);
    g->o_cmp.dtype = NSA_DTYPE_F16; /* branch outputs may be any float dtype (buffer holds it) */
    EXPECT_OK(op, &a, &l, "o_cmp F16, the rest F32");
    build(op, &a, &l);
    g->g_slc.dtype = NSA_DTYPE_F16;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "g_slc", "g_slc F16, o F32");
    build(op, &a, &l);
    g->o.dtype = NSA_DTYPE_BF16;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "o", "o BF16, gates F32");
    build(op, &a, &l);
    g->o_swa.dtype = NSA_DTYPE_I32;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "o_swa", "o_swa I32");
    build(op, &a, &l);
    g->o.data = NULL;
    g->g_cmp.shape[1] = T_ - 1;
    EXPECT(op, &a, NSA_STATUS_BAD_SHAPE, "g_cmp", "o missing and g_cmp shape");

    build(bop, &a, &l);
    a.gate_bwd.fwd.g_cmp.data = a.gate_bwd.fwd.g_slc.data = a.gate_bwd.fwd.g_swa.data = NULL;
    EXPECT(bop, &a, NSA_STATUS_BAD_ARGUMENT, "g_cmp", "no gate");
    build(bop, &a, &l);
    a.gate_bwd.fwd.o.data = NULL; /* only its shape and dtype are read */
    EXPECT_OK(bop, &a, &l, "fwd.o without data");
    build(bop, &a, &l);
    a.gate_bwd.fwd.g_cmp.data = NULL;
    a.gate_bwd.fwd.o_cmp.data = NULL;
    a.gate_bwd.do_cmp.data = NULL;
    a.gate_bwd.dg_cmp.data = NULL;
    EXPECT_OK(bop, &a, &l, "no compressed branch, none of its tensors");
    build(bop, &a, &l);
    a.gate_bwd.dg_swa.dtype = NSA_DTYPE_F16;
    EXPECT(bop, &a, NSA_STATUS_BAD_DTYPE, "dg_swa", "dg_swa F16, o F32");
    build(bop, &a, &l);
    a.gate_bwd.fwd.o.dtype = NSA_DTYPE_F16;
    EXPECT(bop, &a, NSA_STATUS_BAD_DTYPE, "fwd.o", "fwd.o F16, gates F32");
}

static void forward_tests(void)
{
    const op_case *op = &OPS[OP_FORWARD];
    any_args a;
    tlist l;
    nsa_forward_args *f = &a.forward;

    mode_dense();
    build(op, &a, &l);
    f->v_slc.data = NULL;
    EXPECT(op, &a, NSA_STATUS_BAD_ARGUMENT, "k_slc", "k_slc without v_slc");
    build(op, &a, &l);
    f->k_slc.data = NULL;
    EXPECT(op, &a, NSA_STATUS_BAD_ARGUMENT, "v_slc", "v_slc without k_slc");
    build(op, &a, &l);
    f->k_swa = view(&W.k3);
    EXPECT(op, &a, NSA_STATUS_BAD_ARGUMENT, "k_swa", "k_swa without v_swa");
    build(op, &a, &l);
    f->v_cmp = view(&W.vc);
    EXPECT(op, &a, NSA_STATUS_BAD_ARGUMENT, "v_cmp", "v_cmp without k_cmp");
    build(op, &a, &l);
    f->g_cmp.data = f->g_slc.data = f->g_swa.data = NULL;
    EXPECT(op, &a, NSA_STATUS_BAD_ARGUMENT, "g_cmp", "no gate");
    build(op, &a, &l);
    f->block_counts = view(&W.bc);
    EXPECT(op, &a, NSA_STATUS_BAD_ARGUMENT, "block_counts", "block_counts without block_indices");
    build(op, &a, &l);
    f->v_slc.data = NULL;
    f->q.rank = 2;
    EXPECT(op, &a, NSA_STATUS_BAD_ARGUMENT, "v_slc", "one of a pair, and q rank: the pair first");

    /* the caller's compression and selection */
    build(op, &a, &l);
    f->k_cmp = view(&W.kc);
    f->v_cmp = view(&W.vc);
    f->block_indices = view(&W.bi);
    f->block_counts = view(&W.bc);
    f->saved.block_indices.data = NULL; /* not written when the caller selects */
    EXPECT_OK(op, &a, &l, "own k_cmp/v_cmp and block_indices, no saved indices");
    f->k_cmp.shape[1] = NC_ - 1;
    EXPECT(op, &a, NSA_STATUS_BAD_SHAPE, "k_cmp", "k_cmp with Nc - 1 rows");
    f->k_cmp.shape[1] = NC_;
    f->block_indices.shape[3] = 0;
    EXPECT(op, &a, NSA_STATUS_BAD_SHAPE, "block_indices", "block_indices width 0");
    f->block_indices.shape[3] = N_;
    f->block_counts.shape[2] = H_ - 1;
    EXPECT(op, &a, NSA_STATUS_BAD_SHAPE, "block_counts", "block_counts with H - 1 heads");

    /* saved tensors: only those of present branches; lse is F32, o any float */
    build(op, &a, &l);
    f->g_swa.data = NULL;
    f->saved.o_swa.data = NULL;
    f->saved.lse_swa.data = NULL;
    EXPECT_OK(op, &a, &l, "no window branch, no saved window tensors");
    build(op, &a, &l);
    f->g_slc.data = NULL;
    f->saved.o_slc.data = NULL;
    f->saved.lse_slc.data = NULL;
    f->saved.block_indices.rank = 9; /* not selecting: ignored */
    EXPECT_OK(op, &a, &l, "no selection branch, saved.block_indices ignored");
    build(op, &a, &l);
    f->saved.lse_cmp.dtype = NSA_DTYPE_F16;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "saved.lse_cmp", "saved.lse_cmp F16");
    build(op, &a, &l);
    f->saved.block_indices.shape[3] = N_ - 1;
    EXPECT(op, &a, NSA_STATUS_BAD_SHAPE, "saved.block_indices", "saved.block_indices width n - 1");
    build(op, &a, &l);
    f->g_slc.dtype = NSA_DTYPE_BF16;
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "g_slc", "g_slc BF16, q F32");
}

static void backward_tests(void)
{
    const op_case *op = &OPS[OP_BACKWARD];
    any_args a;
    tlist l;
    nsa_backward_args *b = &a.backward;

    mode_dense();
    build(op, &a, &l);
    b->fwd.o.rank = 9; /* ignored by the backward */
    b->fwd.o.data = W.oi[0].t.data;
    EXPECT_OK(op, &a, &l, "fwd.o garbage");
    build(op, &a, &l);
    b->fwd.k_swa = view(&W.k3);
    b->fwd.v_swa = view(&W.v3);
    PUT(&l, b->dv_swa, W.dv3, USE_OUT);
    EXPECT(op, &a, NSA_STATUS_MISSING_OUTPUT, "dk_swa", "k_swa given, dk_swa missing");
    PUT(&l, b->dk_swa, W.dk3, USE_OUT);
    EXPECT_OK(op, &a, &l, "own window K/V with their gradients");
    build(op, &a, &l);
    b->fwd.k_cmp = view(&W.kc);
    b->fwd.v_cmp = view(&W.vc);
    PUT(&l, b->dk_cmp, W.dkc, USE_OUT);
    EXPECT(op, &a, NSA_STATUS_MISSING_OUTPUT, "dv_cmp", "k_cmp given, dv_cmp missing");
    PUT(&l, b->dv_cmp, W.dvc, USE_OUT);
    EXPECT_OK(op, &a, &l, "own k_cmp/v_cmp with their gradients");
    build(op, &a, &l);
    b->fwd.k_cmp = view(&W.kc); /* a gradient is not required of a tensor not given... */
    b->fwd.v_cmp = view(&W.vc);
    b->dk_cmp = view(&W.dkc);
    b->dv_cmp = view(&W.dvc);
    b->dk_cmp.dtype = NSA_DTYPE_F16; /* ... and shares q's dtype when it is */
    EXPECT(op, &a, NSA_STATUS_BAD_DTYPE, "dk_cmp", "dk_cmp F16");
    build(op, &a, &l);
    memset(&b->fwd.saved.o_slc, 0, sizeof b->fwd.saved.o_slc);
    EXPECT(op, &a, NSA_STATUS_NULL_POINTER, "saved.o_slc", "saved.o_slc absent");
    build(op, &a, &l);
    b->fwd.g_cmp.data = NULL;
    memset(&b->fwd.saved.o_cmp, 0, sizeof b->fwd.saved.o_cmp);
    memset(&b->fwd.saved.lse_cmp, 0, sizeof b->fwd.saved.lse_cmp);
    b->dg_cmp.data = NULL;
    EXPECT_OK(op, &a, &l, "no compressed branch, none of its tensors");
    build(op, &a, &l);
    b->fwd.block_indices = view(&W.bi);
    memset(&b->fwd.saved.block_indices, 0, sizeof b->fwd.saved.block_indices);
    EXPECT_OK(op, &a, &l, "caller's block_indices, no saved indices");
    build(op, &a, &l);
    b->fwd.k_slc.data = NULL;
    EXPECT(op, &a, NSA_STATUS_BAD_ARGUMENT, "v_slc", "v_slc without k_slc");
    build(op, &a, &l);
    b->fwd.g_cmp.data = b->fwd.g_slc.data = b->fwd.g_swa.data = NULL;
    EXPECT(op, &a, NSA_STATUS_BAD_ARGUMENT, "g_cmp", "no gate");
}

/* ---- the detail of a failure (nsa_last_error_detail) ------------------------------------- */
/* The calls with no context yet, and the contract: emptied by a success, per thread. */
static void detail_tests(void)
{
    nsa_context *ctx = NULL;
    nsa_context_desc d;
    memset(&d, 0, sizeof d);

    CHECK_STATUS(nsa_context_create(NULL, &d), NSA_STATUS_NULL_POINTER);
    CHECK_DETAIL("ctx");
    CHECK_STATUS(nsa_context_create(&ctx, NULL), NSA_STATUS_NULL_POINTER);
    CHECK_DETAIL("desc");
    d.backend = (nsa_backend)7;
    CHECK_STATUS(nsa_context_create(&ctx, &d), NSA_STATUS_BAD_ARGUMENT);
    CHECK_DETAIL("desc.backend");
    d.backend = NSA_BACKEND_CPU, d.num_threads = -1;
    CHECK_STATUS(nsa_context_create(&ctx, &d), NSA_STATUS_BAD_ARGUMENT);
    CHECK_DETAIL("desc.num_threads");
    d.num_threads = 0, d.device = -1;
    CHECK_STATUS(nsa_context_create(&ctx, &d), NSA_STATUS_BAD_ARGUMENT);
    CHECK_DETAIL("desc.device");
    if (!nsa_backend_available(NSA_BACKEND_CUDA)) {
        d.backend = NSA_BACKEND_CUDA, d.device = 0;
        CHECK_STATUS(nsa_context_create(&ctx, &d), NSA_STATUS_BACKEND_UNAVAILABLE);
        CHECK_DETAIL("desc.backend");
    }
    CHECK_STATUS(nsa_context_set_stream(NULL, NULL), NSA_STATUS_NULL_POINTER);
    CHECK_DETAIL("ctx");

    /* nsa_cmp_offsets: its own argument names */
    {
        nsa_config c = test_config();
        static const int32_t cu_down[] = {0, 5, 4}, cu_start[] = {2, 5};
        int64_t out[3];
        CHECK_STATUS(nsa_cmp_offsets(NULL, CU_OK, 3, out), NSA_STATUS_NULL_POINTER);
        CHECK_DETAIL("config");
        CHECK_STATUS(nsa_cmp_offsets(&c, NULL, 3, out), NSA_STATUS_NULL_POINTER);
        CHECK_DETAIL("cu_seqlens");
        CHECK_STATUS(nsa_cmp_offsets(&c, CU_OK, 3, NULL), NSA_STATUS_NULL_POINTER);
        CHECK_DETAIL("cu_cmp");
        CHECK_STATUS(nsa_cmp_offsets(&c, CU_OK, -1, out), NSA_STATUS_BAD_CU_SEQLENS);
        CHECK_DETAIL("num_seqs");
        CHECK_STATUS(nsa_cmp_offsets(&c, cu_start, 1, out), NSA_STATUS_BAD_CU_SEQLENS);
        CHECK_DETAIL("cu_seqlens");
        CHECK_STATUS(nsa_cmp_offsets(&c, cu_down, 2, out), NSA_STATUS_BAD_CU_SEQLENS);
        CHECK_DETAIL("cu_seqlens");
        c.window = 0;
        CHECK_STATUS(nsa_cmp_offsets(&c, CU_OK, 3, out), NSA_STATUS_BAD_WINDOW);
        CHECK_DETAIL("config.window");
    }

    /* one detail in full, the example nsa.h gives */
    {
        nsa_config c = nsa_config_default();
        c.cmp_len = 32, c.cmp_stride = 32, c.slc_block = 48;
        nsa_config_validate(&c);
        CHECK_MSG(strcmp(nsa_last_error_detail(), "config.slc_block: 48 is not a multiple of cmp_stride 32") == 0,
                  nsa_last_error_detail());
    }

    /* a success empties it: no stale detail from an earlier failure */
    {
        nsa_config c = nsa_config_default();
        CHECK_STATUS(nsa_config_validate(NULL), NSA_STATUS_NULL_POINTER);
        CHECK(nsa_last_error_detail()[0] != '\0');
        CHECK_STATUS(nsa_config_validate(&c), NSA_STATUS_SUCCESS);
        CHECK(nsa_last_error_detail()[0] == '\0');
    }

    /* per thread: each of two threads fails differently, waits for the other, then reads its own */
    {
        int named[2] = {0, 0}, ran = 0;
#pragma omp parallel num_threads(2) reduction(+ : ran)
        {
#ifdef _OPENMP
            const int me = omp_get_thread_num();
#else
            const int me = 0;
#endif
            nsa_config c = nsa_config_default();
            if (me == 0) c.window = 0;
            else c.scale = -1.0f;
            nsa_config_validate(&c);
#pragma omp barrier
            named[me] = harness_detail_names(nsa_last_error_detail(), me == 0 ? "config.window" : "config.scale");
            ran = 1;
        }
        CHECK(named[0]);
        if (ran == 2) CHECK(named[1]); /* OpenMP may give fewer threads; then one is all there is */
    }
}

/* The detail-name matcher itself: whole names only, so a check for "k" cannot pass on "dk". */
static void detail_matcher_tests(void)
{
    CHECK(harness_detail_names("k: dim 1 (T) is 40, q has 10", "k"));
    CHECK(harness_detail_names("k: dim 1 (T) is 40, q has 10", "q"));
    CHECK(harness_detail_names("fwd.k: rank 3", "k"));
    CHECK(harness_detail_names("fwd.config.window: 0", "config.window"));
    CHECK(!harness_detail_names("dk: rank 3", "k"));
    CHECK(!harness_detail_names("k_cmp: rank 3", "k"));
    CHECK(!harness_detail_names("", "k"));
    CHECK(!harness_detail_names("config.scale: nan", "config.window"));
}

void test_validation_all(void)
{
    nsa_context_desc desc;
    int i;

    memset(&desc, 0, sizeof desc);
    desc.backend = NSA_BACKEND_CPU;
    CHECK_STATUS(nsa_context_create(&g_ctx, &desc), NSA_STATUS_SUCCESS);
    if (!g_ctx) return;
    world_create();

    status_and_config_tests();
    detail_tests();
    detail_matcher_tests();
    for (i = 0; i < OP_COUNT; i++) generic_cases(&OPS[i]);
    attention_tests();
    attention_ext_tests();
    compress_tests();
    selection_tests();
    gate_tests();
    forward_tests();
    backward_tests();
    if (g_tests_verbose)
        printf("validation: %ld cases; %d of %d ops need workspace\n", g_cases, g_ws_ops, (int)OP_COUNT);

    world_destroy();
    free(g_ws);
    g_ws = NULL;
    g_ws_bytes = 0;
    nsa_context_destroy(g_ctx);
    g_ctx = NULL;
}
