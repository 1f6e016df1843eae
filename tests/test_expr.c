/* test_expr.c -- the mask_mod / score_mod expression language (src/mod/expr.c, spec 13): each
 * of FlexAttention's example mods and every operator against a C function written from the
 * spec (Python's floor // and %, clamped captured reads, int / float / bool typing) over a grid
 * of (b, h, q_idx, kv_idx, score); the C source the expressions print (what a generated kernel
 * compiles), built with the system's C compiler and loaded, against the evaluator; then bad
 * expressions and bad captures, each refused with BAD_EXPRESSION (or the capture's own status)
 * and a detail that names the position. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <dlfcn.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "mod/expr.h"
#include "nsa.h"

enum { NB = 2, NH = 3, NQ = 37, NK = 41 };

static int32_t g_doc[64];
static float g_slope[NH];
static float g_bias[NH][33];
static uint16_t g_bias16[NH][33]; /* f16 copies of small halves: exact */
static uint8_t g_mask[NQ][NK];

static nsa_tensor t1(void *p, nsa_dtype dt, int64_t n) { return nsa_tensor_make(p, dt, 1, &n); }
static nsa_tensor t2(void *p, nsa_dtype dt, int64_t a, int64_t b) { return nsa_tensor_make(p, dt, 2, (int64_t[]){a, b}); }

static uint16_t half_of(float f) /* f: a multiple of 1/8 in [-64, 64]: exact in f16 */
{
    const int neg = f < 0;
    float a = neg ? -f : f;
    if (a == 0.0f) return (uint16_t)(neg << 15);
    int e = 0;
    while (a >= 2.0f) a /= 2.0f, e++;
    while (a < 1.0f) a *= 2.0f, e--;
    return (uint16_t)((neg << 15) | ((e + 15) << 10) | (uint16_t)((a - 1.0f) * 1024.0f));
}

static void fill(void)
{
    for (int i = 0; i < 64; i++) g_doc[i] = i / 9; /* documents of 9 tokens */
    for (int h = 0; h < NH; h++) {
        g_slope[h] = 1.0f / (float)(2 << h);
        for (int j = 0; j < 33; j++) {
            g_bias[h][j] = (float)((j * 7 + h * 3) % 17 - 8) * 0.125f;
            g_bias16[h][j] = half_of(g_bias[h][j]);
        }
    }
    for (int q = 0; q < NQ; q++)
        for (int k = 0; k < NK; k++) g_mask[q][k] = (uint8_t)((q * 31 + k * 17) % 5 == 0);
}

static int64_t fdiv(int64_t a, int64_t b) { return b == 0 ? 0 : (a - (((a % b) + b) % b)) / b; }
static int64_t fmod_py(int64_t a, int64_t b) { return b == 0 ? 0 : ((a % b) + b) % b; }
static int64_t clampi(int64_t i, int64_t n) { return i < 0 ? 0 : i >= n ? n - 1 : i; }

typedef float (*ref_fn)(int64_t b, int64_t h, int64_t q, int64_t k, float s);

