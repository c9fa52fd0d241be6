/* Weight-only quantized GEMM for x86 CPUs with AVX2+FMA: y[M,N] = x[M,K] @ dequant(W)[N,K]^T.
 *
 * Weights stay quantized in memory; each group of weights dequantizes as q * scale + zero with float32
 * scale/zero per group, which holds GGUF's Q4_0/Q4_1/Q4_K (4-bit, groups of 32) and Q8_0/Q5_K/Q6_K
 * (8-bit container, groups of 32 or 16) exactly.
 *
 * Activations are rounded per row to int16 in blocks of 32 (step max|x| / 32767), so a group's dot product
 * is integer (madd of int16 pairs) and only its sum is scaled in float: fewer instructions per weight than
 * widening every weight to float. int8 activations (llama.cpp's Q8 format, maddubs) were 1.2x faster
 * still but raised the default model's mean KL to the float32 reference from 0.0001 to 0.0048, above
 * llama.cpp's own 0.0047 (benchmarks/quant_accuracy.py); int16 keeps it at the float path's level.
 * The zero point's term uses the group's sum of the rounded x (its error cancels against the q term's).
 * A group's unpacked weights serve up to TILE_M rows of x.
 * Output rows are split over the worker pool of cpu_pool.c. Built at first use by cpu_kernels.py.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <stddef.h>

#include "cpu_pool.h"

#define TILE_M 4

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* x [M, K] -> xq int16 [M, K], dx [M, K/32] (xq * dx ~ x), xsum [M, K/G] (sums of xq * dx per group of G). */
static void quantize_rows(const float *x, int M, int K, int G, int16_t *xq, float *dx, float *xsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * K;
        for (int b = 0; b < K / 32; b++) {
            const float *p = xr + b * 32;
            __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
            __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
            __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            const __m256 id = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
            int16_t *q = xq + (size_t)m * K + b * 32;  /* packs works per 128-bit lane: restore the order */
            _mm256_storeu_si256((__m256i *)q, _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8));
            _mm256_storeu_si256((__m256i *)(q + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8));
            dx[(size_t)m * (K / 32) + b] = amax / 32767.f;
        }
        if (xsum)  /* sums of the rounded x, so the zero point multiplies the same x as the q term */
            for (int g = 0; g < K / G; g++) {
                const int16_t *q = xq + (size_t)m * K + g * G;
                int s = 0;
                for (int j = 0; j < G; j++) s += q[j];
                xsum[(size_t)m * (K / G) + g] = (float)s * dx[(size_t)m * (K / 32) + g * G / 32];
            }
    }
}

static inline float zero_term(const float *z, const float *xs, int ng) {
    float t = 0.f;
    for (int g = 0; g < ng; g++) t += z[g] * xs[g];
    return t;
}

/* float sums of adjacent int16 products (madd): 16 weights against 16 activations, in 8 lanes. */
static inline __m256i dot16(__m256i w, const int16_t *x) {
    return _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)x));
}

static int scratch(int M, int K, int G, int16_t **xq, float **dx, float **xsum) {
    *xq = malloc(sizeof(int16_t) * (size_t)M * K);
    *dx = malloc(sizeof(float) * (size_t)M * (K / 32));
    *xsum = malloc(sizeof(float) * (size_t)M * (K / G));
    return *xq && *dx && *xsum;
}

/* Output rows are split into chunks of at least this many for the worker pool (cpu_pool.c). */
#define ROWS_PER_CHUNK 32

typedef struct {
    const int16_t *xq; const float *dx, *xsum; int M, K, G, N;
    const void *w; const float *scales, *zeros; int has_zeros, nchunks;
    float *y;
} gemm_job;

static void chunk_range(const gemm_job *j, int chunk, int *n0, int *n1) {
    const int per = (j->N + j->nchunks - 1) / j->nchunks;
    *n0 = chunk * per;
    *n1 = *n0 + per < j->N ? *n0 + per : j->N;
}

