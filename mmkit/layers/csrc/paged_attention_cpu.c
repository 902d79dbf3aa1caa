/* Paged decode attention for CPU: one query token per sequence, K/V read in place from the
 * paged cache (no gather copy). Built at first use by mmkit/layers/cpu_kernels.py with
 * `cc -O3 -march=native -fopenmp -shared`; the torch path in attention.py is the reference.
 *
 * Cache layout (per layer): [num_kv_heads, num_blocks, block_size, head_dim], as attention.py.
 * Work item = (sequence, kv head): the item's K rows are read once from the cache into a dense
 * float32 scratch, the `group` query heads sharing that KV head are scored against it, and
 * likewise for V. Scores for the whole context are kept (exact softmax in two passes, float32
 * throughout); a decode token's context is at most max_model_len, so the scratch stays small.
 *
 * Sliding-window layers pass `context_starts`: sequence s attends rows [start_s, len_s) of its
 * listed blocks (the caller lists only the blocks that overlap the window, so blocks entirely
 * before it are never touched); NULL means every row from 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

enum { MMKIT_F32 = 0, MMKIT_BF16 = 1 };

/* Row `row` of a [*, head_dim] array of `dtype`, as float. */
static inline __attribute__((always_inline)) void load_row(float *restrict dst, const void *base, int64_t row,
                                                            const int64_t head_dim, const int dtype) {
    if (dtype == MMKIT_F32) {
        const float *src = (const float *)base + row * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) dst[d] = src[d];
    } else {
        const uint16_t *src = (const uint16_t *)base + row * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) dst[d] = bf16_to_f32(src[d]);
    }
}

/* Rows [0, len) of scores[g * stride ...] for each of `group` heads become exp(score - max);
 * sums[g] gets their sum (the softmax is normalised on the output). With bf16 inputs the
 * numerators are rounded to bf16 and the sum is taken before rounding, as torch's CPU flash
 * attention does (it multiplies bf16 probabilities by V): transformers' bf16 reference then
 * agrees with this kernel to the last bit far more often, and greedy ids stay equal. */
static inline void softmax_numerators(float *scores, int64_t group, int64_t stride, int64_t len, float *sums,
                                      const int dtype) {
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * stride;
        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < len; t++) mx = sg[t] > mx ? sg[t] : mx;
        float sum = 0.0f;
        if (dtype == MMKIT_F32) {
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < len; t++) {
                sg[t] = exp_clamped(sg[t] - mx);
                sum += sg[t];
            }
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < len; t++) {
                const float e = exp_clamped(sg[t] - mx);
                sum += e;
                sg[t] = round_bf16(e);
            }
        }
        sums[g] = sum;
    }
}

/* out[at .. at + head_dim) = acc * scale, in the output dtype. */
static inline __attribute__((always_inline)) void store_head(void *out, int64_t at, const float *acc, float scale,
                                                              const int64_t head_dim, const int dtype) {
    if (dtype == MMKIT_F32) {
        for (int64_t d = 0; d < head_dim; d++) ((float *)out)[at + d] = acc[d] * scale;
    } else {
        for (int64_t d = 0; d < head_dim; d++) ((uint16_t *)out)[at + d] = f32_to_bf16(acc[d] * scale);
    }
}

typedef struct {
    void *out;
    const void *q;
    int64_t q_row_stride;
    const void *k_cache, *v_cache;
    const int64_t *block_ids;
    int64_t max_blocks;
    const int64_t *context_lens;
    const int64_t *context_starts; /* NULL: every context starts at row 0 */
    int64_t num_heads, num_kv_heads, num_blocks, block_size;
    float scale;
} Problem;

/* Context rows [start, len) of one KV head, gathered block by block into dense float32 rows
 * (`dst`, [len - start, head_dim]; L2-resident scratch): each cache row is read from memory once,
 * and the `group` query heads then stream the dense copy. */
static inline __attribute__((always_inline)) void load_context(float *restrict dst, const void *cache,
                                                                const int64_t *table, int64_t start, int64_t len,
                                                                int64_t first_block_row, int64_t block_size,
                                                                const int64_t head_dim, const int dtype) {
    for (int64_t t = start; t < len;) {
        const int64_t b = t / block_size, off = t % block_size;
        const int64_t first = (first_block_row + table[b]) * block_size + off;
        const int64_t n = len - t < block_size - off ? len - t : block_size - off;
        for (int64_t i = 0; i < n; i++) load_row(dst + (t - start + i) * head_dim, cache, first + i, head_dim, dtype);
        t += n;
    }
}

/* One (sequence, kv head) item. Inlined with constant head_dim/dtype at the call sites below,
 * so the head_dim loops unroll into whole vector registers (the accumulator stays in them). */
