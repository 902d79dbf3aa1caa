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
 * float32 uses the same panels without the pairing (panels[p][k][c]) and FMA; AVX2 builds store
 * each float32 panel by halves instead (panels[p][h][k][j] = w[32 p + 16 h + j][k]), see below.
 * CPUs with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2/3, Intel before Cooper Lake) run the
 * same panels with 8-float FMAs: a 32-bit pair of bf16 weights becomes its two float32s by one
 * shift (even column) and one mask (odd column), exact, and each column's sum runs over k in
 * the same order (even, then odd, of each pair) for every batch size, so a row's result does
 * not depend on which other rows share its step. Without either, mmkit keeps oneDNN / F.linear
 * (layers/linear_panels.py). */
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include "bf16.h"
#include "silu_mul_avx512.h"
#include "kv_warm.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MMKIT_P_BF16DP 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MMKIT_P_AVX2 1
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
                             const uint16_t *panel, int64_t Kp, const uint16_t *bias, int64_t ncols,
                             WarmCursor *wc) {
    __m512 acc[MMKIT_MR][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < Kp; ++kp) {
        if (wc && kp % MMKIT_WARM_EVERY == 0) warm_step(wc);
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
                                 const float *panel, int64_t K, const float *bias, int64_t ncols, WarmCursor *wc) {
    __m512 acc[MMKIT_MR][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        if (wc && k % MMKIT_WARM_EVERY == 0) warm_step(wc);
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
    MMKIT_P_ROWS(panel_rows, o, xm, R, panel, K / 2, b, ncols, NULL)
}

/* mmkit_panel_rows_bf16 warming K/V on the way (kv_warm.h). */
static void panel_rows_bf16_warm(uint16_t *o, int64_t N, const uint16_t *xm, int64_t xs, int R,
                                 const uint16_t *panel, int64_t K, const uint16_t *b, int64_t ncols, WarmCursor *wc) {
    MMKIT_P_ROWS(panel_rows, o, xm, R, panel, K / 2, b, ncols, wc)
}

/* Rows [m0, m1) of x against panel p (output columns n0 = 32 p ..), MMKIT_MR rows at a time
 * (R a compile-time constant in each case, so the accumulators stay in registers). */
static void panel_block(void *out, int64_t N, const void *x, int64_t xs, int64_t m0, int64_t m1,
                        const void *panels, int64_t K, const void *bias, int64_t p, int dtype, WarmCursor *wc) {
    if (wc->j >= wc->j_end) wc = NULL; /* nothing (left) to warm: the plain loop */
    const int64_t n0 = p * MMKIT_PANEL, ncols = N - n0 < MMKIT_PANEL ? N - n0 : MMKIT_PANEL;
    for (int64_t m = m0; m < m1; m += MMKIT_MR) {
        const int64_t R = m1 - m < MMKIT_MR ? m1 - m : MMKIT_MR;
        if (dtype == 1) {
            if (wc)
                panel_rows_bf16_warm((uint16_t *)out + m * N + n0, N, (const uint16_t *)x + m * xs, xs, (int)R,
                                     (const uint16_t *)panels + p * K * MMKIT_PANEL, K,
                                     bias ? (const uint16_t *)bias + n0 : NULL, ncols, wc);
            else
                mmkit_panel_rows_bf16((uint16_t *)out + m * N + n0, N, (const uint16_t *)x + m * xs, xs, (int)R,
                                      (const uint16_t *)panels + p * K * MMKIT_PANEL, K,
                                      bias ? (const uint16_t *)bias + n0 : NULL, ncols);
        } else {
            const float *panel = (const float *)panels + p * K * MMKIT_PANEL;
            const float *b = bias ? (const float *)bias + n0 : NULL;
            float *o = (float *)out + m * N + n0;
            const float *xm = (const float *)x + m * xs;
            MMKIT_P_ROWS(panel_rows_f32, o, xm, R, panel, K, b, ncols, wc)
        }
    }
}

/* SiLU(gate) * up fused into the gate/up GEMM's epilogue (issue 52 item 2). The fused gate/up
 * projection's panels hold gate's columns then up's ([gate | up], models/llama.py), so when
 * `inter` is a multiple of 32, gate panel p and up panel P_g + p cover the same columns: one
 * pass over both keeps 4 accumulators per row of x (MMKIT_MR_SILU rows: 24 of the 32 zmm
 * registers) and writes only the activation [M, inter]. The unfused path wrote gate_up
 * [M, 2 inter], read it back, and at decode's row counts ran that pass on one thread (below
 * elementwise_cpu.c's parallel threshold) while the other waited; here each thread finishes
 * its own columns. Bit-identical to GEMM then mmkit_silu_mul_*: the same float32 sums in the
 * same order, the same rounding to the output dtype, then the unfused pass's own SiLU: for
 * bf16 the 16-lane silu_mul_bf16_16 (silu_mul_avx512.h) on the accumulators, for float32 the
 * row function of elementwise_f32_cpu.c (compiled there, with that file's floating-point
 * flags: fp-contract off). */
#define MMKIT_MR_SILU 6
void mmkit_silu_mul_f32_row(float *out, const float *gate, const float *up, int64_t n);
MMKIT_INLINE void silu_rows_bf16(uint16_t *out, int64_t out_stride, const uint16_t *x, int64_t xs, const int R,
                                 const uint16_t *pg, const uint16_t *pu, int64_t Kp, const uint16_t *bg,
                                 const uint16_t *bu, WarmCursor *wc) {
    __m512 acc[MMKIT_MR_SILU][4];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < Kp; ++kp) {
        if (wc && kp % MMKIT_WARM_EVERY == 0) warm_step(wc);
        _mm_prefetch((const char *)(pg + kp * 64) + MMKIT_PF_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(pg + kp * 64) + MMKIT_PF_BYTES + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)(pu + kp * 64) + MMKIT_PF_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(pu + kp * 64) + MMKIT_PF_BYTES + 64, _MM_HINT_T0);
        const __m512bh g0 = (__m512bh)_mm512_loadu_si512(pg + kp * 64);
        const __m512bh g1 = (__m512bh)_mm512_loadu_si512(pg + kp * 64 + 32);
        const __m512bh u0 = (__m512bh)_mm512_loadu_si512(pu + kp * 64);
        const __m512bh u1 = (__m512bh)_mm512_loadu_si512(pu + kp * 64 + 32);
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            __builtin_memcpy(&pair, x + r * xs + 2 * kp, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, g0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, g1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, u0);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, u1);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 2; ++j) { /* columns 16 j .. 16 j + 15 of this panel pair */
            __m512 g = acc[r][j], u = acc[r][2 + j];
            if (bg) {
                g = _mm512_add_ps(g, bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(bg + 16 * j))));
                u = _mm512_add_ps(u, bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(bu + 16 * j))));
            }
            _mm256_storeu_si256((__m256i *)(out + r * out_stride + 16 * j),
                                silu_mul_bf16_16(_mm512_cvtepi32_epi16(f32_to_bf16_512(g)),
                                                 _mm512_cvtepi32_epi16(f32_to_bf16_512(u))));
        }
}

