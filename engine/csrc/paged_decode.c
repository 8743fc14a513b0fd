/* Paged decode attention for CPU in float32: one query per sequence, keys and values read in
 * place from the paged KV pool through each sequence's block table.
 *
 * Built at first use by engine/cpu_kernels.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes with tensors' data pointers; engine/cpu_attention.py checks every shape, dtype
 * and stride first. For each (sequence, kv head) it scores the G = Hq / Hkv query heads of that
 * kv head, one after another, against the sequence's keys (the first pass brings them into
 * cache), takes an exact softmax (max subtracted, float32 sums), then sums the values weighted by
 * it. Work is proportional to the keys each sequence actually has: no padding to the longest
 * sequence, no copy of the history. With AVX-512, keys are scored sixteen at a time, their
 * sixteen partial-sum vectors folded together (vec16.h's fold16, in hsum16's order); without it,
 * four at a time in 8-float halves (hsum8x2, the same order), since 16-float vectors would live
 * in memory there. (sequence, kv head) pairs are independent and split across `threads` OpenMP
 * threads, on torch's own OpenMP runtime (the same soname, loaded once); each pair's arithmetic
 * is the same whatever the thread count or vector width, so results depend on neither.
 * (Measured and not kept: one task per sequence reading each block once for all heads, 10-20%
 * slower in the engine; fused multiply-adds, no faster: the kernel waits on memory.)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

/* Ask for `rows` rows of D floats, `stride` apart, ahead of their use: a sequence's blocks lie
 * anywhere in the pool, so the hardware prefetchers start over at every block. */
static inline void prefetch_rows(const float *p, int64_t rows, int64_t stride, int64_t D) {
    for (int64_t j = 0; j < rows; j++)
        for (int64_t d = 0; d < D; d += 16)
            __builtin_prefetch(p + j * stride + d);
}

/* One (sequence, kv head), D a multiple of 16: q (G, D) rows `q_head_stride` apart, `len` keys
 * through `table`; writes out (G, D) rows D apart. scores: len floats (+ 15 spare). */
static inline __attribute__((always_inline)) void attend(
        const float *q, int64_t q_head_stride, const float *k_cache, const float *v_cache, int64_t sN,
        int64_t sB, int64_t head_offset, const int64_t *table, int64_t len, int64_t G, int64_t D, int64_t B,
        float scale, float *scores, float *out) {
    enum { MAX_D = 256 };
    for (int64_t g = 0; g < G; g++) { /* one query head at a time: its q and sums stay in registers */
        const float *qg = q + g * q_head_stride;
        int64_t t = 0;
#if PD_HAVE_SHUFFLE && defined(__AVX512F__)
        for (; t + 16 <= len; t += 16) { /* sixteen keys at a time, their sums folded together */
            const float *k[16];
            for (int j = 0; j < 16; j++)
                k[j] = k_cache + table[(t + j) / B] * sN + ((t + j) % B) * sB + head_offset;
            if (g == 0 && t + 16 < len) /* the next keys, while these are scored */
                prefetch_rows(k_cache + table[(t + 16) / B] * sN + head_offset, B, sB, D);
            v16 acc[16];
            for (int j = 0; j < 16; j++)
                acc[j] = load16(qg) * load16(k[j]);
            for (int64_t d = 16; d < D; d += 16)
                for (int j = 0; j < 16; j++)
                    acc[j] += load16(qg + d) * load16(k[j] + d);
            store16(scores + t, fold16(acc) * scale);
        }
#else
        /* Without AVX-512 (or without fold16's shuffles), where GCC keeps 16-float vectors in
         * memory (4-5x slower): the same sums in 8-float halves, lanes 0-7 and 8-15 of each v16
         * sum, four keys at a time */
        for (; t + 4 <= len; t += 4) {
            const float *k[4];
            for (int j = 0; j < 4; j++)
                k[j] = k_cache + table[(t + j) / B] * sN + ((t + j) % B) * sB + head_offset;
            if (g == 0 && (t % B) == 0 && t + B < len) /* the next block's keys, while these are scored */
                prefetch_rows(k_cache + table[t / B + 1] * sN + head_offset, B, sB, D);
            v8 lo[4], hi[4];
            for (int j = 0; j < 4; j++) {
                lo[j] = load8(qg) * load8(k[j]);
                hi[j] = load8(qg + 8) * load8(k[j] + 8);
            }
            for (int64_t d = 16; d < D; d += 16)
                for (int j = 0; j < 4; j++) {
                    lo[j] += load8(qg + d) * load8(k[j] + d);
                    hi[j] += load8(qg + d + 8) * load8(k[j] + d + 8);
                }
            for (int j = 0; j < 4; j++)
                scores[t + j] = hsum8x2(lo[j], hi[j]) * scale;
        }
#endif
        for (; t < len; t++) { /* the rest one key at a time: the same sums, the same order */
            const float *k = k_cache + table[t / B] * sN + (t % B) * sB + head_offset;
            v8 lo = load8(qg) * load8(k), hi = load8(qg + 8) * load8(k + 8);
            for (int64_t d = 16; d < D; d += 16) {
                lo += load8(qg + d) * load8(k + d);
                hi += load8(qg + d + 8) * load8(k + d + 8);
            }
            scores[t] = hsum8x2(lo, hi) * scale;
        }
        int64_t padded = (len + 15) & ~(int64_t)15;
        for (int64_t t = len; t < padded; t++)
            scores[t] = -INFINITY; /* weighs nothing */
        v8 top = load8(scores); /* the max, then e^(s - max) and its sum: in v8 halves, lanes 0-7
                                   and 8-15 of a v16 sum (the same bits on every vector width) */
        for (int64_t t = 8; t < padded; t += 8) {
            v8 x = load8(scores + t);
            top = select8(x > top, x, top);
        }
        float m = top[0];
        for (int l = 1; l < 8; l++)
            m = top[l] > m ? top[l] : m;
        v8 lo = {0}, hi = {0};
        for (int64_t t = 0; t < padded; t += 16) {
            v8 e0 = exp8_nonpositive(load8(scores + t) - m), e1 = exp8_nonpositive(load8(scores + t + 8) - m);
            store8(scores + t, e0);
            store8(scores + t + 8, e1);
            lo += e0;
            hi += e1;
        }
        float sum = hsum8x2(lo, hi);
        vn acc[MAX_D / VN] = {{0}}; /* the value sums, one register wide */
        for (int64_t t0 = 0, blk = 0; t0 < len; t0 += B, blk++) {
            const float *vb = v_cache + table[blk] * sN + head_offset;
            int64_t n = len - t0 < B ? len - t0 : B;
            if (g == 0 && t0 + B < len)
                prefetch_rows(v_cache + table[blk + 1] * sN + head_offset, B, sB, D);
            for (int64_t j = 0; j < n; j++) {
                const float *v = vb + j * sB;
                float p = scores[t0 + j];
                for (int64_t c = 0; c < D / VN; c++)
                    acc[c] += p * loadn(v + VN * c);
            }
        }
        float inv = 1.0f / sum;
        for (int64_t c = 0; c < D / VN; c++)
            storen(out + g * D + VN * c, acc[c] * inv);
    }
}

