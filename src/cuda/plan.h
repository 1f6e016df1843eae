/* plan.h -- what the kernel planners of src/cuda decide from: the device, the explicit
 * overrides, and the properties of the call's views. Plain C (no CUDA types), so that every
 * planner is a pure function the CPU test suite checks on a grid of problems
 * (tests/test_plan.c). Each op's planner lives in its room (range/plan.c, selected/plan.c,
 * selection/plan.c, attention/plan.c) and returns the kernel and its tile parameters; the
 * launchers only encode tensor maps and launch. A planner that picks an sm_90a tile also says
 * what to fall back to when its tensor maps cannot be made (plan again with no_tma set). */
#ifndef NSA_CUDA_PLAN_H
#define NSA_CUDA_PLAN_H

#include "../internal.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The device as the planners see it; all zero in the sizing pass, which therefore plans the
 * portable tiles (the workspace does not depend on the choice). */
typedef struct cu_device {
    int cc_major;      /* compute capability (9: Hopper) */
    int smem_max;      /* opt-in shared memory per block, bytes */
    int sm90_ready[3]; /* the loaded binary carries the sm_90a kernels of head-dim class 64 / 128 / 192 */
} cu_device;

/* Explicit overrides of the planners' choices, parsed once when a context is created (the
 * NSA_CUDA_* environment variables; bench/NOTES.md lists them). The defaults are the tuned
 * choices; the others exist to compare kernels on the same inputs. The selected tile's other
 * chunk shapes are compiled only with NSA_CUDA_EXPERIMENTAL (make EXPERIMENTAL=1). */
#ifndef NSA_CUDA_EXPERIMENTAL
#define NSA_CUDA_EXPERIMENTAL 0
#endif
typedef nsa_cuda_overrides cu_overrides; /* fields: internal.h */

/* The tuned defaults. */
void cu_overrides_default(cu_overrides *o);
/* The defaults, changed by whatever NSA_CUDA_* variables the environment sets. */
void cu_overrides_from_env(cu_overrides *o);

/* Head-dim class of the tiles (64, 128, 192) or 0 when the dims are not supported. */
int cu_dims_class(int64_t DK, int64_t DV);
/* Index of a class in cu_device.sm90_ready (64 -> 0, 128 -> 1, 192 -> 2). */
static inline int cu_class_index(int cls) { return cls == 64 ? 0 : cls == 128 ? 1 : 2; }
/* Whether the sm_90a tiles may run at all, and for head-dim class D. */
static inline int cu_sm90(const cu_device *d, const cu_overrides *o) { return o->wgmma && d->cc_major == 9; }
static inline int cu_sm90_class(const cu_device *d, int D) { return d->sm90_ready[cu_class_index(D)]; }

/* Alignment of the call's views (dview.al: rows on 16 bytes and strides that keep them
 * there), which the TMA and wgmma tiles need. */
typedef struct cu_views {
    int q, k, v, o, dout; /* aligned (0 for an absent view) */
    int has_v, has_o;     /* V is read; o is written */
    int o_dt;             /* o's nsa_dtype (has_o) */
} cu_views;

enum { MODE_FWD = 0, MODE_DQ = 1 };

/* The shared-memory sizes of plan.h files: plain C for the planners and their tests, constexpr
 * in C++ so that each kernel's layout struct checks at compile time that the host reserves
 * exactly its bytes. */
#ifdef __cplusplus
#define NSA_SMEM_FN static inline constexpr
#else
#define NSA_SMEM_FN static inline
#endif /* forward or dQ of a forward / dQ tile */

#ifdef __cplusplus
}
#endif

#endif
