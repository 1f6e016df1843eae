/* xattn_d64.cu -- the option-complete attention kernels (xattn.cuh) for head dims padded to
 * 64, bf16 and f16; one file per class so the build compiles them in parallel. */
#include "xattn.cuh"

XATTN_DEFINE(64)
