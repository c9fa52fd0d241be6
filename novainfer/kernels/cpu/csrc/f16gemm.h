/* The 16-bit float GEMM's job (f16gemm_cpu.c), shared by its AVX2 tiles and its AVX-512 tiles (f16gemm_avx512.c).
 *
 * Every output's order of operations, whatever the ISA, tile or M (f16_gemm_ref is it in plain C): 16 float32
 * lanes, lane l summing x[k] * w[k] for k = l, l + 16, ... with one fma each (k past K reads 0 * 0), then lanes
 * l + 8 onto l, l + 4 onto l, l + 2 onto l, and lane 1 onto lane 0. The weights widen to float32 exactly (F16:
 * vcvtph2ps; BF16: the 16 bits shifted up), so the values multiplied are the file's own. */
#ifndef NOVAINFER_F16GEMM_H
#define NOVAINFER_F16GEMM_H

#include <stdint.h>

typedef struct {
    const float *x;     /* [M, K] */
    const uint16_t *w;  /* [N, K], F16 or BF16 bits */
    float *y;           /* [M, N] */
    int M, K, N, bf16, nchunks, block_rows;
} f16_job;

/* Weight rows [n0, n1) of j against every activation row, with the AVX-512 tiles. */
void f16_rows_avx512(const f16_job *j, int n0, int n1);

#endif
