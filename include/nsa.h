/*
 * nsa.h -- Native Sparse Attention (DeepSeek, arXiv 2502.11089) as a C11 library.
 *
 * What is computed is fixed by docs/spec.md (the contract: sections below cite it as "spec N");
 * every backend computes that one function. Conventions used on every declaration below:
 *
 *   - Tensors are views (nsa_tensor): a data pointer, a dtype, a rank <= 4, int64 shapes
 *     and int64 strides counted in ELEMENTS (not bytes). The last dimension must have
 *     stride 1; other strides are free (transposed / sliced views are fine).
 *   - Shapes are written beside each argument, e.g. q: [B, T, HQ, DK].
 *     B batch, T tokens, HQ query heads, H key/value heads (G = HQ / H must be an
 *     integer), DK key dim, DV value dim, Nc compressed blocks, n = config.slc_topk.
 *   - Variable length (packed) input: set varlen.cu_seqlens (HOST memory, int32,
 *     num_seqs + 1 entries, non-decreasing, cu[0] == 0, cu[num_seqs] == T) and B == 1.
 *     Compressed tensors are then packed too: [1, Nc_total, H, D], sequence s owning rows
 *     [cu_cmp[s], cu_cmp[s+1]) with cu_cmp from nsa_cmp_offsets().
 *   - An "optional" tensor is absent when its data pointer is NULL.
 *   - Outputs are caller-owned and fully overwritten (gradients are NOT accumulated).
 *   - Every call validates all arguments first; on any error it returns a specific
 *     status and has not written to any output.
 *   - Scratch memory: each op has a *_workspace_size() query; pass a buffer of at least
 *     that many bytes (host memory for the CPU backend, device memory for CUDA).
 *   - Every failure also leaves one line of detail, read with nsa_last_error_detail(), that
 *     names the argument at fault and what was expected, e.g.
 *     "k: dim 1 (T) is 40, q has 10" or "workspace_bytes: 1024 < 8192 needed".
 *   - The library never prints, never exits, never aborts, holds no global state (the one
 *     exception: that per-thread detail buffer, which no result depends on).
 */
#ifndef NSA_H
#define NSA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NSA_VERSION_MAJOR 0
#define NSA_VERSION_MINOR 2
#define NSA_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH, comparable with nsa_version_number(). */
#define NSA_VERSION_NUMBER (NSA_VERSION_MAJOR * 10000 + NSA_VERSION_MINOR * 100 + NSA_VERSION_PATCH)

#if defined(_WIN32) && defined(NSA_BUILD_SHARED)
#define NSA_API __declspec(dllexport)
#elif defined(__GNUC__)
#define NSA_API __attribute__((visibility("default")))
#else
#define NSA_API
#endif

/* ------------------------------------------------------------------------------------ */
/* Status codes. The numbers are stable: they never change meaning between versions.     */
/* ------------------------------------------------------------------------------------ */
typedef enum nsa_status {
    NSA_STATUS_SUCCESS = 0,
    NSA_STATUS_NULL_POINTER = 1,          /* a required pointer (context, args, data) is NULL */
    NSA_STATUS_BAD_RANK = 2,              /* a tensor has the wrong number of dimensions */
    NSA_STATUS_BAD_SHAPE = 3,             /* a dimension disagrees with another argument */
    NSA_STATUS_BAD_STRIDE = 4,            /* last-dim stride != 1, or a negative stride */
    NSA_STATUS_BAD_DTYPE = 5,             /* dtype not allowed here or not the same as q's */
    NSA_STATUS_BAD_GQA = 6,               /* HQ is not a multiple of H, or one of them is 0 and not the other
                                             (a call without heads, HQ = H = 0, is empty and succeeds) */
    NSA_STATUS_BAD_CMP_STRIDE = 7,        /* cmp_stride d < 1 or > INT32_MAX, or d does not divide cmp_len l */
    NSA_STATUS_BAD_CMP_LEN = 8,           /* cmp_len l < 1 or > INT32_MAX, or l > slc_block l' */
    NSA_STATUS_BAD_SLC_BLOCK = 9,         /* slc_block l' > INT32_MAX, or d does not divide l' */
    NSA_STATUS_BAD_TOPK = 10,             /* slc_topk n < 1, n < n_init + n_local, negative forced counts,
                                             or any of the three > INT32_MAX */
    NSA_STATUS_BAD_WINDOW = 11,           /* window w < 1 (NSA), or window_left/right < -1 (attention) */
    NSA_STATUS_BAD_SCALE = 12,            /* scale is negative, NaN or infinite */
    NSA_STATUS_BAD_CU_SEQLENS = 13,       /* cu_seqlens: cu[0] != 0, decreasing, last != T, or B != 1 */
    NSA_STATUS_SIZE_OVERFLOW = 14,        /* an element count or offset does not fit in int64, or the
                                             workspace the call needs does not fit size_t (query
                                             and call alike; nothing written) */
    NSA_STATUS_WORKSPACE_TOO_SMALL = 15,  /* workspace_bytes below the *_workspace_size() answer */
    NSA_STATUS_BACKEND_UNAVAILABLE = 16,  /* backend not compiled in, or no device present */
    NSA_STATUS_NOT_SUPPORTED = 17,        /* valid request that this backend does not implement */
    NSA_STATUS_OUT_OF_MEMORY = 18,        /* host allocation failed (context creation; CUDA attention's
                                             small host table of packed sequences) */
    NSA_STATUS_DEVICE_ERROR = 19,         /* the device runtime reported an error */
    NSA_STATUS_BAD_ARGUMENT = 20,         /* any other invalid scalar (e.g. num_threads < 0) */
    NSA_STATUS_MISSING_OUTPUT = 21,       /* an output that this call must write was not given */
    NSA_STATUS_BAD_SOFTCAP = 22,          /* attention softcap is negative, NaN or infinite */
    NSA_STATUS_BAD_DROPOUT = 23,          /* attention dropout_p is not in [0, 1) (or NaN) */
    NSA_STATUS_BAD_EXPRESSION = 24        /* a mask_mod / score_mod expression does not parse or type-check, or
                                             names an unknown variable, function or tensor */
} nsa_status;

/* A static, never-NULL English description of a status ("unknown status" if out of range). */
NSA_API const char *nsa_status_string(nsa_status status);

/* The detail of the most recent failure on the calling thread: one line (at most 255 bytes,
 * truncated beyond) that starts with the argument at fault, as named in the args struct
 * ("k", "fwd.dout", "config.slc_block", "varlen.cu_seqlens", "workspace_bytes", "ctx"),
 * then what is wrong: the dimension by index and symbol (B, T, HQ, H, DK, DV, Nc, ...), the
 * given and the expected value; for a backend failure, what is not supported or which CUDA
 * call failed with the runtime's error string.
 * Contract: every function of this header that returns an nsa_status empties the detail when
 * it starts and, when it returns anything but SUCCESS, writes it; so after a failure it
 * describes that failure, after a success it is "". It is per thread (C11 _Thread_local):
 * a failure with no context yet (NULL ctx, nsa_config_validate, nsa_context_create) has one
 * too, and threads never see each other's. Read it before the next nsa_ call on the same
 * thread; copy it to keep it.
 * @return a never-NULL, NUL-terminated string owned by the library ("" when none). */
