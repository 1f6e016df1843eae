/* step/step.cu -- the inference step (nsa.h section 8, spec 12) on the GPU, on scalar kernels:
 *   step_prep_kernel    per sequence: lengths, counts and the pages it will touch, read on the
 *                       device (no host synchronisation: a captured graph replays for any
 *                       lengths; a sequence with a problem is skipped, its code written and
 *                       its output rows blanked, as every row past a sequence's queries is);
 *                       the step's tokens into the token cache; the compressed rows those
 *                       tokens complete (mean pooling)
 *   step_query_kernel   one warp per (sequence, new query, kv head): the compressed branch of
 *                       the G heads, their summed probabilities into the warp's slice of the
 *                       workspace, the selection (importance streamed block by block into a
 *                       ranked list in shared memory), then per head the three branches and
 *                       the gates -- the CPU step's arithmetic (src/cpu/step.c), fp32, any dtype.
 *   step_dense_kernel   the dense step (nsa_attention_step): one warp per (sequence, new query,
 *                       query head), two passes over its visible cached keys (max, then weights)
 *                       after the same check and append kernels.
 * The workspace depends on the shapes only (capacities, not lengths), so a graph keeps it.
 * These kernels are the reference of the GPU step and take every shape; the common ones (bf16 /
 * f16, DK = DV in {64, 128}, G <= 16) run on the tensor-core kernels of tiled.cu instead. */
#include "step.h"

#define STEP_WARPS 4
#define STEP_MAX_WARPS 2048 /* query warps in flight: each owns a compressed-capacity slice of workspace */

static int cu_step_supported(grun *g, const nsa_step_args *a);

/* Query slot i of sequence b and kv head h that no query fills (i >= n_b, or the sequence
 * skipped): its G rows of o zero, of lse -inf, its selection -1, as the CPU step writes them --
 * every row of the outputs is defined after a step, so a caller needs no fill of its own. One
 * warp. */
__device__ void step_blank_rows(const step_params &P, int64_t b, int64_t i, int64_t h, int lane)
{
    for (int64_t hq = h * P.G; hq < (h + 1) * P.G; hq++) {
        const int64_t off = b * P.o.s0 + i * P.o.s1 + hq * P.o.s2;
        for (int c = lane; c < P.DV; c += 32) st_any(P.o.p, P.o.dt, off + c, 0.0f);
        if (P.lse.p && lane == 0) ((float *)P.lse.p)[b * P.lse.s0 + i * P.lse.s1 + hq * P.lse.s2] = -INFINITY;
    }
    if (P.idx.p)
        for (int64_t a = lane; a < P.n; a += 32) ((int32_t *)P.idx.p)[b * P.idx.s0 + i * P.idx.s1 + h * P.idx.s2 + a] = -1;
}

/* The compressed rows one step can complete: n new tokens complete at most n / d + 1. */
static inline int64_t step_pool_rows(const nsa_problem *p, const step_params &P) { return P.pool ? p->T / p->cfg.cmp_stride + 1 : 0; }

/* Everything before the queries, in one launch: per sequence b, `chunks` CTAs, each checking b
 * itself (the first writes its code and ok[b]), whose warps share the sequence's (Tq + rows) * H
 * items: item k < Tq * H appends token k / H of kv head k % H (or, for the scalar kernels,
 * blanks its output rows when no query fills them: past n_b, or the whole sequence when it is
 * skipped; the tensor-core kernels' last ones do that themselves), the others pool the compressed
 * rows the step completes, Nc(L - n) .. Nc(L) - 1, as the mean of their l token rows (summed in
 * order, then times 1 / l), reading the step's own tokens from k_new / v_new so no warp waits for
 * another. */