/* q: (num, Hq, D), rows q_row_stride apart, heads D apart. k_cache, v_cache: element
 * (block, offset, kv head, d) at block * sN + offset * sB + head * sH + d. tables: (num, *) block
 * ids, rows table_stride apart; lens: (num,) keys per sequence, each >= 1. out: (num, Hq, D)
 * contiguous. Returns 0; 1 if D is not a multiple of 16 up to 256; 2 if scratch memory ran out. */
int pd_paged_decode_f32(const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                        int64_t sN, int64_t sB, int64_t sH, const int64_t *tables, int64_t table_stride,
                        const int64_t *lens, int64_t num, int64_t Hq, int64_t Hkv, int64_t D, int64_t B,
                        float scale, int threads, float *out) {
    int64_t G = Hq / Hkv, max_len = 0;
    if (D % 16 != 0 || D > 256)
        return 1;
    for (int64_t s = 0; s < num; s++)
        max_len = lens[s] > max_len ? lens[s] : max_len;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float *scores = malloc((size_t)(max_len + 16) * sizeof(float));
        if (scores == NULL)
            failed = 1;
#pragma omp for schedule(dynamic, 4)
        for (int64_t task = 0; task < num * Hkv; task++) {
            if (scores == NULL)
                continue;
            int64_t s = task / Hkv, h = task % Hkv;
            const float *qs = q + s * q_row_stride + h * G * D;
            const int64_t *table = tables + s * table_stride;
            float *o = out + (s * Hq + h * G) * D;
            switch (D) { /* the common head sizes get loops of a known length */
            case 32:
                attend(qs, D, k_cache, v_cache, sN, sB, h * sH, table, lens[s], G, 32, B, scale, scores, o);
                break;
            case 64:
                attend(qs, D, k_cache, v_cache, sN, sB, h * sH, table, lens[s], G, 64, B, scale, scores, o);
                break;
            case 128:
                attend(qs, D, k_cache, v_cache, sN, sB, h * sH, table, lens[s], G, 128, B, scale, scores, o);
                break;
            default:
                attend(qs, D, k_cache, v_cache, sN, sB, h * sH, table, lens[s], G, D, B, scale, scores, o);
            }
        }
        free(scores);
    }
    return failed ? 2 : 0;
}
