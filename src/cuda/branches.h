/* branches.h -- the host drivers of the attention branches, shared by the single ops
 * (ops.cu) and the whole pipeline (nsa.cu). Each takes the run state, carves what it needs
 * from the workspace and launches on g->st; in the sizing pass it only carves. */
#ifndef NSA_CUDA_BRANCHES_H
#define NSA_CUDA_BRANCHES_H

#include "kernels.h"

/* Run state of one op call (dry: sizing pass, ws unused). */
void g_init(grun *g, const nsa_context *ctx, const nsa_problem *p, void *ws, int dry);
/* Head-dim class of the engine (64, 128, 192) or 0 when the dims are not supported. */
int cu_dims_class(int64_t DK, int64_t DV);
/* The attention kernels need f16/bf16 storage, supported dims, int32 positions. Marks
 * NOT_SUPPORTED on g and returns 0 otherwise. */
int cu_attn_supported(grun *g, nsa_dtype dt);

rule_t cu_rule_window(int64_t wl, int64_t wr, int causal);
rule_t cu_rule_cmp(const nsa_problem *p);
rule_t cu_rule_slc(const nsa_problem *p);

/* Forward of a range branch (window / dense / compressed): o and lse (o absent (NULL or
 * no data): lse only, V unread). */
void cu_fwd_range(grun *g, const rule_t *rule, const dview *q, nsa_dtype dt, const dview *k, const dview *v,
                  const dview *o, const dview *lse);
/* Forward of selected attention over usable lists U/ucnt of width m. */
void cu_fwd_slc(grun *g, const dview *q, nsa_dtype dt, const dview *k, const dview *v, const int32_t *U,
                const int32_t *ucnt, int64_t m, const dview *o, const dview *lse);
/* Importance + top-n into idx (and cnt when cnt->p). */
void cu_select(grun *g, const dview *q, nsa_dtype dt, const dview *k, const dview *lse, const dview *idx,
               const dview *cnt);

/* Backward of one branch: dq added to dq32 [B*T*HQ*DK], dK/dV added to flat fp32 [B, KR, H, D]
 * buffers. Dw, gw: per-row scratch [B*T*HQ]: filled by the branch (nsa_cu_dprep) unless
 * D_ready says the caller already did (the pipeline's gate backward computes them). */
typedef struct bwd_io {
    const dview *q, *k, *v, *o, *lse, *dout, *gate; /* gate may be NULL */
    nsa_dtype dt;
    float *Dw, *gw, *dq32, *dk32, *dv32;
    int64_t KR;
    int D_ready;
    /* non-NULL: this rule is dq's only term; dq32 comes unzeroed, and cu_bwd_range either
     * writes dq_out itself (the wgmma dQ tile: returns 1) or zeroes dq32 and adds into it as
     * usual (returns 0; the caller stores it). NULL: dq32 is zeroed and shared (returns 0). */
    const dview *dq_out;
} bwd_io;
int cu_bwd_range(grun *g, const rule_t *rule, const bwd_io *io);
void cu_bwd_slc(grun *g, const bwd_io *io, const int32_t *U, const int32_t *ucnt, int64_t m);

/* The attention op with options (xattn.cu): any of Tq != Tk, varlen_qk, softcap, sinks,
 * segment ids, bias, mask, dropout, or head dims beyond the engine's (up to 256). */
int cu_xattn_supported(grun *g, nsa_dtype dt); /* marks NOT_SUPPORTED and returns 0 if not */
void cu_xattn_fwd(grun *g, const nsa_attention_args *a);
void cu_xattn_bwd(grun *g, const nsa_attention_bwd_args *a);

/* fp32 scratch helpers */
float *cu_take_f32(grun *g, int64_t n, int zero);

#endif
