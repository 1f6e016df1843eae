/* range/reduce.cu -- the ordered reduction of the range dK / dV row segments' partials (the
 * compressed rule's, and causal attention's with few kv heads: attn/plan.c). */
#include "range.h"
#include "../prim/nonfinite.cuh"
#include "../attn/dkdv_tasks.cuh"

/* The reduction's CTAs per (key tile, head): a tile's partial is bk x (DK + DV) floats (128 KB
 * at 128 keys, D 128), and the tiles are few (32 at 64k), so one CTA a tile left most SMs idle
 * and each thread's serial walk over the segments latency-bound. */
#define SEG_REDUCE_SPLIT 32

/* per key tile (sequence, tile, head) and slice blockIdx.z of its elements:
 * += the partials of row segments 1.., in segment order (loads issued ahead, adds in order) */
__global__ void seg_reduce_kernel(kparams P, seqmap tm)
{
    if (nf_set(P.nf)) return; /* the scalar kernels added dk / dv whole (nonfinite.cuh) */
    int64_t s, kt;
    seq_decode(tm, blockIdx.x, &s, &kt);
    const seqinfo sq = seq_get(tm, s);
    const int64_t h = blockIdx.y;
    const int is_cmp = P.rule.kind == RULE_CMP;
    const int64_t nkeys = rule_nkeys(P.rule, sq), key_row0 = is_cmp ? sq.cmp0 : sq.row0;
    const int64_t bk = P.bk, k0 = kt * bk, k1 = k0 + bk < nkeys ? k0 + bk : nkeys;
    if (k0 >= k1) return;
    /* ktile's task of (tile kt, segment sg): segment-major within the sequence */
    const int64_t task0 = (P.sm.first ? P.sm.first[s] : s * P.sm.per_seq) + kt, ntl = (nkeys + bk - 1) / bk;
    const int64_t step = ntl * P.H * bk * (P.DK + P.DV); /* one segment further: the same element's next partial */
    kt_partials_add(P, P.part + ((task0 + ntl) * P.H + h) * bk * (P.DK + P.DV), step, P.nseg - 1, bk, k1 - k0,
                    sq.b * P.KR + key_row0 + k0, h);
}

void nsa_cu_seg_reduce(grun *g, const kparams *P, seqmap tm, int64_t tiles)
{
    if (!g_live(g) || tiles == 0) return;
    seg_reduce_kernel<<<dim3((unsigned)tiles, (unsigned)P->H, SEG_REDUCE_SPLIT), 256, 0, g->st>>>(*P, tm);
    g_launched(g);
}
