/* Weight-only quantized GEMM for x86 CPUs with AVX2+FMA: y[M,N] = x[M,K] @ dequant(W)[N,K]^T.
 *
 * Weights stay quantized in memory; each group of weights dequantizes as q * scale + zero with float32
 * scale/zero per group, which holds GGUF's Q4_0/Q4_1/Q4_K (4-bit, groups of 32) and Q8_0/Q5_K/Q6_K
 * (8-bit container, groups of 32 or 16) exactly. A group's weights are unpacked to floats once and used
 * for up to TILE_M rows of x, so the same loop serves decode (M small) and prefill.
 * Built at first use by novainfer/layers/quantization/cpu_kernels.py (gcc -O3 -mavx2 -mfma -fopenmp).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>

#define TILE_M 8

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* xsum[m, g] = sum of x[m, g*G:(g+1)*G]: the zero point's contribution is zero[n, g] * xsum[m, g]. */
static void group_sums(const float *x, int M, int K, int G, float *xsum) {
    for (int m = 0; m < M; m++)
        for (int g = 0; g < K / G; g++) {
            float s = 0.f;
            for (int j = 0; j < G; j++) s += x[(size_t)m * K + g * G + j];
            xsum[(size_t)m * (K / G) + g] = s;
        }
}

static inline float zero_term(const float *z, const float *xs, int ng) {
    float t = 0.f;
    for (int g = 0; g < ng; g++) t += z[g] * xs[g];
    return t;
}

/* 4-bit: w[N, K/2] bytes; group g of 32 is bytes [16g, 16g+16): low nibble = element j, high = j+16
 * (GGML's Q4_0/Q4_1 order). scales/zeros: [N, K/32]. xsum: scratch [M, K/32]. */
void q4_gemm(const float *x, int M, int K, const uint8_t *w, const float *scales, const float *zeros,
             int N, float *y, float *xsum, int nthreads) {
    const int ng = K / 32;
    group_sums(x, M, K, 32, xsum);
    const __m128i mask = _mm_set1_epi8(0x0f);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *wr = w + (size_t)n * (K / 2);
        const float *sr = scales + (size_t)n * ng, *zr = zeros + (size_t)n * ng;
        for (int m0 = 0; m0 < M; m0 += TILE_M) {
            const int mt = M - m0 < TILE_M ? M - m0 : TILE_M;
            __m256 acc[TILE_M];
            for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
            for (int g = 0; g < ng; g++) {
                __m128i b = _mm_loadu_si128((const __m128i *)(wr + g * 16));
                __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
                __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                __m256 s = _mm256_set1_ps(sr[g]);
                for (int i = 0; i < mt; i++) {
                    const float *xg = x + (size_t)(m0 + i) * K + g * 32;
                    __m256 v = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
                    v = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), v);
                    v = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), v);
                    v = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), v);
                    acc[i] = _mm256_fmadd_ps(v, s, acc[i]);
                }
            }
            for (int i = 0; i < mt; i++)
                y[(size_t)(m0 + i) * N + n] = hsum(acc[i]) + zero_term(zr, xsum + (size_t)(m0 + i) * ng, ng);
        }
    }
}

/* 8-bit: w[N, K] int8, groups of G (16 or 32) elements; scales/zeros: [N, K/G]. xsum: scratch [M, K/G]. */
void q8_gemm(const float *x, int M, int K, const int8_t *w, int G, const float *scales, const float *zeros,
             int has_zeros, int N, float *y, float *xsum, int nthreads) {
    const int ng = K / G, n16 = K / 16, per = G / 16;
    if (has_zeros) group_sums(x, M, K, G, xsum);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = 0; n < N; n++) {
        const int8_t *wr = w + (size_t)n * K;
        const float *sr = scales + (size_t)n * ng, *zr = zeros + (size_t)n * ng;
        for (int m0 = 0; m0 < M; m0 += TILE_M) {
            const int mt = M - m0 < TILE_M ? M - m0 : TILE_M;
            __m256 acc[TILE_M];
            for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
            for (int u = 0; u < n16; u++) {
                __m128i b = _mm_loadu_si128((const __m128i *)(wr + u * 16));
                __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
                __m256 s = _mm256_set1_ps(sr[u / per]);
                for (int i = 0; i < mt; i++) {
                    const float *xg = x + (size_t)(m0 + i) * K + u * 16;
                    __m256 v = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
                    v = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), v);
                    acc[i] = _mm256_fmadd_ps(v, s, acc[i]);
                }
            }
            for (int i = 0; i < mt; i++) {
                float t = hsum(acc[i]);
                if (has_zeros) t += zero_term(zr, xsum + (size_t)(m0 + i) * ng, ng);
                y[(size_t)(m0 + i) * N + n] = t;
            }
        }
    }
}
