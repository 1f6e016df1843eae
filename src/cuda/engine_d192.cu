/* engine_d192.cu -- the engine kernels for head dims up to DK 192 / DV 128 (padded), bf16 and
 * f16. One file per head-dim class so that the build compiles them in parallel. */
#include "engine.cuh"
#include "hopper.cuh"

NSA_ENGINE_INSTANCE(192, 128)
NSA_HOPPER_QWG_INSTANCE(192, 128)
NSA_HOPPER_SWG_INSTANCE(192)