NSA_API const char *nsa_last_error_detail(void);

/* @return NSA_VERSION_NUMBER of the library actually linked. */
NSA_API int nsa_version_number(void);
/* @return "MAJOR.MINOR.PATCH" of the library actually linked. */
NSA_API const char *nsa_version_string(void);

/* ------------------------------------------------------------------------------------ */
/* Tensors                                                                               */
/* ------------------------------------------------------------------------------------ */
typedef enum nsa_dtype {
    NSA_DTYPE_F32 = 0,   /* IEEE float (on CUDA: scalar kernels, exact but 300-450x slower than bf16) */
    NSA_DTYPE_F16 = 1,   /* IEEE half */
    NSA_DTYPE_BF16 = 2,  /* bfloat16 */
    NSA_DTYPE_I32 = 3,   /* int32: block_indices, block_counts, segment ids */
    NSA_DTYPE_U8 = 4     /* uint8 boolean (nonzero = true): the attention mask */
} nsa_dtype;

#define NSA_MAX_RANK 4

typedef struct nsa_tensor {
    void *data;                     /* NULL = absent (for optional tensors) */
    nsa_dtype dtype;
    int32_t rank;                   /* 1..NSA_MAX_RANK */
    int64_t shape[NSA_MAX_RANK];    /* entries >= rank are ignored */
    int64_t stride[NSA_MAX_RANK];   /* in elements; stride[rank - 1] must be 1 */
} nsa_tensor;

/* A contiguous row-major view of `data` with the given shape (rank 1..4).
 * @return the view (rank 0, data NULL if rank is out of range). */
NSA_API nsa_tensor nsa_tensor_make(void *data, nsa_dtype dtype, int32_t rank, const int64_t *shape);
/* Shorthands for contiguous rank-3 / rank-4 views. @return the view. */
NSA_API nsa_tensor nsa_tensor_3d(void *data, nsa_dtype dtype, int64_t d0, int64_t d1, int64_t d2);
NSA_API nsa_tensor nsa_tensor_4d(void *data, nsa_dtype dtype, int64_t d0, int64_t d1, int64_t d2, int64_t d3);
/* @return bytes per element of dtype (0 for an unknown dtype). */
NSA_API size_t nsa_dtype_size(nsa_dtype dtype);
/* @return the dtype's short name ("f32", "f16", "bf16", "i32", "u8"; "unknown" otherwise), static. */
NSA_API const char *nsa_dtype_name(nsa_dtype dtype);

/* ------------------------------------------------------------------------------------ */
/* Configuration (defaults = the paper's values)                                         */
/* ------------------------------------------------------------------------------------ */
/* Block sizes and counts are at most INT32_MAX (block indices are int32 and the GPU counts in
 * 32 bits); the window has no upper bound (longer than the sequence: the whole prefix). */
typedef struct nsa_config {
    int64_t cmp_len;     /* l:  tokens per compressed block                    (32)  */
    int64_t cmp_stride;  /* d:  stride between compressed blocks, d | l        (16)  */
    int64_t slc_block;   /* l': tokens per selection block, d | l', l <= l'     (64)  */
    int64_t slc_topk;    /* n:  selected blocks per query, forced ones included (16)  */
    int64_t n_init;      /* leading blocks always selected                      (1)   */
    int64_t n_local;     /* blocks ending at the query's own block, always kept (2)   */
    int64_t window;      /* w:  sliding window, keys in [t - w + 1, t], >= 1    (512) */
    float scale;         /* softmax scale; 0 = 1 / sqrt(DK)                     (0)   */
    float swa_scale;     /* the sliding-window branch's softmax scale; 0 = scale (0)   */
} nsa_config;

/* @return the paper's configuration: l=32, d=16, l'=64, n=16, n_init=1, n_local=2,
 *         w=512, scale=0 (meaning 1/sqrt(DK)), swa_scale=0 (meaning scale). */
NSA_API nsa_config nsa_config_default(void);
/* @return NSA_STATUS_SUCCESS, or the status naming the first invalid field. */
NSA_API nsa_status nsa_config_validate(const nsa_config *config);
/* @return Nc = floor((T - l) / d) + 1 for T >= l, else 0 (spec section 1). */
NSA_API int64_t nsa_num_cmp_blocks(const nsa_config *config, int64_t T);
/* @return nb = ceil(T / l'), the number of selection blocks of a T-token sequence. */
NSA_API int64_t nsa_num_slc_blocks(const nsa_config *config, int64_t T);
/* Packed compressed-row offsets for varlen: cu_cmp[s] = sum_{r<s} Nc(len_r), num_seqs + 1
 * entries written to cu_cmp (host). @return SUCCESS, NULL_POINTER or BAD_CU_SEQLENS. */
NSA_API nsa_status nsa_cmp_offsets(const nsa_config *config, const int32_t *cu_seqlens,
                                   int64_t num_seqs, int64_t *cu_cmp);

/* Variable-length description, shared by every op. Zero-initialised = not varlen. */
typedef struct nsa_varlen {
    const int32_t *cu_seqlens;  /* HOST [num_seqs + 1] or NULL; requires B == 1 */
    int64_t num_seqs;           /* N >= 0 (ignored when cu_seqlens is NULL) */
} nsa_varlen;

/* ------------------------------------------------------------------------------------ */
/* Context: one per backend (and per device / stream for CUDA)                           */
/* ------------------------------------------------------------------------------------ */
typedef enum nsa_backend {
    NSA_BACKEND_CPU = 0,   /* C11 + OpenMP; host pointers */
    NSA_BACKEND_CUDA = 1   /* NVIDIA GPUs; device pointers, calls are async on `stream` */
} nsa_backend;

typedef struct nsa_context_desc {
    nsa_backend backend;
    int32_t num_threads;   /* CPU: worker threads, 0 = OpenMP default (OMP_NUM_THREADS) */
    int32_t device;        /* CUDA: device ordinal */
    void *stream;          /* CUDA: cudaStream_t, NULL = default stream */
} nsa_context_desc;

typedef struct nsa_context nsa_context;

/* @return nonzero when `backend` is compiled in and (for CUDA) a device is present. */
NSA_API int nsa_backend_available(nsa_backend backend);
/* Creates a context; *ctx is set to NULL on failure.
 * @return SUCCESS, NULL_POINTER, BAD_ARGUMENT, BACKEND_UNAVAILABLE or OUT_OF_MEMORY. */
NSA_API nsa_status nsa_context_create(nsa_context **ctx, const nsa_context_desc *desc);
/* CUDA: the stream later calls run on. CPU: ignored. @return SUCCESS or NULL_POINTER. */
NSA_API nsa_status nsa_context_set_stream(nsa_context *ctx, void *stream);
/* @return the backend of ctx (NSA_BACKEND_CPU for NULL). */
NSA_API nsa_backend nsa_context_backend(const nsa_context *ctx);
/* Frees ctx; NULL is a no-op. */
NSA_API void nsa_context_destroy(nsa_context *ctx);

