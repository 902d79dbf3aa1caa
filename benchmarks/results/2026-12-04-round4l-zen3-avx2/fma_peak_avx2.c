/* The float32 FMA ceiling of an AVX2 CPU: 12 independent 256-bit FMA chains per thread (round 4l, Zen 3).
 *   gcc -O3 -funroll-loops -march=native -fopenmp fma_peak_avx2.c -o fma_peak_avx2 && OMP_NUM_THREADS=2 ./fma_peak_avx2
 * (-O2 without unrolling left a loop-carried store per chain and measured a third of this.) */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
int main(void){
  double best=0;
  for(int rep=0;rep<5;rep++){
  double t0=omp_get_wtime(); float sink=0; long iters=200000000/ 8;
#pragma omp parallel reduction(+:sink)
  {
    __m256 a[12]; for(int i=0;i<12;i++) a[i]=_mm256_set1_ps(1e-7f*(i+1));
    const __m256 x=_mm256_set1_ps(0.999f), y=_mm256_set1_ps(1e-9f);
    for(long it=0; it<iters; it++){
      for(int i=0;i<12;i++) a[i]=_mm256_fmadd_ps(a[i],x,y);
    }
    __m256 s=a[0]; for(int i=1;i<12;i++) s=_mm256_add_ps(s,a[i]);
    float o[8]; _mm256_storeu_ps(o,s); sink+=o[0];
  }
  double dt=omp_get_wtime()-t0; int nt=omp_get_max_threads();
  double gf = (double)iters*12*8*2*nt/dt/1e9; if(gf>best)best=gf;
  printf("%d threads: %.1f GFLOPS (sink %g)\n", nt, gf, sink);
  }
  return 0;
}
