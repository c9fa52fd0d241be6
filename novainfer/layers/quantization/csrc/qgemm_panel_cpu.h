/* The many-row GEMM's job (qgemm_panel_cpu.c) and its AVX-512 VNNI tiles (qgemm_panel_avx512.c), which read the
 * same unpacked panel and interleaved activations as the AVX2 tiles and give every output the same bits. */
#ifndef NOVAINFER_QGEMM_PANEL_CPU_H
#define NOVAINFER_QGEMM_PANEL_CPU_H

#include <stdint.h>

#ifndef PMR
#define PMR 4  /* activation rows a tile of xt interleaves */
#endif

typedef struct {
    const float *x; int16_t *xq; int32_t *xt; float *dxT, *xsum; int M, K, G, N, ng, ngp, mp;
    const void *w; const void *scales, *zeros; int has_zeros, q4, scale_f16, npanels, nchunks;
    _Atomic int failed;
    float *y;
} panel_job;

/* 1 where the CPU (and the OS) run AVX-512 VNNI, else 0. */
int cpu_has_avx512_vnni(void);

/* Every activation row of j against panel pnl, unpacked (wp [K/2][16][2] int16, sp/zp [ng][16] float32). */
void panel_rows_avx512(const panel_job *j, const int16_t *wp, const float *sp, const float *zp, int pnl);

#endif