/* ==================================================================================== */
/* Operations. Each has args (inputs and outputs), a workspace query and a call.         */
/* Backward args embed the forward args as their first member: fill the forward part     */
/* exactly as for the forward (its outputs become inputs there), then the gradients.     */
/* All floating tensors of one call share q's dtype unless noted; lse is always F32.     */
/* ==================================================================================== */

/* ---- 1. Compression: mean over overlapping blocks (spec 1) ------------------------- */
typedef struct nsa_compress_args {
    nsa_tensor x;        /* in  [B, T, H, D]   (k or v)                                 */
    nsa_tensor x_cmp;    /* out [B, Nc, H, D]; x_cmp[b,i] = mean(x[b, i*d : i*d + l])   */
    nsa_varlen varlen;
    nsa_config config;   /* cmp_len, cmp_stride */
} nsa_compress_args;

typedef struct nsa_compress_bwd_args {
    nsa_compress_args fwd;  /* x: only its shape and dtype are read; x_cmp unused      */
    nsa_tensor dx_cmp;      /* in  [B, Nc, H, D] */
    nsa_tensor dx;          /* out [B, T, H, D]  */
} nsa_compress_bwd_args;

NSA_API nsa_status nsa_compress_workspace_size(nsa_context *ctx, const nsa_compress_args *args, size_t *bytes);
NSA_API nsa_status nsa_compress(nsa_context *ctx, const nsa_compress_args *args, void *workspace, size_t workspace_bytes);
NSA_API nsa_status nsa_compress_bwd_workspace_size(nsa_context *ctx, const nsa_compress_bwd_args *args, size_t *bytes);
NSA_API nsa_status nsa_compress_bwd(nsa_context *ctx, const nsa_compress_bwd_args *args, void *workspace, size_t workspace_bytes);

/* ---- Query chunks (spec 0.3), for the NSA operations 2, 3, 4 and 7 ------------------ */
/* Besides whole sequences (q and k share T), these operations take a chunk of a sequence's
 * queries against the sequence's whole prefix of keys, the local step of context parallelism:
 * q (and o, lse, gates, block_indices, block_counts, dout, dq) has Tq rows, the key side Tk >= Tq
 * (k, v and their overrides, dk, dv: Tk rows; k_cmp, v_cmp: Nc(Tk) rows), and query row i is
 * position Tk - Tq + i (aligned bottom-right, like nsa_attention). Every rule applies at that
 * position, so row i equals row Tk - Tq + i of the whole-sequence call, and the backward's dk,
 * dv (and dk_cmp, ...) are the whole-sequence call's with dout zero outside the chunk. The
 * operations with k take Tk from k's dim 1; nsa_cmp_attn and nsa_select, which have only the
 * compressed keys, from kv_len. Dense batches only: under varlen.cu_seqlens, Tq == Tk. Both
 * backends, every dtype and kernel of the whole-sequence calls. */

/* ---- 2. Compressed attention (spec 2) ---------------------------------------------- */
/* Query t sees block i iff i*d + l - 1 <= t; a query that sees no block gets o = 0 and
 * lse = -inf. Query head hq uses kv head hq / G. */
typedef struct nsa_cmp_attn_args {
    nsa_tensor q;        /* in  [B, T, HQ, DK]  */
    nsa_tensor k_cmp;    /* in  [B, Nc, H, DK]  */
    nsa_tensor v_cmp;    /* in  [B, Nc, H, DV]  */
    nsa_tensor o;        /* out [B, T, HQ, DV]  */
    nsa_tensor lse;      /* out [B, T, HQ] F32: log sum_i exp(scale * q.k_cmp[i])       */
    nsa_varlen varlen;
    nsa_config config;   /* cmp_len, cmp_stride, scale */
    int64_t kv_len;      /* Tk, the tokens the compressed rows come from (Nc = Nc(Tk)); the T
                            queries are positions Tk - T .. Tk - 1. 0 = T (whole sequences) */
} nsa_cmp_attn_args;

typedef struct nsa_cmp_attn_bwd_args {
    nsa_cmp_attn_args fwd;  /* o and lse: the forward's outputs, read here */
    nsa_tensor dout;        /* in  [B, T, HQ, DV] */
    nsa_tensor dq;          /* out [B, T, HQ, DK] */
    nsa_tensor dk_cmp;      /* out [B, Nc, H, DK] */
    nsa_tensor dv_cmp;      /* out [B, Nc, H, DV] */
} nsa_cmp_attn_bwd_args;

NSA_API nsa_status nsa_cmp_attn_workspace_size(nsa_context *ctx, const nsa_cmp_attn_args *args, size_t *bytes);
NSA_API nsa_status nsa_cmp_attn(nsa_context *ctx, const nsa_cmp_attn_args *args, void *workspace, size_t workspace_bytes);
NSA_API nsa_status nsa_cmp_attn_bwd_workspace_size(nsa_context *ctx, const nsa_cmp_attn_bwd_args *args, size_t *bytes);
NSA_API nsa_status nsa_cmp_attn_bwd(nsa_context *ctx, const nsa_cmp_attn_bwd_args *args, void *workspace, size_t workspace_bytes);

/* ---- 3. Importance + top-n selection (spec 3). No gradient. ------------------------- */
/* Importance of selection block j for kv head h = sum over the G query heads and over
 * the compressed blocks i of p_cmp[t, hq, i] * overlap(i, j) / d. Forced blocks
 * (j < n_init, j > cur - n_local) rank first; ties go to the lower index; the kept
 * indices are written ascending, padded with -1. */
typedef struct nsa_select_args {
    nsa_tensor q;              /* in  [B, T, HQ, DK] */
    nsa_tensor k_cmp;          /* in  [B, Nc, H, DK] */
    nsa_tensor lse_cmp;        /* in, optional [B, T, HQ] F32 from nsa_cmp_attn; recomputed if absent */
    nsa_tensor block_indices;  /* out [B, T, H, n] I32, ascending, -1 padded */
    nsa_tensor block_counts;   /* out, optional [B, T, H] I32: valid entries per row */
    nsa_varlen varlen;
    nsa_config config;         /* all selection fields, scale */
    int64_t kv_len;            /* Tk of a query chunk, as in nsa_cmp_attn_args; 0 = T */
} nsa_select_args;

NSA_API nsa_status nsa_select_workspace_size(nsa_context *ctx, const nsa_select_args *args, size_t *bytes);
NSA_API nsa_status nsa_select(nsa_context *ctx, const nsa_select_args *args, void *workspace, size_t workspace_bytes);

/* ---- 4. Selected attention (spec 4) ------------------------------------------------ */
/* Query t (all heads of group h) attends to the tokens of blocks block_indices[b,t,h,:]
 * with key position <= t. Entries that are -1 or outside [0, nb) are skipped, duplicates
 * count once; with block_counts only the first block_counts[b,t,h] entries are read. */
typedef struct nsa_slc_attn_args {
    nsa_tensor q;              /* in  [B, T, HQ, DK] */
    nsa_tensor k;              /* in  [B, Tk, H, DK] (Tk = T, or a query chunk's key side) */
    nsa_tensor v;              /* in  [B, Tk, H, DV] */
    nsa_tensor block_indices;  /* in  [B, T, H, m] I32 (any m >= 1; m = n from nsa_select) */
    nsa_tensor block_counts;   /* in, optional [B, T, H] I32 */
    nsa_tensor o;              /* out [B, T, HQ, DV] */
    nsa_tensor lse;            /* out [B, T, HQ] F32 */
    nsa_varlen varlen;
    nsa_config config;         /* slc_block, scale */
} nsa_slc_attn_args;

