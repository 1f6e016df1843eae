/* flex/flex.cu -- block-sparse attention with mods on the GPU (spec 14): the kernel is generated
 * for each (mask_mod, score_mod, dtype) from the expressions' C source (mod/expr.c expr_to_c),
 * compiled at run time by NVRTC (loaded with dlopen: a machine without it runs the CPU backend
 * and gets NOT_SUPPORTED here, with the reason), loaded with cudaLibraryLoadData and cached per
 * context in memory and on disk by a hash of its source and the architecture.
 *
 * The kernel (scalar, correctness first): one warp per (batch entry, query head, query row);
 * the visible keys walked twice (the max, then the weights) as the CPU's flex_row does; the
 * lists checked on the host first (copied back: the same check as the CPU's, so a bad list is
 * a status and nothing is written). */
#include <dlfcn.h>
#include <nvrtc.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>

#include "../prim/run.h"
#include "../prim/simt.cuh"
#include "../cuda_backend.h"
extern "C" {
#include "../../mod/expr.h"
}

/* ---- the parameter block: one definition for the host and for the generated source ---------- */
#define FLEX_PARAM_FIELDS                                                                          \
    const void *q; const void *k; const void *v; void *o; float *lse;                              \
    long long qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2, ls0, ls1, ls2;           \
    const int *num; const int *idx; const int *fnum; const int *fidx;                              \
    long long ns0, ns1, ns2, is0, is1, is2, is3, fns0, fns1, fns2, fis0, fis1, fis2, fis3;         \
    long long nB, nH, iB, iH, fnB, fnH, fiB, fiH;                                                  \
    long long B, Tq, Tk, HQ, G, DK, DV, q_block, kv_block, nkb;                                    \
    float scale;
#define FLEX_STR2(...) #__VA_ARGS__
#define FLEX_STR(x) FLEX_STR2(x)

struct flex_params {
    FLEX_PARAM_FIELDS
};

