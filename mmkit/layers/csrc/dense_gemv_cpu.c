/* float32 GEMV for a few rows (decode at small batch): out[m, n] = sum_k x[m, k] w[n, k] + b[n].
 *
 * Why: at batch 1 a decode step reads every decoder and LM-head weight once, so its linears
 * are bound by memory bandwidth (about 37 GB/s with both cores of this 2-core machine), and
 * MKL's float32 GEMV reaches about 11 GB/s there (the 49152 x 576 LM head: 10.6 ms for 113 MB).
 * This kernel streams the row-major weight once, every thread reading its own contiguous band
 * of output rows, with software prefetch across the ends of rows (four rows are read side by
 * side, and each row's stream is too short for the hardware prefetcher to follow).
 *
 * x: [M, K] rows `x_stride` floats apart; w: [N, K] row-major; bias [N] or NULL; out [M, N]
 * dense. Products summed with FMA in float32 (another order than MKL's: results agree to
 * float32 rounding, not bit for bit). The rows of x are taken MMKIT_GEMV_ROWS at a time
 * against a band of MMKIT_GEMV_BAND weight rows, so the band is read from memory once and from
 * cache for the following rows of x. bf16 weights use bf16_gemm_cpu.c's panels instead. */
#include <stdint.h>
#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define MMKIT_G_AVX512 1
#endif

#define MMKIT_GEMV_ROWS 4
#define MMKIT_GEMV_BAND 16
#ifndef MMKIT_GEMV_PF_TILES
#define MMKIT_GEMV_PF_TILES 2 /* prefetch distance, in tiles of 4 weight rows */
#endif
#define MMKIT_INLINE static inline __attribute__((always_inline))

/* Portable: one row of x against one weight row. */
static float dot_portable(const float *x, const float *w, int64_t K) {
    float acc = 0.0f;
    for (int64_t k = 0; k < K; ++k) acc += x[k] * w[k];
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

#define MMKIT_G_DISPATCH(FN, R, ...)       \
    switch (R) {                           \
    case 4: FN(__VA_ARGS__, 4); break;     \
    case 3: FN(__VA_ARGS__, 3); break;     \
    case 2: FN(__VA_ARGS__, 2); break;     \
    default: FN(__VA_ARGS__, 1); break;    \
    }
#define MMKIT_G_F32(res, x, xs, w, K, R) f32_tile(res, x, xs, R, w, K)
#endif

/* Rows [n0, n1) of the output for every row of x. */
static void gemv_band(float *out, const float *x, int64_t xs, int64_t M, int64_t K, int64_t N, const float *w,
                      const float *bias, int64_t n0, int64_t n1) {
    for (int64_t b0 = n0; b0 < n1; b0 += MMKIT_GEMV_BAND) {
        const int64_t b1 = b0 + MMKIT_GEMV_BAND < n1 ? b0 + MMKIT_GEMV_BAND : n1;
        for (int64_t m0 = 0; m0 < M; m0 += MMKIT_GEMV_ROWS) {
            const int R = M - m0 < MMKIT_GEMV_ROWS ? (int)(M - m0) : MMKIT_GEMV_ROWS;
            const float *xm = x + m0 * xs;
            int64_t n = b0;
#ifdef MMKIT_G_AVX512
            for (; n + 4 <= b1; n += 4) {
                float res[MMKIT_GEMV_ROWS * 4];
                const float *wn = w + n * K;
                MMKIT_G_DISPATCH(MMKIT_G_F32, R, res, (const float *)xm, xs, (const float *)wn, K)
                for (int r = 0; r < R; ++r)
                    for (int j = 0; j < 4; ++j)
                        out[(m0 + r) * N + n + j] = res[r * 4 + j] + (bias ? bias[n + j] : 0.0f);
            }
#endif
            for (; n < b1; ++n)
                for (int r = 0; r < R; ++r)
                    out[(m0 + r) * N + n] = dot_portable(xm + r * xs, w + n * K, K) + (bias ? bias[n] : 0.0f);
        }
    }
}

/* Each thread takes one contiguous band of output rows (a multiple of 16), so the weight is
 * streamed in as many sequential runs as there are threads. */
void mmkit_dense_gemv_f32(float *out, const float *x, int64_t x_stride, int64_t M, int64_t K, int64_t N,
                          const float *w, const float *bias, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    const int64_t per = ((N + nthreads - 1) / nthreads + MMKIT_GEMV_BAND - 1) / MMKIT_GEMV_BAND * MMKIT_GEMV_BAND;
    if (nthreads == 1) {
        gemv_band(out, x, x_stride, M, K, N, w, bias, 0, N);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t t = omp_get_thread_num();
        const int64_t n0 = t * per < N ? t * per : N, n1 = (t + 1) * per < N ? (t + 1) * per : N;
        if (n0 < n1) gemv_band(out, x, x_stride, M, K, N, w, bias, n0, n1);
    }
}
