/* Weight-only quantized GEMM for x86 CPUs with AVX2+FMA+F16C: y[M,N] = x[M,K] @ dequant(W)[N,K]^T.
 *
 * Weights stay quantized in memory; each group of weights dequantizes as q * scale + zero with a scale/zero
 * per group, which holds GGUF's Q4_0/Q4_1/Q4_K (4-bit, groups of 32) and Q8_0/Q5_K/Q6_K (8-bit container,
 * groups of 32 or 16) exactly. Scales and zeros are float16 (scale_f16) or float32; float16 ones are widened
 * (exactly) and transposed for 8 weight rows at a time, so both give the same bits and the float16 layout reads fewer bytes.
 *
 * Activations are rounded per row to int16 in blocks of 32 (step max|x| / 32767), so a group's dot product
 * is integer (madd of int16 pairs) and only its sum is scaled in float: fewer instructions per weight than
 * widening every weight to float. int8 activations (llama.cpp's Q8 format, maddubs) were 1.2x faster
 * still but raised the default model's mean KL to the float32 reference from 0.0001 to 0.0048, above
 * llama.cpp's own 0.0047 (benchmarks/quant_accuracy.py); int16 keeps it at the float path's level.
 * The zero point's term uses the group's sum of the rounded x (its error cancels against the q term's).
 * A tile is 8 weight rows x up to 3 activation rows (see tile()): per group, each output's integer dot product is
 * summed exactly, then scaled and added in float group after group, one output per lane. That is the panel
 * kernel's order (qgemm_panel_cpu.c), so a row's bits are the same whatever M, its tile, or which of the two
 * kernels its row count picks (from cpu_kernels.PANEL_MIN_ROWS rows on: the panel one, faster there); a decode
 * row and a prefill row of the same values agree. Weights are unpacked in registers and the next tiles' rows
 * prefetched: at one row the kernel waits on memory (the hardware prefetcher does not follow 8 rows read side
 * by side).
 * Output rows are split over the worker pool of cpu_pool.c. Built at first use by cpu_kernels.py.
 */
#include <immintrin.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <stddef.h>

#include "cpu_kernels.h"
#include "cpu_pool.h"
#include "simd_cpu.h"

/* x [M, K] -> xq int16 [M, K], dxT [K/32, mp] (xq * dx ~ x; a block's rows side by side, mp apart),
 * xsum [M, ngp] (sums of xq * dx per group of G, zero past K/G). */
void quantize_rows(const float *x, int M, int K, int G, int mp, int ngp, int16_t *xq, float *dxT,
                          float *xsum, int xsum_needed) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * K;
        for (int b = 0; b < K / 32; b++) {
            const float *p = xr + b * 32;
            __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
            __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
            __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            const __m256 id = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
            int16_t *q = xq + (size_t)m * K + b * 32;  /* packs works per 128-bit lane: restore the order */
            _mm256_storeu_si256((__m256i *)q, _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8));
            _mm256_storeu_si256((__m256i *)(q + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8));
            dxT[(size_t)b * mp + m] = amax / 32767.f;
        }
        if (!xsum_needed) continue;
        float *xs = xsum + (size_t)m * ngp;
        for (int g = 0; g < ngp; g++) {  /* sums of the rounded x, so the zero point multiplies the same x as the q term */
            int s = 0;
            for (int i = 0; i < G && g < K / G; i++) s += xq[(size_t)m * K + g * G + i];
            xs[g] = (float)s * dxT[(size_t)(g < K / G ? g * G / 32 : 0) * mp + m];
        }
    }
}

/* A tile is NB = 8 weight rows (one output per float lane) x up to MB activation rows. */
#define NB 8
#define MB 3
#define PF_ROWS 8  /* tiles prefetch the weight rows (and their scales) this many rows ahead */

typedef struct {
    const int16_t *xq; const float *dxT, *xsum; int M, K, G, N, ng, ngp, mp;
    const void *w; const void *scales, *zeros; int has_zeros, q4, scale_f16, nchunks;
    _Atomic int failed;
    float *y;
} gemm_job;

/* Weight rows n0..n0+nr's scales (or zeros) at every group, transposed to [ng][NB] floats (zero past nr), so a
 * group's 8 scales are one vector: 8x8 transposes of 8 groups at a time (dst holds ngp groups). A last partial block of groups reads
 * past its row into the next one (unused), except at the end of the array, where it goes one by one. */
