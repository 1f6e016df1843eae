/* attention/ops.cu -- the attention op (nsa.h section 5) on the GPU: plain calls (causal,
 * windows, scale; softcap, sinks and a dense Tq != Tk in the forward) on the tuned range
 * tiles, everything else on the option-complete kernels. */
#include "attention.h"
#include "../range/range.h"
#include "../cuda_backend.h"

/* Calls with an option beyond causal / windows / scale (or head dims the engine has no tile
 * for) take the option-complete kernels of xattn.cuh; the rest the tuned range tiles. */
static int attention_general(const nsa_problem *p) { return p->extended || !cu_dims_class(p->DK, p->DV); }

/* The forward of softcap, sinks and Tq != Tk in a dense batch (alone or together) runs on the
 * tuned tiles too, which apply them per score / per row / in the window bounds (their backward
 * runs xattn.cuh, from the same lse). */
static int attention_fwd_tuned(const nsa_problem *p, const nsa_attention_args *a)
{
    if (!cu_dims_class(p->DK, p->DV)) return 0;
    /* (Tq != Tk comes with a dense batch or varlen_qk, which stays on xattn.cuh) */
    return !p->cu_seqlens_q && !a->q_segment_ids.data && !a->bias.data && !a->mask.data && a->dropout_p == 0.0f;
}

static void run_attention(grun *g, const nsa_attention_args *a)
{
    if (!attention_fwd_tuned(g->p, a)) {
        if (cu_xattn_supported(g, a->q.dtype)) cu_xattn_fwd(g, a);
        return;
    }
    if (!cu_attn_supported(g, a->q.dtype)) return;
    g_seq_setup(g, 0);
    const dview q = dv_of(&a->q), k = dv_of(&a->k), v = dv_of(&a->v), o = dv_of(&a->o), lse = dv_of(&a->lse);
    rule_t r = cu_rule_window(a->window_left, a->window_right, a->causal);
    r.cap = a->softcap;
    if (a->sinks.data) r.sinks = (const float *)a->sinks.data, r.sinks_s = a->sinks.stride[0];
    if (g->p->Tk != g->p->T) r.shift = (int)(g->p->Tk - g->p->T), r.nk = (int)g->p->Tk;
    cu_fwd_range(g, &r, &q, a->q.dtype, &k, &v, &o, &lse);
}

size_t nsa_cuda_attention_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_args *a)
{
    return cu_op_workspace(ctx, p, run_attention, a);
}

nsa_status nsa_cuda_attention(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_attention, a, ws);
}

static void run_attention_bwd(grun *g, const nsa_attention_bwd_args *a)
{
    const nsa_attention_args *f = &a->fwd;
    if (attention_general(g->p)) {
        if (cu_xattn_supported(g, f->q.dtype)) cu_xattn_bwd(g, a);
        return;
    }
    if (!cu_attn_supported(g, f->q.dtype)) return;
    g_seq_setup(g, 0);
    const rule_t r = cu_rule_window(f->window_left, f->window_right, f->causal);
    cu_range_bwd_op(g, &r, &f->q, &f->k, &f->v, &f->o, &f->lse, &a->dout, g->p->T, &a->dq, &a->dk, &a->dv);
}

size_t nsa_cuda_attention_bwd_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_bwd_args *a)
{
    return cu_op_workspace(ctx, p, run_attention_bwd, a);
}

nsa_status nsa_cuda_attention_bwd(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_bwd_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_attention_bwd, a, ws);
}