#define STEP_PREP_THREADS 256
__global__ void step_prep_kernel(const step_params P, int64_t rows, int64_t chunks, int blank)
{
    const int lane = threadIdx.x & 31, wpc = (int)(blockDim.x >> 5); /* warps a CTA */
    const int64_t per_b = (P.Tq + rows) * P.H > 0 ? (P.Tq + rows) * P.H : 1;
    const float inv_l = 1.0f / (float)P.l;
    const int64_t chunk = blockIdx.x % chunks;
    for (int64_t b = blockIdx.x / chunks; b < P.B; b += gridDim.x / chunks) {
        const step_seq_t s = step_seq(P, b); /* read once: after the stores below it would be read again */
        const int e = step_problem_cta(P, b, s);
        if (chunk == 0 && threadIdx.x == 0) {
            P.ok[b] = e == NSA_STEP_OK;
            if (P.errors) P.errors[b * P.errors_s] = e;
        }
        for (int64_t k = chunk * wpc + (threadIdx.x >> 5); k < per_b; k += chunks * wpc) {
            if (k < P.Tq * P.H) {
                const int64_t h = k % P.H, i = k / P.H;
                if (e != NSA_STEP_OK || i >= s.n) {
                    if (blank) step_blank_rows(P, b, i, h, lane);
                    continue;
                }
                if (!P.append) continue;
                const int64_t r = s.L0 + i;
                /* the rows' places found once, and each lane's pieces loaded before any is stored:
                 * a store may alias the block table or the new tokens as far as the compiler knows,
                 * so a lookup or load after a store would wait for it (a chain of round trips) */
                const int64_t ko = step_row(P.kv, P.kv.k, b, r, h), vo = step_row(P.kv, P.kv.v, b, r, h);
                const int64_t kn = b * P.kn.s0 + i * P.kn.s1 + h * P.kn.s2, vn = b * P.vn.s0 + i * P.vn.s1 + h * P.vn.s2;
                for (int c0 = 0; c0 < (P.DK > P.DV ? P.DK : P.DV); c0 += 32 * 8) {
                    float xk[8], xv[8];
#pragma unroll
                    for (int u = 0; u < 8; u++) {
                        const int c = c0 + 32 * u + lane;
                        xk[u] = c < P.DK ? ld_any(P.kn.p, P.kn.dt, kn + c) : 0.0f;
                        xv[u] = c < P.DV ? ld_any(P.vn.p, P.vn.dt, vn + c) : 0.0f;
                    }
#pragma unroll
                    for (int u = 0; u < 8; u++) {
                        const int c = c0 + 32 * u + lane;
                        if (c < P.DK) st_any(P.kv.k.p, P.kv.k.dt, ko + c, xk[u]);
                        if (c < P.DV) st_any(P.kv.v.p, P.kv.v.dt, vo + c, xv[u]);
                    }
                }
                continue;
            }
            if (e != NSA_STEP_OK) break; /* a skipped sequence pools nothing */
            const int64_t h = (k - P.Tq * P.H) % P.H, c = nsa_rule_num_cmp(s.L - s.n, P.l, P.d) + (k - P.Tq * P.H) / P.H;
            if (c >= nsa_rule_num_cmp(s.L, P.l, P.d)) continue;
            for (int x = 0; x < 2; x++) {
                const dview &src = x ? P.kv.v : P.kv.k, &dst = x ? P.ckv.v : P.ckv.k, &nw = x ? P.vn : P.kn;
                const int D = x ? P.DV : P.DK;
                for (int e2 = lane; e2 < D; e2 += 32) {
                    float sum = 0.0f;
                    for (int64_t r = c * P.d; r < c * P.d + P.l; r++)
                        sum += r >= s.L0 && P.append ? ld_any(nw.p, nw.dt, b * nw.s0 + (r - s.L0) * nw.s1 + h * nw.s2 + e2)
                                                     : ld_any(src.p, src.dt, step_row(P.kv, src, b, r, h) + e2);
                    st_any(dst.p, dst.dt, step_row(P.ckv, dst, b, c, h) + e2, sum * inv_l);
                }
            }
        }
    }
}

/* Online softmax over one key for a lane's columns (the CPU step's soft_add). */
__device__ __forceinline__ void step_soft_add(float sc, const float (&v)[SIMT_COLS], float &m, float &l, float (&acc)[SIMT_COLS])
{
    if (sc > m) {
        const float alpha = m == -INFINITY ? 0.0f : expf(m - sc);
        l *= alpha;
#pragma unroll
        for (int c = 0; c < SIMT_COLS; c++) acc[c] *= alpha;
        m = sc;
    }
    const float p = m == -INFINITY ? (sc != sc ? sc : 0.0f) : expf(sc - m);
    l += p;
#pragma unroll
    for (int c = 0; c < SIMT_COLS; c++) acc[c] = fmaf(p, v[c], acc[c]);
}

