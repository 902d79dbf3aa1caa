#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
int main(int argc,char**argv){ int D=atoi(argv[1]); size_t CH=atoi(argv[2]); size_t N=(size_t)760<<20;
 char*a=aligned_alloc(4096,N); memset(a,1,N); size_t nch=N/CH; int M=200000; size_t*idx=malloc(M*8);
 for(int i=0;i<M;i++)idx[i]=((size_t)rand()*7919u)%nch*CH;
 double best=1e9; __m512 acc=_mm512_setzero_ps();
 for(int r=0;r<3;r++){double t=now();
 #pragma omp parallel num_threads(2) reduction(+:best)
 { __m512 s=_mm512_setzero_ps();
 #pragma omp for
 for(int i=0;i<M;i++){ if(D&&i+D<M){const char*p=a+idx[i+D]; for(size_t b=0;b<CH;b+=64)_mm_prefetch(p+b,_MM_HINT_T1);}
   const char*p=a+idx[i]; for(size_t b=0;b<CH;b+=64) s=_mm512_add_ps(s,_mm512_load_ps((const float*)(p+b))); }
 float o[16]; _mm512_storeu_ps(o,s); if(o[0]==12345)printf("x");}
 t=now()-t; printf("D=%d CH=%zu: %.2f GB/s\n",D,CH,M*CH/t/1e9);}
}
