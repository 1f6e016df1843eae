/* attn/plan.c -- the dK / dV planner (attn/plan.h). */
#include "plan.h"
#include "../../rules.h"

#include <stdlib.h>

static int kwp_fits(const nsa_problem *p, const cu_device *d, const cu_overrides *o, const cu_views *v, int slc)
{
    if (!o->kwp || !cu_sm90(d, o) || p->G > 64 || 64 % p->G) return 0;
    if (p->DK != p->DV || (p->DK != 64 && p->DK != 128) || !cu_sm90_class(d, (int)p->DK)) return 0;
    if (kwp_smem((int)p->DK, slc) > (size_t)d->smem_max) return 0;
    return v->dout && v->q && v->k && v->v;
}

cu_dkdv_plan cu_plan_dkdv(const nsa_problem *p, const cu_device *d, const cu_overrides *o, const cu_views *v, int slc,
                          int dq_on_wgmma, int no_tma)
{
    cu_dkdv_plan pl = {CU_DKDV_KTILE, 64};
    if (slc) {
        if (!no_tma && kwp_fits(p, d, o, v, 1)) pl.kernel = CU_DKDV_KWP;
        return pl;
    }
    /* same tasks at 128 keys, same ordered partials: the wgmma tiles when the dQ could take its
     * sm_90a tile */
    if (!dq_on_wgmma || p->DK != p->DV || kwg_smem((int)p->DK) > (size_t)d->smem_max) return pl;
    pl.bk = KWG_BK;
    pl.kernel = !no_tma && kwp_fits(p, d, o, v, 0) ? CU_DKDV_KWP : CU_DKDV_KWG;
    return pl;
}

int cu_plan_cmp_segments(const nsa_problem *p, const cu_overrides *o)
{
    if (o->cmp_seg > 0) return o->cmp_seg;
    /* few key tiles, each seen by most queries: each tile's rows are cut into nseg absolute
     * row segments, and tile t has work only in the segments its queries reach (about half of
     * the tasks). Equal tasks still finish unevenly, so ~15 tasks with work per SM keep the
     * SMs busy to the end (64k, H 1: 32 segments left the SMs idle a third of the kernel, 128
     * cut the compressed backward by 14 %); each further segment costs its partial's write
     * and read (bk x (DK + DV) floats, for every tile of every sequence), so at most 4096
     * tasks over the whole batch, 128 segments, and no more segments than the longest
     * sequence has 64-row chunks (a segment holds whole chunks: the rest would be empty) */
    const int64_t nseq = p->cu_seqlens ? p->num_seqs : p->B; /* (as the tasks' seqmap counts them) */
    int64_t tiles = 0, rows_max = 0;
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t lq = p->cu_seqlens ? p->cu_seqlens[s + 1] - p->cu_seqlens[s] : p->T, lk = p->cu_seqlens ? lq : p->Tk;
        tiles += (nsa_rule_num_cmp(lk, p->cfg.cmp_len, p->cfg.cmp_stride) + KWG_BK - 1) / KWG_BK;
        rows_max = lq * p->G > rows_max ? lq * p->G : rows_max;
    }
    const int64_t chunks = (rows_max + 63) / 64;
    int nseg = 8;
    while (nseg < 128 && nseg * 2 <= chunks && tiles * nseg * 2 * p->H <= 4096) nseg *= 2;
    return nseg;
}

/* The segment planner's model of the window / dense dK / dV tile on an H100 / H200 (the
 * sizing pass does not query the device, and both passes must pick the same segments): 132
 * SMs take one task at a time in launch order; a task costs its 64-row chunks (~2 us each at
 * 128 keys), SEG_TASK chunks more for its K / V loads and its store, and a further segment
 * SEG_PART more for writing its partial (128 KB); the reduction of the partials and the fp32
 * dk / dv that segments need (no direct store: a memset, the adds, the conversion, ~32 bytes
 * an element more) cost their bytes at ~3 TB/s, SEG_BYTES_PER_CHUNK a chunk's time. */
#define SEG_SMS 132
#define SEG_TASK 2.0
#define SEG_PART 3.0
#define SEG_BYTES_PER_CHUNK 6.0e6

typedef struct seg_tile {
    int64_t seq, rbase, nrows; /* the tile's rows: flattened rows rbase .. rbase + nrows - 1 */
} seg_tile;

/* The predicted time, in chunks, of the tiles' tasks cut into nseg absolute row segments of
 * each sequence's rows (as kt_task_get cuts them), list-scheduled on SEG_SMS in launch order
 * (kv head, then per sequence segment-major). */
