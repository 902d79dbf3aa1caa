/* GEMM on pre-packed weight panels (bf16 and float32), for every batch size:
 * out[m, n] = sum_k x[m, k] w[n, k] + b[n].
 *
 * Why our own: oneDNN's packed bf16 matmul is fast for many rows but reads weights at about
 * half the memory bandwidth at batch 1 (decode of one request, where a step reads every
 * weight once), and holding a second, row-major copy just for a GEMV doubles weight memory.
 * One layout serves both: panels of 32 output rows, each stored as K/2 pairs of columns
 * ("VNNI" order) so that one VDPBF16PS multiplies a broadcast pair of x by 32 bf16 weights:
 *
 *   panels[p][kp][c][e] = w[32 p + c][2 kp + e]    (c < 32, e < 2; zero past N and K)
 *
 * A panel is read front to back once per block of x rows: a plain sequential stream at batch 1,
 * and at larger batches a block that stays in L2 while MMKIT_MR rows of x sweep it, each
 * pair broadcast from L1 (16 accumulators: MMKIT_MR rows x 2 halves of the panel).
 * Products are summed in float32 (VDPBF16PS), the bias added in float32, one rounding to bf16,
 * as oneDNN's bf16 matmul does; only the order of the float32 sums differs from it.
 * float32 uses the same panels without the pairing (panels[p][k][c]) and FMA.
 * Built only where the CPU has AVX512-BF16; elsewhere mmkit keeps oneDNN / F.linear
 * (layers/linear_panels.py). */
#include <stdint.h>
#include <omp.h>
#include "bf16.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MMKIT_P_BF16DP 1
#endif

#define MMKIT_PANEL 32
#define MMKIT_MR 8
#define MMKIT_M_CHUNK 256 /* rows of x per pass over the weights: 256 x K bf16 stays in L2 */
#ifndef MMKIT_PF_BYTES
#define MMKIT_PF_BYTES 8192 /* prefetch distance: each pair of columns is 128 bytes (2 lines) */
#endif
#define MMKIT_INLINE static inline __attribute__((always_inline))

#ifdef MMKIT_P_BF16DP
/* R rows of x (compile-time after inlining) against one panel; writes R x 32 outputs. */
MMKIT_INLINE void panel_rows(uint16_t *out, int64_t out_stride, const uint16_t *x, int64_t xs, const int R,
                             const uint16_t *panel, int64_t Kp, const uint16_t *bias, int64_t ncols) {
    __m512 acc[MMKIT_MR][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < Kp; ++kp) {
        /* Prefetch the panel well ahead: at batch 1 nothing else hides the memory latency. */
        _mm_prefetch((const char *)(panel + kp * 64) + MMKIT_PF_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(panel + kp * 64) + MMKIT_PF_BYTES + 64, _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + kp * 64);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + kp * 64 + 32);
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            __builtin_memcpy(&pair, x + r * xs + 2 * kp, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
        }
    }
    for (int r = 0; r < R; ++r) {
        float v[MMKIT_PANEL];
        _mm512_storeu_ps(v, acc[r][0]);
        _mm512_storeu_ps(v + 16, acc[r][1]);
        uint16_t *o = out + r * out_stride;
        for (int64_t c = 0; c < ncols; ++c) o[c] = f32_to_bf16(bias ? v[c] + bf16_to_f32(bias[c]) : v[c]);
    }
}

/* float32 twin: panels[p][k][c] = w[32 p + c][k]; per column of k one broadcast of x and two
 * FMAs per row of x (16 accumulators for 8 rows). Sums run over k in order, one FMA each. */
