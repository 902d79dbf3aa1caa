/* Dequantize an int8 / int4 weight-only matrix for a large-batch (prefill) matmul:
 * out[n, k] = (q[n, k] - z[n, g]) * s[n, g] in float32 (the subtraction is exact, one rounding
 * in the multiply: bit-identical to quant_pack.py's torch formula), then, for dtype 1, rounded to
 * bf16 (round to nearest even, as torch's cast). Layouts as in quant_gemm_cpu.c. One pass over
 * the integers, all threads; the torch formula (unpack, int16, float, subtract, multiply, cast)
 * was eight passes and a quarter of a prefill step. */
#include <stdint.h>
#include "bf16.h"

#define MMKIT_DQ_BLOCK 32

/* Unpacked values of one 32-column block of a weight row into v (float32, exact). */
static inline void block_values(float *v, const uint8_t *wrow, int bits, int64_t k) {
    if (bits == 8) {
        const int8_t *q = (const int8_t *)wrow + k;
#pragma omp simd
        for (int j = 0; j < MMKIT_DQ_BLOCK; ++j) v[j] = (float)q[j];
    } else {
        const uint8_t *b = wrow + k / 2;
#pragma omp simd
        for (int j = 0; j < 16; ++j) {
            v[j] = (float)(b[j] & 15);
            v[j + 16] = (float)(b[j] >> 4);
        }
    }
}

/* w: bits 8 int8 [N, K] or bits 4 packed uint8 [N, K / 2]; scales float32 [N, G]; zeros
 * [N, G] int8 (bits 8) / uint8 (bits 4) or NULL; K and gs multiples of 32 (quant_pack.py's
 * packing rule; an int8 layout with another K takes the generic loop). out: [N, K]. */
void mmkit_quant_dequantize(void *out, int dtype, const void *w, int bits, const float *scales, const void *zeros,
                            int64_t N, int64_t K, int64_t gs, int nthreads) {
    const int64_t G = K / gs, row_bytes = bits == 8 ? K : K / 2;
    const int blocked = K % MMKIT_DQ_BLOCK == 0 && gs % MMKIT_DQ_BLOCK == 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t *wrow = (const uint8_t *)w + n * row_bytes;
        float v[MMKIT_DQ_BLOCK];
        for (int64_t k = 0; k < K; k += blocked ? MMKIT_DQ_BLOCK : 1) {
            const int64_t g = k / gs;
            float z = 0.0f;
            if (zeros) z = bits == 8 ? (float)((const int8_t *)zeros)[n * G + g] : (float)((const uint8_t *)zeros)[n * G + g];
            const float s = scales[n * G + g];
            const int len = blocked ? MMKIT_DQ_BLOCK : 1;
            if (blocked) block_values(v, wrow, bits, k);
            else v[0] = (float)((const int8_t *)wrow)[k];
            if (dtype == 1) {
                uint16_t *o = (uint16_t *)out + n * K + k;
#pragma omp simd
                for (int j = 0; j < len; ++j) o[j] = f32_to_bf16((v[j] - z) * s);
            } else {
                float *o = (float *)out + n * K + k;
#pragma omp simd
                for (int j = 0; j < len; ++j) o[j] = (v[j] - z) * s;
            }
        }
    }
}
