/* Greedy sampling straight from the model's logits: the first index of each row's maximum
 * (torch.argmax's tie rule), without the float32 copy of the [rows, vocab] logits that the
 * general sampler makes. One pass over the logits; rows split over threads when large. */
#if defined(__x86_64__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif
#include <math.h>
#include <stdint.h>

#include "bf16.h"

enum { ARGMAX_F32 = 0, ARGMAX_BF16 = 1 };

/* Returns the number of rows holding a NaN (their result is unspecified; the caller then
 * falls back to torch, which defines it). */
int64_t mmkit_argmax_rows(const void *logits, int64_t num_rows, int64_t vocab, int64_t row_stride, int dtype,
                          int64_t *out, int num_threads) {
    int64_t nan_rows = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(+ : nan_rows) \
    if (num_rows * vocab >= (1 << 22))
    for (int64_t r = 0; r < num_rows; r++) {
        /* Pass 1: the maximum (and whether a NaN is present); pass 2: its first index. Both
         * passes vectorize (an early-exit search would not); pass 2 reads the row from cache. */
        float best = -INFINITY;
        int has_nan = 0;
        int64_t at = vocab;
        if (dtype == ARGMAX_F32) {
            const float *x = (const float *)logits + r * row_stride;
#pragma omp simd reduction(max : best) reduction(| : has_nan)
            for (int64_t i = 0; i < vocab; i++) {
                best = x[i] > best ? x[i] : best;
                has_nan |= x[i] != x[i];
            }
#pragma omp simd reduction(min : at)
            for (int64_t i = 0; i < vocab; i++) at = (x[i] == best && i < at) ? i : at;
        } else {
            const uint16_t *x = (const uint16_t *)logits + r * row_stride;
#pragma omp simd reduction(max : best) reduction(| : has_nan)
            for (int64_t i = 0; i < vocab; i++) {
                const float v = bf16_to_f32(x[i]);
                best = v > best ? v : best;
                has_nan |= v != v;
            }
#pragma omp simd reduction(min : at)
            for (int64_t i = 0; i < vocab; i++) at = (bf16_to_f32(x[i]) == best && i < at) ? i : at;
        }
        out[r] = at < vocab ? at : 0; /* all -inf: index 0, as torch */
        nan_rows += has_nan;
    }
    return nan_rows;
}

/* 1 when this build contains the AVX-512 code paths (tests check the generic build's). */
int mmkit_has_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