__global__ void __launch_bounds__(32 * STEP_WARPS) step_query_kernel(const step_params P)
{
    extern __shared__ unsigned char step_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t width = P.m > P.n ? P.m : P.n;
    int32_t *kidx = (int32_t *)step_smem + warp * width;                      /* ranked list: blocks */
    float *kimp = (float *)(step_smem + STEP_WARPS * width * 4) + warp * width; /* ... their importance */
    const int64_t gw = (int64_t)blockIdx.x * STEP_WARPS + warp, nw = (int64_t)gridDim.x * STEP_WARPS;
    float *psum = P.psum ? P.psum + gw * P.ckv.cap : nullptr;
    const int64_t items = P.B * P.Tq * P.H;
    float q[SIMT_COLS], x[SIMT_COLS], y[SIMT_COLS], oc[SIMT_COLS], os[SIMT_COLS], ow[SIMT_COLS];
    for (int64_t w = gw; w < items; w += nw) {
        const int64_t h = w % P.H, i = (w / P.H) % P.Tq, b = w / (P.H * P.Tq);
        if (!P.ok[b]) continue;
        const step_seq_t s = step_seq(P, b);
        if (i >= s.n) continue;
        const int64_t pos = s.L - s.n + i, cur = pos / P.lp;
        const int64_t nc = P.use_cmp || P.selects ? nsa_rule_num_cmp(s.L, P.l, P.d) : 0;
        const int64_t nv = nc ? nsa_rule_cmp_visible_cap(pos, P.l, P.d, nc) : 0;
        int kept = 0;
        if (P.use_slc && !P.selects) { /* the caller's blocks the query can use: in [0, cur], once, ascending */
            if (lane == 0) step_caller_blocks(P, b, i, h, cur, kidx, width);
            __syncwarp();
        }
        /* the G heads' compressed probabilities, summed (max, then sum, then p: the CPU's passes) */
        if (P.selects) {
            for (int64_t r = lane; r < nv; r += 32) psum[r] = 0.0f;
            __syncwarp();
            for (int64_t g = 0; g < P.G && nv > 0; g++) {
                const int64_t hq = h * P.G + g;
                simt_load(q, P.q, b * P.q.s0 + i * P.q.s1 + hq * P.q.s2, P.DK, lane);
                float m = -INFINITY, l = 0.0f;
                for (int64_t r = 0; r < nv; r++) {
                    simt_load(x, P.ckv.k, step_row(P.ckv, P.ckv.k, b, r, h), P.DK, lane);
                    const float sc = simt_dot(q, x, P.DK, lane) * P.scale;
                    m = sc > m ? sc : m;
                }
                for (int64_t r = 0; r < nv; r++) {
                    simt_load(x, P.ckv.k, step_row(P.ckv, P.ckv.k, b, r, h), P.DK, lane);
                    l += expf(simt_dot(q, x, P.DK, lane) * P.scale - m);
                }
                for (int64_t r = 0; r < nv; r++) {
                    simt_load(x, P.ckv.k, step_row(P.ckv, P.ckv.k, b, r, h), P.DK, lane);
                    const float pr = expf(simt_dot(q, x, P.DK, lane) * P.scale - m) / l;
                    if (lane == 0) psum[r] += pr;
                }
                __syncwarp();
            }
            /* importance of blocks 0 .. cur, streamed into the ranked list (select_top_n's order) */
            for (int64_t j = 0; j <= cur; j++) {
                const int64_t r0 = nsa_rule_slc_first_cmp(j, P.l, P.d, P.lp);
                int64_t r1 = nsa_rule_slc_last_cmp(j, P.d, P.lp);
                r1 = r1 < nv - 1 ? r1 : nv - 1;
                float acc = 0.0f;
                for (int64_t r = r0; r <= r1; r++) acc += psum[r] * (float)nsa_rule_overlap(r, j, P.l, P.d, P.lp);
                const float imp = acc * (1.0f / (float)P.d);
                if (lane == 0) {
                    const int fj = nsa_rule_forced(j, cur, P.n_init, P.n_local);
                    int at;
                    if (kept < P.n) {
                        at = kept++;
                    } else {
                        const int wj = kidx[P.n - 1];
                        at = nsa_rule_ranks_above(fj, imp, j, nsa_rule_forced(wj, cur, P.n_init, P.n_local), kimp[P.n - 1], wj)
                                 ? (int)P.n - 1
                                 : -1;
                    }
                    while (at > 0) {
                        const int a = kidx[at - 1];
                        if (!nsa_rule_ranks_above(fj, imp, j, nsa_rule_forced(a, cur, P.n_init, P.n_local), kimp[at - 1], a)) break;
                        kidx[at] = kidx[at - 1], kimp[at] = kimp[at - 1];
                        at--;
                    }
                    if (at >= 0) kidx[at] = (int32_t)j, kimp[at] = imp;
                }
            }
            if (lane == 0) { /* ascending, then -1 */
                for (int a = 1; a < kept; a++) {
                    const int32_t v = kidx[a];
                    int k = a;
                    while (k > 0 && kidx[k - 1] > v) kidx[k] = kidx[k - 1], k--;
                    kidx[k] = v;
                }
                for (int a = kept; a < P.n; a++) kidx[a] = -1;
                if (P.idx.p)
                    for (int a = 0; a < P.n; a++)
                        ((int32_t *)P.idx.p)[b * P.idx.s0 + i * P.idx.s1 + h * P.idx.s2 + a] = kidx[a];
            }
            __syncwarp();
        }
        for (int64_t g = 0; g < P.G; g++) {
            const int64_t hq = h * P.G + g;
            simt_load(q, P.q, b * P.q.s0 + i * P.q.s1 + hq * P.q.s2, P.DK, lane);
#pragma unroll
            for (int c = 0; c < SIMT_COLS; c++) oc[c] = os[c] = ow[c] = 0.0f;
            if (P.use_cmp && nv > 0) {
                float m = -INFINITY, l = 0.0f;
                for (int64_t r = 0; r < nv; r++) {
                    simt_load(x, P.ckv.k, step_row(P.ckv, P.ckv.k, b, r, h), P.DK, lane);
                    const float sc = simt_dot(q, x, P.DK, lane) * P.scale;
                    simt_load(y, P.ckv.v, step_row(P.ckv, P.ckv.v, b, r, h), P.DV, lane);
                    step_soft_add(sc, y, m, l, oc);
                }
#pragma unroll
                for (int c = 0; c < SIMT_COLS; c++) oc[c] /= l;
            }
            if (P.use_slc) {
                float m = -INFINITY, l = 0.0f;
                bool seen = false;
                for (int a = 0; a < width; a++) {
                    const int64_t j = kidx[a];
                    if (j < 0) continue;
                    const int64_t hi = nsa_rule_slc_hi(j, pos, P.lp, s.L);
                    for (int64_t r = j * P.lp; r <= hi; r++, seen = true) {
                        simt_load(x, P.kv.k, step_row(P.kv, P.kv.k, b, r, h), P.DK, lane);
                        const float sc = simt_dot(q, x, P.DK, lane) * P.scale;
                        simt_load(y, P.kv.v, step_row(P.kv, P.kv.v, b, r, h), P.DV, lane);
                        step_soft_add(sc, y, m, l, os);
                    }
                }
                if (seen)
#pragma unroll
                    for (int c = 0; c < SIMT_COLS; c++) os[c] /= l;
            }
            if (P.use_swa) {
                float m = -INFINITY, l = 0.0f;
                const int64_t lo = pos - P.w + 1 > 0 ? pos - P.w + 1 : 0;
                for (int64_t r = lo; r <= pos; r++) {
                    simt_load(x, P.kv.k, step_row(P.kv, P.kv.k, b, r, h), P.DK, lane);
                    const float sc = simt_dot(q, x, P.DK, lane) * P.swa_scale;
                    simt_load(y, P.kv.v, step_row(P.kv, P.kv.v, b, r, h), P.DV, lane);
                    step_soft_add(sc, y, m, l, ow);
                }
#pragma unroll
                for (int c = 0; c < SIMT_COLS; c++) ow[c] /= l;
            }
            const int64_t gr = b * P.gc.s0 + i * P.gc.s1 + hq * P.gc.s2;
            const float gc = P.use_cmp ? ld_any(P.gc.p, P.gc.dt, gr) : 0.0f;
            const float gs = P.use_slc ? ld_any(P.gs.p, P.gs.dt, b * P.gs.s0 + i * P.gs.s1 + hq * P.gs.s2) : 0.0f;
            const float gwv = P.use_swa ? ld_any(P.gw.p, P.gw.dt, b * P.gw.s0 + i * P.gw.s1 + hq * P.gw.s2) : 0.0f;
#pragma unroll
            for (int c = 0; c < SIMT_COLS; c++) {
                float v = 0.0f;
                if (P.use_cmp) v += gc * oc[c];
                if (P.use_slc) v += gs * os[c];
                if (P.use_swa) v += gwv * ow[c];
                x[c] = v;
            }
            simt_store(P.o, b * P.o.s0 + i * P.o.s1 + hq * P.o.s2, P.DV, x, 1.0f, lane);
        }
    }
}

