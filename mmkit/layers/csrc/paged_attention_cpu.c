/* Paged decode attention for CPU: one query token per sequence, K/V read in place from the
 * paged cache (no gather copy). Built at first use by mmkit/layers/cpu_kernels.py with
 * `cc -O3 -march=native -fopenmp -shared`; the torch path in attention.py is the reference.
 *
 * Cache layout (per layer): [num_kv_heads, num_blocks, block_size, head_dim], as attention.py.
 * Work item = (sequence, kv head): the `group` query heads sharing that KV head are scored
 * against the item's K rows, then likewise for V. The vector items (AVX-512 here, AVX2 in
 * paged_item_avx2.h) read float32 rows in place and widen bf16 rows a chunk at a time; the
 * portable item (attend_item) first copies the item's rows into a dense float32 scratch. Scores for the whole context are kept (exact softmax in two passes, float32
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

/* A decode work item: sequence s's context rows [start, len) of KV head kvh, and its `group`
 * query heads. The vector items (AVX-512 here, AVX2 in paged_item_avx2.h) share this setup. */
typedef struct {
    int64_t group, max_len, s, kvh, start, len, first_row, row_bytes;
    const int64_t *table;
} Item;

static inline Item item_of(const Problem *p, int64_t item) {
    Item it;
    it.group = p->num_heads / p->num_kv_heads;
    it.max_len = p->max_blocks * p->block_size;
    it.s = item / p->num_kv_heads;
    it.kvh = item % p->num_kv_heads;
    it.start = p->context_starts ? p->context_starts[it.s] : 0;
    it.len = p->context_lens[it.s];
    it.table = p->block_ids + it.s * p->max_blocks;
    it.first_row = it.kvh * p->num_blocks;
    it.row_bytes = 0; /* set by item_begin */
    return it;
}

/* The item's query heads as float32 times the scale: qf [group, head_dim]. */
static inline __attribute__((always_inline)) void item_queries(float *restrict qf, const Problem *p, const Item *it,
                                                                const int64_t head_dim, const int dtype) {
    const int64_t elem = dtype == MMKIT_F32 ? 4 : 2;
    const char *qrow = (const char *)p->q + it->s * p->q_row_stride * elem;
    for (int64_t g = 0; g < it->group; g++) {
        load_row(qf + g * head_dim, qrow, it->kvh * it->group + g, head_dim, dtype);
        for (int64_t d = 0; d < head_dim; d++) qf[g * head_dim + d] *= p->scale;
    }
}

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

/* n (<= 16) dense key rows [n, D] into one block of a tile's transposed keys, kb[d * 16 + i]
 * (key i along the lanes; zero for i >= n). */
static inline __attribute__((always_inline)) void transpose_keys(float *restrict kb, const float *restrict rows,
                                                                  int64_t n, const int D) {
    for (int64_t i = 0; i < 16; i++)
        for (int d = 0; d < D; d++) kb[d * 16 + i] = i < n ? rows[i * D + d] : 0.0f;
}

/* QB (a run-time count up to 6) as a compile-time constant for a tile kernel (AVX-512 and AVX2). */
#define MMKIT_TILE_QB(QB, CALL) \
    switch (QB) {               \
    case 6: CALL(6); break;     \
    case 5: CALL(5); break;     \
    case 4: CALL(4); break;     \
    case 3: CALL(3); break;     \
    case 2: CALL(2); break;     \
    default: CALL(1); break;    \
    }

/* A tile's query vectors v0 .. v0 + qn (vector v: row r0 + v / group, head kvh * group + v % group)
 * into qf [qn][D], scaled; each one's row (owners), head and context length (lens). Returns the
 * longest of those contexts. Shared by the AVX-512 and AVX2 tiles. */
