/* attention/plan.c -- the planner of the attention op (attention/plan.h). */
#include "plan.h"

int cu_plan_attention_fwd(const nsa_problem *p, const nsa_attention_args *a)
{
    if (!cu_dims_class(p->DK, p->DV)) return CU_ATTN_GENERAL;
    /* (Tq != Tk comes with a dense batch or varlen_qk, which stays on the general kernels) */
    const int tiles = !p->cu_seqlens_q && !a->q_segment_ids.data && !a->bias.data && !a->mask.data && a->dropout_p == 0.0f;
    return tiles ? CU_ATTN_TILES : CU_ATTN_GENERAL;
}

int cu_plan_attention_bwd(const nsa_problem *p, const nsa_attention_args *a)
{
    if (!cu_dims_class(p->DK, p->DV)) return CU_ATTN_GENERAL;
    /* a softcap alone: the tiles recompute the capped scores and put its factor on dS */
    const int cap_only = p->T == p->Tk && !nsa_present(&a->sinks) && !a->q_segment_ids.data && !a->bias.data &&
                         !a->mask.data && a->dropout_p == 0.0f && !p->cu_seqlens_q;
    return !p->extended || cap_only ? CU_ATTN_TILES : CU_ATTN_GENERAL;
}
