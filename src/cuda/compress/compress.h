/* compress/compress.h -- compression by mean pooling (spec section 1) and its backward. */
#ifndef NSA_CUDA_COMPRESS_COMPRESS_H
#define NSA_CUDA_COMPRESS_COMPRESS_H

#include "../prim/common.cuh"

/* x [B, T, H, D] -> mean-pooled x_cmp [B, cmp_rows, H, D] into `out` (any float view). */
void nsa_cu_compress(grun *g, const dview *x, int64_t D, const dview *out);
/* dx [B, T, H, D] from dx_cmp: src is a view (src32 NULL) or a flat fp32 buffer (src32);
 * the result is stored into `dx` (a view) or added to the flat fp32 buffer dx32. */
void nsa_cu_compress_bwd(grun *g, const dview *src, const float *src32, int64_t D, const dview *dx, float *dx32);

#endif
