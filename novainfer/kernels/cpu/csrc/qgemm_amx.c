/* The many-row quantized GEMM's tiles on AMX (the tile matrix unit of Intel Xeons from Sapphire Rapids on), with
 * the bits of the AVX2 and AVX-512 VNNI tiles (qgemm_panel_cpu.c, qgemm_avx512.c).
 *
 * AMX multiplies bytes only, and the activations are int16 (quantize_rows). Each is split exactly into a signed
 * high byte and an unsigned low byte, x = 256 * hi + lo, so a group's integer sum is 256 * (hi . w) + (lo . w):
 * two tile products (TDPBSSD, TDPBUSD) give the very int32 the VNNI tiles' vpdpwssd gives, and the float
 * operations per group that follow are theirs, lane for lane. The weights (every layout fits a signed byte: q4
 * 0..15, q6 -32..31, e2m1 x2 -12..12, q8) go from the unpacked int16 k-pairs to AMX's 4-byte groups once per
 * panel. A tile is 16 activation rows x a panel's 16 outputs: per group of G weights, one A tile each of the high
 * and low bytes (16 x G bytes, stored tile by tile by split_rows_amx), one B tile of the panel (G/4 x 64 bytes),
 * two int32 C tiles stored to L1, then the group's scaling in AVX-512 into 16 float registers while the tiles of
 * the next group run. A chunk of AMX_PANELS panels is packed together and each tile of activations runs against
 * all of them, so the activations come from L1 (one panel at a time streamed them from beyond L2: 1.0-1.1x the
 * VNNI tiles, against 1.37x now at 512 rows, Q4_K 3584 x 1024, one thread of a 2-core Xeon VM).
 * Per group the work that does not shrink is the two C tile stores and the float scaling of 16 x 16 sums: so
 * Q6_K's groups of 16 stay on the VNNI tiles (0.8-0.95x there), as do fewer than 32 rows (qgemm_panel_cpu.c).
 */
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512dq,avx512vl")
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "panel_cpu.h"
#include "qgemm_jobs.h"

#define ARCH_REQ_XCOMP_PERM 0x1023  /* arch_prctl: ask Linux for a feature's register state (asm/prctl.h) */
#define XFEATURE_XTILEDATA 18

/* AMX-INT8 in the CPU, its tile state enabled by the OS (XCR0 bits 17-18), and this process allowed to use it
 * (Linux hands out the 8 KB tile state on request only). Asked once; the permission holds for every thread. */
int cpu_has_amx_int8(void) {
    static int has = -1;
    if (has >= 0) return has;
    unsigned a, b, c, d;
    int ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1);  /* AMX-TILE, AMX-INT8 */
    if (ok && __get_cpuid(1, &a, &b, &c, &d) && (c >> 27 & 1)) {  /* OSXSAVE: xgetbv runs */
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        ok = (lo >> 17 & 3) == 3;
    } else {
        ok = 0;
    }
    has = ok && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return has;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* Tile numbers (macros: the intrinsics paste them into the instruction). */
#define T_HI 0
#define T_LO 1
#define T_W 2
#define T_CHI 3
#define T_CLO 4
#define T_CHI2 5
#define T_CLO2 6

/* The tiles for groups of G weights: A (high, low bytes) 16 rows x G bytes, B G/4 rows x 64, C 16 x 16 int32. */
static void configure(int G) {
    tile_config cfg = {.palette = 1};
    cfg.rows[T_HI] = cfg.rows[T_LO] = 16;
    cfg.colsb[T_HI] = cfg.colsb[T_LO] = (uint16_t)G;
    cfg.rows[T_W] = (uint8_t)(G / 4);
    cfg.colsb[T_W] = 64;
    for (int t = T_CHI; t <= T_CLO2; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    /* not _tile_loadconfig: gcc 12's declares only the first 8 bytes read, and dropped the stores to the rest */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

/* The unpacked panel (wp: k-pair p's 16 rows x 2 weights at wp + 32p, int16) as AMX's B layout: k-quad q's 16 rows
 * x 4 signed bytes at wb + 64q. */
static void pack_panel(const int16_t *wp, int K, int8_t *wb) {
    static const int16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i idx = _mm512_loadu_si512(order);  /* row n: its k-pair 2q (word n), then 2q + 1 (word 16 + n) */
    for (int q = 0; q < K / 4; q++) {
        const __m256i a = _mm512_cvtepi16_epi8(_mm512_load_si512(wp + 64 * q));
        const __m256i b = _mm512_cvtepi16_epi8(_mm512_load_si512(wp + 64 * q + 32));
        _mm512_store_si512(wb + 64 * q, _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)));
    }
}

