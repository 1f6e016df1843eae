/* variant.h -- backend switches for one run: --variant KEY=VALUE puts KEY in the environment
 * before any context exists (the CUDA backend reads its NSA_CUDA_* planner overrides, e.g.
 * NSA_CUDA_WGMMA=0, once, at first use), and headers name every switch in force. */
#ifndef NSA_TEST_VARIANT_H
#define NSA_TEST_VARIANT_H

#include <stddef.h>

/* Sets KEY=VALUE in the environment (call before creating a context). @return 0, or -1 when
 * kv is not KEY=VALUE with a non-empty KEY. */
int variant_set(const char *kv);
/* "K=V K=V ...": the --variant settings, then every other NSA_CUDA_* variable of the
 * environment; "none" without any. */
void variant_describe(char *buf, size_t n);

#endif
