#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define R8(op) op op op op op op op op
int main(){
  long N=100000000; __m256i a=_mm256_set1_epi32(1), b=a, c0=a,c1=a,c2=a,c3=a,c4=a,c5=a,c6=a,c7=a,c8=a,c9=a,c10=a,c11=a; double t,d;
  t=now(); for(long i=0;i<N;i++){ __asm__ volatile(R8("vpaddd %[b], %[a], %[a]\n\t") :[a]"+x"(a):[b]"x"(b)); } d=now()-t;
  double cyc=d/(8.0*N); printf("clock %.2f GHz\n", 1e-9/cyc);
  t=now(); for(long i=0;i<N;i++){ __asm__ volatile(
   "vpmaddwd %[b], %[c0], %[c0]\n\tvpmaddwd %[b], %[c1], %[c1]\n\tvpmaddwd %[b], %[c2], %[c2]\n\tvpmaddwd %[b], %[c3], %[c3]\n\t"
   "vpmaddwd %[b], %[c4], %[c4]\n\tvpmaddwd %[b], %[c5], %[c5]\n\tvpmaddwd %[b], %[c6], %[c6]\n\tvpmaddwd %[b], %[c7], %[c7]\n\t"
   "vpmaddwd %[b], %[c8], %[c8]\n\tvpmaddwd %[b], %[c9], %[c9]\n\tvpmaddwd %[b], %[c10], %[c10]\n\tvpmaddwd %[b], %[c11], %[c11]\n\t"
   :[c0]"+x"(c0),[c1]"+x"(c1),[c2]"+x"(c2),[c3]"+x"(c3),[c4]"+x"(c4),[c5]"+x"(c5),[c6]"+x"(c6),[c7]"+x"(c7),[c8]"+x"(c8),[c9]"+x"(c9),[c10]"+x"(c10),[c11]"+x"(c11):[b]"x"(b)); } d=now()-t;
  printf("madd per cycle %.2f\n", 12.0*N/(d/cyc));
  t=now(); for(long i=0;i<N;i++){ __asm__ volatile(
   "vpmaddwd %[b], %[c0], %%ymm14\n\tvpaddd %%ymm14, %[c1], %[c1]\n\tvpmaddwd %[b], %[c2], %%ymm15\n\tvpaddd %%ymm15, %[c3], %[c3]\n\t"
   "vpmaddwd %[b], %[c4], %%ymm14\n\tvpaddd %%ymm14, %[c5], %[c5]\n\tvpmaddwd %[b], %[c6], %%ymm15\n\tvpaddd %%ymm15, %[c7], %[c7]\n\t"
   "vpmaddwd %[b], %[c8], %%ymm14\n\tvpaddd %%ymm14, %[c9], %[c9]\n\tvpmaddwd %[b], %[c10], %%ymm15\n\tvpaddd %%ymm15, %[c11], %[c11]\n\t"
   :[c0]"+x"(c0),[c1]"+x"(c1),[c2]"+x"(c2),[c3]"+x"(c3),[c4]"+x"(c4),[c5]"+x"(c5),[c6]"+x"(c6),[c7]"+x"(c7),[c8]"+x"(c8),[c9]"+x"(c9),[c10]"+x"(c10),[c11]"+x"(c11):[b]"x"(b):"xmm14","xmm15"); } d=now()-t;
  printf("madd+add pairs per cycle %.2f\n", 6.0*N/(d/cyc));
  return _mm256_extract_epi32(_mm256_add_epi32(a,_mm256_add_epi32(c0,c11)),0)&1;
}
