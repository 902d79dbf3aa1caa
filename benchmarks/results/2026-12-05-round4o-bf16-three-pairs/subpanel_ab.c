/* Round 4o experiment: the float32 AVX2 panel GEMM with two weight layouts, same arithmetic.
 *   layout 0 (committed): panels[p][k][32]: a half-pass over 16 columns reads every other line
 *   layout 1 (tried):     panels[p][h][k][16]: each half of a panel is one sequential stream
 *   layout 2 (tried):     panels[p][q][k][8], blocks of 12 rows x 8 columns (12 accumulators,
 *                         one 32-byte weight load and 12 broadcasts per k: half the weight
 *                         bytes per FMA of the 6 x 16 block)
 * Blocks of up to 6 rows x 16 columns (12 accumulators), sums over k in order, so the outputs
 * must be bit-identical; the harness checks that. The decoder's four shapes x 6 layers (85 MB
 * of weights from memory), median of 9 alternating passes, 2 threads.
 *   gcc -O3 -march=native -fno-trapping-math -fopenmp -std=gnu11 subpanel_ab.c -o subpanel_ab
 *   OMP_WAIT_POLICY=PASSIVE ./subpanel_ab M */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PANEL 32
#define MR 6
#define PF_BYTES 8192
#define INL static inline __attribute__((always_inline))

/* R rows x 16 columns; w: the half's first column at k = 0; ws: floats between rows of k. */
INL void half_rows(float *o, int64_t os, const float *x, int64_t xs, const int R, const float *w, const int ws,
                   int64_t K, const int PF, const int PF2) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
           a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    for (int64_t k = 0; k < K; ++k) {
        if (PF) _mm_prefetch((const char *)(w + k * ws) + PF_BYTES, _MM_HINT_T0);
        if (PF2) _mm_prefetch((const char *)(w + k * ws) + PF_BYTES + 64, _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(w + k * ws), w1 = _mm256_loadu_ps(w + k * ws + 8);
#define ROW(r, A0, A1)                                          \
        if (R > r) {                                            \
            const __m256 xb = _mm256_broadcast_ss(x + r * xs + k); \
            A0 = _mm256_fmadd_ps(xb, w0, A0);                   \
            A1 = _mm256_fmadd_ps(xb, w1, A1);                   \
        }
        ROW(0, a00, a01) ROW(1, a10, a11) ROW(2, a20, a21) ROW(3, a30, a31) ROW(4, a40, a41) ROW(5, a50, a51)
#undef ROW
    }
#define OUT(r, A0, A1) if (R > r) { _mm256_storeu_ps(o + r * os, A0); _mm256_storeu_ps(o + r * os + 8, A1); }
    OUT(0, a00, a01) OUT(1, a10, a11) OUT(2, a20, a21) OUT(3, a30, a31) OUT(4, a40, a41) OUT(5, a50, a51)
#undef OUT
}

/* One row, the whole panel (batch 1): four accumulators; h1: the second half's first column. */
INL void one_row(float *o, const float *x, const float *w, const float *h1, const int ws, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < K; ++k) {
        _mm_prefetch((const char *)(w + k * ws) + PF_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(h1 + k * ws) + PF_BYTES, _MM_HINT_T0);
        const __m256 xb = _mm256_broadcast_ss(x + k);
        a0 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w + k * ws), a0);
        a1 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w + k * ws + 8), a1);
        a2 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(h1 + k * ws), a2);
        a3 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(h1 + k * ws + 8), a3);
    }
    _mm256_storeu_ps(o, a0); _mm256_storeu_ps(o + 8, a1); _mm256_storeu_ps(o + 16, a2); _mm256_storeu_ps(o + 24, a3);
}

/* R rows x 8 columns (layout 2). */
INL void quarter_rows(float *o, int64_t os, const float *x, int64_t xs, const int R, const float *w, int64_t K,
                      const int PF) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0, a10 = a0, a11 = a0;
    for (int64_t k = 0; k < K; ++k) {
        if (PF) _mm_prefetch((const char *)(w + k * 8) + PF_BYTES, _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(w + k * 8);
#define ROW(r, A) if (R > r) A = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * xs + k), w0, A);
        ROW(0, a0) ROW(1, a1) ROW(2, a2) ROW(3, a3) ROW(4, a4) ROW(5, a5) ROW(6, a6) ROW(7, a7) ROW(8, a8)
        ROW(9, a9) ROW(10, a10) ROW(11, a11)
#undef ROW
    }
#define OUT(r, A) if (R > r) _mm256_storeu_ps(o + r * os, A);
    OUT(0, a0) OUT(1, a1) OUT(2, a2) OUT(3, a3) OUT(4, a4) OUT(5, a5) OUT(6, a6) OUT(7, a7) OUT(8, a8) OUT(9, a9)
    OUT(10, a10) OUT(11, a11)
#undef OUT
}

