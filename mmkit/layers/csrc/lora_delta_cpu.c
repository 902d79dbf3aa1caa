/* LoRA deltas added to a projection's output, per row under that row's adapter slot (the C
 * decode stack's hook for mmkit/lora/: the projection stays on the panels and the delta is
 * added to its output in place, so a step with adapters keeps the one-call stack).
 *
 *   out[t, c] += scale[s, sl(c)] * sum_q b[s, c, q] * (x[t] . a[s, sl(c) * rank + q])
 *
 * with s = row_slots[t] (rows with s < 0, or a slot this module holds nothing for, are left
 * alone) and sl(c) the slice of output column c (q, k, v of a fused qkv projection each have
 * their own A/B pair). A and B are float32 whatever the step's dtype; a bf16 output is rounded
 * once after the add. Rows of one adapter are adjacent (the runner orders them), so a slot's A
 * stays in cache across its rows: the cost is rank * (k + n) multiply-adds per row.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

enum { LORA_F32 = 0, LORA_BF16 = 1 };

static inline float lora_dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

/* Returns 0, or 2 when the scratch could not be allocated. */
int mmkit_lora_add(void *out, const void *x, int64_t x_stride, int64_t num_rows, int64_t k, int64_t n,
                   const int64_t *row_slots, const float *a, const float *b, const float *scales,
                   const int64_t *slot_mask, const int64_t *column_slice, int64_t num_slices, int64_t rank,
                   int dtype) {
    const int64_t mid_len = num_slices * rank;
    float *mid = (float *)malloc(sizeof(float) * (size_t)(mid_len + (dtype == LORA_BF16 ? k : 0)));
    if (!mid) return 2;
    float *xf = mid + mid_len;
    for (int64_t t = 0; t < num_rows; ++t) {
        const int64_t s = row_slots[t];
        if (s < 0 || !slot_mask[s]) continue;
        const float *xr;
        if (dtype == LORA_BF16) {
            const uint16_t *xb = (const uint16_t *)x + t * x_stride;
            for (int64_t i = 0; i < k; ++i) xf[i] = bf16_to_f32(xb[i]);
            xr = xf;
        } else {
            xr = (const float *)x + t * x_stride;
        }
        const float *as = a + s * mid_len * k;
        for (int64_t j = 0; j < mid_len; ++j) mid[j] = lora_dot(xr, as + j * k, k);
        const float *bs = b + s * n * rank;
        const float *sc = scales + s * num_slices;
        if (dtype == LORA_BF16) {
            uint16_t *o = (uint16_t *)out + t * n;
            for (int64_t c = 0; c < n; ++c) {
                const int64_t sl = column_slice[c];
                const float d = lora_dot(mid + sl * rank, bs + c * rank, rank) * sc[sl];
                o[c] = f32_to_bf16(bf16_to_f32(o[c]) + d);
            }
        } else {
            float *o = (float *)out + t * n;
            for (int64_t c = 0; c < n; ++c) {
                const int64_t sl = column_slice[c];
                o[c] += lora_dot(mid + sl * rank, bs + c * rank, rank) * sc[sl];
            }
        }
    }
    free(mid);
    return 0;
}
