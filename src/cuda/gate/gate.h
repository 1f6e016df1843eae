/* gate/gate.h -- the gated sum of the branches (spec section 6) and its backward. */
#ifndef NSA_CUDA_GATE_GATE_H
#define NSA_CUDA_GATE_GATE_H

#include "../prim/common.cuh"

/* o = sum of g_x * o_x over present gates (gs[x].p != NULL). */
void nsa_cu_gate(grun *g, const dview os[3], const dview gs[3], const dview *o, int64_t B, int64_t T, int64_t HQ,
                 int64_t DV);
/* dg_x = rowsum(dout * o_x), do_x = g_x * dout, each when its view is given; with Dw/gw
 * (flat [B*T*HQ] per branch, used for present gates) also each branch's backward row terms
 * Dw_x = g_x * dg_x and gw_x = g_x (what nsa_cu_dprep computes), in the same pass; nf (NULL:
 * none) becomes nonzero when a row's dout, o_x or gate holds a non-finite value (run.h). */
void nsa_cu_gate_bwd(grun *g, const dview *dout, const dview os[3], const dview gs[3], const dview dos[3],
                     const dview dgs[3], float *const Dw[3], float *const gw[3], int64_t B, int64_t T, int64_t HQ,
                     int64_t DV, int *nf);

#endif
