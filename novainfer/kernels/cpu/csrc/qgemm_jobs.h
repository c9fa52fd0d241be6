/* The jobs of the two quantized GEMMs (qgemm_cpu.c: few rows; qgemm_panel_cpu.c: many), shared by their AVX2
 * tiles and their AVX-512 VNNI tiles (qgemm_avx512.c), which read the same data and give every output the same
 * bits. quant: the panel layout of the weights (panel_cpu.h's QUANT_*; QUANT_E2M1: the q4 nibbles are MXFP4 codes,
 * read through E2M1_X2 instead of as 0..15). */
#ifndef NOVAINFER_QGEMM_JOBS_H
#define NOVAINFER_QGEMM_JOBS_H

#include <immintrin.h>
#include <stdint.h>

#include "panel_cpu.h"

#define MB 4  /* activation rows a few-row tile */
#ifndef PMR
#define PMR 4  /* activation rows a group of the panel kernel's interleaved xt */
#endif

typedef struct {
    const int16_t *xq; const float *dxT, *xsum; int M, K, G, N, ng, ngp, mp;
    const void *w; const void *scales, *zeros; int has_zeros, quant, scale_fmt, npanels, nchunks, avx512, nthreads;
    _Atomic int failed;
    float *y;
} gemm_job;

typedef struct {
    const float *x; int16_t *xq; int32_t *xt; float *dxT, *xsum; int M, K, G, N, ng, ngp, mp;
    /* AMX (qgemm_amx.c): xq's signed high and unsigned low bytes, per tile of 16 rows and group of G: the 16
     * rows' G high bytes, then their low bytes (a tile each, contiguous); rows past M zero */
    int8_t *xa;
    float *xsT;  /* and xsum transposed [ngp, mp] (a tile's 16 rows side by side) */
    const void *w; const void *scales, *zeros; int has_zeros, quant, scale_fmt, npanels, nchunks, avx512, amx;
    _Atomic int failed;
    float *y;
} panel_job;

/* Few rows: each group of a panel requests the panel's bytes this far on. One activation row's tile streams from
 * DRAM, and the hardware prefetchers alone left it slower: on Zen 4 (AVX-512 tiles) the q6 LM head of 248320 x 1024
 * at M = 1 5.87 ms against 6.12, Q4_K 1024 x 3584 x 24 copies 32 -> 40 GB/s (M = 2 as much); 2048 and 8192 bytes
 * did as well or a little less well. */
#define WEIGHTS_AHEAD 4096

/* The cache lines of group g of a few-row tile's panel wb (q6: 3, q4: G / 8, q8: G / 4) WEIGHTS_AHEAD bytes on (a
 * prefetch faults on nothing past the end); the loads and the sums are untouched. */
static inline __attribute__((always_inline)) void prefetch_group(const uint8_t *wb, int g, int G, int quant) {
    const int gbytes = quant == QUANT_Q6 ? G * 12 : quant == QUANT_Q8 ? G * 16 : G * 8;
    const char *ahead = (const char *)wb + (size_t)g * gbytes + WEIGHTS_AHEAD;
    for (int l = 0; l < gbytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
}

/* x [M, K] rounded per row in blocks of 32 (quantize_rows_cpu.c): xq int16 [M, K], dxT [K/32, mp] (steps), xsum
 * [M, ngp] (sums of xq * dx per group of G, when xsum_needed). */
void quantize_rows(const float *x, int M, int K, int G, int mp, int ngp, int16_t *xq, float *dxT, float *xsum,
                   int xsum_needed);

/* 1 when the GEMMs run their AVX-512 VNNI tiles (the default where the CPU has them), else 0 (AVX2). */
int gemm_isa_avx512(void);

/* 1 when the panel GEMM runs its AMX tiles (the default where the CPU and the OS allow them), else 0. */
int gemm_isa_amx(void);

/* AMX-INT8 usable by this process (the tile state requested from Linux on the first call). */
int cpu_has_amx_int8(void);

/* Rows [m0, m1) of xq [., K] split into signed high and unsigned low bytes (x = 256 * hi + lo), stored as xa. */
void split_rows_amx(const int16_t *xq, int m0, int m1, int K, int G, int8_t *xa);

/* AMX: panels a chunk (unpacked together; each tile of activations then runs against all of them from L1). */
#define AMX_PANELS 8

/* Panel pnl unpacked: quants to int16 k-pair vectors wp [K/2][16][2], scales and zeros to float32 [ng][16]. */
void unpack_panel(const panel_job *j, int pnl, int16_t *wp, float *sp, float *zp);

/* Every activation row of j against panels [p0, p1) on AMX (j->xa); -1 when its scratch cannot be had. */
int panel_rows_amx(const panel_job *j, int p0, int p1);

/* Every activation row of j against panel pnl (the few-row kernel's, unpacking in registers). */
void few_rows_avx512(const gemm_job *j, int pnl);

/* Every activation row of j against panel pnl, unpacked (wp [K/2][16][2] int16, sp/zp [ng][16] float32). */
void panel_rows_avx512(const panel_job *j, const int16_t *wp, const float *sp, const float *zp, int pnl);

#endif