typedef struct nsa_slc_attn_bwd_args {
    nsa_slc_attn_args fwd;
    nsa_tensor dout;           /* in  [B, T, HQ, DV] */
    nsa_tensor dq;             /* out [B, T, HQ, DK] */
    nsa_tensor dk;             /* out [B, Tk, H, DK] */
    nsa_tensor dv;             /* out [B, Tk, H, DV] */
} nsa_slc_attn_bwd_args;

NSA_API nsa_status nsa_slc_attn_workspace_size(nsa_context *ctx, const nsa_slc_attn_args *args, size_t *bytes);
NSA_API nsa_status nsa_slc_attn(nsa_context *ctx, const nsa_slc_attn_args *args, void *workspace, size_t workspace_bytes);
NSA_API nsa_status nsa_slc_attn_bwd_workspace_size(nsa_context *ctx, const nsa_slc_attn_bwd_args *args, size_t *bytes);
NSA_API nsa_status nsa_slc_attn_bwd(nsa_context *ctx, const nsa_slc_attn_bwd_args *args, void *workspace, size_t workspace_bytes);

/* ---- 5. Dense / windowed attention (the flash-attention core; spec 5) --------------- */
/* q [B, Tq, HQ, DK], k [B, Tk, H, DK], v [B, Tk, H, DV]; Tq may differ from Tk. Query head
 * hq uses kv head hq / G. Per sequence of Tq queries and Tk keys, let shift = Tk - Tq (the
 * diagonal is aligned bottom-right, as in flash-attn). Below, i and j are positions within the
 * sequence for the window, and rows of q's / k's dim 1 for the tensors indexed by them (the
 * same for dense input; packed rows under varlen). Query i sees key j iff ALL hold:
 *   window:   (window_left < 0 || j >= i + shift - window_left) and
 *             causal ? j <= i + shift : (window_right < 0 || j <= i + shift + window_right);
 *   segments: q_segment_ids[b, i] == k_segment_ids[b, j]   (when given);
 *   mask:     mask[b, hq, i, j] != 0                       (when given).
 * The score of a visible pair is
 *   s = cap(scale * q_i . k_j) + bias[b, hq, i, j],  cap(u) = softcap * tanh(u / softcap)
 * (cap = identity when softcap == 0: the softcap bounds q.k only, the bias is added AFTER it;
 * a -inf bias entry hides the pair like the mask does).
 * With sinks, Z = sum_visible exp(s) + exp(sinks[hq]); without, Z = sum_visible exp(s);
 * lse = log Z and P_ij = exp(s_ij - lse) (a sink is a logit with no value: it only dilutes).
 * Dropout keeps P_ij with probability 1 - p and scales the kept ones by 1 / (1 - p):
 *   o_i = sum_j P_ij * keep_ij / (1 - p) * v_j,   lse stays that of the undropped softmax.
 * Rows that see no key get o = 0 and lse = -inf (lse = sinks[hq] with sinks); never NaN.
 *
 * Dropout mask (bit-exact on every backend): Philox4x32-10 (Salmon et al. 2011, the
 * Random123 constants M0 = 0xD2511F53, M1 = 0xCD9E8D57, W0 = 0x9E3779B9, W1 = 0xBB67AE85),
 * key = (lo32(seed), hi32(seed)). For element (b, hq, i, j), i and j rows of q's and k's
 * dim 1 (packed rows under varlen, where b = 0):
 *   x = offset + (uint64)(b * HQ + hq)              (mod 2^64)
 *   counter = (c0, c1, c2, c3) = ((uint32)(j >> 2), (uint32)i, lo32(x), hi32(x))
 *   r = Philox4x32-10(counter, key)[j & 3]          (one call serves 4 consecutive keys)
 *   keep_ij = r >= (uint32)floor((double)p * 2^32)
 * Successive calls that want independent masks advance offset by at least B * HQ.
 *
 * Varlen: either varlen.cu_seqlens (int32, the same packing for q and k, Tq == Tk) or
 * varlen_qk (int64, separate packings of q and k); not both. Bias, mask and segment ids are
 * indexed by packed rows then (B == 1).
 * CUDA backend: every option, f16 / bf16 / f32 q, k, v (and o, dq, dk, dv; f32 on scalar
 * kernels, 300-450x slower), head dims up to 256;
 * deterministic (no atomics). Calls with none of softcap, sinks, segment ids, bias, mask,
 * dropout, varlen_qk, Tq != Tk run the tuned tiles (so does the forward with only softcap,
 * sinks and / or Tq != Tk in a dense batch, and the backward with a softcap alone); the others
 * general kernels (src/cuda/attention). */
typedef struct nsa_varlen_qk {
    const int64_t *cu_seqlens_q;  /* HOST [num_seqs + 1] or NULL: packed query rows, cu[N] == Tq */
    const int64_t *cu_seqlens_k;  /* HOST [num_seqs + 1]: packed key rows, cu[N] == Tk (both or neither) */
    int64_t num_seqs;             /* N >= 0; requires B == 1 */
} nsa_varlen_qk;

typedef struct nsa_attention_args {
    nsa_tensor q;          /* in  [B, Tq, HQ, DK] */
    nsa_tensor k;          /* in  [B, Tk, H, DK]  */
    nsa_tensor v;          /* in  [B, Tk, H, DV]  */
    nsa_tensor o;          /* out [B, Tq, HQ, DV] */
    nsa_tensor lse;        /* out [B, Tq, HQ] F32 */
    nsa_varlen varlen;     /* int32, requires Tq == Tk; see varlen_qk */
    float scale;           /* 0 = 1 / sqrt(DK) */
    int32_t causal;        /* != 0: window_right = 0 (bottom-right aligned when Tq != Tk) */
    int64_t window_left;   /* -1 = unbounded; any length up to INT64_MAX */
    int64_t window_right;  /* -1 = unbounded (ignored when causal); any length up to INT64_MAX */
    /* ---- appended in 0.2; zero-initialised = off (the 0.1 behaviour) ---- */
    float softcap;             /* > 0: logit softcap on the scaled score; 0 = off; finite, >= 0 */
    nsa_tensor sinks;          /* in, optional [HQ] F32: one sink logit per query head */
    nsa_tensor q_segment_ids;  /* in, optional [B, Tq] I32 (given with k_segment_ids) */
    nsa_tensor k_segment_ids;  /* in, optional [B, Tk] I32: attend only where ids are equal */
    nsa_tensor bias;           /* in, optional [Bb, Hb, Tq, Tk], any float dtype, Bb in {1, B},
                                  Hb in {1, HQ} (a size-1 dim broadcasts; so does stride 0) */
    nsa_tensor mask;           /* in, optional [Bm, Hm, Tq, Tk] U8, Bm in {1, B}, Hm in {1, HQ};
                                  nonzero = keep */
    float dropout_p;           /* in [0, 1); 0 = off */
    uint64_t dropout_seed;     /* Philox key (see above) */
    uint64_t dropout_offset;   /* Philox counter offset (see above) */
    nsa_varlen_qk varlen_qk;   /* separate q / k packings (int64); zero = not used */
} nsa_attention_args;

