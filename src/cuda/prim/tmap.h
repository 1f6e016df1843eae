/* prim/tmap.h -- TMA tensor maps of the sm_90a tiles, encoded on the host through the
 * runtime's driver entry point (libnsa links no libcuda). */
#ifndef NSA_CUDA_PRIM_TMAP_H
#define NSA_CUDA_PRIM_TMAP_H

#include <cuda.h>
#include "run.h"

/* A 4-D map over the [B, rows, H, D] view v (16-bit elements, 16-byte aligned rows and
 * strides), boxes of 64 columns x box_heads heads x `box` rows x 1 batch with the 128-byte
 * swizzle; rows past the tensor read as zeros. @return 0 when it cannot be made (the caller
 * keeps a cp.async tile). */
int tmap_make_h(CUtensorMap *m, const dview *v, nsa_dtype dt, int64_t B, int64_t rows, int64_t H, int64_t D, int box,
                int box_heads);
/* ... with one head per box */
int tmap_make(CUtensorMap *m, const dview *v, nsa_dtype dt, int64_t B, int64_t rows, int64_t H, int64_t D, int box);

#endif