static void transpose_scales(const gemm_job *j, const void *src, int n0, int nr, float *dst) {
    const int ng = j->ng;
    const size_t end = (size_t)j->N * ng;
    for (int g = 0; g < ng; g += 8) {
        const int gn = ng - g < 8 ? ng - g : 8;
        if ((size_t)(n0 + nr - 1) * ng + g + 8 > end) {
            for (int i = 0; i < gn; i++)
                for (int n = 0; n < NB; n++)
                    dst[(g + i) * NB + n] = n < nr ? load_scale(src, (size_t)(n0 + n) * ng + g + i, j->scale_f16) : 0.f;
            continue;
        }
        __m256i r[NB];
        for (int n = 0; n < NB; n++)
            r[n] = n < nr ? _mm256_castps_si256(load8_scales(src, (size_t)(n0 + n) * ng + g, j->scale_f16))
                          : _mm256_setzero_si256();
        transpose8(r);  /* all 8 stored: dst has room for ngp groups */
        for (int i = 0; i < 8; i++) _mm256_store_si256((__m256i *)(dst + (size_t)(g + i) * NB), r[i]);
    }
}

/* Lane n of the result = the sum of v[n]'s 8 int32 lanes (exact: integer adds). */
static inline __attribute__((always_inline)) __m256i sum_lanes8(const __m256i v[8]) {
    const __m256i k0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i k1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(k0, k1, 0x20), _mm256_permute2x128_si256(k0, k1, 0x31));
}

/* y[m0..m0+mr, n0..n0+nr]: per group of G weights, each output's exact integer dot product S (int16 madds,
 * summed over the group's lanes), then acc = fma(S, weight scale * activation step, acc) and, with zero points,
 * acc = fma(zero, the group's sum of the rounded x, acc): group after group in order, one output per lane.
 * That is the panel kernel's order (qgemm_panel_cpu.c) operation for operation, so a row's bits do not depend on
 * M, its tile or which kernel the row count picks. Weights are unpacked in registers from j->w (q4 nibbles or
 * int8) and the next tiles' rows prefetched: at one row the kernel waits on memory. */
static inline __attribute__((always_inline)) void tile(const gemm_job *j, const float *st, const float *zt, int n0,
                                                       const int nr, int m0, const int mr, const int G, const int q4) {
    const int K = j->K, ng = j->ng, mp = j->mp;
    const size_t rb = q4 ? K / 2 : K;  /* bytes a weight row */
    const int bpg = q4 ? G / 2 : G;    /* bytes a group of a weight row */
    __m256 acc[MB];
    for (int m = 0; m < mr; m++) acc[m] = _mm256_setzero_ps();
    const char *pf = (const char *)j->w + ((size_t)n0 + PF_ROWS) * rb;
    const int pf_ok = nr == NB && n0 + PF_ROWS + NB <= j->N;
    for (int g = 0; g < ng; g++) {
        if (pf_ok)  /* a linear sweep of the NB rows PF_ROWS on: NB rows x bpg bytes per group */
            for (int c = 0; c < NB * bpg; c += 64) _mm_prefetch(pf + (size_t)g * NB * bpg + c, _MM_HINT_T0);
        __m256i v[MB][NB];
        for (int n = 0; n < NB; n++) {
            if (n >= nr) {
                for (int m = 0; m < mr; m++) v[m][n] = _mm256_setzero_si256();
                continue;
            }
            const char *wr = (const char *)j->w + (size_t)(n0 + n) * rb + (size_t)g * bpg;
            __m256i w0, w1 = _mm256_setzero_si256();
            if (q4) {  /* GGML's Q4 order: low nibbles elements 0-15, high nibbles 16-31 */
                const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)wr));
                w0 = _mm256_and_si256(b, _mm256_set1_epi16(0x0f));
                w1 = _mm256_srli_epi16(b, 4);
            } else {
                w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wr));
                if (G == 32) w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + 16)));
            }
            for (int m = 0; m < mr; m++) {
                const int16_t *xg = j->xq + (size_t)(m0 + m) * K + (size_t)g * G;
                __m256i p = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xg));
                if (G == 32) p = _mm256_add_epi32(p, _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xg + 16))));
                v[m][n] = p;
            }
        }
        const __m256 s = _mm256_load_ps(st + (size_t)g * NB), z = _mm256_load_ps(zt + (size_t)g * NB);
        const float *dx = j->dxT + (size_t)(g * G / 32) * mp + m0;
        for (int m = 0; m < mr; m++) {
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_lanes8(v[m])), _mm256_mul_ps(s, _mm256_set1_ps(dx[m])),
                                     acc[m]);
            if (j->has_zeros)
                acc[m] = _mm256_fmadd_ps(z, _mm256_set1_ps(j->xsum[(size_t)(m0 + m) * j->ngp + g]), acc[m]);
        }
    }
    for (int m = 0; m < mr; m++) {
        float *y = j->y + (size_t)(m0 + m) * j->N + n0;
        if (nr == NB) _mm256_storeu_ps(y, acc[m]);
        else {
            float out[NB] __attribute__((aligned(32)));
            _mm256_store_ps(out, acc[m]);
            for (int n = 0; n < nr; n++) y[n] = out[n];
        }
    }
}