typedef struct nsa_attention_bwd_args {
    nsa_attention_args fwd;  /* o and lse: the forward's outputs, read here; same options */
    nsa_tensor dout;       /* in  [B, Tq, HQ, DV] */
    nsa_tensor dq;         /* out [B, Tq, HQ, DK] */
    nsa_tensor dk;         /* out [B, Tk, H, DK]  */
    nsa_tensor dv;         /* out [B, Tk, H, DV]  */
    /* ---- appended in 0.2 ---- */
    nsa_tensor dsinks;     /* out [HQ] F32, required when fwd.sinks is given:
                              dsinks[hq] = -sum over the rows of head hq of exp(sink - lse) * D,
                              D = rowsum(dout * o) */
    nsa_tensor dbias;      /* out, optional (fwd.bias given): same shape as fwd.bias, any float
                              dtype, no stride 0 on a dim of size > 1; the gradient summed over
                              the dims that fwd.bias broadcasts (size 1) */
} nsa_attention_bwd_args;

NSA_API nsa_status nsa_attention_workspace_size(nsa_context *ctx, const nsa_attention_args *args, size_t *bytes);
NSA_API nsa_status nsa_attention(nsa_context *ctx, const nsa_attention_args *args, void *workspace, size_t workspace_bytes);
NSA_API nsa_status nsa_attention_bwd_workspace_size(nsa_context *ctx, const nsa_attention_bwd_args *args, size_t *bytes);
NSA_API nsa_status nsa_attention_bwd(nsa_context *ctx, const nsa_attention_bwd_args *args, void *workspace, size_t workspace_bytes);

/* ---- 6. Gated combination (spec 6) -------------------------------------------------- */
/* o = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa; a branch whose gate is absent is
 * skipped (its o_* may be absent too). At least one gate must be present. */
typedef struct nsa_gate_args {
    nsa_tensor o_cmp, o_slc, o_swa;  /* in  [B, T, HQ, DV] (any float dtype each) */
    nsa_tensor g_cmp, g_slc, g_swa;  /* in  [B, T, HQ], optional */
    nsa_tensor o;                    /* out [B, T, HQ, DV] */
} nsa_gate_args;

typedef struct nsa_gate_bwd_args {
    nsa_gate_args fwd;
    nsa_tensor dout;                    /* in  [B, T, HQ, DV] */
    nsa_tensor do_cmp, do_slc, do_swa;  /* out [B, T, HQ, DV] for present gates: g * dout */
    nsa_tensor dg_cmp, dg_slc, dg_swa;  /* out [B, T, HQ] for present gates: sum_d dout * o_* */
} nsa_gate_bwd_args;

NSA_API nsa_status nsa_gate_workspace_size(nsa_context *ctx, const nsa_gate_args *args, size_t *bytes);
NSA_API nsa_status nsa_gate(nsa_context *ctx, const nsa_gate_args *args, void *workspace, size_t workspace_bytes);
NSA_API nsa_status nsa_gate_bwd_workspace_size(nsa_context *ctx, const nsa_gate_bwd_args *args, size_t *bytes);
NSA_API nsa_status nsa_gate_bwd(nsa_context *ctx, const nsa_gate_bwd_args *args, void *workspace, size_t workspace_bytes);

/* ---- 7. The whole NSA forward and backward ------------------------------------------ */
/* What nsa_forward leaves for nsa_backward. Tensors of disabled branches may be absent. */
typedef struct nsa_saved {
    nsa_tensor block_indices;          /* out [B, T, H, n] I32 (selection branch on and no caller indices) */
    nsa_tensor o_cmp, o_slc, o_swa;    /* out [B, T, HQ, DV] per-branch outputs (any float dtype) */
    nsa_tensor lse_cmp, lse_slc, lse_swa;  /* out [B, T, HQ] F32 */
} nsa_saved;

typedef struct nsa_forward_args {
    nsa_tensor q;                /* in  [B, T, HQ, DK] */
    nsa_tensor k, v;             /* in  [B, Tk, H, DK], [B, Tk, H, DV]: compression source and the
                                        default K/V of the selection and window branches (Tk = T,
                                        or the key side of a query chunk) */
    nsa_tensor k_slc, v_slc;     /* in, optional: separate K/V of the selection branch (both or none) */
    nsa_tensor k_swa, v_swa;     /* in, optional: separate K/V of the window branch (both or none) */
    nsa_tensor k_cmp, v_cmp;     /* in, optional [B, Nc(Tk), H, DK/DV]: the caller's compression
                                        (a learnable phi); default mean pooling of k, v */
    nsa_tensor g_cmp, g_slc, g_swa;  /* in, optional [B, T, HQ]: branch gates; absent = branch off */
    nsa_tensor block_indices;    /* in, optional [B, T, H, m] I32: the caller's selection */
    nsa_tensor block_counts;     /* in, optional [B, T, H] I32 (with block_indices only) */
    nsa_tensor o;                /* out [B, T, HQ, DV] */
    nsa_saved saved;             /* out: what the backward needs */
    nsa_varlen varlen;
    nsa_config config;
} nsa_forward_args;

typedef struct nsa_backward_args {
    nsa_forward_args fwd;        /* the forward's args; saved.* are read */
    nsa_tensor dout;             /* in  [B, T, HQ, DV] */
    nsa_tensor dq;               /* out [B, T, HQ, DK] */
    nsa_tensor dk, dv;           /* out [B, Tk, H, DK/DV] */
    nsa_tensor dk_slc, dv_slc;   /* out when k_slc/v_slc were given */
    nsa_tensor dk_swa, dv_swa;   /* out when k_swa/v_swa were given */
    nsa_tensor dk_cmp, dv_cmp;   /* out when k_cmp/v_cmp were given */
    nsa_tensor dg_cmp, dg_slc, dg_swa;  /* out for present gates */
} nsa_backward_args;

NSA_API nsa_status nsa_forward_workspace_size(nsa_context *ctx, const nsa_forward_args *args, size_t *bytes);
NSA_API nsa_status nsa_forward(nsa_context *ctx, const nsa_forward_args *args, void *workspace, size_t workspace_bytes);
NSA_API nsa_status nsa_backward_workspace_size(nsa_context *ctx, const nsa_backward_args *args, size_t *bytes);
NSA_API nsa_status nsa_backward(nsa_context *ctx, const nsa_backward_args *args, void *workspace, size_t workspace_bytes);

/* ---- 8. Inference: one step of new queries against KV caches (spec 12) ------------- */
/* A cache of K / V rows per sequence, in the context's memory (host for the CPU):
 *   contiguous: k [B, cap, H, DK], v [B, cap, H, DV], block_table absent: row r of sequence b
 *               is k[b, r] (capacity cap rows);
 *   paged:      k [num_pages, page_size, H, DK], v alike, block_table [B, max_pages] I32 in the
 *               context's memory: row r of sequence b is k[block_table[b, r / page_size],
 *               r % page_size] (capacity max_pages * page_size rows; pages in any order, any
 *               page_size >= 1). */
