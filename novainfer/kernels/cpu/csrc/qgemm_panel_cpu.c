/* Many-row (prefill) quantized GEMM for AVX2: y[M,N] = x[M,K] @ dequant(W)[N,K]^T with the same int16
 * activations as qgemm_cpu.c (quantize_rows: per row, blocks of 32, step max|x| / 32767), so the model's
 * accuracy is that of the few-row kernel.
 *
 * Both kernels read the panel layout of panel_cpu.h and broadcast each activation row's k-pair against a panel's
 * k-pair vectors (one madd: 8 outputs' partial sums, no reduction). The few-row kernel unpacks the quants in
 * registers for every tile of rows; this one unpacks a panel once to int16 [K/2][16][2] in scratch and runs
 * tiles of PMR activation rows x 16 outputs over it, 2 * PMR int32 accumulators in registers, the activations'
 * k-pairs interleaved per tile so the micro-kernel broadcasts them at constant offsets. Per group of G weights
 * the integer sums are scaled in float (weight scale * activation step) and the zero-point term (zero * the
 * group's sum of the rounded x) is added, as in the few-row kernel (the same bits). Panels are split over the
 * worker pool (cpu_pool.c). It beats dequantizing the weight to float32 for BLAS sgemm past about 64 rows
 * (benchmarks/qgemm_rows.py --prefill) and the few-row kernel from about 16 (--crossover). Where the CPU has
 * AVX-512 VNNI, the tiles of qgemm_avx512.c run instead (2x on a Sapphire Rapids core; the same bits), and where
 * it has AMX-INT8 those of qgemm_amx.c for groups of 32 from 32 rows (1.1-1.4x the VNNI tiles; the same bits).
 */
#include <immintrin.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_pool.h"
#include "panel_cpu.h"
#include "qgemm_jobs.h"
#include "simd_cpu.h"

#define PNR PANEL


/* Panel pnl's quants unpacked to int16 k-pair vectors wp [K/2][16][2] (panel_cpu.h's order, stored as they come)
 * and its scales and zeros to float32 sp/zp [ng][16]. */
void unpack_panel(const panel_job *j, int pnl, int16_t *wp, float *sp, float *zp) {
    const int K = j->K, ng = j->ng;
    const uint8_t *b = (const uint8_t *)j->w + (size_t)pnl * panel_bytes(j->quant, K);
    __m256i *o = (__m256i *)wp;
    if (j->quant != QUANT_Q8)
        for (int c = 0; c < K / 4; c++, o += 4) {
            __m256i v[4];
            if (j->quant == QUANT_Q6) {
                q6_vectors(b, c, v);
            } else {
                q4_vectors(b + (size_t)c * 32, v);
                if (j->quant == QUANT_E2M1) e2m1_vectors(v);
            }
            for (int t = 0; t < 4; t++) _mm256_store_si256(o + t, v[t]);
        }
    else
        for (int p = 0; p < K / 2; p++, o += 2) {
            __m256i v[2];
            q8_vectors((const int8_t *)b + (size_t)p * 32, v);
            _mm256_store_si256(o, v[0]);
            _mm256_store_si256(o + 1, v[1]);
        }
    for (int g = 0; g < ng; g++) {
        __m256 v[2];
        panel_scales(j->scales, pnl, ng, j->G, g, j->scale_fmt, v);
        _mm256_store_ps(sp + g * PNR, v[0]);
        _mm256_store_ps(sp + g * PNR + 8, v[1]);
        if (j->has_zeros) panel_scales(j->zeros, pnl, ng, j->G, g, j->scale_fmt, v);
        else v[0] = v[1] = _mm256_setzero_ps();
        _mm256_store_ps(zp + g * PNR, v[0]);
        _mm256_store_ps(zp + g * PNR + 8, v[1]);
    }
}

/* a[m][h] += the int32 dot products of n k-pairs: panel vectors w (2 per k-pair) times row m's k-pair broadcast.
 * In assembly: gcc spilled accumulators of the intrinsics version (1.3-1.6x slower). */
#define ROW(m) "vpbroadcastd " #m "*4(%[x]), %%ymm13\n\t" \
               "vpmaddwd %%ymm13, %%ymm14, %%ymm12\n\tvpaddd %%ymm12, %[a" #m "0], %[a" #m "0]\n\t" \
               "vpmaddwd %%ymm13, %%ymm15, %%ymm12\n\tvpaddd %%ymm12, %[a" #m "1], %[a" #m "1]\n\t"
