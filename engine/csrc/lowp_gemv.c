/* y = x @ W^T for a few rows of x, W stored in fewer bytes: bf16 or int8 (per-row scale).
 *
 * Decode steps multiply 1..32 activation rows by every weight: the time is reading W. With W in
 * bf16 (2 bytes) or int8 (1 byte) instead of float32, a step reads 2x or 4x fewer bytes. Each
 * weight element widens to float32 in registers (bf16: zero-extend to 32 bits and shift left 16,
 * exactly the float whose top half it is; int8: sign-extend and convert) and every product is
 * summed in float32 (fused multiply-adds: built with -ffp-contract=fast). int8 rows are multiplied
 * by their scale once, after the dot product. OpenMP threads share the output rows; each thread
 * takes R_TILE weight rows at a time and runs every x row against them while they sit in L1, in
 * M_TILE x R_TILE accumulators of 8 floats (AVX2: 16 ymm registers hold 8 accumulators, 4 weight
 * vectors and the x vector). The tail of K past a multiple of 8 is summed in scalar code.
 *
 * Layouts (checked by engine/cpu_lowp.py): x (M, K) float32 rows with stride xs; W (N, K) rows
 * with stride ws elements; scale (N,) float32 (int8 only); bias (N,) float32 or NULL; y (M, N)
 * float32 rows with stride ys.
 */
#include <stdint.h>
#include <string.h>

/* natural alignment on purpose (see vec16.h): loads and stores go through memcpy */
typedef float f8 __attribute__((vector_size(32)));
typedef uint32_t u8x __attribute__((vector_size(32)));
typedef int32_t i8x __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef int8_t s8x8 __attribute__((vector_size(8)));

#define R_TILE 4 /* weight rows per tile */
#define M_TILE 2 /* x rows per pass over a tile */

static inline f8 load_x(const float *p) {
    f8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__AVX2__)
#include <immintrin.h>
/* AVX2: one vpmovzxwd / vpmovsxbd from memory, then a shift or a convert (the generic forms
 * below compile to split 128-bit sequences, measured 3x slower for int8) */
static inline f8 widen_bf16(const uint16_t *p) { /* 8 bf16 -> 8 float32, exact */
    __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return (f8)_mm256_castsi256_ps(w);
}