typedef struct nsa_kv_cache {
    nsa_tensor k, v;
    nsa_tensor block_table;    /* optional [B, max_pages] I32: present = paged */
} nsa_kv_cache;

/* One step of NSA over cached sequences: decode (one new query per sequence), a multi-token
 * step (speculative verification) or a chunk of a chunked prefill. Sequence b has n_b =
 * q_lens[b] new queries (rows 0 .. n_b - 1 of q; absent q_lens: Tq each) and L0_b =
 * seqlens[b] cached tokens before the step. With k_new / v_new the step first appends their
 * rows 0 .. n_b - 1 at cache rows L0_b .. L0_b + n_b - 1 and the sequence has L_b = L0_b + n_b
 * tokens (flash_attn_with_kvcache's convention); without them the cache already holds the
 * step's tokens and L_b = L0_b (then n_b <= L0_b). Either way query i of sequence b is the token
 * at position L_b - n_b + i, and its output is row L_b - n_b + i of nsa_forward over the L_b
 * cached tokens (same config, gates, selection rule and ties, or the caller's block_indices as
 * nsa_forward takes them). cmp_cache holds Nc(L) compressed
 * rows per sequence: with cmp_by_caller 0 the step writes the rows that its tokens complete
 * (those ending at positions L_b - n_b .. L_b - 1) by mean pooling of the token cache; with 1
 * the caller keeps them (a learnable phi) and the step only reads them. The selection and
 * window branches read the token cache. Lengths past a cache's capacity, a page index outside
 * [0, num_pages) in a row the step reads or writes, or n_b outside [0, Tq] are caught before
 * any write: the CPU checks them on the host and returns NSA_STATUS_BAD_ARGUMENT naming the
 * element (nothing written); the CUDA backend reads them on the device only (no host
 * synchronisation: a captured CUDA graph replays for any lengths), skips such a sequence
 * (nothing of it written to the caches, its rows of o zero and of selected -1) and reports it
 * in `errors`. Rows n_b .. Tq - 1 of o are zero and of selected -1 (no query is there), so
 * every output row is defined after a step. Sequences must not share the pages a step
 * writes. */
typedef enum nsa_step_error {
    NSA_STEP_OK = 0,
    NSA_STEP_BAD_QLEN = 1,           /* q_lens[b] outside [0, Tq] */
    NSA_STEP_BAD_SEQLEN = 2,         /* seqlens[b] < 0 */
    NSA_STEP_NO_TOKENS = 3,          /* without k_new: q_lens[b] > seqlens[b] */
    NSA_STEP_OVER_CAPACITY = 4,      /* the sequence's tokens exceed the token cache */
    NSA_STEP_OVER_CMP_CAPACITY = 5,  /* its compressed rows exceed the compressed cache */
    NSA_STEP_BAD_PAGE = 6,           /* a token-cache page outside [0, num_pages) */
    NSA_STEP_BAD_CMP_PAGE = 7        /* a compressed-cache page outside [0, num_pages) */
} nsa_step_error;
typedef struct nsa_step_args {
    nsa_tensor q;                /* in  [B, Tq, HQ, DK] */
    nsa_tensor q_lens;           /* in, optional [B] I32: new queries per sequence (absent: Tq) */
    nsa_tensor seqlens;          /* in  [B] I32: cached tokens per sequence before the step */
    nsa_tensor k_new, v_new;     /* in, optional [B, Tq, H, DK/DV]: the step's tokens to append (both or none) */
    nsa_kv_cache cache;          /* in/out: token K / V */
    nsa_kv_cache cmp_cache;      /* in/out: compressed K / V (needed when g_cmp or g_slc is given) */
    int32_t cmp_by_caller;       /* 0: the step mean-pools the compressed rows its tokens complete;
                                    1: cmp_cache is kept by the caller */
    nsa_tensor g_cmp, g_slc, g_swa;  /* in, optional [B, Tq, HQ]: branch gates; absent = branch off */
    nsa_tensor block_indices;    /* in, optional [B, Tq, H, m] I32: the caller's selection (as nsa_forward's) */
    nsa_tensor block_counts;     /* in, optional [B, Tq, H] I32 (with block_indices only) */
    nsa_tensor o;                /* out [B, Tq, HQ, DV]: rows 0 .. n_b - 1 of each sequence, zero after */
    nsa_tensor selected;         /* out, optional [B, Tq, H, n] I32: the selection the step made
                                    (selection branch on and no caller indices; else ignored) */
    nsa_tensor errors;           /* out, optional [B] I32: per sequence NSA_STEP_OK or the nsa_step_error
                                    of the first problem found (CUDA: that sequence skipped) */
    nsa_config config;
} nsa_step_args;

NSA_API nsa_status nsa_step_workspace_size(nsa_context *ctx, const nsa_step_args *args, size_t *bytes);
NSA_API nsa_status nsa_step(nsa_context *ctx, const nsa_step_args *args, void *workspace, size_t workspace_bytes);

/* Dense attention of one step's queries against a token cache (spec 12.1): the caches, lengths,
 * append, checks and `errors` of nsa_step, nsa_attention's function. Query i of sequence b (the
 * token at position p = L_b - n_b + i) sees cached key j < L_b iff
 *   (window_left < 0 || j >= p - window_left) and
 *   (causal ? j <= p : (window_right < 0 || j <= p + window_right)),
 * which is row i of nsa_attention with q = the step's n_b queries and k, v = the L_b cached rows
 * (Tq != Tk: bottom-right aligned), the same scale, softcap and sinks; o and lse as nsa_attention
 * writes them (a row that sees no key: o = 0, lse = -inf, or the sink's logit with sinks). For a
 * causal model this is row p of nsa_attention over the whole sequence. Rows n_b .. Tq - 1 of o
 * are zero and of lse -inf, as are a skipped sequence's rows (CUDA). */
typedef struct nsa_attention_step_args {
    nsa_tensor q;                /* in  [B, Tq, HQ, DK] */
    nsa_tensor q_lens;           /* in, optional [B] I32: new queries per sequence (absent: Tq) */
    nsa_tensor seqlens;          /* in  [B] I32: cached tokens per sequence before the step */
    nsa_tensor k_new, v_new;     /* in, optional [B, Tq, H, DK/DV]: the step's tokens to append (both or none) */
    nsa_kv_cache cache;          /* in/out: token K / V */
    nsa_tensor o;                /* out [B, Tq, HQ, DV] */
    nsa_tensor lse;              /* out, optional [B, Tq, HQ] F32 */
    nsa_tensor errors;           /* out, optional [B] I32: as nsa_step's */
    float scale;                 /* 0 = 1 / sqrt(DK) */
    int32_t causal;              /* != 0: window_right = 0 */
    int64_t window_left;         /* -1 = unbounded */
    int64_t window_right;        /* -1 = unbounded (ignored when causal) */
    float softcap;               /* > 0: logit softcap on the scaled score; 0 = off */
    nsa_tensor sinks;            /* in, optional [HQ] F32: one sink logit per query head */
} nsa_attention_step_args;

