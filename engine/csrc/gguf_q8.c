/* y = x @ W^T for a few rows of x rounded to int8 blocks, W kept as a GGUF file's own Q4_1 or Q8_0
 * blocks: integer dot products, as llama.cpp computes its CPU matmuls.
 *
 * Each row of x is first rounded to blocks of 32 int8 codes with one float32 scale (llama.cpp's
 * Q8_1): dx = max |x| / 127, q = x * (1 / dx) rounded to the nearest (ties to even), and sx = dx *
 * sum(q). A weight block (d, m, nibbles w for Q4_1; d, int8 w for Q8_0) and an x block then give
 *     Q4_1: d dx (w . q) + m sx        Q8_0: d dx (w . q)
 * where w . q is an exact int32 sum of 32 products (vpdpbusd with AVX-512 VNNI or AVX-VNNI, else
 * vpmaddubsw + vpmaddwd; Q8_0 applies w's signs to q first, as llama.cpp does, so one side is
 * unsigned). The result is the float32 product of the dequantized weights with the rounded x, up to
 * float32 summation order. Against engine/csrc/gguf_gemv.c, whose x stays float32, a block costs
 * two float operations (convert, multiply-add) instead of eight to twelve: on CPUs whose float
 * units, not memory, set the pace of that kernel, this one reads the weights faster.
 *
 * Layouts (checked by engine/cpu_gguf.py): as gguf_gemv.c. OpenMP threads share groups of G_ROWS
 * weight rows; within a group, x rows go in chunks of up to 4 against tiles of R weight rows; the
 * scales of CH blocks are widened at once (one gather, then vcvtph2ps) and multiplied by x's.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32         /* weights per block */
#define Q4_1_BYTES 20 /* f16 d, f16 m, 16 bytes of nibbles */
#define Q8_0_BYTES 34 /* f16 d, 32 int8 */
#define G_ROWS 4      /* weight rows per parallel work item */
#define PF_GROUPS 4   /* prefetch distance in groups */
#define CH 16         /* blocks whose scales are widened at once */
#define UNROLL _Pragma("GCC unroll 8")

__attribute__((unused)) static float half_to_float(uint16_t h) { /* IEEE half -> float, subnormals included */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, f = h & 0x3ff, w;
    if (e == 0x1f) {
        w = sign | 0x7f800000u | (f << 13);
    } else if (e) {
        w = sign | ((e + 112) << 23) | (f << 13);
    } else if (f) {
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

/* x row (K floats) -> K int8 codes, per block dx and sx = dx * sum of codes (arrays of nb) */
static void quantize_row(const float *x, int64_t nb, int8_t *q, float *dx, float *sx) {
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int k = 0; k < QK; k++) {
            float a = xb[k] < 0 ? -xb[k] : xb[k];
            amax = a > amax || a != a ? a : amax; /* a nan sticks */
        }
        if (!(amax <= 3.4028235e38f)) { /* inf or nan in x: codes 0, scales nan, so y is nan, as the
                                         * float path gives (converting them to int is undefined) */
            memset(q + b * QK, 0, QK);
            dx[b] = sx[b] = amax - amax;
            continue;
        }
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int k = 0; k < QK; k++) {
            float v = xb[k] * id;
            /* nearest, ties to even (the default rounding mode), as torch.round */
            int32_t c = (int32_t)__builtin_nearbyintf(v);
            q[b * QK + k] = (int8_t)c;
            sum += c;
        }
        dx[b] = d;
        sx[b] = d * (float)sum;
    }
}

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_SIMD 1

static inline __m256i dot_u8s8(__m256i u, __m256i s) { /* 8 int32: sums of 4 products u8 * s8 */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else /* pairs in int16 cannot saturate: |u| <= 128, |s| <= 127, 2 * 128 * 127 < 32767 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8(__m256 v) { /* a fixed tree: halves, then pairs */
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* d (and m) of blocks b0 .. b0 + n - 1 (n <= CH) of one row as float32, zeros up to CH: one gather
 * of each block's first 4 bytes per 8 blocks, halves split and widened 8 at a time. */
static inline __m256 halves8(__m256i lo16) { /* 8 dwords, each a half in its low 16 bits */
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo16, lo16), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}
static inline void scales(const uint8_t *row, int64_t b0, int n, int bytes, float *d, float *m) {
    const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    __m256i idx = _mm256_mullo_epi32(lane, _mm256_set1_epi32(bytes));
    for (int h = 0; h < CH; h += 8) {
        __m256i dm = _mm256_setzero_si256();
        if (n > h)
            dm = _mm256_mask_i32gather_epi32(dm, (const int *)(row + (b0 + h) * bytes), idx,
                                             _mm256_cmpgt_epi32(_mm256_set1_epi32(n - h), lane), 1);
        _mm256_storeu_ps(d + h, halves8(_mm256_and_si256(dm, _mm256_set1_epi32(0xffff))));
        if (m) _mm256_storeu_ps(m + h, halves8(_mm256_srli_epi32(dm, 16)));
    }
}