static inline __attribute__((always_inline)) int64_t tile_queries(const Problem *p, int64_t r0, int64_t kvh,
                                                                   int64_t v0, int qn, float *restrict qf,
                                                                   int64_t *owners, int64_t *heads, int64_t *lens,
                                                                   const int D, const int dtype) {
    const int64_t group = p->num_heads / p->num_kv_heads, elem = dtype == MMKIT_F32 ? 4 : 2;
    int64_t longest = 0;
    for (int j = 0; j < qn; j++) {
        const int64_t r = r0 + (v0 + j) / group, g = (v0 + j) % group;
        owners[j] = r;
        heads[j] = kvh * group + g;
        lens[j] = p->context_lens[r];
        longest = lens[j] > longest ? lens[j] : longest;
        load_row(qf + j * D, (const char *)p->q + r * p->q_row_stride * elem, heads[j], D, dtype);
        for (int d = 0; d < D; d++) qf[j * D + d] *= p->scale;
    }
    return longest;
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

/* Ask for the cache lines of rows [t0, t0 + n) ahead of use. Blocks sit at random places in
 * the cache, so the hardware prefetcher cannot guess the next one: without this, half of the
 * kernel's time was spent waiting on the first loads of each block. PREFETCHT0: on Zen 5 the
 * PREFETCHT1 used before read K/V from DRAM up to 20% slower than T0 within the kernel, and in
 * a plain read of scattered 2 KiB blocks it was no faster than no prefetch at all
 * (benchmarks/results/2026-12-07-decode-attention-dram/). */
static inline __attribute__((always_inline)) void prefetch_chunk(const void *cache, const int64_t *table, int64_t t0,
                                                                  int64_t n, int64_t first_block_row,
                                                                  int64_t block_size, int64_t row_bytes) {
    int64_t b = t0 / block_size, off = t0 % block_size;
    for (int64_t i = 0; i < n;) {
        const int64_t run = n - i < block_size - off ? n - i : block_size - off; /* rows left in block b */
        const char *start = (const char *)cache + ((first_block_row + table[b]) * block_size + off) * row_bytes;
        for (int64_t byte = 0; byte < run * row_bytes; byte += 64) __builtin_prefetch(start + byte, 0, 3);
        i += run;
        off = 0;
        b++;
    }
}

/* A vector item's start: where its rows are, its query heads into qf ([group, head_dim],
 * float32, scaled), and the prefetch of its first 16 K rows. */
static inline __attribute__((always_inline)) Item item_begin(const Problem *p, int64_t item, int64_t head_dim,
                                                              int dtype, float *restrict qf) {
    Item it = item_of(p, item);
    it.row_bytes = head_dim * (dtype == MMKIT_F32 ? 4 : 2);
    item_queries(qf, p, &it, head_dim, dtype);
    const int64_t first_n = it.len - it.start < 16 ? it.len - it.start : 16;
    prefetch_chunk(p->k_cache, it.table, it.start, first_n, it.first_row, p->block_size, it.row_bytes);
    return it;
}

/* A vector item's end: each query head's accumulated P V times 1 / its softmax sum, out. */
static inline __attribute__((always_inline)) void item_store(const Problem *p, const Item *it, const float *acc_all,
                                                              const float *sums, int64_t head_dim, int dtype) {
    for (int64_t g = 0; g < it->group; g++)
        store_head(p->out, (it->s * p->num_heads + it->kvh * it->group + g) * head_dim, acc_all + g * head_dim,
                   1.0f / sums[g], head_dim, dtype);
}

/* A vector item's P V over one chunk of n rows (rp[i], float32), in vectors of W floats (VT,
 * and its LOADU, STOREU, SET1, FMADD): for each query head g, acc_g += sum_i p_g,t0+i rp[i],
 * NC accumulators held in registers across the chunk, one FMA chain over rows in order. The
 * item's scores, acc_all, group, max_len, head_dim and start are in scope. */
#define MMKIT_ITEM_PV(VT, W, LOADU, STOREU, SET1, FMADD)                                          \
    for (int64_t g = 0; g < group; g++) {                                                         \
        const float *sg = scores + g * max_len + (t0 - start);                                    \
        VT a[NC];                                                                                 \
        for (int c = 0; c < NC; c++) a[c] = LOADU(acc_all + g * head_dim + (W) * c);              \
        for (int64_t i = 0; i < n; i++) {                                                         \
            const VT pr = SET1(sg[i]);                                                            \
            for (int c = 0; c < NC; c++) a[c] = FMADD(pr, LOADU(rp[i] + (W) * c), a[c]);          \
        }                                                                                         \
        for (int c = 0; c < NC; c++) STOREU(acc_all + g * head_dim + (W) * c, a[c]);              \
    }

/* Cache rows of context tokens [t0, t0 + n): rows[i] = the row index of token t0 + i. */
static inline __attribute__((always_inline)) void chunk_slots(int64_t *slots, const int64_t *table, int64_t t0,
                                                               int64_t n, int64_t first_block_row,
                                                               int64_t block_size) {
    int64_t b = t0 / block_size, off = t0 % block_size;
    for (int64_t i = 0; i < n; i++) {
        slots[i] = (first_block_row + table[b]) * block_size + off;
        if (++off == block_size) {
            off = 0;
            b++;
        }
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

/* exp_clamped of 16 lanes (bf16.h). */
MMKIT_DEFINE_EXP_VEC(exp512, __m512, __m512i, _mm512, si512)

/* softmax_numerators for one row of `len` scores, in 16-lane vectors with a masked tail: the
 * compiler left the scalar loop's remainder (up to 15 calls of a scalar exp per row) unvectorized,
 * which was a third of a prefill tile's time. bf16 rounding as softmax_numerators (finite values). */
static inline void softmax_row512(float *sg, int64_t len, float *sum_out, const int dtype) {
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 m = len - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - t)) - 1u);
        vmx = _mm512_max_ps(vmx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, sg + t));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx));
    __m512 vs = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 m = len - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - t)) - 1u);
        const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + t), mx)));
        vs = _mm512_add_ps(vs, e);
        if (dtype == MMKIT_F32) {
            _mm512_mask_storeu_ps(sg + t, m, e);
        } else { /* round to nearest even at bit 16, as f32_to_bf16 */
            const __m512i u = _mm512_castps_si512(e);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
            _mm512_mask_storeu_ps(sg + t, m, _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32((int)0xffff0000u))));
        }
    }
    *sum_out = _mm512_reduce_add_ps(vs);
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

/* rp[i] = context row t0 + i (i < n) as float32: in place for float32 caches, else widened into
 * `rows` (16 * NC floats a row). */
static inline __attribute__((always_inline)) void chunk_rows(const float **rp, float *rows, const void *cache,
                                                              const int64_t *table, int64_t t0, int64_t n,
                                                              int64_t first_block_row, int64_t block_size,
                                                              const int NC, const int dtype) {
    if (dtype == MMKIT_F32) {
        int64_t slots[16];
        chunk_slots(slots, table, t0, n, first_block_row, block_size);
        for (int64_t i = 0; i < n; i++) rp[i] = (const float *)cache + slots[i] * 16 * NC;
    } else {
        load_chunk(rows, cache, table, t0, n, first_block_row, block_size, NC, dtype);
        for (int64_t i = 0; i < n; i++) rp[i] = rows + i * 16 * NC;
    }
}

/* How far ahead the AVX-512 decode items ask for K/V: MMKIT_DECODE_AHEAD blocks (V) or 16-row
 * chunks (K). With K/V coming from DRAM, 4 read 8-14% faster than 1
 * (benchmarks/results/2026-12-06-decode-attention/harness_ab.log, "pf" against "pv"); from
 * cache it made no difference. The float32 item's K went 1 chunk ahead until 2026-12-07. */
#define MMKIT_DECODE_AHEAD 4
/* ... and, twice as far ahead, one line of the block (chunk) to come, so that its page is
 * walked and its first line requested while the nearer blocks are still arriving, and the full
 * prefetch of that block, MMKIT_DECODE_AHEAD steps later, does not start with a TLB miss
 * (blocks are scattered over the whole pool: nearly every one starts on a page the TLB has not
 * seen; that this is where the gain comes from was not measured). From DRAM, bf16, one
 * thread, Zen 5: PREFETCHT0 alone 12-15 GB/s, with a touch 6-8 steps ahead 16-18, 12-16 steps
 * ahead 14-15; from cache level or slightly faster
 * (benchmarks/results/2026-12-07-decode-attention-dram/variants.log). */
#define MMKIT_DECODE_TOUCH (2 * MMKIT_DECODE_AHEAD)

/* The K pass's far touch (MMKIT_DECODE_TOUCH): while at the 16-row chunk starting at t0, one
 * line of the row 16 MMKIT_DECODE_TOUCH rows ahead; past K's last row it runs on into V's rows
 * from `start`, which the P V pass reads next. */
