/* Weight-only quantized GEMM for x86 CPUs with AVX2+FMA: y[M,N] = x[M,K] @ dequant(W)[N,K]^T.
 *
 * Weights stay quantized in memory; each group of weights dequantizes as q * scale + zero with float32
 * scale/zero per group, which holds GGUF's Q4_0/Q4_1/Q4_K (4-bit, groups of 32) and Q8_0/Q5_K/Q6_K
 * (8-bit container, groups of 32 or 16) exactly.
 *
 * Activations are quantized per row to int8 in blocks of 32 (scale max|x|/127, llama.cpp's Q8_0 format
 * for activations), so a group's dot product is integer (maddubs + madd) and only its sum is scaled in
 * float: 2-3x fewer instructions per weight than widening every weight to float. The zero point's term
 * uses the group's sum of the rounded x (its error then cancels against the q term's, as in llama.cpp). A group's unpacked weights serve up to TILE_M rows of x.
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

/* x [M, K] -> xq int8 [M, K], dx [M, K/32] (xq * dx ~ x), xsum [M, K/G] (sums of xq * dx per group of G). */
static void quantize_rows(const float *x, int M, int K, int G, int8_t *xq, float *dx, float *xsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
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
            const float amax = _mm_cvtss_f32(m4), d = amax / 127.f;
            const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
            __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            _mm256_storeu_si256((__m256i *)(xq + (size_t)m * K + b * 32), _mm256_permutevar8x32_epi32(q, perm));
            dx[(size_t)m * (K / 32) + b] = d;
        }
        if (xsum)  /* sums of the rounded x, so the zero point multiplies the same x as the q term */
            for (int g = 0; g < K / G; g++) {
                const int8_t *q = xq + (size_t)m * K + g * G;
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

/* int32x8 sums of 4 adjacent u8*s8 products: the 32-byte dot product of one block, in 8 lanes. */
static inline __m256 dot_u8s8(__m256i u, __m256i s) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

static int scratch(int M, int K, int G, int8_t **xq, float **dx, float **xsum) {
    *xq = malloc((size_t)M * K);
    *dx = malloc(sizeof(float) * (size_t)M * (K / 32));
    *xsum = malloc(sizeof(float) * (size_t)M * (K / G));
    return *xq && *dx && *xsum;
}

/* Output rows are split into chunks of at least this many for the worker pool (cpu_pool.c). */
#define ROWS_PER_CHUNK 32

typedef struct {
    const int8_t *xq; const float *dx, *xsum; int M, K, G, N;
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
    const int8_t *xq = j->xq;
    const float *dx = j->dx, *xsum = j->xsum;
    const __m256i mask = _mm256_set1_epi8(0x0f);
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
                __m128i b = _mm_loadu_si128((const __m128i *)(wr + g * 16));
                __m256i wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), mask);
                for (int i = 0; i < mt; i++) {
                    const size_t row = (size_t)(m0 + i);
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + row * K + g * 32));
                    acc[i] = _mm256_fmadd_ps(dot_u8s8(wq, xv), _mm256_set1_ps(sr[g] * dx[row * ng + g]), acc[i]);
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
    const int8_t *xq = j->xq;
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
                __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + b * 32));
                __m256i aw = _mm256_sign_epi8(wv, wv);  /* |w| as unsigned; the sign moves onto x */
                /* the weight scale per 8 lanes: one group of 32, or two groups of 16 (4 lanes each) */
                __m256 sw = G == 32 ? _mm256_set1_ps(sr[b])
                                    : _mm256_set_m128(_mm_set1_ps(sr[2 * b + 1]), _mm_set1_ps(sr[2 * b]));
                for (int i = 0; i < mt; i++) {
                    const size_t row = (size_t)(m0 + i);
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + row * K + b * 32));
                    __m256 s = _mm256_mul_ps(sw, _mm256_set1_ps(dx[row * nb + b]));
                    acc[i] = _mm256_fmadd_ps(dot_u8s8(aw, _mm256_sign_epi8(xv, wv)), s, acc[i]);
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
    int8_t *xq; float *dx, *xsum;
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
