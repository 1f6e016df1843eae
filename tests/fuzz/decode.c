/* decode.c -- one fuzz input into one public call, run and checked (see decode.h).
 *
 * Each input decodes into one call (op, shapes, ranks, dtypes, strides, optional tensors,
 * config, varlen, attention options, block indices, workspace size). Every buffer sits between
 * two guard regions of a sentinel byte. After the call the library's promise is checked, and
 * each break of it is printed and counted:
 *   - a failing call has written nothing (every buffer byte-identical to before);
 *   - a successful call has written only its output views (inputs and the padding between an
 *     output's elements unchanged) and its workspace;
 *   - in every case all guards are intact (ASan / UBSan / LSan or compute-sanitizer watch the rest).
 * Shapes stay small (dims 0..9, T up to 40) so one run takes microseconds. With a fuzz_memory
 * the tensors and the workspace live in backend memory: each buffer, guards included, is
 * decoded on the host, uploaded before the call and downloaded after it, so the same byte
 * comparisons hold on the device. */
#include "nsa.h"
#include "op_calls.h"
#include "decode.h"
#include "internal.h"
#include "mod/expr.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { GUARD = 64, SENTINEL = 0xA5, MAX_BUFS = 64, MAX_T = 40 };
#define WS_CAP ((size_t)32 << 20) /* a larger workspace answer is not run: the harness can't back it */

/* ---- input reader: past the end every read is 0 (the plain, valid choice) ---------------- */
typedef struct reader {
    const uint8_t *p;
    size_t n, i;
} reader;

static uint8_t u8(reader *r) { return r->i < r->n ? r->p[r->i++] : 0; }
static uint32_t u32(reader *r)
{
    uint32_t v = 0;
    for (int k = 0; k < 4; k++) v = v << 8 | u8(r);
    return v;
}
static uint64_t u64(reader *r) { return (uint64_t)u32(r) << 32 | u32(r); }
static int64_t upto(reader *r, int64_t hi) { return hi <= 0 ? 0 : (int64_t)(u8(r) % (uint64_t)(hi + 1)); }