INL void block2(float *o, int64_t N, const float *x, int64_t xs, const int R, const float *panel, int64_t K,
                const int first) {
    if (R == 1) { /* one row: the four quarters' streams at once */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float *q0 = panel, *q1 = q0 + K * 8, *q2 = q1 + K * 8, *q3 = q2 + K * 8;
        for (int64_t k = 0; k < K; ++k) {
            _mm_prefetch((const char *)(q0 + k * 8) + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)(q2 + k * 8) + PF_BYTES, _MM_HINT_T0);
            if ((k & 1) == 0) {
                _mm_prefetch((const char *)(q1 + k * 8) + PF_BYTES, _MM_HINT_T0);
                _mm_prefetch((const char *)(q3 + k * 8) + PF_BYTES, _MM_HINT_T0);
            }
            const __m256 xb = _mm256_broadcast_ss(x + k);
            a0 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(q0 + k * 8), a0);
            a1 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(q1 + k * 8), a1);
            a2 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(q2 + k * 8), a2);
            a3 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(q3 + k * 8), a3);
        }
        _mm256_storeu_ps(o, a0); _mm256_storeu_ps(o + 8, a1); _mm256_storeu_ps(o + 16, a2); _mm256_storeu_ps(o + 24, a3);
        return;
    }
    for (int q = 0; q < 4; ++q) {
        if (first) quarter_rows(o + 8 * q, N, x, xs, R, panel + q * K * 8, K, 1);
        else quarter_rows(o + 8 * q, N, x, xs, R, panel + q * K * 8, K, 0);
    }
}

INL void block(float *o, int64_t N, const float *x, int64_t xs, const int R, const float *panel, int64_t K,
               const int LAYOUT, const int first) {
    const float *h1 = LAYOUT ? panel + K * 16 : panel + 16;
    const int ws = LAYOUT ? 16 : 32;
    if (R == 1) { one_row(o, x, panel, h1, ws, K); return; }
    if (LAYOUT == 0) { /* as committed: the first block's first half prefetches both lines */
        if (first) half_rows(o, N, x, xs, R, panel, ws, K, 1, 1); else half_rows(o, N, x, xs, R, panel, ws, K, 0, 0);
        half_rows(o + 16, N, x, xs, R, h1, ws, K, 0, 0);
    } else {        /* each half is its own stream: the first block prefetches it in each pass */
        if (first) half_rows(o, N, x, xs, R, panel, ws, K, 1, 0); else half_rows(o, N, x, xs, R, panel, ws, K, 0, 0);
        if (first) half_rows(o + 16, N, x, xs, R, h1, ws, K, 1, 0); else half_rows(o + 16, N, x, xs, R, h1, ws, K, 0, 0);
    }
}

#define CASES(L)                                                                              \
    switch (R) {                                                                              \
    case 6: block(o, N, xm, K, 6, panel, K, L, first); break;                                 \
    case 5: block(o, N, xm, K, 5, panel, K, L, first); break;                                 \
    case 4: block(o, N, xm, K, 4, panel, K, L, first); break;                                 \
    case 3: block(o, N, xm, K, 3, panel, K, L, first); break;                                 \
    case 2: block(o, N, xm, K, 2, panel, K, L, first); break;                                 \
    default: block(o, N, xm, K, 1, panel, K, L, first); break;                                \
    }

#define CASES2                                                                                \
    switch (R) {                                                                              \
    case 12: block2(o, N, xm, K, 12, panel, K, first); break;                                 \
    case 11: block2(o, N, xm, K, 11, panel, K, first); break;                                 \
    case 10: block2(o, N, xm, K, 10, panel, K, first); break;                                 \
    case 9: block2(o, N, xm, K, 9, panel, K, first); break;                                   \
    case 8: block2(o, N, xm, K, 8, panel, K, first); break;                                   \
    case 7: block2(o, N, xm, K, 7, panel, K, first); break;                                   \
    case 6: block2(o, N, xm, K, 6, panel, K, first); break;                                   \
    case 5: block2(o, N, xm, K, 5, panel, K, first); break;                                   \
    case 4: block2(o, N, xm, K, 4, panel, K, first); break;                                   \
    case 3: block2(o, N, xm, K, 3, panel, K, first); break;                                   \
    case 2: block2(o, N, xm, K, 2, panel, K, first); break;                                   \
    default: block2(o, N, xm, K, 1, panel, K, first); break;                                  \
    }