NSA_API nsa_status nsa_attention_step_workspace_size(nsa_context *ctx, const nsa_attention_step_args *args, size_t *bytes);
NSA_API nsa_status nsa_attention_step(nsa_context *ctx, const nsa_attention_step_args *args, void *workspace,
                                      size_t workspace_bytes);

/* ---- 9. Block-sparse attention with mods (FlexAttention's model; spec 13, 14) ------------ */
/* A mask_mod or score_mod: one expression of the language of spec 13 over b, h (the query
 * head), q_idx, kv_idx (and score), reading the tensors given here by name, e.g.
 *   "q_idx >= kv_idx && doc[q_idx] == doc[kv_idx]"        (a mask_mod)
 *   "score - slope[h] * abs(q_idx - kv_idx)"              (a score_mod: ALiBi)
 * Parsed and type-checked once; a bad expression is NSA_STATUS_BAD_EXPRESSION with a detail
 * giving the column ("mask_mod:10: unknown name 'kvidx'"). The tensors are referenced, not
 * copied: they must stay valid while the mod is used, in the memory of the context of the
 * call that uses it (host for the CPU). Reads clamp every index into its dimension. */
typedef struct nsa_mod nsa_mod;
typedef enum nsa_mod_kind {
    NSA_MOD_MASK = 0,  /* mask_mod(b, h, q_idx, kv_idx) -> bool: the pair is visible */
    NSA_MOD_SCORE = 1  /* score_mod(score, b, h, q_idx, kv_idx) -> float: the new score */
} nsa_mod_kind;
#define NSA_MOD_MAX_TENSORS 16
typedef struct nsa_mod_tensor {
    const char *name;      /* letters, digits and _, at most 32, not a variable or function name */
    nsa_tensor tensor;     /* rank 1-4, dims >= 1: I32 reads as int, U8 as bool, F32 / F16 / BF16 as float */
} nsa_mod_tensor;
/* *mod is NULL on failure. @return SUCCESS, NULL_POINTER, BAD_ARGUMENT, BAD_EXPRESSION,
 * BAD_RANK / BAD_SHAPE / BAD_STRIDE / BAD_DTYPE (a tensor) or OUT_OF_MEMORY. */
NSA_API nsa_status nsa_mod_create(nsa_mod **mod, nsa_mod_kind kind, const char *text, const nsa_mod_tensor *tensors,
                                  int32_t num_tensors);
/* Frees mod; NULL is a no-op. */
NSA_API void nsa_mod_destroy(nsa_mod *mod);

/* FlexAttention's BlockMask: for query block i (rows i*q_block .. (i+1)*q_block - 1) of batch
 * entry b and query head h, the key blocks it visits. Partial blocks (kv_indices) have the
 * mask_mod applied to each pair; full blocks (full_kv_indices) are visible whole. Every index
 * lies in [0, ceil(Tk / kv_block)) and a block is listed once per query block (partial and full
 * together); counts lie in [0, list width]. Keys past Tk in a last, short block never exist. */
typedef struct nsa_block_mask {
    int64_t q_block, kv_block;        /* rows per query and key block, >= 1 (FlexAttention: 128) */
    nsa_tensor kv_num_blocks;         /* [Bm, Hm, NQB] I32, Bm in {1, B}, Hm in {1, HQ}, NQB = ceil(Tq / q_block);
                                         absent: every key block is partial (a dense mask_mod) */
    nsa_tensor kv_indices;            /* [Bm, Hm, NQB, W] I32 (with kv_num_blocks) */
    nsa_tensor full_kv_num_blocks;    /* optional [Bm, Hm, NQB] I32 */
    nsa_tensor full_kv_indices;       /* [Bm, Hm, NQB, Wf] I32 (with full_kv_num_blocks) */
} nsa_block_mask;

/* o[b, i, hq] = softmax over the visible keys j of s_ij, s_ij = score_mod(scale * q_i . k_j, b, hq, i, j)
 * (no score_mod: the scaled product), with v of kv head hq / G; a pair is visible when its key
 * block is listed for i's query block and, in a partial block, mask_mod(b, hq, i, j) holds. A
 * score of -inf hides its pair like the mask. Rows that see no key: o = 0, lse = -inf. */
typedef struct nsa_flex_args {
    nsa_tensor q;                 /* in  [B, Tq, HQ, DK] (a [B, HQ, Tq, DK] tensor passes as its transposed view) */
    nsa_tensor k;                 /* in  [B, Tk, H, DK] */
    nsa_tensor v;                 /* in  [B, Tk, H, DV] */
    nsa_tensor o;                 /* out [B, Tq, HQ, DV] */
    nsa_tensor lse;               /* out, optional [B, Tq, HQ] F32 */
    nsa_block_mask block_mask;    /* kv_num_blocks absent: every key block partial (q_block, kv_block still >= 1) */
    const nsa_mod *mask_mod;      /* NULL: every pair of a listed block is visible */
    const nsa_mod *score_mod;     /* NULL: the scaled product */
    float scale;                  /* 0 = 1 / sqrt(DK) */
    const int32_t *doc_runs;      /* optional, host: for a mask_mod that is a document mask of the dense route (spec 14),
                                     the runs of its ids as bounds 0 = doc_runs[0] < ... < doc_runs[num_doc_runs] = Tq
                                     (nsa_flex_doc_runs), so that the route reads no ids from the device; they must be
                                     the runs of the ids the mask_mod reads. Ignored by every other call. */
    int64_t num_doc_runs;         /* with doc_runs: its runs (num_doc_runs + 1 bounds); else 0 */
} nsa_flex_args;

/* The backward: dq, dk, dv and, for each float tensor t the score_mod reads whose gradient is
 * wanted, dscore_tensors[t] (F32, the tensor's shape: the sum over every visible pair of
 * dL/ds * ds/d(element), through the expression's arithmetic; an index the read clamped feeds
 * the element it read). Sums in a fixed order: deterministic for a given thread count. */
typedef struct nsa_flex_bwd_args {
    nsa_flex_args fwd;            /* o and lse: the forward's outputs (lse required here) */
    nsa_tensor dout;              /* in  [B, Tq, HQ, DV] */
    nsa_tensor dq;                /* out [B, Tq, HQ, DK] */
    nsa_tensor dk;                /* out [B, Tk, H, DK] */
    nsa_tensor dv;                /* out [B, Tk, H, DV] */
    nsa_tensor dscore_tensors[NSA_MOD_MAX_TENSORS]; /* out, optional, in the order the score_mod was given its tensors */
} nsa_flex_bwd_args;

/* FlexAttention's create_block_mask, on the host: evaluates mask_mod on every pair (q_idx < Tq,
 * kv_idx < Tk) of every (b, h) of the mask's own batch and head dims (mask->kv_num_blocks'
 * dims 0 and 1: B or 1, HQ or 1; a dim of 1 evaluates b = 0 / h = 0) and writes the lists: a key
 * block all of whose pairs with the query block are visible is full, one with some visible pairs
 * partial, the others unlisted; ascending block order; entries past a count are -1. The caller
 * gives q_block, kv_block and the four tensors (host memory, I32): counts [Bm, Hm, NQB], lists
 * [Bm, Hm, NQB, NKB], NKB = ceil(Tk / kv_block). mask_mod NULL: every block full. The mod's
 * tensors must be in host memory. Mods that are attention options (spec 14, the dense route;
 * Tq == Tk) get the same lists from each row's key interval, without evaluating every pair;
 * other mods are evaluated in OpenMP threads, a block's evaluation stopping once it is partial. @return SUCCESS, NULL_POINTER, BAD_ARGUMENT, BAD_RANK,
 * BAD_SHAPE, BAD_STRIDE or BAD_DTYPE (nothing written). */