#define ACC(m) [a##m##0] "+x"(r##m##0), [a##m##1] "+x"(r##m##1)
static inline __attribute__((always_inline)) void kpairs(const __m256i *w, const int32_t *x, int n, __m256i a[PMR][2]) {
    __m256i r00 = _mm256_setzero_si256(), r01 = r00, r10 = r00, r11 = r00, r20 = r00, r21 = r00, r30 = r00, r31 = r00;
#if PMR == 6
    __m256i r40 = r00, r41 = r00, r50 = r00, r51 = r00;
#endif
    for (int p = 0; p < n; p++, w += 2, x += PMR) {
#if PMR == 4
        __asm__("vmovdqa (%[w]), %%ymm14\n\tvmovdqa 32(%[w]), %%ymm15\n\t" ROW(0) ROW(1) ROW(2) ROW(3)
                : ACC(0), ACC(1), ACC(2), ACC(3) : [w] "r"(w), [x] "r"(x) : "xmm12", "xmm13", "xmm14", "xmm15");
#elif PMR == 6
        __asm__("vmovdqa (%[w]), %%ymm14\n\tvmovdqa 32(%[w]), %%ymm15\n\t" ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
                : ACC(0), ACC(1), ACC(2), ACC(3), ACC(4), ACC(5) : [w] "r"(w), [x] "r"(x)
                : "xmm12", "xmm13", "xmm14", "xmm15");
#else
#error "PMR must be 4 or 6"
#endif
    }
    a[0][0] = r00; a[0][1] = r01; a[1][0] = r10; a[1][1] = r11; a[2][0] = r20; a[2][1] = r21; a[3][0] = r30; a[3][1] = r31;
#if PMR == 6
    a[4][0] = r40; a[4][1] = r41; a[5][0] = r50; a[5][1] = r51;
#endif
}
#undef ROW
#undef ACC

/* y[m0..m0+mr, n0..] from the unpacked panel; the tile's activations are xt's [K/2][PMR] k-pairs. */
static inline __attribute__((always_inline)) void panel_tile(const panel_job *j, const int16_t *wp, const float *sp,
                                                             const float *zp, int n0, int m0, const int mr, const int G) {
    const int K = j->K, mp = j->mp;
    const int32_t *xt = j->xt + (size_t)(m0 / PMR) * (K / 2) * PMR;
    float f[PMR][PNR] __attribute__((aligned(32)));  /* float sums: touched once per group */
    for (int m = 0; m < PMR; m++)  /* vector stores: gcc made "= {{0}}" a rep stos, ~10% of the kernel's samples */
        for (int h = 0; h < PNR; h += 8) _mm256_store_ps(f[m] + h, _mm256_setzero_ps());
    const __m256i *wv = (const __m256i *)wp;
    for (int g = 0; g < K / G; g++) {
        __m256i a[PMR][2];
        const int p0 = g * G / 2;
        kpairs(wv + 2 * p0, xt + (size_t)p0 * PMR, G / 2, a);
        const float *dx = j->dxT + (size_t)(g * G / 32) * mp + m0;
        for (int h = 0; h < 2; h++) {
            const __m256 s = _mm256_load_ps(sp + g * PNR + 8 * h), z = _mm256_load_ps(zp + g * PNR + 8 * h);
            for (int m = 0; m < mr; m++) {
                __m256 acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][h]), _mm256_mul_ps(s, _mm256_set1_ps(dx[m])),
                                             _mm256_load_ps(f[m] + 8 * h));
                if (j->has_zeros)
                    acc = _mm256_fmadd_ps(z, _mm256_set1_ps(j->xsum[(size_t)(m0 + m) * j->ngp + g]), acc);
                _mm256_store_ps(f[m] + 8 * h, acc);
            }
        }
    }
    const int nr = j->N - n0 < PNR ? j->N - n0 : PNR;
    for (int m = 0; m < mr; m++) {
        float *y = j->y + (size_t)(m0 + m) * j->N + n0;
        if (nr == PNR) {  /* (a memcpy call per row cost 2% of the kernel) */
            _mm256_storeu_ps(y, _mm256_load_ps(f[m]));
            _mm256_storeu_ps(y + 8, _mm256_load_ps(f[m] + 8));
        } else memcpy(y, f[m], sizeof(float) * nr);
    }
}