static inline __attribute__((always_inline)) void touch_ahead(const void *k_cache, const void *v_cache,
                                                               const int64_t *table, int64_t t0, int64_t start,
                                                               int64_t len, int64_t first_block_row,
                                                               int64_t block_size, int64_t row_bytes) {
    int64_t t = t0 + 16 * MMKIT_DECODE_TOUCH;
    const void *cache = k_cache;
    if (t >= len) {
        t = t - len + start;
        cache = v_cache;
        if (t >= len) return;
    }
    const int64_t b = t / block_size, off = t % block_size;
    __builtin_prefetch((const char *)cache + ((first_block_row + table[b]) * block_size + off) * row_bytes, 0, 3);
}

/* Context rows of one KV head in order, from row `start`: `row` is the current row, and each
 * step into a new block asks for the block MMKIT_DECODE_AHEAD further ahead of use and
 * touches the one MMKIT_DECODE_TOUCH ahead (prefetch_chunk's reasoning: blocks sit at random
 * places, so the hardware prefetcher cannot guess them). */
typedef struct {
    const char *row;
    const char *cache;
    const int64_t *table;
    int64_t b, off, first_row, block_size, row_bytes, last_block;
} RowWalk;

static inline __attribute__((always_inline)) void prefetch_block(const RowWalk *w, int64_t b) {
    if (b > w->last_block) return;
    const char *at = w->cache + (w->first_row + w->table[b]) * w->block_size * w->row_bytes;
    for (int64_t byte = 0; byte < w->block_size * w->row_bytes; byte += 64) __builtin_prefetch(at + byte, 0, 3);
}

static inline __attribute__((always_inline)) RowWalk row_walk(const void *cache, const int64_t *table, int64_t start,
                                                               int64_t len, int64_t first_row, int64_t block_size,
                                                               int64_t row_bytes) {
    RowWalk w = {NULL, (const char *)cache, table, start / block_size, start % block_size, first_row, block_size,
                 row_bytes, (len - 1) / block_size};
    w.row = w.cache + ((first_row + table[w.b]) * block_size + w.off) * row_bytes;
    for (int k = 1; k <= MMKIT_DECODE_AHEAD; k++) prefetch_block(&w, w.b + k);
    return w;
}

/* To the next row (which must exist unless this was the context's last). */
static inline __attribute__((always_inline)) void row_next(RowWalk *w) {
    if (++w->off < w->block_size) {
        w->row += w->row_bytes;
        return;
    }
    w->off = 0;
    if (++w->b > w->last_block) return;
    w->row = w->cache + (w->first_row + w->table[w->b]) * w->block_size * w->row_bytes;
    prefetch_block(w, w->b + MMKIT_DECODE_AHEAD);
    if (w->b + MMKIT_DECODE_TOUCH <= w->last_block)
        __builtin_prefetch(w->cache + (w->first_row + w->table[w->b + MMKIT_DECODE_TOUCH]) * w->block_size * w->row_bytes,
                           0, 3);
}

/* P V of H (<= 6) query heads of a float32 item over its context rows [start, len) read in
 * place: out[h * 16 NC ...] = sum over t of pr[h * stride + t - start] v_t, t in order (one FMA
 * chain per element, as MMKIT_ITEM_PV). All H heads' accumulators stay in registers over the
 * whole context, so each V row is loaded once for the group and H * NC chains run side by side
 * (one head's NC chains a chunk at a time, through memory, left the FMA units mostly idle). */
static inline __attribute__((always_inline)) void pv_heads_f32(float *out, const float *pr, int64_t stride,
                                                                RowWalk w, int64_t n, const int NC, const int H) {
    __m512 a[6][8];
    for (int h = 0; h < H; h++)
        for (int c = 0; c < NC; c++) a[h][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        const float *v = (const float *)w.row;
        for (int c = 0; c < NC; c++) {
            const __m512 vc = _mm512_loadu_ps(v + 16 * c);
            for (int h = 0; h < H; h++) a[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(pr[h * stride + i]), vc, a[h][c]);
        }
        if (i + 1 < n) row_next(&w);
    }
    for (int h = 0; h < H; h++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(out + h * 16 * NC + 16 * c, a[h][c]);
}

/* attend_item for head_dim = 16 * NC with AVX-512: bf16 rows are widened and staged 16 at a
 * time (L1), float32 rows are read in place; the 16 scores of a chunk are reduced together. P V:
 * float32 through pv_heads_f32 (a group of heads over the whole context in registers), bf16 (CPUs
 * without AVX512-BF16) one head at a time per chunk. */
static inline __attribute__((always_inline)) void attend_item_avx512(const Problem *p, int64_t item,
                                                                      float *restrict scores, float *restrict acc_all,
                                                                      float *restrict rows, const int NC,
                                                                      const int dtype) {
    const int64_t head_dim = 16 * NC;
    float qf[p->num_heads / p->num_kv_heads * head_dim];
    const Item it = item_begin(p, item, head_dim, dtype, qf);
    const int64_t group = it.group, max_len = it.max_len, start = it.start, len = it.len, first_row = it.first_row;
    const int64_t *table = it.table, row_bytes = it.row_bytes;
    /* Pass 1: scores. Rows t0 in [start, len); scores and softmax index them from 0 (t0 - start). */
    const int64_t first_n = len - start < 16 * MMKIT_DECODE_AHEAD ? len - start : 16 * MMKIT_DECODE_AHEAD;
    if (first_n > 16) prefetch_chunk(p->k_cache, table, start + 16, first_n - 16, first_row, p->block_size, row_bytes);
    int v_asked = 0;
    for (int64_t t0 = start; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        const int64_t at = t0 + 16 * MMKIT_DECODE_AHEAD;
        const int64_t ahead = len - at < 16 ? len - at : 16;
        if (ahead > 0) {
            prefetch_chunk(p->k_cache, table, at, ahead, first_row, p->block_size, row_bytes);
        } else if (!v_asked) {
            prefetch_chunk(p->v_cache, table, start, first_n, first_row, p->block_size, row_bytes);
            v_asked = 1;
        }
        touch_ahead(p->k_cache, p->v_cache, table, t0, start, len, first_row, p->block_size, row_bytes);
        const float *rp[16]; /* the chunk's K rows as float32 */
        chunk_rows(rp, rows, p->k_cache, table, t0, n, first_row, p->block_size, NC, dtype);
        for (int64_t g = 0; g < group; g++) {
            __m512 q[NC];
            for (int c = 0; c < NC; c++) q[c] = _mm512_loadu_ps(qf + g * head_dim + 16 * c);
            __m512 part[16];
            for (int64_t i = 0; i < 16; i++) {
                __m512 a = _mm512_setzero_ps();
                if (i < n)
                    for (int c = 0; c < NC; c++) a = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(rp[i] + 16 * c), a);
                part[i] = a;
            }
            _mm512_mask_storeu_ps(scores + g * max_len + (t0 - start), (__mmask16)((1u << n) - 1u), reduce16(part));
        }
    }
    /* Softmax numerators and sums per query head (normalised on the output). */
    float sums[group];
    for (int64_t g = 0; g < group; g++) softmax_row512(scores + g * max_len, len - start, sums + g, dtype);
    /* Pass 2: acc_g = sum_t p_gt v_t */
    if (dtype == MMKIT_F32) {
        const int HB = 24 / NC;
        for (int64_t h0 = 0; h0 < group; h0 += HB) {
            const RowWalk w = row_walk(p->v_cache, table, start, len, first_row, p->block_size, row_bytes);
            const int hn = group - h0 < HB ? (int)(group - h0) : HB;
#define MMKIT_PV_F32(H) pv_heads_f32(acc_all + h0 * head_dim, scores + h0 * max_len, max_len, w, len - start, NC, H)
            MMKIT_TILE_QB(hn, MMKIT_PV_F32)
#undef MMKIT_PV_F32
        }
        item_store(p, &it, acc_all, sums, head_dim, dtype);
        return;
    }
    for (int64_t i = 0; i < group * head_dim; i++) acc_all[i] = 0.0f;
    for (int64_t t0 = start; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        const int64_t ahead = len - t0 - 16 < 16 ? len - t0 - 16 : 16;
        if (ahead > 0) prefetch_chunk(p->v_cache, table, t0 + 16, ahead, first_row, p->block_size, row_bytes);
        const float *rp[16]; /* the chunk's V rows as float32 */
        chunk_rows(rp, rows, p->v_cache, table, t0, n, first_row, p->block_size, NC, dtype);
        MMKIT_ITEM_PV(__m512, 16, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps, _mm512_fmadd_ps)
    }
    item_store(p, &it, acc_all, sums, head_dim, dtype);
}
#endif

