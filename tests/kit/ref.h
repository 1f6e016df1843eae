/* ref.h -- the float64 dense reference of spec/nsa.md, written from the spec alone.
 *
 * It shares no code with the backends: its masks are materialised T x Tk arrays, its
 * softmax is the textbook one, its selection sorts whole score rows. Keep T small.
 * Every function works on ONE sequence (the test harness slices batches and varlen
 * packs into sequences), contiguous row-major arrays:
 *   q [T, HQ, DK], k [T, H, DK], v [T, H, DV], k_cmp [Nc, H, DK], v_cmp [Nc, H, DV],
 *   o [T, HQ, DV], lse [T, HQ], gates [T, HQ], block_indices [T, H, m] (int32).
 * Gradient outputs are overwritten (not accumulated). `scale` is already resolved. */
#ifndef NSA_TEST_REF_H
#define NSA_TEST_REF_H

#include <stdint.h>
#include "nsa.h"

typedef struct ref_dims {
    int64_t T, HQ, H, DK, DV;   /* G = HQ / H */
} ref_dims;

/* The tolerance rule's "straightforward same-precision implementation" (docs/spec.md, "Accuracy"):
 * when set, the reference rounds every tensor that a plain implementation in the storage
 * dtype would materialise (scores S, probabilities P, outputs O and branch outputs, dP, dS,
 * the compressed K/V) with this function. NULL (the default) = exact float64.
 * The backward functions' o_given [T, HQ, DV] (NULL = none) is the forward output the op under
 * test was handed: with ref_store_round set they take D = dout . o from it, as a kernel reads
 * the stored o it is given, so that the naive implementation and the kernel round the same o
 * (each rounding its own made the naive error a different draw of that rounding, which tiny
 * tensors showed as a kernel 2-4x worse than a lucky naive result); the exact pass ignores it. */
extern double (*ref_store_round)(double);

/* Nc for a T-token sequence (0 when T < l). */
int64_t ref_num_cmp(const nsa_config *c, int64_t T);

/* Spec 1: x [T, H, D] -> x_cmp [Nc, H, D]; bwd: dx_cmp -> dx. */
void ref_compress(const nsa_config *c, int64_t T, int64_t H, int64_t D, const double *x, double *x_cmp);
void ref_compress_bwd(const nsa_config *c, int64_t T, int64_t H, int64_t D, const double *dx_cmp, double *dx);

/* Spec 2. lse = -inf (and o = 0) for rows that see no block. */
void ref_cmp_attn(const nsa_config *c, double scale, ref_dims d, int64_t Nc, const double *q,
                  const double *k_cmp, const double *v_cmp, double *o, double *lse);
void ref_cmp_attn_bwd(const nsa_config *c, double scale, ref_dims d, int64_t Nc, const double *q,
                      const double *k_cmp, const double *v_cmp, const double *dout, const double *o_given,
                      double *dq, double *dk_cmp, double *dv_cmp);

/* Spec 3: block_indices [T, H, n] (n = c->slc_topk), ascending, -1 padded.
 * Also returns the importance imp [T, H, nb] when imp != NULL (nb = ceil(T / l')). */
void ref_select(const nsa_config *c, double scale, ref_dims d, int64_t Nc, const double *q,
                const double *k_cmp, int32_t *block_indices, double *imp);

/* Spec 4: block_indices [T, H, m]; counts [T, H] or NULL (then all m entries are read). */
void ref_slc_attn(const nsa_config *c, double scale, ref_dims d, const double *q, const double *k,
                  const double *v, const int32_t *block_indices, int64_t m, const int32_t *counts,
                  double *o, double *lse);
void ref_slc_attn_bwd(const nsa_config *c, double scale, ref_dims d, const double *q, const double *k,
                      const double *v, const int32_t *block_indices, int64_t m, const int32_t *counts,
                      const double *dout, const double *o_given, double *dq, double *dk, double *dv);

/* Spec 5 and the general core: key s visible to query t iff
 * (window_left < 0 || s >= t - window_left) && (right bound: causal ? s <= t :
 * (window_right < 0 || s <= t + window_right)). */
void ref_attention(double scale, int causal, int64_t window_left, int64_t window_right, ref_dims d,
                   const double *q, const double *k, const double *v, double *o, double *lse);
void ref_attention_bwd(double scale, int causal, int64_t window_left, int64_t window_right, ref_dims d,
                       const double *q, const double *k, const double *v, const double *dout,
                       const double *o_given, double *dq, double *dk, double *dv);

/* The attention op with every option of nsa.h section 5, for ONE sequence of Tq = d.T queries
 * and Tk keys: q [Tq, HQ, DK], k [Tk, H, DK], v [Tk, H, DV]. It materialises the score matrix
 * S [HQ, Tq, Tk] and is written from nsa.h's definitions alone. Per-sequence views of the
 * options; each NULL = off. b, q_row0, k_row0 place the sequence in the call (batch index,
 * first packed query / key row): only the dropout counter reads them. */
