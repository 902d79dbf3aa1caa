/* Paged decode attention for CPU: one query token per sequence, K/V read in place from the
 * paged cache (no gather copy). Built at first use by mmkit/layers/cpu_kernels.py with
 * `cc -O3 -march=native -fopenmp -shared`; the torch path in attention.py is the reference.
 *
 * Cache layout (per layer): [num_kv_heads, num_blocks, block_size, head_dim], as attention.py.
 * Work item = (sequence, kv head): the item's K rows are read once from the cache into a dense
 * float32 scratch, the `group` query heads sharing that KV head are scored against it, and
 * likewise for V. Scores for the whole context are kept (exact softmax in two passes, float32
 * throughout); a decode token's context is at most max_model_len, so the scratch stays small.
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

typedef struct {
    void *out;
    const void *q;
    int64_t q_row_stride;
    const void *k_cache, *v_cache;
    const int64_t *block_ids;
    int64_t max_blocks;
    const int64_t *context_lens;
    int64_t num_heads, num_kv_heads, num_blocks, block_size;
    float scale;
} Problem;

/* Context rows [0, len) of one KV head, gathered block by block into dense float32 rows
 * (`dst`, [len, head_dim]; L2-resident scratch): each cache row is read from memory once, and the
 * `group` query heads then stream the dense copy. */
static inline __attribute__((always_inline)) void load_context(float *restrict dst, const void *cache,
                                                                const int64_t *table, int64_t len,
                                                                int64_t first_block_row, int64_t block_size,
                                                                const int64_t head_dim, const int dtype) {
    for (int64_t b = 0, t = 0; t < len; b++) {
        const int64_t first = (first_block_row + table[b]) * block_size;
        const int64_t n = len - t < block_size ? len - t : block_size;
        for (int64_t i = 0; i < n; i++) load_row(dst + (t + i) * head_dim, cache, first + i, head_dim, dtype);
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
    const int64_t len = p->context_lens[s];
    const int64_t *table = p->block_ids + s * p->max_blocks;
    const int64_t elem = dtype == MMKIT_F32 ? 4 : 2;
    const char *qrow = (const char *)p->q + s * p->q_row_stride * elem;

    /* Pass 1: scores[g, t] = scale * q_g . k_t */
    load_context(rows, p->k_cache, table, len, kvh * p->num_blocks, p->block_size, head_dim, dtype);
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
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * max_len;
        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < len; t++) mx = sg[t] > mx ? sg[t] : mx;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            sg[t] = exp_clamped(sg[t] - mx);
            sum += sg[t];
        }
        sums[g] = sum;
    }
    /* Pass 2: out_g = sum_t p_gt v_t / sum_t p_gt */
    load_context(rows, p->v_cache, table, len, kvh * p->num_blocks, p->block_size, head_dim, dtype);
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
        const int64_t at = (s * p->num_heads + kvh * group + g) * head_dim;
        const float inv = 1.0f / sums[g];
        if (dtype == MMKIT_F32) {
            for (int64_t d = 0; d < head_dim; d++) ((float *)p->out)[at + d] = acc[d] * inv;
        } else {
            for (int64_t d = 0; d < head_dim; d++) ((uint16_t *)p->out)[at + d] = f32_to_bf16(acc[d] * inv);
        }
    }
}

/* Returns 0 on success, 1 when a scratch buffer could not be allocated. */
int mmkit_paged_decode_attention(
    void *out,                   /* [num_seqs, num_heads, head_dim], contiguous */
    const void *q,               /* sequence s, head h at q + s * q_row_stride + h * head_dim */
    int64_t q_row_stride,        /* elements between consecutive sequences' queries */
    const void *k_cache, const void *v_cache,
    const int64_t *block_ids,    /* [num_seqs, max_blocks], row-major */
    int64_t max_blocks,
    const int64_t *context_lens, /* [num_seqs], tokens attended (including the new one) */
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t num_blocks, int64_t block_size, float scale, int dtype, int num_threads) {
    const Problem p = {out, q, q_row_stride, k_cache, v_cache, block_ids, max_blocks, context_lens,
                       num_heads, num_kv_heads, num_blocks, block_size, scale};
    const int64_t group = num_heads / num_kv_heads;
    const int64_t num_items = num_seqs * num_kv_heads;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc((size_t)(group * max_blocks * block_size) * sizeof(float));
        float *rows = malloc((size_t)(max_blocks * block_size * head_dim) * sizeof(float));
        if (!scores || !rows) {
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
            if (dtype == MMKIT_BF16 && head_dim == 64) attend_item(&p, item, scores, rows, 64, MMKIT_BF16);
            else if (dtype == MMKIT_BF16 && head_dim == 128) attend_item(&p, item, scores, rows, 128, MMKIT_BF16);
            else if (dtype == MMKIT_F32 && head_dim == 64) attend_item(&p, item, scores, rows, 64, MMKIT_F32);
            else if (dtype == MMKIT_F32 && head_dim == 128) attend_item(&p, item, scores, rows, 128, MMKIT_F32);
            else if (dtype == MMKIT_BF16) attend_item(&p, item, scores, rows, head_dim, MMKIT_BF16);
            else attend_item(&p, item, scores, rows, head_dim, MMKIT_F32);
        }
        free(scores);
        free(rows);
    }
    return failed;
}
