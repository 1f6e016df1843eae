/* selected/lists.cu -- the usable-block lists of selected attention, their inversion (per
 * block, the ascending queries that selected it: what makes the selected dK / dV
 * deterministic), the segments of long query lists and the ordered reduction of their
 * partials. */
#include "selected.h"
#include "../prim/rowwise.cuh"
#include "../prim/nonfinite.cuh"
#include "../attn/dkdv_tasks.cuh"

__global__ void usable_kernel(dview idx, dview cnt, int64_t m, int64_t lp, int32_t *U, int32_t *ucnt, seqmap sm,
                              int64_t T, int64_t H, int64_t rows)
{
    const int64_t row = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    int64_t h, t, b;
    split_row(row, H, T, rows, &b, &t, &h);
    const seqinfo sq = seq_get(sm, seq_of_row(sm, b, t));
    const int64_t pos = t - sq.row0 + sq.shift, nb = nsa_rule_num_slc(sq.klen, lp); /* (its position) */
    int64_t c = m;
    if (cnt.p) {
        c = ((const int32_t *)cnt.p)[b * cnt.s0 + t * cnt.s1 + h * cnt.s2];
        c = c < 0 ? 0 : (c > m ? m : c);
    }
    const int32_t *ix = (const int32_t *)idx.p + b * idx.s0 + t * idx.s1 + h * idx.s2;
    int32_t *u = U + row * m;
    int k = 0;
    for (int64_t e = 0; e < c; e++) {
        const int32_t j = ix[e];
        if (j < 0 || j >= nb || !nsa_rule_slc_visible(j, pos, lp)) continue; /* not yet started */
        int q = k;
        while (q > 0 && u[q - 1] > j) q--;
        if (q > 0 && u[q - 1] == j) continue;
        for (int r = k; r > q; r--) u[r] = u[r - 1];
        u[q] = j;
        k++;
    }
    ucnt[row] = k;
}

void nsa_cu_usable(grun *g, const dview *idx, const dview *counts, int64_t m, int64_t lp, int32_t *U, int32_t *ucnt)
{
    const nsa_problem *p = g->p;
    const int64_t rows = p->B * p->T * p->H;
    if (!g_live(g) || rows == 0) return;
    dview none;
    memset(&none, 0, sizeof none);
    usable_kernel<<<grid1(rows, PREP_THREADS), PREP_THREADS, 0, g->st>>>(*idx, counts ? *counts : none, m, lp, U, ucnt,
                                                                       g_plain_map(g), p->T, p->H, rows);
    g_launched(g);
}

typedef struct inv_params {
    const int32_t *U, *ucnt;
    int32_t *cnt, *offs, *list;
    const int64_t *cnt_pref, *offs_pref, *list_pref;
    int64_t m, lp, T, H;
    seqmap sm;
    int64_t nb_max;  /* the cursors' ints in inv_fill's shared memory (the staging follows them) */
    int stage;       /* inv_fill: positions whose list entries a warp stages at once (0: none) */
} inv_params;

__device__ __forceinline__ int64_t inv_region(const int64_t *pref, unitspec u, int64_t s, const seqinfo &sq, int64_t H,
                                              int64_t h)
{
    const int64_t n = seq_units(u, sq.len, sq.klen); /* (dense: every sequence's) */
    return (pref ? pref[s] : s * n) * H + h * n;
}

/* per (sequence, chunk of positions, head): how many of the chunk's queries selected each block */
__global__ void inv_count_kernel(inv_params P)
{
    extern __shared__ int hist[];
    int64_t s, c;
    seq_decode(P.sm, blockIdx.x, &s, &c);
    const seqinfo sq = seq_get(P.sm, s);
    const int64_t h = blockIdx.y, nb = nsa_rule_num_slc(sq.klen, P.lp);
    for (int64_t j = threadIdx.x; j < nb; j += blockDim.x) hist[j] = 0;
    __syncthreads();
    const int64_t p0 = c * INV_CHUNK;
    const int64_t np = sq.len - p0 < INV_CHUNK ? sq.len - p0 : INV_CHUNK;
    for (int64_t i = threadIdx.x; i < np * P.m; i += blockDim.x) {
        const int64_t pp = i / P.m, e = i % P.m;
        const int64_t row = (sq.b * P.T + sq.row0 + p0 + pp) * P.H + h;
        if (e < P.ucnt[row]) atomicAdd(&hist[P.U[row * P.m + e]], 1);
    }
    __syncthreads();
    unitspec uc = {UK_INV_CNT, INV_CHUNK, P.lp, 0, 0};
    int32_t *cnt = P.cnt + inv_region(P.cnt_pref, uc, s, sq, P.H, h) + c * nb;
    for (int64_t j = threadIdx.x; j < nb; j += blockDim.x) cnt[j] = hist[j];
}