/* The dense step's score of a visible pair: the scaled dot product, softcapped when asked. */
__device__ __forceinline__ float dense_score(const step_params &P, float dot)
{
    const float v = dot * P.scale;
    return P.softcap > 0.0f ? P.softcap * tanhf(v / P.softcap) : v;
}

/* one warp per (b, new query, query head): the CPU's dense_query (src/cpu/step.c) */
__global__ void step_dense_kernel(const step_params P)
{
    const int lane = threadIdx.x & 31;
    const int64_t items = P.B * P.Tq * P.HQ;
    float q[SIMT_COLS], x[SIMT_COLS], acc[SIMT_COLS];
    for (int64_t w = simt_warp0(); w < items; w += simt_nwarps()) {
        const int64_t hq = w % P.HQ, i = (w / P.HQ) % P.Tq, b = w / (P.HQ * P.Tq);
        if (!P.ok[b]) continue;
        const step_seq_t s = step_seq(P, b);
        if (i >= s.n) continue;
        const int64_t pos = s.L - s.n + i, h = hq / P.G;
        const int64_t lo = P.wl < 0 || P.wl >= pos ? 0 : pos - P.wl;
        const int64_t hi = P.causal ? pos : (P.wr < 0 || P.wr >= s.L - 1 - pos ? s.L - 1 : pos + P.wr);
        simt_load(q, P.q, b * P.q.s0 + i * P.q.s1 + hq * P.q.s2, P.DK, lane);
        float m = -INFINITY;
        for (int64_t r = lo; r <= hi; r++) {
            simt_load(x, P.kv.k, step_row(P.kv, P.kv.k, b, r, h), P.DK, lane);
            const float v = dense_score(P, simt_dot(q, x, P.DK, lane));
            m = v > m || v != v || m != m ? (m != m ? m : v) : m; /* NaN wins */
        }
        const bool seen = hi >= lo, sink = P.sinks != nullptr;
        const float sk = sink ? P.sinks[hq * P.sinks_s] : -INFINITY;
        if (sink && sk > m) m = sk;
        float l = 0.0f, lse;
#pragma unroll
        for (int c = 0; c < SIMT_COLS; c++) acc[c] = 0.0f;
        if (m == -INFINITY) { /* no key and no finite sink: o = 0; keys all at -inf: 0 / 0 as dense softmax */
            lse = seen ? NAN : sink ? sk : -INFINITY;
            if (seen)
#pragma unroll
                for (int c = 0; c < SIMT_COLS; c++) acc[c] = NAN;
        } else {
            for (int64_t r = lo; r <= hi; r++) {
                simt_load(x, P.kv.k, step_row(P.kv, P.kv.k, b, r, h), P.DK, lane);
                const float wgt = expf(dense_score(P, simt_dot(q, x, P.DK, lane)) - m);
                l += wgt;
                simt_load(x, P.kv.v, step_row(P.kv, P.kv.v, b, r, h), P.DV, lane);
#pragma unroll
                for (int c = 0; c < SIMT_COLS; c++) acc[c] = fmaf(wgt, x[c], acc[c]);
            }
            if (sink) l += expf(sk - m);
#pragma unroll
            for (int c = 0; c < SIMT_COLS; c++) acc[c] /= l;
            lse = m + logf(l);
        }
        simt_store(P.o, b * P.o.s0 + i * P.o.s1 + hq * P.o.s2, P.DV, acc, 1.0f, lane);
        if (P.lse.p && lane == 0) ((float *)P.lse.p)[b * P.lse.s0 + i * P.lse.s1 + hq * P.lse.s2] = lse;
    }
}

