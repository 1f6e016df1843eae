/* prim/seq.cuh -- sequences of a varlen batch: per-sequence unit counts (tiles, regions) of a
 * launch, summed on the host for grid sizes and workspace and prefix-summed on the device,
 * where a task finds its sequence. Positions inside one sequence are int (cu_seqlens is
 * int32); element offsets are int64. */
#ifndef NSA_CUDA_PRIM_SEQ_CUH
#define NSA_CUDA_PRIM_SEQ_CUH

#include "run.h"

#ifdef __CUDACC__
#define NSA_CU_HD __host__ __device__ __forceinline__
#else
#define NSA_CU_HD static inline
#endif

/* Per-sequence unit counts: how many tiles / workspace entries one sequence of qlen queries
 * and klen keys owns for a given launch (qlen == klen but for a query chunk of a dense batch:
 * the last qlen positions of klen tokens). The host sums them for grid sizes and workspace;
 * the device prefix-sums them (varlen, where qlen == klen) to find a task's sequence. */
enum unit_kind {
    UK_ROWS = 0,   /* ceil(qlen * a / b): tiles of b flattened query rows (position x a heads) */
    UK_CMP_TILES,  /* ceil(Nc(klen) / b) */
    UK_CMP,        /* Nc(klen) */
    UK_SLC_TILES,  /* nb(klen) * a, nb = ceil(klen / b) */
    UK_INV_CNT,    /* ceil(qlen / a) * nb(klen), nb = ceil(klen / b) */
    UK_INV_OFFS,   /* nb(klen) + 1, nb = ceil(klen / b) */
    UK_LIST,       /* qlen * a */
    UK_CMP_TILES_X,/* ceil(Nc(klen) / b) * a: compressed key tiles, a row segments each */
    UK_KROWS,      /* ceil(klen * a / b): tiles of b key rows */
    UK_KROWS_X     /* ceil(klen / b) * a: tiles of b key rows, a row segments each */
};

typedef struct unitspec {
    int kind;
    int64_t a, b;
    int64_t cl, cd; /* compression l, d (UK_CMP*) */
} unitspec;

NSA_CU_HD int64_t seq_units(unitspec u, int64_t qlen, int64_t klen)
{
    switch (u.kind) {
    case UK_ROWS: return (qlen * u.a + u.b - 1) / u.b;
    case UK_KROWS: return (klen * u.a + u.b - 1) / u.b;
    case UK_CMP_TILES: return (nsa_rule_num_cmp(klen, u.cl, u.cd) + u.b - 1) / u.b;
    case UK_CMP: return nsa_rule_num_cmp(klen, u.cl, u.cd);
    case UK_SLC_TILES: return nsa_rule_num_slc(klen, u.b) * u.a;
    case UK_INV_CNT: return (qlen + u.a - 1) / u.a * nsa_rule_num_slc(klen, u.b);
    case UK_INV_OFFS: return nsa_rule_num_slc(klen, u.b) + 1;
    case UK_CMP_TILES_X: return (nsa_rule_num_cmp(klen, u.cl, u.cd) + u.b - 1) / u.b * u.a;
    case UK_KROWS_X: return (klen + u.b - 1) / u.b * u.a;
    default: return qlen * u.a;
    }
}

/* Where a launch's tasks come from: dense batches have per_seq tasks per sequence; varlen
 * ones a device prefix first[nseq + 1]. */
typedef struct seqmap {
    const int32_t *cu;    /* device cu_seqlens or NULL */
    const int64_t *cmp0;  /* device compressed-row prefix or NULL */
    const int64_t *first; /* device task prefix or NULL (dense) */
    int64_t nseq, T, per_seq;
    int64_t Tk;           /* dense: key rows per sequence (T, or a query chunk's key side) */
    int cl, cd;
} seqmap;

/* One sequence: batch index, first packed row (queries and keys alike: a packed batch has no
 * query chunks), first compressed row; its len queries and klen keys, query i at position
 * i + shift (shift = klen - len: 0 but for a query chunk), ncmp = Nc(klen) compressed keys. */
typedef struct seqinfo {
    int64_t b, row0, cmp0;
    int len, ncmp;
    int klen, shift;
} seqinfo;

#ifdef __CUDACC__
__device__ __forceinline__ seqinfo seq_get(const seqmap &m, int64_t s)
{
    seqinfo q;
    if (m.cu) {
        q.b = 0;
        q.row0 = m.cu[s];
        q.len = m.cu[s + 1] - m.cu[s];
        q.cmp0 = m.cmp0 ? m.cmp0[s] : 0;
    } else {
        q.b = s;
        q.row0 = 0;
        q.len = (int)m.T;
        q.cmp0 = 0;
    }
    q.klen = m.cu ? q.len : (int)m.Tk;
    q.shift = q.klen - q.len;
    q.ncmp = m.cd > 0 ? nsa_rule_num_cmp32(q.klen, m.cl, m.cd) : 0;
    return q;
}

/* task -> (sequence, task within it); empty sequences own no task. */
__device__ __forceinline__ void seq_decode(const seqmap &m, int64_t task, int64_t *s, int64_t *local)
{
    if (!m.first) {
        *s = task / m.per_seq;
        *local = task % m.per_seq;
        return;
    }
    int64_t lo = 0, hi = m.nseq - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (m.first[mid + 1] <= task) lo = mid + 1;
        else hi = mid;
    }
    *s = lo;
    *local = task - m.first[lo];
}

/* Packed row t (0 <= t < T of batch entry b) -> its sequence. */
__device__ __forceinline__ int64_t seq_of_row(const seqmap &m, int64_t b, int64_t t)
{
    if (!m.cu) return b;
    int64_t lo = 0, hi = m.nseq - 1;
    while (lo < hi) { /* the last s with cu[s] <= t: empty sequences before it don't matter */
        int64_t mid = (lo + hi + 1) / 2;
        if (m.cu[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}
#endif /* __CUDACC__ */

/* Uploads cu_seqlens (varlen) and the compressed-row prefix into the workspace. */
void g_seq_setup(grun *g, int need_cmp);
/* The task map of one launch: dense -> per_seq, varlen -> a device prefix of units.
 * *total = tasks over all sequences (host). */
seqmap g_seqmap(grun *g, unitspec u, int64_t *total);
/* Units of spec u summed over the sequences (host). */
int64_t g_units_total(const nsa_problem *p, unitspec u);
/* A device prefix of units per sequence (varlen) or NULL (dense: s * units(T)). */
int64_t *g_prefix(grun *g, unitspec u, int64_t *total);

/* The sequence map of the small row-wise kernels: every sequence, one unit each. */
seqmap g_plain_map(const grun *g);

#endif