MMKIT_INLINE void silu_rows_f32(float *out, int64_t out_stride, const float *x, int64_t xs, const int R,
                                const float *pg, const float *pu, int64_t K, const float *bg, const float *bu,
                                WarmCursor *wc) {
    __m512 acc[MMKIT_MR_SILU][4];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        if (wc && k % MMKIT_WARM_EVERY == 0) warm_step(wc);
        _mm_prefetch((const char *)(pg + k * 32) + MMKIT_PF_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(pg + k * 32) + MMKIT_PF_BYTES + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)(pu + k * 32) + MMKIT_PF_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(pu + k * 32) + MMKIT_PF_BYTES + 64, _MM_HINT_T0);
        const __m512 g0 = _mm512_loadu_ps(pg + k * 32), g1 = _mm512_loadu_ps(pg + k * 32 + 16);
        const __m512 u0 = _mm512_loadu_ps(pu + k * 32), u1 = _mm512_loadu_ps(pu + k * 32 + 16);
        for (int r = 0; r < R; ++r) {
            const __m512 xb = _mm512_set1_ps(x[r * xs + k]);
            acc[r][0] = _mm512_fmadd_ps(xb, g0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xb, g1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(xb, u0, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(xb, u1, acc[r][3]);
        }
    }
    for (int r = 0; r < R; ++r) {
        float v[2 * MMKIT_PANEL];
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(v + 16 * j, acc[r][j]);
        if (bg)
            for (int c = 0; c < 2 * MMKIT_PANEL; ++c) v[c] += c < MMKIT_PANEL ? bg[c] : bu[c - MMKIT_PANEL];
        mmkit_silu_mul_f32_row(out + r * out_stride, v, v + MMKIT_PANEL, MMKIT_PANEL);
    }
}

