/* fuzz_api.c -- libFuzzer harness for the public C API on the CPU backend.
 *
 * Each input decodes into one call with guarded host buffers (decode.c, which also says what
 * is checked); any broken promise aborts, so libFuzzer keeps the input. The same inputs run
 * without libFuzzer, on either backend, through build/nsa_fuzz_replay (replay.c). */
#include "nsa.h"
#include "decode.h"

#include <stdint.h>
#include <stdlib.h>

static nsa_context *ctx_one(void)
{
    static nsa_context *ctx;
    if (!ctx) {
        nsa_context_desc d = {.backend = NSA_BACKEND_CPU, .num_threads = 1};
        if (nsa_context_create(&ctx, &d) != NSA_STATUS_SUCCESS) abort();
    }
    return ctx;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (fuzz_run(data, size, ctx_one(), NULL).violations) abort();
    return 0;
}