typedef struct ref_attn_opts {
    double scale;
    int causal;
    int64_t window_left, window_right;
    double softcap;                      /* 0 = off */
    const double *sinks;                 /* [HQ] */
    const int32_t *q_seg, *k_seg;        /* [Tq], [Tk] */
    const double *bias;                  /* [HQ, Tq, Tk], broadcast already applied */
    const unsigned char *mask;           /* [HQ, Tq, Tk], nonzero = keep */
    double dropout_p;
    uint64_t seed, offset;
    int64_t b, q_row0, k_row0;
    /* the forward output a backward is given, [Tq, HQ, DV] (NULL: the reference's own): with
     * ref_store_round the naive backward takes D = dout . o from it, as a kernel reads the
     * stored o it is handed, so both round the same o */
    const double *o_given;
    /* the forward lse a backward is handed, [Tq, HQ] (NULL: the reference's own): with
     * ref_store_round the naive dsinks takes the sink's probability exp(sink - lse) from it, as
     * a kernel does from the stored lse */
    const double *lse_given;
} ref_attn_opts;

/* Philox4x32-10 written from Salmon et al. 2011 (independent of src/philox.h), and the keep
 * decision of element (b, hq, i, j) of nsa.h: 1 = kept. */
void ref_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);
int ref_dropout_keep(double p, uint64_t seed, uint64_t offset, int64_t b, int64_t HQ, int64_t hq, int64_t i, int64_t j);

/* -> o [Tq, HQ, DV], lse [Tq, HQ] (either may be NULL). */
void ref_attention_ext(const ref_attn_opts *opt, ref_dims d, int64_t Tk, const double *q, const double *k,
                       const double *v, double *o, double *lse);
/* Backward for the loss sum(o * dout): dq [Tq, HQ, DK], dk [Tk, H, DK], dv [Tk, H, DV],
 * dsinks [HQ], dbias [HQ, Tq, Tk] (the gradient of the score after the bias), all
 * overwritten; any may be NULL. */
void ref_attention_ext_bwd(const ref_attn_opts *opt, ref_dims d, int64_t Tk, const double *q, const double *k,
                           const double *v, const double *dout, double *dq, double *dk, double *dv, double *dsinks,
                           double *dbias);

/* Spec 6 and the whole pipeline. Inputs mirror nsa_forward_args for one sequence;
 * NULL = absent. Separate branch K/V default to k, v; k_cmp/v_cmp default to mean pooling;
 * block_indices (width m, optional counts) default to ref_select's. Outputs: o and,
 * when non-NULL, the per-branch outputs/lse and the selection used (width n). */
typedef struct ref_nsa_inputs {
    const double *q, *k, *v;
    const double *k_slc, *v_slc, *k_swa, *v_swa;
    const double *k_cmp, *v_cmp;            /* [Nc, H, D] or NULL */
    const double *g_cmp, *g_slc, *g_swa;    /* [T, HQ] or NULL = branch off */
    const int32_t *block_indices;           /* [T, H, m] or NULL */
    int64_t m;
    const int32_t *block_counts;            /* [T, H] or NULL */
    const double *o_cmp, *o_slc, *o_swa;    /* [T, HQ, DV] or NULL: the branch outputs the
                                               backward is handed (o_given below) */
} ref_nsa_inputs;

typedef struct ref_nsa_grads {              /* each NULL when not wanted */
    double *dq, *dk, *dv;                   /* dk/dv: through compression (when k_cmp absent)
                                               and every branch that uses k, v */
    double *dk_slc, *dv_slc, *dk_swa, *dv_swa, *dk_cmp, *dv_cmp;
    double *dg_cmp, *dg_slc, *dg_swa;
} ref_nsa_grads;

void ref_nsa_forward(const nsa_config *c, double scale, ref_dims d, const ref_nsa_inputs *in, double *o,
                     double *o_cmp, double *o_slc, double *o_swa, int32_t *block_indices_used);
void ref_nsa_backward(const nsa_config *c, double scale, ref_dims d, const ref_nsa_inputs *in,
                      const double *dout, ref_nsa_grads *grads);

/* ref_nsa_forward's o for a few query rows only: rows [nrows] (each 0 <= rows[r] < T)
 * -> o_rows [nrows, HQ, DV], o_rows[r] = o[rows[r]]. Same inputs and meaning as
 * ref_nsa_forward, but each row builds its own visibility and selection, so it allocates
 * O(T) (never O(T^2)) and costs O(nrows * T * (DK + DV) * HQ): a T = 64k demo can check
 * sampled rows against it. */
void ref_nsa_forward_rows(const nsa_config *c, double scale, ref_dims d, const ref_nsa_inputs *in,
                          const int64_t *rows, int64_t nrows, double *o_rows);

#endif
