/* y = x @ W^T for a few rows of x, W kept as a GGUF file's own Q4_1 or Q8_0 blocks.
 *
 * A block holds 32 consecutive weights of one row. Q4_1 (20 bytes): f16 d, f16 m, 16 bytes of
 * nibbles; byte b's low nibble is element b, its high nibble element b + 16; value = d * q + m.
 * Q8_0 (34 bytes): f16 d, 32 int8 q; value = d * q. Each block widens to 32 float32 in registers,
 * as a fused multiply-add q * d + m (Q4_1) or a product d * q (Q8_0): d * q is exact in float32
 * (11 by 4 or 8 significant bits), so each widened weight is, bit for bit, the float32 value the
 * gguf package's dequantize gives (its d * q + m rounds once, at the addition, as the FMA does).
 * x stays float32 and every product is summed in float32 (fused multiply-adds: built with
 * -ffp-contract=fast): the result is the float32 product up to summation order.
 *
 * OpenMP threads share groups of G_ROWS weight rows (the matrix's last N % G_ROWS rows go one
 * at a time). Within a group, x rows go in chunks of up to 4; a chunk of MM rows runs tiles of R
 * weight rows, each weight block widened once and used for all MM x rows, in MM x R (x A)
 * accumulators of 8 floats (AVX2: 16 ymm registers). Each block read also prefetches the same
 * block PF_GROUPS groups further on: without it the loads' latency, not the bandwidth, set the
 * pace (SmolLM2's 96 MB of blocks, 2 threads: 9.5 ms -> 6.5 ms per pass).
 *
 * Layouts (checked by engine/cpu_gguf.py): x (M, K) float32 rows with stride xs elements, K a
 * multiple of 32; W (N, K / 32 blocks) rows with stride ws bytes; bias (N,) float32 or NULL;
 * y (M, N) float32 rows with stride ys elements.
 */
#include <stdint.h>
#include <string.h>

/* natural alignment on purpose (see vec16.h): loads and stores go through memcpy */
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8x __attribute__((vector_size(32)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int8_t s8x8 __attribute__((vector_size(8)));

#define QK 32         /* weights per block */
#define Q4_1_BYTES 20 /* f16 d, f16 m, 16 bytes of nibbles */
#define Q8_0_BYTES 34 /* f16 d, 32 int8 */
#define G_ROWS 4      /* weight rows per parallel work item */
#define PF_GROUPS 4   /* prefetch distance in groups (2..8 measured alike) */
#define UNROLL _Pragma("GCC unroll 8") /* keeps the accumulators in registers */

static inline float hsum8(f8 v) { /* a fixed tree: halves, then pairs */
    float a = (v[0] + v[4]) + (v[2] + v[6]);
    float b = (v[1] + v[5]) + (v[3] + v[7]);
    return a + b;
}

#if defined(__F16C__)
#include <immintrin.h>
static inline float half_at(const uint8_t *p) { /* little-endian IEEE half at p */
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}
#else
static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, f = h & 0x3ff, w;
    if (e == 0x1f) {
        w = sign | 0x7f800000u | (f << 13); /* inf, nan */
    } else if (e) {
        w = sign | ((e + 112) << 23) | (f << 13); /* normal: rebias 15 -> 127 */
    } else if (f) {                               /* subnormal: f * 2^-24, normalised */
        e = 113;
        while (!(f & 0x400)) f <<= 1, e--;
        w = sign | (e << 23) | ((f & 0x3ff) << 13);
    } else {
        w = sign;
    }
    float out;
    memcpy(&out, &w, sizeof out);
    return out;
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
static inline f8 load_x(const float *p) { return (f8)_mm256_loadu_ps(p); }
#if defined(__FMA__)
#define MADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#else
#define MADD(a, b, c) _mm256_add_ps(_mm256_mul_ps(a, b), c) /* exact too: a * b is exact here */
#endif
/* one block -> w[0..3] = elements 0-7, 8-15, 16-23, 24-31 (vpmovzxbd / vpmovsxbd from memory) */
static inline void widen_q4_1(const uint8_t *b, f8 w[4]) {
    int32_t dm_bits; /* d and m as one 32-bit broadcast: lanes d, m, d, m, ... after vcvtph2ps */
    memcpy(&dm_bits, b, sizeof dm_bits);
    __m256 dm = _mm256_cvtph_ps(_mm_set1_epi32(dm_bits));
    __m256 d = _mm256_permute_ps(dm, 0x00), m = _mm256_permute_ps(dm, 0x55);
    __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 4)));  /* bytes 0-7 */
    __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 12))); /* bytes 8-15 */
    __m256i mask = _mm256_set1_epi32(15);
    w[0] = (f8)MADD(_mm256_cvtepi32_ps(_mm256_and_si256(lo, mask)), d, m);
    w[1] = (f8)MADD(_mm256_cvtepi32_ps(_mm256_and_si256(hi, mask)), d, m);
    w[2] = (f8)MADD(_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), d, m);
    w[3] = (f8)MADD(_mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), d, m);
}

