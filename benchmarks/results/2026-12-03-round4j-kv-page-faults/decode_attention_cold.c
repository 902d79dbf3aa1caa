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
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  int64_t B=atoi(argv[1]); int dt=atoi(argv[2]); int nth=atoi(argv[3]); int steps=atoi(argv[4]); int hot=argc>5;
  int64_t H=9,KV=3,D=64,BS=16,NB=4096,LAYERS=30, es=dt?2:4, MAXB=16;
  char *kc[30],*vc[30]; size_t sz=KV*NB*BS*D*es;
  for(int l=0;l<LAYERS;l++){kc[l]=malloc(sz);vc[l]=malloc(sz);
    for(size_t i=0;i<sz;i+=2){kc[l][i]=rand()&0x3f;kc[l][i+1]=0x3c;vc[l][i]=rand()&0x3f;vc[l][i+1]=0x3c;}}
  char *q=malloc(B*H*D*es),*out=malloc(B*H*D*es); memset(q,0x3c,B*H*D*es);
  int64_t *ids=malloc(B*MAXB*8),*lens=malloc(B*8);
  srand(1);
  for(int64_t r=0;r<B;r++){lens[r]=80+rand()%70; for(int64_t b=0;b<MAXB;b++)ids[r*MAXB+b]=rand()%NB;}
  double ts[64];
  for(int s=0;s<steps;s++){ double t=now();
    for(int l=0;l<LAYERS;l++) mmkit_paged_decode_attention(out,q,H*D,kc[hot?0:l],vc[hot?0:l],ids,MAXB,lens,NULL,B,H,KV,D,NB,BS,0.125f,dt,nth);
    ts[s]=now()-t; for(int64_t r=0;r<B;r++) lens[r]++; }
  qsort(ts,steps,sizeof(double),cmp);
  double keys=0; for(int64_t r=0;r<B;r++) keys+=lens[r]-steps/2;
  printf("B=%ld dt=%d th=%d: median %.3f ms/step (30 layers), %.2f GB/s KV\n",B,dt,nth,ts[steps/2]*1e3, keys*LAYERS*KV*D*es*2/ts[steps/2]/1e9);
}
