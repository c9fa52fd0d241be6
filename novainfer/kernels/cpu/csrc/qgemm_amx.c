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
 * VNNI tiles, against 1.37x with the chunks, and 1.45-1.75x with the group loop in assembly (tile_amx), at 512
 * rows, Q4_K 3584 x 1024, 1024 x 3584, 12288 x 1536, one thread of a 2-core Xeon VM). Groups of 32 only.
 * Per group the work that does not shrink is the two C tile stores and the float scaling of 16 x 16 sums: so
 * Q6_K's groups of 16 stay on the VNNI tiles (0.8-0.95x there in C; 1.02x with this file's assembly loop taking
 * groups of 16, Q6_K 1536 x 6144, same bits: not worth the second loop), as do fewer than 32 rows (qgemm_panel_cpu.c).
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

/* A tile of 16 rows x a panel's 16 outputs over all K / 32 groups, as one assembly block (in C, gcc kept the 16
 * sums on the stack, a store and a load of each a group, and its loop bookkeeping in vector registers: 1.4x the
 * time). Per group g: its tile products (high bytes TDPBSSD, low bytes TDPBUSD) into one of two C tile pairs; then
 * the scaling of group g - 1's sums, stored the group before, in AVX-512 while the products run; then group g's
 * sums stored (a tile store waits for its product). A group's scaling is the VNNI tiles' op for op: for row r,
 * f = fma(float(256 * high + low), s * dx[r], f), then with zeros f = fma(z, xsum[r], f).
 * Registers: zmm0-15 the sums f (row r in zmm r), zmm30 s, zmm31 z, zmm18-29 temporaries; tmm0, tmm1 A (high,
 * low bytes), tmm2 B, tmm3-4 and tmm5-6 the C pairs, stored to c (+0) and c + 2048 bytes (high, then low +1024). */
#define SROW(r, t, u, cb)                                                     \
    "vpslld $8, " #cb "+" #r "*64(%[c]), %%zmm" #t "\n\t"                       \
    "vpaddd " #cb "+1024+" #r "*64(%[c]), %%zmm" #t ", %%zmm" #t "\n\t"         \
    "vcvtdq2ps %%zmm" #t ", %%zmm" #t "\n\t"                                    \
    "vmulps " #r "*4(%[dx])%{1to16%}, %%zmm30, %%zmm" #u "\n\t"                 \
    "vfmadd231ps %%zmm" #u ", %%zmm" #t ", %%zmm" #r "\n\t"
#define SROWZ(r, t, u, cb) SROW(r, t, u, cb) "vfmadd231ps " #r "*4(%[xs])%{1to16%}, %%zmm31, %%zmm" #r "\n\t"
#define ROWS16(R, cb)                                                                                        \
    R(0, 18, 19, cb) R(1, 20, 21, cb) R(2, 22, 23, cb) R(3, 24, 25, cb) R(4, 26, 27, cb) R(5, 28, 29, cb)    \
    R(6, 18, 19, cb) R(7, 20, 21, cb) R(8, 22, 23, cb) R(9, 24, 25, cb) R(10, 26, 27, cb) R(11, 28, 29, cb)  \
    R(12, 18, 19, cb) R(13, 20, 21, cb) R(14, 22, 23, cb) R(15, 24, 25, cb)
#define SCALE_Z(cb)                                                                               \
    "vmovaps (%[sp]), %%zmm30\n\tvmovaps (%[zp]), %%zmm31\n\t" ROWS16(SROWZ, cb)                    \
    "add $64, %[sp]\n\tadd $64, %[zp]\n\tadd %[mpb], %[dx]\n\tadd %[mpb], %[xs]\n\t"
#define SCALE_N(cb) "vmovaps (%[sp]), %%zmm30\n\t" ROWS16(SROW, cb) "add $64, %[sp]\n\tadd %[mpb], %[dx]\n\t"
#define PRODUCTS(ch, cl)                                                          \
    "tileloadd (%[xa],%[s32],1), %%tmm0\n\t"                                       \
    "tileloadd 512(%[xa],%[s32],1), %%tmm1\n\t"                                    \
    "tileloadd (%[wb],%[s64],1), %%tmm2\n\t"                                       \
    "tilezero %%tmm" #ch "\n\ttilezero %%tmm" #cl "\n\t"                           \
    "tdpbssd %%tmm2, %%tmm0, %%tmm" #ch "\n\ttdpbusd %%tmm2, %%tmm1, %%tmm" #cl "\n\t" \
    "add $1024, %[xa]\n\tadd $512, %[wb]\n\t"