static inline __attribute__((always_inline)) void attend_item(const Problem *p, int64_t item, float *restrict scores,
                                                               float *restrict rows, const int64_t head_dim,
                                                               const int dtype) {
    const int64_t group = p->num_heads / p->num_kv_heads;
    const int64_t max_len = p->max_blocks * p->block_size;
    const int64_t s = item / p->num_kv_heads, kvh = item % p->num_kv_heads;
    const int64_t start = p->context_starts ? p->context_starts[s] : 0;
    const int64_t len = p->context_lens[s] - start; /* rows attended */
    const int64_t *table = p->block_ids + s * p->max_blocks;
    const int64_t elem = dtype == MMKIT_F32 ? 4 : 2;
    const char *qrow = (const char *)p->q + s * p->q_row_stride * elem;

    /* Pass 1: scores[g, t] = scale * q_g . k_(start + t) */
    load_context(rows, p->k_cache, table, start, start + len, kvh * p->num_blocks, p->block_size, head_dim, dtype);
    for (int64_t g = 0; g < group; g++) {
        /* heads h = kvh * group + g share KV head kvh (transformers' repeat_kv order) */
        float qg[head_dim];
        load_row(qg, qrow, kvh * group + g, head_dim, dtype);
        for (int64_t d = 0; d < head_dim; d++) qg[d] *= p->scale;
        float *sg = scores + g * max_len;
        for (int64_t t = 0; t < len; t++) {
            const float *kt = rows + t * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * kt[d];
            sg[t] = dot;
        }
    }
    /* Softmax numerators and sums per query head (normalised on the output). */
    float sums[group];
    softmax_numerators(scores, group, max_len, len, sums, dtype);
    /* Pass 2: out_g = sum_t p_gt v_t / sum_t p_gt */
    load_context(rows, p->v_cache, table, start, start + len, kvh * p->num_blocks, p->block_size, head_dim, dtype);
    for (int64_t g = 0; g < group; g++) {
        const float *sg = scores + g * max_len;
        float acc[head_dim];
        for (int64_t d = 0; d < head_dim; d++) acc[d] = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            const float pr = sg[t];
            const float *vt = rows + t * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) acc[d] += pr * vt[d];
        }
        store_head(p->out, (s * p->num_heads + kvh * group + g) * head_dim, acc, 1.0f / sums[g], head_dim, dtype);
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* Lane i of the result = the sum of the 16 lanes of v[i]: 16 horizontal sums for ~30 shuffles
 * and adds instead of ~7 per vector. Within each 128-bit lane, pairs then quads of vectors are
 * folded (unpack, shuffle_ps); then the four 128-bit lanes are folded across (shuffle_f32x4). */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 w[4];
    for (int j = 0; j < 4; j++) {
        const __m512 a = v[4 * j], b = v[4 * j + 1], c = v[4 * j + 2], d = v[4 * j + 3];
        const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
        w[j] = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Up to 16 context rows starting at token t0 into dense float rows [n, 16 * NC]. */
static inline __attribute__((always_inline)) void load_chunk(float *restrict dst, const void *cache, const int64_t *table,
                                                              int64_t t0, int64_t n, int64_t first_block_row,
                                                              int64_t block_size, const int NC, const int dtype) {
    int64_t b = t0 / block_size, off = t0 % block_size;
    for (int64_t i = 0; i < n; i++) {
        const int64_t slot = (first_block_row + table[b]) * block_size + off;
        float *d = dst + i * 16 * NC;
        if (dtype == MMKIT_F32) {
            const float *src = (const float *)cache + slot * 16 * NC;
            for (int c = 0; c < NC; c++) _mm512_storeu_ps(d + 16 * c, _mm512_loadu_ps(src + 16 * c));
        } else {
            const uint16_t *src = (const uint16_t *)cache + slot * 16 * NC;
            for (int c = 0; c < NC; c++) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)(src + 16 * c));
                _mm512_storeu_ps(d + 16 * c, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
            }
        }
        if (++off == block_size) {
            off = 0;
            b++;
        }
    }
}

/* Ask for the cache lines of rows [t0, t0 + n) ahead of use (into L2: L1 prefetches of a
 * whole block at once stalled on the line-fill buffers). Blocks sit at random places in
 * the cache, so the hardware prefetcher cannot guess the next one: without this, half of the
 * kernel's time was spent waiting on the first loads of each block. */
static inline __attribute__((always_inline)) void prefetch_chunk(const void *cache, const int64_t *table, int64_t t0,
                                                                  int64_t n, int64_t first_block_row,
                                                                  int64_t block_size, int64_t row_bytes) {
    int64_t b = t0 / block_size, off = t0 % block_size;
    for (int64_t i = 0; i < n;) {
        const int64_t run = n - i < block_size - off ? n - i : block_size - off; /* rows left in block b */
        const char *start = (const char *)cache + ((first_block_row + table[b]) * block_size + off) * row_bytes;
        for (int64_t byte = 0; byte < run * row_bytes; byte += 64) _mm_prefetch(start + byte, _MM_HINT_T1);
        i += run;
        off = 0;
        b++;
    }
}

