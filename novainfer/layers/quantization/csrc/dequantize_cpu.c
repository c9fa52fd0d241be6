/* Dequantization of a PackedWeight to float32 rows, for AVX2+F16C: the embedding lookup's rows and the inputs of
 * a BLAS GEMM (gguf_cpu.PREFILL_DEQUANT). Rows are split over the worker pool of cpu_pool.c in the few-row
 * GEMM's chunks (qgemm_cpu.c). Built with the other kernels by cpu_kernels.py. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu_kernels.h"
#include "cpu_pool.h"
#include "simd_cpu.h"

/* out [N, K] = q * scale + zero, per group of G. */
typedef struct {
    const void *w; const void *scales, *zeros; int K, G, N, q4, scale_f16, nchunks;
    float *out;
} dequant_job;

static void dequant_chunk(void *arg, int chunk) {
    const dequant_job *j = arg;
    const int K = j->K, G = j->G, ng = K / G, per = (j->N + j->nchunks - 1) / j->nchunks;
    const int n0 = chunk * per, n1 = n0 + per < j->N ? n0 + per : j->N;
    const __m256i mask = _mm256_set1_epi32(0x0f);
    for (int n = n0; n < n1; n++) {
        const size_t r = (size_t)n * ng;
        float *o = j->out + (size_t)n * K;
        for (int g = 0; g < ng; g++) {
            const __m256 s = _mm256_set1_ps(load_scale(j->scales, r + g, j->scale_f16));
            const __m256 z = _mm256_set1_ps(j->zeros ? load_scale(j->zeros, r + g, j->scale_f16) : 0.f);
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

/* q4 (q4=1, G=32) or int8 (q4=0, G 16 or 32; zeros may be NULL) weights [N, K] -> out float32 [N, K]; scales
 * and zeros float16 when scale_f16, else float32. */
void dequantize(const void *w, int q4, int G, const void *scales, const void *zeros, int scale_f16, int N, int K,
                float *out, int nthreads) {
    dequant_job j = {.w = w, .scales = scales, .zeros = zeros, .K = K, .G = G, .N = N, .q4 = q4,
                     .scale_f16 = scale_f16, .out = out};
    j.nchunks = num_chunks(N, nthreads);
    pool_run(dequant_chunk, &j, j.nchunks, nthreads);
}