static double seg_makespan(const nsa_problem *p, const seg_tile *tl, int64_t ntiles, const int64_t *len, int nseg)
{
    double sm[SEG_SMS] = {0}; /* a binary min-heap of the SMs' busy-until times */
    for (int64_t h = 0; h < p->H; h++)
        for (int64_t i0 = 0; i0 < ntiles;) {
            int64_t i1 = i0; /* one sequence's tiles i0 .. i1 - 1 */
            while (i1 < ntiles && tl[i1].seq == tl[i0].seq) i1++;
            const int64_t all = len[tl[i0].seq] * p->G, sz = ((all + nseg - 1) / nseg + 63) / 64 * 64;
            for (int sg = 0; sg < nseg; sg++)
                for (int64_t i = i0; i < i1; i++) {
                    int64_t lo = tl[i].rbase, hi = tl[i].rbase + tl[i].nrows;
                    if (nseg > 1) {
                        lo = lo > sg * sz ? lo : sg * sz;
                        hi = hi < (sg + 1) * sz ? hi : (sg + 1) * sz;
                    }
                    const double cost = (hi > lo ? (double)((hi - lo + 63) / 64) + SEG_TASK : 0.2) + (sg > 0 ? SEG_PART : 0.0);
                    /* the earliest free SM takes it: replace the heap's root and sift down */
                    double v = sm[0] + cost;
                    int at = 0;
                    for (;;) {
                        int c = 2 * at + 1;
                        if (c >= SEG_SMS) break;
                        if (c + 1 < SEG_SMS && sm[c + 1] < sm[c]) c++;
                        if (sm[c] >= v) break;
                        sm[at] = sm[c], at = c;
                    }
                    sm[at] = v;
                }
            i0 = i1;
        }
    double end = 0.0;
    for (int i = 0; i < SEG_SMS; i++) end = sm[i] > end ? sm[i] : end;
    return end;
}

int cu_plan_range_segments(const nsa_problem *p, int64_t wl, int64_t wr, int causal, int64_t shift, int64_t nk,
                           const cu_overrides *o)
{
    if (o->range_seg > 0) return o->range_seg;
    /* One task per (key tile, kv head) visits every row that sees its keys. With few tasks of
     * unequal length (causal attention with one or two kv heads: 128 tasks at 16k, the first
     * seeing every row, the last a few) the longest sets the kernel's time while most SMs
     * idle: cut each sequence's rows into absolute segments (as the compressed rule's) where
     * the model above predicts a tenth or more saved. A window's tasks keep one: their rows
     * are the window's whatever the segments. */
    const int64_t nseq = p->cu_seqlens ? p->num_seqs : p->B, G = p->G, BK = KWG_BK;
    int64_t ntiles = 0, len_max = 0;
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t lq = p->cu_seqlens ? p->cu_seqlens[s + 1] - p->cu_seqlens[s] : p->T;
        const int64_t nkeys = nk >= 0 ? nk : p->cu_seqlens ? lq : p->Tk;
        ntiles += (nkeys + BK - 1) / BK;
        len_max = lq > len_max ? lq : len_max;
    }
    if (ntiles == 0 || ntiles * p->H > 4096) return 1; /* tasks enough to balance themselves */
    seg_tile *tl = (seg_tile *)malloc((size_t)ntiles * sizeof *tl);
    int64_t *len = (int64_t *)malloc((size_t)nseq * sizeof *len);
    int nseg = 1;
    if (!tl || !len) goto done;
    int64_t n = 0, rows_all = 0, longest = 0;
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t lq = p->cu_seqlens ? p->cu_seqlens[s + 1] - p->cu_seqlens[s] : p->T;
        const int64_t nkeys = nk >= 0 ? nk : p->cu_seqlens ? lq : p->Tk;
        len[s] = lq;
        for (int64_t k0 = 0; k0 < nkeys; k0 += BK, n++) {
            const int64_t k1 = k0 + BK < nkeys ? k0 + BK : nkeys;
            const int64_t qf = nsa_rule_window_q_first(k0, wr, causal, lq, lq + shift);
            const int64_t ql = nsa_rule_window_q_last(k1 - 1, wl, lq, lq + shift);
            tl[n].seq = s, tl[n].rbase = qf * G, tl[n].nrows = ql >= qf ? (ql - qf + 1) * G : 0;
            rows_all += tl[n].nrows;
            longest = tl[n].nrows > longest ? tl[n].nrows : longest;
        }
    }
    /* the longest task an eighth of an SM's share or less: list scheduling is within ~1/8 */
    if (longest * SEG_SMS <= rows_all * p->H / 8) goto done;
    const double fp32_bytes = 32.0 * (double)(p->cu_seqlens ? p->T : p->B * p->Tk) * (double)p->H * (double)(p->DK + p->DV);
    const double part_bytes = (double)BK * (double)(p->DK + p->DV) * 4.0 * (double)ntiles * (double)p->H;
    double best = seg_makespan(p, tl, ntiles, len, 1), base = best;
    for (int k = 2; k <= 64 && (int64_t)k * 64 <= len_max * G && ntiles * k * p->H <= 4096; k *= 2) {
        const double t = seg_makespan(p, tl, ntiles, len, k) + (fp32_bytes + (k - 1) * part_bytes) / SEG_BYTES_PER_CHUNK;
        if (t < best) best = t, nseg = k;
    }
    if (best > 0.9 * base) nseg = 1;
done:
    free(tl);
    free(len);
    return nseg;
}