/* The kernel's source after the prelude and the two mod functions (nsa_flex_mask, nsa_flex_score). */
static const char FLEX_KERNEL[] =
    "struct flex_params { " FLEX_STR(FLEX_PARAM_FIELDS) " };\n"
    "#define COLS 8\n"
    "__device__ __forceinline__ float ld_elem(const void *p, long long i)\n"
    "{\n"
    "#if NSA_ELEM == 0\n"
    "    return ((const float *)p)[i];\n"
    "#elif NSA_ELEM == 1\n"
    "    return nsa_mod_f16(((const unsigned short *)p)[i]);\n"
    "#else\n"
    "    return nsa_mod_fbits((unsigned int)((const unsigned short *)p)[i] << 16);\n"
    "#endif\n"
    "}\n"
    "__device__ __forceinline__ unsigned int fbits(float f) { union { float f; unsigned int u; } x; x.f = f; return x.u; }\n"
    "__device__ __forceinline__ void st_elem(void *p, long long i, float f)\n"
    "{\n"
    "#if NSA_ELEM == 0\n"
    "    ((float *)p)[i] = f;\n"
    "#elif NSA_ELEM == 1\n"
    "    unsigned int u = fbits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu, h;\n"
    "    if (a > 0x7f800000u) h = sign | 0x7e00u;\n"
    "    else if (a >= 0x477ff000u) h = sign | 0x7c00u;\n"
    "    else if (a < 0x38800000u) {\n"
    "        float af = nsa_mod_fbits(a) * 16777216.0f;\n"
    "        unsigned int m = (unsigned int)af;\n"
    "        float rem = af - (float)m;\n"
    "        if (rem > 0.5f || (rem == 0.5f && (m & 1u))) m++;\n"
    "        h = sign | m;\n"
    "    } else h = sign | ((a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u) >> 13);\n"
    "    ((unsigned short *)p)[i] = (unsigned short)h;\n"
    "#else\n"
    "    unsigned int u = fbits(f);\n"
    "    ((unsigned short *)p)[i] = (unsigned short)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u\n"
    "                                                : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);\n"
    "#endif\n"
    "}\n"
    "__device__ __forceinline__ long long clampll(long long x, long long lo, long long hi) { return x < lo ? lo : x > hi ? hi : x; }\n"
    "/* the visible keys of row i of (b, hq), in the CPU's order: partial blocks, then full ones */\n"
    "template <class F>\n"
    "__device__ void visit(const flex_params &P, const nsa_mod_caps *mc, long long b, long long hq, long long i, F f)\n"
    "{\n"
    "    const long long qb = i / P.q_block;\n"
    "    for (int full = 0; full < 2; full++) {\n"
    "        long long cnt = P.nkb, step = 1;\n"
    "        const int *ix = 0;\n"
    "        if (P.num) {\n"
    "            const int *np = full ? P.fnum : P.num;\n"
    "            if (!np) continue;\n"
    "            const long long bb = (full ? P.fnB : P.nB) == 1 ? 0 : b, hh = (full ? P.fnH : P.nH) == 1 ? 0 : hq;\n"
    "            cnt = full ? np[bb * P.fns0 + hh * P.fns1 + qb * P.fns2] : np[bb * P.ns0 + hh * P.ns1 + qb * P.ns2];\n"
    "            const long long ib = (full ? P.fiB : P.iB) == 1 ? 0 : b, ih = (full ? P.fiH : P.iH) == 1 ? 0 : hq;\n"
    "            ix = full ? P.fidx + ib * P.fis0 + ih * P.fis1 + qb * P.fis2 : P.idx + ib * P.is0 + ih * P.is1 + qb * P.is2;\n"
    "            step = full ? P.fis3 : P.is3;\n"
    "        } else if (full) {\n"
    "            continue;\n"
    "        }\n"
    "        for (long long e = 0; e < cnt; e++) {\n"
    "            const long long j = ix ? ix[e * step] : e; /* (checked on the host: in range, once) */\n"
    "            const long long k0 = j * P.kv_block, k1 = k0 + P.kv_block < P.Tk ? k0 + P.kv_block : P.Tk;\n"
    "            for (long long kv = k0; kv < k1; kv++)\n"
    "                if (full || nsa_flex_mask(mc, b, hq, i, kv)) f(kv);\n"
    "        }\n"
    "    }\n"
    "}\n"
    "extern \"C\" __global__ void nsa_flex_fwd(const flex_params P, const nsa_mod_caps mc, const nsa_mod_caps sc)\n"
    "{\n"
    "    const int lane = threadIdx.x & 31;\n"
    "    const long long nw = (long long)gridDim.x * (blockDim.x >> 5);\n"
    "    const long long items = P.B * P.HQ * P.Tq;\n"
    "    const float NEG_INF = nsa_mod_fbits(0xff800000u);\n"
    "    for (long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < items; w += nw) {\n"
    "        const long long i = w % P.Tq, hq = (w / P.Tq) % P.HQ, b = w / (P.Tq * P.HQ), h = hq / P.G;\n"
    "        float q[COLS], acc[COLS];\n"
    "        for (int c = 0; c < COLS; c++) {\n"
    "            const long long d = lane + 32 * c;\n"
    "            q[c] = d < P.DK ? ld_elem(P.q, b * P.qs0 + i * P.qs1 + hq * P.qs2 + d) : 0.0f;\n"
    "            acc[c] = 0.0f;\n"
    "        }\n"
    "        float m = NEG_INF, l = 0.0f;\n"
    "        for (int pass = 0; pass < 2; pass++) {\n"
    "            if (pass == 1 && m == NEG_INF) break; /* no key, or only -inf scores: an empty row */\n"
    "            visit(P, &mc, b, hq, i, [&](long long kv) {\n"
    "                float s = 0.0f;\n"
    "                for (int c = 0; c < COLS; c++) {\n"
    "                    const long long d = lane + 32 * c;\n"
    "                    if (d < P.DK) s += q[c] * ld_elem(P.k, b * P.ks0 + kv * P.ks1 + h * P.ks2 + d);\n"
    "                }\n"
    "                for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);\n"
    "                s = nsa_flex_score(&sc, b, hq, i, kv, s * P.scale);\n"
    "                if (pass == 0) {\n"
    "                    m = s > m || s != s || m != m ? (m != m ? m : s) : m; /* NaN wins */\n"
    "                    return;\n"
    "                }\n"
    "                const float wgt = expf(s - m);\n"
    "                if (wgt == 0.0f) return; /* a -inf score hides its pair */\n"
    "                l += wgt;\n"
    "                for (int c = 0; c < COLS; c++) {\n"
    "                    const long long d = lane + 32 * c;\n"
    "                    if (d < P.DV) acc[c] += wgt * ld_elem(P.v, b * P.vs0 + kv * P.vs1 + h * P.vs2 + d);\n"
    "                }\n"
    "            });\n"
    "        }\n"
    "        const int empty = m == NEG_INF;\n"
    "        for (int c = 0; c < COLS; c++) {\n"
    "            const long long d = lane + 32 * c;\n"
    "            if (d < P.DV) st_elem(P.o, b * P.os0 + i * P.os1 + hq * P.os2 + d, empty ? 0.0f : acc[c] / l);\n"
    "        }\n"
    "        if (P.lse && lane == 0) P.lse[b * P.ls0 + i * P.ls1 + hq * P.ls2] = empty ? NEG_INF : m + logf(l);\n"
    "    }\n"
    "}\n";

