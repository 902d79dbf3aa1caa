/* int8 / int4 weight-only GEMM on 32-row panels, bf16 activations, every batch size:
 * out[m, n] = sum_k x[m, k] w'[n, k] + b[n],  w'[n, k] = (q[n, k] - z[n, g]) s[n, g],  g = k / gs.
 *
 * Why panels: the row-major kernels (csrc/quant_gemm_cpu.c) read a weight row of a few cache
 * lines, then jump to the next row; at batch 1 that stream ran at about half the bandwidth the
 * bf16 panels reach (csrc/linear_panels_cpu.c), so int8's half of the bytes bought nothing.
 * Here the integers sit in the bf16 panels' order (32 output rows, pairs of columns), so a
 * panel is one sequential stream and VDPBF16PS does the products. Layouts (zero past N):
 *
 *   int8: q[p][kp][2 c + e] = q[32 p + c][2 kp + e]           int8  [P, K/2, 64]
 *   int4: byte j of q[p][kp] holds element j (low nibble) and element 32 + j (high nibble)
 *         of the same 64 (2 c + e) ordering                     uint8 [P, K/2, 32]
 *   scales s[p][g][c] float32 [P, G, 32]; zeros z[p][g][c] int8 (int8) / uint8 (int4) or NULL.
 *
 * Two ways to run a panel:
 * - direct (a few rows, decode): the integers become bf16 in registers. int8 through float32
 *   (exact). int4 with no arithmetic: a nibble u OR 0x4300 is the bf16 bit pattern of 128 + u,
 *   so sum_k (u - z) x = sum_k (128 + u) x - (128 + z) sum_k x, with sum_k x per group and row
 *   computed once per call; int8 with zero points uses the same correction with z alone.
 *   Per group the float32 partial sum is scaled once: s (sum - z' xsum).
 * - decoded (more rows): the panel is decoded once into a bf16 panel w' = bf16((q - z) s),
 *   computed in float32 exactly as QuantizedWeight.dequantize, and the bf16 panel GEMM sweeps
 *   the rows over it from L2 (mmkit_panel_rows_bf16): the decode is amortized over the rows.
 * Outputs are rounded once to bf16 after the bias, as the bf16 panels do. */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include "bf16.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MMKIT_QP_BF16DP 1
#endif

#define MMKIT_QP 32
#define MMKIT_QP_MR 8 /* rows per register block (as the bf16 panels) */
#define MMKIT_QP_PF_BYTES 4096
#define MMKIT_INLINE static inline __attribute__((always_inline))

#ifdef MMKIT_QP_BF16DP
void mmkit_panel_rows_bf16(uint16_t *o, int64_t N, const uint16_t *xm, int64_t xs, int R,
                           const uint16_t *panel, int64_t K, const uint16_t *b, int64_t ncols);

/* 64 int8 -> float32, in 4 vectors of 16 (elements 0-15, 16-31, 32-47, 48-63). */
MMKIT_INLINE void q8_f32(const int8_t *src, __m512 f[4]) {
    for (int i = 0; i < 4; ++i) f[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16 * i))));
}

/* 32 bytes of int4 -> the 64 values as float32 (same split as q8_f32). */
MMKIT_INLINE void q4_f32(const uint8_t *src, __m512 f[4]) {
    const __m512i m = _mm512_set1_epi32(15);
    const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
    const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + 16)));
    f[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b0, m));
    f[1] = _mm512_cvtepi32_ps(_mm512_and_si512(b1, m));
    f[2] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4));
    f[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4));
}

/* Per-column float32 vector of 32 (two halves) -> the 4 vectors matching the pair order:
 * element i of vector j belongs to column (16 j + i) / 2. */
MMKIT_INLINE void per_pair(const __m512 lo, const __m512 hi, __m512 out[4]) {
    const __m512i i0 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i i1 = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    out[0] = _mm512_permutexvar_ps(i0, lo);
    out[1] = _mm512_permutexvar_ps(i1, lo);
    out[2] = _mm512_permutexvar_ps(i0, hi);
    out[3] = _mm512_permutexvar_ps(i1, hi);
}

MMKIT_INLINE void zeros_f32(const void *z, int bits, __m512 *lo, __m512 *hi) {
    if (bits == 8) {
        *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)z)));
        *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)z + 16))));
    } else {
        *lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)z)));
        *hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)z + 16))));
    }
}

