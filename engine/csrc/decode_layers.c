/* The decoder layers of one decode step, run in C: the same kernels, in the same order, as the
 * model's Python path (engine/model.py with engine.cpu_fused, engine.cpu_gguf and the paged
 * decode kernel), called through function pointers taken from their own libraries.
 *
 * Why: a decode step streams every weight once (96 MB for SmolLM2 in GGUF blocks), which evicts
 * the interpreter's working set from the caches. Each of the ~11 Python-side kernel calls of a
 * layer then costs 20-40 us of cache misses instead of 5 (measured here: a fused RMSNorm call,
 * 5 us alone, 47 us right after reading 3 MB). One call per step from Python replaces ~330.
 *
 * Per layer, T rows of hidden size H (residual stream h, updated in place):
 *   x = rms_norm(h); qkv = x Wqkv; rotate q and k; store k, v into their slots; o = attend(q);
 *   a = o Wo; h += a; x = rms_norm(h); g = silu(gate) * up of x Wgu; h += g Wdown.
 * h += a happens inside the norm kernel, and h += g Wdown as one float addition per element, as
 * torch's `h + mlp(x)`: the results are bit for bit the Python path's (tests/test_decode_layers.py).
 * Returns 0, or the first failing kernel's code plus 10 x its place (store 1x, attention 2x,
 * projection 3x).
 */
#include <stdint.h>

typedef int (*gemv_fn)(const float *x, int64_t xs, const void *w, int64_t ws, const float *bias, int64_t M,
                       int64_t N, int64_t K, float *y, int64_t ys, int threads);
typedef void (*rms_norm_fn)(const float *x, int64_t xs, float *residual, int64_t rs, const float *w,
                            int64_t rows, int64_t dim, float eps, float *out);
typedef void (*rotary_fn)(float *x, int64_t rows, int64_t heads, int64_t xs, int64_t D, const float *cos,
                          const float *sin, int64_t table_stride);
typedef void (*silu_mul_fn)(const float *gate_up, int64_t rows, int64_t inter, int64_t stride, float *out);
typedef int (*store_kv_fn)(const float *key, const float *value, int64_t stride, int64_t rows, int64_t width,
                           float *k_cache, float *v_cache, int64_t sN, int64_t sB, int64_t num_blocks,
                           int64_t block_size, const int64_t *blocks, const int64_t *offsets);
typedef int (*decode_fn)(const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                         int64_t sN, int64_t sB, int64_t sH, const int64_t *tables, int64_t table_stride,
                         const int64_t *lens, int64_t num, int64_t Hq, int64_t Hkv, int64_t D, int64_t B,
                         float scale, int threads, float *out);

struct pd_proj { /* one projection: y (M, N) = x (M, K) @ W^T + bias */
    gemv_fn fn;
    const void *w;
    int64_t ws; /* weight stride in the kernel's own unit (GGUF: bytes per packed group of 16 rows;
                   bf16: elements per row) */
    const float *bias;
    int64_t N, K;
};

struct pd_layer {
    const float *in_norm, *post_norm; /* (H,) each */
    struct pd_proj qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* this layer's (num_blocks, B, Hkv, D) views */
};

struct pd_model {
    int64_t num_layers, H, Hq, Hkv, D, I;
    int64_t num_blocks, B, sN, sB, sH; /* pool geometry, in floats, alike for every layer */
    float eps, scale;
    rms_norm_fn rms_norm;
    rotary_fn rotary;
    silu_mul_fn silu_mul;
    store_kv_fn store_kv;
    decode_fn decode;
    const struct pd_layer *layers;
};

struct pd_step {
    int64_t T;                       /* rows: one per decoding sequence */
    float *h;                        /* (T, H) contiguous, in and out */
    const float *cos, *sin;          /* (T, D) rows cs_stride apart, sin sign-folded (engine.rope) */
    int64_t cs_stride;
    const int64_t *blocks, *offsets; /* (T,) the slot of each row's new K/V */
    const int64_t *tables;           /* (T, table_stride) block ids */
    int64_t table_stride;
    const int64_t *lens;             /* (T,) keys per sequence after this step */
    float *scratch;                  /* pd_decode_scratch(model, T) floats */
    int threads;
};

int64_t pd_decode_scratch(const struct pd_model *m, int64_t T) {
    int64_t width = (m->Hq + 2 * m->Hkv) * m->D;
    return T * (m->H + width + m->Hq * m->D + m->H + 2 * m->I + m->I);
}

int pd_decode_layers(const struct pd_model *m, const struct pd_step *s) {
    int64_t T = s->T, H = m->H, D = m->D, width = (m->Hq + 2 * m->Hkv) * D;
    float *x = s->scratch, *qkv = x + T * H, *att = qkv + T * width, *a = att + T * m->Hq * D;
    float *gu = a + T * H, *act = gu + T * 2 * m->I;
    float *h = s->h;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const struct pd_layer *L = &m->layers[l];
        m->rms_norm(h, H, 0, 0, L->in_norm, T, H, m->eps, x);
        if (L->qkv.fn(x, H, L->qkv.w, L->qkv.ws, L->qkv.bias, T, width, H, qkv, width, s->threads))
            return 30 + 1;
        m->rotary(qkv, T, m->Hq + m->Hkv, width, D, s->cos, s->sin, s->cs_stride);
        int code = m->store_kv(qkv + m->Hq * D, qkv + (m->Hq + m->Hkv) * D, width, T, m->Hkv * D, L->k_cache,
                               L->v_cache, m->sN, m->sB, m->num_blocks, m->B, s->blocks, s->offsets);
        if (code)
            return 10 + code;
        code = m->decode(qkv, width, L->k_cache, L->v_cache, m->sN, m->sB, m->sH, s->tables, s->table_stride,
                         s->lens, T, m->Hq, m->Hkv, D, m->B, m->scale, s->threads, att);
        if (code)
            return 20 + code;
        if (L->o.fn(att, m->Hq * D, L->o.w, L->o.ws, L->o.bias, T, H, m->Hq * D, a, H, s->threads))
            return 30 + 2;
        m->rms_norm(a, H, h, H, L->post_norm, T, H, m->eps, x); /* h += a; x = norm(h) */
        if (L->gate_up.fn(x, H, L->gate_up.w, L->gate_up.ws, L->gate_up.bias, T, 2 * m->I, H, gu, 2 * m->I,
                          s->threads))
            return 30 + 3;
        m->silu_mul(gu, T, m->I, 2 * m->I, act);
        if (L->down.fn(act, m->I, L->down.w, L->down.ws, L->down.bias, T, H, m->I, a, H, s->threads))
            return 30 + 4;
        for (int64_t i = 0; i < T * H; i++)
            h[i] = h[i] + a[i];
    }
    return 0;
}
