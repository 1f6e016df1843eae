/* engine_d64.cu -- the engine kernels for head dims up to DK 64 / DV 64 (padded), bf16 and
 * f16. One file per head-dim class so that the build compiles them in parallel. */
#include "engine.cuh"
#include "hopper.cuh"

NSA_ENGINE_INSTANCE(64, 64)
NSA_HOPPER_INSTANCE(64)
