/* y = x @ W^T for a few rows of x, W kept as a GGUF file's own Q4_1 or Q8_0 blocks, packed
 * sixteen rows at a time so that one vector lane is one weight row.
 *
 * A GGUF block holds 32 consecutive weights of one row. Q4_1 (20 bytes): f16 d, f16 m, 16 bytes of
 * nibbles; byte p's low nibble is element p, its high nibble element p + 16; value = d * q + m.
 * Q8_0 (34 bytes): f16 d, 32 int8 q; value = d * q. engine/cpu_gguf.py `pack` moves the same
 * bytes, for each group of 16 rows (the last one padded with zero blocks) and each block column
 * b, into one group-block:
 *   Q4_1 (320 bytes): the 16 rows' d (16 f16), their m (16 f16), then for p = 0..15 the 16 rows'
 *        byte p (16 bytes each: lane r is row r);
 *   Q8_0 (544 bytes): the 16 rows' d (16 f16), then for k = 0..31 the 16 rows' code k.
 * A group's blocks follow each other, and groups follow each other: one matrix is one
 * front-to-back stream. Each weight widens in a vector lane, as a fused multiply-add q * d + m
 * (Q4_1) or a product d * q (Q8_0): d * q is exact in float32 (11 by 4 or 8 significant bits), so
 * each widened weight is, bit for bit, the float32 value the gguf package's dequantize gives (its
 * d * q + m rounds once, at the addition, as the FMA does). x stays float32, each x element is
 * broadcast to all lanes, and every product is summed in float32 (fused multiply-adds: built
 * with -ffp-contract=fast): the result is the float32 product up to summation order.
 *
 * Why rows in lanes (2026-12-02, one Zen 5 core, a 1536 x 576 matrix from cache): with a row's 32
 * weights across the lanes, each block needed its d and m broadcast, 8 widening steps and a
 * horizontal sum per row, 2.05 ns a block-row (1.40 with 16-lane AVX-512 widening); with rows in
 * lanes, d and m load as vectors, a block costs 1 widening step per 16 weights, nothing is summed
 * across lanes, and it takes 0.92 ns (8 vector instructions per 32 weights of a row instead of
 * 22; the AVX2 build: 2.41 -> 1.79 ns). Under AVX-512 a Q4_1 code becomes a float by vpermps from
 * the table 0..15 (it reads only an index's low 4 bits: no mask); elsewhere by mask and convert.
 *
 * OpenMP threads share the groups. x rows go in chunks of up to 4; every widened weight serves
 * the chunk's rows, with CH accumulators per row and nibble half (8 chains of fused multiply-adds
 * in flight for one row). Chunks of 8 under AVX-512 measured the same at 8 rows: there the
 * multiply-adds with x set the pace, not the widening. Each vector covers VLEN rows of a group (16 with AVX-512, else 8: a
 * group then takes two passes over its blocks).
 *
 * Layouts (checked by engine/cpu_gguf.py): x (M, K) float32 rows with stride xs elements, K a
 * multiple of 32; W packed as above, ws = bytes per group (K / 32 group-blocks); bias (N,) float32
 * or NULL; y (M, N) float32 rows with stride ys elements.
 */
#include <stdint.h>
#include <string.h>

#define QK 32      /* weights per block */
#define GROUP 16   /* rows per group: lanes of one packed block */
#define PF_BYTES 8192 /* prefetch distance: 1.2 -> 1.1 ns a block-row over DRAM (0.64..16 KiB tried) */
#define UNROLL _Pragma("GCC unroll 16") /* keeps the accumulators in registers */

#if defined(__AVX512F__) && defined(__F16C__)
#define VLEN 16
#else
#define VLEN 8
#endif
typedef float fv __attribute__((vector_size(4 * VLEN)));
typedef int32_t iv __attribute__((vector_size(4 * VLEN)));
typedef uint8_t u8v __attribute__((vector_size(VLEN)));
typedef int8_t s8v __attribute__((vector_size(VLEN)));

