/* hashlog.h -- bitwise comparison of two builds: a 64-bit FNV-1a hash of every output the
 * sweep checks, one line per (case, output), written by one build (--hash-out) and compared
 * by another (--hash-cmp).
 *
 * A line: case=3 seed=1234 op=nsa_attention out=o shape=B1,T200,HQ8,H2,DK64,DV64,bf16 fnv1a=<16 hex>
 * (out: the output's name, spaces as '_'). Lines are keyed by (case, seed, op, out); a run
 * of some ops (--op) compares against a file of all of them. */
#ifndef NSA_TEST_HASHLOG_H
#define NSA_TEST_HASHLOG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include "sweep.h"

#define HASHLOG_FNV_OFFSET 0xcbf29ce484222325ull

/* FNV-1a over n bytes, continuing from h (HASHLOG_FNV_OFFSET to start). */
uint64_t hashlog_fnv1a(const void *bytes, size_t n, uint64_t h);

typedef struct hashlog hashlog;
hashlog *hashlog_new(void);
void hashlog_free(hashlog *log);

/* The case whose outputs come next: its index, seed and shape go on each line. */
void hashlog_begin_case(hashlog *log, long index, uint64_t seed, const sweep_case *c);
/* A sweep_hash_fn (sweep.h): appends the line of one output, name "op output". */
void hashlog_sink(void *log, const char *name, uint64_t hash);

/* The lines so far (a forked case hands them to its parent), and appending such text. */
const char *hashlog_text(const hashlog *log, size_t *n);
void hashlog_append(hashlog *log, const char *text, size_t n);

/* Writes the lines to path. @return 0, or -1 (errno set). */
int hashlog_write(const hashlog *log, const char *path);
/* Reads a file of lines. @return NULL if it cannot be read. */
hashlog *hashlog_read(const char *path);

/* Compares the run's lines with the base's, case by case: a case is identical when every one of
 * its outputs has a line in base with the same hash. Prints the first max_report differing
 * cases (each with its first differing outputs) to out, then the line "N identical, M differ".
 * @return M. */
long hashlog_compare(const hashlog *run, const hashlog *base, FILE *out, int max_report);

#endif
