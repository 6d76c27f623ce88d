/* Which arithmetic a Q4_K verify should take on AVX-512 VNNI (issues 46 and 47 asked this be
 * decided, with paired figures, before the kernels were ported): two inner loops over the same
 * data, alternated 20 runs at a time in one process, their time ratio's median and quartiles.
 *
 *   gcc -O3 -march=native -DNP=5 scripts/arith_q4k.c -o /tmp/arith && /tmp/arith 60
 *
 * Not a kernel of tsspec's (its data are random and it checks no result): a model of the two
 * instruction mixes, with the real code's loop order (a weight row's super-block unpacked once, then
 * every pair of input rows) and the real code's 512-bit pairing of input rows.
 *
 * Two ways, same data volume and loop order:
 * A (tsspec today): per 128-element group and input-row pair, 4 VPDPBUSD -> convert, multiply (a*d),
 *   fma; the super-block's offsets one fma.
 * B (integer sub-block scales, Q8_K-style): per group 4 VPDPBUSD -> VPMULLD by the sub-block scales,
 *   VPADDD into an int32 sum; per super-block one convert and fma, and the minimums' one.
 * Rows: NP pairs of input rows (2*NP rows), N weight rows of K elements, 1 thread, data in L2.
 * run_a and run_b repeat their loop framing on purpose: each mix is its own noinline loop, so that
 * neither's code generation shapes the other's. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#ifndef NP
#define NP 5
#endif
#define N 192
#define K 4096
#define NSB (K / 256)
static double now(void){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
static uint8_t W[N][NSB][144] __attribute__((aligned(64)));
static int8_t X[NP][NSB][2][256] __attribute__((aligned(64))); /* pair p, super-block, group: 2 rows x 128 */
static float XD[NP][NSB][2][16] __attribute__((aligned(64)));
static float XF[NP][NSB][16] __attribute__((aligned(64)));
static int32_t XB[NP][NSB][16] __attribute__((aligned(64)));
static float out[N][NP];
static inline __m512i bcast256(const void *p){ return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p)); }
/* a super-block's two groups of 4-bit codes, both rows' halves (the same in both variants) */
static inline __attribute__((always_inline)) void unpack_sb(const uint8_t *b, __m512i Z[2][4]){
  const __m512i m4=_mm512_set1_epi8(15);
  for(int g=0;g<2;g++){ __m512i q0=bcast256(b+16+64*g), q1=bcast256(b+48+64*g);
    Z[g][0]=_mm512_and_si512(q0,m4); Z[g][1]=_mm512_and_si512(_mm512_srli_epi16(q0,4),m4);
    Z[g][2]=_mm512_and_si512(q1,m4); Z[g][3]=_mm512_and_si512(_mm512_srli_epi16(q1,4),m4);}
}
/* the exact integer sums of one group and pair of input rows: four VPDPBUSD (the same in both) */
static inline __attribute__((always_inline)) __m512i group_sums(const __m512i Z[4], const int8_t *x){
  __m512i i=_mm512_setzero_si512();
  for(int j=0;j<4;j++) i=_mm512_dpbusd_epi32(i,Z[j],_mm512_load_si512(x+64*j));
  return i;
}
__attribute__((noinline)) static void run_a(void){
  for(int r=0;r<N;r++){
    __m512 acc[NP]; for(int p=0;p<NP;p++) acc[p]=_mm512_setzero_ps();
    for(int sb=0;sb<NSB;sb++){
      const uint8_t *b=W[r][sb];
      __m512i Z[2][4];
      unpack_sb(b,Z);
      const __m512 a0=_mm512_set1_ps((float)(b[4]&63)*0.01f), a1=_mm512_set1_ps((float)(b[5]&63)*0.01f);
      const __m512 mn=_mm512_set1_ps(-(float)(b[8]&63)*0.02f);
      for(int p=0;p<NP;p++){
        acc[p]=_mm512_fmadd_ps(mn,_mm512_load_ps(XF[p][sb]),acc[p]);
        for(int g=0;g<2;g++){ const __m512i i=group_sums(Z[g],X[p][sb][g]);
          acc[p]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(i),_mm512_mul_ps(g?a1:a0,_mm512_load_ps(XD[p][sb][g])),acc[p]);}
      }
    }
    for(int p=0;p<NP;p++) out[r][p]=_mm512_reduce_add_ps(acc[p]);
  }
}
__attribute__((noinline)) static void run_b(void){
  for(int r=0;r<N;r++){
    __m512 acc[NP]; for(int p=0;p<NP;p++) acc[p]=_mm512_setzero_ps();
    for(int sb=0;sb<NSB;sb++){
      const uint8_t *b=W[r][sb];
      __m512i Z[2][4];
      unpack_sb(b,Z);
      const __m512i s0=_mm512_set1_epi32(b[4]&63), s1=_mm512_set1_epi32(b[5]&63), m8=_mm512_set1_epi32(b[8]&63);
      const __m512 dd=_mm512_set1_ps(0.01f), dm=_mm512_set1_ps(-0.02f);
      for(int p=0;p<NP;p++){
        __m512i is=_mm512_setzero_si512();
        for(int g=0;g<2;g++){ const __m512i i=group_sums(Z[g],X[p][sb][g]);
          is=_mm512_add_epi32(is,_mm512_mullo_epi32(i,g?s1:s0));}
        const __m512i ms=_mm512_mullo_epi32(_mm512_load_si512(XB[p][sb]),m8);
        acc[p]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(is),_mm512_mul_ps(dd,_mm512_load_ps(XD[p][sb][0])),acc[p]);
        acc[p]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(ms),_mm512_mul_ps(dm,_mm512_load_ps(XD[p][sb][1])),acc[p]);
      }
    }
    for(int p=0;p<NP;p++) out[r][p]=_mm512_reduce_add_ps(acc[p]);
  }
}
int main(int argc,char**argv){
  srand(1); uint8_t *w=(uint8_t*)W; for(size_t i=0;i<sizeof W;i++) w[i]=rand();
  int8_t *x=(int8_t*)X; for(size_t i=0;i<sizeof X;i++) x[i]=rand()%255-127;
  float *d=(float*)XD; for(size_t i=0;i<sizeof XD/4;i++) d[i]=0.01f; float *f=(float*)XF; for(size_t i=0;i<sizeof XF/4;i++) f[i]=1.f;
  int32_t *bb=(int32_t*)XB; for(size_t i=0;i<sizeof XB/4;i++) bb[i]=rand()%2000;
  double ta[200],tb[200]; int R=argc>1?atoi(argv[1]):60; if(R<1||R>200){fprintf(stderr,"rounds: 1 to 200, not %s\n",argv[1]); return 2;}
  for(int i=0;i<R;i++){ double t0=now(); for(int k=0;k<20;k++) run_a(); double t1=now(); for(int k=0;k<20;k++) run_b(); double t2=now(); ta[i]=t1-t0; tb[i]=t2-t1; }
  double rr[200]; for(int i=0;i<R;i++) rr[i]=tb[i]/ta[i];
  for(int i=0;i<R;i++) for(int j=i+1;j<R;j++) if(rr[j]<rr[i]){double t=rr[i];rr[i]=rr[j];rr[j]=t;}
  printf("NP=%d (rows %d): B/A time median %.3f (quartiles %.3f-%.3f); A %.1f ns per super-block-row, %g\n", NP, 2*NP, rr[R/2], rr[R/4], rr[3*R/4], ta[R/2]/20/N/NSB*1e9, out[0][0]);
}
