/* attn/plan.c -- the dK / dV planner (attn/plan.h). */
#include "plan.h"
#include "../../rules.h"

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

/* Sequence s's queries (lq) and the keys its rule chooses from (nkeys): the window rule's
 * explicit key count nk where it has one (>= 0), else the sequence's keys. */
static void seg_lens(const nsa_problem *p, int64_t nk, int64_t s, int64_t *lq, int64_t *nkeys)
{
    *lq = p->cu_seqlens ? p->cu_seqlens[s + 1] - p->cu_seqlens[s] : p->T;
    *nkeys = nk >= 0 ? nk : p->cu_seqlens ? *lq : p->Tk;
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
        int64_t lq, lk;
        seg_lens(p, -1, s, &lq, &lk);
        tiles += (nsa_rule_num_cmp(lk, p->cfg.cmp_len, p->cfg.cmp_stride) + KWG_BK - 1) / KWG_BK;
        rows_max = lq * p->G > rows_max ? lq * p->G : rows_max;
    }
    const int64_t chunks = (rows_max + 63) / 64;
    int nseg = 8;
    while (nseg < 128 && nseg * 2 <= chunks && tiles * nseg * 2 * p->H <= 4096) nseg *= 2;
    return nseg;
}

/* The window / dense dK / dV's segments aim at SEG_TASKS_MIN tasks with work: 5 / 4 of the 132
 * SMs of an H100 / H200 (a fixed count: the sizing pass does not query the device, and both
 * passes must pick the same segments). More segments than that cost more than they balance:
 * each writes and reads its partial, and dk / dv go through fp32 instead of the direct store
 * (the measurements by segment count: bench/NOTES.md, "Causal dK / dV with few kv heads"). */
#define SEG_TASKS_MIN 165
#define SEG_SMS 132

int cu_plan_range_segments(const nsa_problem *p, int64_t wl, int64_t wr, int causal, int64_t shift, int64_t nk,
                           const cu_overrides *o)
{
    if (o->range_seg > 0) return o->range_seg;
    /* One task per (key tile, kv head) visits every row that sees its keys. With fewer tasks
     * than SMs or a few more (causal attention with one or two kv heads: 128 tasks at 16k, the
     * first seeing every row, the last a few) the longest sets the kernel's time while most
     * SMs idle: cut each sequence's rows into absolute segments (as the compressed rule's), the
     * fewest that give SEG_TASKS_MIN tasks with work (a task is cut only where its rows cross
     * a segment's border). */
    const int64_t nseq = p->cu_seqlens ? p->num_seqs : p->B, G = p->G, BK = KWG_BK;
    int64_t ntiles = 0, len_max = 0;
    for (int64_t s = 0; s < nseq; s++) {
        int64_t lq, nkeys;
        seg_lens(p, nk, s, &lq, &nkeys);
        ntiles += (nkeys + BK - 1) / BK;
        len_max = lq > len_max ? lq : len_max;
    }
    /* nor for a window shorter than half the longest sequence (its tasks are about equal;
     * cutting them only adds partials), nor where the longest task is within 1.5x of an SM's
     * share of the rows */
    if (ntiles * p->H >= SEG_TASKS_MIN || (wl >= 0 && 2 * wl < len_max)) return 1;
    /* (fewer than SEG_TASKS_MIN tiles here) each tile's flattened rows [lo, hi) and its
     * sequence's rows */
    struct {
        int64_t lo, hi, all;
    } tl[SEG_TASKS_MIN];
    int n = 0;
    int64_t rows = 0, longest = 0;
    for (int64_t s = 0; s < nseq; s++) {
        int64_t lq, nkeys;
        seg_lens(p, nk, s, &lq, &nkeys);
        for (int64_t k0 = 0; k0 < nkeys; k0 += BK) {
            const int64_t k1 = k0 + BK < nkeys ? k0 + BK : nkeys;
            const int64_t qf = nsa_rule_window_q_first(k0, wr, causal, lq, lq + shift);
            const int64_t ql = nsa_rule_window_q_last(k1 - 1, wl, lq, lq + shift);
            if (ql < qf) continue;
            tl[n].lo = qf * G, tl[n].hi = (ql + 1) * G, tl[n].all = lq * G;
            rows += tl[n].hi - tl[n].lo;
            longest = tl[n].hi - tl[n].lo > longest ? tl[n].hi - tl[n].lo : longest;
            n++;
        }
    }
    if (2 * longest * SEG_SMS <= 3 * rows * p->H) return 1;
    for (int k = 2; k <= 64 && (int64_t)k * 512 <= len_max * G; k *= 2) { /* segments of 8 chunks or more */
        int64_t work = 0; /* tasks with rows: per tile, the segments its rows cross */
        for (int i = 0; i < n; i++) {
            const int64_t sz = cu_seg_rows(tl[i].all, k);
            work += (tl[i].hi - 1) / sz - tl[i].lo / sz + 1;
        }
        if (work * p->H >= SEG_TASKS_MIN) return k;
    }
    return 1;
}
