/* Weight-only int8 / int4 GEMM (GEMV at batch 1) for mmkit's quantized linear layers.
 *
 * out[m, n] = sum_k x[m, k] * (q[n, k] - z[n, g]) * s[n, g],  g = k / group_size.
 * Each group's partial dot is formed in float32 with (q - z) converted exactly (small integers),
 * then scaled by s[n, g] and added to the row's accumulator, so a group never needs a
 * horizontal sum. x is bf16 or float32 (converted to float32 once per call); out has x's dtype.
 *
 * Weight layouts (built by mmkit/layers/quant_pack.py):
 *   bits 8: q int8 [N, K], zeros int8 [N, G] or NULL (symmetric).
 *   bits 4: q uint8 [N, K / 2]; in each block of 32 columns, byte j holds column j in its low
 *           nibble and column j + 16 in its high nibble (two 16-lane halves per 16 bytes);
 *           zeros uint8 [N, G] (always: a symmetric checkpoint's values are stored offset by 8).
 * The weight row n (K or K/2 bytes) stays in L1 while up to MMKIT_QROWS rows of x use it. */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include "bf16.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MMKIT_QROWS 4

/* One output row n for rows x[m0 .. m0 + rows) (float32, row stride K). */
static void qrow(float *acc_out, const float *x, int64_t rows, int64_t K, const uint8_t *wrow, int bits,
                 const float *srow, const uint8_t *zrow, int64_t gs) {
    const int64_t G = K / gs;
    const int zero_signed = bits == 8;
#if defined(__AVX512F__)
    if (gs % 32 == 0) {
        __m512 acc[MMKIT_QROWS];
        for (int64_t m = 0; m < rows; ++m) acc[m] = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; ++g) {
            float zf = 0.0f;
            if (zrow) zf = zero_signed ? (float)((const int8_t *)zrow)[g] : (float)zrow[g];
            const __m512 zv = _mm512_set1_ps(zf);
            __m512 part[MMKIT_QROWS];
            for (int64_t m = 0; m < rows; ++m) part[m] = _mm512_setzero_ps();
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 32) {
                __m512 w0, w1;
                if (bits == 8) {
                    const int8_t *q = (const int8_t *)wrow + k;
                    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
                    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
                } else {
                    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wrow + k / 2)));
                    w0 = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
                    w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
                }
                w0 = _mm512_sub_ps(w0, zv);
                w1 = _mm512_sub_ps(w1, zv);
                for (int64_t m = 0; m < rows; ++m) {
                    const float *xm = x + m * K + k;
                    part[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), part[m]);
                    part[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), part[m]);
                }
            }
            const __m512 sv = _mm512_set1_ps(srow[g]);
            for (int64_t m = 0; m < rows; ++m) acc[m] = _mm512_fmadd_ps(part[m], sv, acc[m]);
        }
        for (int64_t m = 0; m < rows; ++m) acc_out[m] = _mm512_reduce_add_ps(acc[m]);
        return;
    }
#endif
    /* Portable path: the same order of operations per group, 16 partial sums per group as the
     * vector lanes keep them (so both builds round alike up to the final lane sum). */
    for (int64_t m = 0; m < rows; ++m) {
        const float *xm = x + m * K;
        float acc = 0.0f;
        for (int64_t g = 0; g < G; ++g) {
            float zf = 0.0f;
            if (zrow) zf = zero_signed ? (float)((const int8_t *)zrow)[g] : (float)zrow[g];
            float part = 0.0f;
            for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
                float w;
                if (bits == 8) {
                    w = (float)((const int8_t *)wrow)[k];
                } else {
                    const int64_t block = k / 32, j = k % 32;
                    const uint8_t byte = wrow[block * 16 + (j & 15)];
                    w = (float)(j < 16 ? (byte & 15) : (byte >> 4));
                }
                part += (w - zf) * xm[k];
            }
            acc += part * srow[g];
        }
        acc_out[m] = acc;
    }
}

/* x: [M, K] (dtype 0 float32, 1 bf16); out: [M, N] same dtype; w, scales [N, G] f32, zeros.
 * Returns 0, or 1 when scratch memory could not be allocated. */
int mmkit_quant_gemm(void *out, const void *x, int64_t M, int64_t K, int64_t N, int dtype, const void *w,
                     int bits, const float *scales, const void *zeros, int64_t gs, int nthreads) {
    const int64_t G = K / gs, row_bytes = bits == 8 ? K : K / 2;
    const float *xf = (const float *)x;
    float *scratch = NULL;
    if (dtype == 1) {
        scratch = (float *)malloc((size_t)(M * K) * sizeof(float));
        if (!scratch) return 1;
        const uint16_t *xb = (const uint16_t *)x;
        for (int64_t i = 0; i < M * K; ++i) scratch[i] = bf16_to_f32(xb[i]);
        xf = scratch;
    }
    if (nthreads < 1) nthreads = 1;
    if (N * K < 65536) nthreads = 1; /* waking a worker costs more than a small matrix */
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t *wrow = (const uint8_t *)w + n * row_bytes;
        const uint8_t *zrow = zeros ? (const uint8_t *)zeros + n * G : NULL;
        float res[MMKIT_QROWS];
        for (int64_t m0 = 0; m0 < M; m0 += MMKIT_QROWS) {
            const int64_t rows = M - m0 < MMKIT_QROWS ? M - m0 : MMKIT_QROWS;
            qrow(res, xf + m0 * K, rows, K, wrow, bits, scales + n * G, zrow, gs);
            for (int64_t r = 0; r < rows; ++r) {
                if (dtype == 1) ((uint16_t *)out)[(m0 + r) * N + n] = f32_to_bf16(res[r]);
                else ((float *)out)[(m0 + r) * N + n] = res[r];
            }
        }
    }
    free(scratch);
    return 0;
}
