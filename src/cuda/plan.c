/* plan.c -- the planners' shared inputs (plan.h): overrides and head-dim classes. */
#include "plan.h"

#include <stdlib.h>
#include <string.h>

void cu_overrides_default(cu_overrides *o)
{
    memset(o, 0, sizeof *o);
    o->wgmma = 1;
    o->kwp = 1;
    o->slc_bn = 32;
    o->slc_stages = 2;
    o->slc_pair = 1;
    o->slc_union = 1;
    o->nonfinite = -1;
    o->step_tiled = 1;
    o->step_pdl = 1;
    o->flex_tc = 1;
    o->cp_overlap = 1;
    o->swg_ws = 1;
    o->range_pipe = 1;
}

void cu_overrides_from_env(cu_overrides *o)
{
    cu_overrides_default(o);
    const char *e = getenv("NSA_CUDA_WGMMA");
    if (e && e[0] == '0') o->wgmma = 0;
    e = getenv("NSA_CUDA_KWP");
    if (e && e[0] == '0') o->kwp = 0;
    e = getenv("NSA_CUDA_CHECK_WORKSPACE");
    if (e && e[0] == '1') o->check_ws = 1;
#if NSA_CUDA_EXPERIMENTAL
    /* NSA_CUDA_SLC_BN: "64" (64 keys in 2 stages) or "32x3" (32 keys in 3 stages); their
     * kernels exist only in a build with EXPERIMENTAL=1 */
    e = getenv("NSA_CUDA_SLC_BN");
    if (e && atoi(e) == 64) o->slc_bn = 64;
    if (o->slc_bn == 32 && e && strchr(e, 'x') && atoi(strchr(e, 'x') + 1) == 3) o->slc_stages = 3;
#endif
    e = getenv("NSA_CUDA_SLC_NP");
    if (e && e[0] == '1') o->slc_pair = 0;
    e = getenv("NSA_CUDA_SLC_RP");
    if (e && e[0] == '1') o->slc_union = 0;
    e = getenv("NSA_CUDA_NONFINITE");
    if (e && (e[0] == '0' || e[0] == '1')) o->nonfinite = e[0] - '0';
    e = getenv("NSA_CUDA_STEP_TILED");
    if (e && e[0] == '0') o->step_tiled = 0;
    e = getenv("NSA_CUDA_FLEX_TC");
    if (e && e[0] == '0') o->flex_tc = 0;
    e = getenv("NSA_CUDA_STEP_PDL");
    if (e && e[0] == '0') o->step_pdl = 0;
    e = getenv("NSA_CUDA_SWG_WS");
    if (e && e[0] == '0') o->swg_ws = 0;
    e = getenv("NSA_CUDA_CP_OVERLAP");
    if (e && e[0] == '0') o->cp_overlap = 0;
    e = getenv("NSA_CUDA_STEP_HC");
    if (e && (atoi(e) == 1 || atoi(e) == 2 || atoi(e) == 4)) o->step_hc = atoi(e);
    e = getenv("NSA_CUDA_CMP_SEG");
    if (e && atoi(e) >= 2 && atoi(e) <= 256 && (atoi(e) & (atoi(e) - 1)) == 0) o->cmp_seg = atoi(e);
    e = getenv("NSA_CUDA_RANGE_PIPE");
    if (e && (e[0] == '0' || e[0] == '2')) o->range_pipe = e[0] - '0';
    e = getenv("NSA_CUDA_RANGE_SEG");
    if (e && atoi(e) >= 1 && atoi(e) <= 128 && (atoi(e) & (atoi(e) - 1)) == 0) o->range_seg = atoi(e);
}

int cu_dims_class(int64_t DK, int64_t DV)
{
    if (DK <= 64 && DV <= 64) return 64;
    if (DK <= 128 && DV <= 128) return 128;
    if (DK <= 192 && DV <= 128) return 192;
    return 0;
}