/* attend_item for head_dim = 16 * NC with AVX-512: rows are staged 16 at a time (L1), the
 * 16 scores of a chunk are reduced together, the accumulators live in registers per chunk. */
static inline __attribute__((always_inline)) void attend_item_avx512(const Problem *p, int64_t item,
                                                                      float *restrict scores, float *restrict acc_all,
                                                                      float *restrict rows, const int NC,
                                                                      const int dtype) {
    const int64_t head_dim = 16 * NC;
    const int64_t group = p->num_heads / p->num_kv_heads;
    const int64_t max_len = p->max_blocks * p->block_size;
    const int64_t s = item / p->num_kv_heads, kvh = item % p->num_kv_heads;
    const int64_t start = p->context_starts ? p->context_starts[s] : 0;
    const int64_t len = p->context_lens[s];
    const int64_t *table = p->block_ids + s * p->max_blocks;
    const int64_t first_row = kvh * p->num_blocks;
    const int64_t elem = dtype == MMKIT_F32 ? 4 : 2;
    const char *qrow = (const char *)p->q + s * p->q_row_stride * elem;
    float qf[group * head_dim];
    for (int64_t g = 0; g < group; g++) {
        load_row(qf + g * head_dim, qrow, kvh * group + g, head_dim, dtype);
        for (int64_t d = 0; d < head_dim; d++) qf[g * head_dim + d] *= p->scale;
    }
    const int64_t row_bytes = head_dim * elem;
    /* Pass 1: scores */
    /* Rows t0 in [start, len); scores and softmax index them from 0 (t0 - start). */
    const int64_t first_n = len - start < 16 ? len - start : 16;
    prefetch_chunk(p->k_cache, table, start, first_n, first_row, p->block_size, row_bytes);
    for (int64_t t0 = start; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        const int64_t ahead = len - t0 - 16 < 16 ? len - t0 - 16 : 16;
        if (ahead > 0) prefetch_chunk(p->k_cache, table, t0 + 16, ahead, first_row, p->block_size, row_bytes);
        else prefetch_chunk(p->v_cache, table, start, first_n, first_row, p->block_size, row_bytes);
        load_chunk(rows, p->k_cache, table, t0, n, first_row, p->block_size, NC, dtype);
        for (int64_t g = 0; g < group; g++) {
            __m512 q[NC];
            for (int c = 0; c < NC; c++) q[c] = _mm512_loadu_ps(qf + g * head_dim + 16 * c);
            __m512 part[16];
            for (int64_t i = 0; i < 16; i++) {
                __m512 a = _mm512_setzero_ps();
                if (i < n)
                    for (int c = 0; c < NC; c++) a = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(rows + i * head_dim + 16 * c), a);
                part[i] = a;
            }
            _mm512_mask_storeu_ps(scores + g * max_len + (t0 - start), (__mmask16)((1u << n) - 1u), reduce16(part));
        }
    }
    /* Softmax numerators and sums per query head (normalised on the output). */
    float sums[group];
    softmax_numerators(scores, group, max_len, len - start, sums, dtype);
    /* Pass 2: acc_g = sum_t p_gt v_t */
    for (int64_t i = 0; i < group * head_dim; i++) acc_all[i] = 0.0f;
    for (int64_t t0 = start; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        const int64_t ahead = len - t0 - 16 < 16 ? len - t0 - 16 : 16;
        if (ahead > 0) prefetch_chunk(p->v_cache, table, t0 + 16, ahead, first_row, p->block_size, row_bytes);
        load_chunk(rows, p->v_cache, table, t0, n, first_row, p->block_size, NC, dtype);
        for (int64_t g = 0; g < group; g++) {
            const float *sg = scores + g * max_len + (t0 - start);
            __m512 a[NC];
            for (int c = 0; c < NC; c++) a[c] = _mm512_loadu_ps(acc_all + g * head_dim + 16 * c);
            for (int64_t i = 0; i < n; i++) {
                const __m512 pr = _mm512_set1_ps(sg[i]);
                for (int c = 0; c < NC; c++) a[c] = _mm512_fmadd_ps(pr, _mm512_loadu_ps(rows + i * head_dim + 16 * c), a[c]);
            }
            for (int c = 0; c < NC; c++) _mm512_storeu_ps(acc_all + g * head_dim + 16 * c, a[c]);
        }
    }
    for (int64_t g = 0; g < group; g++) {
        store_head(p->out, (s * p->num_heads + kvh * group + g) * head_dim, acc_all + g * head_dim,
                   1.0f / sums[g], head_dim, dtype);
    }
}
#endif