/* Decode panel p into a bf16 panel [K/2][64]: bf16((q - z) * s), float32 inside. */
static void decode_panel(uint16_t *dst, const uint8_t *q, int bits, const float *s, const void *z,
                         int64_t Kp, int64_t gkp) {
    const int64_t bytes = bits == 8 ? 64 : 32;
    for (int64_t kp0 = 0, g = 0; kp0 < Kp; kp0 += gkp, ++g) {
        __m512 sv[4], zv[4];
        per_pair(_mm512_loadu_ps(s + g * 32), _mm512_loadu_ps(s + g * 32 + 16), sv);
        if (z) {
            __m512 zl, zh;
            zeros_f32((const uint8_t *)z + g * 32, bits, &zl, &zh);
            per_pair(zl, zh, zv);
        }
        for (int64_t kp = kp0; kp < kp0 + gkp; ++kp) {
            __m512 f[4];
            if (bits == 8) q8_f32((const int8_t *)q + kp * bytes, f);
            else q4_f32(q + kp * bytes, f);
            for (int i = 0; i < 4; ++i) f[i] = _mm512_mul_ps(z ? _mm512_sub_ps(f[i], zv[i]) : f[i], sv[i]);
            _mm512_storeu_si512(dst + kp * 64, (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]));
            _mm512_storeu_si512(dst + kp * 64 + 32, (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]));
        }
    }
}

/* R rows of x against quantized panel p, the integers decoded in registers (module comment).
 * xsum: [R][G] float32 rows G apart (sum of x over each group), used only with zero points. */
MMKIT_INLINE void qpanel_rows(uint16_t *out, int64_t N, const uint16_t *x, int64_t xs, const int R,
                              const uint8_t *q, const int bits, const float *s, const void *z,
                              const float *xsum, int64_t G, int64_t Kp, int64_t gkp,
                              const uint16_t *bias, int64_t ncols) {
    const int64_t bytes = bits == 8 ? 64 : 32;
    const __m512i nib = _mm512_set1_epi16(15), c128 = _mm512_set1_epi16(0x4300);
    __m512 res[MMKIT_QP_MR][2];
    for (int r = 0; r < R; ++r) res[r][0] = res[r][1] = _mm512_setzero_ps();
    for (int64_t kp0 = 0, g = 0; kp0 < Kp; kp0 += gkp, ++g) {
        __m512 acc[MMKIT_QP_MR][2];
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t kp = kp0; kp < kp0 + gkp; ++kp) {
            const uint8_t *src = q + kp * bytes;
            _mm_prefetch((const char *)src + MMKIT_QP_PF_BYTES, _MM_HINT_T0);
            __m512bh w0, w1;
            if (bits == 8) {
                __m512 f[4];
                q8_f32((const int8_t *)src, f);
                w0 = _mm512_cvtne2ps_pbh(f[1], f[0]);
                w1 = _mm512_cvtne2ps_pbh(f[3], f[2]);
            } else {
                const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
                w0 = (__m512bh)_mm512_or_si512(_mm512_and_si512(b, nib), c128);
                w1 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(b, 4), c128);
            }
            for (int r = 0; r < R; ++r) {
                int32_t pair;
                __builtin_memcpy(&pair, x + r * xs + 2 * kp, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
            }
        }
        const __m512 s0 = _mm512_loadu_ps(s + g * 32), s1 = _mm512_loadu_ps(s + g * 32 + 16);
        if (bits == 4 || z) {
            /* the offset each element carries: 128 + z (int4), z (int8 with zero points) */
            __m512 z0 = _mm512_setzero_ps(), z1 = _mm512_setzero_ps();
            if (z) zeros_f32((const uint8_t *)z + g * 32, bits, &z0, &z1);
            if (bits == 4) {
                z0 = _mm512_add_ps(z0, _mm512_set1_ps(128.0f));
                z1 = _mm512_add_ps(z1, _mm512_set1_ps(128.0f));
            }
            for (int r = 0; r < R; ++r) {
                const __m512 xsb = _mm512_set1_ps(xsum[r * G + g]);
                acc[r][0] = _mm512_fnmadd_ps(z0, xsb, acc[r][0]);
                acc[r][1] = _mm512_fnmadd_ps(z1, xsb, acc[r][1]);
            }
        }
        for (int r = 0; r < R; ++r) {
            res[r][0] = _mm512_fmadd_ps(acc[r][0], s0, res[r][0]);
            res[r][1] = _mm512_fmadd_ps(acc[r][1], s1, res[r][1]);
        }
    }
    for (int r = 0; r < R; ++r) {
        float v[MMKIT_QP];
        _mm512_storeu_ps(v, res[r][0]);
        _mm512_storeu_ps(v + 16, res[r][1]);
        uint16_t *o = out + r * N;
        for (int64_t c = 0; c < ncols; ++c) o[c] = f32_to_bf16(bias ? v[c] + bf16_to_f32(bias[c]) : v[c]);
    }
}

#define MMKIT_QP_CASE(R_, BITS)                                                                        \
    case R_: qpanel_rows(o, N, xm, xs, R_, qp, BITS, sp, zp, xsum ? xsum + m * G : NULL, G, Kp, gkp, b, \
                         ncols); break;