/* ---- data generator (the bytes choose the seed, not every value) --------------------------- */
static uint64_t rng_state;
static uint64_t rnd(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* ---- guarded buffers ------------------------------------------------------------------------ */
typedef struct buffer {
    unsigned char *base; /* GUARD | body (size bytes) | GUARD, on the host */
    unsigned char *dev;  /* its copy in backend memory (NULL: the call uses base itself) */
    size_t size;
    unsigned char *snap;
    int is_out;
    nsa_tensor view; /* for an output: the elements it may write (rank 0 = none known) */
} buffer;

static buffer bufs[MAX_BUFS];
static int nbufs;
static const fuzz_memory *mem; /* NULL: host memory, the call sees base */
static int nviolations;

/* A buffer of size bytes between guards. host_only: an array the API reads on the host
 * (cu_seqlens) whatever the backend, so it gets no backend copy. */
static buffer *guarded_alloc(size_t size, int is_out, const nsa_tensor *view, int host_only)
{
    if (nbufs == MAX_BUFS) abort(); /* harness bug: more tensors than planned */
    buffer *b = &bufs[nbufs++];
    b->base = (unsigned char *)malloc(size + 2 * GUARD);
    if (!b->base) abort();
    b->size = size;
    b->is_out = is_out;
    memset(&b->view, 0, sizeof b->view);
    if (view) b->view = *view;
    memset(b->base, SENTINEL, GUARD);
    memset(b->base + GUARD + size, SENTINEL, GUARD);
    b->snap = NULL;
    b->dev = mem && !host_only ? (unsigned char *)mem->alloc(size + 2 * GUARD) : NULL;
    return b;
}

static void *host_ptr(const buffer *b) { return b->base + GUARD; }
/* the address the library gets */
static void *call_ptr(const buffer *b) { return (b->dev ? b->dev : b->base) + GUARD; }

static int guards_intact(const unsigned char *g, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (g[i] != SENTINEL) return 0;
    return 1;
}

static void violation(const char *what, int buf)
{
    fprintf(stderr, "fuzz: %s (buffer %d of %d)\n", what, buf, nbufs);
    nviolations++;
}

/* Right after a library call: a failure says what is wrong (nsa_last_error_detail is not
 * empty) and a success leaves no stale detail behind (nsa.h's contract). */
static void check_detail(nsa_status st)
{
    const char *d = nsa_last_error_detail();
    if (st != NSA_STATUS_SUCCESS && d[0] == '\0') violation("a failing call left no detail", -1);
    if (st == NSA_STATUS_SUCCESS && d[0] != '\0') violation("a successful call left a detail", -1);
}

/* NSA_FUZZ_VERBOSE=1 prints each decoded tensor, config and status (for triage) */
static int verbose(void)
{
    static int v = -1;
    if (v < 0) v = getenv("NSA_FUZZ_VERBOSE") != NULL;
    return v;
}

/* ---- tensors -------------------------------------------------------------------------------- */
static size_t dsize(nsa_dtype t)
{
    switch (t) {
    case NSA_DTYPE_F32: case NSA_DTYPE_I32: return 4;
    case NSA_DTYPE_F16: case NSA_DTYPE_BF16: return 2;
    case NSA_DTYPE_U8: return 1;
    default: return 4;
    }
}

/* Elements a view spans (max offset + 1), or -1 when the harness can't back it (negative or
 * overflowing strides: the library must reject those before touching memory). */
static int64_t view_extent(const nsa_tensor *t)
{
    if (t->rank < 1 || t->rank > NSA_MAX_RANK) return -1;
    int64_t off = 0;
    for (int d = 0; d < t->rank; d++) {
        if (t->shape[d] < 0) return -1;
        if (t->shape[d] == 0) return 0;
    }
    for (int d = 0; d < t->rank; d++) {
        if (t->stride[d] < 0) return -1;
        if (t->shape[d] > 1 && t->stride[d] > ((int64_t)1 << 24) / (t->shape[d] - 1)) return -1;
        off += (t->shape[d] - 1) * t->stride[d];
    }
    return off + 1;
}

typedef struct tspec {
    int is_out;
    int i32_hi;       /* I32 data: values mostly in [-1, i32_hi] */
    int optional;     /* may be absent (data NULL) */
} tspec;

static void fill(void *data, nsa_dtype dt, int64_t n, int i32_hi, int mode)
{
    for (int64_t i = 0; i < n; i++) {
        uint64_t r = rnd();
        switch (dt) {
        case NSA_DTYPE_F32: {
            float f = (float)((int64_t)(r % 4001) - 2000) / 1000.0f;
            if (mode == 1 && r % 13 == 0) { uint32_t bits = (uint32_t)(r >> 32); memcpy(&f, &bits, 4); }
            ((float *)data)[i] = f;
            break;
        }
        case NSA_DTYPE_F16: /* sign, exponent 10..17, any mantissa: |x| in ~[2^-5, 8) */
            ((uint16_t *)data)[i] = (uint16_t)((r & 0x8000) | ((10 + (r >> 16) % 8) << 10) | ((r >> 24) & 0x3FF));
            if (mode == 1 && r % 13 == 0) ((uint16_t *)data)[i] = (uint16_t)(r >> 40);
            break;
        case NSA_DTYPE_BF16:
            ((uint16_t *)data)[i] = (uint16_t)((r & 0x8000) | ((122 + (r >> 16) % 8) << 7) | ((r >> 24) & 0x7F));
            if (mode == 1 && r % 13 == 0) ((uint16_t *)data)[i] = (uint16_t)(r >> 40);
            break;
        case NSA_DTYPE_I32: {
            int32_t v;
            switch (r % 16) {
            case 0: v = -1; break;
            case 1: v = (int32_t)(uint32_t)(r >> 32); break;      /* anything */
            case 2: v = (r >> 8) & 1 ? INT32_MAX : INT32_MIN; break;
            default: v = (int32_t)((r >> 8) % (uint64_t)(i32_hi + 2)); break; /* 0..hi+1 */
            }
            ((int32_t *)data)[i] = v;
            break;
        }
        case NSA_DTYPE_U8: ((uint8_t *)data)[i] = (uint8_t)(r % 3 ? 1 : r >> 8); break;
        default: ((uint32_t *)data)[i] = (uint32_t)(r >> 16); break; /* not a dtype: dsize's 4 bytes, all set */
        }
    }
}

/* each overflows int64 once times 2 (shape forced >= 3), so the library must reject it; a huge stride
 * that still fits would be a valid view the harness can't back */
static const int64_t huge_strides[] = {INT64_MAX, (int64_t)1 << 62, INT64_MAX / 3 * 2, INT64_MIN};

/* A view of the intended shape, most of the time contiguous, valid and present; one byte picks
 * a perturbation: absent, wrong dtype / rank / one dim, padded, transposed, negative, zero or
 * huge strides. The buffer behind it always covers what the final view spans. */
static nsa_tensor mk(reader *r, tspec s, nsa_dtype dt, int rank, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    nsa_tensor t;
    memset(&t, 0, sizeof t);
    const int64_t dims[4] = {d0, d1, d2, d3};
    t.dtype = dt;
    t.rank = rank;
    for (int d = 0; d < rank; d++) t.shape[d] = dims[d];
    uint8_t m = u8(r);
    int kind = m < 176 ? 0 : (m - 176) % 12;
    uint8_t arg = kind ? u8(r) : 0;
    int absent = 0;
    switch (kind) {
    case 1: absent = 1; break;                                  /* NULL data, the intended shape */
    case 2: absent = 1; t.rank = 0; memset(t.shape, 0, sizeof t.shape); break; /* NULL, empty view */
    case 3: t.dtype = (nsa_dtype)(arg % 7); break;              /* 5, 6: not a dtype */
    case 4: t.rank = arg % 6; break;                            /* 0..5 */
    case 5: if (rank) { /* one dim off: +-1, 0, or anything small */
            int d = arg % rank, w = (arg >> 3) % 4;
            t.shape[d] = w == 0 ? t.shape[d] + 1 : w == 1 ? t.shape[d] - 1 : w == 2 ? 0 : (arg >> 5) % 8;
        } break;
    default: break;
    }
    /* strides: contiguous for the (possibly changed) shape, then the stride perturbations */
    int64_t acc = 1;
    int rk = t.rank >= 1 && t.rank <= NSA_MAX_RANK ? t.rank : 0;
    int64_t pad = 0;
    for (int d = rk - 1; d >= 0; d--) {
        t.stride[d] = acc;
        int64_t sh = t.shape[d] > 0 ? t.shape[d] : 1;
        if (kind == 6 && d == rk - 1) pad = 1 + arg % 5; /* padded rows: gaps the call must not write */
        acc *= sh + (d == rk - 1 ? pad : 0);
    }
    if (rk >= 2) {
        int d = arg % (rk - 1);
        switch (kind) {
        case 7: { /* outer dims swapped: a transposed, still covering view */
            int64_t x = t.stride[0];
            t.stride[0] = t.stride[rk - 2], t.stride[rk - 2] = x;
        } break;
        case 8: t.stride[d] = -t.stride[d] - (arg >> 7); break;
        case 9: t.stride[d] = 0; break;
        case 10:
            t.stride[d] = huge_strides[(arg >> 4) % 4];
            if (t.shape[d] < 3) t.shape[d] = 3; /* (shape - 1) * stride overflows */
            break;
        case 11: t.stride[rk - 1] = (arg & 1) ? 0 : 2; break; /* last-dim stride != 1 */
        default: break;
        }
    }
    int64_t ext = view_extent(&t);
    if (verbose())
        fprintf(stderr, "tensor %d: %s dtype %d rank %d shape [%lld %lld %lld %lld] stride [%lld %lld %lld %lld] extent %lld%s\n",
                nbufs, absent ? "absent" : s.is_out ? "out" : "in", (int)t.dtype, (int)t.rank, (long long)t.shape[0],
                (long long)t.shape[1], (long long)t.shape[2], (long long)t.shape[3], (long long)t.stride[0],
                (long long)t.stride[1], (long long)t.stride[2], (long long)t.stride[3], (long long)ext,
                ext < 0 ? " (not backed)" : "");
    if (absent) return t;
    int64_t nel = ext >= 0 ? ext : 16;
    size_t bytes = (size_t)nel * dsize(t.dtype);
    buffer *b = guarded_alloc(bytes, s.is_out, ext >= 0 ? &t : NULL, 0);
    fill(host_ptr(b), t.dtype, nel, s.i32_hi, (int)(rng_state & 1));
    t.data = call_ptr(b);
    return t;
}

/* An output the call ignores in this configuration (a selection output when the caller gives
 * the indices, the saved output of a branch that is off): its buffer becomes an input, so that
 * any write to it is a violation, not only one past its view. */
static void ignored(const nsa_tensor *t)
{
    for (int i = 0; t->data && i < nbufs; i++)
        if (call_ptr(&bufs[i]) == t->data) bufs[i].is_out = 0;
}

/* An optional tensor: absent with NULL data and an empty view, unless the presence bit says so. */
static nsa_tensor opt(reader *r, int present, tspec s, nsa_dtype dt, int rank, int64_t d0, int64_t d1, int64_t d2,
                      int64_t d3)
{
    if (!present) {
        nsa_tensor t;
        memset(&t, 0, sizeof t);
        return t;
    }
    s.optional = 1;
    return mk(r, s, dt, rank, d0, d1, d2, d3);
}

/* ---- shapes, config, varlen ---------------------------------------------------------------- */
typedef struct dims {
    int64_t B, T, Tk, H, HQ, DK, DV, M, Nc, nb;
    nsa_dtype dt;
} dims;

static const int64_t extremes[] = {0, -1, INT64_MAX, INT64_MIN, (int64_t)1 << 56, (int64_t)1 << 62,
                                   (int64_t)1 << 31, 3, 1000000007};

static nsa_config mk_config(reader *r)
{
    nsa_config c;
    int64_t d = 1 + upto(r, 3);
    c.cmp_stride = d;
    c.cmp_len = d * (1 + upto(r, 2));
    c.slc_block = c.cmp_len * (1 + upto(r, 1));
    c.n_init = upto(r, 2);
    c.n_local = upto(r, 2);
    c.slc_topk = c.n_init + c.n_local + upto(r, 3);
    if (c.slc_topk == 0) c.slc_topk = 1;
    c.window = 1 + upto(r, 45);
    uint8_t sc = u8(r);
    c.scale = sc < 200 ? 0.0f : sc < 240 ? (float)(sc - 200) / 16.0f : sc == 250 ? NAN : sc == 251 ? INFINITY : -1.0f;
    uint8_t x = u8(r); /* one field to an extreme value, or none */
    if (x >= 200) {
        int64_t v = extremes[u8(r) % 9];
        switch (x % 7) {
        case 0: c.cmp_len = v; break;
        case 1: c.cmp_stride = v; break;
        case 2: c.slc_block = v; break;
        case 3: c.slc_topk = v; break;
        case 4: c.n_init = v; break;
        case 5: c.n_local = v; break;
        default: c.window = v; break;
        }
    }
    if (verbose())
        fprintf(stderr, "config l %lld d %lld l' %lld n %lld init %lld local %lld w %lld scale %g\n", (long long)c.cmp_len,
                (long long)c.cmp_stride, (long long)c.slc_block, (long long)c.slc_topk, (long long)c.n_init,
                (long long)c.n_local, (long long)c.window, (double)c.scale);
    return c;
}

static int64_t clampd(int64_t v) { return v < 0 ? 0 : v > MAX_T ? MAX_T : v; }

/* Query-chunk inputs (first byte 0xFA): the NSA ops with q's T rows against a key side of Tk
 * rows (mk_dims' Tk: sometimes shorter than T, a refusal), kv_len given where only compressed
 * keys are, sometimes negative. */
static int g_chunk;
static int64_t key_rows(const dims *D) { return g_chunk ? D->Tk : D->T; }

/* Nc and nb for shaping tensors: the library's own counts (0 for configs they cannot count) */
static int64_t num_cmp(const nsa_config *c, int64_t T) { return nsa_num_cmp_blocks(c, T); }
static int64_t num_slc(const nsa_config *c, int64_t T) { return nsa_num_slc_blocks(c, T); }

/* Varlen (B becomes 1): a split of T into up to 5 sequences, sometimes broken. Returns the
 * total compressed rows under cfg in *nc (what the compressed tensors then hold). */
static nsa_varlen mk_varlen(reader *r, dims *D, const nsa_config *cfg, int64_t *nc)
{
    nsa_varlen v = {NULL, 0};
    *nc = clampd(num_cmp(cfg, D->T));
    uint8_t m = u8(r);
    if (m < 192) return v;
    D->B = 1;
    int64_t N = m % 5; /* 0..4 sequences */
    int32_t *cu = (int32_t *)host_ptr(guarded_alloc((size_t)(N + 1) * 4, 0, NULL, 1));
    cu[0] = 0;
    for (int64_t s = 1; s < N; s++) cu[s] = cu[s - 1] + (int32_t)upto(r, D->T - cu[s - 1]);
    cu[N] = (int32_t)D->T;
    uint8_t bad = u8(r);
    if (bad >= 224) {
        int64_t at = bad % (N + 1);
        switch (bad % 4) {
        case 0: cu[at] = -1 - (int32_t)(bad % 3); break;
        case 1: cu[at] = INT32_MAX; break;
        case 2: cu[at] += 1; break;
        default: if (at > 0) cu[at] = cu[at - 1] - 1; break;
        }
    }
    v.cu_seqlens = cu;
    v.num_seqs = N;
    int64_t total = 0;
    for (int64_t s = 0; s < N; s++) {
        int64_t len = (int64_t)cu[s + 1] - cu[s];
        int64_t k = len >= 0 ? num_cmp(cfg, len) : 0;
        total += k > 0 && k <= MAX_T ? k : 0;
    }
    *nc = clampd(total);
    return v;
}

static nsa_varlen_qk mk_varlen_qk(reader *r, dims *D)
{
    nsa_varlen_qk v = {NULL, NULL, 0};
    uint8_t m = u8(r);
    if (m < 224) return v;
    D->B = 1;
    int64_t N = m % 4;
    int64_t *cq = (int64_t *)host_ptr(guarded_alloc((size_t)(N + 1) * 8, 0, NULL, 1));
    int64_t *ck = (int64_t *)host_ptr(guarded_alloc((size_t)(N + 1) * 8, 0, NULL, 1));
    cq[0] = ck[0] = 0;
    for (int64_t s = 1; s < N; s++) {
        cq[s] = cq[s - 1] + upto(r, D->T - cq[s - 1]);
        ck[s] = ck[s - 1] + upto(r, D->Tk - ck[s - 1]);
    }
    cq[N] = D->T, ck[N] = D->Tk;
    uint8_t bad = u8(r);
    if (bad >= 224) (bad & 1 ? cq : ck)[bad % (N + 1)] = bad & 2 ? INT64_MAX : -5;
    v.cu_seqlens_q = cq;
    v.cu_seqlens_k = (bad & 0xF0) == 0xF0 ? NULL : ck; /* sometimes only one of the two */
    v.num_seqs = N;
    return v;
}

static void mk_dims(reader *r, dims *D, const nsa_config *cfg)
{
    uint8_t a = u8(r), b = u8(r), c = u8(r);
    D->B = a % 3;            /* 0..2 */
    D->T = b % (MAX_T + 1);  /* 0..40 */
    D->Tk = (b & 0x80) ? (c % (MAX_T + 1)) : D->T;
    D->H = 1 + (a >> 2) % 3; /* 1..3 */
    int64_t G = 1 + (a >> 4) % 3;
    D->HQ = (a >> 6) == 3 ? (c % 10) : D->H * G; /* sometimes not a multiple of H */
    uint8_t d = u8(r);
    D->DK = d % 10, D->DV = (d >> 4) % 10;
    if ((d & 0x0F) >= 10) D->DK = 1 + (d & 3);
    D->M = 1 + upto(r, 5);
    uint8_t t = u8(r);
    static const nsa_dtype dts[] = {NSA_DTYPE_F32, NSA_DTYPE_F32, NSA_DTYPE_F16, NSA_DTYPE_BF16};
    D->dt = t < 248 ? dts[t % 4] : (nsa_dtype)(t % 7);
    int64_t nb = num_slc(cfg, D->T);
    D->nb = nb > 0 && nb < 64 ? nb : 4;
    D->Nc = clampd(num_cmp(cfg, D->T));
}

/* ---- the call ------------------------------------------------------------------------------- */
typedef union args {
    nsa_compress_bwd_args compress;
    nsa_cmp_attn_bwd_args cmp;
    nsa_select_args select;
    nsa_slc_attn_bwd_args slc;
    nsa_attention_bwd_args attn;
    nsa_gate_bwd_args gate;
    nsa_backward_args nsa;
    nsa_step_args step;
    nsa_attention_step_args astep;
    nsa_flex_bwd_args flex;
} args;

#define IN ((tspec){0, 4, 0})
#define OUT ((tspec){1, 4, 0})
#define F32 NSA_DTYPE_F32
#define I32 NSA_DTYPE_I32

/* Chunk inputs: the compressed rows of the key side, and kv_len (ops without k) drawn around
 * Tk: Tk itself mostly, else 0 (= T), a shorter one or a negative one. */
static void chunk_side(reader *r, dims *D, const nsa_config *cfg, const nsa_varlen *vl, int64_t *kv_len)
{
    if (!g_chunk) return;
    if (!vl->cu_seqlens) D->Nc = clampd(num_cmp(cfg, D->Tk)); /* packed: the packing's rows (a refusal) */
    const uint8_t k = u8(r);
    if (kv_len) *kv_len = k < 200 ? D->Tk : k < 220 ? 0 : k < 240 ? D->Tk - 1 - k % 4 : -1 - (int64_t)(k % 3);
}

static void build_compress(reader *r, dims *D, nsa_compress_bwd_args *a, int bwd, uint8_t pres)
{
    (void)pres;
    a->fwd.config = mk_config(r);
    mk_dims(r, D, &a->fwd.config);
    a->fwd.varlen = mk_varlen(r, D, &a->fwd.config, &D->Nc);
    a->fwd.x = mk(r, IN, D->dt, 4, D->B, D->T, D->H, D->DK);
    a->fwd.x_cmp = mk(r, bwd ? IN : OUT, D->dt, 4, D->B, D->Nc, D->H, D->DK);
    if (!bwd) return;
    a->dx_cmp = mk(r, IN, D->dt, 4, D->B, D->Nc, D->H, D->DK);
    a->dx = mk(r, OUT, D->dt, 4, D->B, D->T, D->H, D->DK);
}

static void build_cmp(reader *r, dims *D, nsa_cmp_attn_bwd_args *a, int bwd, uint8_t pres)
{
    (void)pres;
    a->fwd.config = mk_config(r);
    mk_dims(r, D, &a->fwd.config);
    a->fwd.varlen = mk_varlen(r, D, &a->fwd.config, &D->Nc);
    chunk_side(r, D, &a->fwd.config, &a->fwd.varlen, &a->fwd.kv_len);
    tspec o = bwd ? IN : OUT;
    a->fwd.q = mk(r, IN, D->dt, 4, D->B, D->T, D->HQ, D->DK);
    a->fwd.k_cmp = mk(r, IN, D->dt, 4, D->B, D->Nc, D->H, D->DK);
    a->fwd.v_cmp = mk(r, IN, D->dt, 4, D->B, D->Nc, D->H, D->DV);
    a->fwd.o = mk(r, o, D->dt, 4, D->B, D->T, D->HQ, D->DV);
    a->fwd.lse = mk(r, o, F32, 3, D->B, D->T, D->HQ, 0);
    if (!bwd) return;
    a->dout = mk(r, IN, D->dt, 4, D->B, D->T, D->HQ, D->DV);
    a->dq = mk(r, OUT, D->dt, 4, D->B, D->T, D->HQ, D->DK);
    a->dk_cmp = mk(r, OUT, D->dt, 4, D->B, D->Nc, D->H, D->DK);
    a->dv_cmp = mk(r, OUT, D->dt, 4, D->B, D->Nc, D->H, D->DV);
}

static void build_select(reader *r, dims *D, nsa_select_args *a, uint8_t pres)
{
    a->config = mk_config(r);
    mk_dims(r, D, &a->config);
    a->varlen = mk_varlen(r, D, &a->config, &D->Nc);
    chunk_side(r, D, &a->config, &a->varlen, &a->kv_len);
    int64_t n = a->config.slc_topk >= 1 && a->config.slc_topk <= 8 ? a->config.slc_topk : 2;
    a->q = mk(r, IN, D->dt, 4, D->B, D->T, D->HQ, D->DK);
    a->k_cmp = mk(r, IN, D->dt, 4, D->B, D->Nc, D->H, D->DK);
    a->lse_cmp = opt(r, pres & 1, IN, F32, 3, D->B, D->T, D->HQ, 0);
    a->block_indices = mk(r, OUT, I32, 4, D->B, D->T, D->H, n);
    a->block_counts = opt(r, pres & 2, OUT, I32, 3, D->B, D->T, D->H, 0);
}

static void build_slc(reader *r, dims *D, nsa_slc_attn_bwd_args *a, int bwd, uint8_t pres)
{
    a->fwd.config = mk_config(r);
    mk_dims(r, D, &a->fwd.config);
    a->fwd.varlen = mk_varlen(r, D, &a->fwd.config, &D->Nc);
    chunk_side(r, D, &a->fwd.config, &a->fwd.varlen, NULL);
    tspec o = bwd ? IN : OUT, idx = {0, (int)D->nb, 0}, cnt = {0, (int)D->M, 0};
    a->fwd.q = mk(r, IN, D->dt, 4, D->B, D->T, D->HQ, D->DK);
    a->fwd.k = mk(r, IN, D->dt, 4, D->B, key_rows(D), D->H, D->DK);
    a->fwd.v = mk(r, IN, D->dt, 4, D->B, key_rows(D), D->H, D->DV);
    a->fwd.block_indices = mk(r, idx, I32, 4, D->B, D->T, D->H, D->M);
    a->fwd.block_counts = opt(r, pres & 1, cnt, I32, 3, D->B, D->T, D->H, 0);
    a->fwd.o = mk(r, o, D->dt, 4, D->B, D->T, D->HQ, D->DV);
    a->fwd.lse = mk(r, o, F32, 3, D->B, D->T, D->HQ, 0);
    if (!bwd) return;
    a->dout = mk(r, IN, D->dt, 4, D->B, D->T, D->HQ, D->DV);
    a->dq = mk(r, OUT, D->dt, 4, D->B, D->T, D->HQ, D->DK);
    a->dk = mk(r, OUT, D->dt, 4, D->B, key_rows(D), D->H, D->DK);
    a->dv = mk(r, OUT, D->dt, 4, D->B, key_rows(D), D->H, D->DV);
}

static const int64_t windows[] = {-1, -1, 0, 1, 2, 3, 5, 8, 13, INT64_MAX, -2, INT64_MIN, (int64_t)1 << 56, 40, 17, 7};

static void build_attn(reader *r, dims *D, nsa_attention_bwd_args *a, int bwd, uint8_t pres)
{
    nsa_config cfg = nsa_config_default();
    mk_dims(r, D, &cfg);
    nsa_attention_args *f = &a->fwd;
    int64_t unused;
    if (!(pres & 0x80)) f->varlen = mk_varlen(r, D, &cfg, &unused);
    else f->varlen_qk = mk_varlen_qk(r, D);
    uint8_t o1 = u8(r), o2 = u8(r);
    f->causal = o1 & 1;
    f->window_left = windows[(o1 >> 1) % 16];
    f->window_right = windows[(o1 >> 5) % 8];
    uint8_t sc = u8(r);
    f->scale = sc < 200 ? 0.0f : sc < 250 ? (float)(sc - 199) / 8.0f : sc == 250 ? NAN : -1.0f;
    f->softcap = (o2 & 3) == 0 ? 0.0f : (o2 & 3) == 1 ? 5.0f : (o2 & 3) == 2 ? 0.5f : (o2 & 4 ? -1.0f : INFINITY);
    f->dropout_p = (o2 >> 3) % 8 < 5 ? 0.0f : (o2 >> 3) % 8 == 5 ? 0.25f : (o2 >> 3) % 8 == 6 ? 0.9f : (o2 & 0x40 ? 1.0f : NAN);
    if (f->dropout_p != 0.0f) f->dropout_seed = u64(r), f->dropout_offset = u64(r);
    tspec o = bwd ? IN : OUT, seg = {0, 2, 0}, sm = IN;
    f->q = mk(r, IN, D->dt, 4, D->B, D->T, D->HQ, D->DK);
    f->k = mk(r, IN, D->dt, 4, D->B, D->Tk, D->H, D->DK);
    f->v = mk(r, IN, D->dt, 4, D->B, D->Tk, D->H, D->DV);
    f->o = mk(r, o, D->dt, 4, D->B, D->T, D->HQ, D->DV);
    f->lse = mk(r, o, F32, 3, D->B, D->T, D->HQ, 0);
    f->sinks = opt(r, pres & 1, sm, F32, 1, D->HQ, 0, 0, 0);
    f->q_segment_ids = opt(r, pres & 2, seg, I32, 2, D->B, D->T, 0, 0);
    f->k_segment_ids = opt(r, (pres & 2) ? !(o2 & 0x80) || (pres & 4) : 0, seg, I32, 2, D->B, D->Tk, 0, 0);
    uint8_t bm = u8(r); /* bias / mask broadcast choices */
    int64_t Bb = bm & 1 ? 1 : D->B, Hb = bm & 2 ? 1 : D->HQ, Bm = bm & 4 ? 1 : D->B, Hm = bm & 8 ? 1 : D->HQ;
    nsa_dtype bdt = (nsa_dtype)((bm >> 4) % 3);
    f->bias = opt(r, pres & 8, IN, bdt, 4, Bb, Hb, D->T, D->Tk);
    f->mask = opt(r, pres & 16, IN, NSA_DTYPE_U8, 4, Bm, Hm, D->T, D->Tk);
    if (!bwd) return;
    a->dout = mk(r, IN, D->dt, 4, D->B, D->T, D->HQ, D->DV);
    a->dq = mk(r, OUT, D->dt, 4, D->B, D->T, D->HQ, D->DK);
    a->dk = mk(r, OUT, D->dt, 4, D->B, D->Tk, D->H, D->DK);
    a->dv = mk(r, OUT, D->dt, 4, D->B, D->Tk, D->H, D->DV);
    a->dsinks = opt(r, (pres & 1) ? !(bm & 0x80) : (pres & 32), OUT, F32, 1, D->HQ, 0, 0, 0);
    a->dbias = opt(r, (pres & 8) ? !(bm & 0x40) : (pres & 64), OUT, (nsa_dtype)((bm >> 5) % 3), 4, Bb, Hb, D->T, D->Tk);
}

static void build_gate(reader *r, dims *D, nsa_gate_bwd_args *a, int bwd, uint8_t pres)
{
    nsa_config cfg = nsa_config_default();
    mk_dims(r, D, &cfg);
    nsa_gate_args *f = &a->fwd;
    uint8_t odt = u8(r);
    nsa_dtype dts[3];
    for (int i = 0; i < 3; i++) dts[i] = (odt >> (2 * i)) % 4 == 3 ? D->dt : (nsa_dtype)((odt >> (2 * i)) % 4);
    nsa_tensor *os[3] = {&f->o_cmp, &f->o_slc, &f->o_swa}, *gs[3] = {&f->g_cmp, &f->g_slc, &f->g_swa};
    for (int i = 0; i < 3; i++) {
        int g = (pres >> i) & 1, op = g || ((pres >> (3 + i)) & 1);
        *os[i] = opt(r, op, IN, dts[i], 4, D->B, D->T, D->HQ, D->DV);
        *gs[i] = opt(r, g, IN, D->dt, 3, D->B, D->T, D->HQ, 0);
    }
    f->o = mk(r, OUT, D->dt, 4, D->B, D->T, D->HQ, D->DV);
    if (!bwd) return;
    a->dout = mk(r, IN, D->dt, 4, D->B, D->T, D->HQ, D->DV);
    nsa_tensor *dos[3] = {&a->do_cmp, &a->do_slc, &a->do_swa}, *dgs[3] = {&a->dg_cmp, &a->dg_slc, &a->dg_swa};
    uint8_t drop = u8(r); /* sometimes one required gradient is missing */
    for (int i = 0; i < 3; i++) {
        int g = (pres >> i) & 1;
        *dos[i] = opt(r, g && !(drop == 255 - i), OUT, dts[i], 4, D->B, D->T, D->HQ, D->DV);
        *dgs[i] = opt(r, g && !(drop == 250 - i), OUT, D->dt, 3, D->B, D->T, D->HQ, 0);
    }
}

static void build_nsa(reader *r, dims *D, nsa_backward_args *a, int bwd, uint8_t pres)
{
    nsa_forward_args *f = &a->fwd;
    f->config = mk_config(r);
    mk_dims(r, D, &f->config);
    f->varlen = mk_varlen(r, D, &f->config, &D->Nc);
    chunk_side(r, D, &f->config, &f->varlen, NULL);
    uint8_t p2 = u8(r);
    int gc = pres & 1, gsl = pres & 2, gsw = pres & 4, kslc = pres & 8, kswa = pres & 16, kcmp = pres & 32,
        bi = pres & 64, bc = (pres & 128) && bi;
    int64_t n = f->config.slc_topk >= 1 && f->config.slc_topk <= 8 ? f->config.slc_topk : 2;
    tspec o = bwd ? IN : OUT, idx = {0, (int)D->nb, 0}, cnt = {0, (int)D->M, 0};
    f->q = mk(r, IN, D->dt, 4, D->B, D->T, D->HQ, D->DK);
    f->k = mk(r, IN, D->dt, 4, D->B, key_rows(D), D->H, D->DK);
    f->v = mk(r, IN, D->dt, 4, D->B, key_rows(D), D->H, D->DV);
    f->k_slc = opt(r, kslc, IN, D->dt, 4, D->B, key_rows(D), D->H, D->DK);
    f->v_slc = opt(r, kslc && !(p2 == 255), IN, D->dt, 4, D->B, key_rows(D), D->H, D->DV);
    f->k_swa = opt(r, kswa, IN, D->dt, 4, D->B, key_rows(D), D->H, D->DK);
    f->v_swa = opt(r, kswa, IN, D->dt, 4, D->B, key_rows(D), D->H, D->DV);
    f->k_cmp = opt(r, kcmp, IN, D->dt, 4, D->B, D->Nc, D->H, D->DK);
    f->v_cmp = opt(r, kcmp && !(p2 == 254), IN, D->dt, 4, D->B, D->Nc, D->H, D->DV);
    f->g_cmp = opt(r, gc, IN, D->dt, 3, D->B, D->T, D->HQ, 0);
    f->g_slc = opt(r, gsl, IN, D->dt, 3, D->B, D->T, D->HQ, 0);
    f->g_swa = opt(r, gsw, IN, D->dt, 3, D->B, D->T, D->HQ, 0);
    f->block_indices = opt(r, bi, idx, I32, 4, D->B, D->T, D->H, D->M);
    f->block_counts = opt(r, bc || p2 == 253, cnt, I32, 3, D->B, D->T, D->H, 0);
    f->o = mk(r, o, D->dt, 4, D->B, D->T, D->HQ, D->DV);
    /* saved: present for enabled branches; p2 bits add the ones a disabled branch may omit */
    nsa_saved *s = &f->saved;
    nsa_dtype sdt = p2 & 0x40 ? (nsa_dtype)(p2 % 3) : D->dt;
    s->block_indices = opt(r, (gsl && !bi) || (p2 & 1), o, I32, 4, D->B, D->T, D->H, n);
    s->o_cmp = opt(r, gc || (p2 & 2), o, sdt, 4, D->B, D->T, D->HQ, D->DV);
    s->o_slc = opt(r, gsl || (p2 & 2), o, sdt, 4, D->B, D->T, D->HQ, D->DV);
    s->o_swa = opt(r, gsw || (p2 & 2), o, sdt, 4, D->B, D->T, D->HQ, D->DV);
    s->lse_cmp = opt(r, gc || gsl || (p2 & 4), o, F32, 3, D->B, D->T, D->HQ, 0);
    s->lse_slc = opt(r, gsl || (p2 & 4), o, F32, 3, D->B, D->T, D->HQ, 0);
    s->lse_swa = opt(r, gsw || (p2 & 4), o, F32, 3, D->B, D->T, D->HQ, 0);
    if (!bwd) { /* what a branch that is off, or a selection the caller made, leaves alone */
        if (!gsl || nsa_present(&f->block_indices)) ignored(&s->block_indices);
        if (!gc) ignored(&s->o_cmp), ignored(&s->lse_cmp);
        if (!gsl) ignored(&s->o_slc), ignored(&s->lse_slc);
        if (!gsw) ignored(&s->o_swa), ignored(&s->lse_swa);
        return;
    }
    a->dout = mk(r, IN, D->dt, 4, D->B, D->T, D->HQ, D->DV);
    a->dq = mk(r, OUT, D->dt, 4, D->B, D->T, D->HQ, D->DK);
    a->dk = mk(r, OUT, D->dt, 4, D->B, key_rows(D), D->H, D->DK);
    a->dv = mk(r, OUT, D->dt, 4, D->B, key_rows(D), D->H, D->DV);
    a->dk_slc = opt(r, kslc, OUT, D->dt, 4, D->B, key_rows(D), D->H, D->DK);
    a->dv_slc = opt(r, kslc, OUT, D->dt, 4, D->B, key_rows(D), D->H, D->DV);
    a->dk_swa = opt(r, kswa, OUT, D->dt, 4, D->B, key_rows(D), D->H, D->DK);
    a->dv_swa = opt(r, kswa && !(p2 == 252), OUT, D->dt, 4, D->B, key_rows(D), D->H, D->DV);
    a->dk_cmp = opt(r, kcmp, OUT, D->dt, 4, D->B, D->Nc, D->H, D->DK);
    a->dv_cmp = opt(r, kcmp, OUT, D->dt, 4, D->B, D->Nc, D->H, D->DV);
    a->dg_cmp = opt(r, gc, OUT, D->dt, 3, D->B, D->T, D->HQ, 0);
    a->dg_slc = opt(r, gsl, OUT, D->dt, 3, D->B, D->T, D->HQ, 0);
    a->dg_swa = opt(r, gsw && !(p2 == 251), OUT, D->dt, 3, D->B, D->T, D->HQ, 0);
}

/* The inference step: caches contiguous or paged (pres bit 0), lengths and page indices drawn
 * around their bounds by fill (0 .. hi + 1, -1, extremes), the optional tensors by pres bits. */
static void build_step(reader *r, dims *D, nsa_step_args *a, uint8_t pres)
{
    a->config = mk_config(r);
    mk_dims(r, D, &a->config);
    const int64_t Tq = D->T % 6, cap = D->Tk, page = 1 + upto(r, 7), pool = 1 + upto(r, 12);
    const int paged = pres & 1, mp = (int)((cap + page - 1) / page);
    const int64_t ncap = clampd(num_cmp(&a->config, cap));
    const int64_t n = a->config.slc_topk >= 1 && a->config.slc_topk <= 8 ? a->config.slc_topk : 2;
    tspec len = {0, (int)(cap + 1), 0}, ql = {0, (int)Tq, 0}, tab = {0, (int)pool, 0};
    a->q = mk(r, IN, D->dt, 4, D->B, Tq, D->HQ, D->DK);
    a->q_lens = opt(r, pres & 2, ql, I32, 1, D->B, 0, 0, 0);
    a->seqlens = mk(r, len, I32, 1, D->B, 0, 0, 0);
    a->k_new = opt(r, pres & 4, IN, D->dt, 4, D->B, Tq, D->H, D->DK);
    a->v_new = opt(r, (pres & 4) && u8(r) != 255, IN, D->dt, 4, D->B, Tq, D->H, D->DV);
    a->cache.k = mk(r, OUT, D->dt, 4, paged ? pool : D->B, paged ? page : cap, D->H, D->DK);
    a->cache.v = mk(r, OUT, D->dt, 4, paged ? pool : D->B, paged ? page : cap, D->H, D->DV);
    a->cache.block_table = opt(r, paged, tab, I32, 2, D->B, mp, 0, 0);
    a->cmp_cache.k = mk(r, OUT, D->dt, 4, paged ? pool : D->B, paged ? page : ncap, D->H, D->DK);
    a->cmp_cache.v = mk(r, OUT, D->dt, 4, paged ? pool : D->B, paged ? page : ncap, D->H, D->DV);
    a->cmp_cache.block_table = opt(r, paged, tab, I32, 2, D->B, (ncap + page - 1) / page, 0, 0);
    a->cmp_by_caller = (int32_t)(upto(r, 3) == 3 ? -1 : (pres >> 3) & 1);
    a->g_cmp = opt(r, pres & 16, IN, D->dt, 3, D->B, Tq, D->HQ, 0);
    a->g_slc = opt(r, pres & 32, IN, D->dt, 3, D->B, Tq, D->HQ, 0);
    a->g_swa = opt(r, (pres & 64) || !(pres & 48), IN, D->dt, 3, D->B, Tq, D->HQ, 0);
    a->o = mk(r, OUT, D->dt, 4, D->B, Tq, D->HQ, D->DV);
    a->selected = opt(r, pres & 128, OUT, I32, 4, D->B, Tq, D->H, n);
    a->errors = opt(r, u8(r) & 1, OUT, I32, 1, D->B, 0, 0, 0);
    const uint8_t ci = u8(r); /* the caller's selection, sometimes with counts */
    tspec idx = {0, (int)D->nb, 0}, cnt = {0, (int)D->M, 0};
    a->block_indices = opt(r, ci & 1, idx, I32, 4, D->B, Tq, D->H, D->M);
    a->block_counts = opt(r, (ci & 1) && (ci & 2), cnt, I32, 3, D->B, Tq, D->H, 0);
    if (!nsa_present(&a->g_slc) || nsa_present(&a->block_indices)) ignored(&a->selected); /* the step selects nothing */
}

/* The dense step: nsa_step's caches and lengths (build_step's draws), the attention options
 * around their bounds (build_attn's windows, scales and softcaps). */
static void build_attention_step(reader *r, dims *D, nsa_attention_step_args *a, uint8_t pres)
{
    nsa_config cfg = nsa_config_default();
    mk_dims(r, D, &cfg);
    const int64_t Tq = D->T % 6, cap = D->Tk, page = 1 + upto(r, 7), pool = 1 + upto(r, 12);
    const int paged = pres & 1, mp = (int)((cap + page - 1) / page);
    tspec len = {0, (int)(cap + 1), 0}, ql = {0, (int)Tq, 0}, tab = {0, (int)pool, 0};
    const uint8_t o1 = u8(r), o2 = u8(r), sc = u8(r);
    a->causal = o1 & 1;
    a->window_left = windows[(o1 >> 1) % 16];
    a->window_right = windows[(o1 >> 5) % 8];
    a->scale = sc < 200 ? 0.0f : sc < 250 ? (float)(sc - 199) / 8.0f : sc == 250 ? NAN : -1.0f;
    a->softcap = (o2 & 3) == 0 ? 0.0f : (o2 & 3) == 1 ? 5.0f : (o2 & 3) == 2 ? 0.5f : (o2 & 4 ? -1.0f : INFINITY);
    a->q = mk(r, IN, D->dt, 4, D->B, Tq, D->HQ, D->DK);
    a->q_lens = opt(r, pres & 2, ql, I32, 1, D->B, 0, 0, 0);
    a->seqlens = mk(r, len, I32, 1, D->B, 0, 0, 0);
    a->k_new = opt(r, pres & 4, IN, D->dt, 4, D->B, Tq, D->H, D->DK);
    a->v_new = opt(r, (pres & 4) && u8(r) != 255, IN, D->dt, 4, D->B, Tq, D->H, D->DV);
    a->cache.k = mk(r, OUT, D->dt, 4, paged ? pool : D->B, paged ? page : cap, D->H, D->DK);
    a->cache.v = mk(r, OUT, D->dt, 4, paged ? pool : D->B, paged ? page : cap, D->H, D->DV);
    a->cache.block_table = opt(r, paged, tab, I32, 2, D->B, mp, 0, 0);
    a->o = mk(r, OUT, D->dt, 4, D->B, Tq, D->HQ, D->DV);
    a->lse = opt(r, pres & 8, OUT, F32, 3, D->B, Tq, D->HQ, 0);
    a->errors = opt(r, pres & 16, OUT, I32, 1, D->B, 0, 0, 0);
    a->sinks = opt(r, pres & 32, IN, F32, 1, D->HQ, 0, 0, 0);
}

/* Block-sparse attention with mods: shapes as the attention op's, block sizes 1-8, the block
 * lists' counts and indices drawn around their bounds (so out of range and repeated blocks are
 * frequent), mods from a fixed set (sometimes of the wrong kind), a tensor gradient sometimes. */
static int32_t g_flex_doc[16];
static float g_flex_tab[8];
static nsa_mod *g_flex_mods[2];

static void build_flex(reader *r, dims *D, nsa_flex_bwd_args *a, int bwd, uint8_t pres)
{
    static const char *const MASKS[] = {"q_idx >= kv_idx", "doc[q_idx] == doc[kv_idx]", "kv_idx % 3 != 1 || h == 0",
                                        "q_idx - kv_idx < 4 && q_idx >= kv_idx"};
    static const char *const SCORES[] = {"score + tab[h]", "3.0 * tanh(score / 3.0)", "where(kv_idx % 2 == 0, score, -exp(1000.0))",
                                         "score - tab[q_idx - kv_idx] * abs(q_idx - kv_idx)"};
    for (int i = 0; i < 16; i++) g_flex_doc[i] = i / 3;
    for (int i = 0; i < 8; i++) g_flex_tab[i] = 0.25f * (float)(i - 3);
    nsa_config cfg = nsa_config_default();
    mk_dims(r, D, &cfg);
    nsa_flex_args *f = &a->fwd;
    nsa_block_mask *m = &f->block_mask;
    m->q_block = 1 + upto(r, 7), m->kv_block = 1 + upto(r, 7);
    const int64_t nqb = D->T / m->q_block + (D->T % m->q_block != 0), nkb = D->Tk / m->kv_block + (D->Tk % m->kv_block != 0);
    if (u8(r) == 255) m->q_block = 0; /* (refused) */
    const tspec o = bwd ? IN : OUT;
    f->q = mk(r, IN, D->dt, 4, D->B, D->T, D->HQ, D->DK);
    f->k = mk(r, IN, D->dt, 4, D->B, D->Tk, D->H, D->DK);
    f->v = mk(r, IN, D->dt, 4, D->B, D->Tk, D->H, D->DV);
    f->o = mk(r, o, D->dt, 4, D->B, D->T, D->HQ, D->DV);
    f->lse = bwd ? mk(r, IN, F32, 3, D->B, D->T, D->HQ, 0) : opt(r, pres & 64, OUT, F32, 3, D->B, D->T, D->HQ, 0);
    if (pres & 1) {
        const int64_t Bm = u8(r) & 1 ? 1 : D->B, Hm = u8(r) & 1 ? 1 : D->HQ, W = upto(r, nkb), Wf = upto(r, nkb);
        tspec cnt = {0, (int)W, 0}, ix = {0, (int)nkb, 0}, fcnt = {0, (int)Wf, 0};
        m->kv_num_blocks = mk(r, cnt, I32, 3, Bm, Hm, nqb, 0);
        m->kv_indices = mk(r, ix, I32, 4, Bm, Hm, nqb, W);
        m->full_kv_num_blocks = opt(r, pres & 2, fcnt, I32, 3, Bm, Hm, nqb, 0);
        m->full_kv_indices = opt(r, (pres & 2) && u8(r) != 255, ix, I32, 4, Bm, Hm, nqb, Wf);
    }
    /* the mods' tensors live where the call's do (backend memory on CUDA), guarded like them */
    const int64_t nd = 16, nt = 8;
    buffer *bd = guarded_alloc(sizeof g_flex_doc, 0, NULL, 0), *btab = guarded_alloc(sizeof g_flex_tab, 0, NULL, 0);
    memcpy(host_ptr(bd), g_flex_doc, sizeof g_flex_doc), memcpy(host_ptr(btab), g_flex_tab, sizeof g_flex_tab);
    const nsa_mod_tensor tens[2] = {{"doc", nsa_tensor_make(call_ptr(bd), NSA_DTYPE_I32, 1, &nd)},
                                    {"tab", nsa_tensor_make(call_ptr(btab), NSA_DTYPE_F32, 1, &nt)}};
    const uint8_t mods = u8(r);
    const int swap = (pres & 32) && (mods & 0x80);
    if (pres & 4) nsa_mod_create(&g_flex_mods[0], swap ? NSA_MOD_SCORE : NSA_MOD_MASK, swap ? SCORES[mods % 4] : MASKS[mods % 4], tens, 2);
    if (pres & 8) nsa_mod_create(&g_flex_mods[1], NSA_MOD_SCORE, SCORES[(mods >> 2) % 4], tens, 2);
    f->mask_mod = g_flex_mods[0], f->score_mod = g_flex_mods[1];
    const uint8_t sc = u8(r);
    f->scale = sc < 200 ? 0.0f : sc < 250 ? (float)(sc - 199) / 8.0f : sc == 250 ? NAN : -1.0f;
    if (!bwd) return;
    a->dout = mk(r, IN, D->dt, 4, D->B, D->T, D->HQ, D->DV);
    a->dq = mk(r, OUT, D->dt, 4, D->B, D->T, D->HQ, D->DK);
    a->dk = mk(r, OUT, D->dt, 4, D->B, D->Tk, D->H, D->DK);
    a->dv = mk(r, OUT, D->dt, 4, D->B, D->Tk, D->H, D->DV);
    a->dscore_tensors[1] = opt(r, pres & 16, OUT, F32, 1, 8, 0, 0, 0);
}

/* nsa_create_block_mask: the four list tensors drawn around the shapes the lengths and block
 * sizes make (they are its outputs), lengths and block sizes sometimes out of range, the mask_mod
 * one of build_flex's (its tensors in host memory), none, or a score_mod in its place. */
static const nsa_mod *build_block_mask(reader *r, dims *D, uint8_t pres, nsa_block_mask *m, int64_t *Tq, int64_t *Tk)
{
    static const char *const MASKS[] = {"q_idx >= kv_idx", "doc[q_idx] == doc[kv_idx]", "kv_idx < 5 || q_idx >= kv_idx",
                                        "q_idx - kv_idx < 4 && q_idx >= kv_idx && b == 0"};
    for (int i = 0; i < 16; i++) g_flex_doc[i] = i / 3;
    nsa_config cfg = nsa_config_default();
    mk_dims(r, D, &cfg);
    *Tq = D->T, *Tk = D->Tk;
    const uint8_t x = u8(r);
    if (x == 255) *Tq = -1;
    if (x == 254) *Tk = INT64_MAX;
    m->q_block = 1 + upto(r, 7), m->kv_block = 1 + upto(r, 7);
    const int64_t nqb = *Tq > 0 ? *Tq / m->q_block + (*Tq % m->q_block != 0) : 0;
    const int64_t nkb = *Tk > 0 && *Tk <= MAX_T ? *Tk / m->kv_block + (*Tk % m->kv_block != 0) : 1;
    if (x == 253) m->q_block = 0;
    if (x == 252) m->kv_block = -3;
    const int64_t Bm = pres & 1 ? 1 : D->B, Hm = pres & 2 ? 1 : D->HQ;
    m->kv_num_blocks = mk(r, OUT, NSA_DTYPE_I32, 3, Bm, Hm, nqb, 0);
    m->kv_indices = mk(r, OUT, NSA_DTYPE_I32, 4, Bm, Hm, nqb, nkb);
    m->full_kv_num_blocks = mk(r, OUT, NSA_DTYPE_I32, 3, Bm, Hm, nqb, 0);
    m->full_kv_indices = mk(r, OUT, NSA_DTYPE_I32, 4, Bm, Hm, nqb, nkb);
    const int64_t nd = 16;
    buffer *bd = guarded_alloc(sizeof g_flex_doc, 0, NULL, 1);
    memcpy(host_ptr(bd), g_flex_doc, sizeof g_flex_doc);
    const nsa_mod_tensor tens[1] = {{"doc", nsa_tensor_make(call_ptr(bd), NSA_DTYPE_I32, 1, &nd)}};
    const uint8_t which = u8(r);
    if (pres & 4) return NULL;
    nsa_mod_create(&g_flex_mods[0], pres & 8 ? NSA_MOD_SCORE : NSA_MOD_MASK, pres & 8 ? "score * 2.0" : MASKS[which % 4], tens,
                   1);
    return g_flex_mods[0];
}

/* Marks the bytes an output view may write; returns 0 when the view is unknown (write anywhere). */
static int mark_view(const buffer *b, unsigned char *ok)
{
    const nsa_tensor *t = &b->view;
    if (t->rank < 1) return 0;
    const size_t es = dsize(t->dtype);
    int64_t sh[4] = {1, 1, 1, 1}, st[4] = {0, 0, 0, 0};
    for (int d = 0; d < t->rank; d++) sh[4 - t->rank + d] = t->shape[d], st[4 - t->rank + d] = t->stride[d];
    for (int64_t i0 = 0; i0 < sh[0]; i0++)
        for (int64_t i1 = 0; i1 < sh[1]; i1++)
            for (int64_t i2 = 0; i2 < sh[2]; i2++)
                for (int64_t i3 = 0; i3 < sh[3]; i3++) {
                    size_t off = (size_t)(i0 * st[0] + i1 * st[1] + i2 * st[2] + i3 * st[3]) * es;
                    if (off + es <= b->size) memset(ok + off, 1, es);
                }
    return 1;
}

static void check_after(nsa_status st)
{
    for (int i = 0; i < nbufs; i++) {
        buffer *b = &bufs[i];
        if (!guards_intact(b->base, GUARD)) violation("guard before a buffer overwritten", i);
        if (!guards_intact(b->base + GUARD + b->size, GUARD)) violation("guard after a buffer overwritten", i);
        if (memcmp(b->snap, b->base + GUARD, b->size) == 0) continue;
        if (st != NSA_STATUS_SUCCESS) { violation("a failing call changed a buffer", i); continue; }
        if (!b->is_out) { violation("a successful call changed an input", i); continue; }
        unsigned char *ok = (unsigned char *)calloc(b->size + 1, 1);
        if (!ok) abort();
        if (mark_view(b, ok))
            for (size_t k = 0; k < b->size; k++)
                if (!ok[k] && b->snap[k] != b->base[GUARD + k]) {
                    violation("a successful call wrote outside its output view", i);
                    break;
                }
        free(ok);
    }
}

static void free_all(void)
{
    for (int i = 0; i < nbufs; i++) {
        if (bufs[i].dev) mem->release(bufs[i].dev);
        free(bufs[i].base), free(bufs[i].snap);
    }
    nbufs = 0;
}

/* Every buffer's bytes kept before the call (check_after compares), and sent to the backend. */
static void snapshot_all(void)
{
    for (int i = 0; i < nbufs; i++) {
        buffer *b = &bufs[i];
        b->snap = (unsigned char *)malloc(b->size + 1);
        if (!b->snap) abort();
        memcpy(b->snap, b->base + GUARD, b->size);
        if (b->dev) mem->upload(b->dev, b->base, b->size + 2 * GUARD);
    }
}

/* The workspace query, a workspace of some size, the call, the checks; fills res. */
static void run_op(reader *r, nsa_context *ctx, const void *a, op_ws_fn qs, op_run_fn call, fuzz_result *res)
{
    uint8_t w = u8(r), nul = u8(r);
    size_t need = 0, sentinel = (size_t)0x5A5A5A5A5A5A5A5Aull, bytes = sentinel;
    nsa_status qst = qs(nul == 255 ? NULL : ctx, nul == 254 ? NULL : a, nul == 253 ? NULL : &bytes);
    check_detail(qst);
    res->query = qst;
    if (qst != NSA_STATUS_SUCCESS && bytes != sentinel) violation("a failing workspace query wrote its answer", -1);
    if (qst == NSA_STATUS_SUCCESS) need = bytes;
    if (need > WS_CAP) return;
    size_t ws = need;
    switch (w % 8) {
    case 5: ws = need > 0 ? need - 1 - (w >> 3) % need : 0; break;   /* too small */
    case 6: ws = need + 1 + (w >> 3); break;                       /* larger */
    case 7: ws = (w >> 3) * 8; break;                              /* unrelated */
    default: break;
    }
    unsigned char *wsb = (unsigned char *)malloc(ws + 2 * GUARD);
    if (!wsb) abort();
    memset(wsb, SENTINEL, ws + 2 * GUARD);
    unsigned char *wsd = mem ? (unsigned char *)mem->alloc(ws + 2 * GUARD) : NULL;
    if (wsd) mem->upload(wsd, wsb, ws + 2 * GUARD);
    void *wp = (w % 16 == 15) ? NULL : (wsd ? wsd : wsb) + GUARD;
    snapshot_all();
    if (verbose()) fprintf(stderr, "query status %d need %zu, workspace %zu%s\n", (int)qst, need, ws, wp ? "" : " (NULL)");
    nsa_status st = call(nul == 252 ? NULL : ctx, nul == 251 ? NULL : a, wp, ws);
    check_detail(st);
    res->ran = 1;
    res->status = st;
    if (verbose()) fprintf(stderr, "status %d\n", (int)st);
    if (mem) { /* backend calls may return before their work is done: wait, then bring every byte back */
        mem->sync();
        if (wsd) mem->download(wsb, wsd, ws + 2 * GUARD);
        for (int i = 0; i < nbufs; i++)
            if (bufs[i].dev) mem->download(bufs[i].base, bufs[i].dev, bufs[i].size + 2 * GUARD);
    }
    if (!guards_intact(wsb, GUARD) || !guards_intact(wsb + GUARD + ws, GUARD)) violation("workspace guard overwritten", -1);
    check_after(st);
    if (wsd) mem->release(wsd);
    free(wsb);
}

static const char *const op_names[N_OPS_ALL] = {"compress", "compress_bwd", "cmp_attn", "cmp_attn_bwd", "select",
                                                "slc_attn", "slc_attn_bwd", "attention", "attention_bwd", "gate",
                                                "gate_bwd", "forward", "backward", "config_validate", "step",
                                                "attention_step", "expr", "flex_attention", "flex_attention_bwd",
                                                "create_block_mask"};

const char *fuzz_op_name(int op) { return op >= 0 && op < N_OPS_ALL ? op_names[op] : "?"; }

fuzz_result fuzz_run(const uint8_t *data, size_t size, nsa_context *ctx, const fuzz_memory *memory)
{
    reader r = {data, size, 0};
    fuzz_result res = {0, 0, 0, 0, 0};
    const uint8_t first = u8(&r);
    int op = first == 0xF9 ? OP_BLOCK_MASK : first == 0xFF ? OP_STEP : first == 0xFE ? OP_ATTENTION_STEP : first == 0xFD ? OP_EXPR : first == 0xFC ? OP_FLEX
             : first == 0xFB ? OP_FLEX_BWD : first % N_OPS;
    g_chunk = first == 0xFA;
    if (g_chunk) { /* a query chunk of one of the NSA ops */
        static const int chunk_ops[] = {OP_CMP_ATTN, OP_CMP_ATTN_BWD, OP_SELECT, OP_SLC_ATTN, OP_SLC_ATTN_BWD, OP_FORWARD,
                                        OP_BACKWARD};
        op = chunk_ops[u8(&r) % 7];
    }
    res.op = op;
    uint8_t pres = u8(&r);
    rng_state = u64(&r);
    static args a; /* large; zero per call */
    memset(&a, 0, sizeof a);
    dims D;
    memset(&D, 0, sizeof D);
    nbufs = 0;
    nviolations = 0;
    mem = memory;
    switch (op) {
    case OP_EXPR: { /* the rest of the input as expression text over two captured tensors */
        static int32_t doc[37];
        static uint16_t bias[3 * 11];
        for (int i = 0; i < 37; i++) doc[i] = i / 5;
        for (int i = 0; i < 33; i++) bias[i] = (uint16_t)(0x3c00 + i * 16); /* f16 */
        const int64_t nd = 37, nb[2] = {3, 11};
        const expr_capture caps[2] = {{"doc", nsa_tensor_make(doc, NSA_DTYPE_I32, 1, &nd)},
                                      {"bias", nsa_tensor_make(bias, NSA_DTYPE_F16, 2, nb)}};
        const size_t n = r.n > r.i ? r.n - r.i : 0;
        char *text = (char *)malloc(n + 1);
        if (!text) abort();
        memcpy(text, r.p + r.i, n);
        text[n] = 0;
        expr_program *prog = NULL;
        nsa_detail_clear();
        const nsa_status st = expr_compile(text, (pres & 1) ? EXPR_SCORE : EXPR_MASK, caps, 2, NULL, &prog);
        check_detail(st);
        if ((st == NSA_STATUS_SUCCESS) != (prog != NULL)) violation("expr_compile: status and program disagree", -1);
        if (prog) { /* evaluate at extreme and ordinary points; generate its source */
            static const int64_t pts[] = {0, 1, 36, -1, INT64_MAX, INT64_MIN, 1000000007};
            for (int i = 0; i < 7; i++)
                for (int j = 0; j < 7; j++) (void)expr_eval(prog, pts[j] & 3, pts[i] % 5, pts[i], pts[j], (float)i - 3.5f);
            char buf[64];
            const size_t need = expr_to_c(prog, 1, buf, sizeof buf);
            char *code = (char *)malloc(need + 1);
            if (!code) abort();
            if (expr_to_c(prog, 1, code, need + 1) != need || strlen(code) != need) violation("expr_to_c: lengths disagree", -1);
            free(code);
            expr_free(prog);
        }
        free(text);
        res.ran = 1;
        res.status = st;
        break;
    }
    case OP_BLOCK_MASK: { /* a host function: its tensors stay in host memory on either replay */
        mem = NULL;
        nsa_block_mask bm;
        memset(&bm, 0, sizeof bm);
        int64_t Tq = 0, Tk = 0;
        const nsa_mod *mm = build_block_mask(&r, &D, pres, &bm, &Tq, &Tk);
        snapshot_all();
        nsa_detail_clear();
        const nsa_status st = nsa_create_block_mask(mm, Tq, Tk, (pres & 16) && u8(&r) == 255 ? NULL : &bm);
        check_detail(st);
        check_after(st);
        res.ran = 1;
        res.query = NSA_STATUS_SUCCESS;
        res.status = st;
        break;
    }
    case OP_CONFIG: {
        nsa_config c = mk_config(&r);
        nsa_status st = nsa_config_validate(u8(&r) == 255 ? NULL : &c);
        check_detail(st);
        if (st == NSA_STATUS_SUCCESS && (c.cmp_len < 1 || c.cmp_stride < 1 || c.cmp_len % c.cmp_stride || c.slc_block < c.cmp_len ||
                                         c.slc_block % c.cmp_stride || c.slc_topk < 1 || c.window < 1 || c.n_init < 0 ||
                                         c.n_local < 0 || c.slc_topk - c.n_init < c.n_local))
            violation("nsa_config_validate accepted an invalid config", -1);
        res.ran = 1;
        res.status = st;
        break;
    }
#define RUN(name) run_op(&r, ctx, &a, op_ws_##name, op_run_##name, &res)
    case OP_COMPRESS: build_compress(&r, &D, &a.compress, 0, pres); RUN(compress); break;
    case OP_COMPRESS_BWD: build_compress(&r, &D, &a.compress, 1, pres); RUN(compress_bwd); break;
    case OP_CMP_ATTN: build_cmp(&r, &D, &a.cmp, 0, pres); RUN(cmp_attn); break;
    case OP_CMP_ATTN_BWD: build_cmp(&r, &D, &a.cmp, 1, pres); RUN(cmp_attn_bwd); break;
    case OP_SELECT: build_select(&r, &D, &a.select, pres); RUN(select); break;
    case OP_SLC_ATTN: build_slc(&r, &D, &a.slc, 0, pres); RUN(slc_attn); break;
    case OP_SLC_ATTN_BWD: build_slc(&r, &D, &a.slc, 1, pres); RUN(slc_attn_bwd); break;
    case OP_ATTENTION: build_attn(&r, &D, &a.attn, 0, pres); RUN(attention); break;
    case OP_ATTENTION_BWD: build_attn(&r, &D, &a.attn, 1, pres); RUN(attention_bwd); break;
    case OP_GATE: build_gate(&r, &D, &a.gate, 0, pres); RUN(gate); break;
    case OP_GATE_BWD: build_gate(&r, &D, &a.gate, 1, pres); RUN(gate_bwd); break;
    case OP_FORWARD: build_nsa(&r, &D, &a.nsa, 0, pres); RUN(forward); break;
    case OP_BACKWARD: build_nsa(&r, &D, &a.nsa, 1, pres); RUN(backward); break;
    case OP_STEP: build_step(&r, &D, &a.step, pres); RUN(step); break;
    case OP_ATTENTION_STEP: build_attention_step(&r, &D, &a.astep, pres); RUN(attention_step); break;
    case OP_FLEX: build_flex(&r, &D, &a.flex, 0, pres); run_op(&r, ctx, &a.flex.fwd, op_ws_flex_attention, op_run_flex_attention, &res); break;
    case OP_FLEX_BWD: build_flex(&r, &D, &a.flex, 1, pres); RUN(flex_attention_bwd); break;
    default: break;
    }
#undef RUN
    for (int i = 0; i < 2; i++) nsa_mod_destroy(g_flex_mods[i]), g_flex_mods[i] = NULL;
    free_all();
    res.violations = nviolations;
    return res;
}