static int num_chunks(int N, int nthreads) {
    int c = N / ROWS_PER_CHUNK;
    if (c > 8 * nthreads) c = 8 * nthreads;  /* enough for a late worker to find work, few enough to be cheap */
    return c < 1 ? 1 : c;
}

/* 4-bit: w[N, K/2] bytes; group g of 32 is bytes [16g, 16g+16): low nibble = element j, high = j+16
 * (GGML's Q4_0/Q4_1 order). scales/zeros: [N, K/32]. */
static void q4_chunk(void *arg, int chunk) {
    const gemm_job *j = arg;
    const int M = j->M, K = j->K, N = j->N, ng = K / 32;
    const int16_t *xq = j->xq;
    const float *dx = j->dx, *xsum = j->xsum;
    const __m256i mask = _mm256_set1_epi16(0x0f);
    int n0, n1;
    chunk_range(j, chunk, &n0, &n1);
    for (int n = n0; n < n1; n++) {
        const uint8_t *wr = (const uint8_t *)j->w + (size_t)n * (K / 2);
        const float *sr = j->scales + (size_t)n * ng, *zr = j->zeros + (size_t)n * ng;
        for (int m0 = 0; m0 < M; m0 += TILE_M) {
            const int mt = M - m0 < TILE_M ? M - m0 : TILE_M;
            __m256 acc[TILE_M];
            for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
            for (int g = 0; g < ng; g++) {
                __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wr + g * 16)));
                __m256i lo = _mm256_and_si256(b, mask), hi = _mm256_srli_epi16(b, 4);  /* elements 0-15, 16-31 */
                for (int i = 0; i < mt; i++) {
                    const size_t row = (size_t)(m0 + i);
                    const int16_t *xg = xq + row * K + g * 32;
                    __m256i d = _mm256_add_epi32(dot16(lo, xg), dot16(hi, xg + 16));
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sr[g] * dx[row * ng + g]), acc[i]);
                }
            }
            for (int i = 0; i < mt; i++)
                j->y[(size_t)(m0 + i) * N + n] = hsum(acc[i]) + zero_term(zr, xsum + (size_t)(m0 + i) * ng, ng);
        }
    }
}

/* 8-bit: w[N, K] int8, groups of G (16 or 32) elements; scales/zeros: [N, K/G]. */
static void q8_chunk(void *arg, int chunk) {
    const gemm_job *j = arg;
    const int M = j->M, K = j->K, N = j->N, G = j->G, ng = K / G, nb = K / 32;
    const int16_t *xq = j->xq;
    const float *dx = j->dx, *xsum = j->xsum;
    int n0, n1;
    chunk_range(j, chunk, &n0, &n1);
    for (int n = n0; n < n1; n++) {
        const int8_t *wr = (const int8_t *)j->w + (size_t)n * K;
        const float *sr = j->scales + (size_t)n * ng, *zr = j->zeros + (size_t)n * ng;
        for (int m0 = 0; m0 < M; m0 += TILE_M) {
            const int mt = M - m0 < TILE_M ? M - m0 : TILE_M;
            __m256 acc[TILE_M];
            for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
            for (int b = 0; b < nb; b++) {
                __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + b * 32)));
                __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + b * 32 + 16)));
                /* one weight scale for the 32, or one per 16 (groups of 16) */
                const float s0 = G == 32 ? sr[b] : sr[2 * b], s1 = G == 32 ? sr[b] : sr[2 * b + 1];
                for (int i = 0; i < mt; i++) {
                    const size_t row = (size_t)(m0 + i);
                    const int16_t *xg = xq + row * K + b * 32;
                    const float d = dx[row * nb + b];
                    if (G == 32) {
                        __m256i p = _mm256_add_epi32(dot16(w0, xg), dot16(w1, xg + 16));
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s0 * d), acc[i]);
                    } else {
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16(w0, xg)), _mm256_set1_ps(s0 * d), acc[i]);
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16(w1, xg + 16)), _mm256_set1_ps(s1 * d), acc[i]);
                    }
                }
            }
            for (int i = 0; i < mt; i++) {
                float t = hsum(acc[i]);
                if (j->has_zeros) t += zero_term(zr, xsum + (size_t)(m0 + i) * ng, ng);
                j->y[(size_t)(m0 + i) * N + n] = t;
            }
        }
    }
}