#define MMKIT_SILU_ROWS(FN, o, xm, R, ...)                \
    switch (R) {                                           \
    case 6: FN(o, inter, xm, xs, 6, __VA_ARGS__); break;   \
    case 5: FN(o, inter, xm, xs, 5, __VA_ARGS__); break;   \
    case 4: FN(o, inter, xm, xs, 4, __VA_ARGS__); break;   \
    case 3: FN(o, inter, xm, xs, 3, __VA_ARGS__); break;   \
    case 2: FN(o, inter, xm, xs, 2, __VA_ARGS__); break;   \
    default: FN(o, inter, xm, xs, 1, __VA_ARGS__); break;  \
    }

/* Rows [m0, m1) of x against gate panel p and its up panel; out [M, inter]. */
static void silu_block(void *out, int64_t inter, const void *x, int64_t xs, int64_t m0, int64_t m1,
                       const void *panels, int64_t K, const void *bias, int64_t p, int dtype, WarmCursor *wc) {
    const int64_t pu_index = inter / MMKIT_PANEL + p, n0 = p * MMKIT_PANEL;
    for (int64_t m = m0; m < m1; m += MMKIT_MR_SILU) {
        const int R = m1 - m < MMKIT_MR_SILU ? (int)(m1 - m) : MMKIT_MR_SILU;
        if (dtype == 1) {
            const uint16_t *pw = (const uint16_t *)panels, *b = (const uint16_t *)bias;
            uint16_t *o = (uint16_t *)out + m * inter + n0;
            const uint16_t *xm = (const uint16_t *)x + m * xs;
            MMKIT_SILU_ROWS(silu_rows_bf16, o, xm, R, pw + p * K * MMKIT_PANEL, pw + pu_index * K * MMKIT_PANEL, K / 2,
                            b ? b + n0 : NULL, b ? b + inter + n0 : NULL, wc)
        } else {
            const float *pw = (const float *)panels, *b = (const float *)bias;
            float *o = (float *)out + m * inter + n0;
            const float *xm = (const float *)x + m * xs;
            MMKIT_SILU_ROWS(silu_rows_f32, o, xm, R, pw + p * K * MMKIT_PANEL, pw + pu_index * K * MMKIT_PANEL, K,
                            b ? b + n0 : NULL, b ? b + inter + n0 : NULL, wc)
        }
    }
}
#undef MMKIT_SILU_ROWS

/* The AVX512-BF16 driver: P panels (or gate/up panel pairs) split into contiguous runs over the
 * threads, MMKIT_M_CHUNK rows of x per pass; `block` does rows [m0, m1) of one panel, writing
 * the `N` columns of out's rows. */
typedef void (*panel_block_fn)(void *out, int64_t N, const void *x, int64_t xs, int64_t m0, int64_t m1,
                               const void *panels, int64_t K, const void *bias, int64_t p, int dtype,
                               WarmCursor *wc);
/* `warm` (or NULL): K/V blocks to warm during the first chunk of rows, spread over each
 * thread's inner-loop steps (`mr` rows per block; a step is a pair of bf16 columns of K or one
 * float32 column). */
static void run_blocks(panel_block_fn block, int64_t P, void *out, int64_t N, const void *x, int64_t xs, int64_t M,
                       const void *panels, int64_t K, const void *bias, int dtype, int nthreads,
                       const MmkitKvWarm *warm, int64_t mr) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > P) nthreads = (int)P;
    for (int64_t c0 = 0; c0 < M; c0 += MMKIT_M_CHUNK) {
        const int64_t c1 = c0 + MMKIT_M_CHUNK < M ? c0 + MMKIT_M_CHUNK : M;
#pragma omp parallel num_threads(nthreads)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t p0 = P * t / nt, p1 = P * (t + 1) / nt;
            const int64_t steps = (p1 - p0) * ((c1 - c0 + mr - 1) / mr) * (dtype == 1 ? K / 2 : K);
            WarmCursor wc = warm_cursor(c0 == 0 ? warm : NULL, t, nt, steps);
            for (int64_t p = p0; p < p1; ++p) block(out, N, x, xs, c0, c1, panels, K, bias, p, dtype, &wc);
        }
    }
}
#endif

