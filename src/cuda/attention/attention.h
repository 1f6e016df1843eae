/* attention/attention.h -- the attention op with every option of nsa.h section 5 (spec
 * section 5): Tq != Tk, separate q / k packings, softcap, sinks, segment ids, bias, mask,
 * dropout, head dims up to 256. Plain calls run the tuned tiles of attn/ and range/; the rest
 * the option-complete kernels of kernels.cuh (launch.cu). */
#ifndef NSA_CUDA_ATTENTION_ATTENTION_H
#define NSA_CUDA_ATTENTION_ATTENTION_H

#include "../attn/tiles.h"

/* A 4-D view [d0, d1, d2, d3] with explicit strides (elements); a size-1 dim that broadcasts
 * has stride 0 here, so the kernels index every tensor alike. */
typedef struct pview {
    const void *p;
    int dt;
    int64_t s0, s1, s2, s3;
} pview;

enum { XK_FWD = 0, XK_DQ = 1, XK_DKV = 2 };
enum { XW_DV = 1, XW_DK = 2 }; /* xdkv_kernel: which gradients one pass computes */

typedef struct xparams {
    dview q, k, v, o, lse, dout, dq, dk, dv;
    pview bias, mask, qseg, kseg;  /* p NULL: absent; qseg / kseg: [B, T] (s0, s1) */
    const float *sinks;            /* [HQ] at stride sinks_s, or NULL */
    int64_t sinks_s;
    float *dbias;                  /* fp32 [dbB, dbH, Tq, Tk], added to; NULL: not wanted */
    int64_t dbB, dbH;
    float *Dw;                     /* [B, Tq, HQ] rowsum(dout * o); with sinks xdq_kernel writes
                                      sum_j P z dP~ there instead (backward) */
    /* sequences: device cu_q / cu_k [nseq + 1] and the tile prefix of this launch (query
     * tiles for XK_FWD / XK_DQ, key tiles for XK_DKV); NULL: dense batch, sequence = z */
    const int64_t *cuq, *cuk, *first;
    int64_t nseq, B, Tq, Tk, HQ, H, G;
    int DK, DV;
    float scale, cap;
    int causal;
    int64_t wl, wr;
    int dropout;
    uint32_t thresh;               /* keep iff Philox word >= thresh */
    float rp;                      /* 1 / (1 - p) */
    uint64_t seed, offset;
    int loop_b, loop_h;            /* XK_DQ with a broadcast dbias: batch / heads looped in a CTA */
    int which;                     /* XK_DKV: XW_DV | XW_DK */
    const int *nf;                 /* the call's non-finite flag (run.h; NULL: never set) */
    int flex_rows;                 /* a row whose visible scores are all -inf is empty (nsa_problem.flex_rows) */
} xparams;

#define XQ_BM 64 /* query rows per forward / dQ CTA; keys per dK / dV CTA */
/* keys per chunk (forward, dQ) and query rows per chunk (dK / dV): fewer at DP 256, whose
 * accumulators already take 128 registers a thread */
#define XQ_BN(DP) ((DP) == 256 ? 32 : 64)
#define XQ_BQ(DP) ((DP) == 64 ? 64 : 32)
/* Two stages of every chunk (the next one loads during this one's products); side: the call
 * has bias, mask or dropout, whose per-chunk table (64 x 64 floats and bytes) comes last */
static inline constexpr size_t xattn_smem(int DP, int kind, int side)
{
    const size_t LD = (size_t)DP + 8, tab = side ? 64 * 64 * 5 : 0;
    if (kind == XK_FWD) return (XQ_BM + 4 * (size_t)XQ_BN(DP)) * LD * 2 + 2 * (size_t)XQ_BN(DP) * 4 + tab;
    if (kind == XK_DQ) return (2 * XQ_BM + 4 * (size_t)XQ_BN(DP)) * LD * 2 + 2 * (size_t)XQ_BN(DP) * 4 + tab;
    return (2 * XQ_BM + 4 * (size_t)XQ_BQ(DP)) * LD * 2 + 2 * (size_t)XQ_BQ(DP) * 5 * 4 + tab;
}
/* One launch of kernel `kind` on `grid` (x, y, z), head dims padded to 64 / 128 / 256. */
void nsa_cu_xattn_64(grun *g, const xparams *P, int kind, int bf16, const int64_t grid[3]);
void nsa_cu_xattn_128(grun *g, const xparams *P, int kind, int bf16, const int64_t grid[3]);
void nsa_cu_xattn_256(grun *g, const xparams *P, int kind, int bf16, const int64_t grid[3]);
/* The same launch on the scalar kernels (simt.cu): for calls whose inputs may hold a
 * non-finite value, launched beside the tiles with only_if = the call's flag (they run only
 * when it is set, when the tiles stand aside). */
void nsa_cu_xattn_simt(grun *g, const xparams *P, int kind, const int *only_if);
/* dsinks[hq] = -sum over rows of exp(sink - lse) * Dw (deterministic order). */
void nsa_cu_xsinks(grun *g, const xparams *P, float *dsinks, int64_t ds_stride);
/* the fp32 dbias accumulator [dbB, dbH, Tq, Tk] -> the caller's dbias (any float dtype) */
void nsa_cu_xdbias_store(grun *g, const xparams *P, const pview *dst);

/* The attention op with options (launch.cu): any of Tq != Tk, varlen_qk, softcap, sinks,
 * segment ids, bias, mask, dropout, or head dims beyond the tiles' (up to 256). */
int cu_xattn_supported(grun *g, nsa_dtype dt); /* marks NOT_SUPPORTED and returns 0 if not */
void cu_xattn_fwd(grun *g, const nsa_attention_args *a);
void cu_xattn_bwd(grun *g, const nsa_attention_bwd_args *a);

#endif