/* Quantizes x, then runs the chunks on the pool. Returns 0, or -1 when scratch memory ran out. */
static int run_gemm(gemm_job *j, const float *x, pool_chunk_fn fn, int nthreads) {
    int16_t *xq; float *dx, *xsum;
    if (!scratch(j->M, j->K, j->G, &xq, &dx, &xsum)) { free(xq); free(dx); free(xsum); return -1; }
    quantize_rows(x, j->M, j->K, j->G, xq, dx, j->has_zeros ? xsum : NULL);
    j->xq = xq; j->dx = dx; j->xsum = xsum;
    j->nchunks = num_chunks(j->N, nthreads);
    pool_run(fn, j, j->nchunks, nthreads);
    free(xq); free(dx); free(xsum);
    return 0;
}

int q4_gemm(const float *x, int M, int K, const uint8_t *w, const float *scales, const float *zeros,
            int N, float *y, int nthreads) {
    gemm_job j = {.M = M, .K = K, .G = 32, .N = N, .w = w, .scales = scales, .zeros = zeros, .has_zeros = 1,
                  .y = y};
    return run_gemm(&j, x, q4_chunk, nthreads);
}

int q8_gemm(const float *x, int M, int K, const int8_t *w, int G, const float *scales, const float *zeros,
            int has_zeros, int N, float *y, int nthreads) {
    gemm_job j = {.M = M, .K = K, .G = G, .N = N, .w = w, .scales = scales, .zeros = zeros,
                  .has_zeros = has_zeros, .y = y};
    return run_gemm(&j, x, q8_chunk, nthreads);
}

/* Dequantization to float32 rows (the prefill path's BLAS GEMM input): out [N, K] = q * scale + zero. */
typedef struct {
    const void *w; const float *scales, *zeros; int K, G, N, q4, nchunks;
    float *out;
} dequant_job;

static void dequant_chunk(void *arg, int chunk) {
    const dequant_job *j = arg;
    const int K = j->K, G = j->G, ng = K / G, per = (j->N + j->nchunks - 1) / j->nchunks;
    const int n0 = chunk * per, n1 = n0 + per < j->N ? n0 + per : j->N;
    const __m256i mask = _mm256_set1_epi32(0x0f);
    for (int n = n0; n < n1; n++) {
        const float *sr = j->scales + (size_t)n * ng, *zr = j->zeros ? j->zeros + (size_t)n * ng : NULL;
        float *o = j->out + (size_t)n * K;
        for (int g = 0; g < ng; g++) {
            const __m256 s = _mm256_set1_ps(sr[g]), z = _mm256_set1_ps(zr ? zr[g] : 0.f);
            for (int c = 0; c < G; c += 8) {
                __m256i q;
                if (j->q4) {  /* element c of group g: low nibbles hold 0-15, high nibbles 16-31 */
                    const uint8_t *b = (const uint8_t *)j->w + (size_t)n * (K / 2) + g * 16 + (c & 15);
                    q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
                    q = c < 16 ? _mm256_and_si256(q, mask) : _mm256_srli_epi32(q, 4);
                } else {
                    q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)j->w + (size_t)n * K + g * G + c)));
                }
                _mm256_storeu_ps(o + g * G + c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, z));
            }
        }
    }
}

/* q4 (q4=1, G=32) or int8 (q4=0, G 16 or 32; zeros may be NULL) weights [N, K] -> out float32 [N, K]. */
void dequantize(const void *w, int q4, int G, const float *scales, const float *zeros, int N, int K, float *out,
                int nthreads) {
    dequant_job j = {.w = w, .scales = scales, .zeros = zeros, .K = K, .G = G, .N = N, .q4 = q4, .out = out};
    j.nchunks = num_chunks(N, nthreads);
    pool_run(dequant_chunk, &j, j.nchunks, nthreads);
}
