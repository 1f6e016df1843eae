/* range/reduce.cu -- the ordered reduction of the compressed dK / dV row segments' partials. */
#include "range.h"
#include "../prim/nonfinite.cuh"

/* per compressed key tile (sequence, tile, head): += the partials of row segments 1.., in order */
__global__ void seg_reduce_kernel(kparams P, seqmap tm)
{
    if (nf_set(P.nf)) return; /* the scalar kernels added dk / dv whole (nonfinite.cuh) */
    int64_t s, kt;
    seq_decode(tm, blockIdx.x, &s, &kt);
    const seqinfo sq = seq_get(tm, s);
    const int64_t h = blockIdx.y;
    const int is_cmp = P.rule.kind == RULE_CMP;
    const int64_t nkeys = is_cmp ? sq.ncmp : sq.klen, key_row0 = is_cmp ? sq.cmp0 : sq.row0;
    const int64_t bk = P.bk, k0 = kt * bk, k1 = k0 + bk < nkeys ? k0 + bk : nkeys;
    if (k0 >= k1) return;
    /* ktile's task of (tile kt, segment sg): segment-major within the sequence */
    const int64_t task0 = (P.sm.first ? P.sm.first[s] : s * P.sm.per_seq) + kt, ntl = (nkeys + bk - 1) / bk;
    const int64_t W = P.DK + P.DV;
    for (int64_t i = threadIdx.x; i < (k1 - k0) * W; i += blockDim.x) {
        const int64_t key = i / W, col = i % W;
        const int64_t po = col < P.DK ? key * P.DK + col : bk * P.DK + key * P.DV + (col - P.DK);
        float sum = 0.0f;
        for (int64_t sg = 1; sg < P.nseg; sg++) sum += P.part[((task0 + sg * ntl) * P.H + h) * bk * W + po];
        const int64_t row = (sq.b * P.KR + key_row0 + k0 + key) * P.H + h;
        if (col < P.DK) P.dk[row * P.DK + col] += sum;
        else P.dv[row * P.DV + (col - P.DK)] += sum;
    }
}

void nsa_cu_seg_reduce(grun *g, const kparams *P, seqmap tm, int64_t tiles)
{
    if (!g_live(g) || tiles == 0) return;
    seg_reduce_kernel<<<dim3((unsigned)tiles, (unsigned)P->H), 256, 0, g->st>>>(*P, tm);
    g_launched(g);
}
