/* mmkit_panel_gemm per shape of the benchmark LLaVA (fused qkv 960x576, o 576x576, gate/up
 * 3072x576, down 576x1536) and row count, on its own: 6 distinct weights per shape (so they
 * come from memory as in a step), median of 7 passes, GFLOPS.
 *   gcc -O3 -march=native -fopenmp gemm_shapes.c ../../../mmkit/layers/csrc/linear_panels_cpu.c \
 *       -I../../../mmkit/layers/csrc -o gemm_shapes && OMP_WAIT_POLICY=PASSIVE ./gemm_shapes 2 48 256 2048 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
int mmkit_panel_gemm(void *out, const void *x, int64_t x_stride, int64_t M, int64_t K, int64_t N,
                     const void *panels, const void *bias, int dtype, int nthreads);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
#define L 6
int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 2;
    const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    for (int dtype = 1; dtype >= 0; --dtype) {
        const size_t es = dtype ? 2 : 4;
        for (int a = 2; a < argc; ++a) {
            const int64_t M = atol(argv[a]);
            double total_flop = 0, total_s = 0;
            printf("%s M=%5ld:", dtype ? "bf16" : "f32 ", (long)M);
            for (int s = 0; s < 4; ++s) {
                const int64_t N = shapes[s][0], K = shapes[s][1], P = (N + 31) / 32;
                void *w[L];
                for (int l = 0; l < L; ++l) { w[l] = aligned_alloc(64, P * 32 * K * es); memset(w[l], 0x3c, P * 32 * K * es); }
                void *x = aligned_alloc(64, M * K * es), *o = aligned_alloc(64, M * N * es);
                memset(x, 0x3c, M * K * es); memset(o, 0, M * N * es);
                double t[7];
                for (int r = -1; r < 7; ++r) {
                    const double t0 = now();
                    for (int l = 0; l < L; ++l) mmkit_panel_gemm(o, x, K, M, K, N, w[l], NULL, dtype, threads);
                    if (r >= 0) t[r] = now() - t0;
                }
                qsort(t, 7, sizeof t[0], cmp);
                const double flop = 2.0 * M * N * K * L;
                printf("  %ldx%ld %6.1f", (long)N, (long)K, flop / t[3] / 1e9);
                total_flop += flop; total_s += t[3];
                for (int l = 0; l < L; ++l) free(w[l]);
                free(x); free(o);
            }
            printf("  | all %6.1f GFLOPS\n", total_flop / total_s / 1e9);
        }
    }
    return 0;
}