#ifdef MMKIT_P_AVX2
/* AVX2 + FMA. 16 ymm registers hold at most 12 accumulators of 8 floats beside the weights and
 * a broadcast, so a block is 1 row x the whole panel (batch 1: the panel streamed, prefetched)
 * or up to MMKIT_A2_MR rows x half the panel (16 columns; the panel is read twice from L2 per
 * block). float32 panels are stored by halves, [P][2][K][16], so that a half-pass is one
 * sequential stream of K x 64 bytes: stored by rows of 32 ([P][K][32]), a half-pass read every
 * other line, the hardware prefetcher lagged and the L2 held lines half used (round 4o:
 * 0.76-0.98x the time, benchmarks/results/round4/o/subpanel_ab.c). bf16 keeps its pairs
 * layout: half a row of pairs is a whole 64-byte line. bf16 rows of x are first widened to
 * float32 (MMKIT_A2_XBUF bytes at a time, shared by every panel): widening each pair inside the
 * loop cost more than the FMAs it fed. Sums and the one rounding to bf16 are as in the
 * AVX512-BF16 path. */
#define MMKIT_A2_MR 6 /* float32 rows per block (6 x 2 accumulators); bf16 takes 4 */
#define MMKIT_A2_MR_BF16 4
#define MMKIT_A2_XBUF (192 * 1024)

/* R rows of float32 x (rows xs apart) against columns [8 c0, 8 (c0 + NC)) of one panel
 * (bf16 pairs when BF16, else float32); the R x 8 NC sums go to v (rows vs apart). NC is 4
 * only with R = 1; bf16 takes R <= MMKIT_A2_MR_BF16. The accumulators are named variables:
 * held in an array, gcc 12 stored every one of them to the stack after each FMA (half the
 * speed). PF (the first block of rows of a panel only): prefetch the weights ahead, both lines
 * of each row of bf16 pairs (a half-pass reads one of them), or the float32 half's own stream.
 * The first block is the one that brings the panel from memory (later blocks find it in L2),
 * and the hardware prefetcher lagged on it: at 16 rows the GEMM ran at 54-57 GFLOPS without
 * it, 71-72 with it (2 threads, Zen 3, round 4m). */
#define MMKIT_A2_OUT(r, j, A) if (R > r) _mm256_storeu_ps(v + r * vs + 8 * (c0 + j), A);
MMKIT_INLINE void a2_rows(float *v, int64_t vs, const float *x, int64_t xs, const int R, const int NC,
                          const int c0, const void *panel, int64_t K, const int BF16, const int PF) {
    if (BF16 && NC == 2) {
        const uint16_t *pw = (const uint16_t *)panel + 16 * c0;
        const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
               a31 = a00;
        for (int64_t kp = 0; kp < K / 2; ++kp) {
            if (PF) {
                _mm_prefetch((const char *)((const uint16_t *)panel + kp * 64) + MMKIT_PF_BYTES, _MM_HINT_T0);
                _mm_prefetch((const char *)((const uint16_t *)panel + kp * 64) + MMKIT_PF_BYTES + 64, _MM_HINT_T0);
            }
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(pw + kp * 64));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(pw + kp * 64 + 16));
            /* a pair holds column k (low half) and k + 1 (high half): widening is exact */
            const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
            const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, hi));
            const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
            const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, hi));
#define MMKIT_A2_ROW(r, A0, A1)                                                          \
            if (R > r) {                                                                 \
                const __m256 xe = _mm256_broadcast_ss(x + r * xs + 2 * kp);              \
                const __m256 xo = _mm256_broadcast_ss(x + r * xs + 2 * kp + 1);          \
                A0 = _mm256_fmadd_ps(xo, o0, _mm256_fmadd_ps(xe, e0, A0));               \
                A1 = _mm256_fmadd_ps(xo, o1, _mm256_fmadd_ps(xe, e1, A1));               \
            }
            MMKIT_A2_ROW(0, a00, a01) MMKIT_A2_ROW(1, a10, a11) MMKIT_A2_ROW(2, a20, a21) MMKIT_A2_ROW(3, a30, a31)