#define MMKIT_QP_SWITCH(BITS)                                                                          \
    switch (R) {                                                                                       \
    MMKIT_QP_CASE(8, BITS) MMKIT_QP_CASE(7, BITS) MMKIT_QP_CASE(6, BITS) MMKIT_QP_CASE(5, BITS)       \
    MMKIT_QP_CASE(4, BITS) MMKIT_QP_CASE(3, BITS) MMKIT_QP_CASE(2, BITS) default: MMKIT_QP_CASE(1, BITS) \
    }
#endif

/* x: bf16 [M, K] (K even), rows x_stride apart; q/scales/zeros: panels as above for N outputs
 * (group_size even, dividing K); bias bf16 [N] or NULL; out: bf16 [M, N] dense.
 * direct_max_rows: up to this many rows the integers are decoded in registers, above it each
 * panel is decoded once into bf16 (module comment). Threads split the panels.
 * Returns 0; 1 when this build has no AVX512-BF16 path (nothing written); 2 when scratch
 * memory could not be allocated. */
int mmkit_quant_panel_gemm(uint16_t *out, const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, int64_t N,
                           const uint8_t *q, int bits, const float *scales, const void *zeros, int64_t group_size,
                           const uint16_t *bias, int64_t direct_max_rows, int nthreads) {
#ifdef MMKIT_QP_BF16DP
    const int64_t P = (N + MMKIT_QP - 1) / MMKIT_QP, Kp = K / 2, G = K / group_size, gkp = group_size / 2;
    const int64_t qbytes = Kp * (bits == 8 ? 64 : 32);
    const int64_t xs = x_stride;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > P) nthreads = (int)P;
    if (M <= direct_max_rows) {
        float *xsum = NULL;
        if (bits == 4 || zeros) { /* sum of x over each group, per row (the zero-point correction) */
            xsum = (float *)malloc((size_t)(M * G) * sizeof(float));
            if (!xsum) return 2;
            for (int64_t m = 0; m < M; ++m)
                for (int64_t g = 0; g < G; ++g) {
                    float acc = 0.0f;
                    for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) acc += bf16_to_f32(x[m * xs + k]);
                    xsum[m * G + g] = acc;
                }
        }
#pragma omp parallel num_threads(nthreads)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            for (int64_t p = P * t / nt; p < P * (t + 1) / nt; ++p) {
                const int64_t n0 = p * MMKIT_QP, ncols = N - n0 < MMKIT_QP ? N - n0 : MMKIT_QP;
                const uint8_t *qp = q + p * qbytes;
                const float *sp = scales + p * G * MMKIT_QP;
                const void *zp = zeros ? (const uint8_t *)zeros + p * G * MMKIT_QP : NULL;
                const uint16_t *b = bias ? bias + n0 : NULL;
                for (int64_t m = 0; m < M; m += MMKIT_QP_MR) {
                    const int64_t R = M - m < MMKIT_QP_MR ? M - m : MMKIT_QP_MR;
                    uint16_t *o = out + m * N + n0;
                    const uint16_t *xm = x + m * xs;
                    if (bits == 8) { MMKIT_QP_SWITCH(8) } else { MMKIT_QP_SWITCH(4) }
                }
            }
        }
        free(xsum);
        return 0;
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        uint16_t *panel = (uint16_t *)malloc((size_t)(Kp * 64) * sizeof(uint16_t));
        if (!panel) {
            failed = 1;
        } else {
            for (int64_t p = P * t / nt; p < P * (t + 1) / nt; ++p) {
                const int64_t n0 = p * MMKIT_QP, ncols = N - n0 < MMKIT_QP ? N - n0 : MMKIT_QP;
                const void *zp = zeros ? (const uint8_t *)zeros + p * G * MMKIT_QP : NULL;
                /* One decode per panel per call, then every row of x over it (x of a decode
                 * batch, M x K bf16, stays in L2 across the panels). */
                decode_panel(panel, q + p * qbytes, bits, scales + p * G * MMKIT_QP, zp, Kp, gkp);
                for (int64_t m = 0; m < M; m += MMKIT_QP_MR) {
                    const int R = (int)(M - m < MMKIT_QP_MR ? M - m : MMKIT_QP_MR);
                    mmkit_panel_rows_bf16(out + m * N + n0, N, x + m * xs, xs, R, panel, K,
                                          bias ? bias + n0 : NULL, ncols);
                }
            }
            free(panel);
        }
    }
    return failed ? 2 : 0;
#else
    (void)out; (void)x; (void)x_stride; (void)M; (void)K; (void)N; (void)q; (void)bits; (void)scales; (void)zeros;
    (void)group_size; (void)bias; (void)direct_max_rows; (void)nthreads;
    return 1;
#endif
}

/* 1 where this build has the quantized panels (AVX512-BF16); the dense panels' AVX2 path has no
 * quantized twin, so there int8/int4 weights keep quant_gemm_cpu.c's kernels. */
int mmkit_quant_panel_gemm_available(void) {
#ifdef MMKIT_QP_BF16DP
    return 1;
#else
    return 0;
#endif
}
