/* The many-row GEMM's tiles for CPUs with AVX-512 VNNI (qgemm_panel_cpu.c picks them where the CPU has it).
 *
 * A k-pair of the unpacked panel (panel_cpu.h's two vectors, rows 0-7 and 8-15) is one 512-bit register, so one
 * vpdpwssd (madd and add in one) takes an activation row's k-pair, broadcast from memory, against all 16
 * outputs: a quarter of the AVX2 tile's instructions per multiply. A tile is up to NT of xt's interleaved
 * groups of PMR rows; each output's integer sums are exact and its float operations per group are those of
 * the AVX2 tiles, lane for lane, so every row gets the same bits from either ISA (and from the few-row kernel).
 */
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "panel_cpu.h"
#include "qgemm_panel_cpu.h"

#ifndef NT
#define NT 3  /* groups of PMR rows a tile: NT * PMR int32 accumulators and as many float sums in registers */
#endif

int cpu_has_avx512_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}

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
    __m512i a20 = zero, a21 = zero, a22 = zero, a23 = zero, a30 = zero, a31 = zero, a32 = zero, a33 = zero;
    const int32_t *x0 = x, *x1 = x + ts, *x2 = x + 2 * ts, *x3 = x + 3 * ts;
    for (int p = 0; p < n; p++, w++, x0 += PMR, x1 += PMR, x2 += PMR, x3 += PMR) {
        if (nt == 1)
            __asm__(LOADW ROWS(0) : ACC(0) : [w] "r"(w), [x0] "r"(x0) : "xmm31");
        else if (nt == 2)
            __asm__(LOADW ROWS(0) ROWS(1) : ACC(0), ACC(1) : [w] "r"(w), [x0] "r"(x0), [x1] "r"(x1) : "xmm31");
        else if (nt == 3)
            __asm__(LOADW ROWS(0) ROWS(1) ROWS(2) : ACC(0), ACC(1), ACC(2)
                    : [w] "r"(w), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2) : "xmm31");
        else {  /* two statements: an asm takes at most 30 operands, and each "+v" counts twice */
            __asm__(LOADW ROWS(0) ROWS(1) : ACC(0), ACC(1) : [w] "r"(w), [x0] "r"(x0), [x1] "r"(x1) : "xmm31");
            __asm__(LOADW ROWS(2) ROWS(3) : ACC(2), ACC(3) : [w] "r"(w), [x2] "r"(x2), [x3] "r"(x3) : "xmm31");
        }
    }
    OUT(0)
    if (nt > 1) { OUT(1) }
    if (nt > 2) { OUT(2) }
#if NT == 4
    if (nt > 3) { OUT(3) }
#endif
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
#if NT == 4
        else if (nt == 4) T(4, mr);
#elif NT != 3
#error "NT must be 3 or 4"
#endif
        else if (nt == 3) T(3, mr);
        else if (nt == 2) T(2, mr);
        else T(1, mr);
#undef T
    }
}
