/* Weight-only quantized GEMM for x86 CPUs with AVX2+FMA+F16C: y[M,N] = x[M,K] @ dequant(W)[N,K]^T.
 *
 * Weights stay quantized in memory; each group of weights dequantizes as q * scale + zero with a scale/zero
 * per group, which holds GGUF's Q4_0/Q4_1/Q4_K (4-bit, groups of 32), Q6_K (6-bit, groups of 16) and Q8_0/Q5_K
 * (8-bit container, groups of 32) exactly. Quants, scales and zeros are in the panel layout of panel_cpu.h: 16
 * output rows a panel, in the order the madds consume them, so a panel streams as one run of memory and unpacks
 * in registers with shifts and masks. Scales and zeros are float32, float16 (widened exactly) or, for the K-quants,
 * int8 multipliers of a float16 factor per 256 weights (multiplied in float32, exactly): scale_fmt, panel_cpu.h.
 *
 * Activations are rounded per row to int16 in blocks of 32 (step max|x| / 32767), so a group's dot product
 * is integer (madd of int16 pairs) and only its sum is scaled in float: fewer instructions per weight than
 * widening every weight to float. int8 activations (llama.cpp's Q8 format, maddubs) were 1.2x faster
 * still but raised the default model's mean KL to the float32 reference from 0.0001 to 0.0048, above
 * llama.cpp's own 0.0047 (benchmarks/quant_accuracy.py); int16 keeps it at the float path's level.
 * The zero point's term uses the group's sum of the rounded x (its error cancels against the q term's).
 * A tile is one panel x up to 4 activation rows (see tile()): per group, each output's integer dot product is
 * summed exactly, then scaled and added in float group after group, one output per lane. That is the panel
 * kernel's order (qgemm_panel_cpu.c), so a row's bits are the same whatever M, its tile, or which of the two
 * kernels its row count picks (from qgemm.py's PANEL_MIN_ROWS rows on: the panel one, which unpacks each
 * panel once for all rows); a decode row and a prefill row of the same values agree.
 * Panels are split over the worker pool of cpu_pool.c. Built at first use by kernels/cpu/library.py.
 */
#include <immintrin.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <stddef.h>

#include "cpu_kernels.h"
#include "cpu_pool.h"
#include "panel_cpu.h"
#include "qgemm_jobs.h"
#include "simd_cpu.h"

typedef int32_t __attribute__((may_alias, aligned(2))) i16pair;  /* one k-pair of int16 activations */

/* a[m][h] += the k-pair vectors (w0: panel rows 0-7, w1: rows 8-15) times row m's k-pair p, broadcast.
 * chain: keep each sum a chain of adds in one register. Left alone, GCC unrolls a q4 or q6 group, computes all its
 * madds first and adds them as a tree, spilling half of them to the stack: the q4 one-row GEMV on a 2-core Zen 3
 * ran 1.15-1.2x faster (q6 1.06-1.17x) with the chain, the q8 one 0.92-0.98x, so q8 leaves it out. The integer
 * sums are exact, so the bits are the same either way. */
static inline __attribute__((always_inline)) void madd_rows(__m256i w0, __m256i w1, const int16_t *xq, int K, int p,
                                                            const int mr, __m256i a[MB][2], const int chain) {
    for (int m = 0; m < mr; m++) {
        const __m256i xb = _mm256_set1_epi32(*(const i16pair *)(xq + (size_t)m * K + 2 * p));
        a[m][0] = _mm256_add_epi32(a[m][0], _mm256_madd_epi16(w0, xb));
        a[m][1] = _mm256_add_epi32(a[m][1], _mm256_madd_epi16(w1, xb));
        if (chain) __asm__("" : "+x"(a[m][0]), "+x"(a[m][1]));
    }
}

/* y[m0..m0+mr, the panel's outputs]: per group of G weights, each output's exact integer dot product S (int16
 * madds of the weights, unpacked in registers from the panel layout of panel_cpu.h), then
 * acc = fma(S, weight scale * activation step, acc) and, with zero points, acc = fma(zero, the group's sum of
 * the rounded x, acc): group after group in order, one output per lane. The panel kernel (qgemm_panel_cpu.c)
 * does the same operations per output, so a row's bits do not depend on M, its tile or the kernel. */
