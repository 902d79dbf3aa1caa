/* A/B of two builds of linear_panels_cpu.c (round 4m): the committed one, its entry point renamed
 *   git show 77f9ec8:mmkit/layers/csrc/linear_panels_cpu.c | sed "s/^int mmkit_panel_gemm(/int old_mmkit_panel_gemm(/; s/^int mmkit_panel_gemm_available/int old_&/; s/^void mmkit_panel_rows_bf16/void old_mmkit_panel_rows_bf16/" > old_lp.c
 * (include path of bf16.h adjusted), and the working tree. Build and run:
 *   F="-O3 -march=native -fno-trapping-math -fopenmp -std=gnu11"; gcc $F -c old_lp.c; gcc $F -c linear_panels_cpu.c -o new_lp.o
 *   gcc $F panel_ab.c old_lp.o new_lp.o -o ab; OMP_WAIT_POLICY=PASSIVE ./ab M DTYPE(0 f32, 1 bf16) [BIAS] */
/* A/B: committed linear_panels_cpu.c (old) vs working tree (new), same inputs, bitwise compare */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdint.h>
int old_mmkit_panel_gemm(void *, const void *, int64_t, int64_t, int64_t, int64_t, const void *, const void *, int, int);
int mmkit_panel_gemm(void *, const void *, int64_t, int64_t, int64_t, int64_t, const void *, const void *, int, int);
static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }
static int cmpd(const void *a, const void *b) { double x = *(double*)a, y = *(double*)b; return x < y ? -1 : x > y; }
int main(int argc, char **argv) {
    int M = atoi(argv[1]), dt = atoi(argv[2]), bias = argc > 3 ? atoi(argv[3]) : 0, L = 6, reps = 9;
    int shapes[4][2] = {{960,576},{576,576},{3072,576},{576,1536}};
    size_t el = dt ? 2 : 4;
    void *W[6][4], *X[4], *O1[4], *O2[4], *B[4]; double flops = 0;
    for (int s = 0; s < 4; ++s) {
        int n = shapes[s][0], k = shapes[s][1], P = (n + 31)/32;
        flops += 2.0 * M * n * k * L;
        X[s] = malloc(el * M * k); O1[s] = malloc(el * M * n); O2[s] = malloc(el * M * n); B[s] = malloc(el * n);
        for (int i = 0; i < M*k; ++i) { float f = (float)rand()/RAND_MAX - 0.5f; if (dt) { uint32_t u; memcpy(&u,&f,4); ((uint16_t*)X[s])[i] = u >> 16; } else ((float*)X[s])[i] = f; }
        for (int i = 0; i < n; ++i) { float f = 0.1f*((float)rand()/RAND_MAX - 0.5f); if (dt) { uint32_t u; memcpy(&u,&f,4); ((uint16_t*)B[s])[i] = u >> 16; } else ((float*)B[s])[i] = f; }
        for (int l = 0; l < L; ++l) { W[l][s] = aligned_alloc(64, el * P * k * 32); for (long i = 0; i < (long)P*k*32; ++i) { float f = (float)rand()/RAND_MAX - 0.5f; if (dt) { uint32_t u; memcpy(&u,&f,4); ((uint16_t*)W[l][s])[i] = u >> 16; } else ((float*)W[l][s])[i] = f; } }
    }
    double ta[16], tb[16];
    for (int it = 0; it < reps + 1; ++it) {
        double t0 = now();
        for (int l = 0; l < L; ++l) for (int s = 0; s < 4; ++s) old_mmkit_panel_gemm(O1[s], X[s], shapes[s][1], M, shapes[s][1], shapes[s][0], W[l][s], bias ? B[s] : NULL, dt, 2);
        double t1 = now();
        for (int l = 0; l < L; ++l) for (int s = 0; s < 4; ++s) mmkit_panel_gemm(O2[s], X[s], shapes[s][1], M, shapes[s][1], shapes[s][0], W[l][s], bias ? B[s] : NULL, dt, 2);
        double t2 = now();
        if (it) { ta[it-1] = t1 - t0; tb[it-1] = t2 - t1; }
    }
    int bad = 0;
    for (int s = 0; s < 4; ++s) if (memcmp(O1[s], O2[s], el * M * shapes[s][0])) { printf("MISMATCH shape %d\n", s); bad = 1; }
    qsort(ta, reps, sizeof(double), cmpd); qsort(tb, reps, sizeof(double), cmpd);
    printf("%s M=%4d bias=%d  old %6.1f GFLOPS  new %6.1f GFLOPS  new/old time %.3f%s\n", dt ? "bf16" : "f32 ", M, bias, flops/ta[reps/2]/1e9, flops/tb[reps/2]/1e9, tb[reps/2]/ta[reps/2], bad ? " MISMATCH" : " (bitwise equal)");
    return bad;
}