#if VLEN == 16
#include <immintrin.h>
/* VLEN bytes, zero- or sign-extended to int32 lanes (GCC scalarises __builtin_convertvector here) */
static inline iv load_u8(const uint8_t *p) { return (iv)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline iv load_s8(const uint8_t *p) { return (iv)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
#elif defined(__AVX2__)
#include <immintrin.h>
static inline iv load_u8(const uint8_t *p) { return (iv)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline iv load_s8(const uint8_t *p) { return (iv)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#else
static inline iv load_u8(const uint8_t *p) {
    u8v b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, iv);
}

static inline iv load_s8(const uint8_t *p) {
    s8v b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, iv);
}
#endif

#if defined(__F16C__)
#include <immintrin.h>
static inline fv load_halves(const uint8_t *p) { /* VLEN little-endian IEEE halves -> float32 */
#if VLEN == 16
    return (fv)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#else
    return (fv)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#endif
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

static inline fv load_halves(const uint8_t *p) {
    fv v;
    for (int i = 0; i < VLEN; i++) v[i] = half_at(p + 2 * i);
    return v;
}
#endif

/* low and high nibbles of zero-extended bytes, as floats 0..15 */
#if VLEN == 16
static inline fv nibbles_lo(iv q) {
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return (fv)_mm512_permutexvar_ps((__m512i)q, values);
}
static inline fv nibbles_hi(iv q) { return nibbles_lo(q >> 4); }
#else
static inline fv nibbles_lo(iv q) { return __builtin_convertvector(q & 15, fv); }
static inline fv nibbles_hi(iv q) { return __builtin_convertvector(q >> 4, fv); }
#endif

/* out[i] = the sum of x row i's 2 * ch accumulators (acc as [mm][2][ch]), in a fixed order */
static inline void fold(int mm, int ch, const fv *acc, fv *out) {
    for (int i = 0; i < mm; i++) {
        const fv *a = acc + i * 2 * ch;
        fv s = a[0] + a[ch];
        for (int c = 1; c < ch; c++) s += a[c] + a[ch + c];
        out[i] = s;
    }
}

/* One pass over a group's nb blocks for MM x rows (at x, stride xs) and the VLEN lanes starting at
 * lane h * VLEN: out[i] = x row i . those rows. CH accumulators per x row and half of a block. */
#define DEFINE_Q4_1(NAME, MM, CH)                                                                  \
    static void NAME(const float *x, int64_t xs, const uint8_t *w, int64_t nb, int h, fv *out) {  \
        fv acc[MM][2][CH] = {{{{0}}}};                                                             \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            const uint8_t *o = w + b * (GROUP * 20);                                               \
            UNROLL for (int l = 0; l < GROUP * 20; l += 64) __builtin_prefetch(o + PF_BYTES + l);   \
            fv d = load_halves(o + 2 * VLEN * h), m = load_halves(o + 32 + 2 * VLEN * h);          \
            const float *xb = x + b * QK;                                                          \
            UNROLL for (int p = 0; p < 16; p++) {                                                  \
                iv q = load_u8(o + 64 + 16 * p + VLEN * h);                                        \
                fv lo = nibbles_lo(q) * d + m, hi = nibbles_hi(q) * d + m;                         \
                UNROLL for (int i = 0; i < MM; i++) {                                              \
                    acc[i][0][p % CH] += lo * xb[i * xs + p];                                      \
                    acc[i][1][p % CH] += hi * xb[i * xs + 16 + p];                                 \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        fold(MM, CH, &acc[0][0][0], out);                                                          \
    }

#define DEFINE_Q8_0(NAME, MM, CH)                                                                  \
    static void NAME(const float *x, int64_t xs, const uint8_t *w, int64_t nb, int h, fv *out) {  \
        fv acc[MM][2][CH] = {{{{0}}}};                                                             \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            const uint8_t *o = w + b * (GROUP * 34);                                               \
            UNROLL for (int l = 0; l < GROUP * 34; l += 64) __builtin_prefetch(o + PF_BYTES + l);   \
            fv d = load_halves(o + 2 * VLEN * h);                                                  \
            const float *xb = x + b * QK;                                                          \
            UNROLL for (int k = 0; k < QK; k++) {                                                  \
                fv wk = __builtin_convertvector(load_s8(o + 32 + 16 * k + VLEN * h), fv) * d;       \
                UNROLL for (int i = 0; i < MM; i++) acc[i][k & 1][(k >> 1) % CH] += wk * xb[i * xs + k]; \
            }                                                                                      \
        }                                                                                          \
        fold(MM, CH, &acc[0][0][0], out);                                                          \
    }

typedef void (*pass_fn)(const float *, int64_t, const uint8_t *, int64_t, int, fv *);

/* per format: passes for MM = 1..4 x rows (8, 8, 6 and 8 chains in flight) */
#define DEFINE_FORMAT(F, DEFINE)                                                                    \
    DEFINE(F##_1, 1, 4)                                                                            \
    DEFINE(F##_2, 2, 2)                                                                            \
    DEFINE(F##_3, 3, 1)                                                                            \
    DEFINE(F##_4, 4, 1)                                                                            \
    static const pass_fn F##_passes[5] = {0, F##_1, F##_2, F##_3, F##_4};

DEFINE_FORMAT(q4_1, DEFINE_Q4_1)
DEFINE_FORMAT(q8_0, DEFINE_Q8_0)

static void gemv(const pass_fn *passes, const float *x, int64_t xs, const uint8_t *w, int64_t ws,
                 const float *bias, int64_t M, int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    int64_t nb = K / QK, groups = (N + GROUP - 1) / GROUP;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = g * GROUP;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int mm = (int)(M - m0 < 4 ? M - m0 : 4);
            for (int h = 0; h < GROUP / VLEN; h++) {
                fv sums[4];
                passes[mm](x + m0 * xs, xs, w + g * ws, nb, h, sums);
                for (int i = 0; i < mm; i++)
                    for (int l = 0; l < VLEN; l++) {
                        int64_t n = n0 + h * VLEN + l;
                        if (n < N) /* the last group's padding rows are computed, never stored */
                            y[(m0 + i) * ys + n] = bias ? sums[i][l] + bias[n] : sums[i][l];
                    }
            }
        }
    }
}

/* both return 0 (the signature engine/csrc/decode_layers.c calls projections with) */
int pd_gemv_q4_1(const float *x, int64_t xs, const uint8_t *w, int64_t ws, const float *bias, int64_t M,
                 int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    gemv(q4_1_passes, x, xs, w, ws, bias, M, N, K, y, ys, threads);
    return 0;
}

int pd_gemv_q8_0(const float *x, int64_t xs, const uint8_t *w, int64_t ws, const float *bias, int64_t M,
                 int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    gemv(q8_0_passes, x, xs, w, ws, bias, M, N, K, y, ys, threads);
    return 0;
}