/* Rows [m0, m1) of xq split into high and low bytes in the order the tiles read them (xa, panel_job's). */
void split_rows_amx(const int16_t *xq, int m0, int m1, int K, int G, int8_t *xa) {
    const int ng = K / G;
    for (int m = m0; m < m1; m++)
        for (int g = 0; g < ng; g++) {
            int8_t *hi = xa + ((size_t)(m / 16) * ng + g) * 32 * G + (m % 16) * G, *lo = hi + 16 * G;
            for (int k = 0; k < G; k += 16) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(xq + (size_t)m * K + g * G + k));
                _mm_storeu_si128((__m128i *)(hi + k), _mm256_cvtepi16_epi8(_mm256_srai_epi16(v, 8)));
                _mm_storeu_si128((__m128i *)(lo + k), _mm256_cvtepi16_epi8(v));
            }
        }
}

static __thread int8_t *wbuf;
static __thread size_t wbuf_cap;

/* Group g's int32 sums (high bytes' in C tile ch, low bytes' in cl) stored to c[0..255], c[256..511]. */
#define GROUP_SUMS(g, ch, cl, c)                                     \
    do {                                                             \
        _tile_loadd(T_HI, xa + (size_t)(g) * 32 * G, G);             \
        _tile_loadd(T_LO, xa + (size_t)(g) * 32 * G + 16 * G, G);    \
        _tile_loadd(T_W, wb + (size_t)(g) * G * PANEL, 64);          \
        _tile_zero(ch);                                              \
        _tile_zero(cl);                                              \
        _tile_dpbssd(ch, T_HI, T_W);                                 \
        _tile_dpbusd(cl, T_LO, T_W);                                 \
        _tile_stored(ch, (c), 64);                                   \
        _tile_stored(cl, (c) + 256, 64);                             \
    } while (0)

/* f[r] += group g's sums c scaled, as the VNNI tiles do (256 * high + low is their int32): for row r,
 * f = fma(float(sum), s * dx[r], f), then with zeros f = fma(z, xsum[r], f). In assembly: gcc kept the 16 sums
 * in memory (a load and a store a row a group). */
#define ROW(r, t, u)                                                         \
    "vpslld $8, " #r "*64(%[c]), %%zmm" #t "\n\t"                              \
    "vpaddd 1024+" #r "*64(%[c]), %%zmm" #t ", %%zmm" #t "\n\t"                \
    "vcvtdq2ps %%zmm" #t ", %%zmm" #t "\n\t"                                   \
    "vmulps " #r "*4(%[dx])%{1to16%}, %[s], %%zmm" #u "\n\t"                   \
    "vfmadd231ps %%zmm" #u ", %%zmm" #t ", %[f" #r "]\n\t"
#define ZERO(r) "vfmadd231ps " #r "*4(%[xs])%{1to16%}, %[z], %[f" #r "]\n\t"
#define ROWS0(R) R(0, 28, 29) R(1, 30, 31) R(2, 28, 29) R(3, 30, 31) R(4, 28, 29) R(5, 30, 31) R(6, 28, 29) \
    R(7, 30, 31)
#define ROWS1(R) R(8, 28, 29) R(9, 30, 31) R(10, 28, 29) R(11, 30, 31) R(12, 28, 29) R(13, 30, 31)     \
    R(14, 28, 29) R(15, 30, 31)
#define ROWZ(r, t, u) ROW(r, t, u) ZERO(r)
#define F(r) [f##r] "+v"(f[r])
#define FS0 F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7)
#define FS1 F(8), F(9), F(10), F(11), F(12), F(13), F(14), F(15)
#define TMP "xmm28", "xmm29", "xmm30", "xmm31", "memory"
static inline __attribute__((always_inline)) void scale_group(const panel_job *j, const float *sp, const float *zp,
                                                              const float *xsT, int m0, int g, const int G,
                                                              const int32_t *c, __m512 f[16]) {
    const float *dx = j->dxT + (size_t)(g * G / 32) * j->mp + m0;
    const __m512 s = _mm512_load_ps(sp + g * PANEL);
    if (j->has_zeros) {
        const __m512 z = _mm512_load_ps(zp + g * PANEL);
        const float *xs = xsT + (size_t)g * j->mp + m0;
        __asm__(ROWS0(ROWZ) : FS0 : [c] "r"(c), [dx] "r"(dx), [xs] "r"(xs), [s] "v"(s), [z] "v"(z) : TMP);
        __asm__(ROWS1(ROWZ) : FS1 : [c] "r"(c), [dx] "r"(dx), [xs] "r"(xs), [s] "v"(s), [z] "v"(z) : TMP);
    } else {
        __asm__(ROWS0(ROW) : FS0 : [c] "r"(c), [dx] "r"(dx), [s] "v"(s) : TMP);
        __asm__(ROWS1(ROW) : FS1 : [c] "r"(c), [dx] "r"(dx), [s] "v"(s) : TMP);
    }
}
#undef ROW
#undef ZERO
#undef ROWS0
#undef ROWS1
#undef TMP
#undef ROWZ
#undef F
#undef FS0
#undef FS1

