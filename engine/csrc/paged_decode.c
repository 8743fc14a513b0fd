/* Paged decode attention for CPU in float32: one query per sequence, keys and values read in
 * place from the paged KV pool through each sequence's block table.
 *
 * Built at first use by engine/cpu_kernels.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes with tensors' data pointers; engine/cpu_attention.py checks every shape, dtype
 * and stride first. For each (sequence, kv head) it scores the G = Hq / Hkv query heads of that kv
 * head, one after another, against the sequence's keys (the first pass brings them into cache),
 * takes an exact softmax (max subtracted, float32 sums), then sums the values weighted by it. Work is proportional to the
 * keys each sequence actually has: no padding to the longest sequence, no copy of the history.
 * Keys are scored sixteen at a time, their sixteen partial-sum vectors folded together
 * (vec16.h's fold16, in hsum16's order). (sequence, kv head) pairs are independent and split
 * across `threads` OpenMP threads, on torch's own OpenMP runtime (the same soname, loaded once);
 * each pair's arithmetic is the same whatever the thread count, so results do not depend on it.
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
#if PD_HAVE_SHUFFLE
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
#endif
        for (; t < len; t++) { /* the rest one key at a time: the same sums, the same order */
            const float *k = k_cache + table[t / B] * sN + (t % B) * sB + head_offset;
            v16 acc = load16(qg) * load16(k);
            for (int64_t d = 16; d < D; d += 16)
                acc += load16(qg + d) * load16(k + d);
            scores[t] = hsum16(acc) * scale;
        }
        int64_t padded = (len + 15) & ~(int64_t)15;
        for (int64_t t = len; t < padded; t++)
            scores[t] = -INFINITY; /* weighs nothing */
        v16 top = load16(scores);
        for (int64_t t = 16; t < padded; t += 16) {
            v16 x = load16(scores + t);
            top = select16(x > top, x, top);
        }
        float m = top[0];
        for (int l = 1; l < 16; l++)
            m = top[l] > m ? top[l] : m;
        v16 part = {0};
        for (int64_t t = 0; t < padded; t += 16) {
            v16 e = exp16_nonpositive(load16(scores + t) - m);
            store16(scores + t, e);
            part += e;
        }
        float sum = hsum16(part);
        v16 acc[MAX_D / 16] = {{0}};
        for (int64_t t0 = 0, blk = 0; t0 < len; t0 += B, blk++) {
            const float *vb = v_cache + table[blk] * sN + head_offset;
            int64_t n = len - t0 < B ? len - t0 : B;
            if (g == 0 && t0 + B < len)
                prefetch_rows(v_cache + table[blk + 1] * sN + head_offset, B, sB, D);
            for (int64_t j = 0; j < n; j++) {
                const float *v = vb + j * sB;
                float p = scores[t0 + j];
                for (int64_t c = 0; c < D / 16; c++)
                    acc[c] += p * load16(v + 16 * c);
            }
        }
        float inv = 1.0f / sum;
        for (int64_t c = 0; c < D / 16; c++)
            store16(out + g * D + 16 * c, acc[c] * inv);
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