static inline void widen_q8_0(const uint8_t *b, f8 w[4]) {
    int16_t d_bits;
    memcpy(&d_bits, b, sizeof d_bits);
    __m256 d = _mm256_cvtph_ps(_mm_set1_epi16(d_bits));
    for (int i = 0; i < 4; i++)
        w[i] = (f8)_mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i)))), d);
}
#else
static inline f8 load_x(const float *p) {
    f8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void widen_q4_1(const uint8_t *b, f8 w[4]) {
    float d = half_at(b), m = half_at(b + 2);
    u8x8 lo, hi;
    memcpy(&lo, b + 4, sizeof lo);
    memcpy(&hi, b + 12, sizeof hi);
    i8x l = __builtin_convertvector(lo, i8x), h = __builtin_convertvector(hi, i8x);
    w[0] = __builtin_convertvector(l & 15, f8) * d + m;
    w[1] = __builtin_convertvector(h & 15, f8) * d + m;
    w[2] = __builtin_convertvector(l >> 4, f8) * d + m;
    w[3] = __builtin_convertvector(h >> 4, f8) * d + m;
}

static inline void widen_q8_0(const uint8_t *b, f8 w[4]) {
    float d = half_at(b);
    for (int i = 0; i < 4; i++) {
        s8x8 q;
        memcpy(&q, b + 2 + 8 * i, sizeof q);
        w[i] = __builtin_convertvector(__builtin_convertvector(q, i8x), f8) * d;
    }
}
#endif

/* One tile: R weight rows (at w, row stride ws bytes, nb blocks each) against MM x rows (at x,
 * row stride xs); sums[i * R + j] = x row i . weight row j. A accumulators per pair, taking a
 * block's 8-wide slices in turn (A = 2 for one x row: 2 R independent sums in flight). */
#define DEFINE_TILE(NAME, WIDEN, BYTES, MM, R, A)                                                   \
    static void NAME(const float *x, int64_t xs, const uint8_t *w, int64_t ws, int64_t nb,         \
                     float *sums) {                                                                \
        f8 acc[MM][R][A];                                                                          \
        for (int i = 0; i < MM; i++)                                                               \
            for (int j = 0; j < R; j++)                                                            \
                for (int a = 0; a < A; a++) acc[i][j][a] = (f8){0};                                \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            UNROLL for (int j = 0; j < R; j++) {                                                   \
                f8 wv[4];                                                                          \
                __builtin_prefetch(w + (j + PF_GROUPS * G_ROWS) * ws + b * BYTES);                 \
                WIDEN(w + j * ws + b * BYTES, wv);                                                 \
                UNROLL for (int i = 0; i < MM; i++) {                                              \
                    const float *xb = x + i * xs + b * QK;                                         \
                    UNROLL for (int c = 0; c < 4; c++) acc[i][j][c % A] += load_x(xb + 8 * c) * wv[c]; \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MM; i++)                                                               \
            for (int j = 0; j < R; j++) {                                                          \
                f8 s = acc[i][j][0];                                                               \
                for (int a = 1; a < A; a++) s += acc[i][j][a];                                     \
                sums[i * R + j] = hsum8(s);                                                        \
            }                                                                                      \
    }

typedef void (*tile_fn)(const float *, int64_t, const uint8_t *, int64_t, int64_t, float *);

/* per format: tiles for MM = 1..4 x rows, of R = TILE_R[MM] weight rows and of 1 */
#define DEFINE_FORMAT(F, WIDEN, BYTES)                                                              \
    DEFINE_TILE(F##_1x4, WIDEN, BYTES, 1, 4, 2)                                                    \
    DEFINE_TILE(F##_2x4, WIDEN, BYTES, 2, 4, 1)                                                    \
    DEFINE_TILE(F##_3x2, WIDEN, BYTES, 3, 2, 1)                                                    \
    DEFINE_TILE(F##_4x2, WIDEN, BYTES, 4, 2, 1)                                                    \
    DEFINE_TILE(F##_1x1, WIDEN, BYTES, 1, 1, 2)                                                    \
    DEFINE_TILE(F##_2x1, WIDEN, BYTES, 2, 1, 1)                                                    \
    DEFINE_TILE(F##_3x1, WIDEN, BYTES, 3, 1, 1)                                                    \
    DEFINE_TILE(F##_4x1, WIDEN, BYTES, 4, 1, 1)                                                    \
    static const tile_fn F##_tiles[5] = {0, F##_1x4, F##_2x4, F##_3x2, F##_4x2};                   \
    static const tile_fn F##_rows[5] = {0, F##_1x1, F##_2x1, F##_3x1, F##_4x1};

DEFINE_FORMAT(q4_1, widen_q4_1, Q4_1_BYTES)
DEFINE_FORMAT(q8_0, widen_q8_0, Q8_0_BYTES)
static const int TILE_R[5] = {0, 4, 4, 2, 2}; /* G_ROWS must be a multiple of each */

static void gemv(const tile_fn *tiles, const tile_fn *rows, const float *x, int64_t xs, const uint8_t *w,
                 int64_t ws, const float *bias, int64_t M, int64_t N, int64_t K, float *y, int64_t ys,
                 int threads) {
    int64_t nb = K / QK, full = N / G_ROWS, groups = full + N % G_ROWS;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = g < full ? g * G_ROWS : full * G_ROWS + (g - full);
        int r = g < full ? G_ROWS : 1;
        float sums[4 * G_ROWS];
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int mm = (int)(M - m0 < 4 ? M - m0 : 4);
            const float *xm = x + m0 * xs;
            if (r == 1) {
                rows[mm](xm, xs, w + n0 * ws, ws, nb, sums);
            } else { /* tiles of TILE_R[mm] rows: sums as [mm][TILE_R] per tile, laid out [mm][G_ROWS] */
                int tr = TILE_R[mm];
                for (int j0 = 0; j0 < G_ROWS; j0 += tr) {
                    float part[4 * 4];
                    tiles[mm](xm, xs, w + (n0 + j0) * ws, ws, nb, part);
                    for (int i = 0; i < mm; i++)
                        for (int j = 0; j < tr; j++) sums[i * G_ROWS + j0 + j] = part[i * tr + j];
                }
            }
            for (int i = 0; i < mm; i++)
                for (int j = 0; j < r; j++) {
                    float s = sums[i * r + j];
                    y[(m0 + i) * ys + n0 + j] = bias ? s + bias[n0 + j] : s;
                }
        }
    }
}

/* both return 0 (the signature engine/csrc/decode_layers.c calls projections with) */
int pd_gemv_q4_1(const float *x, int64_t xs, const uint8_t *w, int64_t ws, const float *bias, int64_t M,
                 int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    gemv(q4_1_tiles, q4_1_rows, x, xs, w, ws, bias, M, N, K, y, ys, threads);
    return 0;
}

int pd_gemv_q8_0(const float *x, int64_t xs, const uint8_t *w, int64_t ws, const float *bias, int64_t M,
                 int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    gemv(q8_0_tiles, q8_0_rows, x, xs, w, ws, bias, M, N, K, y, ys, threads);
    return 0;
}