/* y[m0..m0+16, the panel's outputs] (rows past M computed, not stored) over the packed panel wb. The tiles of group
 * g + 1 run while the vector units scale group g's sums: two pairs of C tiles, two buffers c[0..511], c[512..]. */
static inline __attribute__((always_inline)) void tile_amx(const panel_job *j, const int8_t *wb, const float *sp,
                                                           const float *zp, int n0, int m0, const int G,
                                                           int32_t *c) {
    const int K = j->K, ng = K / G;
    const int8_t *xa = j->xa + (size_t)m0 * K * 2;  /* this tile's rows: its groups' high and low bytes */
    __m512 f[16];
    for (int r = 0; r < 16; r++) f[r] = _mm512_setzero_ps();
    GROUP_SUMS(0, T_CHI, T_CLO, c);
    for (int g = 1; g < ng; g++) {
        if (g & 1) GROUP_SUMS(g, T_CHI2, T_CLO2, c + 512);
        else GROUP_SUMS(g, T_CHI, T_CLO, c);
        scale_group(j, sp, zp, j->xsT, m0, g - 1, G, c + 512 * ((g - 1) & 1), f);
    }
    scale_group(j, sp, zp, j->xsT, m0, ng - 1, G, c + 512 * ((ng - 1) & 1), f);
    const int nr = j->N - n0 < PANEL ? j->N - n0 : PANEL, mr = j->M - m0 < 16 ? j->M - m0 : 16;
    const __mmask16 keep = (__mmask16)((1u << nr) - 1);
    for (int r = 0; r < mr; r++) _mm512_mask_storeu_ps(j->y + (size_t)(m0 + r) * j->N + n0, keep, f[r]);
}
#undef GROUP_SUMS

int panel_rows_amx(const panel_job *j, int p0, int p1) {
    const int K = j->K, np = p1 - p0;
    const size_t wbytes = (size_t)K * PANEL, fbytes = sizeof(float) * PANEL * (size_t)j->ng;
    const size_t need = (size_t)np * (wbytes + 2 * fbytes) + 2 * wbytes + 4 * 256 * sizeof(int32_t);
    if (need > wbuf_cap) {
        free(wbuf);
        wbuf = aligned_alloc(64, (need + 63) / 64 * 64);
        wbuf_cap = wbuf ? need : 0;
        if (!wbuf) return -1;
    }
    /* K * 16 and 64 * ng are multiples of 64 bytes: every part stays aligned */
    int8_t *wb = wbuf;
    float *sp = (float *)(wb + (size_t)np * wbytes), *zp = sp + (size_t)np * PANEL * j->ng;
    int16_t *wp = (int16_t *)(zp + (size_t)np * PANEL * j->ng);
    int32_t *c = (int32_t *)((int8_t *)wp + 2 * wbytes);
    for (int i = 0; i < np; i++) {
        unpack_panel(j, p0 + i, wp, sp + (size_t)i * PANEL * j->ng, zp + (size_t)i * PANEL * j->ng);
        pack_panel(wp, K, wb + (size_t)i * wbytes);
    }
    configure(j->G);  /* per call: other code on this thread (oneDNN) may have configured or released the tiles */
    for (int m0 = 0; m0 < j->M; m0 += 16)  /* the tile's activations stay in L1 across the chunk's panels */
        for (int i = 0; i < np; i++) {
            const int8_t *w = wb + (size_t)i * wbytes;
            const float *s = sp + (size_t)i * PANEL * j->ng, *z = zp + (size_t)i * PANEL * j->ng;
            if (j->G == 32) tile_amx(j, w, s, z, (p0 + i) * PANEL, m0, 32, c);
            else tile_amx(j, w, s, z, (p0 + i) * PANEL, m0, 16, c);
        }
    _tile_release();
    return 0;
}
