/* decode.h -- the fuzz input format, shared by the libFuzzer harness (fuzz_api.c, host memory)
 * and the replay program (replay.c, host or CUDA device memory): one input decodes into one
 * public call with guarded buffers, which is run and checked. The format is the corpus's:
 * changing how bytes decode changes what every stored input means. */
#ifndef NSA_FUZZ_DECODE_H
#define NSA_FUZZ_DECODE_H

#include "nsa.h"

#include <stddef.h>
#include <stdint.h>

/* The op an input's first byte picks: 0xFF the inference step, 0xFE the dense step, 0xFD a
 * mod expression, 0xFC / 0xFB block-sparse attention with mods (forward / backward), 0xF9
 * nsa_create_block_mask (host memory, on either replay), 0xFA a
 * query chunk of an NSA op (the next byte picks cmp_attn, its backward, select, slc_attn, its
 * backward, forward or backward), else the byte modulo N_OPS (those came later; no stored input
 * starts with 0xF9-0xFF, so they all keep their meaning). */
enum { OP_COMPRESS, OP_COMPRESS_BWD, OP_CMP_ATTN, OP_CMP_ATTN_BWD, OP_SELECT, OP_SLC_ATTN, OP_SLC_ATTN_BWD,
       OP_ATTENTION, OP_ATTENTION_BWD, OP_GATE, OP_GATE_BWD, OP_FORWARD, OP_BACKWARD, OP_CONFIG, N_OPS,
       OP_STEP = N_OPS, OP_ATTENTION_STEP, OP_EXPR, OP_FLEX, OP_FLEX_BWD, OP_BLOCK_MASK, N_OPS_ALL };

/* Backend memory for the tensors and the workspace; alloc never returns NULL (it exits
 * instead), upload / download copy whole buffers, sync waits for the backend's queued work. */
typedef struct fuzz_memory {
    void *(*alloc)(size_t bytes);
    void (*release)(void *p);
    void (*upload)(void *dev, const void *host, size_t bytes);
    void (*download)(void *host, const void *dev, size_t bytes);
    void (*sync)(void);
} fuzz_memory;

typedef struct fuzz_result {
    int op;             /* OP_* */
    int ran;            /* the call was made (0: the workspace answer was too large to back) */
    nsa_status query;   /* the workspace query's status (SUCCESS for the config op) */
    nsa_status status;  /* the call's status, when ran */
    int violations;     /* broken promises, each printed on stderr; 0 = the checks held */
} fuzz_result;

/* Decodes data into one call on ctx, runs it and checks every buffer afterwards. mem NULL:
 * host memory, passed to the library in place; otherwise every tensor and the workspace
 * live in mem (cu_seqlens stay on the host, as the API wants). Not thread-safe.
 * @return what was called, its statuses and the number of violations. */
fuzz_result fuzz_run(const uint8_t *data, size_t size, nsa_context *ctx, const fuzz_memory *mem);

/* @return the name of an OP_* value ("compress", ...; "config_validate" for OP_CONFIG). */
const char *fuzz_op_name(int op);

#endif