/* per (sequence, head): block offsets, and each chunk's first slot per block */
__global__ void inv_scan_kernel(inv_params P)
{
    __shared__ int wsum[32];
    __shared__ int carry;
    const int64_t s = blockIdx.x, h = blockIdx.y;
    const seqinfo sq = seq_get(P.sm, s);
    const int64_t nb = nsa_rule_num_slc(sq.klen, P.lp), nch = (sq.len + INV_CHUNK - 1) / INV_CHUNK;
    unitspec uc = {UK_INV_CNT, INV_CHUNK, P.lp, 0, 0}, uo = {UK_INV_OFFS, 0, P.lp, 0, 0};
    int32_t *cnt = P.cnt + inv_region(P.cnt_pref, uc, s, sq, P.H, h);
    int32_t *offs = P.offs + inv_region(P.offs_pref, uo, s, sq, P.H, h);
    for (int64_t j = threadIdx.x; j < nb; j += blockDim.x) {
        int tot = 0;
        for (int64_t c = 0; c < nch; c++) tot += cnt[c * nb + j];
        offs[j] = tot;
    }
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int64_t base = 0; base < nb; base += blockDim.x) {
        const int64_t j = base + threadIdx.x;
        const int v = j < nb ? offs[j] : 0;
        const int x = block_scan_pass<int>(v, wsum, &carry);
        if (j < nb) offs[j] = x;
    }
    if (threadIdx.x == 0) offs[nb] = carry;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < nb; j += blockDim.x) {
        int run = offs[j];
        for (int64_t c = 0; c < nch; c++) {
            const int t = cnt[c * nb + j];
            cnt[c * nb + j] = run;
            run += t;
        }
    }
}

/* per (sequence, chunk, head), one warp: the chunk's queries in ascending order into the
 * lists (a query's blocks are distinct, so the lanes never share a cursor). The walk is
 * serial over the chunk's positions; with P.stage the warp first copies `stage` positions'
 * counts and entries into shared memory in coalesced loads, so the walk waits on shared
 * memory only (one global load chain a position made it ~0.34 ms at any length) */
__global__ void inv_fill_kernel(inv_params P)
{
    extern __shared__ int cursor[];
    int64_t s, c;
    seq_decode(P.sm, blockIdx.x, &s, &c);
    const seqinfo sq = seq_get(P.sm, s);
    const int64_t h = blockIdx.y, nb = nsa_rule_num_slc(sq.klen, P.lp);
    const int lane = threadIdx.x, m = (int)P.m;
    unitspec uc = {UK_INV_CNT, INV_CHUNK, P.lp, 0, 0}, ul = {UK_LIST, P.m, 1, 0, 0};
    const int32_t *cnt = P.cnt + inv_region(P.cnt_pref, uc, s, sq, P.H, h) + c * nb;
    int32_t *list = P.list + inv_region(P.list_pref, ul, s, sq, P.H, h);
    for (int64_t j = lane; j < nb; j += 32) cursor[j] = cnt[j];
    __syncwarp();
    const int64_t p0 = c * INV_CHUNK;
    const int64_t np = sq.len - p0 < INV_CHUNK ? sq.len - p0 : INV_CHUNK;
    const int64_t row0 = (sq.b * P.T + sq.row0 + p0) * P.H + h; /* position pp's row: row0 + pp H */
    auto place = [&](int64_t pp, int k, const int32_t *ent) {
        for (int e = lane; e < k; e += 32) {
            const int j = ent[e];
            const int slot = cursor[j];
            cursor[j] = slot + 1;
            list[slot] = (int32_t)(p0 + pp);
        }
        __syncwarp();
    };
    if (P.stage) {
        int *scnt = cursor + P.nb_max, *sent = scnt + P.stage;
        for (int64_t q0 = 0; q0 < np; q0 += P.stage) {
            const int n = np - q0 < P.stage ? (int)(np - q0) : P.stage;
            for (int i = lane; i < n; i += 32) scnt[i] = P.ucnt[row0 + (q0 + i) * P.H];
            __syncwarp();
            /* only the entries below each position's count: the rest of U may never be written */
            for (int i = lane; i < n * m; i += 32)
                if (i % m < scnt[i / m]) sent[i] = P.U[(row0 + (q0 + i / m) * P.H) * P.m + i % m];
            __syncwarp();
            for (int i = 0; i < n; i++) place(q0 + i, scnt[i], sent + i * m);
        }
        return;
    }
    for (int64_t pp = 0; pp < np; pp++) {
        const int64_t row = row0 + pp * P.H;
        place(pp, P.ucnt[row], P.U + row * P.m);
    }
}