/* Per-thread scratch that only grows: a decode step calls the kernel once per layer, and
 * long contexts need buffers past malloc's mmap threshold, which would be mapped, faulted in
 * and unmapped on every call. Returns NULL when the allocation fails. */
static float *thread_scratch(int which, size_t count) {
    static __thread float *buffers[5];
    static __thread size_t sizes[5];
    if (sizes[which] < count) {
        float *grown = realloc(buffers[which], count * sizeof(float));
        if (grown == NULL) return NULL;
        buffers[which] = grown;
        sizes[which] = count;
    }
    return buffers[which];
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* The bf16-rounded probabilities of a row of n scores as pairs: dword k = (p_2k, p_2k+1) (the
 * second zero past the end), written in place over the row's first (n + 1) / 2 floats. Exact:
 * softmax_row512 left bf16 values in float32. */
static inline void pair_probabilities(float *sg, int64_t n) {
    uint32_t *pp = (uint32_t *)sg;
    for (int64_t t = 0; t < n; t += 16) {
        const int64_t live = n - t < 16 ? n - t : 16;
        const __m256i pairs = (__m256i)_mm512_cvtneps_pbh(
            _mm512_maskz_loadu_ps((__mmask16)((1u << live) - 1u), sg + t));
        /* only the row's own pairs: a short row (fewer than 16 slots) must not spill into the next */
        _mm256_mask_storeu_epi32(pp + t / 2, (__mmask8)((1u << ((live + 1) / 2)) - 1u), pairs);
    }
}

/* P V of H (<= 6) query heads of a bf16 item over its n context rows, two keys per VDPBF16PS:
 * the V rows of keys 2k, 2k + 1 interleaved per element by two in-lane unpacks (no widening),
 * against the pair (p_2k, p_2k+1) of each head (pp[h * stride + k]). The unpacks put elements in
 * a permuted order (dword 4L + j of vector 2c is element 32c + 8L + j, of vector 2c + 1 element
 * 32c + 8L + 4 + j, for 128-bit lane L): out gets the accumulators in that order. As in
 * pv_heads_f32, the H * NC accumulators stay in registers over the whole context; each element's
 * sum is the same chain of pair products as before, so results are unchanged. */
static inline __attribute__((always_inline)) void pv_heads_bf16(float *out, const uint32_t *pp, int64_t stride,
                                                                 RowWalk w, int64_t n, const int NC, const int H) {
    __m512 a[6][8];
    for (int h = 0; h < H; h++)
        for (int c = 0; c < NC; c++) a[h][c] = _mm512_setzero_ps();
    for (int64_t i = 0, k = 0; i < n; i += 2, k++) {
        const uint16_t *r0 = (const uint16_t *)w.row;
        if (i + 1 < n) row_next(&w);
        const uint16_t *r1 = i + 1 < n ? (const uint16_t *)w.row : NULL;
        if (i + 2 < n) row_next(&w);
        for (int c = 0; c < NC / 2; c++) {
            const __m512i x = _mm512_loadu_si512(r0 + 32 * c);
            const __m512i y = r1 ? _mm512_loadu_si512(r1 + 32 * c) : _mm512_setzero_si512();
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
            for (int h = 0; h < H; h++) {
                const __m512bh pk = (__m512bh)_mm512_set1_epi32((int)pp[h * stride + k]);
                a[h][2 * c] = _mm512_dpbf16_ps(a[h][2 * c], pk, lo);
                a[h][2 * c + 1] = _mm512_dpbf16_ps(a[h][2 * c + 1], pk, hi);
            }
        }
    }
    for (int h = 0; h < H; h++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(out + h * 16 * NC + 16 * c, a[h][c]);
}

/* Accumulators of pv_heads_bf16 (one head, 16 * NC floats) back into element order. */
static inline __attribute__((always_inline)) void unpermute_pairs(float *restrict dst, const float *restrict acc,
                                                                   const int NC) {
    for (int c = 0; c < NC / 2; c++)
        for (int L = 0; L < 4; L++)
            for (int j = 0; j < 4; j++) {
                dst[32 * c + 8 * L + j] = acc[32 * c + 4 * L + j];
                dst[32 * c + 8 * L + 4 + j] = acc[32 * c + 16 + 4 * L + j];
            }
}

/* Scores of HB (2, 3 or 4) query heads against one chunk of n (<= 16) keys (rows slots[i]), bf16,
 * KB = 8 (HB 2) or 4 keys at a time (HB 3 leaves lanes 12-15 unused): each K row is loaded once
 * for the HB heads (before, once per head), and one reduce16 sums the HB x KB dot products (lane
 * h * KB + i: head h, key i). Each score is the same sum as before: VDPBF16PS along the row, then
 * reduce16's tree over its lanes. out[h * stride + i] = scale * q_h . k_i. With 4 heads of 64
 * (Llama-style 32/8 GQA) the call was about 10% faster, with heads of 128 up to 1.3x. */
static inline __attribute__((always_inline)) void chunk_scores_bf16(float *out, int64_t stride, const uint16_t *kc,
                                                                     const int64_t *slots, int64_t n,
                                                                     const uint16_t *q0, __m512 scale, const int NC,
                                                                     const int HB) {
    const int64_t head_dim = 16 * NC;
    const int KB = HB == 2 ? 8 : 4;
    __m512bh q[4][4];
    for (int h = 0; h < HB; h++)
        for (int c = 0; c < NC / 2; c++) q[h][c] = (__m512bh)_mm512_loadu_si512(q0 + h * head_dim + 32 * c);
    for (int64_t i0 = 0; i0 < n; i0 += KB) {
        __m512 part[16];
        for (int j = 0; j < 16; j++) part[j] = _mm512_setzero_ps();
        for (int i = 0; i < KB; i++) {
            if (i0 + i >= n) break;
            __m512bh k[4];
            for (int c = 0; c < NC / 2; c++) k[c] = (__m512bh)_mm512_loadu_si512(kc + slots[i0 + i] * head_dim + 32 * c);
            for (int h = 0; h < HB; h++) {
                __m512 a = _mm512_setzero_ps();
                for (int c = 0; c < NC / 2; c++) a = _mm512_dpbf16_ps(a, q[h][c], k[c]);
                part[h * KB + i] = a;
            }
        }
        const __m512 sc = _mm512_mul_ps(reduce16(part), scale);
        const int64_t m = n - i0 < KB ? n - i0 : KB;
        if (KB == 8) {
            for (int h = 0; h < HB; h++)
                _mm256_mask_storeu_ps(out + h * stride + i0, (__mmask8)((1u << m) - 1u),
                                      h ? _mm512_extractf32x8_ps(sc, 1) : _mm512_castps512_ps256(sc));
        } else {
            const __mmask8 live = (__mmask8)((1u << m) - 1u);
            _mm_mask_storeu_ps(out + i0, live, _mm512_castps512_ps128(sc));
            _mm_mask_storeu_ps(out + stride + i0, live, _mm512_extractf32x4_ps(sc, 1));
            _mm_mask_storeu_ps(out + 2 * stride + i0, live, _mm512_extractf32x4_ps(sc, 2));
            if (HB == 4) _mm_mask_storeu_ps(out + 3 * stride + i0, live, _mm512_extractf32x4_ps(sc, 3));
        }
    }
}

/* attend_item_avx512 for bf16 on CPUs with AVX512-BF16: the cache rows are used as bf16, never
 * widened and staged (that widening was about half of the decode kernel's time). Scores are
 * q . k by VDPBF16PS (bf16 products are exact in float32; sums in float32), then times the
 * scale, as torch's flash attention computes q k^T before scaling. P V pairs consecutive keys:
 * the bf16-rounded probabilities of keys t, t + 1 against V rows t, t + 1 interleaved per
 * element, one VDPBF16PS per 16 outputs per pair. The same softmax as the other paths. */
static inline __attribute__((always_inline)) void attend_item_bf16dp(const Problem *p, int64_t item,
                                                                      float *restrict scores,
                                                                      float *restrict acc_all, const int NC) {
    const int64_t head_dim = 16 * NC;
    const Item it = item_of(p, item);
    const int64_t group = it.group, max_len = it.max_len, s = it.s, kvh = it.kvh, start = it.start, len = it.len;
    const int64_t first_row = it.first_row;
    const int64_t *table = it.table;
    const uint16_t *qrow = (const uint16_t *)p->q + s * p->q_row_stride;
    const uint16_t *kc = (const uint16_t *)p->k_cache, *vc = (const uint16_t *)p->v_cache;
    const int64_t row_bytes = head_dim * 2;
    const __m512 scale = _mm512_set1_ps(p->scale);
    int64_t slots[16];
    /* Pass 1: scores */
    const int64_t first_n = len - start < 16 * MMKIT_DECODE_AHEAD ? len - start : 16 * MMKIT_DECODE_AHEAD;
    int v_asked = 0;
    prefetch_chunk(kc, table, start, first_n, first_row, p->block_size, row_bytes);
    for (int64_t t0 = start; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        const int64_t at = t0 + 16 * MMKIT_DECODE_AHEAD;
        const int64_t ahead = len - at < 16 ? len - at : 16;
        if (ahead > 0) {
            prefetch_chunk(kc, table, at, ahead, first_row, p->block_size, row_bytes);
        } else if (!v_asked) { /* past K's end: V's first rows */
            prefetch_chunk(vc, table, start, first_n, first_row, p->block_size, row_bytes);
            v_asked = 1;
        }
        touch_ahead(kc, vc, table, t0, start, len, first_row, p->block_size, row_bytes);
        chunk_slots(slots, table, t0, n, first_row, p->block_size);
        /* heads 4 at a time (head dim 64; a last 3 together too) or 2 (128: their query
         * registers), the rest one by one */
        for (int64_t h0 = 0; h0 < group;) {
            const int64_t left = group - h0;
            const int hb = NC == 4 ? (left >= 4 ? 4 : left == 3 ? 3 : 1) : (left >= 2 ? 2 : 1);
            float *out = scores + h0 * max_len + (t0 - start);
            const uint16_t *q0 = qrow + (kvh * group + h0) * head_dim;
            if (hb == 4) {
                chunk_scores_bf16(out, max_len, kc, slots, n, q0, scale, NC, 4);
            } else if (hb == 3) {
                chunk_scores_bf16(out, max_len, kc, slots, n, q0, scale, NC, 3);
            } else if (hb == 2) {
                chunk_scores_bf16(out, max_len, kc, slots, n, q0, scale, NC, 2);
            } else { /* one head against the 16 keys */
                __m512bh q[4];
                for (int c = 0; c < NC / 2; c++) q[c] = (__m512bh)_mm512_loadu_si512(q0 + 32 * c);
                __m512 part[16];
                for (int64_t i = 0; i < 16; i++) {
                    __m512 a = _mm512_setzero_ps();
                    if (i < n)
                        for (int c = 0; c < NC / 2; c++)
                            a = _mm512_dpbf16_ps(a, q[c], (__m512bh)_mm512_loadu_si512(kc + slots[i] * head_dim + 32 * c));
                    part[i] = a;
                }
                _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1u), _mm512_mul_ps(reduce16(part), scale));
            }
            h0 += hb;
        }
    }
    float sums[group];
    for (int64_t g = 0; g < group; g++) softmax_row512(scores + g * max_len, len - start, sums + g, MMKIT_BF16);
    /* Pass 2: acc_g = sum_t p_gt v_t, two keys per VDPBF16PS, up to 6 heads at a time */
    for (int64_t g = 0; g < group; g++) pair_probabilities(scores + g * max_len, len - start);
    const int HB = 24 / NC;
    for (int64_t h0 = 0; h0 < group; h0 += HB) {
        const RowWalk w = row_walk(vc, table, start, len, first_row, p->block_size, row_bytes);
        const int hn = group - h0 < HB ? (int)(group - h0) : HB;
        const uint32_t *pp = (const uint32_t *)(scores + h0 * max_len);
#define MMKIT_PV_BF16(H) pv_heads_bf16(acc_all + h0 * head_dim, pp, max_len, w, len - start, NC, H)
        MMKIT_TILE_QB(hn, MMKIT_PV_BF16)
#undef MMKIT_PV_BF16
    }
    for (int64_t g = 0; g < group; g++) {
        float acc[128];
        unpermute_pairs(acc, acc_all + g * head_dim, NC);
        store_head(p->out, (s * p->num_heads + kvh * group + g) * head_dim, acc, 1.0f / sums[g], head_dim,
                   MMKIT_BF16);
    }
}
#endif

