/* The decode work item (one query row, one KV head, its whole context) on CPUs with AVX2 and
 * FMA but no AVX-512 (AMD Zen 2/3, Intel Haswell to Comet Lake). Included by
 * paged_attention_cpu.c after its shared helpers (Problem, Item, item_begin, item_store,
 * MMKIT_ITEM_PV, chunk_slots, prefetch_chunk, softmax_numerators); nothing here is compiled on its own.
 *
 * Without it such a CPU ran the portable attend_item: it first copied the item's whole K
 * context into a dense scratch (then V), float32 included, and reduced every score alone (an
 * 8-lane dot product and its horizontal sum). On a float32 decode-heavy run on Zen 3 that copy
 * was about 5% of all samples. Here, as in the AVX-512 item, float32 rows are read where they
 * are in the cache (bf16 rows are widened 8 at a time into L1), the blocks ahead are
 * prefetched (a context's blocks sit at random places, which no hardware prefetcher follows),
 * and the 8 scores of a chunk are reduced together. */
#ifndef MMKIT_PAGED_ITEM_AVX2_H
#define MMKIT_PAGED_ITEM_AVX2_H

#include <immintrin.h>

/* Lane i of the result = the sum of the 8 lanes of v[i] (pairs, quads within each 128-bit
 * half, then the two halves): 8 horizontal sums in 14 shuffles and adds. */
static inline __m256 reduce8(const __m256 v[8]) {
    __m256 w[2];
    for (int j = 0; j < 2; j++) {
        const __m256 a = v[4 * j], b = v[4 * j + 1], c = v[4 * j + 2], d = v[4 * j + 3];
        const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
        const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
        /* lanes: [a, b, c, d] sums of the low half, then of the high half */
        w[j] = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    /* [w0 low, w1 low] + [w0 high, w1 high]: lanes 0-3 from v[0..3], 4-7 from v[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(w[0], w[1], 0x20), _mm256_permute2f128_ps(w[0], w[1], 0x31));
}

/* rp[i] = context row t0 + i (i < n <= 8) as float32: in place for float32 caches, else widened
 * into `rows` (8 * NC floats a row). */
static inline __attribute__((always_inline)) void chunk_rows8(const float **rp, float *rows, const void *cache,
                                                               const int64_t *table, int64_t t0, int64_t n,
                                                               int64_t first_block_row, int64_t block_size,
                                                               const int NC, const int dtype) {
    int64_t slots[8];
    chunk_slots(slots, table, t0, n, first_block_row, block_size);
    for (int64_t i = 0; i < n; i++) {
        if (dtype == MMKIT_F32) {
            rp[i] = (const float *)cache + slots[i] * 8 * NC;
        } else {
            const uint16_t *src = (const uint16_t *)cache + slots[i] * 8 * NC;
            float *d = rows + i * 8 * NC;
            for (int c = 0; c < NC; c++) {
                const __m128i h = _mm_loadu_si128((const __m128i *)(src + 8 * c));
                _mm256_storeu_ps(d + 8 * c, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
            }
            rp[i] = d;
        }
    }
}

/* attend_item for head_dim = 8 * NC. Scores: per key an FMA chain over its NC vectors, then
 * the 8 keys' lanes summed together (reduce8); softmax_numerators as every path; P V: per query
 * head an FMA chain over keys in order, in NC accumulators. */
static inline __attribute__((always_inline)) void attend_item_avx2(const Problem *p, int64_t item,
                                                                    float *restrict scores, float *restrict acc_all,
                                                                    float *restrict rows, const int NC,
                                                                    const int dtype) {
    const int64_t head_dim = 8 * NC;
    float qf[p->num_heads / p->num_kv_heads * head_dim];
    const Item it = item_begin(p, item, head_dim, dtype, qf);
    const int64_t group = it.group, max_len = it.max_len;
    /* Pass 1: scores of rows [it.start, it.len), indexed from 0. The next 16 rows are
     * prefetched while these 8 are scored; past the end, V's first rows. */
    for (int64_t t0 = it.start; t0 < it.len; t0 += 8) {
        const int64_t n = it.len - t0 < 8 ? it.len - t0 : 8;
        if ((t0 - it.start) % 16 == 0) {
            const int64_t ahead = it.len - t0 - 16 < 16 ? it.len - t0 - 16 : 16;
            if (ahead > 0) prefetch_chunk(p->k_cache, it.table, t0 + 16, ahead, it.first_row, p->block_size, it.row_bytes);
            else prefetch_chunk(p->v_cache, it.table, it.start, it.len - it.start < 16 ? it.len - it.start : 16,
                                it.first_row, p->block_size, it.row_bytes);
        }
        const float *rp[8];
        chunk_rows8(rp, rows, p->k_cache, it.table, t0, n, it.first_row, p->block_size, NC, dtype);
        for (int64_t g = 0; g < group; g++) {
            const float *q = qf + g * head_dim;
            __m256 part[8];
            for (int64_t i = 0; i < 8; i++) {
                __m256 a = _mm256_setzero_ps();
                if (i < n)
                    for (int c = 0; c < NC; c++) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(rp[i] + 8 * c), a);
                part[i] = a;
            }
            float sc[8];
            _mm256_storeu_ps(sc, reduce8(part));
            for (int64_t i = 0; i < n; i++) scores[g * max_len + (t0 - it.start) + i] = sc[i];
        }
    }
    float sums[group];
    softmax_numerators(scores, group, max_len, it.len - it.start, sums, dtype);
    /* Pass 2: acc_g = sum_t p_gt v_t */
    for (int64_t i = 0; i < group * head_dim; i++) acc_all[i] = 0.0f;
    for (int64_t t0 = it.start; t0 < it.len; t0 += 8) {
        const int64_t n = it.len - t0 < 8 ? it.len - t0 : 8;
        const int64_t ahead = it.len - t0 - 16 < 16 ? it.len - t0 - 16 : 16;
        if ((t0 - it.start) % 16 == 0 && ahead > 0)
            prefetch_chunk(p->v_cache, it.table, t0 + 16, ahead, it.first_row, p->block_size, it.row_bytes);
        const float *rp[8];
        chunk_rows8(rp, rows, p->v_cache, it.table, t0, n, it.first_row, p->block_size, NC, dtype);
        const int64_t start = it.start;
        MMKIT_ITEM_PV(__m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps, _mm256_fmadd_ps)
    }
    item_store(p, &it, acc_all, sums, head_dim, dtype);
}

#endif
