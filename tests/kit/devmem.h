/* devmem.h -- backend memory for the tests and the CLI: host memory for the CPU backend,
 * device memory (cudaMalloc) for CUDA, and the CUDA device as the sweep's memory hooks.
 * The only place of the kit that includes a CUDA header (CUDA builds: NSA_WITH_CUDA). */
#ifndef NSA_TEST_DEVMEM_H
#define NSA_TEST_DEVMEM_H

#include <stddef.h>
#include "nsa.h"
#include "sweep.h"

/* Called with a one-line reason when an allocation or copy fails; it must not return.
 * Default: "FAIL <reason>" on stderr, then _exit(3), so that a forked sweep case fails alone. */
typedef void (*devmem_fail_fn)(const char *reason);
void devmem_set_fail(devmem_fail_fn fn);

/* bytes of backend memory (never NULL; 0 bytes still gives a distinct pointer); `what` names it in errors. */
void *devmem_alloc(nsa_backend be, size_t bytes, const char *what);
void devmem_free(nsa_backend be, void *p);
void devmem_zero(nsa_backend be, void *p, size_t bytes);
void devmem_upload(nsa_backend be, void *dst, const void *host, size_t bytes);
void devmem_download(nsa_backend be, void *host, const void *src, size_t bytes);
/* Waits for the backend's queued work (CUDA calls return before it is done). */
void devmem_sync(nsa_backend be);

/* The CUDA device as sweep_memory hooks; NULL in a build without CUDA. */
const sweep_memory *devmem_sweep_memory(void);

#endif