/* One (sequence, kv head) item, gathering its own context from the cache: the compiled
 * variant for the head size and dtype (constant loop bounds), else the generic one. */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include "paged_item_avx2.h"
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* The bf16 items in functions of their own: inlined into attend_one beside the other variants,
 * their code moved whenever any other variant changed, and from DRAM the call ran 10% slower or
 * faster with it (same instructions, other addresses). */
static __attribute__((noinline)) void item_bf16dp_64(const Problem *p, int64_t item, float *scores, float *acc) {
    attend_item_bf16dp(p, item, scores, acc, 4);
}
static __attribute__((noinline)) void item_bf16dp_128(const Problem *p, int64_t item, float *scores, float *acc) {
    attend_item_bf16dp(p, item, scores, acc, 8);
}
#endif

static void attend_one(const Problem *p, int64_t item, float *scores, float *acc, float *rows, int64_t head_dim,
                       int dtype) {
    (void)acc; /* scratch of the AVX-512 and AVX2 variants only */
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
    if (dtype == MMKIT_BF16 && head_dim == 64) item_bf16dp_64(p, item, scores, acc);
    else if (dtype == MMKIT_BF16 && head_dim == 128) item_bf16dp_128(p, item, scores, acc);
    else
#endif
    if (dtype == MMKIT_BF16 && head_dim == 64) attend_item_avx512(p, item, scores, acc, rows, 4, MMKIT_BF16);
    else if (dtype == MMKIT_BF16 && head_dim == 128) attend_item_avx512(p, item, scores, acc, rows, 8, MMKIT_BF16);
    else if (dtype == MMKIT_F32 && head_dim == 64) attend_item_avx512(p, item, scores, acc, rows, 4, MMKIT_F32);
    else if (dtype == MMKIT_F32 && head_dim == 128) attend_item_avx512(p, item, scores, acc, rows, 8, MMKIT_F32);
    else
#elif defined(__AVX2__) && defined(__FMA__)
    if (dtype == MMKIT_BF16 && head_dim == 64) attend_item_avx2(p, item, scores, acc, rows, 8, MMKIT_BF16);
    else if (dtype == MMKIT_BF16 && head_dim == 128) attend_item_avx2(p, item, scores, acc, rows, 16, MMKIT_BF16);
    else if (dtype == MMKIT_F32 && head_dim == 64) attend_item_avx2(p, item, scores, acc, rows, 8, MMKIT_F32);
    else if (dtype == MMKIT_F32 && head_dim == 128) attend_item_avx2(p, item, scores, acc, rows, 16, MMKIT_F32);
    else
#endif
    if (dtype == MMKIT_BF16 && head_dim == 64) attend_item(p, item, scores, rows, 64, MMKIT_BF16);
    else if (dtype == MMKIT_BF16 && head_dim == 128) attend_item(p, item, scores, rows, 128, MMKIT_BF16);
    else if (dtype == MMKIT_F32 && head_dim == 64) attend_item(p, item, scores, rows, 64, MMKIT_F32);
    else if (dtype == MMKIT_F32 && head_dim == 128) attend_item(p, item, scores, rows, 128, MMKIT_F32);
    else if (dtype == MMKIT_BF16) attend_item(p, item, scores, rows, head_dim, MMKIT_BF16);
    else attend_item(p, item, scores, rows, head_dim, MMKIT_F32);
}