static step_cache_t cache_view(const nsa_kv_cache *c, int64_t cap)
{
    step_cache_t s;
    memset(&s, 0, sizeof s);
    s.k = dv_of(&c->k), s.v = dv_of(&c->v);
    s.page = c->k.shape[1], s.pool = c->k.shape[0], s.cap = cap;
    if (nsa_present(&c->block_table))
        s.bt = (const int32_t *)c->block_table.data, s.bt0 = c->block_table.stride[0], s.bt1 = c->block_table.stride[1];
    return s;
}

/* The fields both steps share: q, the token cache, lengths, append, o and errors. */
static void params_common(step_params *P, const nsa_problem *p, const nsa_step_args *a)
{
    memset(P, 0, sizeof *P);
    P->q = dv_of(&a->q), P->kn = dv_of(&a->k_new), P->vn = dv_of(&a->v_new), P->o = dv_of(&a->o);
    P->kv = cache_view(&a->cache, p->cache_cap);
    P->qlens = nsa_present(&a->q_lens) ? (const int32_t *)a->q_lens.data : NULL, P->qlens_s = a->q_lens.stride[0];
    P->seqlens = (const int32_t *)a->seqlens.data, P->seqlens_s = a->seqlens.stride[0];
    P->errors = nsa_present(&a->errors) ? (int32_t *)a->errors.data : NULL, P->errors_s = a->errors.stride[0];
    P->B = p->B, P->Tq = p->T, P->HQ = p->HQ, P->H = p->H, P->G = p->G, P->DK = (int)p->DK, P->DV = (int)p->DV;
    P->scale = p->scale;
    P->append = nsa_present(&a->k_new);
}

