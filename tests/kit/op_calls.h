/* op_calls.h -- every public op's workspace query and call behind `const void *` arguments,
 * so a test can hold them in one table without calling through a cast function type. Header
 * only: the C suite and the fuzz harness (which links no kit library) both include it. */
#ifndef NSA_TEST_OP_CALLS_H
#define NSA_TEST_OP_CALLS_H

#include "nsa.h"

#include <stddef.h>

typedef nsa_status (*op_ws_fn)(nsa_context *ctx, const void *args, size_t *bytes);
typedef nsa_status (*op_run_fn)(nsa_context *ctx, const void *args, void *workspace, size_t bytes);

#define OP_CALLS(op, args_t)                                                                      \
    static inline nsa_status op_ws_##op(nsa_context *c, const void *a, size_t *bytes)             \
    {                                                                                             \
        return nsa_##op##_workspace_size(c, (const args_t *)a, bytes);                            \
    }                                                                                             \
    static inline nsa_status op_run_##op(nsa_context *c, const void *a, void *ws, size_t bytes)   \
    {                                                                                             \
        return nsa_##op(c, (const args_t *)a, ws, bytes);                                         \
    }
OP_CALLS(compress, nsa_compress_args)
OP_CALLS(compress_bwd, nsa_compress_bwd_args)
OP_CALLS(cmp_attn, nsa_cmp_attn_args)
OP_CALLS(cmp_attn_bwd, nsa_cmp_attn_bwd_args)
OP_CALLS(select, nsa_select_args)
OP_CALLS(slc_attn, nsa_slc_attn_args)
OP_CALLS(slc_attn_bwd, nsa_slc_attn_bwd_args)
OP_CALLS(attention, nsa_attention_args)
OP_CALLS(attention_bwd, nsa_attention_bwd_args)
OP_CALLS(gate, nsa_gate_args)
OP_CALLS(gate_bwd, nsa_gate_bwd_args)
OP_CALLS(forward, nsa_forward_args)
OP_CALLS(backward, nsa_backward_args)
OP_CALLS(step, nsa_step_args)
OP_CALLS(attention_step, nsa_attention_step_args)
OP_CALLS(flex_attention, nsa_flex_args)
OP_CALLS(flex_attention_bwd, nsa_flex_bwd_args)
#undef OP_CALLS

#endif