static __thread void *pscratch;
static __thread size_t pscratch_cap;

static void panel_chunk(void *arg, int chunk) {
    panel_job *j = arg;
    /* chunk c: panels [c * np / nc, (c + 1) * np / nc), sizes within one of each other */
    const int p0 = (int)((long)chunk * j->npanels / j->nchunks), p1 = (int)((long)(chunk + 1) * j->npanels / j->nchunks);
    if (j->amx) {
        if (panel_rows_amx(j, p0, p1)) atomic_store(&j->failed, 1);
        return;
    }
    const size_t wbytes = sizeof(int16_t) * PNR * (size_t)j->K, fbytes = sizeof(float) * PNR * (size_t)j->ng;
    const size_t need = wbytes + 2 * fbytes + 128;
    if (need > pscratch_cap) {
        free(pscratch);
        pscratch = aligned_alloc(64, (need + 63) / 64 * 64);
        pscratch_cap = pscratch ? need : 0;
        if (!pscratch) { atomic_store(&j->failed, 1); return; }
    }
    int16_t *wp = pscratch;
    float *sp = (float *)((char *)wp + (wbytes + 63) / 64 * 64), *zp = sp + (size_t)PNR * j->ng;
    for (int pnl = p0; pnl < p1; pnl++) {
        const int n0 = pnl * PNR;
        unpack_panel(j, pnl, wp, sp, zp);
        if (j->avx512) {
            panel_rows_avx512(j, wp, sp, zp, pnl);
            continue;
        }
        for (int m0 = 0; m0 < j->M; m0 += PMR) {
            const int mr = j->M - m0 < PMR ? j->M - m0 : PMR;
#define PT(MR) do { if (j->G == 32) panel_tile(j, wp, sp, zp, n0, m0, MR, 32); else panel_tile(j, wp, sp, zp, n0, m0, MR, 16); } while (0)
            if (mr == PMR) PT(PMR); else PT(mr);
#undef PT
        }
    }
}

/* Rows of tiles c*per.. of x rounded (quantize_rows: xq, dxT, xsum) and their k-pairs interleaved into xt int32
 * [ceil(M/PMR)][K/2][PMR] (a tile's k-pair p of row m at p * PMR + m, zero past M), so the micro-kernel broadcasts
 * them at constant offsets from one pointer. */
static void prepare_rows(void *arg, int c) {
    panel_job *j = arg;
    const int K = j->K, ntiles = (j->M + PMR - 1) / PMR, per = (ntiles + j->nchunks - 1) / j->nchunks;
    const int t1 = (c + 1) * per < ntiles ? (c + 1) * per : ntiles;
    if (c * per >= t1) return;
    const int m0 = c * per * PMR, m1 = t1 * PMR < j->M ? t1 * PMR : j->M;
    quantize_rows(j->x + (size_t)m0 * K, m1 - m0, K, j->G, j->mp, j->ngp, j->xq + (size_t)m0 * K,
                  j->dxT + m0, j->xsum + (size_t)m0 * j->ngp, j->has_zeros);
    if (j->amx) {
        split_rows_amx(j->xq, m0, m1, K, j->G, j->xa);
        if (j->has_zeros)
            for (int m = m0; m < m1; m++)
                for (int g = 0; g < j->ng; g++) j->xsT[(size_t)g * j->mp + m] = j->xsum[(size_t)m * j->ngp + g];
        return;
    }
    const int32_t *x32 = (const int32_t *)j->xq;
    for (int t = c * per; t < t1; t++) {
        const int32_t *r[PMR];
        for (int m = 0; m < PMR; m++) r[m] = t * PMR + m < j->M ? x32 + (size_t)(t * PMR + m) * (K / 2) : NULL;
        int32_t *o = j->xt + (size_t)t * (K / 2) * PMR;
        for (int p = 0; p < K / 2; p += 8) {  /* 4 rows x 8 k-pairs -> 8 k-pairs x 4 rows (K / 2 is a multiple of 16) */
            __m256i v[PMR];
            for (int m = 0; m < PMR; m++) v[m] = r[m] ? _mm256_loadu_si256((const __m256i *)(r[m] + p)) : _mm256_setzero_si256();
            const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
            const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
            const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);  /* k-pairs 0, 4 | 1, 5 */
            const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);  /* 2, 6 | 3, 7 */
            __m256i *op = (__m256i *)(o + (size_t)p * PMR);
            _mm256_storeu_si256(op, _mm256_permute2x128_si256(u0, u1, 0x20));
            _mm256_storeu_si256(op + 1, _mm256_permute2x128_si256(u2, u3, 0x20));
            _mm256_storeu_si256(op + 2, _mm256_permute2x128_si256(u0, u1, 0x31));
            _mm256_storeu_si256(op + 3, _mm256_permute2x128_si256(u2, u3, 0x31));
        }
    }
}