MMKIT_INLINE void panel_rows_f32(float *out, int64_t out_stride, const float *x, int64_t xs, const int R,
                                 const float *panel, int64_t K, const float *bias, int64_t ncols) {
    __m512 acc[MMKIT_MR][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        _mm_prefetch((const char *)(panel + k * 32) + MMKIT_PF_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(panel + k * 32) + MMKIT_PF_BYTES + 64, _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(panel + k * 32);
        const __m512 w1 = _mm512_loadu_ps(panel + k * 32 + 16);
        for (int r = 0; r < R; ++r) {
            const __m512 xb = _mm512_set1_ps(x[r * xs + k]);
            acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; ++r) {
        float v[MMKIT_PANEL];
        _mm512_storeu_ps(v, acc[r][0]);
        _mm512_storeu_ps(v + 16, acc[r][1]);
        float *o = out + r * out_stride;
        for (int64_t c = 0; c < ncols; ++c) o[c] = bias ? v[c] + bias[c] : v[c];
    }
}

#define MMKIT_P_ROWS(FN, o, xm, R, ...)                   \
    switch (R) {                                           \
    case 8: FN(o, N, xm, xs, 8, __VA_ARGS__); break;       \
    case 7: FN(o, N, xm, xs, 7, __VA_ARGS__); break;       \
    case 6: FN(o, N, xm, xs, 6, __VA_ARGS__); break;       \
    case 5: FN(o, N, xm, xs, 5, __VA_ARGS__); break;       \
    case 4: FN(o, N, xm, xs, 4, __VA_ARGS__); break;       \
    case 3: FN(o, N, xm, xs, 3, __VA_ARGS__); break;       \
    case 2: FN(o, N, xm, xs, 2, __VA_ARGS__); break;       \
    default: FN(o, N, xm, xs, 1, __VA_ARGS__); break;      \
    }

/* Up to MMKIT_MR rows of bf16 x against one bf16 panel (K columns, even), writing
 * out[r * N + c] for c < ncols; bias (already offset to the panel's first column) or NULL.
 * Not static: the quantized panels (csrc/quant_panels_cpu.c) run it on a panel they decoded. */
void mmkit_panel_rows_bf16(uint16_t *o, int64_t N, const uint16_t *xm, int64_t xs, int R,
                           const uint16_t *panel, int64_t K, const uint16_t *b, int64_t ncols) {
    MMKIT_P_ROWS(panel_rows, o, xm, R, panel, K / 2, b, ncols)
}

/* Rows [m0, m1) of x against panel p (output columns n0 = 32 p ..), MMKIT_MR rows at a time
 * (R a compile-time constant in each case, so the accumulators stay in registers). */
static void panel_block(void *out, int64_t N, const void *x, int64_t xs, int64_t m0, int64_t m1,
                        const void *panels, int64_t K, const void *bias, int64_t p, int dtype) {
    const int64_t n0 = p * MMKIT_PANEL, ncols = N - n0 < MMKIT_PANEL ? N - n0 : MMKIT_PANEL;
    for (int64_t m = m0; m < m1; m += MMKIT_MR) {
        const int64_t R = m1 - m < MMKIT_MR ? m1 - m : MMKIT_MR;
        if (dtype == 1) {
            mmkit_panel_rows_bf16((uint16_t *)out + m * N + n0, N, (const uint16_t *)x + m * xs, xs, (int)R,
                                  (const uint16_t *)panels + p * K * MMKIT_PANEL, K,
                                  bias ? (const uint16_t *)bias + n0 : NULL, ncols);
        } else {
            const float *panel = (const float *)panels + p * K * MMKIT_PANEL;
            const float *b = bias ? (const float *)bias + n0 : NULL;
            float *o = (float *)out + m * N + n0;
            const float *xm = (const float *)x + m * xs;
            MMKIT_P_ROWS(panel_rows_f32, o, xm, R, panel, K, b, ncols)
        }
    }
}
#endif

/* x: [M, K] (dtype 0 float32, 1 bf16 with K even), rows x_stride apart; panels as above for N
 * outputs; bias [N] or NULL; out: [M, N] dense, all of x's dtype. Threads split the panels
 * (contiguous runs); rows of x go MMKIT_M_CHUNK at a time.
 * Returns 0, or 1 when this build has no AVX512-BF16 path (nothing written). */
int mmkit_panel_gemm(void *out, const void *x, int64_t x_stride, int64_t M, int64_t K, int64_t N,
                     const void *panels, const void *bias, int dtype, int nthreads) {
#ifdef MMKIT_P_BF16DP
    const int64_t P = (N + MMKIT_PANEL - 1) / MMKIT_PANEL;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > P) nthreads = (int)P;
    for (int64_t c0 = 0; c0 < M; c0 += MMKIT_M_CHUNK) {
        const int64_t c1 = c0 + MMKIT_M_CHUNK < M ? c0 + MMKIT_M_CHUNK : M;
#pragma omp parallel num_threads(nthreads)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            for (int64_t p = P * t / nt; p < P * (t + 1) / nt; ++p)
                panel_block(out, N, x, x_stride, c0, c1, panels, K, bias, p, dtype);
        }
    }
    return 0;
#else
    (void)out; (void)x; (void)x_stride; (void)M; (void)K; (void)N; (void)panels; (void)bias; (void)dtype;
    (void)nthreads;
    return 1;
#endif
}

int mmkit_panel_gemm_available(void) {
#ifdef MMKIT_P_BF16DP
    return 1;
#else
    return 0;
#endif
}