/* The check of every sequence, the append of the step's tokens and the pooling (prep kernel);
 * blank: the rows no query fills are its to write (the scalar kernels'). */
static void launch_prep(grun *g, const step_params &P, int blank)
{
    const nsa_problem *p = g->p;
    const int64_t rows = step_pool_rows(p, P);
    const int64_t per_b = (p->T + rows) * p->H > 0 ? (p->T + rows) * p->H : 1;
    /* CTAs a sequence: enough for its items at a warp each, at most 64 (a long prefill chunk's
     * warps then take several items); sequences past the grid's limit loop */
    const int64_t wpc = STEP_PREP_THREADS / 32, chunks = per_b < 64 * wpc ? (per_b + wpc - 1) / wpc : 64;
    const int64_t seqs = p->B < (int64_t)(INT32_MAX / 64) ? p->B : (int64_t)(INT32_MAX / 64);
    step_prep_kernel<<<(unsigned)(seqs * chunks), STEP_PREP_THREADS, 0, g->st>>>(P, rows, chunks, blank);
    g_launched(g);
}

static void run_step(grun *g, const nsa_step_args *a)
{
    const nsa_problem *p = g->p;
    if (!cu_step_supported(g, a)) return;
    step_params P;
    params_common(&P, p, a);
    P.gc = dv_of(&a->g_cmp), P.gs = dv_of(&a->g_slc), P.gw = dv_of(&a->g_swa);
    P.bi = dv_of(&a->block_indices), P.bc = dv_of(&a->block_counts);
    P.use_cmp = nsa_present(&a->g_cmp), P.use_slc = nsa_present(&a->g_slc), P.use_swa = nsa_present(&a->g_swa);
    P.selects = P.use_slc && !nsa_present(&a->block_indices);
    /* selected is validated, and written, only when the step selects: otherwise a caller's
     * stale tensor there is not ours to touch */
    if (P.selects) P.idx = dv_of(&a->selected);
    if (P.use_cmp || P.selects) P.ckv = cache_view(&a->cmp_cache, p->cmp_cap);
    const nsa_config *c = &p->cfg;
    P.l = c->cmp_len, P.d = c->cmp_stride, P.lp = c->slc_block, P.n = c->slc_topk, P.n_init = c->n_init, P.n_local = c->n_local;
    P.m = p->m;
    P.w = c->window, P.swa_scale = p->swa_scale;
    P.pool = (P.use_cmp || P.selects) && !a->cmp_by_caller;
    P.ok = (int32_t *)g_take_n(g, nsa_size_of(p->B), sizeof(int32_t));
    const int64_t items = p->B * p->T * p->H;
    const int64_t blocks = ((items < STEP_MAX_WARPS ? items : STEP_MAX_WARPS) + STEP_WARPS - 1) / STEP_WARPS;
    ts_plan plan;
    const int tiled = step_tiled_fits(g, &P);
    if (tiled) step_tiled_take(g, &P, &plan);
    else P.psum = P.selects ? cu_take_f32(g, nsa_size_mul(nsa_size_of(blocks * STEP_WARPS), nsa_size_of(P.ckv.cap)), 0) : NULL;
    if (!g_live(g) || p->B == 0) return;
    /* a step that writes nothing before its reads (no append, no pooling) leaves the check to
     * the tiled kernels' first launch (step_tiled_checks) */
    const int checks = tiled && items > 0 && step_tiled_checks(&P, &plan);
    if (!checks) launch_prep(g, P, !tiled);
    if (items == 0) return;
    if (tiled) {
        step_tiled_launch(g, &P, &plan, checks);
        return;
    }
    const size_t smem = (size_t)STEP_WARPS * (size_t)(P.m > P.n ? P.m : P.n) * 8;
    g_smem_optin(g, (const void *)step_query_kernel, smem);
    if (!g_live(g)) return;
    step_query_kernel<<<(unsigned)blocks, 32 * STEP_WARPS, smem, g->st>>>(P);
    g_launched(g);
}

