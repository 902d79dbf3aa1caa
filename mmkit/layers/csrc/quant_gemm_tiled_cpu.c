/* int8 / int4 weight-only GEMM for batches of bf16 rows (decode of many sequences, short
 * prefills): out[m, n] = bf16(sum_k x[m, k] * bf16(w'[n, k])), w' = (q - z) * s as in
 * quant_dequant_cpu.c.
 *
 * Why not the GEMV kernel (quant_gemm_cpu.c) for these: it reduces along K per output, so each
 * (row, column) pair pays a horizontal sum and the weight is decoded again for every 4 rows;
 * and why not dequantize-then-oneDNN: that writes the whole bf16 weight, then oneDNN reorders
 * it again before its GEMM (three passes over a bf16 copy per call). Here each thread decodes a
 * tile of 32 output columns x K into bf16 pairs laid out for VDPBF16PS ([K / 2][32][2], kept in
 * L1/L2), then runs an 8-row x 32-column register-blocked microkernel over every row of x:
 * the decode is paid once per call and column, and each instruction does 32 products.
 * Products of bf16 values are exact in float32 and sums are float32, as oneDNN's bf16 GEMM;
 * only the order of the sums differs.
 *
 * Needs AVX512-BF16 (and a K that is even); otherwise the function returns 1 and the caller
 * uses the dequantized path. Returns 2 when scratch memory could not be allocated. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "bf16.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#include <immintrin.h>
#define MMKIT_TILED 1
#endif

#define NC 8  /* output columns per tile (weight rows decoded together) */
#define MB 2  /* 16-row blocks of x per microkernel call: NC x MB = 16 accumulators */

#ifdef MMKIT_TILED
/* Row n of w' as bf16 [K] into dst: ((q - z) * s) in float32 (the exact formula of
 * quant_dequant_cpu.c), rounded to nearest even. */
static void decode_row(uint16_t *dst, const uint8_t *wrow, int bits, const float *srow, const uint8_t *zrow,
                       int64_t K, int64_t gs) {
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t k0 = 0; k0 < K; k0 += gs) {
        const int64_t g = k0 / gs;
        const __m512 s = _mm512_set1_ps(srow[g]);
        const __m512 z = _mm512_set1_ps(zrow ? (bits == 8 ? (float)((const int8_t *)zrow)[g] : (float)zrow[g]) : 0.0f);
        for (int64_t k = k0; k < k0 + gs; k += 32) {
            __m512 a, b;
            if (bits == 8) {
                a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wrow + k))));
                b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wrow + k + 16))));
            } else {
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wrow + k / 2)));
                a = _mm512_cvtepi32_ps(_mm512_and_si512(v, low4));
                b = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
            }
            a = _mm512_mul_ps(_mm512_sub_ps(a, z), s);
            b = _mm512_mul_ps(_mm512_sub_ps(b, z), s);
            _mm512_storeu_si512(dst + k, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
}

/* out[16 (b0 + j) + lane, n0 + c] for c < C, j < J: rows of x vectorized (16 per zmm), a
 * broadcast pair of weights per column. xt: [blocks][K / 2][16] bf16 pairs; wp: [NC][K] bf16. */
static inline __attribute__((always_inline)) void micro(uint16_t *out, int64_t N, int64_t M, int64_t m0,
                                                        const uint32_t *xt, const uint16_t *wp, int64_t K,
                                                        const int C, const int J) {
    __m512 acc[NC][MB];
    for (int c = 0; c < C; ++c)
        for (int j = 0; j < J; ++j) acc[c][j] = _mm512_setzero_ps();
    const int64_t K2 = K / 2;
    for (int64_t k2 = 0; k2 < K2; ++k2) {
        __m512bh xv[MB];
        for (int j = 0; j < J; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(xt + (j * K2 + k2) * 16);
        for (int c = 0; c < C; ++c) {
            const __m512bh wb = (__m512bh)_mm512_set1_epi32(((const uint32_t *)(wp + c * K))[k2]);
            for (int j = 0; j < J; ++j) acc[c][j] = _mm512_dpbf16_ps(acc[c][j], wb, xv[j]);
        }
    }
    for (int j = 0; j < J; ++j)
        for (int c = 0; c < C; ++c) {
            float v[16];
            _mm512_storeu_ps(v, acc[c][j]);
            for (int l = 0; l < 16 && m0 + 16 * j + l < M; ++l) out[(m0 + 16 * j + l) * N + c] = f32_to_bf16(v[l]);
        }
}
#endif

int mmkit_quant_gemm_tiled(uint16_t *out, const uint16_t *x, int64_t M, int64_t K, int64_t N, const void *w,
                           int bits, const float *scales, const void *zeros, int64_t gs, int nthreads) {
#ifdef MMKIT_TILED
    if (K % 32 != 0 || gs % 32 != 0) return 1;
    const int64_t G = K / gs, row_bytes = bits == 8 ? K : K / 2, tiles = (N + NC - 1) / NC;
    const int64_t blocks = (M + 15) / 16, K2 = K / 2;
    /* x as bf16 pairs, 16 rows side by side: xt[b][k2][l] = x[16 b + l, 2 k2 .. 2 k2 + 1] (0 past M) */
    uint32_t *xt = (uint32_t *)calloc((size_t)(blocks * K2 * 16), sizeof(uint32_t));
    if (!xt) return 2;
    const uint32_t *xp = (const uint32_t *)x;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k2 = 0; k2 < K2; ++k2) xt[((m / 16) * K2 + k2) * 16 + m % 16] = xp[m * K2 + k2];
    int failed = 0;
    if (nthreads < 1) nthreads = 1;
    if (tiles < nthreads) nthreads = (int)tiles;
#pragma omp parallel num_threads(nthreads)
    {
        uint16_t *wp = (uint16_t *)malloc((size_t)(NC * K) * sizeof(uint16_t));
        if (!wp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            if (!wp) continue;
            const int64_t n0 = t * NC;
            const int C = N - n0 < NC ? (int)(N - n0) : NC;
            for (int c = 0; c < C; ++c)
                decode_row(wp + c * K, (const uint8_t *)w + (n0 + c) * row_bytes, bits, scales + (n0 + c) * G,
                           zeros ? (const uint8_t *)zeros + (n0 + c) * G : NULL, K, gs);
            for (int64_t b = 0; b < blocks; b += MB) {
                const int J = blocks - b >= MB ? MB : 1;
                const uint32_t *xb = xt + b * K2 * 16;
                uint16_t *o = out + n0;
                if (C == NC && J == 2) micro(o, N, M, 16 * b, xb, wp, K, NC, 2);
                else if (C == NC) micro(o, N, M, 16 * b, xb, wp, K, NC, 1);
                else if (J == 2) for (int c = 0; c < C; ++c) micro(o + c, N, M, 16 * b, xb, wp + c * K, K, 1, 2);
                else for (int c = 0; c < C; ++c) micro(o + c, N, M, 16 * b, xb, wp + c * K, K, 1, 1);
            }
        }
        free(wp);
    }
    free(xt);
    return failed ? 2 : 0;
#else
    (void)out; (void)x; (void)M; (void)K; (void)N; (void)w; (void)bits; (void)scales; (void)zeros; (void)gs;
    (void)nthreads;
    return 1;
#endif
}