#if defined(__AVX512F__)
/* A tile's arithmetic as two small matrix products, register-blocked like a GEMM: the decode
 * kernel's dot products (one query against 16 keys, then a 16-way horizontal reduction) run at
 * about a tenth of the FMA peak, while here each loaded vector of K or V feeds QB queries.
 *
 * Scores of QB query vectors (qf: [QB][D], scaled, float32) against KB blocks of 16 keys from
 * block b0 (kt: [blocks][D][16], keys along the lanes): out[q * stride + key]. Each score is a
 * sum over d in order, whatever QB and KB, so a row's result does not depend on its tile. */
static inline __attribute__((always_inline)) void tile_scores(float *restrict out, int64_t stride,
                                                               const float *restrict qf, const float *restrict kt,
                                                               int64_t b0, const int QB, const int KB, const int D) {
    __m512 acc[6][2];
    for (int q = 0; q < QB; q++)
        for (int k = 0; k < KB; k++) acc[q][k] = _mm512_setzero_ps();
    const float *kb = kt + b0 * D * 16;
    for (int d = 0; d < D; d++) {
        __m512 kv[2];
        for (int k = 0; k < KB; k++) kv[k] = _mm512_loadu_ps(kb + ((int64_t)k * D + d) * 16);
        for (int q = 0; q < QB; q++) {
            const __m512 qb = _mm512_set1_ps(qf[q * D + d]);
            for (int k = 0; k < KB; k++) acc[q][k] = _mm512_fmadd_ps(qb, kv[k], acc[q][k]);
        }
    }
    for (int q = 0; q < QB; q++)
        for (int k = 0; k < KB; k++) _mm512_storeu_ps(out + q * stride + 16 * (b0 + k), acc[q][k]);
}