/* Head dims the scalar kernels hold (lanes x SIMT_COLS columns) and a ranked list that fits
 * shared memory. Marks NOT_SUPPORTED on g and returns 0 otherwise. */
static int cu_step_supported(grun *g, const nsa_step_args *a)
{
    const nsa_problem *p = g->p;
    if (p->DK > 32 * SIMT_COLS || p->DV > 32 * SIMT_COLS) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "q: DK %lld and DV %lld, the CUDA step takes head dims up to %d",
               (long long)p->DK, (long long)p->DV, 32 * SIMT_COLS);
        return 0;
    }
    const int64_t width = p->m > p->cfg.slc_topk ? p->m : p->cfg.slc_topk;
    const size_t smem = (size_t)STEP_WARPS * (size_t)width * 8;
    if (nsa_present(&a->g_slc) && !g->dry && smem > (size_t)g->dev.smem_max) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "config.slc_topk: %lld, the CUDA step keeps at most %d selected blocks",
               (long long)p->cfg.slc_topk, g->dev.smem_max / (STEP_WARPS * 8));
        return 0;
    }
    return 1;
}

size_t nsa_cuda_step_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_step_args *a)
{
    return cu_op_workspace(ctx, p, run_step, a);
}

nsa_status nsa_cuda_step(const nsa_context *ctx, const nsa_problem *p, const nsa_step_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_step, a, ws);
}

static void run_attention_step(grun *g, const nsa_attention_step_args *a)
{
    const nsa_problem *p = g->p;
    if (p->DK > 32 * SIMT_COLS || p->DV > 32 * SIMT_COLS) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "q: DK %lld and DV %lld, the CUDA step takes head dims up to %d", (long long)p->DK,
               (long long)p->DV, 32 * SIMT_COLS);
        return;
    }
    const nsa_step_args common = nsa_step_common(a);
    step_params P;
    params_common(&P, p, &common);
    P.lse = dv_of(&a->lse);
    P.sinks = nsa_present(&a->sinks) ? (const float *)a->sinks.data : NULL, P.sinks_s = a->sinks.stride[0];
    P.wl = a->window_left, P.wr = a->window_right, P.causal = a->causal != 0, P.softcap = a->softcap;
    P.ok = (int32_t *)g_take_n(g, nsa_size_of(p->B), sizeof(int32_t));
    ts_plan plan;
    const int tiled = attention_step_tiled_fits(g, &P);
    if (tiled) attention_step_tiled_take(g, &P, &plan);
    if (!g_live(g) || p->B == 0) return;
    const int64_t items = p->B * p->T * p->HQ;
    const int checks = tiled && items > 0 && attention_step_tiled_checks(&P, &plan);
    if (!checks) launch_prep(g, P, !tiled);
    if (items == 0) return;
    if (tiled) {
        attention_step_tiled_launch(g, &P, &plan, checks);
        return;
    }
    step_dense_kernel<<<simt_grid(items), 32 * SIMT_WARPS, 0, g->st>>>(P);
    g_launched(g);
}

size_t nsa_cuda_attention_step_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_step_args *a)
{
    return cu_op_workspace(ctx, p, run_attention_step, a);
}

nsa_status nsa_cuda_attention_step(const nsa_context *ctx, const nsa_problem *p, const nsa_attention_step_args *a, void *ws)
{
    return cu_op_run(ctx, p, run_attention_step, a, ws);
}
