/* GEMM of 16-bit float weights kept as stored (GGUF F16 and BF16): y[M,N] = x[M,K] @ W[N,K]^T, float32 x and y.
 *
 * A decode step reads an F16 weight's 2 bytes a value instead of the 4 of a float32 copy (Gemma 4's
 * per_layer_model_proj: 27.5 MB a token, not 55). The weights widen to float32 exactly and every product and sum is
 * float32, in the order f16gemm.h states for every output (16 lanes over k, then a fixed tree): the scalar
 * reference f16_gemm_ref below, the AVX2 tiles here and the AVX-512 tiles (f16gemm_avx512.c, where the CPU has
 * them: set_gemm_isa) give the same bits, for any M, tile or thread count.
 *
 * Weight rows are split over the worker pool (cpu_pool.c); each chunk goes through its rows in blocks that stay
 * in L2 while every tile of activation rows passes over them (one pass over the weights for any M).
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_pool.h"
#include "f16gemm.h"
#include "qgemm_jobs.h"

#define BLOCK_BYTES (256 << 10)  /* weight bytes a block of rows (L2-sized: Zen 4 has 1 MiB a core) */

/* ---- the scalar reference (plain C, no SIMD: the order every kernel keeps) ---------------------------------- */

/* IEEE binary16 -> float32, exactly (subnormals normalized; a NaN keeps its payload, quieted as vcvtph2ps does). */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (!man) {
        bits = sign;
    } else {  /* man * 2^-24: shift the leading one up to bit 10 */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

void f16_gemm_ref(const float *x, int M, int K, const uint16_t *w, int bf16, int N, float *y) {
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            const float *xr = x + (size_t)m * K;
            const uint16_t *wr = w + (size_t)n * K;
            float a[16] = {0};
            for (int k0 = 0; k0 < K; k0 += 16)
                for (int l = 0; l < 16; l++) {
                    const int k = k0 + l;
                    const float xv = k < K ? xr[k] : 0.f;
                    const float wv = k >= K ? 0.f : bf16 ? bf16_to_float(wr[k]) : half_to_float(wr[k]);
                    a[l] = __builtin_fmaf(xv, wv, a[l]);
                }
            for (int i = 0; i < 8; i++) a[i] = a[i] + a[i + 8];
            for (int i = 0; i < 4; i++) a[i] = a[i] + a[i + 4];
            for (int i = 0; i < 2; i++) a[i] = a[i] + a[i + 2];
            y[(size_t)m * N + n] = a[0] + a[1];
        }
}

/* ---- AVX2 + F16C tiles: NR weight rows x up to MR activation rows, each output in two 8-lane registers ---------- */

#define NR2 2
#define MR2 2

static inline __attribute__((always_inline)) __m256 widen8(const uint16_t *p, const int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}

/* lanes l + 8 onto l (the two registers), then l + 4, l + 2, l + 1: f16gemm.h's tree */
static inline float reduce16(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* 16 elements of NR2 weight rows (wp[r] + k) against mr activation rows (xp[m] + k). */
static inline __attribute__((always_inline)) void step2(const uint16_t *const *wp, const float *const *xp, size_t k,
                                                        const int mr, const int bf16, __m256 a[NR2][MR2][2]) {
    __m256 w[NR2][2];
    for (int r = 0; r < NR2; r++) {
        w[r][0] = widen8(wp[r] + k, bf16);
        w[r][1] = widen8(wp[r] + k + 8, bf16);
    }
    for (int m = 0; m < mr; m++) {
        const __m256 x0 = _mm256_loadu_ps(xp[m] + k), x1 = _mm256_loadu_ps(xp[m] + k + 8);
        for (int r = 0; r < NR2; r++) {
            a[r][m][0] = _mm256_fmadd_ps(x0, w[r][0], a[r][m][0]);
            a[r][m][1] = _mm256_fmadd_ps(x1, w[r][1], a[r][m][1]);
        }
    }
}

/* y[m0..m0+mr, n..n+nr]: rows past nr repeat row n (computed, not stored). */
static inline __attribute__((always_inline)) void tile2(const f16_job *j, int n, int nr, int m0, const int mr,
                                                        const int bf16) {
    const int K = j->K, kmain = K / 16 * 16;
    const uint16_t *wp[NR2];
    const float *xp[MR2];
    for (int r = 0; r < NR2; r++) wp[r] = j->w + (size_t)(n + (r < nr ? r : 0)) * K;
    for (int m = 0; m < mr; m++) xp[m] = j->x + (size_t)(m0 + m) * K;
    __m256 a[NR2][MR2][2];
    for (int r = 0; r < NR2; r++)
        for (int m = 0; m < mr; m++) a[r][m][0] = a[r][m][1] = _mm256_setzero_ps();
    for (int k = 0; k < kmain; k += 16) step2(wp, xp, (size_t)k, mr, bf16, a);
    if (kmain < K) {  /* the tail, zero-padded to 16 */
        uint16_t wt[NR2][16] = {{0}};
        float xt[MR2][16] = {{0}};
        const uint16_t *wq[NR2];
        const float *xq[MR2];
        for (int r = 0; r < NR2; r++) {
            memcpy(wt[r], wp[r] + kmain, sizeof(uint16_t) * (size_t)(K - kmain));
            wq[r] = wt[r];
        }
        for (int m = 0; m < mr; m++) {
            memcpy(xt[m], xp[m] + kmain, sizeof(float) * (size_t)(K - kmain));
            xq[m] = xt[m];
        }
        step2(wq, xq, 0, mr, bf16, a);
    }
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) j->y[(size_t)(m0 + m) * j->N + n + r] = reduce16(a[r][m][0], a[r][m][1]);
}

static void rows_avx2(const f16_job *j, int n0, int n1) {
    for (int nb = n0; nb < n1; nb += j->block_rows) {
        const int ne = n1 < nb + j->block_rows ? n1 : nb + j->block_rows;
        for (int m0 = 0; m0 < j->M; m0 += MR2) {
            const int mr = j->M - m0 < MR2 ? j->M - m0 : MR2;
            for (int n = nb; n < ne; n += NR2) {
                const int nr = ne - n < NR2 ? ne - n : NR2;
                if (j->bf16) {
                    if (mr == 2) tile2(j, n, nr, m0, 2, 1); else tile2(j, n, nr, m0, 1, 1);
                } else {
                    if (mr == 2) tile2(j, n, nr, m0, 2, 0); else tile2(j, n, nr, m0, 1, 0);
                }
            }
        }
    }
}

/* ---- the entry point ---------------------------------------------------------------------------------------- */

static void f16_chunk(void *arg, int chunk) {
    const f16_job *j = arg;
    const int n0 = (int)((long)chunk * j->N / j->nchunks), n1 = (int)((long)(chunk + 1) * j->N / j->nchunks);
    if (gemm_isa_avx512()) f16_rows_avx512(j, n0, n1);
    else rows_avx2(j, n0, n1);
}

int f16_gemm(const float *x, int M, int K, const uint16_t *w, int bf16, int N, float *y, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    int block = BLOCK_BYTES / (2 * (K > 0 ? K : 1)) / 4 * 4;
    f16_job j = {.x = x, .w = w, .y = y, .M = M, .K = K, .N = N, .bf16 = bf16, .block_rows = block < 4 ? 4 : block};
    const int c = num_chunks(N, nthreads);
    j.nchunks = c < N ? c : N;
    pool_run(f16_chunk, &j, j.nchunks, nthreads);
    return 0;
}
