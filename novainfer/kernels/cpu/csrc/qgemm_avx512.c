/* The quantized GEMMs' tiles for CPUs with AVX-512 VNNI (qgemm_cpu.c and qgemm_panel_cpu.c run them where the
 * CPU has them; set_gemm_isa switches). vpdpwssd is a madd and an add in one instruction over 16 int32 lanes,
 * so a 512-bit register covers a panel's 16 outputs (or two k-pairs of 8) where AVX2 needs four instructions.
 * Each output's integer sums per group are exact and its float operations per group are those of the AVX2
 * tiles, lane for lane, so every row gets the same bits from either ISA and from either kernel.
 *
 * Many rows (panel_rows_avx512): a k-pair of the unpacked panel (panel_cpu.h's two vectors, rows 0-7 and 8-15)
 * is one register, against an activation row's k-pair broadcast from memory; a tile is up to NT of xt's
 * interleaved groups of PMR rows, all accumulators in registers.
 * Few rows (few_rows_avx512): 64 bytes of the panel layout hold two k-pairs' vectors side by side (one per
 * 256-bit half), so each half takes its own k-pair of the activations (a permute of 4 k-pairs) and the halves
 * are added once per group.
 */
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
#include <immintrin.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "panel_cpu.h"
#include "qgemm_jobs.h"

/* Groups of PMR rows a tile: NT * PMR int32 accumulators and as many float sums in registers (4 groups, in two
 * asm statements since one takes at most 30 operands and each "+v" counts twice, were no faster). */
#define NT 3

static int cpu_has_avx512_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}

static _Atomic int gemm_isa = -1;  /* 2 AMX (many-row tiles; AVX-512 VNNI for the rest), 1 AVX-512 VNNI, 0 AVX2 */

/* Picks the GEMMs' tiles (isa: 2 AMX, 1 AVX-512 VNNI, 0 AVX2, -1 the best the CPU runs), capped at what the CPU
 * runs; returns what is used. All give the same bits; tests and benchmarks switch them. */
int set_gemm_isa(int isa) {
    const int has = cpu_has_avx512_vnni() ? 1 + cpu_has_amx_int8() : 0;
    gemm_isa = isa < 0 || isa > has ? has : isa;
    return gemm_isa;
}

static int current_isa(void) {
    const int v = gemm_isa;
    return v < 0 ? set_gemm_isa(-1) : v;
}

int gemm_isa_avx512(void) { return current_isa() >= 1; }

int gemm_isa_amx(void) { return current_isa() == 2; }

/* a[r] = the int32 dot products of n k-pairs: panel vectors w times row r's k-pair (xt's groups ts apart), for
 * nt groups. In assembly: gcc's intrinsics version shuffled the accumulators between registers every k-pair. */
#define ROW(t, m) "vpdpwssd " #m "*4(%[x" #t "])%{1to16%}, %%zmm31, %[a" #t #m "]\n\t"
#define ROWS(t) ROW(t, 0) ROW(t, 1) ROW(t, 2) ROW(t, 3)
#define ACC(t) [a##t##0] "+v"(a##t##0), [a##t##1] "+v"(a##t##1), [a##t##2] "+v"(a##t##2), [a##t##3] "+v"(a##t##3)
#define OUT(t) a[4 * t] = a##t##0; a[4 * t + 1] = a##t##1; a[4 * t + 2] = a##t##2; a[4 * t + 3] = a##t##3;
#define LOADW "vmovdqa64 (%[w]), %%zmm31\n\t"
static inline __attribute__((always_inline)) void kpairs512(const __m512i *w, const int32_t *x, size_t ts, const int n,
                                                            const int nt, __m512i a[NT * PMR]) {
    const __m512i zero = _mm512_setzero_si512();
    __m512i a00 = zero, a01 = zero, a02 = zero, a03 = zero, a10 = zero, a11 = zero, a12 = zero, a13 = zero;
    __m512i a20 = zero, a21 = zero, a22 = zero, a23 = zero;
    const int32_t *x0 = x, *x1 = x + ts, *x2 = x + 2 * ts;  /* (the groups past nt are never read) */
    for (int p = 0; p < n; p++, w++, x0 += PMR, x1 += PMR, x2 += PMR) {
        if (nt == 1)
            __asm__(LOADW ROWS(0) : ACC(0) : [w] "r"(w), [x0] "r"(x0) : "xmm31");
        else if (nt == 2)
            __asm__(LOADW ROWS(0) ROWS(1) : ACC(0), ACC(1) : [w] "r"(w), [x0] "r"(x0), [x1] "r"(x1) : "xmm31");
        else
            __asm__(LOADW ROWS(0) ROWS(1) ROWS(2) : ACC(0), ACC(1), ACC(2)
                    : [w] "r"(w), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2) : "xmm31");
    }
    OUT(0)
    if (nt > 1) { OUT(1) }
    if (nt > 2) { OUT(2) }
}
#undef ROW
#undef ROWS
#undef ACC
#undef OUT
#undef LOADW