static inline __attribute__((always_inline)) void tile(const gemm_job *j, int panel, int m0, const int mr,
                                                       const int G, const int quant) {
    const int K = j->K, ng = j->ng;
    const int16_t *xq = j->xq + (size_t)m0 * K;
    const uint8_t *wb = (const uint8_t *)j->w + (size_t)panel * panel_bytes(j->quant, K);
    float f[MB][PANEL] __attribute__((aligned(32)));  /* float sums: touched once per group */
    for (int m = 0; m < mr; m++) {
        _mm256_store_ps(f[m], _mm256_setzero_ps());
        _mm256_store_ps(f[m] + 8, _mm256_setzero_ps());
    }
    for (int g = 0; g < ng; g++) {
        __m256i a[MB][2];
        for (int m = 0; m < mr; m++) a[m][0] = a[m][1] = _mm256_setzero_si256();
        prefetch_group(wb, g, G, quant);
        const int p0 = g * G / 2;
        if (quant != QUANT_Q8) {
            for (int p = p0; p < p0 + G / 2; p += 2) {  /* 4 elements (two k-pairs) per 32 bytes of nibbles */
                __m256i v[4];
                if (quant == QUANT_Q6) {
                    q6_vectors(wb, p / 2, v);
                } else {
                    q4_vectors(wb + (size_t)p * 16, v);
                    if (j->quant == QUANT_E2M1) e2m1_vectors(v);
                }
                madd_rows(v[0], v[1], xq, K, p, mr, a, 1);
                madd_rows(v[2], v[3], xq, K, p + 1, mr, a, 1);
            }
        } else {
            for (int p = p0; p < p0 + G / 2; p++) {
                __m256i v[2];
                q8_vectors((const int8_t *)wb + (size_t)p * 32, v);
                madd_rows(v[0], v[1], xq, K, p, mr, a, 0);
            }
        }
        __m256 s[2], z[2];
        panel_scales(j->scales, panel, ng, G, g, j->scale_fmt, s);
        if (j->has_zeros) panel_scales(j->zeros, panel, ng, G, g, j->scale_fmt, z);
        const float *dx = j->dxT + (size_t)(g * G / 32) * j->mp + m0;
        for (int m = 0; m < mr; m++)
            for (int h = 0; h < 2; h++) {
                __m256 acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][h]), _mm256_mul_ps(s[h], _mm256_set1_ps(dx[m])),
                                             _mm256_load_ps(f[m] + 8 * h));
                if (j->has_zeros)
                    acc = _mm256_fmadd_ps(z[h], _mm256_set1_ps(j->xsum[(size_t)(m0 + m) * j->ngp + g]), acc);
                _mm256_store_ps(f[m] + 8 * h, acc);
            }
    }
    const int n0 = panel * PANEL, nr = j->N - n0 < PANEL ? j->N - n0 : PANEL;
    for (int m = 0; m < mr; m++) {
        float *y = j->y + (size_t)(m0 + m) * j->N + n0;
        if (nr == PANEL) {
            _mm256_storeu_ps(y, _mm256_load_ps(f[m]));
            _mm256_storeu_ps(y + 8, _mm256_load_ps(f[m] + 8));
        } else {
            for (int n = 0; n < nr; n++) y[n] = f[m][n];
        }
    }
}

/* Every activation row against one panel, a specialised tile per row count and format. */
static void panel_rows(const gemm_job *j, int panel) {
    for (int m0 = 0; m0 < j->M; m0 += MB) {
        const int mr = j->M - m0 < MB ? j->M - m0 : MB;
#define TILE(MR) do {                                                       \
            if (j->quant == QUANT_Q4 || j->quant == QUANT_E2M1) tile(j, panel, m0, MR, 32, QUANT_Q4); \
            else if (j->quant == QUANT_Q6) tile(j, panel, m0, MR, 16, QUANT_Q6); \
            else if (j->G == 32) tile(j, panel, m0, MR, 32, QUANT_Q8);     \
            else tile(j, panel, m0, MR, 16, QUANT_Q8);                     \
        } while (0)
        if (mr == 4) TILE(4); else if (mr == 3) TILE(3); else if (mr == 2) TILE(2); else TILE(1);
#undef TILE
    }
}

static void gemm_chunk(void *arg, int claim) {
    gemm_job *j = arg;  /* chunk c: panels [c * P / nchunks, (c + 1) * P / nchunks) */
    const int chunk = pool_chunk_order(claim, j->nchunks, j->nthreads);
    const int p0 = (int)((long)chunk * j->npanels / j->nchunks), p1 = (int)((long)(chunk + 1) * j->npanels / j->nchunks);
    for (int p = p0; p < p1; p++) {
        if (j->avx512) few_rows_avx512(j, p);
        else panel_rows(j, p);
    }
}

/* Output rows are split into chunks of at least this many for the worker pool (cpu_pool.c). */
#define ROWS_PER_CHUNK 32

