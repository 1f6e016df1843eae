/* hashlog.c -- output hashes of the sweep, written and compared line by line (see hashlog.h). */
#include "hashlog.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

struct hashlog {
    char *text;
    size_t len, cap;
    long index;       /* the current case */
    uint64_t seed;
    char shape[128];
};

uint64_t hashlog_fnv1a(const void *bytes, size_t n, uint64_t h)
{
    const unsigned char *p = (const unsigned char *)bytes;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

hashlog *hashlog_new(void)
{
    hashlog *log = (hashlog *)calloc(1, sizeof *log);
    if (!log) abort();
    return log;
}

void hashlog_free(hashlog *log)
{
    if (log) free(log->text);
    free(log);
}

void hashlog_append(hashlog *log, const char *text, size_t n)
{
    if (log->len + n + 1 > log->cap) {
        log->cap = (log->len + n + 1) * 2;
        log->text = (char *)realloc(log->text, log->cap);
        if (!log->text) abort();
    }
    memcpy(log->text + log->len, text, n);
    log->len += n;
    log->text[log->len] = '\0';
}

const char *hashlog_text(const hashlog *log, size_t *n)
{
    *n = log->len;
    return log->text ? log->text : "";
}

void hashlog_begin_case(hashlog *log, long index, uint64_t seed, const sweep_case *c)
{
    log->index = index;
    log->seed = seed;
    const char *dt = nsa_dtype_name(c->dtype);
    int len = snprintf(log->shape, sizeof log->shape, "B%lld,T%lld,HQ%lld,H%lld,DK%lld,DV%lld,%s", (long long)c->B,
                       (long long)c->T, (long long)c->HQ, (long long)c->H, (long long)c->DK, (long long)c->DV, dt);
    if (c->varlen && len > 0 && (size_t)len < sizeof log->shape)
        snprintf(log->shape + len, sizeof log->shape - (size_t)len, ",varlen%lld", (long long)c->num_seqs);
}

void hashlog_sink(void *user, const char *name, uint64_t hash)
{
    hashlog *log = (hashlog *)user;
    char op[64], out[96];
    const char *sp = strchr(name, ' ');
    const size_t nop = sp ? (size_t)(sp - name) : strlen(name);
    snprintf(op, sizeof op, "%.*s", (int)nop, name);
    snprintf(out, sizeof out, "%s", sp ? sp + 1 : "out");
    for (char *c = out; *c; c++)
        if (*c == ' ') *c = '_';
    char line[400];
    const int n = snprintf(line, sizeof line, "case=%ld seed=%llu op=%s out=%s shape=%s fnv1a=%016llx\n", log->index,
                           (unsigned long long)log->seed, op, out, log->shape, (unsigned long long)hash);
    hashlog_append(log, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}

int hashlog_write(const hashlog *log, const char *path)
{
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    size_t n = 0;
    const char *t = hashlog_text(log, &n);
    const int ok = fwrite(t, 1, n, f) == n;
    return fclose(f) == 0 && ok ? 0 : -1;
}

hashlog *hashlog_read(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    hashlog *log = hashlog_new();
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) hashlog_append(log, buf, n);
    const int err = ferror(f);
    fclose(f);
    if (err) {
        hashlog_free(log);
        errno = EIO;
        return NULL;
    }
    return log;
}

/* ---- comparison ------------------------------------------------------------------------ */

typedef struct entry {
    long index;
    unsigned long long seed, hash;
    char op[64], out[96], shape[128];
} entry;

/* The log's well-formed lines, in order. */
static entry *parse(const hashlog *log, long *count)
{
    size_t n = 0;
    const char *t = hashlog_text(log, &n);
    long cap = 64, k = 0;
    entry *e = (entry *)malloc((size_t)cap * sizeof *e);
    if (!e) abort();
    for (const char *line = t; line < t + n && *line;) {
        const char *end = strchr(line, '\n');
        if (k == cap) {
            cap *= 2;
            e = (entry *)realloc(e, (size_t)cap * sizeof *e);
            if (!e) abort();
        }
        entry *x = &e[k];
        if (sscanf(line, "case=%ld seed=%llu op=%63s out=%95s shape=%127s fnv1a=%llx", &x->index, &x->seed, x->op, x->out,
                   x->shape, &x->hash) == 6)
            k++;
        if (!end) break;
        line = end + 1;
    }
    *count = k;
    return e;
}

static int key_cmp(const void *a, const void *b)
{
    const entry *x = (const entry *)a, *y = (const entry *)b;
    if (x->index != y->index) return x->index < y->index ? -1 : 1;
    if (x->seed != y->seed) return x->seed < y->seed ? -1 : 1;
    const int c = strcmp(x->op, y->op);
    return c ? c : strcmp(x->out, y->out);
}

long hashlog_compare(const hashlog *run, const hashlog *base, FILE *out, int max_report)
{
    long nr = 0, nb = 0, same = 0, differ = 0;
    entry *r = parse(run, &nr), *b = parse(base, &nb);
    qsort(b, (size_t)nb, sizeof *b, key_cmp);
    for (long i = 0; i < nr;) {
        long j = i; /* the run's lines of one case are consecutive */
        while (j < nr && r[j].index == r[i].index && r[j].seed == r[i].seed) j++;
        char detail[600] = "";
        int len = 0, bad = 0;
        for (long k = i; k < j; k++) {
            const entry *m = (const entry *)bsearch(&r[k], b, (size_t)nb, sizeof *b, key_cmp);
            if (m && m->hash == r[k].hash) continue;
            if (bad++ < 4 && len < (int)sizeof detail - 160) {
                if (m)
                    len += snprintf(detail + len, sizeof detail - (size_t)len, " %s %s (%016llx, base %016llx);", r[k].op,
                                    r[k].out, r[k].hash, m->hash);
                else
                    len += snprintf(detail + len, sizeof detail - (size_t)len, " %s %s (not in the base);", r[k].op, r[k].out);
            }
        }
        if (bad && differ < max_report)
            fprintf(out, "hash: case %ld seed=%llu %s: %d of %ld outputs differ:%s%s\n", r[i].index, r[i].seed, r[i].shape, bad,
                    j - i, detail, bad > 4 ? " ..." : "");
        if (bad) differ++;
        else same++;
        i = j;
    }
    fprintf(out, "%ld identical, %ld differ\n", same, differ);
    fflush(out);
    free(r);
    free(b);
    return differ;
}