/* Every activation row against weight rows n0..n0+nr, one specialised tile per shape. */
static void rows_block(const gemm_job *j, const float *st, const float *zt, int n0, int nr) {
    for (int m0 = 0; m0 < j->M; m0 += MB) {
        const int mr = j->M - m0 < MB ? j->M - m0 : MB;
#define TILE(NR, MR) do {                                                          \
            if (j->q4) tile(j, st, zt, n0, NR, m0, MR, 32, 1);                     \
            else if (j->G == 32) tile(j, st, zt, n0, NR, m0, MR, 32, 0);           \
            else tile(j, st, zt, n0, NR, m0, MR, 16, 0);                           \
        } while (0)
        if (nr == NB) {
            if (mr == 3) TILE(NB, 3); else if (mr == 2) TILE(NB, 2); else TILE(NB, 1);
        } else {
            if (mr == 3) TILE(nr, 3); else if (mr == 2) TILE(nr, 2); else TILE(nr, 1);
        }
#undef TILE
    }
}

static __thread float *scratch;  /* per thread: a tile's transposed scales and zeros */
static __thread size_t scratch_cap;

static void gemm_chunk(void *arg, int chunk) {
    gemm_job *j = arg;
    const size_t need = 2 * (size_t)NB * j->ngp;
    if (need > scratch_cap) {  /* 16 floats a group: a few KB, allocated once per thread and shape */
        free(scratch);
        scratch = aligned_alloc(32, (need * sizeof(float) + 31) / 32 * 32);
        scratch_cap = scratch ? need : 0;
        if (!scratch) { atomic_store(&j->failed, 1); return; }
    }
    float *st = scratch, *zt = scratch + (size_t)NB * j->ngp;
    const long tiles = (j->N + NB - 1) / NB;  /* chunk c: tiles [c * tiles / nchunks, (c + 1) * tiles / nchunks) */
    const int n0 = (int)(chunk * tiles / j->nchunks) * NB, n1e = (int)((chunk + 1) * tiles / j->nchunks) * NB;
    const int n1 = n1e < j->N ? n1e : j->N;
    const size_t row_bytes = (j->scale_f16 ? 2 : 4) * (size_t)j->ng;  /* a weight row's scales (or zeros) */
    for (int n = n0; n < n1; n += NB) {
        const int nr = n1 - n < NB ? n1 - n : NB;
        if (n + PF_ROWS + NB <= j->N)  /* the scales and zeros PF_ROWS rows on, as the weights */
            for (size_t c = 0; c < NB * row_bytes; c += 64) {
                const size_t off = (n + PF_ROWS) * row_bytes + c;
                _mm_prefetch((const char *)j->scales + off, _MM_HINT_T0);
                if (j->has_zeros) _mm_prefetch((const char *)j->zeros + off, _MM_HINT_T0);
            }
        transpose_scales(j, j->scales, n, nr, st);
        if (j->has_zeros) transpose_scales(j, j->zeros, n, nr, zt);
        rows_block(j, st, zt, n, nr);
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
        j->nchunks = (j->N + NB - 1) / NB < num_chunks(j->N, nthreads) ? (j->N + NB - 1) / NB : num_chunks(j->N, nthreads);
        atomic_store(&j->failed, 0);
        pool_run(gemm_chunk, j, j->nchunks, nthreads);
        rc = atomic_load(&j->failed) ? -1 : 0;
    }
    free(xq); free(dxT); free(xsum);
    return rc;
}

/* From this many activation rows on, q4_gemm/q8_gemm hand over to the panel kernel (qgemm_panel_cpu.c): the
 * same bits, faster past about 12 rows. */
static int panel_min_rows = 12;  /* cpu_kernels.PANEL_MIN_ROWS sets it */

void set_panel_min_rows(int rows) { panel_min_rows = rows; }

/* Present in builds whose GEMM/dequantize entry points take scale_f16 (cpu_kernels.py binds them by it). */
int packed_scales_f16(void) { return 1; }

int q4_gemm(const float *x, int M, int K, const uint8_t *w, const void *scales, const void *zeros, int scale_f16,
            int N, float *y, int nthreads) {
    if (M >= panel_min_rows) return q4_gemm_panel(x, M, K, w, scales, zeros, scale_f16, N, y, nthreads);
    gemm_job j = {.M = M, .K = K, .G = 32, .N = N, .w = w, .scales = scales, .zeros = zeros, .has_zeros = 1,
                  .q4 = 1, .scale_f16 = scale_f16, .y = y};
    return run_gemm(&j, x, nthreads);
}

int q8_gemm(const float *x, int M, int K, const int8_t *w, int G, const void *scales, const void *zeros,
            int has_zeros, int scale_f16, int N, float *y, int nthreads) {
    if (M >= panel_min_rows) return q8_gemm_panel(x, M, K, w, G, scales, zeros, has_zeros, scale_f16, N, y, nthreads);
    gemm_job j = {.M = M, .K = K, .G = G, .N = N, .w = w, .scales = scales, .zeros = zeros,
                  .has_zeros = has_zeros, .q4 = 0, .scale_f16 = scale_f16, .y = y};
    return run_gemm(&j, x, nthreads);
}
