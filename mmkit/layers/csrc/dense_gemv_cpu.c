/* Dense GEMV for a few rows (decode at small batch): out[m, n] = sum_k x[m, k] w[n, k] + b[n].
 *
 * Why: at batch 1 a decode step reads every decoder and LM-head weight once, so its linears
 * are bound by memory bandwidth (about 37 GB/s on this class of 2-core machine). oneDNN's
 * packed bf16 matmul reaches about 19 GB/s there (the 49152 x 576 LM head: 3.0 ms for 57 MB)
 * and MKL's float32 GEMV about 11 GB/s; this kernel streams the row-major weight once with
 * every thread reading its own contiguous band of output rows.
 *
 * x: [M, K] rows `x_stride` elements apart; w: [N, K] row-major; bias [N] or NULL; out [M, N]
 * dense. dtype 0: float32 everywhere (FMA in float32); 1: bfloat16 x, w, bias and out, the
 * products summed in float32 (VDPBF16PS where the CPU has it), bias added in float32, one
 * rounding to bf16 at the end, as oneDNN's bf16 matmul does.
 * The rows of x are taken MMKIT_GEMV_ROWS at a time against a band of MMKIT_GEMV_BAND weight
 * rows, so the band is read from memory once and from cache for the following rows of x. */
#include <stdint.h>
#include <omp.h>
#include "bf16.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define MMKIT_G_AVX512 1
#endif
#if defined(MMKIT_G_AVX512) && defined(__AVX512BF16__)
#define MMKIT_G_BF16DP 1
#endif

#define MMKIT_GEMV_ROWS 4
#define MMKIT_GEMV_BAND 16
#ifndef MMKIT_GEMV_PF_TILES
#define MMKIT_GEMV_PF_TILES 2 /* prefetch distance, in tiles of 4 weight rows */
#endif
#define MMKIT_INLINE static inline __attribute__((always_inline))

/* Portable: one row of x against one weight row. */
static float dot_portable(const void *x, const void *w, int64_t K, int dtype) {
    float acc = 0.0f;
    if (dtype == 1) {
        const uint16_t *xb = (const uint16_t *)x, *wb = (const uint16_t *)w;
        for (int64_t k = 0; k < K; ++k) acc += bf16_to_f32(xb[k]) * bf16_to_f32(wb[k]);
    } else {
        const float *xf = (const float *)x, *wf = (const float *)w;
        for (int64_t k = 0; k < K; ++k) acc += xf[k] * wf[k];
    }
    return acc;
}

#ifdef MMKIT_G_AVX512
/* R rows of float32 x (compile-time R after inlining) against 4 weight rows: res[r * 4 + j]. */
MMKIT_INLINE void f32_tile(float *res, const float *x, int64_t xs, const int R, const float *w, int64_t K) {
    __m512 acc[MMKIT_GEMV_ROWS][4];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1u);
        __m512 wv[4];
        const char *pf = (const char *)(w + 4 * K) + (k / 16) * 256;
        for (int j = 0; j < 4; ++j) _mm_prefetch(pf + (MMKIT_GEMV_PF_TILES - 1) * 16 * K + j * 64, _MM_HINT_T0);
        for (int j = 0; j < 4; ++j) wv[j] = _mm512_maskz_loadu_ps(mask, w + j * K + k);
        for (int r = 0; r < R; ++r) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * xs + k);
            for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) res[r * 4 + j] = _mm512_reduce_add_ps(acc[r][j]);
}

/* The same for bf16 x and w: 32 products per instruction with VDPBF16PS, else 16 widened to
 * float32 (exact) and multiplied with FMA. */
MMKIT_INLINE void bf16_tile(float *res, const uint16_t *x, int64_t xs, const int R, const uint16_t *w, int64_t K) {
    __m512 acc[MMKIT_GEMV_ROWS][4];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
#ifdef MMKIT_G_BF16DP
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1u);
        __m512i wv[4];
        /* The next tiles' rows, 256 bytes per step: four rows end every 2 KB or so, and the
         * hardware prefetcher loses each short row's stream at its end. */
        const char *pf = (const char *)(w + 4 * K) + (k / 32) * 256;
        for (int j = 0; j < 4; ++j) _mm_prefetch(pf + (MMKIT_GEMV_PF_TILES - 1) * 8 * K + j * 64, _MM_HINT_T0);
        for (int j = 0; j < 4; ++j) wv[j] = _mm512_maskz_loadu_epi16(mask, w + j * K + k);
        for (int r = 0; r < R; ++r) {
            const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + r * xs + k);
            for (int j = 0; j < 4; ++j)
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
    }
