/* The FMA ceiling of this CPU: 16 independent accumulators of 512-bit FMA (float32) or
 * VDPBF16PS (bf16 pairs) in registers, no memory traffic; GFLOPS on N OpenMP threads.
 *   gcc -O2 -march=native -fopenmp fma_peak.c -o fma_peak && OMP_NUM_THREADS=2 ./fma_peak */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define ITERS 200000000L
int main(void) {
    for (int kind = 0; kind < 2; ++kind) {
        double t0 = now(); float sink = 0;
#pragma omp parallel reduction(+ : sink)
        {
            /* 16 named accumulators: held in an array behind a barrier, gcc spills them. */
            /* distinct starting values, or gcc folds the sixteen chains into one */
#define S(i) _mm512_set1_ps(1e-7f * (i + 1) * (float)(omp_get_thread_num() + 1))
            __m512 a0 = S(0), a1 = S(1), a2 = S(2), a3 = S(3), a4 = S(4), a5 = S(5), a6 = S(6), a7 = S(7),
                   a8 = S(8), a9 = S(9), a10 = S(10), a11 = S(11), a12 = S(12), a13 = S(13), a14 = S(14), a15 = S(15);
#undef S
            const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-9f);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(0x3f803f80), yb = (__m512bh)_mm512_set1_epi32(0x30003000);
            if (kind == 0) {
#define F(A) A = _mm512_fmadd_ps(A, x, y);
                for (long it = 0; it < ITERS / 16; ++it) { F(a0) F(a1) F(a2) F(a3) F(a4) F(a5) F(a6) F(a7) F(a8) F(a9) F(a10) F(a11) F(a12) F(a13) F(a14) F(a15) }
            } else {
#undef F
#define F(A) A = _mm512_dpbf16_ps(A, xb, yb);
                for (long it = 0; it < ITERS / 16; ++it) { F(a0) F(a1) F(a2) F(a3) F(a4) F(a5) F(a6) F(a7) F(a8) F(a9) F(a10) F(a11) F(a12) F(a13) F(a14) F(a15) }
            }
#undef F
            __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)), _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
            s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)), _mm512_add_ps(_mm512_add_ps(a12, a13), _mm512_add_ps(a14, a15))));
            sink += _mm512_reduce_add_ps(s);
        }
        const double dt = now() - t0, flop_per = kind == 0 ? 32.0 : 64.0; /* per instruction */
        printf("%s: %d threads, %.1f GFLOPS (%g)\n", kind == 0 ? "float32 FMA" : "bf16 VDPBF16PS",
               omp_get_max_threads(), ITERS * flop_per * omp_get_max_threads() / dt / 1e9, sink);
    }
    return 0;
}
