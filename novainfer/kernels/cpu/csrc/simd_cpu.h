/* Small AVX2 helpers shared by the CPU kernels (header-only, static inline). */
#ifndef NOVAINFER_SIMD_CPU_H
#define NOVAINFER_SIMD_CPU_H

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* The sum of 8 floats. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* The dot product of n floats. */
static inline float dot_f32(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* x *= scale / sqrt(sum(x^2) + 1e-6): the Gated DeltaNet's q / k normalisation. */
static inline void l2_normalize(float *x, int n, float scale) {
    const float r = scale / sqrtf(dot_f32(x, x, n) + 1e-6f);
    for (int i = 0; i < n; i++) x[i] *= r;
}

/* exp(x) for 8 floats (Cephes' polynomial, relative error ~1e-7 on [-87, 88]). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* A row of attention scores -> exp(score - max) over its visible keys lo..hi (inclusive), zero elsewhere in
 * 0..W (scores soft-capped first as cap * tanh(x / cap) when soft_cap > 0); returns 1 / the sum, and the max in
 * *max_out unless it is NULL. Shared by the decode and prefill attention kernels. */
static inline float softmax_row(float *row, int W, int lo, int hi, float soft_cap, float *max_out) {
    if (soft_cap > 0.f)
        for (int c = lo; c <= hi; c++) row[c] = soft_cap * tanhf(row[c] / soft_cap);
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    int c = lo;
    for (; c + 8 <= hi + 1; c += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(row + c));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    for (; c <= hi; c++) mx = row[c] > mx ? row[c] : mx;
    for (c = 0; c < lo; c++) row[c] = 0.f;
    for (c = hi + 1; c < W; c++) row[c] = 0.f;
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 vs = _mm256_setzero_ps();
    for (c = lo; c + 8 <= hi + 1; c += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + c), vm));
        _mm256_storeu_ps(row + c, e);
        vs = _mm256_add_ps(vs, e);
    }
    float sum = hsum8(vs);
    for (; c <= hi; c++) { row[c] = expf(row[c] - mx); sum += row[c]; }
    if (max_out) *max_out = mx;
    return 1.0f / sum;
}

/* The normalizer 1 / (sum + e^(sink - max)) of a softmax row that softmax_row gave inv = 1 / sum and max mx, with
 * one more logit, an attention sink, that takes its share of the mass and emits nothing (gpt-oss). */
static inline float sink_inv(float inv, float mx, float sink) { return 1.0f / (1.0f / inv + expf(sink - mx)); }

/* 8 bfloat16 -> 8 float32. */
static inline __m256 load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 vectors of 8 int32 (rows) -> their transpose, in place. */
static inline void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            u[i + 2 * h] = _mm256_unpacklo_epi64(t[i + h], t[i + h + 2]);
            u[i + 2 * h + 1] = _mm256_unpackhi_epi64(t[i + h], t[i + h + 2]);
        }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

#endif