/* ---- NVRTC, loaded on first use ------------------------------------------------------------- */
typedef struct nvrtc_api {
    void *handle;
    nvrtcResult (*create)(nvrtcProgram *, const char *, const char *, int, const char *const *, const char *const *);
    nvrtcResult (*compile)(nvrtcProgram, int, const char *const *);
    nvrtcResult (*log_size)(nvrtcProgram, size_t *);
    nvrtcResult (*log)(nvrtcProgram, char *);
    nvrtcResult (*cubin_size)(nvrtcProgram, size_t *);
    nvrtcResult (*cubin)(nvrtcProgram, char *);
    nvrtcResult (*destroy)(nvrtcProgram *);
} nvrtc_api;

static int nvrtc_open(nvrtc_api *api, char *why, size_t n)
{
    static const char *const NAMES[] = {"libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"};
    memset(api, 0, sizeof *api);
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0] && !api->handle; i++) api->handle = dlopen(NAMES[i], RTLD_NOW | RTLD_LOCAL);
    if (!api->handle) {
        snprintf(why, n, "NVRTC (libnvrtc.so) not found: %s", dlerror());
        return 0;
    }
#define FLEX_SYM(field, name) *(void **)&api->field = dlsym(api->handle, name)
    FLEX_SYM(create, "nvrtcCreateProgram");
    FLEX_SYM(compile, "nvrtcCompileProgram");
    FLEX_SYM(log_size, "nvrtcGetProgramLogSize");
    FLEX_SYM(log, "nvrtcGetProgramLog");
    FLEX_SYM(cubin_size, "nvrtcGetCUBINSize");
    FLEX_SYM(cubin, "nvrtcGetCUBIN");
    FLEX_SYM(destroy, "nvrtcDestroyProgram");
#undef FLEX_SYM
    if (!api->create || !api->compile || !api->log_size || !api->log || !api->cubin_size || !api->cubin || !api->destroy) {
        snprintf(why, n, "NVRTC lacks a function this library calls");
        dlclose(api->handle);
        api->handle = NULL;
        return 0;
    }
    return 1;
}

/* The source of one kernel: the expressions' prelude, the element type, the two mods, the kernel. */
static char *flex_source(const nsa_mod *mask, const nsa_mod *score, int elem)
{
    const size_t nm = mask ? expr_to_c(mask, NULL, 0) : 0, ns = score ? expr_to_c(score, NULL, 0) : 0;
    const size_t cap = strlen(EXPR_C_PRELUDE) + sizeof FLEX_KERNEL + nm + ns + 1024;
    char *src = (char *)malloc(cap), *me = (char *)malloc(nm + 1), *se = (char *)malloc(ns + 1);
    if (!src || !me || !se) {
        free(src), free(me), free(se);
        return NULL;
    }
    if (mask) expr_to_c(mask, me, nm + 1);
    if (score) expr_to_c(score, se, ns + 1);
    snprintf(src, cap,
             "#define NSA_MOD_FN __device__ __forceinline__\n#define NSA_ELEM %d\n%s"
             "NSA_MOD_FN int nsa_flex_mask(const nsa_mod_caps *caps, long long b, long long h, long long q_idx, "
             "long long kv_idx)\n{\n    (void)caps, (void)b, (void)h, (void)q_idx, (void)kv_idx;\n    return %s;\n}\n"
             "NSA_MOD_FN float nsa_flex_score(const nsa_mod_caps *caps, long long b, long long h, long long q_idx, "
             "long long kv_idx, float score)\n{\n    (void)caps, (void)b, (void)h, (void)q_idx, (void)kv_idx;\n"
             "    return (float)(%s);\n}\n%s",
             elem, EXPR_C_PRELUDE, mask ? me : "1", score ? se : "score", FLEX_KERNEL);
    free(me), free(se);
    return src;
}