/* out[q][D] = sum over t < len of pr[q * stride + t] * vd[t][D], t in order (QB * NC <= 24
 * accumulators in registers). */
static inline __attribute__((always_inline)) void tile_values(float *restrict out, const float *restrict pr,
                                                               int64_t stride, const float *restrict vd, int64_t len,
                                                               const int QB, const int NC) {
    __m512 acc[6][8];
    for (int q = 0; q < QB; q++)
        for (int c = 0; c < NC; c++) acc[q][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        __m512 v[8];
        for (int c = 0; c < NC; c++) v[c] = _mm512_loadu_ps(vd + t * 16 * NC + 16 * c);
        for (int q = 0; q < QB; q++) {
            const __m512 pb = _mm512_set1_ps(pr[q * stride + t]);
            for (int c = 0; c < NC; c++) acc[q][c] = _mm512_fmadd_ps(pb, v[c], acc[q][c]);
        }
    }
    for (int q = 0; q < QB; q++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(out + q * 16 * NC + 16 * c, acc[q][c]);
}

/* Rows [r0, r1) of one tile for KV head kvh (see attend_tile). The tile's context is gathered
 * once: K transposed into blocks of 16 keys (kt), V dense (vd). The tile's query vectors (row,
 * head of the group) then go QG at a time: scores for all of them over the keys the longest
 * sees, each one's softmax over its own causal prefix (the rest zeroed), and P V. */
static inline __attribute__((always_inline)) void attend_tile_avx512(const Problem *p, int64_t r0, int64_t r1,
                                                                      int64_t kvh, float *restrict scores,
                                                                      float *restrict rows, float *restrict kt,
                                                                      float *restrict vd, const int NC,
                                                                      const int dtype) {
    const int D = 16 * NC, QG = 24 / NC;
    const int64_t group = p->num_heads / p->num_kv_heads;
    const int64_t len = p->context_lens[r1 - 1], nb = (len + 15) / 16, stride = nb * 16;
    const int64_t *table = p->block_ids + r0 * p->max_blocks;
    const int64_t first_row = kvh * p->num_blocks;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t n = len - 16 * b < 16 ? len - 16 * b : 16;
        load_chunk(rows, p->k_cache, table, 16 * b, n, first_row, p->block_size, NC, dtype);
        transpose_keys(kt + b * D * 16, rows, n, D);
        load_chunk(vd + 16 * b * D, p->v_cache, table, 16 * b, n, first_row, p->block_size, NC, dtype);
    }
    const int64_t num_vectors = (r1 - r0) * group;
    for (int64_t v0 = 0; v0 < num_vectors; v0 += QG) {
        const int qn = num_vectors - v0 < QG ? (int)(num_vectors - v0) : QG;
        float qf[6 * 128], out[6 * 128], sums[6]; /* QG * D <= 384; sized for the unused QB cases */
        int64_t lens[6], heads[6], owners[6];
        const int64_t longest = tile_queries(p, r0, kvh, v0, qn, qf, owners, heads, lens, D, dtype);
        const int64_t blocks = (longest + 15) / 16;
        int64_t b = 0;
#define MMKIT_SCORES2(QB) tile_scores(scores, stride, qf, kt, b, QB, 2, D)
#define MMKIT_SCORES1(QB) tile_scores(scores, stride, qf, kt, b, QB, 1, D)
        for (; b + 2 <= blocks; b += 2) MMKIT_TILE_QB(qn, MMKIT_SCORES2)
        if (b < blocks) MMKIT_TILE_QB(qn, MMKIT_SCORES1)
#undef MMKIT_SCORES2
#undef MMKIT_SCORES1
        for (int j = 0; j < qn; j++) {
            float *sj = scores + j * stride;
            softmax_row512(sj, lens[j], sums + j, dtype);
            for (int64_t t = lens[j]; t < longest; t++) sj[t] = 0.0f; /* keys after this query's */
        }
#define MMKIT_VALUES(QB) tile_values(out, scores, stride, vd, longest, QB, NC)
        MMKIT_TILE_QB(qn, MMKIT_VALUES)
#undef MMKIT_VALUES
        for (int j = 0; j < qn; j++)
            store_head(p->out, (owners[j] * p->num_heads + heads[j]) * D, out + j * D, 1.0f / sums[j], D, dtype);
    }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include "paged_tile_avx2.h"
#endif

/* Rows [r0, r1) of one tile for KV head kvh: rows of one sequence (one block table), context
 * lengths non-decreasing, every context from row 0 (a prefill chunk's tokens in order). The
 * tile's context is read from the cache once for all its rows (attend_tile_avx512, or
 * attend_tile_avx2 on CPUs without AVX-512), where the decode kernel would read it once per row.
 * For another head size, a build with neither, or a tile of one row (a decode), the rows run
 * one by one. */
static void attend_tile(const Problem *p, int64_t r0, int64_t r1, int64_t kvh, float *scores, float *acc,
                        float *rows, float *kt, float *vd, int64_t head_dim, int dtype) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512F__)
