/* The decode work item (one query row, one KV head, its whole context) on CPUs with AVX2 and
 * FMA but no AVX-512 (AMD Zen 2/3, Intel Haswell to Comet Lake). Included by
 * paged_attention_cpu.c after its shared helpers (Problem, Item, item_begin, item_store,
 * MMKIT_ITEM_PV, chunk_slots, prefetch_chunk); nothing here is compiled on its own.
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

/* exp_clamped of 8 lanes (bf16.h). */
MMKIT_DEFINE_EXP_VEC(exp256, __m256, __m256i, _mm256, si256)

/* softmax_numerators for one row of `len` scores in 8-lane vectors, the tail masked. gcc left
 * softmax_numerators scalar where the AVX2 tile and item inline it ("control flow in loop": the
 * clamp is not if-converted there), and its scalar max, exp and sum were about half of an AVX2
 * prefill tile's samples at 2048 keys. bf16 rounding as softmax_numerators (finite values). */
static inline void softmax_row256(float *sg, int64_t len, float *sum_out, const int dtype) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(sg + t));
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(len - t)), lane); /* lanes < len - t */
    if (t < len)
        vmx = _mm256_max_ps(vmx, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(sg + t, tail),
                                                  _mm256_castsi256_ps(tail)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 vs = _mm256_setzero_ps();
    for (t = 0; t < len; t += 8) {
        const int whole = t + 8 <= len;
        const __m256i m = whole ? _mm256_set1_epi32(-1) : tail;
        const __m256 x = whole ? _mm256_loadu_ps(sg + t) : _mm256_maskload_ps(sg + t, m);
        const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(x, mx)), _mm256_castsi256_ps(m));
        vs = _mm256_add_ps(vs, e);
        __m256 stored = e;
        if (dtype != MMKIT_F32) { /* round to nearest even at bit 16, as f32_to_bf16 */
            const __m256i u = _mm256_castps_si256(e);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
            stored = _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32((int)0xffff0000u)));
        }
        if (whole) _mm256_storeu_ps(sg + t, stored);
        else _mm256_maskstore_ps(sg + t, m, stored);
    }
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(vs), _mm256_extractf128_ps(vs, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));
    *sum_out = _mm_cvtss_f32(s4);
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
 * the 8 keys' lanes summed together (reduce8); softmax_row256; P V: per query
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
    for (int64_t g = 0; g < group; g++) softmax_row256(scores + g * max_len, it.len - it.start, sums + g, dtype);
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