static uint64_t fnv1a(const char *s, uint64_t h)
{
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* Compiles src for compute capability major.minor into a cubin (malloc'd). @return 1, or 0 with
 * the reason in why (the compiler's log on a compile error). */
static int flex_compile(nvrtc_api *api, const char *src, int major, int minor, char **cubin, size_t *bytes, char *why,
                        size_t n)
{
    char arch[48];
    snprintf(arch, sizeof arch, "--gpu-architecture=sm_%d%d%s", major, minor, major == 9 && minor == 0 ? "a" : "");
    const char *opts[] = {arch, "--std=c++17", "-default-device"};
    nvrtcProgram prog;
    if (api->create(&prog, src, "nsa_flex.cu", 0, NULL, NULL) != NVRTC_SUCCESS) {
        snprintf(why, n, "nvrtcCreateProgram failed");
        return 0;
    }
    const nvrtcResult rc = api->compile(prog, 3, opts);
    if (rc != NVRTC_SUCCESS) {
        size_t ls = 0;
        api->log_size(prog, &ls);
        char *log = (char *)malloc(ls + 1);
        if (log && api->log(prog, log) == NVRTC_SUCCESS) snprintf(why, n, "NVRTC: %.200s", log);
        else snprintf(why, n, "NVRTC compile failed (%d)", (int)rc);
        free(log);
        api->destroy(&prog);
        return 0;
    }
    *bytes = 0;
    api->cubin_size(prog, bytes);
    *cubin = (char *)malloc(*bytes ? *bytes : 1);
    const int ok = *cubin && api->cubin(prog, *cubin) == NVRTC_SUCCESS;
    api->destroy(&prog);
    if (!ok) snprintf(why, n, "nvrtcGetCUBIN failed");
    return ok;
}

/* Compiles the kernel of (mask, score, elem) for an architecture without a GPU: what the tests
 * run on a machine with the toolkit (the generated source must compile) and what times the
 * first compile of a new mod. @return SUCCESS or NOT_SUPPORTED / BAD_ARGUMENT with the reason. */
extern "C" nsa_status nsa_cuda_flex_compile_check(const nsa_mod *mask, const nsa_mod *score, int elem, int major, int minor,
                                                  size_t *cubin_bytes, double *seconds)
{
    nvrtc_api api;
    char why[256];
    if (!nvrtc_open(&api, why, sizeof why)) return nsa_fail(NSA_STATUS_NOT_SUPPORTED, "ctx: %s", why);
    char *src = flex_source(mask, score, elem), *cubin = NULL;
    if (!src) {
        dlclose(api.handle);
        return nsa_fail(NSA_STATUS_OUT_OF_MEMORY, "ctx: no memory for the kernel source");
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    const int ok = flex_compile(&api, src, major, minor, &cubin, cubin_bytes, why, sizeof why);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (seconds) *seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    free(src), free(cubin);
    dlclose(api.handle);
    return ok ? NSA_STATUS_SUCCESS : nsa_fail(NSA_STATUS_NOT_SUPPORTED, "ctx: %s", why);
}

/* ---- the per-context cache ------------------------------------------------------------------ */
enum { FLEX_CACHE_ENTRIES = 64 };
struct flex_cache {
    pthread_mutex_t lock;
    nvrtc_api api;
    int opened;
    int n;
    struct {
        uint64_t hash;
        cudaLibrary_t lib;
        cudaKernel_t kernel;
    } e[FLEX_CACHE_ENTRIES];
};

extern "C" void *nsa_cuda_flex_cache_new(void)
{
    flex_cache *c = (flex_cache *)calloc(1, sizeof *c);
    if (c) pthread_mutex_init(&c->lock, NULL);
    return c;
}

extern "C" void nsa_cuda_flex_cache_free(void *cache)
{
    flex_cache *c = (flex_cache *)cache;
    if (!c) return;
    for (int i = 0; i < c->n; i++) cudaLibraryUnload(c->e[i].lib);
    if (c->api.handle) dlclose(c->api.handle);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

/* The disk cache's folder: NSA_CACHE_DIR, else $XDG_CACHE_HOME/nsa, else $HOME/.cache/nsa
 * (made if absent; no folder: no disk cache). */
static int cache_dir(char *buf, size_t n)
{
    const char *d = getenv("NSA_CACHE_DIR"), *x = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (d && *d) snprintf(buf, n, "%s", d);
    else if (x && *x) snprintf(buf, n, "%s/nsa", x);
    else if (home && *home) snprintf(buf, n, "%s/.cache/nsa", home);
    else return 0;
    mkdir(buf, 0755); /* (its parent may need making too for the $HOME form) */
    struct stat st;
    return stat(buf, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The kernel of (mask, score, elem) on this device: memory cache, disk cache, or compiled. */
static cudaKernel_t flex_kernel(grun *g, flex_cache *c, const nsa_mod *mask, const nsa_mod *score, int elem)
{
    char *src = flex_source(mask, score, elem);
    if (!src) {
        g_fail(g, NSA_STATUS_OUT_OF_MEMORY, "ctx: no memory for the kernel source");
        return NULL;
    }
    int major = 0, minor = 0, dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    char tag[32];
    snprintf(tag, sizeof tag, "sm_%d%d", major, minor);
    const uint64_t hash = fnv1a(tag, fnv1a(src, 1469598103934665603ull));
    cudaKernel_t k = NULL;
    pthread_mutex_lock(&c->lock);
    for (int i = 0; i < c->n && !k; i++)
        if (c->e[i].hash == hash) k = c->e[i].kernel;
    if (!k) {
        char dir[512], path[600], why[256];
        char *cubin = NULL;
        size_t bytes = 0;
        const int have_dir = cache_dir(dir, sizeof dir);
        snprintf(path, sizeof path, "%s/flex-%016llx.cubin", dir, (unsigned long long)hash);
        FILE *f = have_dir ? fopen(path, "rb") : NULL;
        if (f) { /* a cubin compiled earlier for this source and architecture */
            fseek(f, 0, SEEK_END);
            const long len = ftell(f);
            fseek(f, 0, SEEK_SET);
            cubin = len > 0 ? (char *)malloc((size_t)len) : NULL;
            if (cubin && fread(cubin, 1, (size_t)len, f) == (size_t)len) bytes = (size_t)len;
            else free(cubin), cubin = NULL;
            fclose(f);
        }
        if (!cubin) {
            if (!c->opened) c->opened = nvrtc_open(&c->api, why, sizeof why) ? 1 : -1;
            if (c->opened < 0 || !flex_compile(&c->api, src, major, minor, &cubin, &bytes, why, sizeof why)) {
                g_fail(g, NSA_STATUS_NOT_SUPPORTED, "ctx: %s", c->opened < 0 ? "NVRTC (libnvrtc.so) not found" : why);
                pthread_mutex_unlock(&c->lock);
                free(src);
                return NULL;
            }
            FILE *w = have_dir ? fopen(path, "wb") : NULL;
            if (w) fwrite(cubin, 1, bytes, w), fclose(w);
        }
        cudaLibrary_t lib = NULL;
        g_check(g, cudaLibraryLoadData(&lib, cubin, NULL, NULL, 0, NULL, NULL, 0));
        if (g_live(g)) g_check(g, cudaLibraryGetKernel(&k, lib, "nsa_flex_fwd"));
        if (g_live(g)) {
            if (c->n == FLEX_CACHE_ENTRIES) { /* full: the oldest goes */
                cudaLibraryUnload(c->e[0].lib);
                memmove(&c->e[0], &c->e[1], sizeof c->e[0] * (FLEX_CACHE_ENTRIES - 1));
                c->n--;
            }
            c->e[c->n].hash = hash, c->e[c->n].lib = lib, c->e[c->n].kernel = k;
            c->n++;
        }
        free(cubin);
    }
    pthread_mutex_unlock(&c->lock);
    free(src);
    return k;
}

/* ---- the call -------------------------------------------------------------------------------- */
static void caps_of(const nsa_mod *m, nsa_mod_caps *c)
{
    if (m) expr_caps(m, c);
    else memset(c, 0, sizeof *c);
}

/* The block lists copied to the host and checked as the CPU checks them (before any write). */
static void check_lists(grun *g, const nsa_flex_args *a)
{
    const nsa_block_mask *m = &a->block_mask;
    if (!nsa_present(&m->kv_num_blocks)) return;
    nsa_flex_args h = *a;
    const nsa_tensor *src[4] = {&m->kv_num_blocks, &m->kv_indices, &m->full_kv_num_blocks, &m->full_kv_indices};
    nsa_tensor *dst[4] = {&h.block_mask.kv_num_blocks, &h.block_mask.kv_indices, &h.block_mask.full_kv_num_blocks,
                          &h.block_mask.full_kv_indices};
    void *host[4] = {NULL, NULL, NULL, NULL};
    for (int t = 0; t < 4 && g_live(g); t++) {
        if (!nsa_present(src[t])) continue;
        int64_t span = 1; /* elements the view spans (max offset + 1) */
        for (int d = 0; d < src[t]->rank; d++) span += (src[t]->shape[d] - 1) * src[t]->stride[d];
        int empty = 0;
        for (int d = 0; d < src[t]->rank; d++) empty |= src[t]->shape[d] == 0;
        if (empty) continue;
        host[t] = malloc((size_t)span * 4);
        if (!host[t]) {
            g_fail(g, NSA_STATUS_OUT_OF_MEMORY, "block_mask: no host memory to check the lists");
            break;
        }
        g_check(g, cudaMemcpyAsync(host[t], src[t]->data, (size_t)span * 4, cudaMemcpyDeviceToHost, g->st));
        dst[t]->data = host[t];
    }
    if (g_live(g)) g_check(g, cudaStreamSynchronize(g->st));
    if (g_live(g)) {
        const nsa_status st = nsa_flex_lists_check(&h, g->p);
        if (st != NSA_STATUS_SUCCESS) g->err = st; /* (its detail is written) */
    }
    for (int t = 0; t < 4; t++) free(host[t]);
}

/* The mods read their tensors on the device: memory the device cannot address (plain host
 * memory) is refused, naming the tensor, instead of faulting in the kernel. Only the live pass
 * asks the runtime. */
static void check_mod_memory(grun *g, const nsa_mod *m, const char *which)
{
    if (!m || !g_live(g)) return;
    for (int i = 0; i < expr_num_captures(m); i++) {
        const nsa_tensor *t = expr_capture_tensor(m, i);
        cudaPointerAttributes at;
        memset(&at, 0, sizeof at);
        const cudaError_t e = cudaPointerGetAttributes(&at, t->data);
        if (e != cudaSuccess) (void)cudaGetLastError(); /* an unknown pointer: not an error of the call */
        if (e != cudaSuccess || at.type == cudaMemoryTypeUnregistered || (at.type == cudaMemoryTypeHost && !at.devicePointer)) {
            g_fail(g, NSA_STATUS_BAD_ARGUMENT, "%s: tensor '%s' is host memory; on the CUDA backend a mod's tensors must be "
                                               "device (or mapped) memory",
                   which, expr_capture_name(m, i));
            return;
        }
    }
}

static void run_flex(grun *g, const nsa_flex_args *a, flex_cache *c)
{
    const nsa_problem *p = g->p;
    if (p->DK > 256 || p->DV > 256) {
        g_fail(g, NSA_STATUS_NOT_SUPPORTED, "q: DK %lld and DV %lld, the CUDA block-sparse kernel takes head dims up to 256",
               (long long)p->DK, (long long)p->DV);
        return;
    }
    check_mod_memory(g, a->mask_mod, "mask_mod");
    check_mod_memory(g, a->score_mod, "score_mod");
    check_lists(g, a);
    if (!g_live(g)) return;
    if (!c) {
        g_fail(g, NSA_STATUS_OUT_OF_MEMORY, "ctx: no memory for the kernel cache");
        return;
    }
    const int elem = a->q.dtype == NSA_DTYPE_F32 ? 0 : a->q.dtype == NSA_DTYPE_F16 ? 1 : 2;
    cudaKernel_t k = flex_kernel(g, c, a->mask_mod, a->score_mod, elem);
    if (!g_live(g) || !k) return;
    flex_params P;
    memset(&P, 0, sizeof P);
    P.q = a->q.data, P.k = a->k.data, P.v = a->v.data, P.o = a->o.data;
    P.qs0 = a->q.stride[0], P.qs1 = a->q.stride[1], P.qs2 = a->q.stride[2];
    P.ks0 = a->k.stride[0], P.ks1 = a->k.stride[1], P.ks2 = a->k.stride[2];
    P.vs0 = a->v.stride[0], P.vs1 = a->v.stride[1], P.vs2 = a->v.stride[2];
    P.os0 = a->o.stride[0], P.os1 = a->o.stride[1], P.os2 = a->o.stride[2];
    if (nsa_present(&a->lse)) P.lse = (float *)a->lse.data, P.ls0 = a->lse.stride[0], P.ls1 = a->lse.stride[1], P.ls2 = a->lse.stride[2];
    const nsa_block_mask *m = &a->block_mask;
    if (nsa_present(&m->kv_num_blocks)) {
        P.num = (const int *)m->kv_num_blocks.data, P.idx = (const int *)m->kv_indices.data;
        P.ns0 = m->kv_num_blocks.stride[0], P.ns1 = m->kv_num_blocks.stride[1], P.ns2 = m->kv_num_blocks.stride[2];
        P.is0 = m->kv_indices.stride[0], P.is1 = m->kv_indices.stride[1], P.is2 = m->kv_indices.stride[2];
        P.is3 = m->kv_indices.stride[3];
        P.nB = m->kv_num_blocks.shape[0], P.nH = m->kv_num_blocks.shape[1];
        P.iB = m->kv_indices.shape[0], P.iH = m->kv_indices.shape[1];
        if (nsa_present(&m->full_kv_num_blocks)) {
            P.fnum = (const int *)m->full_kv_num_blocks.data, P.fidx = (const int *)m->full_kv_indices.data;
            P.fns0 = m->full_kv_num_blocks.stride[0], P.fns1 = m->full_kv_num_blocks.stride[1];
            P.fns2 = m->full_kv_num_blocks.stride[2];
            P.fis0 = m->full_kv_indices.stride[0], P.fis1 = m->full_kv_indices.stride[1], P.fis2 = m->full_kv_indices.stride[2];
            P.fis3 = m->full_kv_indices.stride[3];
            P.fnB = m->full_kv_num_blocks.shape[0], P.fnH = m->full_kv_num_blocks.shape[1];
            P.fiB = m->full_kv_indices.shape[0], P.fiH = m->full_kv_indices.shape[1];
        }
    }
    P.B = p->B, P.Tq = p->T, P.Tk = p->Tk, P.HQ = p->HQ, P.G = p->G, P.DK = p->DK, P.DV = p->DV;
    P.q_block = m->q_block, P.kv_block = m->kv_block, P.nkb = p->Tk / m->kv_block + (p->Tk % m->kv_block != 0);
    P.scale = p->scale;
    nsa_mod_caps mc, sc;
    caps_of(a->mask_mod, &mc), caps_of(a->score_mod, &sc);
    const int64_t items = p->B * p->HQ * p->T;
    if (items == 0) return;
    void *args[] = {&P, &mc, &sc};
    g_check(g, cudaLaunchKernel((const void *)k, dim3(simt_grid(items)), dim3(32 * SIMT_WARPS), args, 0, g->st));
}

extern "C" size_t nsa_cuda_flex_workspace(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_args *a)
{
    (void)ctx, (void)p, (void)a;
    return 0; /* (the kernel takes none) */
}

extern "C" nsa_status nsa_cuda_flex(const nsa_context *ctx, const nsa_problem *p, const nsa_flex_args *a, void *ws)
{
    grun g;
    g_init(&g, ctx, p, ws, 0);
    if (g.err != NSA_STATUS_SUCCESS) return g.err;
    run_flex(&g, a, (flex_cache *)ctx->flex_cache);
    if (g.err == NSA_STATUS_SUCCESS) g_check(&g, cudaGetLastError());
    return g.err;
}
