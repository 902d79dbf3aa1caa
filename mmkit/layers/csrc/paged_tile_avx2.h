/* Prefill tiles of the paged rows kernel on CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3,
 * Intel Haswell to Comet Lake). Included by paged_attention_cpu.c after its shared helpers
 * (Problem, load_context, transpose_keys, tile_queries, MMKIT_TILE_QB, store_head) and
 * paged_item_avx2.h (softmax_row256); nothing here is compiled on its own.
 *
 * Without it such a CPU ran a prefill chunk's rows one by one through the decode kernel: every
 * row gathered and widened its whole context again, and each score was an 8-lane dot product
 * with a horizontal sum, so a chunk of L tokens cost about L^2 / 2 context rows read and
 * reduced. Here, as in the AVX-512 tiles, a tile's context is gathered once (K transposed in
 * blocks of 16 keys, V dense) and its query vectors run as two register-blocked products.
 *
 * The arithmetic of every output is the AVX-512 tile's: a score is one FMA chain over d in
 * order (key along the lanes), and P V one FMA chain over keys in order for each (query, d).
 * So a row's result does not depend on the tile it is in, nor on the blocking below. */
#ifndef MMKIT_PAGED_TILE_AVX2_H
#define MMKIT_PAGED_TILE_AVX2_H

#include <immintrin.h>

/* Query vectors scored at once: 6 x 2 accumulators + 2 key vectors + 1 broadcast = 15 of the
 * 16 ymm registers. */
#define MMKIT_TILE2_QG 6

/* Scores of QB query vectors (qf: [QB][D], scaled) against the 16 keys of block b
 * (kt: [blocks][D][16]): out[q * stride + 16 * b + i]. */
static inline __attribute__((always_inline)) void tile2_scores(float *restrict out, int64_t stride,
                                                               const float *restrict qf, const float *restrict kt,
                                                               int64_t b, const int QB, const int D) {
    __m256 acc[MMKIT_TILE2_QG][2];
    for (int q = 0; q < QB; q++) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
    const float *kb = kt + b * D * 16;
    for (int d = 0; d < D; d++) {
        const __m256 k0 = _mm256_loadu_ps(kb + d * 16), k1 = _mm256_loadu_ps(kb + d * 16 + 8);
        for (int q = 0; q < QB; q++) {
            const __m256 qb = _mm256_broadcast_ss(qf + q * D + d);
            acc[q][0] = _mm256_fmadd_ps(qb, k0, acc[q][0]);
            acc[q][1] = _mm256_fmadd_ps(qb, k1, acc[q][1]);
        }
    }
    for (int q = 0; q < QB; q++) {
        _mm256_storeu_ps(out + q * stride + 16 * b, acc[q][0]);
        _mm256_storeu_ps(out + q * stride + 16 * b + 8, acc[q][1]);
    }
}

/* out[q][c0 .. c0 + 32) = sum over t < len of pr[q * stride + t] * vd[t][c0 ..], t in order, for
 * QB <= 3 query vectors (12 accumulators + 3 broadcasts + 1 value vector). */
static inline __attribute__((always_inline)) void tile2_values(float *restrict out, const float *restrict pr,
                                                               int64_t stride, const float *restrict vd, int64_t len,
                                                               int c0, const int QB, const int D) {
    __m256 acc[3][4];
    for (int q = 0; q < QB; q++)
        for (int c = 0; c < 4; c++) acc[q][c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        __m256 pb[3];
        for (int q = 0; q < QB; q++) pb[q] = _mm256_broadcast_ss(pr + q * stride + t);
        for (int c = 0; c < 4; c++) {
            const __m256 v = _mm256_loadu_ps(vd + t * D + c0 + 8 * c);
            for (int q = 0; q < QB; q++) acc[q][c] = _mm256_fmadd_ps(pb[q], v, acc[q][c]);
        }
    }
    for (int q = 0; q < QB; q++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(out + q * D + c0 + 8 * c, acc[q][c]);
}

/* Rows [r0, r1) of one tile for KV head kvh (see attend_tile in paged_attention_cpu.c), head_dim
 * D = 16 NC = 64 or 128 (attend_tile_avx512's arguments). Scratch: rows [16, D], kt and vd
 * [context + 16, D]. */
static inline __attribute__((always_inline)) void attend_tile_avx2(const Problem *p, int64_t r0, int64_t r1,
                                                                    int64_t kvh, float *restrict scores,
                                                                    float *restrict rows, float *restrict kt,
                                                                    float *restrict vd, const int NC, const int dtype) {
    const int D = 16 * NC;
    const int64_t group = p->num_heads / p->num_kv_heads;
    const int64_t len = p->context_lens[r1 - 1], stride = (len + 15) / 16 * 16;
    const int64_t *table = p->block_ids + r0 * p->max_blocks, first_row = kvh * p->num_blocks;
    /* Gather the context once: K transposed into blocks of 16 keys (zero past len), V dense. */
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        load_context(rows, p->k_cache, table, t0, t0 + n, first_row, p->block_size, D, dtype);
        transpose_keys(kt + t0 * D, rows, n, D);
    }
    load_context(vd, p->v_cache, table, 0, len, first_row, p->block_size, D, dtype);
    const int64_t num_vectors = (r1 - r0) * group;
    for (int64_t v0 = 0; v0 < num_vectors; v0 += MMKIT_TILE2_QG) {
        const int qn = num_vectors - v0 < MMKIT_TILE2_QG ? (int)(num_vectors - v0) : MMKIT_TILE2_QG;
        float qf[MMKIT_TILE2_QG * 128], out[MMKIT_TILE2_QG * 128], sums[MMKIT_TILE2_QG];
        int64_t lens[MMKIT_TILE2_QG], heads[MMKIT_TILE2_QG], owners[MMKIT_TILE2_QG];
        const int64_t longest = tile_queries(p, r0, kvh, v0, qn, qf, owners, heads, lens, D, dtype);
        const int64_t blocks = (longest + 15) / 16;
#define MMKIT_SCORES(QB) tile2_scores(scores, stride, qf, kt, b, QB, D)
        for (int64_t b = 0; b < blocks; b++) MMKIT_TILE_QB(qn, MMKIT_SCORES)
#undef MMKIT_SCORES
        for (int j = 0; j < qn; j++) {
            float *sj = scores + j * stride;
            softmax_row256(sj, lens[j], sums + j, dtype);
            for (int64_t t = lens[j]; t < longest; t++) sj[t] = 0.0f; /* keys after this query's */
        }
        for (int j0 = 0; j0 < qn; j0 += 3) {
            const int jn = qn - j0 < 3 ? qn - j0 : 3;
            for (int c0 = 0; c0 < D; c0 += 32) {
                const float *pr = scores + j0 * stride;
                float *o = out + j0 * D;
                if (jn == 3) tile2_values(o, pr, stride, vd, longest, c0, 3, D);
                else if (jn == 2) tile2_values(o, pr, stride, vd, longest, c0, 2, D);
                else tile2_values(o, pr, stride, vd, longest, c0, 1, D);
            }
        }
        for (int j = 0; j < qn; j++)
            store_head(p->out, (owners[j] * p->num_heads + heads[j]) * D, out + j * D, 1.0f / sums[j], D, dtype);
    }
}

#endif
