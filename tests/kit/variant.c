/* variant.c -- --variant KEY=VALUE into the environment, and the switches in force (see variant.h). */
#define _POSIX_C_SOURCE 200809L

#include "variant.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern char **environ;

enum { MAX_VARIANTS = 32 };
static char g_keys[MAX_VARIANTS][64];
static int g_nkeys;

int variant_set(const char *kv)
{
    const char *eq = strchr(kv, '=');
    if (!eq || eq == kv || (size_t)(eq - kv) >= sizeof g_keys[0]) return -1;
    char key[64];
    snprintf(key, sizeof key, "%.*s", (int)(eq - kv), kv);
    if (setenv(key, eq + 1, 1) != 0) return -1;
    int i = 0;
    while (i < g_nkeys && strcmp(g_keys[i], key)) i++;
    if (i == g_nkeys && g_nkeys < MAX_VARIANTS) snprintf(g_keys[g_nkeys++], sizeof g_keys[0], "%s", key);
    return 0;
}

void variant_describe(char *buf, size_t n)
{
    size_t len = 0;
    buf[0] = '\0';
    for (int i = 0; i < g_nkeys && len < n; i++) {
        const char *v = getenv(g_keys[i]);
        len += (size_t)snprintf(buf + len, n - len, "%s%s=%s", len ? " " : "", g_keys[i], v ? v : "");
    }
    for (char **e = environ; e && *e && len < n; e++) {
        if (strncmp(*e, "NSA_CUDA_", 9) != 0) continue;
        const char *eq = strchr(*e, '=');
        int listed = 0;
        for (int i = 0; i < g_nkeys && eq; i++)
            listed |= strlen(g_keys[i]) == (size_t)(eq - *e) && !strncmp(g_keys[i], *e, (size_t)(eq - *e));
        if (!listed) len += (size_t)snprintf(buf + len, n - len, "%s%s", len ? " " : "", *e);
    }
    if (!buf[0]) snprintf(buf, n, "none");
}