static inline f8 widen_int8(const int8_t *p) { /* 8 int8 -> 8 float32, exact */
    return (f8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
static inline f8 widen_bf16(const uint16_t *p) {
    u16x8 h;
    memcpy(&h, p, sizeof h);
    u8x w = __builtin_convertvector(h, u8x) << 16;
    f8 f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline f8 widen_int8(const int8_t *p) {
    s8x8 b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, i8x), f8);
}
#endif

static inline float bf16_to_float(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline float hsum8(f8 v) { /* a fixed tree: halves, then pairs */
    float a = (v[0] + v[4]) + (v[2] + v[6]);
    float b = (v[1] + v[5]) + (v[3] + v[7]);
    return a + b;
}

/* One tile: R weight rows (at w, row stride ws) against MM x rows (at x, row stride xs), both
 * compile-time constants so the MM x R accumulators stay in registers; sums[i * R + j] gets
 * x row i . weight row j. The widening is the only difference between the formats. */
#define DEFINE_TILE(NAME, WT, WIDEN, SCALAR, MM, R)                                                 \
    static inline void NAME(const float *x, int64_t xs, const WT *w, int64_t ws, int64_t K,        \
                            float *sums) {                                                         \
        f8 acc[MM][R];                                                                             \
        for (int i = 0; i < MM; i++)                                                               \
            for (int j = 0; j < R; j++) acc[i][j] = (f8){0};                                       \
        int64_t k = 0;                                                                             \
        for (; k + 8 <= K; k += 8) {                                                               \
            f8 wv[R];                                                                              \
            for (int j = 0; j < R; j++) wv[j] = WIDEN(w + j * ws + k);                             \
            for (int i = 0; i < MM; i++) {                                                         \
                f8 xv = load_x(x + i * xs + k);                                                    \
                for (int j = 0; j < R; j++) acc[i][j] += xv * wv[j];                               \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MM; i++)                                                               \
            for (int j = 0; j < R; j++) {                                                          \
                float s = hsum8(acc[i][j]);                                                        \
                for (int64_t t = k; t < K; t++) s += x[i * xs + t] * SCALAR(w[j * ws + t]);        \
                sums[i * R + j] = s;                                                               \
            }                                                                                      \
    }

/* The one-row tile: two accumulators per weight row (k and k + 8 in turn) so that eight
 * independent sums, not four, hide the latency of the fused multiply-adds. */
#define DEFINE_TILE1(NAME, WT, WIDEN, SCALAR, R)                                                    \
    static inline void NAME(const float *x, int64_t xs, const WT *w, int64_t ws, int64_t K,        \
                            float *sums) {                                                         \
        (void)xs;                                                                                  \
        f8 acc[2][R];                                                                              \
        for (int j = 0; j < R; j++) acc[0][j] = acc[1][j] = (f8){0};                               \
        int64_t k = 0;                                                                             \
        for (; k + 16 <= K; k += 16) {                                                             \
            f8 x0 = load_x(x + k), x1 = load_x(x + k + 8);                                         \
            for (int j = 0; j < R; j++) {                                                          \
                acc[0][j] += x0 * WIDEN(w + j * ws + k);                                           \
                acc[1][j] += x1 * WIDEN(w + j * ws + k + 8);                                       \
            }                                                                                      \
        }                                                                                          \
        for (; k + 8 <= K; k += 8) {                                                               \
            f8 x0 = load_x(x + k);                                                                 \
            for (int j = 0; j < R; j++) acc[0][j] += x0 * WIDEN(w + j * ws + k);                   \
        }                                                                                          \
        for (int j = 0; j < R; j++) {                                                              \
            float s = hsum8(acc[0][j] + acc[1][j]);                                                \
            for (int64_t t = k; t < K; t++) s += x[t] * SCALAR(w[j * ws + t]);                     \
            sums[j] = s;                                                                           \
        }                                                                                          \
    }

#define INT8_SCALAR(v) ((float)(v))
DEFINE_TILE(bf16_2x4, uint16_t, widen_bf16, bf16_to_float, 2, 4)
DEFINE_TILE1(bf16_1x4, uint16_t, widen_bf16, bf16_to_float, 4)
DEFINE_TILE(bf16_1x1, uint16_t, widen_bf16, bf16_to_float, 1, 1)
DEFINE_TILE(int8_2x4, int8_t, widen_int8, INT8_SCALAR, 2, 4)
DEFINE_TILE1(int8_1x4, int8_t, widen_int8, INT8_SCALAR, 4)
DEFINE_TILE(int8_1x1, int8_t, widen_int8, INT8_SCALAR, 1, 1)

/* format 0: bf16 (w points at uint16 bits), 1: int8 (w at int8, scale required). Full tiles of
 * R_TILE rows, then the last N % R_TILE rows one at a time (x rows likewise by M_TILE, then 1). */
static void gemv(int format, const float *x, int64_t xs, const void *w, int64_t ws, const float *scale,
                 const float *bias, int64_t M, int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    int64_t full = N / R_TILE, tiles = full + N % R_TILE;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n0 = t < full ? t * R_TILE : full * R_TILE + (t - full);
        int r = t < full ? R_TILE : 1;
        const uint16_t *wb = (const uint16_t *)w + n0 * ws;
        const int8_t *wq = (const int8_t *)w + n0 * ws;
        float sums[M_TILE * R_TILE];
        for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
            int mm = (int)(M - m0 < M_TILE ? M - m0 : M_TILE);
            const float *xm = x + m0 * xs;
            for (int i = 0; i < mm; i++) {
                if (r == 1) {
                    if (format == 0) bf16_1x1(xm + i * xs, xs, wb, ws, K, sums + i * r);
                    else int8_1x1(xm + i * xs, xs, wq, ws, K, sums + i * r);
                } else if (mm == M_TILE) {
                    if (format == 0) bf16_2x4(xm, xs, wb, ws, K, sums);
                    else int8_2x4(xm, xs, wq, ws, K, sums);
                    break;
                } else {
                    if (format == 0) bf16_1x4(xm + i * xs, xs, wb, ws, K, sums + i * r);
                    else int8_1x4(xm + i * xs, xs, wq, ws, K, sums + i * r);
                }
            }
            for (int i = 0; i < mm; i++)
                for (int j = 0; j < r; j++) {
                    float s = scale ? sums[i * r + j] * scale[n0 + j] : sums[i * r + j];
                    y[(m0 + i) * ys + n0 + j] = bias ? s + bias[n0 + j] : s;
                }
        }
    }
}

/* returns 0: the projection signature engine/csrc/decode_layers.c calls */
int pd_gemv_bf16(const float *x, int64_t xs, const uint16_t *w, int64_t ws, const float *bias, int64_t M,
                 int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    gemv(0, x, xs, w, ws, NULL, bias, M, N, K, y, ys, threads);
    return 0;
}

void pd_gemv_int8(const float *x, int64_t xs, const int8_t *w, int64_t ws, const float *scale, const float *bias,
                  int64_t M, int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    gemv(1, x, xs, w, ws, scale, bias, M, N, K, y, ys, threads);
}