/* Per-thread scratch that only grows: a decode step calls the kernel once per layer, and
 * long contexts need buffers past malloc's mmap threshold, which would be mapped, faulted in
 * and unmapped on every call. Returns NULL when the allocation fails. */
static float *thread_scratch(int which, size_t count) {
    static __thread float *buffers[3];
    static __thread size_t sizes[3];
    if (sizes[which] < count) {
        float *grown = realloc(buffers[which], count * sizeof(float));
        if (grown == NULL) return NULL;
        buffers[which] = grown;
        sizes[which] = count;
    }
    return buffers[which];
}

/* Returns 0 on success, 1 when a scratch buffer could not be allocated, 2 (bounds-checking
 * build, -DMMKIT_KERNEL_CHECKS) when a block id or context length is out of range. */
int mmkit_paged_decode_attention(
    void *out,                   /* [num_seqs, num_heads, head_dim], contiguous */
    const void *q,               /* sequence s, head h at q + s * q_row_stride + h * head_dim */
    int64_t q_row_stride,        /* elements between consecutive sequences' queries */
    const void *k_cache, const void *v_cache,
    const int64_t *block_ids,    /* [num_seqs, max_blocks], row-major */
    int64_t max_blocks,
    const int64_t *context_lens, /* [num_seqs], tokens of the listed blocks up to the new one (included) */
    const int64_t *context_starts, /* [num_seqs] first attended row, or NULL (row 0) */
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t num_blocks, int64_t block_size, float scale, int dtype, int num_threads) {
    const Problem p = {out, q, q_row_stride, k_cache, v_cache, block_ids, max_blocks, context_lens, context_starts,
                       num_heads, num_kv_heads, num_blocks, block_size, scale};
    const int64_t group = num_heads / num_kv_heads;
    const int64_t num_items = num_seqs * num_kv_heads;
    int failed = 0;
#ifdef MMKIT_KERNEL_CHECKS
    /* Every block a context reads must exist, before any thread reads one. */
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 2;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = context_lens[s];
        if (len < 1 || len > max_blocks * block_size) return 2;
        if (context_starts && (context_starts[s] < 0 || context_starts[s] >= len)) return 2;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; b++) {
            const int64_t id = block_ids[s * max_blocks + b];
            if (id < 0 || id >= num_blocks) return 2;
        }
    }
#endif

    /* A small batch (a few short sequences) runs on the calling thread: waking OpenMP's
     * sleeping worker (OMP_WAIT_POLICY=PASSIVE) costs more than its share of the work. */
#pragma omp parallel num_threads(num_threads) if (num_items * max_blocks * block_size * head_dim >= (1 << 18))
    {
        float *scores = thread_scratch(0, (size_t)(group * max_blocks * block_size));
        float *rows = thread_scratch(1, (size_t)(max_blocks * block_size * head_dim));
        float *acc = thread_scratch(2, (size_t)(group * head_dim));
        if (!scores || !rows || !acc) {
#pragma omp atomic write
            failed = 1;
        }
        /* Every thread reaches the loop: a worksharing construct must be met by all. */
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < num_items; item++) {
            int stop;
#pragma omp atomic read
            stop = failed;
            if (stop) continue;
#if defined(__AVX512F__)
            if (dtype == MMKIT_BF16 && head_dim == 64) attend_item_avx512(&p, item, scores, acc, rows, 4, MMKIT_BF16);
            else if (dtype == MMKIT_BF16 && head_dim == 128) attend_item_avx512(&p, item, scores, acc, rows, 8, MMKIT_BF16);
            else if (dtype == MMKIT_F32 && head_dim == 64) attend_item_avx512(&p, item, scores, acc, rows, 4, MMKIT_F32);
            else if (dtype == MMKIT_F32 && head_dim == 128) attend_item_avx512(&p, item, scores, acc, rows, 8, MMKIT_F32);
            else
#endif
            if (dtype == MMKIT_BF16 && head_dim == 64) attend_item(&p, item, scores, rows, 64, MMKIT_BF16);
            else if (dtype == MMKIT_BF16 && head_dim == 128) attend_item(&p, item, scores, rows, 128, MMKIT_BF16);
            else if (dtype == MMKIT_F32 && head_dim == 64) attend_item(&p, item, scores, rows, 64, MMKIT_F32);
            else if (dtype == MMKIT_F32 && head_dim == 128) attend_item(&p, item, scores, rows, 128, MMKIT_F32);
            else if (dtype == MMKIT_BF16) attend_item(&p, item, scores, rows, head_dim, MMKIT_BF16);
            else attend_item(&p, item, scores, rows, head_dim, MMKIT_F32);
        }
    }
    return failed;
}
