/* Round 4m, tried and not kept (packed_x_tried.log): float32 x packed 6 rows at a time ([k][6]) and K
 * blocked for L1, against the AVX2 panels' a2_gemm. Build from the repository root:
 *   gcc -O3 -march=native -fno-trapping-math -fopenmp -std=gnu11 -DKC=128 -DXBYTES=1048576 \
 *       -I. benchmarks/results/2026-12-04-round4m-zen3-float32/packed_x_kblock.c -o h4 && OMP_WAIT_POLICY=PASSIVE ./h4 256 */
#include "mmkit/layers/csrc/linear_panels_cpu.c"
#include <stdio.h>
#include <string.h>
#include <time.h>
#ifndef KC
#define KC 128
#endif
#ifndef XBYTES
#define XBYTES (256*1024)
#endif
/* R rows of packed x (xp[k*6 + r]) x 16 columns (w stride 32) -> v rows (stride 32) */
MMKIT_INLINE void pk6x16(float *v, const float *xp, const int R, const float *pw, int64_t K, const int first) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
           a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
#define LD(r, A0, A1) if (R > r && !first) { A0 = _mm256_loadu_ps(v + r*32); A1 = _mm256_loadu_ps(v + r*32 + 8); }
    LD(0,a00,a01) LD(1,a10,a11) LD(2,a20,a21) LD(3,a30,a31) LD(4,a40,a41) LD(5,a50,a51)
    for (int64_t k = 0; k < K; ++k) {
        const __m256 w0 = _mm256_loadu_ps(pw + k * 32), w1 = _mm256_loadu_ps(pw + k * 32 + 8);
        const float *x = xp + 6 * k;
#define ROW(r, A0, A1) if (R > r) { const __m256 xb = _mm256_broadcast_ss(x + r); A0 = _mm256_fmadd_ps(xb, w0, A0); A1 = _mm256_fmadd_ps(xb, w1, A1); }
        ROW(0,a00,a01) ROW(1,a10,a11) ROW(2,a20,a21) ROW(3,a30,a31) ROW(4,a40,a41) ROW(5,a50,a51)
#undef ROW
    }
#define ST(r, A0, A1) if (R > r) { _mm256_storeu_ps(v + r*32, A0); _mm256_storeu_ps(v + r*32 + 8, A1); }
    ST(0,a00,a01) ST(1,a10,a11) ST(2,a20,a21) ST(3,a30,a31) ST(4,a40,a41) ST(5,a50,a51)
