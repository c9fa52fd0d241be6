/* The activations' rounding both quantized GEMMs share (qgemm_cpu.c, qgemm_panel_cpu.c): per row, blocks of 32
 * rounded to int16 with step max|x| / 32767, so a group's dot product with the weights is integer. In a file of
 * its own so that the few-row kernel calls the panel kernel (from PANEL_MIN_ROWS rows on) and never the reverse. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "qgemm_jobs.h"

/* x [M, K] -> xq int16 [M, K], dxT [K/32, mp] (xq * dx ~ x; a block's rows side by side, mp apart),
 * xsum [M, ngp] (sums of xq * dx per group of G, zero past K/G). */
void quantize_rows(const float *x, int M, int K, int G, int mp, int ngp, int16_t *xq, float *dxT,
                   float *xsum, int xsum_needed) {
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
            dxT[(size_t)b * mp + m] = amax / 32767.f;
        }
        if (!xsum_needed) continue;
        float *xs = xsum + (size_t)m * ngp;
        for (int g = 0; g < ngp; g++) {  /* sums of the rounded x, so the zero point multiplies the same x as the q term */
            int s = 0;
            for (int i = 0; i < G && g < K / G; i++) s += xq[(size_t)m * K + g * G + i];
            xs[g] = (float)s * dxT[(size_t)(g < K / G ? g * G / 32 : 0) * mp + m];
        }
    }
}
