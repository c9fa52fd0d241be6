/* The panel layout of a PackedWeight's quants and scales (repack.py writes it; panel_layout.py converts it
 * back to rows for the tests' reference): output rows in panels of 16, each panel's weights stored in the order
 * the GEMM's madds consume them, so a kernel unpacks them in registers with shifts and masks alone.
 *
 * A "k-pair vector" is 16 int16 lanes: lane 2i + e holds the weight of panel row 8h + i at element 2p + e (h: the
 * panel's half), so a madd with k-pair p of an activation row (broadcast as one int32) gives 8 outputs' partial
 * sums, one per int32 lane.
 *   q4 (uint8 [P, 8K]): each 4 elements 4c..4c+3 of the panel take 32 bytes, 16 little-endian uint16 lanes; nibble t
 *     (bits 4t..4t+3) of lane L is the k-pair vector (p = 2c + t / 2, h = t % 2)'s lane L.
 *   q8 (int8 [P, 16K]): each k-pair p takes 32 bytes, 16 uint16 lanes; the low byte of lane L is vector (p, h = 0)'s
 *     lane L, the high byte vector (p, h = 1)'s.
 *   scales and zeros ([P, 16 * K/G], float16 or float32): group g's 16 values (one per panel row) side by side.
 * Rows past N in the last panel are zero (weights and scales), so they compute zeros that are never stored.
 */
#ifndef NOVAINFER_PANEL_CPU_H
#define NOVAINFER_PANEL_CPU_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define PANEL 16  /* output rows a panel */

/* q4: the 4 k-pair vectors of 4 elements (t = 0..3: k-pair 2c half 0, half 1, k-pair 2c + 1 half 0, half 1). */
static inline __attribute__((always_inline)) void q4_vectors(const uint8_t *b, __m256i v[4]) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)b), m = _mm256_set1_epi16(0x0f);
    v[0] = _mm256_and_si256(q, m);
    v[1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m);
    v[2] = _mm256_and_si256(_mm256_srli_epi16(q, 8), m);
    v[3] = _mm256_srli_epi16(q, 12);
}

/* MXFP4's e2m1 code (sign bit 3) -> twice its value, an integer in [-12, 12]; times 2^(e - 128) per 32 weights
 * that is the weight (the scales of an e2m1 PackedWeight hold the 2^(e - 128), kernels/cpu/repack.py). */
#define E2M1_X2_BYTES 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12
static const int8_t E2M1_X2[16] = {E2M1_X2_BYTES};

/* q4 vectors of e2m1 codes (0..15 in int16 lanes) -> their doubled values, sign-extended: a byte shuffle (the
 * lanes' high bytes index entry 0, a zero) then the low byte's sign into the high one. */
static inline __attribute__((always_inline)) void e2m1_vectors(__m256i v[4]) {
    const __m256i t = _mm256_setr_epi8(E2M1_X2_BYTES, E2M1_X2_BYTES);
    for (int i = 0; i < 4; i++) v[i] = _mm256_srai_epi16(_mm256_slli_epi16(_mm256_shuffle_epi8(t, v[i]), 8), 8);
}

/* q8: the 2 k-pair vectors (half 0, half 1) of one k-pair, sign-extended. */
static inline __attribute__((always_inline)) void q8_vectors(const int8_t *b, __m256i v[2]) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)b);
    v[0] = _mm256_srai_epi16(_mm256_slli_epi16(q, 8), 8);
    v[1] = _mm256_srai_epi16(q, 8);
}

/* Bytes of quants a panel takes (K elements per row). */
static inline size_t panel_bytes(int q4, int K) { return q4 ? (size_t)8 * K : (size_t)16 * K; }

/* Group g's 16 scales (or zeros) of a panel as two float32 vectors (rows 0-7, 8-15). */
static inline __attribute__((always_inline)) void panel_scales(const void *p, size_t panel, int ng, int g, int f16,
                                                               __m256 out[2]) {
    const size_t i = (panel * ng + g) * PANEL;
    if (f16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        out[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        out[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    } else {
        out[0] = _mm256_loadu_ps((const float *)p + i);
        out[1] = _mm256_loadu_ps((const float *)p + i + 8);
    }
}

#endif