NSA_API nsa_status nsa_create_block_mask(const nsa_mod *mask_mod, int64_t Tq, int64_t Tk, nsa_block_mask *mask);

/* CPU and CUDA backends: every form (CUDA: kernels generated per mod pair and compiled by NVRTC
 * on first use; NOT_SUPPORTED saying why where NVRTC is missing). The CUDA backward is
 * deterministic too: its tensor gradients are summed exactly (spec 14). Mods that are
 * nsa_attention options (causal, windows, a document mask, a softcap) with Tq == Tk and a block
 * mask that visits what they see run on nsa_attention's kernels (spec 14, "the dense route";
 * NSA_FLEX_ROUTE=0 turns it off). */
NSA_API nsa_status nsa_flex_attention_workspace_size(nsa_context *ctx, const nsa_flex_args *args, size_t *bytes);
NSA_API nsa_status nsa_flex_attention(nsa_context *ctx, const nsa_flex_args *args, void *workspace, size_t workspace_bytes);
NSA_API nsa_status nsa_flex_attention_bwd_workspace_size(nsa_context *ctx, const nsa_flex_bwd_args *args, size_t *bytes);
NSA_API nsa_status nsa_flex_attention_bwd(nsa_context *ctx, const nsa_flex_bwd_args *args, void *workspace,
                                          size_t workspace_bytes);
/* 1 when a call with these mods (and Tq == Tk) takes the dense route from its mods alone, whatever
 * its data: they are nsa_attention options without a document mask (causal, windows, a softcap),
 * and the route is on; 2 when they are such options with a document mask, which the route takes
 * from the mods and doc_runs alone (with B = 1; on CUDA not while the stream is captured). Such a call computes the same function whether or not it is
 * given a block mask that visits what the mods see (the lists nsa_create_block_mask makes for
 * them); given one, CUDA copies and checks its lists (a synchronisation of the stream), given none
 * (and doc_runs for a document mask) it reads nothing on the host. A caller that holds such
 * lists, unchanged, may therefore leave them out (nsa.flex_attention does). NULL mods are plain
 * attention (1). 0 otherwise. */
NSA_API int nsa_flex_route_without_lists(const nsa_mod *mask_mod, const nsa_mod *score_mod);
/* For doc_runs: the runs of the ids of a document mask (nsa_flex_route_without_lists(mask_mod, ..)
 * is 2) whose tensors are in host memory, doc[0 .. T) as bounds into runs (T + 1 entries), and
 * (ids_tensor not NULL) the ids' index among the mod's tensors. @return the number of runs; 0
 * when the mod is no such mask, T is outside [1, INT32_MAX], the ids are fewer than T, or an id
 * comes back after another (no route then); -1 without host memory. */
NSA_API int64_t nsa_flex_doc_runs(const nsa_mod *mask_mod, int64_t T, int32_t *runs, int32_t *ids_tensor);

/* ---- 10. Context parallelism over NCCL (spec 15) ---------------------------------------- */
/* The NSA forward / backward of sequences of seq_len positions split over the ranks of an NCCL
 * communicator, each rank calling with its part: the zigzag layout of spec 15 (2P chunks, rank r
 * holding chunks r and 2P-1-r, in that order, along dim 1). local is nsa_forward_args over the
 * rank's L = local_length rows (q, k, v, gates, o, saved: [B, L, ...]); the call all-gathers K and
 * V in two halves (the ranks' first chunks, then their second ones: chunk r reads only the first
 * half, so its call runs while the second arrives) and runs one query chunk (spec 0.3) per local
 * chunk. The backward runs chunk 2P-1-r first and sends its dK / dV partial to the owners while
 * chunk r's call runs, then chunk r's partial (first-half rows only); each owner sums the later
 * chunks' pieces in rank order, then the first chunks' pieces in rank order (deterministic for a
 * fixed P). The rows equal the whole-sequence call's rows (dk / dv up to the order of sums).
 * CUDA backend only, with NCCL loaded at run time (libnccl.so.2; nsa_cp_available says whether
 * it loaded), on the communicator's device. The collectives run on a second stream the context
 * makes at its first such call (NSA_CUDA_CP_OVERLAP=0 when the context is created: on the
 * context's stream, the same results bit for bit), ordered against the context's stream by
 * events: like every call, the results are ready and the workspace free once the work queued on
 * the context's stream is done. Every rank must make the same calls in the same order, one at a
 * time on a context. Not taken (NOT_SUPPORTED): varlen, the caller's k_cmp / v_cmp,
 * block_indices, separate branch K / V, k / v rows that are not contiguous (stride[2] == D,
 * stride[3] == 1). The workspace holds the whole sequence's K and V (the backward: its dK / dV
 * partials too). */
typedef struct nsa_cp_args {
    nsa_forward_args local;  /* this rank's rows; local.saved is written (forward) or read (backward) */
    void *comm;              /* ncclComm_t: the ranks of the split, P = its size */
    int64_t seq_len;         /* T, the whole sequence's positions (the same on every rank) */
} nsa_cp_args;

typedef struct nsa_cp_bwd_args {
    nsa_cp_args fwd;
    nsa_tensor dout;                    /* in  [B, L, HQ, DV] */
    nsa_tensor dq;                      /* out [B, L, HQ, DK] */
    nsa_tensor dk, dv;                  /* out [B, L, H, DK/DV]: this rank's rows, summed over the ranks */
    nsa_tensor dg_cmp, dg_slc, dg_swa;  /* out [B, L, HQ] for present gates */
} nsa_cp_bwd_args;

/* @return nonzero when the CUDA backend is compiled in and NCCL could be loaded. */
NSA_API int nsa_cp_available(void);
/* The rows of rank `rank` of `world` in a sequence of seq_len positions (spec 15), or -1 for
 * arguments out of range (world < 1, rank outside [0, world), seq_len < 0). */
NSA_API int64_t nsa_cp_local_length(int64_t seq_len, int64_t rank, int64_t world);
NSA_API nsa_status nsa_cp_forward_workspace_size(nsa_context *ctx, const nsa_cp_args *args, size_t *bytes);
NSA_API nsa_status nsa_cp_forward(nsa_context *ctx, const nsa_cp_args *args, void *workspace, size_t workspace_bytes);
NSA_API nsa_status nsa_cp_backward_workspace_size(nsa_context *ctx, const nsa_cp_bwd_args *args, size_t *bytes);
NSA_API nsa_status nsa_cp_backward(nsa_context *ctx, const nsa_cp_bwd_args *args, void *workspace,
                                   size_t workspace_bytes);

#ifdef __cplusplus
}
#endif
#endif /* NSA_H */
