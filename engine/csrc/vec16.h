/* Sixteen floats as one vector, for the CPU kernels in this directory.
 *
 * GCC/Clang vector extensions: one AVX-512 register where the CPU has them, pairs or quads of
 * narrower registers elsewhere; the order of every sum written with these is the same either
 * way, so a kernel's results do not depend on the vector width it was compiled for.
 *
 * `vn` is the widest vector the CPU holds in one register (v16 with AVX-512, else v8), with
 * loadn/storen/selectn/expn: elementwise loops use it. Without AVX-512, GCC 12 keeps v16
 * variables in memory (store-forwarding stalls: the decode kernel 3.6x and SwiGLU 5x slower
 * than with 8-wide code), so sums that must keep a v16's lane order are written as two v8
 * halves (`hsum8x2`).
 *
 * The types keep their natural alignment: memory is only ever read and written through memcpy
 * (load16/store16), which takes any address. Declared under-aligned (`aligned(4)`, as they were
 * until 2026-12), GCC 12 with AVX-512 kept every vector variable in memory rather than in
 * registers: on an AVX-512 Xeon the paged decode kernel ran 7.8x slower (2.0 against 15.8 GB/s of
 * K/V), and a bare multiply-add loop 18x slower; without AVX-512 the cost was about 1.3x.
 */
#ifndef PD_VEC16_H
#define PD_VEC16_H

#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v16 load16(const float *p) {
    v16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store16(float *p, v16 x) { memcpy(p, &x, sizeof x); }

static inline v8 load8(const float *p) {
    v8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store8(float *p, v8 x) { memcpy(p, &x, sizeof x); }

static inline v16 select16(i16 mask, v16 a, v16 b) { /* a where mask is set, else b */
    return (v16)(((i16)a & mask) | ((i16)b & ~mask));
}

static inline v8 select8(i8v mask, v8 a, v8 b) {
    return (v8)(((i8v)a & mask) | ((i8v)b & ~mask));
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define PD_HAVE_SHUFFLE 1
#define PD_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PD_HAVE_SHUFFLE 0
#endif

/* hsum16 of the vector whose lanes 0-7 are lo and 8-15 are hi: a fixed tree, halves, quarters,
 * then four lanes (in registers: through memcpy it went via the stack, 5x slower under AVX2) */
static inline float hsum8x2(v8 lo, v8 hi) {
    v8 a = lo + hi;
#if PD_HAVE_SHUFFLE
    v4 b = PD_SHUFFLE(a, a, 0, 1, 2, 3) + PD_SHUFFLE(a, a, 4, 5, 6, 7);
#else
    v4 l4, h4;
    memcpy(&l4, &a, sizeof l4);
    memcpy(&h4, (const char *)&a + sizeof l4, sizeof h4);
    v4 b = l4 + h4;
#endif
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float hsum16(v16 x) {
#if PD_HAVE_SHUFFLE
    return hsum8x2(PD_SHUFFLE(x, x, 0, 1, 2, 3, 4, 5, 6, 7), PD_SHUFFLE(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
#else
    v8 lo, hi;
    memcpy(&lo, &x, sizeof lo);
    memcpy(&hi, (const char *)&x + sizeof lo, sizeof hi);
    return hsum8x2(lo, hi);
#endif
}

#if PD_HAVE_SHUFFLE
/* The sixteen lane sums of x[0..15], lane j for x[j], in hsum16's tree order (so the same bits):
 * fold lanes l and l + 8, then l and l + 4, l and l + 2, l and l + 1, two vectors at a time. */
static inline v16 fold16(const v16 x[16]) {
    v16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* x[2i]'s eight half sums in lanes 0-7, x[2i+1]'s in 8-15 */
        a[i] = PD_SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               PD_SHUFFLE(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* four lanes per vector of x */
        b[i] = PD_SHUFFLE(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               PD_SHUFFLE(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* two */
        c[i] = PD_SHUFFLE(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               PD_SHUFFLE(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return PD_SHUFFLE(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) + /* one */
           PD_SHUFFLE(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#endif

/* e^x for x <= 88.3: x = n ln2 + r with n = round(x / ln2), a degree-6 polynomial for e^r
 * (Cephes' expf coefficients, about 1 ulp), 2^n from the exponent bits. Below -87.3 (where e^x
 * leaves the normal floats), -inf included, it gives 0. exp##W: e^x for any x, and +inf above
 * 88.3 (e^x within 2x of the largest float). Defined per width W (lane by lane, the same bits). */
#define PD_DEFINE_EXP(VF, VI, W)                                                                   \
    static inline VF exp##W##_nonpositive(VF x) {                                                 \
        const VF low = (VF){0} - 87.3f;                                                            \
        VI tiny = x < low;                                                                         \
        x = select##W(tiny, low, x);                                                               \
        const float magic = 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds */        \
        VF n = (x * 1.44269504088896341f + magic) - magic;                                         \
        VF r = x - n * 0.693359375f;                                                               \
        r = r + n * 2.12194440e-4f;                                                                \
        VF p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                            \
        p = p * r + 8.3334519073e-3f;                                                              \
        p = p * r + 4.1665795894e-2f;                                                              \
        p = p * r + 1.6666665459e-1f;                                                              \
        p = p * r + 5.0000001201e-1f;                                                              \
        VF y = p * r * r + r + 1.0f;                                                               \
        VI two_n = (__builtin_convertvector(n, VI) + 127) << 23;                                   \
        return (VF)((VI)(y * (VF)two_n) & ~tiny);                                                  \
    }                                                                                              \
    static inline VF exp##W(VF x) {                                                                \
        const VF high = (VF){0} + 88.3f;                                                           \
        VI huge = x > high;                                                                        \
        VF y = exp##W##_nonpositive(select##W(huge, high, x));                                     \
        return select##W(huge, (VF){0} + __builtin_inff(), y);                                     \
    }

PD_DEFINE_EXP(v16, i16, 16)
PD_DEFINE_EXP(v8, i8v, 8)

#if defined(__AVX512F__)
typedef v16 vn;
typedef i16 in;
#define VN 16
#define loadn load16
#define storen store16
#define selectn select16
#define expn exp16
#define expn_nonpositive exp16_nonpositive
#else
typedef v8 vn;
typedef i8v in;
#define VN 8
#define loadn load8
#define storen store8
#define selectn select8
#define expn exp8
#define expn_nonpositive exp8_nonpositive
#endif

#endif