void nsa_cu_invert(grun *g, const int32_t *U, const int32_t *ucnt, int64_t m, int64_t lp, inv_index *ix)
{
    const nsa_problem *p = g->p;
    unitspec uc = {UK_INV_CNT, INV_CHUNK, lp, 0, 0}, uo = {UK_INV_OFFS, 0, lp, 0, 0}, ul = {UK_LIST, m, 1, 0, 0};
    unitspec uch = {UK_ROWS, 1, INV_CHUNK, 0, 0};
    int64_t ncnt, noffs, nlist, nchunks;
    const int64_t *cnt_pref = g_prefix(g, uc, &ncnt);
    ix->offs_pref = g_prefix(g, uo, &noffs);
    ix->list_pref = g_prefix(g, ul, &nlist);
    /* per-head copies of each prefix's units, plus one end entry */
    const size_t H = nsa_size_of(p->H);
    int32_t *cnt = (int32_t *)g_take_n(g, nsa_size_add(nsa_size_mul(nsa_size_of(ncnt), H), 1), sizeof(int32_t));
    ix->offs = (int32_t *)g_take_n(g, nsa_size_add(nsa_size_mul(nsa_size_of(noffs), H), 1), sizeof(int32_t));
    ix->list = (int32_t *)g_take_n(g, nsa_size_add(nsa_size_mul(nsa_size_of(nlist), H), 1), sizeof(int32_t));
    seqmap sm = g_seqmap(g, uch, &nchunks);
    int64_t nb_max = 0;
    for (int64_t s = 0; s < p->num_seqs; s++) {
        const int64_t len = p->cu_seqlens ? p->cu_seqlens[s + 1] - p->cu_seqlens[s] : p->Tk;
        const int64_t nb = nsa_rule_num_slc(len, lp);
        nb_max = nb > nb_max ? nb : nb_max;
    }
    const size_t hist_bytes = nsa_size_mul(nsa_size_of(nb_max > 0 ? nb_max : 1), sizeof(int));
    if (hist_bytes > 200 * 1024) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "config.slc_block: a sequence of %lld selection blocks, the CUDA backend "
               "takes at most 51200 per sequence", (long long)nb_max);
        return;
    }
    if (!g_live(g) || p->H == 0) return;
    inv_params P;
    memset(&P, 0, sizeof P);
    P.U = U, P.ucnt = ucnt, P.cnt = cnt, P.offs = ix->offs, P.list = ix->list;
    P.cnt_pref = cnt_pref, P.offs_pref = ix->offs_pref, P.list_pref = ix->list_pref;
    P.m = m, P.lp = lp, P.T = p->T, P.H = p->H, P.sm = sm;
    /* inv_fill stages 32 positions' entries after its cursors where they fit (m <= 64: 8 KB) */
    P.nb_max = nb_max > 0 ? nb_max : 1;
    const size_t stage_bytes = (size_t)(32 + 32 * m) * sizeof(int), fill_bytes = hist_bytes + stage_bytes;
    if (m <= 64 && fill_bytes <= (size_t)g->dev.smem_max) P.stage = 32;
    const size_t fill_smem = P.stage ? fill_bytes : hist_bytes;
    if (hist_bytes > 48 * 1024) g_smem_optin(g, (const void *)inv_count_kernel, hist_bytes);
    if (fill_smem > 48 * 1024) g_smem_optin(g, (const void *)inv_fill_kernel, fill_smem);
    if (!g_live(g)) return;
    if (nchunks > 0) {
        inv_count_kernel<<<dim3((unsigned)nchunks, (unsigned)p->H), 256, hist_bytes, g->st>>>(P);
        g_launched(g);
    }
    if (p->num_seqs > 0) {
        seqmap plain = g_plain_map(g);
        P.sm = plain;
        inv_scan_kernel<<<dim3((unsigned)p->num_seqs, (unsigned)p->H), 1024, 0, g->st>>>(P);
        g_launched(g);
        P.sm = sm;
    }
    if (nchunks > 0) {
        inv_fill_kernel<<<dim3((unsigned)nchunks, (unsigned)p->H), 32, fill_smem, g->st>>>(P);
        g_launched(g);
    }
}

