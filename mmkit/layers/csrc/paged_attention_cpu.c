/* Paged decode attention for CPU: one query token per sequence, K/V read in place from the
 * paged cache (no gather copy). Built at first use by mmkit/layers/cpu_kernels.py with
 * `cc -O3 -march=native -fopenmp -shared`; the torch path in attention.py is the reference.
 *
 * Cache layout (per layer): [num_kv_heads, num_blocks, block_size, head_dim], as attention.py.
 * Work item = (sequence, kv head): the `group` query heads that share one KV head are scored
 * together, so every K/V row is read once per item. Scores for the whole context are kept
 * (exact softmax in two passes, over K then over V, float32 throughout); a decode token's
 * context is at most max_model_len, so the per-thread buffer stays small.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { MMKIT_F32 = 0, MMKIT_BF16 = 1 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    /* Round to nearest even, as torch's float -> bfloat16 cast. */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (softmax after subtracting the max), written so that loops over it
 * vectorize: libm's expf is a scalar call. Range reduction x = n ln2 + r, |r| <= ln2/2, and a
 * degree-6 Taylor polynomial on r: relative error about 2e-7 (1-2 ulp), like torch's own
 * vectorized exp. Results below about 1e-38 flush to 0 (they vanish in the softmax sum). */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f;
    const float n = __builtin_roundf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float poly = 1.0f / 720.0f;
    poly = poly * r + 1.0f / 120.0f;
    poly = poly * r + 1.0f / 24.0f;
    poly = poly * r + 1.0f / 6.0f;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.0f;
    poly = poly * r + 1.0f;
    int32_t bits;
    memcpy(&bits, &poly, sizeof bits);
    bits += (int32_t)n << 23; /* multiply by 2^n: n >= -126 here, so the exponent stays normal */
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

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

/* One (sequence, kv head) item. Inlined with constant head_dim/dtype at the call sites below
 * so the inner loops unroll into whole vector registers. */
static inline __attribute__((always_inline)) void attend_item(const Problem *p, int64_t item, float *restrict scores,
                                                               float *restrict qf, float *restrict acc,
                                                               float *restrict row, const int64_t head_dim,
                                                               const int dtype) {
    const int64_t group = p->num_heads / p->num_kv_heads;
    const int64_t max_len = p->max_blocks * p->block_size;
    const int64_t s = item / p->num_kv_heads, kvh = item % p->num_kv_heads;
    const int64_t len = p->context_lens[s];
    const int64_t *table = p->block_ids + s * p->max_blocks;
    const int64_t bs = p->block_size;
    const int64_t elem = dtype == MMKIT_F32 ? 4 : 2;
    const char *qrow = (const char *)p->q + s * p->q_row_stride * elem;

    for (int64_t g = 0; g < group; g++) {
        /* heads h = kvh * group + g share KV head kvh (transformers' repeat_kv order) */
        load_row(qf + g * head_dim, qrow, kvh * group + g, head_dim, dtype);
        for (int64_t d = 0; d < head_dim; d++) qf[g * head_dim + d] *= p->scale;
    }
    /* Pass 1: scores = q . k over the context, block by block. */
    for (int64_t b = 0, t = 0; t < len; b++) {
        const int64_t first = (kvh * p->num_blocks + table[b]) * bs;
        const int64_t end = t + bs < len ? t + bs : len;
        for (int64_t slot = first; t < end; t++, slot++) {
            load_row(row, p->k_cache, slot, head_dim, dtype);
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qf + g * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * row[d];
                scores[g * max_len + t] = dot;
            }
        }
    }
    /* Softmax per query head (normalised at the end, on the accumulator). */
    float sums[group];
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * max_len;
        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < len; t++) mx = sg[t] > mx ? sg[t] : mx;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            sg[t] = exp_nonpositive(sg[t] - mx);
            sum += sg[t];
        }
        sums[g] = sum;
    }
    /* Pass 2: out = sum_t p_t v_t / sum_t p_t. */
    memset(acc, 0, (size_t)(group * head_dim) * sizeof(float));
    for (int64_t b = 0, t = 0; t < len; b++) {
        const int64_t first = (kvh * p->num_blocks + table[b]) * bs;
        const int64_t end = t + bs < len ? t + bs : len;
        for (int64_t slot = first; t < end; t++, slot++) {
            load_row(row, p->v_cache, slot, head_dim, dtype);
            for (int64_t g = 0; g < group; g++) {
                const float pr = scores[g * max_len + t];
                float *ag = acc + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) ag[d] += pr * row[d];
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const int64_t at = (s * p->num_heads + kvh * group + g) * head_dim;
        const float inv = 1.0f / sums[g];
        const float *ag = acc + g * head_dim;
        if (dtype == MMKIT_F32) {
            for (int64_t d = 0; d < head_dim; d++) ((float *)p->out)[at + d] = ag[d] * inv;
        } else {
            for (int64_t d = 0; d < head_dim; d++) ((uint16_t *)p->out)[at + d] = f32_to_bf16(ag[d] * inv);
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
        float *qf = malloc((size_t)(group * head_dim) * sizeof(float));
        float *acc = malloc((size_t)(group * head_dim) * sizeof(float));
        float *row = malloc((size_t)head_dim * sizeof(float));
        if (!scores || !qf || !acc || !row) {
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
            if (dtype == MMKIT_BF16 && head_dim == 64) attend_item(&p, item, scores, qf, acc, row, 64, MMKIT_BF16);
            else if (dtype == MMKIT_BF16 && head_dim == 128) attend_item(&p, item, scores, qf, acc, row, 128, MMKIT_BF16);
            else if (dtype == MMKIT_F32 && head_dim == 64) attend_item(&p, item, scores, qf, acc, row, 64, MMKIT_F32);
            else if (dtype == MMKIT_F32 && head_dim == 128) attend_item(&p, item, scores, qf, acc, row, 128, MMKIT_F32);
            else if (dtype == MMKIT_BF16) attend_item(&p, item, scores, qf, acc, row, head_dim, MMKIT_BF16);
            else attend_item(&p, item, scores, qf, acc, row, head_dim, MMKIT_F32);
        }
        free(scores);
        free(qf);
        free(acc);
        free(row);
    }
    return failed;
}
