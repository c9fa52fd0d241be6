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
 *   q6 (uint8 [P, 12K]; Q6_K's weights, -32..31, as 6-bit two's complement): each 8 elements 8b..8b+7 take 96
 *     bytes: the q4 layout's 64 bytes of those elements holding the low 4 bits, then 32 bytes of the top 2 bits
 *     (signed: a weight is nibble + 16 * top): byte 16 * (c % 2) + L holds lane L's of elements 4c..4c+3 (c = 2b,
 *     2b + 1), those of vector t (q4's nibble t) in bits 2t..2t+1.
 *   scales and zeros ([P, 16 * K/G], float16 or float32): group g's 16 values (one per panel row) side by side;
 *     or, SCALE_SUPER (the K-quants; uint8 [P, K/256 * (32 + 16 * 256/G)]), per super-block of 256 weights its 16
 *     float16 factors (GGUF's d, or -dmin for zeros), then its 256/G groups' 16 int8 multipliers each (sc, or m):
 *     a group's value is (float)factor * (float)multiplier, exact in float32 (11 bits times 8), so the kernels
 *     see the very values a float32 store holds.
 * Rows past N in the last panel are zero (weights and scales), so they compute zeros that are never stored.
 */
#ifndef NOVAINFER_PANEL_CPU_H
#define NOVAINFER_PANEL_CPU_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define PANEL 16  /* output rows a panel */
#define SUPER 256  /* weights a K-quant super-block (SCALE_SUPER: one float16 factor per row) */

/* How a PackedWeight stores its scales and zeros (repack.py's scale_format). */
enum { SCALE_F32 = 0, SCALE_F16 = 1, SCALE_SUPER = 2 };

/* A panel's quants (repack.py's quant_code): int8, 4-bit nibbles, MXFP4's e2m1 codes in q4 nibbles, 6-bit planes;
 * QUANT_F16 and QUANT_BF16 are no panels: 16-bit float rows [N, K] as stored (f16gemm_cpu.c). */
enum { QUANT_Q8 = 0, QUANT_Q4 = 1, QUANT_E2M1 = 2, QUANT_Q6 = 3, QUANT_F16 = 4, QUANT_BF16 = 5 };
#define Q6_BLOCK 96  /* q6 bytes of 8 elements of a panel: 64 of low nibbles, 32 of high bits */

/* q4: the 4 k-pair vectors of 4 elements (t = 0..3: k-pair 2c half 0, half 1, k-pair 2c + 1 half 0, half 1). */
static inline __attribute__((always_inline)) void q4_vectors(const uint8_t *b, __m256i v[4]) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)b), m = _mm256_set1_epi16(0x0f);
    v[0] = _mm256_and_si256(q, m);
    v[1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m);
    v[2] = _mm256_and_si256(_mm256_srli_epi16(q, 8), m);
    v[3] = _mm256_srli_epi16(q, 12);
}

/* q6: the 4 k-pair vectors of elements 4c..4c+3 (q4_vectors' order) as int16 weights: the nibble in bits 0-3, the
 * top 2 bits (shifted to the lane's top, then arithmetically down to bit 4: sign-extended) in bits 4-15. */
static inline __attribute__((always_inline)) void q6_vectors(const uint8_t *b, int c, __m256i v[4]) {
    const uint8_t *blk = b + (size_t)(c / 2) * Q6_BLOCK;
    q4_vectors(blk + 32 * (c & 1), v);
    const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 64 + 16 * (c & 1))));
    const __m256i lo = _mm256_set1_epi16(0x0f);
    const __m256i top[4] = {_mm256_slli_epi16(h, 14), _mm256_slli_epi16(h, 12), _mm256_slli_epi16(h, 10),
                            _mm256_slli_epi16(h, 8)};
    for (int t = 0; t < 4; t++) v[t] = _mm256_or_si256(v[t], _mm256_andnot_si256(lo, _mm256_srai_epi16(top[t], 10)));
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

/* Bytes of quants a panel takes (K elements per row) in layout quant (QUANT_*). */
static inline size_t panel_bytes(int quant, int K) {
    return (size_t)K * (quant == QUANT_Q8 ? 16 : quant == QUANT_Q6 ? 12 : 8);
}

/* SCALE_SUPER: the start of the super-block that holds group g (of ng, G weights each) of a panel's scales. */
static inline const uint8_t *super_block(const void *p, size_t panel, int ng, int G, int g) {
    const int gps = SUPER / G;  /* groups a super-block */
    const size_t per_block = 2 * PANEL + (size_t)gps * PANEL, per_panel = (size_t)(ng / gps) * per_block;
    return (const uint8_t *)p + panel * per_panel + (size_t)(g / gps) * per_block;
}

/* SCALE_SUPER: group g's 16 int8 multipliers in its super-block sb. */
static inline const int8_t *super_multipliers(const uint8_t *sb, int G, int g) {
    return (const int8_t *)(sb + 2 * PANEL + (size_t)(g % (SUPER / G)) * PANEL);
}

/* Panel row r's scale (or zero) of group g in format fmt: the scalar reference of panel_scales. */
static inline float panel_scale_at(const void *p, size_t panel, int ng, int G, int g, int r, int fmt) {
    if (fmt == SCALE_SUPER) {
        const uint8_t *sb = super_block(p, panel, ng, G, g);
        return _cvtsh_ss(((const uint16_t *)sb)[r]) * (float)super_multipliers(sb, G, g)[r];
    }
    const size_t i = (panel * ng + g) * PANEL + r;
    return fmt == SCALE_F16 ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Group g's 16 scales (or zeros) of a panel as two float32 vectors (rows 0-7, 8-15): panel_scale_at's values. */
static inline __attribute__((always_inline)) void panel_scales(const void *p, size_t panel, int ng, int G, int g,
                                                               int fmt, __m256 out[2]) {
    if (fmt == SCALE_SUPER) {
        const uint8_t *sb = super_block(p, panel, ng, G, g);
        const __m256i h = _mm256_loadu_si256((const __m256i *)sb);
        const __m128i m = _mm_loadu_si128((const __m128i *)super_multipliers(sb, G, g));
        out[0] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(m)));
        out[1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)),
                               _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(m, 8))));
        return;
    }
    const size_t i = (panel * ng + g) * PANEL;
    if (fmt == SCALE_F16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        out[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        out[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    } else {
        out[0] = _mm256_loadu_ps((const float *)p + i);
        out[1] = _mm256_loadu_ps((const float *)p + i + 8);
    }
}

#endif