#undef MMKIT_A2_ROW
        }
        MMKIT_A2_OUT(0, 0, a00) MMKIT_A2_OUT(0, 1, a01) MMKIT_A2_OUT(1, 0, a10) MMKIT_A2_OUT(1, 1, a11)
        MMKIT_A2_OUT(2, 0, a20) MMKIT_A2_OUT(2, 1, a21) MMKIT_A2_OUT(3, 0, a30) MMKIT_A2_OUT(3, 1, a31)
    } else if (BF16) { /* one row, the whole panel: a0..a3 are its four groups of 8 columns */
        const uint16_t *pw = (const uint16_t *)panel;
        const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t kp = 0; kp < K / 2; ++kp) {
            const uint16_t *w = pw + kp * 64;
            _mm_prefetch((const char *)w + MMKIT_PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)w + MMKIT_PF_BYTES + 64, _MM_HINT_T0);
            const __m256 xe = _mm256_broadcast_ss(x + 2 * kp), xo = _mm256_broadcast_ss(x + 2 * kp + 1);
#define MMKIT_A2_COLS(A, off)                                                                 \
            {                                                                                 \
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + off));             \
                A = _mm256_fmadd_ps(xo, _mm256_castsi256_ps(_mm256_and_si256(v, hi)),         \
                                    _mm256_fmadd_ps(xe, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), A)); \
            }
            MMKIT_A2_COLS(a0, 0) MMKIT_A2_COLS(a1, 16) MMKIT_A2_COLS(a2, 32) MMKIT_A2_COLS(a3, 48)
#undef MMKIT_A2_COLS
        }
        MMKIT_A2_OUT(0, 0, a0) MMKIT_A2_OUT(0, 1, a1) MMKIT_A2_OUT(0, 2, a2) MMKIT_A2_OUT(0, 3, a3)
    } else if (NC == 2) { /* float32 halves: c0 / 2 is the half, one sequential stream of K x 64 bytes */
        const float *pw = (const float *)panel + (c0 / 2) * K * 16;
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
               a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
        for (int64_t k = 0; k < K; ++k) {
            if (PF) _mm_prefetch((const char *)(pw + k * 16) + MMKIT_PF_BYTES, _MM_HINT_T0);
            const __m256 w0 = _mm256_loadu_ps(pw + k * 16), w1 = _mm256_loadu_ps(pw + k * 16 + 8);
#define MMKIT_A2_ROW(r, A0, A1)                                         \
            if (R > r) {                                                \
                const __m256 xb = _mm256_broadcast_ss(x + r * xs + k);  \
                A0 = _mm256_fmadd_ps(xb, w0, A0);                       \
                A1 = _mm256_fmadd_ps(xb, w1, A1);                       \
            }
            MMKIT_A2_ROW(0, a00, a01) MMKIT_A2_ROW(1, a10, a11) MMKIT_A2_ROW(2, a20, a21) MMKIT_A2_ROW(3, a30, a31)
            MMKIT_A2_ROW(4, a40, a41) MMKIT_A2_ROW(5, a50, a51)
#undef MMKIT_A2_ROW
        }
        MMKIT_A2_OUT(0, 0, a00) MMKIT_A2_OUT(0, 1, a01) MMKIT_A2_OUT(1, 0, a10) MMKIT_A2_OUT(1, 1, a11)
        MMKIT_A2_OUT(2, 0, a20) MMKIT_A2_OUT(2, 1, a21) MMKIT_A2_OUT(3, 0, a30) MMKIT_A2_OUT(3, 1, a31)
        MMKIT_A2_OUT(4, 0, a40) MMKIT_A2_OUT(4, 1, a41) MMKIT_A2_OUT(5, 0, a50) MMKIT_A2_OUT(5, 1, a51)
    } else { /* one row, float32: both halves' streams at once */
        const float *h0 = (const float *)panel, *h1 = h0 + K * 16;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = 0; k < K; ++k) {
            _mm_prefetch((const char *)(h0 + k * 16) + MMKIT_PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)(h1 + k * 16) + MMKIT_PF_BYTES, _MM_HINT_T0);
            const __m256 xb = _mm256_broadcast_ss(x + k);
            a0 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(h0 + k * 16), a0);
            a1 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(h0 + k * 16 + 8), a1);
            a2 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(h1 + k * 16), a2);
            a3 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(h1 + k * 16 + 8), a3);
        }
        MMKIT_A2_OUT(0, 0, a0) MMKIT_A2_OUT(0, 1, a1) MMKIT_A2_OUT(0, 2, a2) MMKIT_A2_OUT(0, 3, a3)
    }
}
#undef MMKIT_A2_OUT