static float r_causal(int64_t b, int64_t h, int64_t q, int64_t k, float s) { (void)b, (void)h, (void)s; return q >= k; }
static float r_window(int64_t b, int64_t h, int64_t q, int64_t k, float s) { (void)b, (void)h, (void)s; return q - k < 8 && q >= k; }
static float r_prefix(int64_t b, int64_t h, int64_t q, int64_t k, float s) { (void)b, (void)h, (void)s; return k < 6 || q >= k; }
static float r_doc(int64_t b, int64_t h, int64_t q, int64_t k, float s)
{
    (void)b, (void)h, (void)s;
    return g_doc[q] == g_doc[k] && q >= k;
}
static float r_alibi(int64_t b, int64_t h, int64_t q, int64_t k, float s)
{
    (void)b;
    return s - g_slope[h] * (float)(q > k ? q - k : k - q);
}
static float r_softcap(int64_t b, int64_t h, int64_t q, int64_t k, float s)
{
    (void)b, (void)h, (void)q, (void)k;
    return 30.0f * tanhf(s / 30.0f);
}
static float r_relbias(int64_t b, int64_t h, int64_t q, int64_t k, float s)
{
    (void)b;
    return s + g_bias[h][clampi(q - k + 16, 33)];
}
static float r_floor(int64_t b, int64_t h, int64_t q, int64_t k, float s)
{
    (void)b, (void)h, (void)s;
    return (float)(fdiv(q - k, 3) + fmod_py(q - k, 5) * 100 + fdiv(k - 20, -4) * 10000 + fmod_py(q, 0));
}
static float r_funcs(int64_t b, int64_t h, int64_t q, int64_t k, float s)
{
    (void)b, (void)h;
    const float w = q > k ? 1.0f / (1.0f + expf(-s)) : fminf(expf(s), 2.0f);
    return w + (float)(q > 3 ? q : 3) + sqrtf(4.0f) + floorf(-1.5f) + logf(1.0f) + (float)q / 4.0f;
}
static float r_bits(int64_t b, int64_t h, int64_t q, int64_t k, float s)
{
    (void)h, (void)s;
    const int a = ((q & 7) ^ (k | 1)) != ~b, c = ((q < 5) && (k > 2)) || !(b == 1), d = !(q < k);
    return (float)(a && (c || d));
}
static float r_half(int64_t b, int64_t h, int64_t q, int64_t k, float s)
{
    (void)b;
    return s * 0.5f + g_bias[h][clampi(k - q + 16, 33)];
}
static float r_u8(int64_t b, int64_t h, int64_t q, int64_t k, float s) { (void)b, (void)h, (void)s; return g_mask[q][k] != 0; }
static float r_ternary(int64_t b, int64_t h, int64_t q, int64_t k, float s)
{
    (void)s;
    return (float)(q == k ? -1 : (b + h) % 2 == 0 ? q * k : q - k);
}
static float r_true(int64_t b, int64_t h, int64_t q, int64_t k, float s) { (void)b, (void)h, (void)q, (void)k, (void)s; return 1.0f; }
static float r_mixed(int64_t b, int64_t h, int64_t q, int64_t k, float s)
{
    (void)b, (void)h;
    return (float)(q - k) * 0.5f + (s >= 0.0f ? s : -s) + (float)(q % 4 == 1 && k != 2);
}

static void check_mod(const char *text, expr_kind kind, ref_fn ref);

/* The expressions checked, kept for the generated-source test. */
static struct {
    const char *text;
    expr_kind kind;
} g_checked[32];
static int g_nchecked;

static void captures(expr_capture *caps)
{
    caps[0] = (expr_capture){"doc", t1(g_doc, NSA_DTYPE_I32, 64)};
    caps[1] = (expr_capture){"slope", t1(g_slope, NSA_DTYPE_F32, NH)};
    caps[2] = (expr_capture){"bias", t2(g_bias, NSA_DTYPE_F32, NH, 33)};
    caps[3] = (expr_capture){"bias16", t2(g_bias16, NSA_DTYPE_F16, NH, 33)};
    caps[4] = (expr_capture){"m", t2(g_mask, NSA_DTYPE_U8, NQ, NK)};
}

static void check_mod(const char *text, expr_kind kind, ref_fn ref)
{
    expr_capture caps[5];
    captures(caps);
    if (g_nchecked < 32) g_checked[g_nchecked].text = text, g_checked[g_nchecked++].kind = kind;
    expr_program *p = NULL;
    const nsa_status st = expr_compile(text, kind, caps, 5, NULL, &p);
    char msg[300];
    snprintf(msg, sizeof msg, "compile '%s': %s", text, nsa_last_error_detail());
    CHECK_MSG(st == NSA_STATUS_SUCCESS && p, msg);
    if (!p) return;
    long bad = 0;
    double worst = 0.0;
    const float scores[] = {-3.5f, -0.25f, 0.0f, 0.75f, 2.0f, 41.0f};
    for (int64_t b = 0; b < NB; b++)
        for (int64_t h = 0; h < NH; h++)
            for (int64_t q = 0; q < NQ; q++)
                for (int64_t k = 0; k < NK; k++) {
                    const float s = scores[(q + k + h) % 6];
                    const float got = expr_eval(p, b, h, q, k, s), want = ref(b, h, q, k, s);
                    const double d = fabs((double)got - (double)want);
                    if (!(d <= 1e-6 * (1.0 + fabs((double)want)))) bad++;
                    worst = d > worst ? d : worst;
                }
    snprintf(msg, sizeof msg, "'%s': %ld of %d values differ from the reference (worst %.3g)", text, bad, NB * NH * NQ * NK,
             worst);
    CHECK_MSG(bad == 0, msg);
    if (g_tests_verbose) printf("  %s\n", msg);
    expr_free(p);
}

