/* prim/tmap.cu -- TMA tensor maps (prim/tmap.h). */
#include "tmap.h"

typedef CUresult (*tmap_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                   const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* cuTensorMapEncodeTiled through the runtime's driver entry point (libnsa links no libcuda);
 * NULL when the driver has none */
static tmap_encode_fn tmap_encoder(void)
{
    static int tried;
    static tmap_encode_fn fn;
    if (!tried) {
        tried = 1;
        void *f = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (tmap_encode_fn)f;
        else
            cudaGetLastError();
    }
    return fn;
}

/* A 4-D map over the [B, rows, H, D] view v (16-bit elements, 16-byte aligned rows and
 * strides: dview.al), boxes of 64 columns x box_heads heads x `box` rows x 1 batch with the
 * 128-byte swizzle (a box lands as box x box_heads rows of 128 bytes, head fastest) (the canonical layout of prim/wgmma.cuh's sw_off); rows past the tensor read as zeros.
 * Returns 0 when it cannot be made (the caller keeps the cp.async tile). */
int tmap_make_h(CUtensorMap *m, const dview *v, nsa_dtype dt, int64_t B, int64_t rows, int64_t H, int64_t D,
                       int box, int box_heads)
{
    const tmap_encode_fn fn = tmap_encoder();
    if (!fn || !v->al || D % 64 || rows < 1 || B < 1 || H < 1) return 0; /* (no keys: nothing to load) */
    const int64_t s1 = v->s1 * 2, s2 = v->s2 * 2, s0 = B > 1 ? v->s0 * 2 : s1 * rows;
    const cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)H, (cuuint64_t)rows, (cuuint64_t)B};
    const cuuint64_t strides[3] = {(cuuint64_t)s2, (cuuint64_t)s1, (cuuint64_t)s0};
    if (box_heads < 1 || box_heads > H || box < 1 || box > 256 || box_heads > 256) return 0;
    const cuuint32_t boxd[4] = {64, (cuuint32_t)box_heads, (cuuint32_t)box, 1}, es[4] = {1, 1, 1, 1};
    for (int i = 0; i < 3; i++)
        if (strides[i] % 16 || strides[i] >= ((cuuint64_t)1 << 40)) return 0;
    const CUtensorMapDataType t = dt == NSA_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    return fn(m, t, 4, v->p, dims, strides, boxd, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

int tmap_make(CUtensorMap *m, const dview *v, nsa_dtype dt, int64_t B, int64_t rows, int64_t H, int64_t D, int box)
{
    return tmap_make_h(m, v, dt, B, rows, H, D, box, 1);
}
