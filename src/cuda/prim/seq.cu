/* prim/seq.cu -- per-sequence prefixes of a varlen batch (prim/seq.cuh). */
#include "seq.cuh"
#include "rowwise.cuh"

/* out[s] = sum of units over sequences < s, out[nseq] = total (one block). */
__global__ void prefix_kernel(const int32_t *cu, int64_t nseq, unitspec u, int64_t *out)
{
    __shared__ int64_t wsum[32];
    __shared__ int64_t carry;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int64_t base = 0; base < nseq; base += blockDim.x) {
        const int64_t s = base + threadIdx.x;
        const int64_t v = s < nseq ? seq_units(u, (int64_t)(cu[s + 1] - cu[s]), (int64_t)(cu[s + 1] - cu[s])) : 0;
        const int64_t x = block_scan_pass<int64_t>(v, wsum, &carry);
        if (s < nseq) out[s] = x;
    }
    if (threadIdx.x == 0) out[nseq] = carry;
}

int64_t g_units_total(const nsa_problem *p, unitspec u)
{
    if (!p->cu_seqlens) return p->B * seq_units(u, p->T, p->Tk);
    int64_t t = 0;
    for (int64_t s = 0; s < p->num_seqs; s++) {
        const int64_t len = p->cu_seqlens[s + 1] - p->cu_seqlens[s];
        t += seq_units(u, len, len);
    }
    return t;
}

void g_seq_setup(grun *g, int need_cmp)
{
    const nsa_problem *p = g->p;
    g->cu = NULL;
    g->cmp0 = NULL;
    if (!p->cu_seqlens) return;
    const int64_t N = p->num_seqs;
    const size_t bytes = nsa_size_mul(nsa_size_add(nsa_size_of(N), 1), sizeof(int32_t));
    g->cu = (int32_t *)g_take(g, bytes);
    if (g_live(g)) g_check(g, cudaMemcpyAsync(g->cu, p->cu_seqlens, bytes, cudaMemcpyHostToDevice, g->st));
    if (need_cmp) {
        unitspec u = {UK_CMP, 0, 1, p->cfg.cmp_len, p->cfg.cmp_stride};
        int64_t total;
        g->cmp0 = g_prefix(g, u, &total);
    }
}

int64_t *g_prefix(grun *g, unitspec u, int64_t *total)
{
    const nsa_problem *p = g->p;
    *total = g_units_total(p, u);
    if (!p->cu_seqlens) return NULL;
    int64_t *out = (int64_t *)g_take_n(g, nsa_size_add(nsa_size_of(p->num_seqs), 1), sizeof(int64_t));
    if (g_live(g)) {
        prefix_kernel<<<1, 1024, 0, g->st>>>(g->cu, p->num_seqs, u, out);
        g_launched(g);
    }
    return out;
}

seqmap g_seqmap(grun *g, unitspec u, int64_t *total)
{
    const nsa_problem *p = g->p;
    seqmap m;
    memset(&m, 0, sizeof m);
    m.cu = g->cu;
    m.cmp0 = g->cmp0;
    m.first = g_prefix(g, u, total);
    m.nseq = p->num_seqs;
    m.T = p->T;
    m.Tk = p->Tk;
    m.per_seq = seq_units(u, p->T, p->Tk);
    if (m.per_seq < 1) m.per_seq = 1; /* dense with no task: never divided by */
    m.cl = (int)p->cfg.cmp_len;
    m.cd = (int)p->cfg.cmp_stride;
    return m;
}

seqmap g_plain_map(const grun *g)
{
    seqmap m;
    memset(&m, 0, sizeof m);
    m.cu = g->cu;
    m.cmp0 = g->cmp0;
    m.nseq = g->p->num_seqs;
    m.T = g->p->T;
    m.Tk = g->p->Tk;
    m.per_seq = 1;
    m.cl = (int)g->p->cfg.cmp_len;
    m.cd = (int)g->p->cfg.cmp_stride;
    return m;
}
