/* prim/nonfinite.cuh -- non-finite inputs against masked pairs. A tensor-core product
 * multiplies every pair of its tile, masked ones included, and 0 * inf and 0 * NaN are NaN: a
 * non-finite value in a key row (forward, dQ) or a query row (dK / dV) that some row of the
 * tile does not see would reach that row -- a row the mask hides it from, a padded row's
 * neighbour, another sequence of a packed batch. So a call whose inputs may carry such a
 * value to a tile is computed by the scalar kernels instead (attn/simt.cu and
 * attention/simt.cu), which multiply only the pairs a row sees: dense attention's result by
 * construction. The choice is made on the device, without a synchronisation: the call's flag
 * (run.h) is set by scans of the tiles' operands and by the row-term kernels; every tile
 * kernel reads it at its start and returns when it is set, and the scalar kernels, launched
 * beside each tile launch, return when it is not. Finite calls run the tiles' arithmetic,
 * unchanged, plus the scans and one wave of returning blocks per launch. */
#ifndef NSA_CUDA_PRIM_NONFINITE_CUH
#define NSA_CUDA_PRIM_NONFINITE_CUH

#include <stdint.h>

#if defined(__CUDACC__)

/* Whether the call's flag is set (nf NULL: never, under NSA_CUDA_NONFINITE=0): a tile kernel
 * then returns at once and the scalar kernels compute the call. */
__device__ __forceinline__ bool nf_set(const int *nf) { return nf != nullptr && *(const volatile int *)nf != 0; }

#endif /* __CUDACC__ */

#endif