static void test_mods_equal_reference(void)
{
    fill();
    check_mod("q_idx >= kv_idx", EXPR_MASK, r_causal);
    check_mod("q_idx - kv_idx < 8 && q_idx >= kv_idx", EXPR_MASK, r_window);
    check_mod("kv_idx < 6 || q_idx >= kv_idx", EXPR_MASK, r_prefix);
    check_mod("(doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)", EXPR_MASK, r_doc);
    check_mod("score - slope[h] * abs(q_idx - kv_idx)", EXPR_SCORE, r_alibi);
    check_mod("30.0 * tanh(score / 30.0)", EXPR_SCORE, r_softcap);
    check_mod("score + bias[h, q_idx - kv_idx + 16]", EXPR_SCORE, r_relbias);
    check_mod("(q_idx - kv_idx) // 3 + (q_idx - kv_idx) % 5 * 100 + (kv_idx - 20) // -4 * 10000 + q_idx % 0", EXPR_SCORE,
              r_floor);
    check_mod("where(q_idx > kv_idx, sigmoid(score), min(exp(score), 2.0)) + max(q_idx, 3) + sqrt(4) + floor(-1.5) "
              "+ log(1.0) + q_idx / 4",
              EXPR_SCORE, r_funcs);
    check_mod("(((q_idx & 7) ^ (kv_idx | 1)) != ~b) && ((q_idx < 5) & (kv_idx > 2) | !(b == 1) || ~(q_idx < kv_idx))",
              EXPR_MASK, r_bits);
    check_mod("score * .5 + bias16[h, kv_idx - q_idx + 16]", EXPR_SCORE, r_half);
    check_mod("m[q_idx, kv_idx]", EXPR_MASK, r_u8);
    check_mod("q_idx == kv_idx ? -1 : (b + h) % 2 == 0 ? q_idx * kv_idx : q_idx - kv_idx", EXPR_SCORE, r_ternary);
    check_mod("  True  ", EXPR_MASK, r_true);
    check_mod("(q_idx - kv_idx) * 0.5 + abs(score) + where(q_idx % 4 == 1 && kv_idx != 2, 1, 0)", EXPR_SCORE, r_mixed);
}

/* expr_to_c of every checked expression, compiled by the system's C compiler into a shared
 * object with EXPR_C_PRELUDE and loaded: each function equals expr_eval over the grid; and the
 * score_mods' expr_grad_to_c, whose value, score derivative and tensor gradients equal
 * expr_grad's (the same arithmetic, up to the contraction of a * b + c). */
typedef float (*gen_fn)(const nsa_mod_caps *, long long, long long, long long, long long, float);
typedef struct gen_sink {
    float *g[16];
} gen_sink;
typedef float (*grad_fn)(const nsa_mod_caps *, const gen_sink *, long long, long long, long long, long long, float, float, float *);
enum { GRAD_ELEMS = 4096 }; /* per capture, at least its element count */

/* Equal within fp32 rounding (the library may contract a * b + c where the generated object does
 * not), or the same non-finite value. */
static int close_or_same(float x, float y)
{
    if (x != x || y != y || isinf(x) || isinf(y)) return !memcmp(&x, &y, 4) || (x != x && y != y);
    return fabs((double)x - (double)y) <= 1e-6 * (1.0 + fabs((double)y));
}

static void check_generated_grad(void *lib, int i, const expr_program *p, int idx32)
{
    char name[32];
    snprintf(name, sizeof name, "grad%s_%d", idx32 ? "32" : "", i);
    grad_fn fn;
    void *sym = dlsym(lib, name);
    memcpy(&fn, &sym, sizeof fn);
    CHECK_MSG(fn != NULL, "a generated gradient function is missing");
    if (!fn) return;
    nsa_mod_caps mc;
    expr_caps(p, &mc);
    float *mine = (float *)calloc(2 * 16 * GRAD_ELEMS, sizeof(float)), *theirs = mine + 16 * GRAD_ELEMS;
    gen_sink sink;
    float *grads[16];
    for (int c = 0; c < 16; c++) sink.g[c] = mine + c * GRAD_ELEMS, grads[c] = theirs + c * GRAD_ELEMS;
    void *scratch = malloc(expr_scratch_bytes(p) + 16);
    const float scores[] = {-3.5f, -0.25f, 0.0f, 0.75f, 2.0f, 41.0f};
    long bad = 0;
    for (int64_t b = 0; b < NB; b++)
        for (int64_t h = 0; h < NH; h++)
            for (int64_t q = 0; q < NQ; q++)
                for (int64_t k = 0; k < NK; k++) {
                    const float s = scores[(q + k + h) % 6], g = 0.5f - (float)((q * 3 + k) % 5) * 0.25f;
                    float d1 = 0.0f, d2 = 0.0f;
                    const float v1 = fn(&mc, &sink, b, h, q, k, s, g, &d1), v2 = expr_grad(p, b, h, q, k, s, g, &d2, grads, scratch);
                    bad += !close_or_same(v1, v2) || !close_or_same(d1, d2);
                }
    for (size_t e = 0; e < 16 * GRAD_ELEMS; e++) bad += !close_or_same(mine[e], theirs[e]);
    char msg[300];
    snprintf(msg, sizeof msg, "generated reverse mode (%s ints) of '%s': %ld values or gradients differ from expr_grad",
             idx32 ? "32-bit" : "64-bit", g_checked[i].text, bad);
    CHECK_MSG(bad == 0, msg);
    free(scratch), free(mine);
}

