/* engine_d128.cu -- the engine kernels for head dims up to DK 128 / DV 128 (padded), bf16 and
 * f16. One file per head-dim class so that the build compiles them in parallel. */
#include "engine.cuh"
#include "hopper.cuh"

NSA_ENGINE_INSTANCE(128, 128)
NSA_HOPPER_INSTANCE(128)