/* The activations' scratch of a panel GEMM (rounded rows, steps, sums, interleaved or split copies), kept by the
 * calling thread between calls: allocated fresh each call, its pages cost ~1,000 page faults a 512-row GEMM of
 * the 0.8B models (a few ms, ~10% of a prefill). Past SCRATCH_KEEP bytes it is given back after the call. */
#define SCRATCH_KEEP ((size_t)64 << 20)
static __thread char *xscratch;
static __thread size_t xscratch_cap;

/* parts[i] = sizes[i] bytes of the scratch, each 64-byte aligned; 0 when the memory cannot be had. */
static int carve_scratch(const size_t *sizes, char **parts, int n) {
    size_t need = 0;
    for (int i = 0; i < n; i++) need += (sizes[i] + 63) / 64 * 64;
    if (need > xscratch_cap) {
        free(xscratch);
        xscratch = aligned_alloc(64, need ? need : 64);
        xscratch_cap = xscratch ? need : 0;
        if (!xscratch) return 0;
    }
    for (size_t i = 0, off = 0; i < (size_t)n; off += (sizes[i] + 63) / 64 * 64, i++) parts[i] = xscratch + off;
    return 1;
}

static void release_scratch(void) {
    if (xscratch_cap <= SCRATCH_KEEP) return;
    free(xscratch);
    xscratch = NULL;
    xscratch_cap = 0;
}

static _Atomic int panel_calls;

/* How many GEMMs this kernel has run (tests check which kernel a row count picks: both give the same bits). */
int panel_gemm_calls(void) { return atomic_load(&panel_calls); }