/* ---- generated C, compiled by the system's C compiler and loaded ------------------------------ */
typedef struct gen_obj {
    char dir[32], src[64], so[64];
    FILE *f;
} gen_obj;

/* A temporary folder and <stem>.c in it, opened with EXPR_C_PRELUDE written. @return 0 (and says
 * why: no C compiler means `skipped` is printed) when the check cannot run. */
static int gen_open(gen_obj *g, const char *stem, const char *skipped)
{
    memset(g, 0, sizeof *g);
    if (system("cc --version > /dev/null 2>&1") != 0) {
        printf("  expr: no C compiler (cc): %s\n", skipped);
        return 0;
    }
    snprintf(g->dir, sizeof g->dir, "/tmp/nsa_expr_XXXXXX");
    if (!mkdtemp(g->dir)) {
        CHECK_MSG(0, "mkdtemp failed");
        return 0;
    }
    snprintf(g->src, sizeof g->src, "%s/%s.c", g->dir, stem), snprintf(g->so, sizeof g->so, "%s/%s.so", g->dir, stem);
    g->f = fopen(g->src, "w");
    CHECK_MSG(g->f != NULL, "cannot write the generated source");
    if (g->f) fprintf(g->f, "#include <math.h>\n#define NSA_MOD_FN static inline\n%s", EXPR_C_PRELUDE);
    return g->f != NULL;
}

/* float <prefix>[32]_<i>(caps, b, h, q_idx, kv_idx, score): p printed with expr_to_c(idx32).
 * @return whether the text holds a 32-bit int. */
static int gen_mod(gen_obj *g, const char *prefix, int i, const expr_program *p, int idx32)
{
    const size_t need = expr_to_c(p, idx32, NULL, 0);
    char *code = (char *)malloc(need + 1);
    CHECK(expr_to_c(p, idx32, code, need + 1) == need && strlen(code) == need);
    fprintf(g->f, "float %s%s_%d(const nsa_mod_caps *caps, long long b, long long h, long long q_idx, long long kv_idx, "
                  "float score)\n{\n    (void)caps, (void)b, (void)h, (void)q_idx, (void)kv_idx, (void)score;\n"
                  "    return (float)(%s);\n}\n", prefix, idx32 ? "32" : "", i, code);
    const int narrow = strstr(code, "(int)") != NULL;
    free(code);
    return narrow;
}

/* The source compiled (cc with `flags`) and loaded; NULL on failure (checked, the files kept). */
static void *gen_load(gen_obj *g, const char *flags)
{
    fclose(g->f);
    g->f = NULL;
    char cmd[256];
    snprintf(cmd, sizeof cmd, "cc -std=c11 -O1 %s -shared -fPIC -o %s %s -lm", flags, g->so, g->src);
    const int rc = system(cmd);
    CHECK_MSG(rc == 0, "the generated source does not compile (kept in /tmp/nsa_expr_*)");
    void *lib = rc == 0 ? dlopen(g->so, RTLD_NOW | RTLD_LOCAL) : NULL;
    CHECK_MSG(rc != 0 || lib != NULL, "dlopen of the generated object failed");
    return lib;
}

/* The function <prefix>[32]_<i> of a loaded object, or NULL. */
static gen_fn gen_get(void *lib, const char *prefix, int i, int idx32)
{
    char name[32];
    snprintf(name, sizeof name, "%s%s_%d", prefix, idx32 ? "32" : "", i);
    gen_fn fn;
    void *sym = dlsym(lib, name);
    memcpy(&fn, &sym, sizeof fn);
    return fn;
}

static void gen_close(gen_obj *g, void *lib)
{
    if (lib) dlclose(lib);
    if (lib) remove(g->so), remove(g->src), rmdir(g->dir);
}

/* Point e of NBIG_POINTS with indices near 2^31 (the 32-bit form's promise is [0, 2^31)): where a
 * product or a sum could leave 32 bits, the range analysis must have kept 64. */
