/* VDPBF16PS throughput on this host: 16 independent zmm accumulators, no memory traffic.
 * gcc -O2 -march=native -fopenmp vdpbf16ps_peak.c -o peak && OMP_NUM_THREADS=1 ./peak && OMP_NUM_THREADS=2 ./peak
 * (vdpbf16ps_peak.log: the 1-thread run's line, then the 2-thread run's two). 64 FLOP per
 * instruction (16 lanes x 2 bf16 products, each added). */
#include <stdio.h>
#include <time.h>
#include <omp.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define D(i) "vdpbf16ps %%zmm30, %%zmm31, %%zmm" #i "\n\t"
int main(){
  #pragma omp parallel
  {
  long iters=400000000L/ omp_get_num_threads();
  double t0=now();
  __asm__ volatile(
    "vpxord %%zmm30,%%zmm30,%%zmm30\n\t vpxord %%zmm31,%%zmm31,%%zmm31\n\t"
    "1:\n\t"
    D(0) D(1) D(2) D(3) D(4) D(5) D(6) D(7) D(8) D(9) D(10) D(11) D(12) D(13) D(14) D(15)
    "dec %0\n\t jnz 1b\n\t"
    : "+r"(iters) :: "zmm0","zmm1","zmm2","zmm3","zmm4","zmm5","zmm6","zmm7","zmm8","zmm9","zmm10","zmm11","zmm12","zmm13","zmm14","zmm15","zmm30","zmm31","cc");
  double dt=now()-t0;
  long n=400000000L/ omp_get_num_threads();
  #pragma omp critical
  printf("thread %d: %.1f GFLOPS, %.2f G instr/s\n", omp_get_thread_num(), n*16.0*64/dt/1e9, n*16.0/dt/1e9);
  }
}