/* R (<= MMKIT_A2_MR) rows against one panel: 1 row in one pass (prefetching all the way),
 * more by halves. When PF, bf16's first half prefetches both halves (they share each line of
 * the pairs' rows); float32's halves are separate streams, each prefetched in its own pass. */
MMKIT_INLINE void a2_panel(float *v, int64_t vs, const float *x, int64_t xs, const int R, const void *panel,
                           int64_t K, const int BF16, const int PF) {
    if (R == 1) {
        a2_rows(v, vs, x, xs, 1, 4, 0, panel, K, BF16, 0);
    } else {
        a2_rows(v, vs, x, xs, R, 2, 0, panel, K, BF16, PF);
        a2_rows(v, vs, x, xs, R, 2, 2, panel, K, BF16, BF16 ? 0 : PF);
    }
}

#define MMKIT_A2_CASE(n, BF16) \
    case n: if (pf) a2_panel(v, vs, x, xs, n, panel, K, BF16, 1); else a2_panel(v, vs, x, xs, n, panel, K, BF16, 0); break;
static void a2_block(float *v, int64_t vs, const float *x, int64_t xs, int R, const void *panel, int64_t K,
                     int bf16, int pf) {
    if (bf16) { /* R <= MMKIT_A2_MR_BF16 */
        switch (R) {
        MMKIT_A2_CASE(4, 1) MMKIT_A2_CASE(3, 1) MMKIT_A2_CASE(2, 1)
        default: a2_panel(v, vs, x, xs, 1, panel, K, 1, 0); break;
        }
        return;
    }
    switch (R) {
    MMKIT_A2_CASE(6, 0) MMKIT_A2_CASE(5, 0) MMKIT_A2_CASE(4, 0) MMKIT_A2_CASE(3, 0) MMKIT_A2_CASE(2, 0)
    default: a2_panel(v, vs, x, xs, 1, panel, K, 0, 0); break;
    }
}
#undef MMKIT_A2_CASE

/* Rows [0, M) of float32 x (rows xs apart) against panel p; out [M, N] of `dtype`. A float32
 * block of a whole panel without bias is written in place (no copy through v). */
static void a2_panel_rows(void *out, int64_t N, const float *x, int64_t xs, int64_t M, const void *panels,
                          int64_t K, const void *bias, int64_t p, int dtype) {
    const int64_t n0 = p * MMKIT_PANEL, ncols = N - n0 < MMKIT_PANEL ? N - n0 : MMKIT_PANEL;
    const void *panel = dtype == 1 ? (const void *)((const uint16_t *)panels + p * K * MMKIT_PANEL)
                                   : (const void *)((const float *)panels + p * K * MMKIT_PANEL);
    float v[MMKIT_A2_MR][MMKIT_PANEL];
    const int64_t mr = dtype == 1 ? MMKIT_A2_MR_BF16 : MMKIT_A2_MR;
    const int direct = dtype == 0 && ncols == MMKIT_PANEL && !bias;
    for (int64_t m = 0; m < M; m += mr) {
        const int R = M - m < mr ? (int)(M - m) : (int)mr;
        a2_block(direct ? (float *)out + m * N + n0 : &v[0][0], direct ? N : MMKIT_PANEL, x + m * xs, xs, R, panel, K,
                 dtype == 1, m == 0);
        for (int r = 0; r < R && !direct; ++r) {
            if (dtype == 1) {
                uint16_t *o = (uint16_t *)out + (m + r) * N + n0;
                const uint16_t *b = bias ? (const uint16_t *)bias + n0 : NULL;
                for (int64_t c = 0; c < ncols; ++c) o[c] = f32_to_bf16(b ? v[r][c] + bf16_to_f32(b[c]) : v[r][c]);
            } else {
                float *o = (float *)out + (m + r) * N + n0;
                const float *b = bias ? (const float *)bias + n0 : NULL;
                for (int64_t c = 0; c < ncols; ++c) o[c] = b ? v[r][c] + b[c] : v[r][c];
            }
        }
    }
}

