/* io.c -- strided rows in any storage dtype <-> fp32, packed K/V panels, threads. */
#include "common.h"
#include "../dtype.h"

#ifdef _OPENMP
#include <omp.h>
#endif

int cpu_threads(const nsa_context *ctx)
{
#ifdef _OPENMP
    return ctx && ctx->num_threads > 0 ? ctx->num_threads : omp_get_max_threads();
#else
    (void)ctx;
    return 1;
#endif
}

void io_load(const nsa_tensor *t, int64_t off, int64_t n, float *dst)
{
    switch (t->dtype) {
    case NSA_DTYPE_F32: memcpy(dst, (const float *)t->data + off, (size_t)n * sizeof(float)); break;
    case NSA_DTYPE_BF16: {
        const uint16_t *s = (const uint16_t *)t->data + off;
        for (int64_t i = 0; i < n; i++) dst[i] = nsa_bf16_to_f32(s[i]);
        break;
    }
    case NSA_DTYPE_F16: {
        const uint16_t *s = (const uint16_t *)t->data + off;
        for (int64_t i = 0; i < n; i++) dst[i] = nsa_f16_to_f32(s[i]);
        break;
    }
    default: /* I32 never reaches here: validation keeps float tensors float */
        for (int64_t i = 0; i < n; i++) dst[i] = (float)((const int32_t *)t->data)[off + i];
    }
}

void io_load_scaled(const nsa_tensor *t, int64_t off, int64_t n, float scale, float *dst)
{
    io_load(t, off, n, dst);
    for (int64_t i = 0; i < n; i++) dst[i] *= scale;
}

void io_store(const nsa_tensor *t, int64_t off, int64_t n, const float *src)
{
    switch (t->dtype) {
    case NSA_DTYPE_F32: memcpy((float *)t->data + off, src, (size_t)n * sizeof(float)); break;
    case NSA_DTYPE_BF16: {
        uint16_t *d = (uint16_t *)t->data + off;
        for (int64_t i = 0; i < n; i++) d[i] = nsa_f32_to_bf16(src[i]);
        break;
    }
    case NSA_DTYPE_F16: {
        uint16_t *d = (uint16_t *)t->data + off;
        for (int64_t i = 0; i < n; i++) d[i] = nsa_f32_to_f16(src[i]);
        break;
    }
    default:
        for (int64_t i = 0; i < n; i++) ((int32_t *)t->data)[off + i] = (int32_t)src[i];
    }
}

float io_get(const nsa_tensor *t, int64_t off)
{
    float v;
    io_load(t, off, 1, &v);
    return v;
}

void io_set(const nsa_tensor *t, int64_t off, float v) { io_store(t, off, 1, &v); }

void cpu_pack_heads(const nsa_context *ctx, const nsa_tensor *x, float *panel)
{
    const int64_t B = x->shape[0], R = x->shape[1], H = x->shape[2], D = x->shape[3];
    const int64_t jobs = B * H * R;
#pragma omp parallel for schedule(static) num_threads(cpu_threads(ctx))
    for (int64_t job = 0; job < jobs; job++) {
        int64_t r = job % R, h = (job / R) % H, b = job / (R * H);
        io_load(x, io_off(x, b, r, h), D, panel + ((b * H + h) * R + r) * D);
    }
}

void cpu_unpack_heads(const nsa_context *ctx, const float *panel, const nsa_tensor *x)
{
    const int64_t B = x->shape[0], R = x->shape[1], H = x->shape[2], D = x->shape[3];
    const int64_t jobs = B * H * R;
#pragma omp parallel for schedule(static) num_threads(cpu_threads(ctx))
    for (int64_t job = 0; job < jobs; job++) {
        int64_t r = job % R, h = (job / R) % H, b = job / (R * H);
        io_store(x, io_off(x, b, r, h), D, panel + ((b * H + h) * R + r) * D);
    }
}

int64_t *cpu_cmp_offsets(ws_arena *a, const nsa_problem *p)
{
    if (!p->cu_seqlens) return NULL;
    int64_t *cu = (int64_t *)ws_take_n(a, nsa_size_add(nsa_size_of(p->num_seqs), 1), sizeof(int64_t));
    if (cu) nsa_cmp_offsets(&p->cfg, p->cu_seqlens, p->num_seqs, cu);
    return cu;
}