static const int64_t BIG[] = {0, 1, 5, 46341, 65536, 2147483000, 2147483646, 2147483647};
enum { NBIG = (int)(sizeof BIG / sizeof BIG[0]), NBIG_POINTS = NBIG * NBIG * 4 };
static void big_point(int e, int64_t *b, int64_t *h, int64_t *q, int64_t *k)
{
    *q = BIG[e % NBIG], *k = BIG[(e / NBIG) % NBIG];
    *b = (e / (NBIG * NBIG)) & 1 ? BIG[NBIG - 1] : 1;
    *h = (e / (NBIG * NBIG)) & 2 ? BIG[NBIG - 2] : 2;
}

static void test_generated_source(void)
{
    gen_obj g;
    if (!gen_open(&g, "gen", "the generated-source check is skipped")) return;
    FILE *f = g.f;
    fprintf(f, "typedef struct nsa_mod_sink { float *g[16]; } nsa_mod_sink;\n"
               "static void nsa_mod_grad(const nsa_mod_sink *s, int c, long long lin, float a) { s->g[c][lin] += a; }\n");
    expr_capture caps[5];
    captures(caps);
    expr_program *progs[32] = {0};
    for (int i = 0; i < g_nchecked; i++) {
        CHECK_STATUS(expr_compile(g_checked[i].text, g_checked[i].kind, caps, 5, NULL, &progs[i]), NSA_STATUS_SUCCESS);
        if (!progs[i]) continue;
        for (int idx32 = 0; idx32 < 2; idx32++) gen_mod(&g, "mod", i, progs[i], idx32); /* mod32_<i>: 32 bits where exact */
        for (int idx32 = 0; g_checked[i].kind == EXPR_SCORE && idx32 < 2; idx32++) { /* its reverse mode, under its own name */
            const size_t gneed = expr_grad_to_c(progs[i], idx32, NULL, 0);
            char *gcode = (char *)malloc(gneed + 1);
            CHECK(gneed > 0 && expr_grad_to_c(progs[i], idx32, gcode, gneed + 1) == gneed && strlen(gcode) == gneed);
            fprintf(f, "#define nsa_mod_score_grad grad%s_%d\n#undef NSA_MOD_FN\n#define NSA_MOD_FN\n%s#undef NSA_MOD_FN\n"
                       "#define NSA_MOD_FN static inline\n#undef nsa_mod_score_grad\n", idx32 ? "32" : "", i, gcode);
            free(gcode);
        }
    }
    void *lib = gen_load(&g, "-ffp-contract=off -Wall -Werror");
    const float scores[] = {-3.5f, -0.25f, 0.0f, 0.75f, 2.0f, 41.0f};
    for (int i = 0; lib && i < g_nchecked; i++) {
        for (int idx32 = 0; idx32 < 2; idx32++) {
            const gen_fn fn = gen_get(lib, "mod", i, idx32);
            if (!fn || !progs[i]) continue;
            nsa_mod_caps mc;
            expr_caps(progs[i], &mc);
            long bad = 0;
            for (int64_t b = 0; b < NB; b++)
                for (int64_t h = 0; h < NH; h++)
                    for (int64_t q = 0; q < NQ; q++)
                        for (int64_t k = 0; k < NK; k++) {
                            const float s = scores[(q + k + h) % 6];
                            const float x = fn(&mc, b, h, q, k, s), y = expr_eval(progs[i], b, h, q, k, s);
                            bad += !(fabs((double)x - (double)y) <= 1e-6 * (1.0 + fabs((double)y)));
                        }
            for (int e = 0; e < NBIG_POINTS; e++) { /* and near 2^31 */
                int64_t b, h, q, k;
                big_point(e, &b, &h, &q, &k);
                const float s = scores[e % 6];
                const float x = fn(&mc, b, h, q, k, s), y = expr_eval(progs[i], b, h, q, k, s);
                bad += !(fabs((double)x - (double)y) <= 1e-6 * (1.0 + fabs((double)y))) && !(x != x && y != y);
            }
            char msg[300];
            snprintf(msg, sizeof msg, "generated C (%s ints) of '%s': %ld values differ from the evaluator", idx32 ? "32-bit" : "64-bit",
                     g_checked[i].text, bad);
            CHECK_MSG(bad == 0, msg);
        }
        for (int idx32 = 0; g_checked[i].kind == EXPR_SCORE && idx32 < 2; idx32++) check_generated_grad(lib, i, progs[i], idx32);
    }
    gen_close(&g, lib);
    for (int i = 0; i < g_nchecked; i++) expr_free(progs[i]);
}