/* xoff = exclusive prefix over the flat offs array of the further segments per entry (one block) */
__global__ void slc_segments_kernel(const int32_t *offs, int64_t nflat, int64_t segp, int32_t *xoff)
{
    __shared__ int wsum[32];
    __shared__ int carry;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int64_t base = 0; base < nflat; base += blockDim.x) {
        const int64_t f = base + threadIdx.x;
        int v = 0;
        if (f + 1 < nflat) {
            const int64_t c = (int64_t)offs[f + 1] - offs[f]; /* <= 0 past a region's last block */
            v = c > segp ? (int)((c - 1) / segp) : 0;
        }
        const int x = block_scan_pass<int>(v, wsum, &carry);
        if (f < nflat) xoff[f] = x;
    }
    if (threadIdx.x == 0) xoff[nflat] = carry;
}

void nsa_cu_slc_segments(grun *g, const inv_index *ix, int64_t nflat, int64_t segp, int32_t *xoff)
{
    if (!g_live(g)) return;
    slc_segments_kernel<<<1, 1024, 0, g->st>>>(ix->offs, nflat, segp, xoff);
    g_launched(g);
}

/* The reduction's CTAs per (key tile, head): the blocks every position selects (the first, the
 * local ones) have the longest lists, so one CTA a tile left their sums to a few SMs at the end */
#define SLC_REDUCE_SPLIT 8

/* per key tile (sequence, block, 64-key sub-tile, head) and slice blockIdx.z of its elements:
 * += the partials of its further segments, in segment order (loads issued ahead, adds in order) */
__global__ void slc_reduce_kernel(kparams P)
{
    if (nf_set(P.nf)) return; /* the scalar kernels added dk / dv whole (nonfinite.cuh) */
    int64_t s, local;
    seq_decode(P.sm, blockIdx.x, &s, &local);
    const seqinfo sq = seq_get(P.sm, s);
    const int64_t h = blockIdx.y, lp = P.rule.lp, j = local / P.nsub, sub = local % P.nsub;
    const int64_t nb1 = nsa_rule_num_slc(sq.klen, lp) + 1; /* (dense: every sequence's) */
    const int64_t f = (P.offs_pref ? P.offs_pref[s] : s * nb1) * P.H + h * nb1 + j;
    const int64_t x0 = P.xoff[f], x1 = P.xoff[f + 1];
    if (x0 == x1) return;
    const int64_t bend = nsa_rule_slc_end(j, lp, sq.klen);
    const int64_t k0 = nsa_rule_slc_lo(j, lp) + sub * 64, k1 = k0 + 64 < bend ? k0 + 64 : bend;
    if (k0 >= k1) return;
    const int64_t step = P.nsub * 64 * (P.DK + P.DV); /* the next segment's partial of the same element */
    kt_partials_add(P, P.part + (x0 * P.nsub + sub) * 64 * (P.DK + P.DV), step, x1 - x0, 64, k1 - k0,
                    sq.b * P.KR + sq.row0 + k0, h);
}

void nsa_cu_slc_reduce(grun *g, const kparams *P, int64_t tiles)
{
    if (!g_live(g) || tiles == 0) return;
    slc_reduce_kernel<<<dim3((unsigned)tiles, (unsigned)P->H, SLC_REDUCE_SPLIT), 256, 0, g->st>>>(*P);
    g_launched(g);
}