static int run_panel(panel_job *j, const float *x, int nthreads) {
    atomic_fetch_add(&panel_calls, 1);
    j->avx512 = gemm_isa_avx512();
    /* AMX where it wins (qgemm_amx.c's notes): groups of 32 (Q6_K's 16 take twice its per-group work), 32+ rows */
    j->amx = gemm_isa_amx() && j->G == 32 && j->M >= 32;
    j->ng = j->K / j->G;
    j->ngp = (j->ng + 7) / 8 * 8;
    /* dxT's row stride: a cache line past M, so the groups' steps a tile reads (one row each) do not share a few
     * L1 sets (at 512 rows a 2 KB stride put all 18 of K = 576 in 2 sets of 8 ways); it also covers the rows an
     * AMX tile computes past M (zeros) */
    j->mp = j->M + 16;
    const int mt = (j->M + 15) / 16 * 16;  /* AMX: rows in whole tiles of 16, those past M zero */
    const size_t sizes[6] = {
        sizeof(int16_t) * (size_t)j->M * j->K,                                         /* xq */
        sizeof(float) * (size_t)(j->K / 32) * j->mp,                                   /* dxT */
        sizeof(float) * (size_t)j->M * j->ngp,                                         /* xsum */
        j->amx ? 0 : sizeof(int16_t) * (size_t)(j->M + PMR - 1) / PMR * PMR * j->K,  /* xt */
        j->amx ? (size_t)mt * j->K * 2 : 0,                                            /* xhl */
        j->amx && j->has_zeros ? sizeof(float) * (size_t)j->ngp * j->mp : 0,          /* xsT */
    };
    char *parts[6];
    if (!carve_scratch(sizes, parts, 6)) return -1;
    int16_t *xq = (int16_t *)parts[0];
    float *dxT = (float *)parts[1], *xsum = (float *)parts[2], *xsT = sizes[5] ? (float *)parts[5] : NULL;
    int32_t *xt = j->amx ? NULL : (int32_t *)parts[3];
    int8_t *xhl = j->amx ? (int8_t *)parts[4] : NULL;
    /* what the row preparation leaves unwritten and a tile reads: the steps and sums of rows M..mp (a tile's rows
     * past M, computed and not stored), the bytes of the last AMX tile's rows past M, xsT's padding groups */
    for (int b = 0; b < j->K / 32; b++) memset(dxT + (size_t)b * j->mp + j->M, 0, sizeof(float) * (j->mp - j->M));
    if (xsT)
        for (int g = 0; g < j->ngp; g++)
            if (g < j->ng) memset(xsT + (size_t)g * j->mp + j->M, 0, sizeof(float) * (j->mp - j->M));
            else memset(xsT + (size_t)g * j->mp, 0, sizeof(float) * j->mp);
    if (xhl && j->M % 16)
        for (int g = 0; g < j->ng; g++)
            for (int h = 0; h < 2; h++)
                memset(xhl + ((size_t)(j->M / 16) * j->ng + g) * 32 * j->G + h * 16 * j->G + (j->M % 16) * j->G, 0,
                       (size_t)(16 - j->M % 16) * j->G);
    j->x = x; j->xq = xq; j->xt = xt; j->dxT = dxT; j->xsum = xsum;
    j->xa = xhl; j->xsT = xsT;
    j->nchunks = j->M >= 64 ? 2 * nthreads : 1;  /* a few rows: not worth waking a worker */
    pool_run(prepare_rows, j, j->nchunks, nthreads);
    j->npanels = (j->N + PNR - 1) / PNR;
    /* chunks of ~32 rows' work or more (a panel's claim costs an atomic, ~0.1 us against a 16-row panel's
     * ~3 us): at 512 rows a panel each, so the core that finishes first waits at most one panel (~0.1 ms);
     * at 16 rows two (chunks of 16 panels left a 60-panel qkv's cores 16 panels apart: 4-5% of a step) */
    int per = j->amx ? AMX_PANELS : j->M >= 32 ? 1 : 32 / j->M;
    if (j->npanels / per >= 0xffff) per = j->npanels / 0xfffe + 1;  /* the pool takes < 2^16 chunks */
    j->nchunks = (j->npanels + per - 1) / per;
    atomic_store(&j->failed, 0);
    pool_run(panel_chunk, j, j->nchunks, nthreads);
    release_scratch();
    return atomic_load(&j->failed) ? -1 : 0;
}

int q4_gemm_panel(const float *x, int M, int K, const uint8_t *w, const void *scales, const void *zeros,
                  int scale_fmt, int N, float *y, int nthreads) {
    panel_job j = {.M = M, .K = K, .G = 32, .N = N, .w = w, .scales = scales, .zeros = zeros, .has_zeros = 1,
                   .quant = QUANT_Q4, .scale_fmt = scale_fmt, .y = y};
    return run_panel(&j, x, nthreads);
}

int q8_gemm_panel(const float *x, int M, int K, const int8_t *w, int G, const void *scales, const void *zeros,
                  int has_zeros, int scale_fmt, int N, float *y, int nthreads) {
    panel_job j = {.M = M, .K = K, .G = G, .N = N, .w = w, .scales = scales, .zeros = zeros,
                   .has_zeros = has_zeros, .quant = QUANT_Q8, .scale_fmt = scale_fmt, .y = y};
    return run_panel(&j, x, nthreads);
}

int mxfp4_gemm_panel(const float *x, int M, int K, const uint8_t *w, const void *scales, int scale_fmt, int N,
                     float *y, int nthreads) {
    panel_job j = {.M = M, .K = K, .G = 32, .N = N, .w = w, .scales = scales, .zeros = scales, .has_zeros = 0,
                   .quant = QUANT_E2M1, .scale_fmt = scale_fmt, .y = y};
    return run_panel(&j, x, nthreads);
}

int q6_gemm_panel(const float *x, int M, int K, const uint8_t *w, const void *scales, int scale_fmt, int N, float *y,
                  int nthreads) {
    panel_job j = {.M = M, .K = K, .G = 16, .N = N, .w = w, .scales = scales, .zeros = scales, .has_zeros = 0,
                   .quant = QUANT_Q6, .scale_fmt = scale_fmt, .y = y};
    return run_panel(&j, x, nthreads);
}
