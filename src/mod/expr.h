/* mod/expr.h -- the expression language of mask_mod and score_mod (docs/spec.md section 13):
 * parsed and type-checked once into a program that the CPU evaluates and that can be printed as
 * C / CUDA source for a generated kernel. Backend-neutral; not installed. */
#ifndef NSA_MOD_EXPR_H
#define NSA_MOD_EXPR_H

#include <stddef.h>
#include <stdint.h>

#include "../internal.h"

typedef enum expr_kind {
    EXPR_MASK = 0, /* mask_mod(b, h, q_idx, kv_idx) -> bool */
    EXPR_SCORE = 1 /* score_mod(score, b, h, q_idx, kv_idx) -> float */
} expr_kind;

/* A tensor the expression reads by name (`doc[q_idx]`): a view in the memory the evaluator
 * reads (host for the CPU). int32 reads as int, uint8 as bool, f32 / f16 / bf16 as float.
 * The public nsa_mod_tensor; a program is the public nsa_mod. */
typedef nsa_mod_tensor expr_capture;
typedef struct nsa_mod expr_program;

enum { EXPR_MAX_CAPTURES = NSA_MOD_MAX_TENSORS, EXPR_MAX_NAME = 32 };

/* The kind a program was compiled as; its captured tensors (count, view, name). */
expr_kind expr_kind_of(const expr_program *p);
int expr_num_captures(const expr_program *p);
const nsa_tensor *expr_capture_tensor(const expr_program *p, int c);
const char *expr_capture_name(const expr_program *p, int c);

/* Reverse mode through a score_mod at one pair: returns the value of score_mod(score, ...) and,
 * for an incoming gradient g = dL/d(value), sets *dscore = dL/d(score) and, for each float
 * capture c with grads[c] non-NULL (one float per element of the tensor, row-major over its
 * shape), adds g * d(value)/d(element) to grads[c][element] (the element the clamped read read).
 * scratch: at least expr_scratch_bytes(p) bytes, aligned for int64. */
float expr_grad(const expr_program *p, int64_t b, int64_t h, int64_t q_idx, int64_t kv_idx, float score, float g,
                float *dscore, float *const *grads, void *scratch);
size_t expr_scratch_bytes(const expr_program *p);

/* Parses and checks `text` (NUL-terminated, at most 64 KiB); *out is NULL on failure.
 * `what` names the expression in a failure's detail ("mask_mod:14: unknown name 'dco'").
 * @return SUCCESS, NULL_POINTER, BAD_EXPRESSION (syntax, unknown name, wrong type or count of
 * arguments, a capture's bad name, dtype, rank or stride) or OUT_OF_MEMORY. */
nsa_status expr_compile(const char *text, expr_kind kind, const expr_capture *captures, int num_captures, const char *what,
                        expr_program **out);
void expr_free(expr_program *p);

/* One evaluation at (b, h, q_idx, kv_idx) with `score` (score_mod only). A mask_mod returns 1.0f
 * (keep) or 0.0f; a score_mod the modified score. Captured reads clamp every index into its
 * dimension (documented: never out of bounds). Needs no allocation; thread-safe. */
float expr_eval(const expr_program *p, int64_t b, int64_t h, int64_t q_idx, int64_t kv_idx, float score);

/* The expression as one C / CUDA expression over the variables b, h, q_idx, kv_idx (int64_t),
 * score (float) and caps (const nsa_mod_caps *: the captured tensors' pointers, dtypes, shapes
 * and strides, filled by expr_caps()), using the helpers of EXPR_C_PRELUDE (define NSA_MOD_FN
 * first: "static inline" for C, "__device__ __forceinline__" for CUDA). A mask_mod's value is an
 * int (0 / 1), a score_mod's a float. idx32 = 1 promises b, h, q_idx and kv_idx in [0, 2^31):
 * the int subexpressions whose every possible value (and every int operand's) then fits in 32
 * bits are computed in 32-bit ints -- the same values as in 64 bits. Writes at most `size` bytes
 * (NUL included). @return the length it needs (without the NUL), as snprintf. */
size_t expr_to_c(const expr_program *p, int idx32, char *buf, size_t size);

/* The reverse mode of a score_mod (expr_grad) as one C / CUDA function of the program's
 * instructions, after EXPR_C_PRELUDE:
 *   float nsa_mod_score_grad(const nsa_mod_caps *caps, const nsa_mod_sink *sink, long long b,
 *                            long long h, long long q_idx, long long kv_idx, float score, float g,
 *                            float *dscore)
 * returns score_mod's value, sets *dscore = g * d(value)/d(score) and, for each float read of
 * capture c, calls nsa_mod_grad(sink, c, element, g * d(value)/d(element)) with the element's
 * row-major index over the capture's shape (the clamped index the read read). The includer
 * declares the type nsa_mod_sink and the function nsa_mod_grad before it. idx32: as expr_to_c's.
 * @return the length it needs (without the NUL), as snprintf; 0 without memory. */
size_t expr_grad_to_c(const expr_program *p, int idx32, char *buf, size_t size);

/* The captured tensors as generated code reads them (the layout EXPR_C_PRELUDE declares). */
typedef struct nsa_mod_caps {
    const void *data[EXPR_MAX_CAPTURES];
    int64_t shape[EXPR_MAX_CAPTURES][4];
    int64_t stride[EXPR_MAX_CAPTURES][4];
    int32_t dtype[EXPR_MAX_CAPTURES];
} nsa_mod_caps;
void expr_caps(const expr_program *p, nsa_mod_caps *caps);

/* Helper functions and the nsa_mod_caps type for generated code (C and CUDA alike). */
extern const char EXPR_C_PRELUDE[];

/* The mods as nsa_attention's options (spec 14, the dense route): a mask_mod that is a
 * conjunction (&&, or & of bools) of q_idx >= kv_idx (causal), q_idx - kv_idx < c or <= c (a left
 * window), abs(q_idx - kv_idx) < c or <= c (both sides) and doc[q_idx] == doc[kv_idx] (a rank-1
 * int32 tensor: a document mask), in either operand order; a score_mod that is score or
 * c * tanh(score / c) (a softcap, c > 0). Either mod may be NULL. Positions are FlexAttention's
 * (top-left), so the options hold for Tq == Tk only; the caller checks the rest. Also
 * recognised: prefix-LM, (kv_idx < c) || (q_idx >= kv_idx) (| of bools too, either order). */
typedef struct expr_attention {
    int causal;            /* keys kv_idx <= q_idx */
    int64_t window_left;   /* keys kv_idx >= q_idx - window_left; -1: unbounded */
    int64_t window_right;  /* keys kv_idx <= q_idx + window_right; -1: unbounded */
    int doc;               /* the mask's capture of a document mask, -1: none */
    float softcap;         /* 0: none */
    int64_t prefix;        /* prefix-LM, kv_idx < prefix || q_idx >= kv_idx (alone, and causal set): keys
                              below prefix seen by every row; 0: none. No nsa_attention option: the
                              route refuses it, block masks use the rows' intervals it still gives */
} expr_attention;
/* @return 1 and *out when both mods are of those forms, else 0. */
int expr_as_attention(const expr_program *mask, const expr_program *score, expr_attention *out);

/* Which of the variables the expression reads (bits: 1 b, 2 h, 4 q_idx, 8 kv_idx, 16 score). */
unsigned expr_uses(const expr_program *p);
/* Its instruction count (0 for NULL): how much code each inlined copy of it is. */
int expr_size(const expr_program *p);

#endif /* NSA_MOD_EXPR_H */