/* The call fails with `want` and its detail contains `needle` (position and message). */
static void expect_bad(const char *text, expr_kind kind, const expr_capture *caps, int ncap, nsa_status want, const char *needle)
{
    expr_program *p = (expr_program *)1;
    const nsa_status st = expr_compile(text, kind, caps, ncap, NULL, &p);
    char msg[400];
    snprintf(msg, sizeof msg, "'%s': status %d, detail '%s', want %d with '%s'", text ? text : "(null)", (int)st,
             nsa_last_error_detail(), (int)want, needle);
    CHECK_MSG(st == want && p == NULL && strstr(nsa_last_error_detail(), needle) != NULL, msg);
    if (g_tests_verbose) printf("  refused: %s\n", nsa_last_error_detail());
}

static void test_bad_expressions(void)
{
    const expr_capture doc[] = {{"doc", t1(g_doc, NSA_DTYPE_I32, 64)}};
    const nsa_status E = NSA_STATUS_BAD_EXPRESSION;
    expect_bad("q_idx >= ", EXPR_MASK, doc, 1, E, "mask_mod:10: unexpected end");
    expect_bad("q_idx >= kvidx", EXPR_MASK, doc, 1, E, "mask_mod:10: unknown name 'kvidx'");
    expect_bad("score > 0", EXPR_MASK, doc, 1, E, "mask_mod:1: 'score' is not known in a mask_mod");
    expect_bad("q_idx + kv_idx", EXPR_MASK, doc, 1, E, "must give a bool");
    expect_bad("q_idx < kv_idx", EXPR_SCORE, doc, 1, E, "score_mod:1: a score_mod must give a number");
    expect_bad("doc[q_idx, kv_idx] == 1", EXPR_MASK, doc, 1, E, "mask_mod:1: 'doc' has rank 1, indexed with 2 indexes");
    expect_bad("doc[1.5] == 1", EXPR_MASK, doc, 1, E, "mask_mod:5: index 0 of 'doc' must be an int, got float");
    expect_bad("foo(q_idx) > 0", EXPR_MASK, doc, 1, E, "mask_mod:1: unknown function 'foo'");
    expect_bad("exp(q_idx < 1) > 0", EXPR_MASK, doc, 1, E, "exp needs a number, got a bool");
    expect_bad("min(q_idx) > 0", EXPR_MASK, doc, 1, E, "min takes 2 arguments, got 1");
    expect_bad("1 < q_idx < 3", EXPR_MASK, doc, 1, E, "chained comparison");
    expect_bad("(q_idx >= kv_idx", EXPR_MASK, doc, 1, E, "mask_mod:17: expected ')'");
    expect_bad("q_idx >= kv_idx)", EXPR_MASK, doc, 1, E, "mask_mod:16: unexpected ')' after the expression");
    expect_bad("q_idx && kv_idx", EXPR_MASK, doc, 1, E, "mask_mod:7: '&&' needs two bools, got int and int");
    expect_bad("0x10 > q_idx", EXPR_MASK, doc, 1, E, "mask_mod:1: malformed number");
    expect_bad("99999999999999999999 > q_idx", EXPR_MASK, doc, 1, E, "does not fit int64");
    expect_bad("where(q_idx, 1, 2) > 0", EXPR_MASK, doc, 1, E, "the condition must be a bool, got int");
    expect_bad("doc > 1", EXPR_MASK, doc, 1, E, "mask_mod:1: 'doc' is a tensor");
    expect_bad("cat[q_idx] > 1", EXPR_MASK, doc, 1, E, "unknown tensor 'cat'");
    expect_bad("(q_idx < 1) + 1 > 0", EXPR_MASK, doc, 1, E, "'+' needs numbers, got a bool");
    expect_bad("q_idx ** 2 > 0", EXPR_MASK, doc, 1, E, "mask_mod:8: unexpected '*'");
    expect_bad("score & 1", EXPR_SCORE, doc, 1, E, "'&' needs two bools or two ints, got float and int");
    expect_bad("-(q_idx < 1)", EXPR_MASK, doc, 1, E, "'-' needs a number, got a bool");
    expect_bad("q_idx < 1 ? 1", EXPR_SCORE, doc, 1, E, "expected ':'");
    expect_bad("where(q_idx < 1, true, 2.0)", EXPR_SCORE, doc, 1, E, "must both be bools or both numbers");
    expect_bad("(q_idx < 1) == 1", EXPR_MASK, doc, 1, E, "compares a bool with a number");
    expect_bad("", EXPR_MASK, doc, 1, E, "mask_mod:1: unexpected end");
    expect_bad("q_idx # 1", EXPR_MASK, doc, 1, E, "mask_mod:7: unexpected '#'");
    char deep[400];
    size_t n = 0;
    for (int i = 0; i < 100; i++) deep[n++] = '(';
    deep[n++] = '1';
    for (int i = 0; i < 100; i++) deep[n++] = ')';
    memcpy(deep + n, " > 0", 5);
    expect_bad(deep, EXPR_MASK, doc, 1, E, "nests deeper than");
    expect_bad(NULL, EXPR_MASK, doc, 1, NSA_STATUS_NULL_POINTER, "text is NULL");

    /* captures: reserved or repeated names, bad views */
    expr_capture bad[2] = {{"score", t1(g_doc, NSA_DTYPE_I32, 64)}, {"doc", t1(g_doc, NSA_DTYPE_I32, 64)}};
    expect_bad("q_idx > 0", EXPR_MASK, bad, 1, E, "capture 0: 'score' is not a free name");
    bad[0].name = "where";
    expect_bad("q_idx > 0", EXPR_MASK, bad, 1, E, "'where' is not a free name");
    bad[0].name = "9lives";
    expect_bad("q_idx > 0", EXPR_MASK, bad, 1, E, "'9lives' is not a free name");
    bad[0].name = "doc";
    expect_bad("q_idx > 0", EXPR_MASK, bad, 2, E, "capture 'doc' given twice");
    bad[0].name = NULL;
    expect_bad("q_idx > 0", EXPR_MASK, bad, 1, NSA_STATUS_NULL_POINTER, "capture 0: name is NULL");
    bad[0].name = "x";
    bad[0].tensor.dtype = (nsa_dtype)42;
    expect_bad("q_idx > 0", EXPR_MASK, bad, 1, NSA_STATUS_BAD_DTYPE, "capture 'x': dtype 42");
    bad[0].tensor = t1(NULL, NSA_DTYPE_F32, 4);
    expect_bad("q_idx > 0", EXPR_MASK, bad, 1, NSA_STATUS_NULL_POINTER, "capture 'x': data is NULL");
    bad[0].tensor = t1(g_doc, NSA_DTYPE_F32, 0);
    expect_bad("q_idx > 0", EXPR_MASK, bad, 1, NSA_STATUS_BAD_SHAPE, "capture 'x': dim 0 is 0");
    bad[0].tensor = t1(g_doc, NSA_DTYPE_F32, 4);
    bad[0].tensor.rank = 5;
    expect_bad("q_idx > 0", EXPR_MASK, bad, 1, NSA_STATUS_BAD_RANK, "capture 'x': rank 5");
    expect_bad("q_idx > 0", EXPR_MASK, bad, 17, NSA_STATUS_BAD_ARGUMENT, "17 captures");
}