#define MMKIT_TILE_KERNEL attend_tile_avx512
#else
#define MMKIT_TILE_KERNEL attend_tile_avx2
#endif
    if (r1 - r0 > 1 && (head_dim == 64 || head_dim == 128)) {
        if (head_dim == 64 && dtype == MMKIT_BF16) MMKIT_TILE_KERNEL(p, r0, r1, kvh, scores, rows, kt, vd, 4, MMKIT_BF16);
        else if (head_dim == 64) MMKIT_TILE_KERNEL(p, r0, r1, kvh, scores, rows, kt, vd, 4, MMKIT_F32);
        else if (dtype == MMKIT_BF16) MMKIT_TILE_KERNEL(p, r0, r1, kvh, scores, rows, kt, vd, 8, MMKIT_BF16);
        else MMKIT_TILE_KERNEL(p, r0, r1, kvh, scores, rows, kt, vd, 8, MMKIT_F32);
        return;
    }
#undef MMKIT_TILE_KERNEL
#else
    (void)kt;
    (void)vd;
#endif
    for (int64_t r = r0; r < r1; r++) attend_one(p, r * p->num_kv_heads + kvh, scores, acc, rows, head_dim, dtype);
}

/* Both entry points below: rows [0, num_seqs) of the problem, each alone (tiles NULL: one work
 * item per row and KV head) or grouped in tiles (one item per tile and KV head). Returns 0, 1
 * when a scratch buffer could not be allocated, 2 (bounds-checking build, -DMMKIT_KERNEL_CHECKS)
 * when a block id, a context length or a tile is out of range. */
static int run_rows(const Problem *p, const int64_t *tiles, int64_t num_tiles, int64_t num_seqs,
                    int64_t head_dim, int dtype, int num_threads) {
    const int64_t group = p->num_heads / p->num_kv_heads;
    const int64_t max_blocks = p->max_blocks, block_size = p->block_size, nkv = p->num_kv_heads;
    const int64_t num_items = (tiles ? num_tiles : num_seqs) * nkv;
    int failed = 0;
#ifdef MMKIT_KERNEL_CHECKS
    /* Every block a context reads must exist, before any thread reads one. */
    if (nkv <= 0 || p->num_heads % nkv != 0) return 2;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = p->context_lens[s];
        if (len < 1 || len > max_blocks * block_size) return 2;
        if (p->context_starts && (p->context_starts[s] < 0 || p->context_starts[s] >= len)) return 2;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; b++) {
            const int64_t id = p->block_ids[s * max_blocks + b];
            if (id < 0 || id >= p->num_blocks) return 2;
        }
    }
    if (tiles) { /* tiles partition the rows; a tile's rows share a table, lengths non-decreasing */
        if (tiles[0] != 0 || tiles[num_tiles] != num_seqs) return 2;
        for (int64_t i = 0; i < num_tiles; i++) {
            if (tiles[i + 1] <= tiles[i]) return 2;
            for (int64_t s = tiles[i] + 1; s < tiles[i + 1]; s++) {
                if (p->context_lens[s] < p->context_lens[s - 1]) return 2;
                for (int64_t b = 0; b < max_blocks; b++)
                    if (p->block_ids[s * max_blocks + b] != p->block_ids[tiles[i] * max_blocks + b]) return 2;
            }
        }
    }
#endif

    /* A small batch (a few short sequences) runs on the calling thread: waking OpenMP's
     * sleeping worker (OMP_WAIT_POLICY=PASSIVE) costs more than its share of the work. */
#pragma omp parallel num_threads(num_threads) if (num_seqs * nkv * max_blocks * block_size * head_dim >= (1 << 18))
    {
        const size_t context = (size_t)(max_blocks * block_size) + 16;
        /* scores: a row's group of heads, or a tile's QG (<= 6) query vectors */
        float *scores = thread_scratch(0, (size_t)(group > 6 ? group : 6) * context);
        float *rows = thread_scratch(1, context * (size_t)head_dim);
        float *acc = thread_scratch(2, (size_t)(group * head_dim));
        /* a tile's context, K transposed and V dense (rows alone never need them) */
        float *kt = tiles ? thread_scratch(3, context * (size_t)head_dim) : NULL;
        float *vd = tiles ? thread_scratch(4, context * (size_t)head_dim) : NULL;
        if (!scores || !rows || !acc || (tiles && (!kt || !vd))) {
#pragma omp atomic write
            failed = 1;
        }
        /* Every thread reaches the loop: a worksharing construct must be met by all. Tiles
         * grow longer along a chunk, so they are handed out one at a time. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++) {
            int stop;
#pragma omp atomic read
            stop = failed;
            if (stop) continue;
            if (tiles) {
                const int64_t t = item / nkv, kvh = item % nkv;
                attend_tile(p, tiles[t], tiles[t + 1], kvh, scores, acc, rows, kt, vd, head_dim, dtype);
            } else {
                attend_one(p, item, scores, acc, rows, head_dim, dtype);
            }
        }
    }
    return failed;
}

/* Returns as run_rows. */
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
    return run_rows(&p, NULL, 0, num_seqs, head_dim, dtype, num_threads);
}

/* The paged kernel over rows grouped in tiles: tile i is rows [tiles[i], tiles[i + 1]) (tiles
 * has num_tiles + 1 entries, tiles[num_tiles] = num_seqs). A tile of one row is a decode row;
 * a longer tile holds consecutive tokens of one prefill chunk (see attend_tile). Arguments
 * otherwise as mmkit_paged_decode_attention, without context_starts (global layers only).
 * Returns as run_rows. */
int mmkit_paged_rows_attention(void *out, const void *q, int64_t q_row_stride, const void *k_cache,
                               const void *v_cache, const int64_t *block_ids, int64_t max_blocks,
                               const int64_t *context_lens, const int64_t *tiles, int64_t num_tiles,
                               int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t num_blocks, int64_t block_size, float scale, int dtype, int num_threads) {
    const Problem p = {out, q, q_row_stride, k_cache, v_cache, block_ids, max_blocks, context_lens, NULL,
                       num_heads, num_kv_heads, num_blocks, block_size, scale};
    return run_rows(&p, tiles, num_tiles, num_seqs, head_dim, dtype, num_threads);
}