/* y[m0..m0+mr, n0..] from the unpacked panel: nt groups of xt's rows (mr of them real). */
static inline __attribute__((always_inline)) void tile512(const panel_job *j, const int16_t *wp, const float *sp,
                                                          const float *zp, int n0, int m0, const int nt, const int mr,
                                                          const int G) {
    const int K = j->K;
    const size_t ts = (size_t)(K / 2) * PMR;
    const int32_t *xt = j->xt + (size_t)(m0 / PMR) * ts;
    const __m512i *wv = (const __m512i *)wp;
    __m512 f[NT * PMR];
    for (int r = 0; r < mr; r++) f[r] = _mm512_setzero_ps();
    for (int g = 0; g < K / G; g++) {
        __m512i a[NT * PMR];
        const int p0 = g * G / 2;
        kpairs512(wv + p0, xt + (size_t)p0 * PMR, ts, G / 2, nt, a);
        const float *dx = j->dxT + (size_t)(g * G / 32) * j->mp + m0;
        const __m512 s = _mm512_load_ps(sp + g * PANEL), z = _mm512_load_ps(zp + g * PANEL);
        for (int r = 0; r < mr; r++) {
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r]), _mm512_mul_ps(s, _mm512_set1_ps(dx[r])), f[r]);
            if (j->has_zeros) f[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(j->xsum[(size_t)(m0 + r) * j->ngp + g]), f[r]);
        }
    }
    const int nr = j->N - n0 < PANEL ? j->N - n0 : PANEL;
    const __mmask16 keep = (__mmask16)((1u << nr) - 1);
    for (int r = 0; r < mr; r++) _mm512_mask_storeu_ps(j->y + (size_t)(m0 + r) * j->N + n0, keep, f[r]);
}

void panel_rows_avx512(const panel_job *j, const int16_t *wp, const float *sp, const float *zp, int pnl) {
    const int n0 = pnl * PANEL;
    for (int m0 = 0; m0 < j->M; m0 += NT * PMR) {
        const int mr = j->M - m0 < NT * PMR ? j->M - m0 : NT * PMR;
#define T(NTILES, MR) do { if (j->G == 32) tile512(j, wp, sp, zp, n0, m0, NTILES, MR, 32);   \
                           else tile512(j, wp, sp, zp, n0, m0, NTILES, MR, 16); } while (0)
        const int nt = (mr + PMR - 1) / PMR;
        if (mr == NT * PMR) T(NT, NT * PMR);
        else if (nt == 3) T(3, mr);
        else if (nt == 2) T(2, mr);
        else T(1, mr);
#undef T
    }
}

/* Group g's 16 scales (or zeros) of a panel: panel_cpu.h's panel_scales (panel_scale_at's values) in one register. */
static inline __attribute__((always_inline)) __m512 group_scales(const void *p, size_t panel, int ng, int G, int g,
                                                                 int fmt) {
    if (fmt == SCALE_SUPER) {
        const uint8_t *sb = super_block(p, panel, ng, G, g);
        const __m128i m = _mm_loadu_si128((const __m128i *)super_multipliers(sb, G, g));
        return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb)),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(m)));
    }
    const size_t i = (panel * ng + g) * PANEL;
    return fmt == SCALE_F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                            : _mm512_loadu_ps((const float *)p + i);
}

/* x4: 4 k-pairs of an activation row; the even pair (0, 2) or odd pair (1, 3), each over one 256-bit half. */
static inline __attribute__((always_inline)) __m512i halves(__m512i x4, int odd) {
    return _mm512_permutexvar_epi32(odd ? _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1)
                                        : _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0), x4);
}

/* y[m0..m0+mr, the panel's outputs], as qgemm_cpu.c's tile(): a[m][h] gathers panel half h's rows, k-pair p's
 * products in lanes 0-7 and k-pair p + 2 (q4) or p + 1 (q8)'s in lanes 8-15 (summed per group). */