/* The program keeps its own copy of the capture names, and reports the variables it reads. */
static void test_program_details(void)
{
    char name[8] = "doc";
    const expr_capture caps[] = {{name, t1(g_doc, NSA_DTYPE_I32, 64)}};
    expr_program *p = NULL;
    CHECK_STATUS(expr_compile("doc[q_idx] == doc[kv_idx]", EXPR_MASK, caps, 1, "doc_mask", &p), NSA_STATUS_SUCCESS);
    memcpy(name, "xyz", 4);
    CHECK(p && expr_eval(p, 0, 0, 3, 5, 0.0f) == 1.0f && expr_eval(p, 0, 0, 3, 9, 0.0f) == 0.0f);
    CHECK(expr_uses(p) == (4u | 8u));
    expr_free(p);
    CHECK_STATUS(expr_compile("score * 2 + h", EXPR_SCORE, NULL, 0, NULL, &p), NSA_STATUS_SUCCESS);
    CHECK(p && expr_uses(p) == (16u | 2u) && expr_eval(p, 0, 3, 0, 0, 1.5f) == 6.0f);
    expr_free(p);
    expr_free(NULL);
}


/* Random int expressions (every int operator, literals up to 2^40, reads of an i32 capture,
 * comparisons choosing between ints), printed with 64-bit ints and with 32-bit ones where the range analysis allows,
 * compiled and loaded: both equal the evaluator bit for bit at indices from 0 to 2^31 - 1. A node
 * the analysis wrongly narrowed would wrap in 32 bits at the large indices. */
static const char *const RND_LIT[] = {"0", "1", "2", "3", "7", "100", "4096", "46341", "65536", "2147483647", "2147483648",
                                      "4294967296", "1099511627776"};

/* printf into buf (n bytes; a long expression is cut, which only shortens the test's input) */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static void rnd_put(char *buf, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, n, fmt, ap);
    va_end(ap);
}