#define STORE(ch, cl, cb) \
    "tilestored %%tmm" #ch ", " #cb "(%[c],%[s64],1)\n\ttilestored %%tmm" #cl ", " #cb "+1024(%[c],%[s64],1)\n\t"
#define ZERO_F(r) "vpxord %%zmm" #r ", %%zmm" #r ", %%zmm" #r "\n\t"
#define OUT_F(r) "vmovaps %%zmm" #r ", " #r "*64(%[out])\n\t"
#define EACH16(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)
/* buffer 0 holds the newest stored group while n groups remain: two a turn, then the odd one out */
#define GROUP_LOOP(SCALE)                                                                   \
    EACH16(ZERO_F) PRODUCTS(3, 4) STORE(3, 4, 0)                                            \
    "1:\n\tcmp $2, %[n]\n\tjl 2f\n\t"                                                       \
    PRODUCTS(5, 6) SCALE(0) STORE(5, 6, 2048) PRODUCTS(3, 4) SCALE(2048) STORE(3, 4, 0)      \
    "sub $2, %[n]\n\tjmp 1b\n"                                                              \
    "2:\n\ttest %[n], %[n]\n\tjz 3f\n\t"                                                    \
    PRODUCTS(5, 6) SCALE(0) STORE(5, 6, 2048) SCALE(2048) "jmp 4f\n"                        \
    "3:\n\t" SCALE(0) "4:\n\t" EACH16(OUT_F)

/* y[m0..m0+16, the panel's outputs] (rows past M computed, not stored) over the packed panel wb (groups of 32). */
static void tile_amx(const panel_job *j, const int8_t *wb, const float *sp, const float *zp, int n0, int m0,
                     int32_t *c) {
    const int8_t *xa = j->xa + (size_t)m0 * j->K * 2;  /* this tile's rows: its groups' high and low bytes */
    const float *dx = j->dxT + m0, *xs = j->has_zeros ? j->xsT + m0 : dx;
    long n = j->K / 32 - 1;  /* groups after the first */
    const long s32 = 32, s64 = 64, mpb = (long)j->mp * (long)sizeof(float);
    float out[256] __attribute__((aligned(64)));
#define OPERANDS                                                                                            \
    : [xa] "+r"(xa), [wb] "+r"(wb), [sp] "+r"(sp), [zp] "+r"(zp), [dx] "+r"(dx), [xs] "+r"(xs), [n] "+r"(n) \
    : [c] "r"(c), [out] "r"(out), [s32] "r"(s32), [s64] "r"(s64), [mpb] "r"(mpb)                           \
    : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",       \
      "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22",      \
      "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31", "memory", "cc"
    if (j->has_zeros) __asm__ volatile(GROUP_LOOP(SCALE_Z) OPERANDS);
    else __asm__ volatile(GROUP_LOOP(SCALE_N) OPERANDS);
#undef OPERANDS
    const int nr = j->N - n0 < PANEL ? j->N - n0 : PANEL, mr = j->M - m0 < 16 ? j->M - m0 : 16;
    const __mmask16 keep = (__mmask16)((1u << nr) - 1);
    for (int r = 0; r < mr; r++) _mm512_mask_storeu_ps(j->y + (size_t)(m0 + r) * j->N + n0, keep, _mm512_load_ps(out + 16 * r));
}
#undef SROW
#undef SROWZ
#undef ROWS16
#undef SCALE_Z
#undef SCALE_N
#undef PRODUCTS
#undef STORE
#undef ZERO_F
#undef OUT_F
#undef EACH16
#undef GROUP_LOOP

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
            tile_amx(j, w, s, z, (p0 + i) * PANEL, m0, c);
        }
    _tile_release();
    return 0;
}
