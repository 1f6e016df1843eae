/* prim/common.cuh -- what every CUDA file of the backend includes: the op-call run state and
 * views (run.h), sequences (seq.cuh) and the sm_80 primitives (mma_sync.cuh). */
#ifndef NSA_CUDA_PRIM_COMMON_CUH
#define NSA_CUDA_PRIM_COMMON_CUH

#include "run.h"
#include "seq.cuh"
#include "mma_sync.cuh"

#endif