static void rnd_expr(test_rng *r, char *buf, size_t n, int depth)
{
    const int pick = depth <= 0 ? (int)rng_int(r, 0, 5) : (int)rng_int(r, 0, 21);
    char a[2048], b[2048], c[2048];
    switch (pick) {
    case 0: rnd_put(buf, n, "q_idx"); return;
    case 1: rnd_put(buf, n, "kv_idx"); return;
    case 2: rnd_put(buf, n, "b"); return;
    case 3: rnd_put(buf, n, "h"); return;
    case 4: case 5: rnd_put(buf, n, "%s%s", rng_int(r, 0, 3) == 0 ? "-" : "", RND_LIT[rng_int(r, 0, 12)]); return;
    default: break;
    }
    rnd_expr(r, a, sizeof a, depth - 1);
    rnd_expr(r, b, sizeof b, depth - 1);
    static const char *const BIN[] = {"+", "-", "*", "//", "%", "&", "|", "^"};
    static const char *const CMP[] = {"<", "<=", ">", ">=", "==", "!="};
    switch (pick) {
    case 6: case 7: case 8: case 9: case 10: case 11: case 12: case 13:
        rnd_put(buf, n, "(%s %s %s)", a, BIN[pick - 6], b); return;
    case 14: rnd_put(buf, n, "(-%s)", a); return;
    case 15: rnd_put(buf, n, "abs(%s)", a); return;
    case 16: rnd_put(buf, n, "min(%s, %s)", a, b); return;
    case 17: rnd_put(buf, n, "max(%s, %s)", a, b); return;
    case 18: rnd_put(buf, n, "(~%s)", a); return;
    case 19: rnd_put(buf, n, "doc[%s]", a); return;
    case 20: rnd_put(buf, n, "((%s %% 7) * %s)", a, b); return;
    default:
        rnd_expr(r, c, sizeof c, depth - 1);
        rnd_put(buf, n, "where(%s %s %s, %s, %s)", a, CMP[rng_int(r, 0, 5)], b, b, c);
        return;
    }
}

static void test_random_int_expressions(void)
{
    enum { NEXPR = 160 };
    gen_obj g;
    if (!gen_open(&g, "rnd", "the random int expressions are skipped")) return;
    expr_capture caps[5];
    captures(caps);
    test_rng r = {20261127};
    expr_program *progs[NEXPR] = {0};
    char text[NEXPR][4096];
    int narrowed = 0;
    for (int i = 0; i < NEXPR; i++) {
        char e[4096 - 16];
        rnd_expr(&r, e, sizeof e, 2 + i % 4);
        snprintf(text[i], sizeof text[i], "score + %s", e);
        CHECK_STATUS(expr_compile(text[i], EXPR_SCORE, caps, 5, NULL, &progs[i]), NSA_STATUS_SUCCESS);
        if (!progs[i]) continue;
        gen_mod(&g, "rnd", i, progs[i], 0);
        narrowed += gen_mod(&g, "rnd", i, progs[i], 1);
    }
    /* (-w: random text holds x == x and the like; -fwrapv: a wrongly narrowed int wraps, visibly) */
    void *lib = gen_load(&g, "-fwrapv -w");
    long bad = 0;
    for (int i = 0; lib && i < NEXPR; i++) {
        if (!progs[i]) continue;
        nsa_mod_caps mc;
        expr_caps(progs[i], &mc);
        for (int idx32 = 0; idx32 < 2; idx32++) {
            const gen_fn fn = gen_get(lib, "rnd", i, idx32);
            if (!fn) continue;
            long here = 0;
            for (int e = 0; e < NBIG_POINTS; e++) {
                int64_t b, h, q, k;
                big_point(e, &b, &h, &q, &k);
                const float x = fn(&mc, b, h, q, k, 0.5f), y = expr_eval(progs[i], b, h, q, k, 0.5f);
                here += memcmp(&x, &y, sizeof x) != 0 && !(x != x && y != y);
            }
            if (here && bad < 3) printf("  expr: '%s' (%s ints) differs from the evaluator at %ld points\n", text[i], idx32 ? "32-bit" : "64-bit", here);
            bad += here;
        }
    }
    char msg[200];
    snprintf(msg, sizeof msg, "random int expressions: %ld values differ from the evaluator (%d of %d printed with 32-bit ints)", bad,
             narrowed, NEXPR);
    CHECK_MSG(lib != NULL && bad == 0 && narrowed > NEXPR / 4, msg);
    if (g_tests_verbose) printf("  %s\n", msg);
    gen_close(&g, lib);
    for (int i = 0; i < NEXPR; i++) expr_free(progs[i]);
}

void test_expr_all(void)
{
    test_mods_equal_reference();
    test_generated_source();
    test_random_int_expressions();
    test_bad_expressions();
    test_program_details();
}