/* The AVX2 GEMM: float32 x is used in place, MMKIT_M_CHUNK rows per pass; bf16 x is widened
 * chunk by chunk (on the calling thread) into a buffer of at most MMKIT_A2_XBUF bytes, then the
 * threads split the panels over the chunk. */
static int a2_gemm(void *out, const void *x, int64_t xs, int64_t M, int64_t K, int64_t N, const void *panels,
                   const void *bias, int dtype, int nthreads) {
    const int64_t P = (N + MMKIT_PANEL - 1) / MMKIT_PANEL;
    const int64_t mr = dtype == 1 ? MMKIT_A2_MR_BF16 : MMKIT_A2_MR;
    int64_t rows = dtype == 1 ? MMKIT_A2_XBUF / (4 * K) : MMKIT_M_CHUNK;
    rows = rows < mr ? mr : rows / mr * mr; /* whole blocks per chunk */
    if (rows > M) rows = M;
    float *buf = NULL;
    if (dtype == 1) {
        buf = (float *)malloc((size_t)(rows * K) * sizeof(float));
        if (!buf) return 2;
    }
    int pthreads = nthreads < 1 ? 1 : nthreads;
    if (pthreads > P) pthreads = (int)P;
    for (int64_t c0 = 0; c0 < M; c0 += rows) {
        const int64_t c1 = c0 + rows < M ? c0 + rows : M;
        if (dtype == 1) {
            for (int64_t m = c0; m < c1; ++m) {
                const uint16_t *xr = (const uint16_t *)x + m * xs;
                float *br = buf + (m - c0) * K;
                for (int64_t k = 0; k < K; ++k) br[k] = bf16_to_f32(xr[k]);
            }
        }
        const float *xc = dtype == 1 ? buf : (const float *)x + c0 * xs;
        const int64_t xcs = dtype == 1 ? K : xs;
        void *oc = dtype == 1 ? (void *)((uint16_t *)out + c0 * N) : (void *)((float *)out + c0 * N);
#pragma omp parallel num_threads(pthreads)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            for (int64_t p = P * t / nt; p < P * (t + 1) / nt; ++p)
                a2_panel_rows(oc, N, xc, xcs, c1 - c0, panels, K, bias, p, dtype);
        }
    }
    free(buf);
    return 0;
}
#endif

/* x: [M, K] (dtype 0 float32, 1 bf16 with K even), rows x_stride apart; panels as above for N
 * outputs; bias [N] or NULL; out: [M, N] dense, all of x's dtype. Threads split the panels
 * (contiguous runs); rows of x go MMKIT_M_CHUNK at a time.
 * Returns 0; 1 when this build has neither the AVX512-BF16 nor the AVX2 path (nothing written);
 * 2 when the AVX2 path could not allocate its widening buffer. */
/* mmkit_panel_gemm that also warms `warm`'s K/V blocks (kv_warm.h; NULL: none; the AVX2
 * panels do not warm). */
int mmkit_panel_gemm_warm(void *out, const void *x, int64_t x_stride, int64_t M, int64_t K, int64_t N,
                          const void *panels, const void *bias, int dtype, int nthreads, const MmkitKvWarm *warm) {
#if defined(MMKIT_P_AVX2)
    (void)warm;
    return a2_gemm(out, x, x_stride, M, K, N, panels, bias, dtype, nthreads);
#elif defined(MMKIT_P_BF16DP)
    run_blocks(panel_block, (N + MMKIT_PANEL - 1) / MMKIT_PANEL, out, N, x, x_stride, M, panels, K, bias, dtype, nthreads,
               warm, MMKIT_MR);
    return 0;
#else
    (void)out; (void)x; (void)x_stride; (void)M; (void)K; (void)N; (void)panels; (void)bias; (void)dtype;
    (void)nthreads; (void)warm;
    return 1;
#endif
}