static void panel_rows(float *out, int64_t N, const float *x, int64_t M, const float *panels, int64_t K, int64_t p,
                       int layout) {
    const float *panel = panels + p * K * PANEL;
    if (layout == 2) {
        for (int64_t m = 0; m < M; m += 12) {
            const int R = M - m < 12 ? (int)(M - m) : 12, first = m == 0;
            float *o = out + m * N + p * PANEL;
            const float *xm = x + m * K;
            CASES2
        }
        return;
    }
    for (int64_t m = 0; m < M; m += MR) {
        const int R = M - m < MR ? (int)(M - m) : MR, first = m == 0;
        float *o = out + m * N + p * PANEL;
        const float *xm = x + m * K;
        if (layout) { CASES(1) } else { CASES(0) }
    }
}

static void gemm(float *out, const float *x, int64_t M, int64_t K, int64_t N, const float *panels, int layout) {
    const int64_t P = N / PANEL;
    for (int64_t c0 = 0; c0 < M; c0 += 256) {
        const int64_t c1 = c0 + 256 < M ? c0 + 256 : M;
#pragma omp parallel num_threads(2)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            for (int64_t p = P * t / nt; p < P * (t + 1) / nt; ++p)
                panel_rows(out + c0 * N, N, x + c0 * K, c1 - c0, panels, K, p, layout);
        }
    }
}

static void pack(float *dst, const float *w, int64_t N, int64_t K, int layout) {
    for (int64_t p = 0; p < N / PANEL; ++p)
        for (int64_t k = 0; k < K; ++k)
            for (int c = 0; c < PANEL; ++c) {
                const float v = w[(p * PANEL + c) * K + k];
                if (layout == 2) dst[p * K * PANEL + (c / 8) * K * 8 + k * 8 + c % 8] = v;
                else if (layout) dst[p * K * PANEL + (c / 16) * K * 16 + k * 16 + c % 16] = v;
                else dst[p * K * PANEL + k * PANEL + c] = v;
            }
}

static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }
static int cmpd(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }

int main(int argc, char **argv) {
    const int M = atoi(argv[1]), L = 6, reps = 9;
    const int shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    float *W[3][6][4], *X[4], *O[3][4];
    double flops = 0, t[3][16];
    srand(1);
    for (int s = 0; s < 4; ++s) {
        const int n = shapes[s][0], k = shapes[s][1];
        flops += 2.0 * M * n * k * L;
        X[s] = malloc(sizeof(float) * M * k);
        for (int i = 0; i < M * k; ++i) X[s][i] = (float)rand() / RAND_MAX - 0.5f;
        for (int v = 0; v < 3; ++v) O[v][s] = malloc(sizeof(float) * M * n);
        float *dense = malloc(sizeof(float) * n * k);
        for (int l = 0; l < L; ++l) {
            for (long i = 0; i < (long)n * k; ++i) dense[i] = (float)rand() / RAND_MAX - 0.5f;
            for (int v = 0; v < 3; ++v) { W[v][l][s] = aligned_alloc(64, sizeof(float) * n * k); pack(W[v][l][s], dense, n, k, v); }
        }
        free(dense);
    }
    for (int it = 0; it < reps + 1; ++it)
        for (int v0 = 0; v0 < 3; ++v0) {
            const int v = (it + v0) % 3; /* rotate which layout goes first */
            const double t0 = now();
            for (int l = 0; l < L; ++l)
                for (int s = 0; s < 4; ++s) gemm(O[v][s], X[s], M, shapes[s][1], shapes[s][0], W[v][l][s], v);
            if (it) t[v][it - 1] = now() - t0;
        }
    int bad = 0;
    for (int s = 0; s < 4; ++s)
        for (int v = 1; v < 3; ++v) bad |= memcmp(O[0][s], O[v][s], sizeof(float) * M * shapes[s][0]) != 0;
    for (int v = 0; v < 3; ++v) qsort(t[v], reps, sizeof(double), cmpd);
    printf("f32 M=%4d  layout0 %6.1f GFLOPS  layout1 %6.1f (1/0 time %.3f)  layout2 %6.1f (2/0 time %.3f)%s\n", M,
           flops / t[0][reps / 2] / 1e9, flops / t[1][reps / 2] / 1e9, t[1][reps / 2] / t[0][reps / 2],
           flops / t[2][reps / 2] / 1e9, t[2][reps / 2] / t[0][reps / 2], bad ? " MISMATCH" : " (bitwise equal)");
    return bad;
}
