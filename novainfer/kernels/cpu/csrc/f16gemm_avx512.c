/* The 16-bit float GEMM's tiles for CPUs with AVX-512 (f16gemm_cpu.c runs them where set_gemm_isa picked
 * AVX-512): one 16-lane register an output, so f16gemm.h's lanes are one register's; the tail of K is a masked
 * load (lanes past K read 0). NR weight rows x up to MR activation rows a tile, all accumulators in registers.
 * No software prefetch: at M = 1 the hardware prefetchers follow the NR row streams (a prefetch 1 KiB ahead, as the
 * quantized tiles have, was no faster: 0.73 ms against 0.69 for 8960 x 1536 on 2 Zen 4 cores, ~38 GB/s). */
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "f16gemm.h"

#define NR 4
#define MR 4

static inline __attribute__((always_inline)) __m512 widen16(__m256i h, const int bf16) {
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

/* lanes l + 8 onto l, then l + 4, l + 2, l + 1: f16gemm.h's tree */
static inline float reduce16(__m512 a) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* y[m0..m0+mr, n..n+nr]: rows past nr repeat row n (computed, not stored). */
static inline __attribute__((always_inline)) void tile(const f16_job *j, int n, int nr, int m0, const int mr,
                                                       const int bf16) {
    const int K = j->K, kmain = K / 16 * 16;
    const uint16_t *wp[NR];
    const float *xp[MR];
    for (int r = 0; r < NR; r++) wp[r] = j->w + (size_t)(n + (r < nr ? r : 0)) * K;
    for (int m = 0; m < mr; m++) xp[m] = j->x + (size_t)(m0 + m) * K;
    __m512 a[NR][MR];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < mr; m++) a[r][m] = _mm512_setzero_ps();
    for (int k = 0; k < kmain; k += 16) {
        __m512 w[NR];
        for (int r = 0; r < NR; r++) w[r] = widen16(_mm256_loadu_si256((const __m256i *)(wp[r] + k)), bf16);
        for (int m = 0; m < mr; m++) {
            const __m512 xv = _mm512_loadu_ps(xp[m] + k);
            for (int r = 0; r < NR; r++) a[r][m] = _mm512_fmadd_ps(xv, w[r], a[r][m]);
        }
    }
    if (kmain < K) {
        const __mmask16 keep = (__mmask16)((1u << (K - kmain)) - 1);
        __m512 w[NR];
        for (int r = 0; r < NR; r++) w[r] = widen16(_mm256_maskz_loadu_epi16(keep, wp[r] + kmain), bf16);
        for (int m = 0; m < mr; m++) {
            const __m512 xv = _mm512_maskz_loadu_ps(keep, xp[m] + kmain);
            for (int r = 0; r < NR; r++) a[r][m] = _mm512_fmadd_ps(xv, w[r], a[r][m]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) j->y[(size_t)(m0 + m) * j->N + n + r] = reduce16(a[r][m]);
}

#define TILES(BF16)                                                   \
    do {                                                              \
        if (mr == 4) tile(j, n, nr, m0, 4, BF16);                     \
        else if (mr == 3) tile(j, n, nr, m0, 3, BF16);                \
        else if (mr == 2) tile(j, n, nr, m0, 2, BF16);                \
        else tile(j, n, nr, m0, 1, BF16);                             \
    } while (0)

void f16_rows_avx512(const f16_job *j, int n0, int n1) {
    for (int nb = n0; nb < n1; nb += j->block_rows) {
        const int ne = n1 < nb + j->block_rows ? n1 : nb + j->block_rows;
        for (int m0 = 0; m0 < j->M; m0 += MR) {
            const int mr = j->M - m0 < MR ? j->M - m0 : MR;
            for (int n = nb; n < ne; n += NR) {
                const int nr = ne - n < NR ? ne - n : NR;
                if (j->bf16) TILES(1);
                else TILES(0);
            }
        }
    }
}
