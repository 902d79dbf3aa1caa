/* LoRA deltas added to a projection's output, per row under that row's adapter slot (the C
 * decode stack's hook for mmkit/lora/: the projection stays on the panels and the delta is
 * added to its output in place, so a step with adapters keeps the one-call stack).
 *
 *   mid[j]   = x[t] . a[s, j]                                  (j < num_slices * rank)
 *   out[t, c] += scale[s, i] * sum_q mid[i * rank + q] * bt[s, q, c]   (c in slice i)
 *
 * with s = row_slots[t] (rows with s < 0, or a slot this module holds nothing for, are left
 * alone); slice i covers output columns [bounds[i], bounds[i + 1]) (q, k and v of a fused qkv
 * projection each have their own A/B pair). A and B are float32 whatever the step's dtype; the
 * delta is summed in float32 and added once (as PEFT adds `lora_B(lora_A(x)) * scaling`), a bf16
 * output rounded after the add. Rows of one adapter are adjacent (the runner orders them), so a
 * slot's A and B stay in cache across its rows: rank * (k + n) multiply-adds per row, in
 * vectorized dot products over k and axpys over n.
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

static inline void lora_axpy(float *y, float alpha, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

/* Returns 0, or 2 when the scratch could not be allocated. */
int mmkit_lora_add(void *out, const void *x, int64_t x_stride, int64_t num_rows, int64_t k, int64_t n,
                   const int64_t *row_slots, const float *a, const float *bt, const float *scales,
                   const int64_t *slot_mask, const int64_t *bounds, int64_t num_slices, int64_t rank,
                   int dtype) {
    const int64_t mid_len = num_slices * rank;
    float *mid = (float *)malloc(sizeof(float) * (size_t)(mid_len + n + (dtype == LORA_BF16 ? k : 0)));
    if (!mid) return 2;
    float *acc = mid + mid_len;
    float *xf = acc + n;
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
        const float *bs = bt + s * rank * n;
        const float *sc = scales + s * num_slices;
        for (int64_t c = 0; c < n; ++c) acc[c] = 0.0f;
        for (int64_t i = 0; i < num_slices; ++i) {
            const int64_t lo = bounds[i], width = bounds[i + 1] - bounds[i];
            if (sc[i] == 0.0f) continue;
            for (int64_t q = 0; q < rank; ++q) lora_axpy(acc + lo, mid[i * rank + q], bs + q * n + lo, width);
            for (int64_t c = lo; c < lo + width; ++c) acc[c] *= sc[i];
        }
        if (dtype == LORA_BF16) {
            uint16_t *o = (uint16_t *)out + t * n;
            for (int64_t c = 0; c < n; ++c) o[c] = f32_to_bf16(bf16_to_f32(o[c]) + acc[c]);
        } else {
            float *o = (float *)out + t * n;
            for (int64_t c = 0; c < n; ++c) o[c] += acc[c];
        }
    }
    free(mid);
    return 0;
}
