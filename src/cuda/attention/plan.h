/* attention/plan.h -- the planner of the attention op (attention/plan.c): the tuned tiles of
 * attn/ and range/ or the option-complete kernels of attention/kernels.cuh. Plain C. */
#ifndef NSA_CUDA_ATTENTION_PLAN_H
#define NSA_CUDA_ATTENTION_PLAN_H

#include "../plan.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { CU_ATTN_TILES = 0, CU_ATTN_GENERAL = 1 };

/* Forward: the tuned tiles take calls with causal / windows / scale, and softcap, sinks and
 * Tq != Tk in a dense batch (alone or together: they apply them per score, per row or in the
 * window bounds); everything else (segments, bias, mask, dropout, varlen_qk, head dims beyond
 * the tiles') the general kernels. */
int cu_plan_attention_fwd(const nsa_problem *p, const nsa_attention_args *a);
/* Backward: the tuned tiles without any option (p->extended) or with a softcap alone, on the
 * tiles' head dims; a: the forward's arguments. */
int cu_plan_attention_bwd(const nsa_problem *p, const nsa_attention_args *a);

#ifdef __cplusplus
}
#endif

#endif
