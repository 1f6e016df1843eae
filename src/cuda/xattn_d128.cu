/* xattn_d128.cu -- the option-complete attention kernels (xattn.cuh) for head dims padded to
 * 128, bf16 and f16; one file per class so the build compiles them in parallel. */
#include "xattn.cuh"

XATTN_DEFINE(128)