int mmkit_panel_gemm(void *out, const void *x, int64_t x_stride, int64_t M, int64_t K, int64_t N,
                     const void *panels, const void *bias, int dtype, int nthreads) {
    return mmkit_panel_gemm_warm(out, x, x_stride, M, K, N, panels, bias, dtype, nthreads, NULL);
}

/* out [M, inter] = silu(x @ Wg^T + bg) * (x @ Wu^T + bu), rounded as mmkit_panel_gemm followed
 * by mmkit_silu_mul_bf16 / _f32 round (bit-identical), for the fused gate/up projection's
 * panels (N = 2 inter outputs, gate's columns first) and bias [2 inter] or NULL. Returns 0; 1
 * (nothing written; the caller runs the two passes) where mmkit_panel_gemm_silu_mul_takes says
 * no: AVX2 builds, `inter` not a multiple of 32 (an up panel would start inside a gate panel),
 * or K past the size where the fused pass stops paying. */
int mmkit_panel_gemm_silu_mul_takes(int64_t K, int64_t inter);
/* mmkit_panel_gemm_silu_mul that also warms `warm`'s K/V blocks (kv_warm.h; NULL: none). */
int mmkit_panel_gemm_silu_mul_warm(void *out, const void *x, int64_t x_stride, int64_t M, int64_t K, int64_t inter,
                                   const void *panels, const void *bias, int dtype, int nthreads,
                                   const MmkitKvWarm *warm) {
#if defined(MMKIT_P_BF16DP)
    if (!mmkit_panel_gemm_silu_mul_takes(K, inter)) return 1;
    run_blocks(silu_block, inter / MMKIT_PANEL, out, inter, x, x_stride, M, panels, K, bias, dtype, nthreads, warm,
               MMKIT_MR_SILU);
    return 0;
#else
    (void)out; (void)x; (void)x_stride; (void)M; (void)K; (void)inter; (void)panels; (void)bias; (void)dtype;
    (void)nthreads; (void)warm;
    return 1;
#endif
}

int mmkit_panel_gemm_silu_mul(void *out, const void *x, int64_t x_stride, int64_t M, int64_t K, int64_t inter,
                              const void *panels, const void *bias, int dtype, int nthreads) {
    return mmkit_panel_gemm_silu_mul_warm(out, x, x_stride, M, K, inter, panels, bias, dtype, nthreads, NULL);
}

/* 1 when mmkit_panel_gemm_silu_mul runs for these sizes: an AVX512-BF16 build, `inter` a
 * multiple of 32, and K at most MMKIT_SILU_MAX_K. Measured on Zen 5 (2 threads, 1-128 rows,
 * benchmarks/results/2026-12-07-round5c/ab/silu_kernel_ab_2threads.log): at K 576 (the benchmark
 * LLaVA) the fused pass takes 0.86-0.95x the two passes' time in bf16 and 0.82-0.98x in float32;
 * at K 1536 (Qwen2-VL-2B) 1.02-1.06x in bf16, where the SiLU pass is a smaller share of the
 * work than the 6-row blocks' cost over the plain kernel's 8 (an unexplained loss, kept out). */
#define MMKIT_SILU_MAX_K 1024
int mmkit_panel_gemm_silu_mul_takes(int64_t K, int64_t inter) {
#if defined(MMKIT_P_BF16DP)
    return inter > 0 && inter % MMKIT_PANEL == 0 && K <= MMKIT_SILU_MAX_K;
#else
    (void)K; (void)inter;
    return 0;
#endif
}

/* 1 when this build's float32 panels are stored by halves ([P][2][K][16], the AVX2 kernel), 0
 * when by rows of 32 ([P][K][32]); linear_panels.pack asks. */
int mmkit_panel_f32_halves(void) {
#if defined(MMKIT_P_AVX2)
    return 1;
#else
    return 0;
#endif
}

int mmkit_panel_gemm_available(void) {
#if defined(MMKIT_P_BF16DP) || defined(MMKIT_P_AVX2)
    return 1;
#else
    return 0;
#endif
}