#else
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1u);
        __m512 wv[4];
        for (int j = 0; j < 4; ++j)
            wv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, w + j * K + k)), 16));
        for (int r = 0; r < R; ++r) {
            const __m512 xv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x + r * xs + k)), 16));
            for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
        }
    }
#endif
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) res[r * 4 + j] = _mm512_reduce_add_ps(acc[r][j]);
}

#define MMKIT_G_DISPATCH(FN, R, ...)       \
    switch (R) {                           \
    case 4: FN(__VA_ARGS__, 4); break;     \
    case 3: FN(__VA_ARGS__, 3); break;     \
    case 2: FN(__VA_ARGS__, 2); break;     \
    default: FN(__VA_ARGS__, 1); break;    \
    }
#define MMKIT_G_F32(res, x, xs, w, K, R) f32_tile(res, x, xs, R, w, K)
#define MMKIT_G_BF16(res, x, xs, w, K, R) bf16_tile(res, x, xs, R, w, K)
#endif

/* Rows [n0, n1) of the output for every row of x. */
static void gemv_band(void *out, const void *x, int64_t xs, int64_t M, int64_t K, int64_t N, const void *w,
                      const void *bias, int dtype, int64_t n0, int64_t n1) {
    const int64_t es = dtype == 1 ? 2 : 4;
    for (int64_t b0 = n0; b0 < n1; b0 += MMKIT_GEMV_BAND) {
        const int64_t b1 = b0 + MMKIT_GEMV_BAND < n1 ? b0 + MMKIT_GEMV_BAND : n1;
        for (int64_t m0 = 0; m0 < M; m0 += MMKIT_GEMV_ROWS) {
            const int R = M - m0 < MMKIT_GEMV_ROWS ? (int)(M - m0) : MMKIT_GEMV_ROWS;
            const char *xm = (const char *)x + m0 * xs * es;
            int64_t n = b0;
#ifdef MMKIT_G_AVX512
            for (; n + 4 <= b1; n += 4) {
                float res[MMKIT_GEMV_ROWS * 4];
                const char *wn = (const char *)w + n * K * es;
                if (dtype == 1) {
                    MMKIT_G_DISPATCH(MMKIT_G_BF16, R, res, (const uint16_t *)xm, xs, (const uint16_t *)wn, K)
                } else {
                    MMKIT_G_DISPATCH(MMKIT_G_F32, R, res, (const float *)xm, xs, (const float *)wn, K)
                }
                for (int r = 0; r < R; ++r)
                    for (int j = 0; j < 4; ++j) {
                        const int64_t o = (m0 + r) * N + n + j;
                        if (dtype == 1) {
                            float v = res[r * 4 + j];
                            if (bias) v += bf16_to_f32(((const uint16_t *)bias)[n + j]);
                            ((uint16_t *)out)[o] = f32_to_bf16(v);
                        } else {
                            ((float *)out)[o] = res[r * 4 + j] + (bias ? ((const float *)bias)[n + j] : 0.0f);
                        }
                    }
            }
#endif
            for (; n < b1; ++n)
                for (int r = 0; r < R; ++r) {
                    float v = dot_portable(xm + r * xs * es, (const char *)w + n * K * es, K, dtype);
                    const int64_t o = (m0 + r) * N + n;
                    if (dtype == 1) {
                        if (bias) v += bf16_to_f32(((const uint16_t *)bias)[n]);
                        ((uint16_t *)out)[o] = f32_to_bf16(v);
                    } else {
                        ((float *)out)[o] = v + (bias ? ((const float *)bias)[n] : 0.0f);
                    }
                }
        }
    }
}

/* Each thread takes one contiguous band of output rows (a multiple of 16), so the weight is
 * streamed in as many sequential runs as there are threads. */
void mmkit_dense_gemv(void *out, const void *x, int64_t x_stride, int64_t M, int64_t K, int64_t N, const void *w,
                      const void *bias, int dtype, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    const int64_t per = ((N + nthreads - 1) / nthreads + MMKIT_GEMV_BAND - 1) / MMKIT_GEMV_BAND * MMKIT_GEMV_BAND;
    if (nthreads == 1) {
        gemv_band(out, x, x_stride, M, K, N, w, bias, dtype, 0, N);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t t = omp_get_thread_num();
        const int64_t n0 = t * per < N ? t * per : N, n1 = (t + 1) * per < N ? (t + 1) * per : N;
        if (n0 < n1) gemv_band(out, x, x_stride, M, K, N, w, bias, dtype, n0, n1);
    }
}

int mmkit_dense_gemv_has_bf16dp(void) {
#ifdef MMKIT_G_BF16DP
    return 1;
#else
    return 0;
#endif
}
