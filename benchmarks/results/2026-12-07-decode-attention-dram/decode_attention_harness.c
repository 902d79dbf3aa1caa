/* 2026-12-07: ../2026-12-06-decode-attention/decode_attention_harness.c with the thread count
 * from env T (default 1); otherwise unchanged.
 * The paged decode kernel alone, from C (no Python between calls): B sequences of
 * CTX keys, H query / KV heads of D (env D, default 64), dtype 0 float32 / 1 bf16, CALLS calls,
 * blocks of BS rows scattered at random; LAYERS (env, default 1) caches called in turn (1: the
 * K/V stay in cache; 40: each call reads from DRAM). Prints the fastest call's GB/s of K/V, the
 * mean over all calls, and a hash of the last output (equal hashes: bit-identical outputs).
 * Built by harness_ab.sh against each kernel version. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
int mmkit_paged_decode_attention(void *out, const void *q, int64_t q_row_stride, const void *k_cache,
                                 const void *v_cache, const int64_t *block_ids, int64_t max_blocks,
                                 const int64_t *context_lens, const int64_t *context_starts, int64_t num_seqs,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                                 int64_t block_size, float scale, int dtype, int num_threads);
int main(int argc,char**argv){
  int64_t B=atoi(argv[1]), CTX=atoi(argv[2]), H=atoi(argv[3]), KV=atoi(argv[4]); int dt=atoi(argv[5]); int calls=atoi(argv[6]);
  int64_t D=getenv("D")?atoi(getenv("D")):64, BS=argc>7?atoi(argv[7]):16, es=dt?2:4, MAXB=(CTX+BS-1)/BS, NB=B*MAXB+1;
  size_t sz=KV*NB*BS*D*es; int LAY=getenv("LAYERS")?atoi(getenv("LAYERS")):1; char*kcs[256],*vcs[256];
  for(int l=0;l<LAY;l++){char*kc=kcs[l]=malloc(sz),*vc=vcs[l]=malloc(sz);
  for(size_t i=0;i<sz;i+=2){kc[i]=rand()&0x3f;kc[i+1]=0x3c;vc[i]=rand()&0x3f;vc[i+1]=0x3c;}}
  char *q=malloc(B*H*D*es),*out=malloc(B*H*D*es); for(size_t i=0;i<B*H*D*es;i+=2){q[i]=rand();q[i+1]=0x3c;}
  int64_t *ids=malloc(B*MAXB*8),*lens=malloc(B*8); int64_t *perm=malloc(NB*8);
  for(int64_t i=0;i<NB;i++)perm[i]=i; for(int64_t i=NB-1;i>0;i--){int64_t j=rand()%(i+1),t=perm[i];perm[i]=perm[j];perm[j]=t;}
  for(int64_t r=0;r<B;r++){lens[r]=CTX; for(int64_t b=0;b<MAXB;b++)ids[r*MAXB+b]=perm[r*MAXB+b];}
  double t=1e9, tsum=0; int ncalls=calls;
  for(int c=0;c<calls;c++){ struct timespec a,b; clock_gettime(CLOCK_MONOTONIC,&a);
   mmkit_paged_decode_attention(out,q,H*D,kcs[c%LAY],vcs[c%LAY],ids,MAXB,lens,NULL,B,H,KV,D,NB,BS,0.125f,dt,getenv("T")?atoi(getenv("T")):1);
  clock_gettime(CLOCK_MONOTONIC,&b);
  double tt=(b.tv_sec-a.tv_sec)+1e-9*(b.tv_nsec-a.tv_nsec); if(tt<t)t=tt; tsum+=tt;} calls=1;
  unsigned h=0; for(size_t i=0;i<B*H*D*es;i++)h=h*31+(unsigned char)out[i];
  printf("best %.2f GB/s mean %.2f hash %08x\n", (double)sz*2/NB*(NB-1)/t/1e9, (double)sz*2/NB*(NB-1)*ncalls/tsum/1e9, h);
}