#undef ST
}
static void pk_block(float *v, const float *xp, int R, const float *panel, int64_t K, int first) {
    if (first) switch (R) {
#define C(n) case n: pk6x16(v, xp, n, panel, K, 1); pk6x16(v + 16, xp, n, panel + 16, K, 1); break;
    C(6) C(5) C(4) C(3) C(2)
    default: pk6x16(v, xp, 1, panel, K, 1); pk6x16(v + 16, xp, 1, panel + 16, K, 1); break;
#undef C
    } else switch (R) {
#define C(n) case n: pk6x16(v, xp, n, panel, K, 0); pk6x16(v + 16, xp, n, panel + 16, K, 0); break;
    C(6) C(5) C(4) C(3) C(2)
    default: pk6x16(v, xp, 1, panel, K, 0); pk6x16(v + 16, xp, 1, panel + 16, K, 0); break;
#undef C
    }
}
static int pk_gemm(float *out, const float *x, int64_t xs, int64_t M, int64_t K, int64_t N, const float *panels, const float *bias, int nthreads) {
    const int64_t P = (N + 31) / 32;
    int64_t rows = XBYTES / (4 * K); rows = rows < 6 ? 6 : rows / 6 * 6; if (rows > M) rows = (M + 5) / 6 * 6;
    float *xp = aligned_alloc(64, sizeof(float) * rows * K);
    int pthreads = nthreads < 1 ? 1 : nthreads; if (pthreads > P) pthreads = (int)P;
    for (int64_t c0 = 0; c0 < M; c0 += rows) {
        const int64_t c1 = c0 + rows < M ? c0 + rows : M, mc = c1 - c0, nb = (mc + 5) / 6;
#pragma omp parallel num_threads(pthreads)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            for (int64_t b = nb * t / nt; b < nb * (t + 1) / nt; ++b) {
                const int R = mc - 6 * b < 6 ? (int)(mc - 6 * b) : 6;
                float *dst = xp + 6 * b * K;
                const float *src = x + (c0 + 6 * b) * xs;
                for (int64_t k = 0; k < K; ++k) for (int r = 0; r < R; ++r) dst[6 * k + r] = src[r * xs + k];
            }
#pragma omp barrier
            float *cb = aligned_alloc(64, sizeof(float) * nb * 6 * 32);
            for (int64_t p = P * t / nt; p < P * (t + 1) / nt; ++p) {
                const float *panel = panels + p * K * 32;
                const int64_t n0 = p * 32, ncols = N - n0 < 32 ? N - n0 : 32;
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int64_t kc = K - k0 < KC ? K - k0 : KC;
                    for (int64_t b = 0; b < nb; ++b) {
                        const int R = mc - 6 * b < 6 ? (int)(mc - 6 * b) : 6;
                        pk_block(cb + b * 192, xp + 6 * b * K + 6 * k0, R, panel + 32 * k0, kc, k0 == 0);
                    }
                }
                for (int64_t r = 0; r < mc; ++r) {
                    float *o = out + (c0 + r) * N + n0; const float *v = cb + r * 32;
                    for (int64_t c = 0; c < ncols; ++c) o[c] = bias ? v[c] + bias[n0 + c] : v[c];
                }
            }
            free(cb);
        }
    }
    free(xp);
    return 0;
}
static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }
static int cmpd(const void *a, const void *b) { double x = *(double*)a, y = *(double*)b; return x < y ? -1 : x > y; }
int main(int argc, char **argv) {
    int M = argc > 1 ? atoi(argv[1]) : 256, L = 6, reps = 7;
    int shapes[4][2] = {{960,576},{576,576},{3072,576},{576,1536}};
    float *W[6][4], *X[4], *O1[4], *O2[4];
    double flops = 0;
    for (int s = 0; s < 4; ++s) {
        int n = shapes[s][0], k = shapes[s][1], P = (n + 31)/32;
        flops += 2.0 * M * n * k * L;
        X[s] = malloc(sizeof(float) * M * k); for (int i = 0; i < M*k; ++i) X[s][i] = (float)rand()/RAND_MAX - 0.5f;
        O1[s] = malloc(sizeof(float) * M * n); O2[s] = malloc(sizeof(float) * M * n);
        for (int l = 0; l < L; ++l) { W[l][s] = aligned_alloc(64, sizeof(float) * P * k * 32); for (long i = 0; i < (long)P*k*32; ++i) W[l][s][i] = (float)rand()/RAND_MAX - 0.5f; }
    }
    double ta[16], tb[16];
    for (int it = 0; it < reps + 1; ++it) {
        double t0 = now();
        for (int l = 0; l < L; ++l) for (int s = 0; s < 4; ++s) a2_gemm(O1[s], X[s], shapes[s][1], M, shapes[s][1], shapes[s][0], W[l][s], NULL, 0, 2);
        double t1 = now();
        for (int l = 0; l < L; ++l) for (int s = 0; s < 4; ++s) pk_gemm(O2[s], X[s], shapes[s][1], M, shapes[s][1], shapes[s][0], W[l][s], NULL, 2);
        double t2 = now();
        if (it) { ta[it-1] = t1 - t0; tb[it-1] = t2 - t1; }
    }
    for (int s = 0; s < 4; ++s) if (memcmp(O1[s], O2[s], sizeof(float) * M * shapes[s][0])) printf("MISMATCH shape %d\n", s);
    qsort(ta, reps, sizeof(double), cmpd); qsort(tb, reps, sizeof(double), cmpd);
    printf("M=%d KC=%d XBYTES=%d  old %.1f GFLOPS  new %.1f GFLOPS  ratio new/old time %.3f\n", M, KC, XBYTES, flops/ta[reps/2]/1e9, flops/tb[reps/2]/1e9, tb[reps/2]/ta[reps/2]);
    return 0;
}
