/* Read ceilings for the decode kernel's access pattern: 512 MB as blocks of BLK bytes read in
 * random order (a bf16 KV block of 16 rows x 64 is 2 KiB, of 128 rows 16 KiB), with software
 * prefetch variants: none; every line of the block D ahead with hint T0/T1/T2/NTA; only its first
 * L lines (T0 or T2). Best of 5 passes, GB/s. Then ONLY7=1: one line D2 ahead plus all lines D
 * ahead. gcc -O2 -march=native -fopenmp random_block_read.c -o rb && ./rb BLK HUGE THREADS */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
static size_t n; static char *a; static size_t *perm; static size_t nb, blk;
static int sink;
/* mode: 0 no prefetch, 1 all lines t0, 2 all t1, 3 all t2, 4 all nta, 5 first L lines t0, 6 first L lines t2 */
static double run(int mode, int D, int L, int T){
  double best=1e9;
  for(int r=0;r<5;r++){
    double t=now();
    #pragma omp parallel num_threads(T)
    { int id=omp_get_thread_num(); size_t lo=nb*id/T, hi=nb*(id+1)/T; __m512i s=_mm512_setzero_si512();
      for(size_t b=lo;b<hi;b++){ const char*p=a+perm[b]*blk;
        if(mode==7||mode==8){ if(b+L<hi) _mm_prefetch(a+perm[b+L]*blk,_MM_HINT_T0); if(b+D<hi){const char*q=a+perm[b+D]*blk; for(size_t k=0;k<blk;k+=64) { if(mode==7) _mm_prefetch(q+k,_MM_HINT_T0); else _mm_prefetch(q+k,_MM_HINT_T2);}} }
        else if(mode && b+D<hi){ const char*q=a+perm[b+D]*blk; size_t lim = (mode>=5)? (size_t)L*64 : blk;
          for(size_t k=0;k<lim;k+=64){ switch(mode){case 1: case 5: _mm_prefetch(q+k,_MM_HINT_T0);break; case 2:_mm_prefetch(q+k,_MM_HINT_T1);break; case 3: case 6:_mm_prefetch(q+k,_MM_HINT_T2);break; case 4:_mm_prefetch(q+k,_MM_HINT_NTA);break;} } }
        for(size_t k=0;k<blk;k+=256){ s=_mm512_add_epi32(s,_mm512_load_si512(p+k)); s=_mm512_add_epi32(s,_mm512_load_si512(p+k+64)); s=_mm512_add_epi32(s,_mm512_load_si512(p+k+128)); s=_mm512_add_epi32(s,_mm512_load_si512(p+k+192)); }
      }
      #pragma omp atomic
      sink += _mm512_reduce_add_epi32(s);
    }
    t=now()-t; if(t<best)best=t;
  }
  return n/best/1e9;
}
int main(int argc,char**argv){
  n=(size_t)512<<20; blk=argc>1?atoi(argv[1]):2048; int huge=argc>2?atoi(argv[2]):0; int T=argc>3?atoi(argv[3]):1;
  a=aligned_alloc(2<<20,n); if(huge) madvise(a,n,MADV_HUGEPAGE); else madvise(a,n,MADV_NOHUGEPAGE);
  for(size_t i=0;i<n;i++)a[i]=i;
  nb=n/blk; perm=malloc(nb*8); for(size_t i=0;i<nb;i++)perm[i]=i; srand(1); for(size_t i=nb-1;i>0;i--){size_t j=rand()%(i+1),t=perm[i];perm[i]=perm[j];perm[j]=t;}
  printf("block %zu huge %d threads %d\n", blk, huge, T);
  size_t *ident=malloc(nb*8); for(size_t i=0;i<nb;i++)ident[i]=i; size_t*pp=perm; perm=ident;
  printf("  sequential: %.1f GB/s\n", run(0,0,0,T)); perm=pp;
  printf("  random no prefetch: %.1f\n", run(0,0,0,T));
  const char*nm[]={"","all t0","all t1","all t2","all nta","first L t0","first L t2"};
  if(getenv("ONLY7")){ for(int D=1;D<=4;D*=2) for(int L=8;L<=32;L*=2){ printf("  far1 t0 near all t0 D=%d far=%d: %.1f\n",D,L,run(7,D,L,T)); printf("  far1 t0 near all t2 D=%d far=%d: %.1f\n",D,L,run(8,D,L,T));} printf("  all t0 D=4: %.1f\n", run(1,4,0,T)); printf("  all t0 D=8: %.1f\n", run(1,8,0,T)); return 0;}
  for(int mode=1;mode<=4;mode++) for(int D=1;D<=16;D*=2) printf("  %s D=%d: %.1f\n", nm[mode], D, run(mode,D,0,T));
  for(int mode=5;mode<=6;mode++) for(int D=2;D<=16;D*=2) for(int L=1;L<=4;L*=2) printf("  %s D=%d L=%d: %.1f\n", nm[mode], D, L, run(mode,D,L,T));
  return sink==12345;
}
