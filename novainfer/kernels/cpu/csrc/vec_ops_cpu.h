/* Float vector op sets under one naming, so a kernel written once as a macro over an op set X (X##_LOAD, X##_FMADD,
 * ...) is stamped out for AVX-512 (V16: 16 floats) and AVX2 (V8: 8 floats) and each copy is picked at run time. */
#ifndef NOVAINFER_VEC_OPS_CPU_H
#define NOVAINFER_VEC_OPS_CPU_H

#include <immintrin.h>

#define V16_T __m512
#define V16_W 16
#define V16_TARGET __attribute__((target("avx512f")))
#define V16_LOAD _mm512_loadu_ps
#define V16_STORE _mm512_storeu_ps
#define V16_SET1 _mm512_set1_ps
#define V16_ZERO _mm512_setzero_ps
#define V16_MUL _mm512_mul_ps
#define V16_SUB _mm512_sub_ps
#define V16_FMADD _mm512_fmadd_ps   /* a * b + c */
#define V16_FNMADD _mm512_fnmadd_ps /* c - a * b */

#define V8_T __m256
#define V8_W 8
#define V8_TARGET __attribute__((target("avx2,fma")))
#define V8_LOAD _mm256_loadu_ps
#define V8_STORE _mm256_storeu_ps
#define V8_SET1 _mm256_set1_ps
#define V8_ZERO _mm256_setzero_ps
#define V8_MUL _mm256_mul_ps
#define V8_SUB _mm256_sub_ps
#define V8_FMADD _mm256_fmadd_ps
#define V8_FNMADD _mm256_fnmadd_ps

/* The vector level a kernel runs at: 0 scalar, 1 AVX2 (the library's floor), 2 AVX-512F where the CPU has it.
 * `requested` -1 asks for the best available; a level above the CPU's is lowered to it. */
static inline int vec_level(int requested) {
    __builtin_cpu_init();
    const int best = __builtin_cpu_supports("avx512f") ? 2 : 1;
    return requested < 0 || requested > best ? best : requested;
}

#endif