int num_chunks(int N, int nthreads) {
    int c = N / ROWS_PER_CHUNK;
    if (c > 8 * nthreads) c = 8 * nthreads;  /* enough for a late worker to find work, few enough to be cheap */
    return c < 1 ? 1 : c;
}

/* Quantizes x, then runs the chunks on the pool. Returns 0, or -1 when scratch memory ran out. */
static int run_gemm(gemm_job *j, const float *x, int nthreads) {
    j->ng = j->K / j->G;
    j->ngp = (j->ng + 7) / 8 * 8;
    j->mp = j->M;
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)j->M * j->K);
    float *dxT = calloc((size_t)(j->K / 32) * j->mp, sizeof(float));
    float *xsum = malloc(sizeof(float) * (size_t)j->M * j->ngp);
    int rc = -1;
    if (xq && dxT && xsum) {
        quantize_rows(x, j->M, j->K, j->G, j->mp, j->ngp, xq, dxT, xsum, j->has_zeros);
        j->xq = xq; j->dxT = dxT; j->xsum = xsum;
        j->avx512 = gemm_isa_avx512();
        j->npanels = (j->N + PANEL - 1) / PANEL;
        const int c = num_chunks(j->N, nthreads);
        j->nchunks = j->npanels < c ? j->npanels : c;
        atomic_store(&j->failed, 0);
        j->nthreads = nthreads;
        pool_run(gemm_chunk, j, j->nchunks, nthreads);
        rc = atomic_load(&j->failed) ? -1 : 0;
    }
    free(xq); free(dxT); free(xsum);
    return rc;
}

/* From this many activation rows on, q4_gemm/q8_gemm hand over to the panel kernel (qgemm_panel_cpu.c): the
 * same bits, faster past about 12 rows. */
static int panel_min_rows = 16;  /* kernels/cpu/qgemm.py PANEL_MIN_ROWS says the same */

/* Tests move it to compare the two kernels on the same rows (they give every row the same bits). */
void set_panel_min_rows(int rows) { panel_min_rows = rows; }

int q4_gemm(const float *x, int M, int K, const uint8_t *w, const void *scales, const void *zeros, int scale_fmt,
            int N, float *y, int nthreads) {
    if (M >= panel_min_rows) return q4_gemm_panel(x, M, K, w, scales, zeros, scale_fmt, N, y, nthreads);
    gemm_job j = {.M = M, .K = K, .G = 32, .N = N, .w = w, .scales = scales, .zeros = zeros, .has_zeros = 1,
                  .quant = QUANT_Q4, .scale_fmt = scale_fmt, .y = y};
    return run_gemm(&j, x, nthreads);
}

int q8_gemm(const float *x, int M, int K, const int8_t *w, int G, const void *scales, const void *zeros,
            int has_zeros, int scale_fmt, int N, float *y, int nthreads) {
    if (M >= panel_min_rows) return q8_gemm_panel(x, M, K, w, G, scales, zeros, has_zeros, scale_fmt, N, y, nthreads);
    gemm_job j = {.M = M, .K = K, .G = G, .N = N, .w = w, .scales = scales, .zeros = zeros,
                  .has_zeros = has_zeros, .quant = QUANT_Q8, .scale_fmt = scale_fmt, .y = y};
    return run_gemm(&j, x, nthreads);
}

/* MXFP4 weights (q4 panels of e2m1 codes, scales 2^(e - 128) as float16 or float32, no zeros). */
int mxfp4_gemm(const float *x, int M, int K, const uint8_t *w, const void *scales, int scale_fmt, int N, float *y,
               int nthreads) {
    if (M >= panel_min_rows) return mxfp4_gemm_panel(x, M, K, w, scales, scale_fmt, N, y, nthreads);
    gemm_job j = {.M = M, .K = K, .G = 32, .N = N, .w = w, .scales = scales, .zeros = scales, .has_zeros = 0,
                  .quant = QUANT_E2M1, .scale_fmt = scale_fmt, .y = y};
    return run_gemm(&j, x, nthreads);
}

/* Q6_K weights (q6 panels, groups of 16, no zeros). */
int q6_gemm(const float *x, int M, int K, const uint8_t *w, const void *scales, int scale_fmt, int N, float *y,
            int nthreads) {
    if (M >= panel_min_rows) return q6_gemm_panel(x, M, K, w, scales, scale_fmt, N, y, nthreads);
    gemm_job j = {.M = M, .K = K, .G = 16, .N = N, .w = w, .scales = scales, .zeros = scales, .has_zeros = 0,
                  .quant = QUANT_Q6, .scale_fmt = scale_fmt, .y = y};
    return run_gemm(&j, x, nthreads);
}
