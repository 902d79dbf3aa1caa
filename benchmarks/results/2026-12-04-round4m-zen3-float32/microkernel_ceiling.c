/* Round 4m: the float32 FMA ceiling of one thread and the 6x16 / 4x24 micro-kernels with everything in L1
 * (packed_x_tried.log). gcc -O3 -march=native -fno-trapping-math -std=gnu11 microkernel_ceiling.c -o mk && ./mk */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#define INL static inline __attribute__((always_inline))
static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }
/* peak: 12 independent chains, register only */
__attribute__((noinline)) void peak(float *c, long n) {
    __m256 a0=_mm256_loadu_ps(c),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0,a10=a0,a11=a0;
    const __m256 x=_mm256_set1_ps(0.999f), y=_mm256_set1_ps(1e-9f);
    for (long i=0;i<n;++i){
        __asm__ ("" : "+x"(a0),"+x"(a1),"+x"(a2),"+x"(a3),"+x"(a4),"+x"(a5),"+x"(a6),"+x"(a7),"+x"(a8),"+x"(a9),"+x"(a10),"+x"(a11));
        a0=_mm256_fmadd_ps(a0,x,y);a1=_mm256_fmadd_ps(a1,x,y);a2=_mm256_fmadd_ps(a2,x,y);a3=_mm256_fmadd_ps(a3,x,y);
        a4=_mm256_fmadd_ps(a4,x,y);a5=_mm256_fmadd_ps(a5,x,y);a6=_mm256_fmadd_ps(a6,x,y);a7=_mm256_fmadd_ps(a7,x,y);
        a8=_mm256_fmadd_ps(a8,x,y);a9=_mm256_fmadd_ps(a9,x,y);a10=_mm256_fmadd_ps(a10,x,y);a11=_mm256_fmadd_ps(a11,x,y);
    }
    __m256 s=_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)),_mm256_add_ps(_mm256_add_ps(a4,a5),_mm256_add_ps(a6,a7)));
    s=_mm256_add_ps(s,_mm256_add_ps(_mm256_add_ps(a8,a9),_mm256_add_ps(a10,a11)));
    _mm256_storeu_ps(c,s);
}
/* 6x16, packed x: xp[k*6 + r]; w stride WS floats per k */
__attribute__((noinline)) void k6x16p(float *c, const float *xp, const float *pw, long K, long WS) {
    __m256 a00=_mm256_loadu_ps(c),a01=_mm256_loadu_ps(c+8),a10=_mm256_loadu_ps(c+32),a11=_mm256_loadu_ps(c+40),a20=_mm256_loadu_ps(c+64),a21=_mm256_loadu_ps(c+72),
           a30=_mm256_loadu_ps(c+96),a31=_mm256_loadu_ps(c+104),a40=_mm256_loadu_ps(c+128),a41=_mm256_loadu_ps(c+136),a50=_mm256_loadu_ps(c+160),a51=_mm256_loadu_ps(c+168);
    for (long k=0;k<K;++k){
        const __m256 w0=_mm256_loadu_ps(pw+k*WS), w1=_mm256_loadu_ps(pw+k*WS+8);
        const float *x = xp + 6*k; __m256 b;
        b=_mm256_broadcast_ss(x+0); a00=_mm256_fmadd_ps(b,w0,a00); a01=_mm256_fmadd_ps(b,w1,a01);
        b=_mm256_broadcast_ss(x+1); a10=_mm256_fmadd_ps(b,w0,a10); a11=_mm256_fmadd_ps(b,w1,a11);
        b=_mm256_broadcast_ss(x+2); a20=_mm256_fmadd_ps(b,w0,a20); a21=_mm256_fmadd_ps(b,w1,a21);
        b=_mm256_broadcast_ss(x+3); a30=_mm256_fmadd_ps(b,w0,a30); a31=_mm256_fmadd_ps(b,w1,a31);
        b=_mm256_broadcast_ss(x+4); a40=_mm256_fmadd_ps(b,w0,a40); a41=_mm256_fmadd_ps(b,w1,a41);
        b=_mm256_broadcast_ss(x+5); a50=_mm256_fmadd_ps(b,w0,a50); a51=_mm256_fmadd_ps(b,w1,a51);
    }
    _mm256_storeu_ps(c,a00);_mm256_storeu_ps(c+8,a01);_mm256_storeu_ps(c+32,a10);_mm256_storeu_ps(c+40,a11);_mm256_storeu_ps(c+64,a20);_mm256_storeu_ps(c+72,a21);
    _mm256_storeu_ps(c+96,a30);_mm256_storeu_ps(c+104,a31);_mm256_storeu_ps(c+128,a40);_mm256_storeu_ps(c+136,a41);_mm256_storeu_ps(c+160,a50);_mm256_storeu_ps(c+168,a51);
}
/* 4x24, packed x xp[k*4+r]; w stride 32 (uses cols 0..23) */
__attribute__((noinline)) void k4x24p(float *c, const float *xp, const float *pw, long K, long WS) {
    __m256 a00=_mm256_loadu_ps(c),a01=_mm256_loadu_ps(c+8),a02=_mm256_loadu_ps(c+16),a10=_mm256_loadu_ps(c+32),a11=_mm256_loadu_ps(c+40),a12=_mm256_loadu_ps(c+48),
           a20=_mm256_loadu_ps(c+64),a21=_mm256_loadu_ps(c+72),a22=_mm256_loadu_ps(c+80),a30=_mm256_loadu_ps(c+96),a31=_mm256_loadu_ps(c+104),a32=_mm256_loadu_ps(c+112);
    for (long k=0;k<K;++k){
        const __m256 w0=_mm256_loadu_ps(pw+k*WS), w1=_mm256_loadu_ps(pw+k*WS+8), w2=_mm256_loadu_ps(pw+k*WS+16);
        const float *x = xp + 4*k; __m256 b;
        b=_mm256_broadcast_ss(x+0); a00=_mm256_fmadd_ps(b,w0,a00); a01=_mm256_fmadd_ps(b,w1,a01); a02=_mm256_fmadd_ps(b,w2,a02);
        b=_mm256_broadcast_ss(x+1); a10=_mm256_fmadd_ps(b,w0,a10); a11=_mm256_fmadd_ps(b,w1,a11); a12=_mm256_fmadd_ps(b,w2,a12);
        b=_mm256_broadcast_ss(x+2); a20=_mm256_fmadd_ps(b,w0,a20); a21=_mm256_fmadd_ps(b,w1,a21); a22=_mm256_fmadd_ps(b,w2,a22);
        b=_mm256_broadcast_ss(x+3); a30=_mm256_fmadd_ps(b,w0,a30); a31=_mm256_fmadd_ps(b,w1,a31); a32=_mm256_fmadd_ps(b,w2,a32);
    }
    _mm256_storeu_ps(c,a00);_mm256_storeu_ps(c+8,a01);_mm256_storeu_ps(c+16,a02);_mm256_storeu_ps(c+32,a10);_mm256_storeu_ps(c+40,a11);_mm256_storeu_ps(c+48,a12);
    _mm256_storeu_ps(c+64,a20);_mm256_storeu_ps(c+72,a21);_mm256_storeu_ps(c+80,a22);_mm256_storeu_ps(c+96,a30);_mm256_storeu_ps(c+104,a31);_mm256_storeu_ps(c+112,a32);
}
int main(void){
    float *c=aligned_alloc(64,4*6*32*2); for(int i=0;i<384;++i)c[i]=0;
    float *pw=aligned_alloc(64,4*32*1024), *xp=aligned_alloc(64,4*6*1024);
    for(int i=0;i<32*1024;++i)pw[i]=0.001f*(i%7); for(int i=0;i<6*1024;++i)xp[i]=0.001f*(i%5);
    for (int rep=0;rep<3;++rep){
    double t0=now(); long n=50000000; peak(c,n); double t=now()-t0;
    printf("peak 1 thread: %.1f GFLOPS\n", n*12*16.0/t/1e9);
    for (int K=128; K<=512; K*=2){
        long it=2000000000L/(K*192);
        t0=now(); for(long i=0;i<it;++i){ k6x16p(c,xp,pw,K,32); k6x16p(c+16,xp,pw+16,K,32);} t=now()-t0;
        double g1=2.0*it*K*192/t/1e9;
        t0=now(); for(long i=0;i<it;++i){ k6x16p(c,xp,pw,K,16);} t=now()-t0;
        double g2=2.0*it*K*96/t/1e9;
        long it2=2000000000L/(K*96);
        t0=now(); for(long i=0;i<it2;++i){ k4x24p(c,xp,pw,K,32);} t=now()-t0;
        double g3=2.0*it2*K*96/t/1e9;
        printf("K=%d 6x16 packed-x ws32 %.1f  ws16 %.1f   4x24 packed-x %.1f GFLOPS\n",K,g1,g2,g3);
    }}
    return c[7]>1e30;
}
