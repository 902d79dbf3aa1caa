/* Structured outputs: apply xgrammar's token bitmask to float32 logits in place.
 * bitmask row r holds ceil(vocab / 32) int32 words; bit j of word w set = token 32 * w + j
 * allowed. A word of all ones (free-text states: most of the vocabulary allowed) is skipped
 * and a zero word (enum/choice states: almost nothing allowed) is a plain fill, so the pass
 * is memory-bound; xgrammar's own CPU kernel tests every bit. */
#include <math.h>
#include <stdint.h>

void mmkit_apply_token_bitmask(float *logits, int64_t row_stride, const int32_t *bitmask, int64_t mask_stride,
                               const int64_t *rows, int64_t num_rows, int64_t vocab, int num_threads) {
    const int64_t num_words = (vocab + 31) / 32;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows * vocab >= (1 << 22))
    for (int64_t k = 0; k < num_rows; k++) {
        float *x = logits + rows[k] * row_stride;
        const uint32_t *m = (const uint32_t *)(bitmask + rows[k] * mask_stride);
        for (int64_t w = 0; w < num_words; w++) {
            const uint32_t word = m[w];
            if (word == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32;
            const int64_t n = vocab - base < 32 ? vocab - base : 32;
            if (word == 0) {
                for (int64_t j = 0; j < n; j++) x[base + j] = -INFINITY;
            } else {
                for (int64_t j = 0; j < n; j++)
                    if (!((word >> j) & 1u)) x[base + j] = -INFINITY;
            }
        }
    }
}