static inline __attribute__((always_inline)) void few_tile512(const gemm_job *j, int panel, int m0, const int mr,
                                                              const int G, const int quant) {
    const int K = j->K, ng = j->ng;
    const int16_t *xq = j->xq + (size_t)m0 * K;
    const uint8_t *wb = (const uint8_t *)j->w + (size_t)panel * panel_bytes(j->quant, K);
    __m512 f[MB];
    for (int m = 0; m < mr; m++) f[m] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m512i a[MB][2];
        for (int m = 0; m < mr; m++) a[m][0] = a[m][1] = _mm512_setzero_si512();
        prefetch_group(wb, g, G, quant);
        for (int p = g * G / 2; p < (g + 1) * G / 2; p += 4) {  /* 4 k-pairs: 64 bytes of q4, 96 of q6, 128 of q8 */
            __m512i v[4];
            if (quant != QUANT_Q8) {  /* panel_cpu.h: blocks p/2 and p/2 + 1; nibble t: k-pair + t/2, half t%2 */
                const uint8_t *b = quant == QUANT_Q6 ? wb + (size_t)(p / 4) * Q6_BLOCK : wb + (size_t)p * 16;
                const __m512i q = _mm512_loadu_si512(b), lo = _mm512_set1_epi16(0x0f);
                const __m512i nib[4] = {q, _mm512_srli_epi16(q, 4), _mm512_srli_epi16(q, 8),
                                        _mm512_srli_epi16(q, 12)};
                if (quant == QUANT_Q6) {  /* panel_cpu.h's q6_vectors: bits 0-3 from the nibble (a select), 4-15 the
                                           * sign-extended top 2 bits of both blocks' lanes */
                    const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64)));
                    const __m512i top[4] = {_mm512_slli_epi16(h, 14), _mm512_slli_epi16(h, 12),
                                            _mm512_slli_epi16(h, 10), _mm512_slli_epi16(h, 8)};
                    for (int t = 0; t < 4; t++)
                        v[t] = _mm512_ternarylogic_epi32(nib[t], _mm512_srai_epi16(top[t], 10), lo, 0xE4);
                } else {
                    for (int t = 0; t < 3; t++) v[t] = _mm512_and_si512(nib[t], lo);
                    v[3] = nib[3];
                }
                if (j->quant == QUANT_E2M1) {  /* the codes' doubled values (panel_cpu.h), one word permute each */
                    const __m512i t = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -12, -8, -6,
                                                       -4, -3, -2, -1, 0, 12, 8, 6, 4, 3, 2, 1, 0);
                    for (int i = 0; i < 4; i++) v[i] = _mm512_permutexvar_epi16(v[i], t);
                }
            } else {  /* k-pairs p, p + 1 then p + 2, p + 3: low byte half 0, high byte half 1 */
                const uint8_t *b = wb + (size_t)p * 32;
                const __m512i q0 = _mm512_loadu_si512(b), q1 = _mm512_loadu_si512(b + 64);
                v[0] = _mm512_srai_epi16(_mm512_slli_epi16(q0, 8), 8);
                v[1] = _mm512_srai_epi16(q0, 8);
                v[2] = _mm512_srai_epi16(_mm512_slli_epi16(q1, 8), 8);
                v[3] = _mm512_srai_epi16(q1, 8);
            }
            for (int m = 0; m < mr; m++) {
                const __m128i *xp = (const __m128i *)(xq + (size_t)m * K + 2 * p);
                const __m512i x4 = _mm512_broadcast_i32x4(_mm_loadu_si128(xp));
                /* q4, q6: v[0..1] take k-pairs (p, p + 2), v[2..3] (p + 1, p + 3); q8: (p, p + 1) then (p + 2, p + 3) */
                const __m512i x01 = quant != QUANT_Q8 ? halves(x4, 0) : _mm512_permutexvar_epi32(
                    _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), x4);
                const __m512i x23 = quant != QUANT_Q8 ? halves(x4, 1) : _mm512_permutexvar_epi32(
                    _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2), x4);
                a[m][0] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(a[m][0], v[0], x01), v[2], x23);
                a[m][1] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(a[m][1], v[1], x01), v[3], x23);
            }
        }
        const __m512 s = group_scales(j->scales, panel, ng, G, g, j->scale_fmt);
        const __m512 z = j->has_zeros ? group_scales(j->zeros, panel, ng, G, g, j->scale_fmt) : _mm512_setzero_ps();
        const float *dx = j->dxT + (size_t)(g * G / 32) * j->mp + m0;
        for (int m = 0; m < mr; m++) {  /* lanes 0-7: half 0's rows (0-7), 8-15: half 1's (8-15) */
            const __m512i sum = _mm512_add_epi32(_mm512_shuffle_i64x2(a[m][0], a[m][1], 0x44),
                                                 _mm512_shuffle_i64x2(a[m][0], a[m][1], 0xEE));
            f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s, _mm512_set1_ps(dx[m])), f[m]);
            if (j->has_zeros) f[m] = _mm512_fmadd_ps(z, _mm512_set1_ps(j->xsum[(size_t)(m0 + m) * j->ngp + g]), f[m]);
        }
    }
    const int n0 = panel * PANEL, nr = j->N - n0 < PANEL ? j->N - n0 : PANEL;
    const __mmask16 keep = (__mmask16)((1u << nr) - 1);
    for (int m = 0; m < mr; m++) _mm512_mask_storeu_ps(j->y + (size_t)(m0 + m) * j->N + n0, keep, f[m]);
}

void few_rows_avx512(const gemm_job *j, int panel) {
    for (int m0 = 0; m0 < j->M; m0 += MB) {
        const int mr = j->M - m0 < MB ? j->M - m0 : MB;
#define TILE(MR) do {                                                         \
            if (j->quant == QUANT_Q4 || j->quant == QUANT_E2M1) few_tile512(j, panel, m0, MR, 32, QUANT_Q4); \
            else if (j->quant == QUANT_Q6) few_tile512(j, panel, m0, MR, 16, QUANT_Q6); \
            else if (j->G == 32) few_tile512(j, panel, m0, MR, 32, QUANT_Q8); \
            else few_tile512(j, panel, m0, MR, 16, QUANT_Q8);                 \
        } while (0)
        if (mr == 4) TILE(4); else if (mr == 3) TILE(3); else if (mr == 2) TILE(2); else TILE(1);
#undef TILE
    }
}
