/* The scalar reference of the MXFP4 GEMM (ggml-cpu style: plain C over the stored blocks, no SIMD), which the
 * tests hold the AVX2 and AVX-512 kernels to, bit for bit: y[M,N] = x[M,K] @ W[N,K]^T with W in GGUF's
 * block_mxfp4 rows (per 32 weights one e8m0 byte e, then 16 bytes: element i the low nibble of byte i, element
 * i + 16 the high one), weight = E2M1_X2[code] * 2^(e - 128) (ggml's half scale with the doubled values).
 *
 * It does what the kernels do, in their order: each activation row rounded to int16 per block of 32 (step
 * max|x| / 32767, round to nearest even, as quantize_rows_cpu.c), then per output and block the exact integer
 * dot product S, and f = fma(S, 2^(e - 128) * step, f) block after block. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"
#include "panel_cpu.h"

/* ggml's e8m0 -> float at half scale: 2^(e - 128), the two smallest as float32 subnormals. */
static float e8m0_half(uint8_t e) {
    union { uint32_t u; float f; } b = {.u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23};
    return b.f;
}

void mxfp4_gemm_ref(const float *x, int M, int K, const uint8_t *blocks, int N, float *y) {
    const int nb = K / 32;
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)K);
    float *dx = malloc(sizeof(float) * (size_t)nb);
    if (!xq || !dx) abort();
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * K;
        for (int b = 0; b < nb; b++) {
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xr[b * 32 + i]));
            const float id = amax > 0.f ? 32767.f / amax : 0.f;
            for (int i = 0; i < 32; i++) xq[b * 32 + i] = (int16_t)nearbyintf(xr[b * 32 + i] * id);
            dx[b] = amax / 32767.f;
        }
        for (int n = 0; n < N; n++) {
            const uint8_t *row = blocks + (size_t)n * nb * 17;
            float f = 0.f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = row + (size_t)b * 17;
                int32_t s = 0;
                for (int i = 0; i < 16; i++) {
                    s += (int32_t)xq[b * 32 + i] * E2M1_X2[blk[1 + i] & 15];
                    s += (int32_t)xq[b * 32 + 16 + i] * E2M1_X2[blk[1 + i] >> 4];
                }
                f = fmaf((float)s, e8m0_half(blk[0]) * dx[b], f);
            }
            y[(size_t)m * N + n] = f;
        }
    }
    free(xq);
    free(dx);
}