/* one weight block -> 32 unsigned codes in element order, and (Q8_0) the signs to apply to x */
static inline __m256i codes_q4_1(const uint8_t *b) {
    __m128i raw = _mm_loadu_si128((const __m128i *)(b + 4)); /* byte i: element i low, 16 + i high */
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
}

/* One tile: R weight rows (at w, row stride ws bytes, nb blocks) against MM x rows (codes xq, row
 * stride K; dx, sx row stride sxs) -> sums[i * R + j]. */
#define DEFINE_TILE(NAME, Q8W, BYTES, MM, R)                                                        \
    static void NAME(const int8_t *xq, int64_t K, const float *dx, const float *sx, int64_t sxs,   \
                     const uint8_t *w, int64_t ws, int64_t nb, float *sums) {                      \
        __m256 acc[MM][R], macc[MM][R];                                                            \
        float d[R][CH], m[R][CH], dd[MM][R][CH];                                                   \
        for (int i = 0; i < MM; i++)                                                               \
            for (int j = 0; j < R; j++) acc[i][j] = macc[i][j] = _mm256_setzero_ps();              \
        for (int64_t b0 = 0; b0 < nb; b0 += CH) {                                                  \
            int n = nb - b0 < CH ? (int)(nb - b0) : CH;                                            \
            for (int j = 0; j < R; j++) scales(w + j * ws, b0, n, BYTES, d[j], Q8W ? 0 : m[j]);    \
            for (int i = 0; i < MM; i++)                                                           \
                for (int j = 0; j < R; j++)                                                        \
                    for (int c = 0; c < CH; c += 8)                                                \
                        _mm256_storeu_ps(dd[i][j] + c, _mm256_mul_ps(_mm256_loadu_ps(d[j] + c),    \
                                                                     _mm256_loadu_ps(dx + i * sxs + b0 + c))); \
            for (int k = 0; k < n; k++) {                                                          \
                int64_t b = b0 + k;                                                                \
                __m256i xv[MM];                                                                    \
                UNROLL for (int i = 0; i < MM; i++) xv[i] = _mm256_loadu_si256((const __m256i *)(xq + i * K + b * QK)); \
                UNROLL for (int j = 0; j < R; j++) {                                               \
                    const uint8_t *blk = w + j * ws + b * BYTES;                                   \
                    __builtin_prefetch(blk + PF_GROUPS * G_ROWS * ws);                             \
                    if (Q8W) {                                                                     \
                        __m256i wv = _mm256_loadu_si256((const __m256i *)(blk + 2));               \
                        __m256i u = _mm256_sign_epi8(wv, wv);                                      \
                        UNROLL for (int i = 0; i < MM; i++) acc[i][j] = _mm256_fmadd_ps(           \
                            _mm256_cvtepi32_ps(dot_u8s8(u, _mm256_sign_epi8(xv[i], wv))),          \
                            _mm256_set1_ps(dd[i][j][k]), acc[i][j]);                               \
                    } else {                                                                       \
                        __m256i u = codes_q4_1(blk);                                               \
                        UNROLL for (int i = 0; i < MM; i++) acc[i][j] = _mm256_fmadd_ps(           \
                            _mm256_cvtepi32_ps(dot_u8s8(u, xv[i])), _mm256_set1_ps(dd[i][j][k]),   \
                            acc[i][j]);                                                            \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            if (!Q8W)                                                                              \
                for (int i = 0; i < MM; i++)                                                       \
                    for (int j = 0; j < R; j++)                                                    \
                        for (int c = 0; c < CH; c += 8)                                            \
                            macc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(m[j] + c),                \
                                                         _mm256_loadu_ps(sx + i * sxs + b0 + c), macc[i][j]); \
        }                                                                                          \
        for (int i = 0; i < MM; i++)                                                               \
            for (int j = 0; j < R; j++)                                                            \
                sums[i * R + j] = Q8W ? hsum8(acc[i][j]) : hsum8(acc[i][j]) + hsum8(macc[i][j]);   \
    }
#else
#define HAVE_SIMD 0

/* portable: the same sums, one block at a time, in plain C */
#define DEFINE_TILE(NAME, Q8W, BYTES, MM, R)                                                        \
    static void NAME(const int8_t *xq, int64_t K, const float *dx, const float *sx, int64_t sxs,   \
                     const uint8_t *w, int64_t ws, int64_t nb, float *sums) {                      \
        for (int i = 0; i < MM; i++)                                                               \
            for (int j = 0; j < R; j++) {                                                          \
                float acc = 0.0f, macc = 0.0f;                                                     \
                for (int64_t b = 0; b < nb; b++) {                                                 \
                    const uint8_t *blk = w + j * ws + b * BYTES;                                   \
                    const int8_t *q = xq + i * K + b * QK;                                         \
                    uint16_t hd, hm;                                                               \
                    memcpy(&hd, blk, 2);                                                           \
                    memcpy(&hm, blk + 2, 2);                                                       \
                    int32_t dot = 0;                                                               \
                    for (int k = 0; k < QK; k++)                                                   \
                        dot += (Q8W ? (int32_t)(int8_t)blk[2 + k]                                  \
                                    : (int32_t)(k < 16 ? blk[4 + k] & 15 : blk[4 + k - 16] >> 4)) * q[k]; \
                    acc += half_to_float(hd) * dx[i * sxs + b] * (float)dot;                       \
                    if (!Q8W) macc += half_to_float(hm) * sx[i * sxs + b];                         \
                }                                                                                  \
                sums[i * R + j] = acc + macc;                                                      \
            }                                                                                      \
    }
#endif

typedef void (*tile_fn)(const int8_t *, int64_t, const float *, const float *, int64_t, const uint8_t *,
                        int64_t, int64_t, float *);

/* per format: tiles for MM = 1..4 x rows, of R = TILE_R[MM] weight rows and of 1 */
#define DEFINE_FORMAT(F, Q8W, BYTES)                                                               \
    DEFINE_TILE(F##_1x4, Q8W, BYTES, 1, 4)                                                         \
    DEFINE_TILE(F##_2x4, Q8W, BYTES, 2, 4)                                                         \
    DEFINE_TILE(F##_3x2, Q8W, BYTES, 3, 2)                                                         \
    DEFINE_TILE(F##_4x2, Q8W, BYTES, 4, 2)                                                         \
    DEFINE_TILE(F##_1x1, Q8W, BYTES, 1, 1)                                                         \
    DEFINE_TILE(F##_2x1, Q8W, BYTES, 2, 1)                                                         \
    DEFINE_TILE(F##_3x1, Q8W, BYTES, 3, 1)                                                         \
    DEFINE_TILE(F##_4x1, Q8W, BYTES, 4, 1)                                                         \
    static const tile_fn F##_tiles[5] = {0, F##_1x4, F##_2x4, F##_3x2, F##_4x2};                   \
    static const tile_fn F##_rows[5] = {0, F##_1x1, F##_2x1, F##_3x1, F##_4x1};

DEFINE_FORMAT(q4_1, 0, Q4_1_BYTES)
DEFINE_FORMAT(q8_0, 1, Q8_0_BYTES)
static const int TILE_R[5] = {0, 4, 4, 2, 2}; /* G_ROWS must be a multiple of each */

/* returns 0, or -1 when the scratch for x's codes could not be allocated (y untouched) */
static int gemv(const tile_fn *tiles, const tile_fn *rows, const float *x, int64_t xs, const uint8_t *w,
                int64_t ws, const float *bias, int64_t M, int64_t N, int64_t K, float *y, int64_t ys,
                int threads) {
    int64_t nb = K / QK, full = N / G_ROWS, groups = full + N % G_ROWS;
    int64_t sxs = (nb + CH - 1) / CH * CH; /* scales per x row, zeros up to a whole chunk */
    int8_t *xq = malloc((size_t)(M * K));
    float *dx = calloc((size_t)(2 * M * sxs), sizeof *dx), *sx = dx + M * sxs;
    if (!xq || !dx) {
        free(xq);
        free(dx);
        return -1;
    }
    for (int64_t i = 0; i < M; i++) quantize_row(x + i * xs, nb, xq + i * K, dx + i * sxs, sx + i * sxs);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = g < full ? g * G_ROWS : full * G_ROWS + (g - full);
        int r = g < full ? G_ROWS : 1;
        float sums[4 * G_ROWS];
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int mm = (int)(M - m0 < 4 ? M - m0 : 4);
            const int8_t *xm = xq + m0 * K;
            const float *dxm = dx + m0 * sxs, *sxm = sx + m0 * sxs;
            if (r == 1) {
                rows[mm](xm, K, dxm, sxm, sxs, w + n0 * ws, ws, nb, sums);
            } else { /* tiles of TILE_R[mm] rows: sums as [mm][TILE_R] per tile, laid out [mm][G_ROWS] */
                int tr = TILE_R[mm];
                for (int j0 = 0; j0 < G_ROWS; j0 += tr) {
                    float part[4 * 4];
                    tiles[mm](xm, K, dxm, sxm, sxs, w + (n0 + j0) * ws, ws, nb, part);
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
    free(xq);
    free(dx);
    return 0;
}

int pd_gemv_q4_1_q8(const float *x, int64_t xs, const uint8_t *w, int64_t ws, const float *bias, int64_t M,
                    int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    return gemv(q4_1_tiles, q4_1_rows, x, xs, w, ws, bias, M, N, K, y, ys, threads);
}

int pd_gemv_q8_0_q8(const float *x, int64_t xs, const uint8_t *w, int64_t ws, const float *bias, int64_t M,
                    int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    return gemv(q8_0_tiles, q8_0_rows, x, xs, w, ws, bias, M, N, K, y, ys, threads);
}

/* x (M, K) -> the int8 codes and block scales the kernels use (for the tests' reference) */
void pd_quantize_q8(const float *x, int64_t xs, int64_t M, int64_t K, int8_t *q, float *dx, float *sx) {
    for (int64_t i = 0; i < M; i++) quantize_row(x + i * xs, K / QK, q + i * K, dx + i * (K / QK), sx + i * (K / QK));
}

int pd_gguf_q8_simd(void) { return HAVE_SIMD; }
