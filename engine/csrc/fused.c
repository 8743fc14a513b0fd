/* The small elementwise steps of a float32 decoder layer on CPU, each one pass over its rows
 * instead of several torch ops: RMSNorm (optionally after adding a residual in place), rotary
 * embedding applied in place, SiLU(gate) * up, and the store of new keys and values into their
 * pool slots. Built at first use by engine/cpu_kernels.py with -ffp-contract=off, so that no
 * multiply and add are fused where torch rounds twice: the rotary and the SwiGLU product round
 * exactly as the torch ops they replace; RMSNorm sums its squares in a fixed order of its own.
 * engine/cpu_fused.py checks every shape, dtype and stride before calling.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"

/* Sum of squares of x[0..n): sixteen partial sums, a fixed tree, then the tail in order. */
static float sum_squares(const float *x, int64_t n) {
    v8 lo = {0}, hi = {0}; /* lanes 0-7 and 8-15 of the sixteen partial sums */
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
        v8 a = load8(x + d), b = load8(x + d + 8);
        lo += a * a;
        hi += b * b;
    }
    float sum = hsum8x2(lo, hi);
    for (; d < n; d++)
        sum += x[d] * x[d];
    return sum;
}

/* out[r] = y * (1 / sqrt(mean(y^2) + eps)) * w for `rows` rows of `dim` floats, y = x[r]; with a
 * residual, first residual[r] += x[r] in place and y = residual[r] (the pre-norm residual stream).
 * x and residual rows are their strides apart; out is contiguous. */
void pd_rms_norm_f32(const float *x, int64_t x_stride, float *residual, int64_t res_stride, const float *w,
                     int64_t rows, int64_t dim, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *src = x + r * x_stride;
        if (residual != NULL) {
            float *h = residual + r * res_stride;
            for (int64_t d = 0; d < dim; d++)
                h[d] += src[d];
            src = h;
        }
        float inv = 1.0f / sqrtf(sum_squares(src, dim) / (float)dim + eps);
        float *o = out + r * dim;
        for (int64_t d = 0; d < dim; d++)
            o[d] = src[d] * inv * w[d];
    }
}

/* Rotate `heads` heads of D floats in place per row: x * cos + swap_halves(x) * sin, with sin's
 * first half negated by the caller (engine.rope's folded table). Rows of x are x_stride apart,
 * heads D apart; cos and sin rows are table_stride apart, one per row of x. */
void pd_rotary_f32(float *x, int64_t rows, int64_t heads, int64_t x_stride, int64_t D, const float *cos,
                   const float *sin, int64_t table_stride) {
    enum { MAX_D = 512 };
    float tmp[MAX_D];
    int64_t half = D / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * table_stride, *s = sin + r * table_stride;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * x_stride + h * D;
            memcpy(tmp, v, (size_t)D * sizeof(float));
            for (int64_t d = 0; d < half; d++)
                v[d] = tmp[d] * c[d] + tmp[d + half] * s[d];
            for (int64_t d = half; d < D; d++)
                v[d] = tmp[d] * c[d] + tmp[d - half] * s[d];
        }
    }
}

/* out (rows, inter) = silu(gate) * up, gate and up the two halves of each gate_up row (rows
 * `stride` apart); silu(g) = g / (1 + e^-g). */
void pd_silu_mul_f32(const float *gate_up, int64_t rows, int64_t inter, int64_t stride, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * stride, *u = g + inter;
        float *o = out + r * inter;
        int64_t d = 0;
        for (; d + VN <= inter; d += VN) {
            vn x = loadn(g + d);
            storen(o + d, x / (1.0f + expn((vn){0} - x)) * loadn(u + d));
        }
        for (; d < inter; d++) { /* the tail through one vector too: the same rounding */
            vn x = (vn){0} + g[d];
            o[d] = (x / (1.0f + expn((vn){0} - x)))[0] * u[d];
        }
    }
}

/* Copy row t of key and value ((Hkv * D) floats each, rows `stride` apart) into pool block
 * blocks[t], offset offsets[t] (element (n, b) of a cache at n * sN + b * sB, each slot's
 * (Hkv, D) contiguous). Returns 0, or 1 (nothing written) if a block is not below num_blocks
 * or an offset not below block_size. */
int pd_store_kv_f32(const float *key, const float *value, int64_t stride, int64_t rows, int64_t width,
                    float *k_cache, float *v_cache, int64_t sN, int64_t sB, int64_t num_blocks,
                    int64_t block_size, const int64_t *blocks, const int64_t *offsets) {
    for (int64_t t = 0; t < rows; t++)
        if (blocks[t] < 0 || blocks[t] >= num_blocks || offsets[t] < 0 || offsets[t] >= block_size)
            return 1;
    for (int64_t t = 0; t < rows; t++) {
        int64_t at = blocks[t] * sN + offsets[t] * sB;
        memcpy(k_cache + at, key + t * stride, (size_t)width * sizeof(float));
        memcpy(v_cache + at, value + t * stride, (size_t)width * sizeof(float));
    }
    return 0;
}
