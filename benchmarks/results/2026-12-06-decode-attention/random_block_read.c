/* One thread reading 512 MB: sequentially, and as 2 KiB blocks in random order (a bf16 KV block of
 * 16 rows x 64) with each block prefetched two blocks ahead: what one core of this host can read
 * the way the decode kernel does. gcc -O2 -march=native random_block_read.c && ./a.out */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
int main(){ size_t n=512<<20; char*a=aligned_alloc(64,n); for(size_t i=0;i<n;i+=4096)a[i]=1;
 for(size_t i=0;i<n;i++)a[i]=i;
 double best=1e9; __m512i s=_mm512_setzero_si512();
 for(int r=0;r<8;r++){ double t=now(); for(size_t i=0;i<n;i+=256){ s=_mm512_add_epi32(s,_mm512_load_si512(a+i)); s=_mm512_add_epi32(s,_mm512_load_si512(a+i+64));s=_mm512_add_epi32(s,_mm512_load_si512(a+i+128));s=_mm512_add_epi32(s,_mm512_load_si512(a+i+192));} t=now()-t; if(t<best)best=t;}
 printf("seq read 1 thread: %.1f GB/s (%d)\n", n/best/1e9, _mm512_reduce_add_epi32(s));
 /* random 2 KiB blocks */
 size_t nb=n/2048; size_t *perm=malloc(nb*8); for(size_t i=0;i<nb;i++)perm[i]=i; for(size_t i=nb-1;i>0;i--){size_t j=rand()%(i+1),t=perm[i];perm[i]=perm[j];perm[j]=t;}
 best=1e9;
 for(int r=0;r<8;r++){ double t=now(); for(size_t b=0;b<nb;b++){ const char*p=a+perm[b]*2048; if(b+2<nb){const char*q=a+perm[b+2]*2048; for(int k=0;k<2048;k+=64)_mm_prefetch(q+k,_MM_HINT_T1);} for(int k=0;k<2048;k+=64)s=_mm512_add_epi32(s,_mm512_load_si512(p+k)); } t=now()-t; if(t<best)best=t;}
 printf("random 2KiB blocks, prefetch 2 ahead: %.1f GB/s (%d)\n", n/best/1e9, _mm512_reduce_add_epi32(s));
}
