#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
int main(int c, char**v){ size_t n = (size_t)atol(v[1])<<20; char *a = aligned_alloc(64,n);
#pragma omp parallel for
 for(size_t i=0;i<n;i++)a[i]=i;
 double times[15]; float tot=0;
 for(int r=0;r<15;r++){double t=now();
#pragma omp parallel reduction(+:tot)
 { __m512 s0=_mm512_setzero_ps(),s1=s0,s2=s0,s3=s0;
#pragma omp for
  for(size_t i=0;i<n;i+=256){ s0=_mm512_add_ps(s0,_mm512_load_ps((float*)(a+i))); s1=_mm512_add_ps(s1,_mm512_load_ps((float*)(a+i+64)));s2=_mm512_add_ps(s2,_mm512_load_ps((float*)(a+i+128)));s3=_mm512_add_ps(s3,_mm512_load_ps((float*)(a+i+192)));}
  tot+=_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0,s1),_mm512_add_ps(s2,s3))); }
 times[r]=now()-t;}
 for(int i=0;i<15;i++)for(int j=i+1;j<15;j++)if(times[j]<times[i]){double x=times[i];times[i]=times[j];times[j]=x;}
 printf("%s MB threads %d: median %.1f GB/s best %.1f GB/s (%f)\n", v[1], omp_get_max_threads(), n/times[7]/1e9, n/times[0]/1e9, tot); }
