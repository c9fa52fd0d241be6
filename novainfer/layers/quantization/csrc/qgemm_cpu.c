/* Weight-only quantized GEMM for x86 CPUs with AVX2+FMA+F16C: y[M,N] = x[M,K] @ dequant(W)[N,K]^T.
 *
 * Weights stay quantized in memory; each group of weights dequantizes as q * scale + zero with a scale/zero
 * per group, which holds GGUF's Q4_0/Q4_1/Q4_K (4-bit, groups of 32) and Q8_0/Q5_K/Q6_K (8-bit container,
 * groups of 32 or 16) exactly. Scales and zeros are float16 (scale_f16) or float32; float16 ones are widened
 * (exactly) for 4 weight rows at a time, so both give the same bits and the float16 layout reads fewer bytes.
 *
 * Activations are rounded per row to int16 in blocks of 32 (step max|x| / 32767), so a group's dot product
 * is integer (madd of int16 pairs) and only its sum is scaled in float: fewer instructions per weight than
 * widening every weight to float. int8 activations (llama.cpp's Q8 format, maddubs) were 1.2x faster
 * still but raised the default model's mean KL to the float32 reference from 0.0001 to 0.0048, above
 * llama.cpp's own 0.0047 (benchmarks/quant_accuracy.py); int16 keeps it at the float path's level.
 * The zero point's term uses the group's sum of the rounded x (its error cancels against the q term's).
 * Tiles of 4 weight rows x 3 activation rows are register-blocked (see tile()); a row's bits do not depend on
 * the batch. Up to 3 rows (a decode step) the weights are unpacked in registers and prefetched two tiles ahead:
 * at one row the kernel waits on memory, and that made a batch-1 step's GEMMs 1.2-1.5x faster. From 64 rows on
 * (a prefill) the panel kernel of qgemm_panel_cpu.c takes over: the same int16 products laid out as a BLAS GEMM,
 * 1.2x faster at 8 rows and 2x at 64, but summed in another float order.
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

/* x [M, K] -> xq int16 [M, K], dxT [K/32, mp] (xq * dx ~ x, transposed so one load serves a tile's rows),
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

/* Register blocking: a tile of NB weight rows x MB activation rows keeps NB * MB float accumulators, so one load
 * of a row's activations serves NB weight rows and one unpack of a weight row serves every activation row. */
#define NB 4
#define MB 3  /* 12 accumulators; 4x3 measured at least as fast as 4x2, 3x3, 2x4 and 4x4 on the AVX2 machine */
/* Up to this many activation rows every tile unpacks its weights in registers again, rather than once into wb:
 * 4-8 rows measured 4-12% faster that way (the weights are in L1 for the tiles after the first), the same bits. */
#define DIRECT_MAX_ROWS 8
#define PF_TILES 2  /* direct tiles prefetch the weight rows this many tiles ahead (1, 2, 4, 8 measured alike) */

typedef struct {
    const int16_t *xq; const float *dxT, *xsum; int M, K, G, N, ng, ngp, mp;
    const void *w; const void *scales, *zeros; int has_zeros, q4, scale_f16, nchunks;
    _Atomic int failed;
    float *y;
} gemm_job;

/* Weight rows n0..n0+nr unpacked to int16 [nr, K]. 4-bit: w[N, K/2] bytes; group g of 32 is bytes [16g, 16g+16):
 * low nibble = element j, high = j+16 (GGML's Q4_0/Q4_1 order). 8-bit: w[N, K] int8. */
void unpack_weight_rows(const void *w, int q4, int K, int n0, int nr, int16_t *wb) {
    const __m256i mask = _mm256_set1_epi16(0x0f);
    for (int r = 0; r < nr; r++) {
        int16_t *o = wb + (size_t)r * K;
        if (q4) {
            const uint8_t *wr = (const uint8_t *)w + (size_t)(n0 + r) * (K / 2);
            for (int g = 0; g < K / 32; g++) {
                __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wr + g * 16)));
                _mm256_storeu_si256((__m256i *)(o + g * 32), _mm256_and_si256(b, mask));
                _mm256_storeu_si256((__m256i *)(o + g * 32 + 16), _mm256_srli_epi16(b, 4));
            }
        } else {
            const int8_t *wr = (const int8_t *)w + (size_t)(n0 + r) * K;
            for (int c = 0; c < K; c += 16)
                _mm256_storeu_si256((__m256i *)(o + c), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + c))));
        }
    }
}

/* y[m0.., n0..] for nr weight rows (unpacked in wb; their float32 scales sr and zeros zr [nr, ng]) and mr
 * activation rows: per block of 32, two madds of int16 pairs give the integer dot product, scaled in float by
 * (weight scale * activation step); the zero points' term sum_g zero * xsum is added at the end. The same float
 * operations for a row whatever M or its tile.
 * direct (M <= DIRECT_MAX_ROWS, e.g. a batch-1 decode step or a verify step): the weights are unpacked in registers
 * from j->w (q4 or int8) and the scale products formed in place, not stored to wb and pt and loaded again; the
 * same integers and float operations, so the same bits. */
static inline __attribute__((always_inline)) void tile(const gemm_job *j, const int16_t *wb, float *pt,
                                                       const float *sr, const float *zr, int n0, const int nr, int m0,
                                                       const int mr, const int G, const int direct, const int q4) {
    const int K = j->K, ng = j->ng, mp = j->mp, H = 32 / G;
    /* pt[b][h][n][m] = weight scale * activation step, one store of 4 per (b, h, n): the inner loop then broadcasts
     * its factor straight from memory. A store's 4th lane past mr lands in the next entry, written after it. */
    for (int b = 0; b < K / 32 && !direct; b++) {
        const __m128 d4 = _mm_loadu_ps(j->dxT + (size_t)b * mp + m0);
        for (int h = 0; h < H; h++)
            for (int n = 0; n < nr; n++)
                _mm_storeu_ps(pt + ((size_t)(b * H + h) * nr + n) * mr,
                              _mm_mul_ps(_mm_set1_ps(sr[(size_t)n * ng + b * H + h]), d4));
    }
    __m256 acc[NB][MB];
    for (int n = 0; n < nr; n++)
        for (int m = 0; m < mr; m++) acc[n][m] = _mm256_setzero_ps();
    /* direct: the rows PF_TILES tiles on, one cache line per block (NB q4 rows are 64 bytes a block, int8 128): the
     * hardware prefetcher does not follow NB rows read side by side, and a decode step waits on memory. */
    const char *pf = (const char *)j->w + ((size_t)n0 + PF_TILES * NB) * (q4 ? K / 2 : K);
    const int pf_ok = direct && nr == NB && n0 + (PF_TILES + 1) * NB <= j->N;
    for (int b = 0; b < K / 32; b++) {
        const float *pb = pt + (size_t)b * H * nr * mr;
        if (pf_ok) {
            _mm_prefetch(pf + (size_t)b * NB * (q4 ? 16 : 32), _MM_HINT_T0);
            if (!q4) _mm_prefetch(pf + (size_t)b * NB * 32 + 64, _MM_HINT_T0);
        }
        __m256i x0[MB], x1[MB];
        for (int m = 0; m < mr; m++) {
            const int16_t *xg = j->xq + (size_t)(m0 + m) * K + b * 32;
            x0[m] = _mm256_loadu_si256((const __m256i *)xg);
            x1[m] = _mm256_loadu_si256((const __m256i *)(xg + 16));
        }
        const float *dx = j->dxT + (size_t)b * mp + m0;
        for (int n = 0; n < nr; n++) {
            __m256i w0, w1;
            if (!direct) {
                const int16_t *wg = wb + (size_t)n * K + b * 32;
                w0 = _mm256_loadu_si256((const __m256i *)wg);
                w1 = _mm256_loadu_si256((const __m256i *)(wg + 16));
            } else if (q4) {  /* unpack_weight_rows' layout: low nibbles elements 0-15, high nibbles 16-31 */
                const __m256i v = _mm256_cvtepu8_epi16(
                    _mm_loadu_si128((const __m128i *)((const uint8_t *)j->w + (size_t)(n0 + n) * (K / 2) + b * 16)));
                w0 = _mm256_and_si256(v, _mm256_set1_epi16(0x0f));
                w1 = _mm256_srli_epi16(v, 4);
            } else {
                const int8_t *wr = (const int8_t *)j->w + (size_t)(n0 + n) * K + b * 32;
                w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wr));
                w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + 16)));
            }
            for (int m = 0; m < mr; m++) {
                const __m256i p0 = _mm256_madd_epi16(w0, x0[m]), p1 = _mm256_madd_epi16(w1, x1[m]);
                const float *s = sr + (size_t)n * ng + b * H;
                if (G == 32) {
                    const __m256 f = direct ? _mm256_set1_ps(s[0] * dx[m]) : _mm256_broadcast_ss(pb + n * mr + m);
                    acc[n][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), f, acc[n][m]);
                } else {
                    const __m256 f0 = direct ? _mm256_set1_ps(s[0] * dx[m]) : _mm256_broadcast_ss(pb + n * mr + m);
                    const __m256 f1 = direct ? _mm256_set1_ps(s[1] * dx[m])
                                             : _mm256_broadcast_ss(pb + (nr + n) * mr + m);
                    acc[n][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), f0, acc[n][m]);
                    acc[n][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), f1, acc[n][m]);
                }
            }
        }
    }
    float out[NB][MB];  /* the sums leave the registers here, so acc stays in registers through the loop */
    for (int n = 0; n < nr; n++)
        for (int m = 0; m < mr; m++) out[n][m] = hsum8(acc[n][m]);
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(ng % 8), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int n = 0; n < nr; n++)
        for (int m = 0; m < mr; m++) {
            float t = out[n][m];
            if (j->has_zeros) {  /* sum_g zero[n, g] * xsum[m, g] */
                const float *z = zr + (size_t)n * ng, *xs = j->xsum + (size_t)(m0 + m) * j->ngp;
                __m256 a = _mm256_setzero_ps();
                int g = 0;
                for (; g + 8 <= ng; g += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(z + g), _mm256_loadu_ps(xs + g), a);
                if (g < ng) a = _mm256_fmadd_ps(_mm256_maskload_ps(z + g, tail), _mm256_loadu_ps(xs + g), a);
                t += hsum8(a);
            }
            j->y[(size_t)(m0 + m) * j->N + n0 + n] = t;
        }
}

/* Every activation row against nr (NB or 1) weight rows, one specialised tile per shape: the rows unpacked in wb,
 * or (direct, for M <= DIRECT_MAX_ROWS) read from j->w in each tile. */
static void rows_block(const gemm_job *j, const int16_t *wb, float *pt, const float *sr, const float *zr, int n0,
                       int nr, const int direct) {
    for (int m0 = 0; m0 < j->M; m0 += MB) {
        const int mr = j->M - m0 < MB ? j->M - m0 : MB;
#define TILE(NR, MR) do {                                                                                       \
            if (!direct && j->G == 32) tile(j, wb, pt, sr, zr, n0, NR, m0, MR, 32, 0, 0);                       \
            else if (!direct) tile(j, wb, pt, sr, zr, n0, NR, m0, MR, 16, 0, 0);                                \
            else if (j->q4) tile(j, wb, pt, sr, zr, n0, NR, m0, MR, 32, 1, 1);                                  \
            else if (j->G == 32) tile(j, wb, pt, sr, zr, n0, NR, m0, MR, 32, 1, 0);                             \
            else tile(j, wb, pt, sr, zr, n0, NR, m0, MR, 16, 1, 0);                                             \
        } while (0)
        switch ((nr == NB) * 4 + mr) {  /* mr <= MB = 3 */
        case 4 + 3: TILE(NB, 3); break;
        case 4 + 2: TILE(NB, 2); break;
        case 4 + 1: TILE(NB, 1); break;
        case 3: TILE(1, 3); break;
        case 2: TILE(1, 2); break;
        default: TILE(1, 1);
        }
#undef TILE
    }
}

static __thread void *scratch;  /* per thread: NB weight rows as int16, a tile's scale products, their scales/zeros */
static __thread size_t scratch_cap;

/* Weight rows n0..n0+nr's scales and zeros as float32 [nr, ng]: pointers into the weight's own float32 ones, or
 * float16 ones widened into buf (2 * NB * ng floats). */
static void row_scales(const gemm_job *j, int n0, int nr, float *buf, const float **sr, const float **zr) {
    const size_t off = (size_t)n0 * j->ng, n = (size_t)nr * j->ng;
    if (!j->scale_f16) {
        *sr = (const float *)j->scales + off;
        *zr = j->has_zeros ? (const float *)j->zeros + off : NULL;
        return;
    }
    f16_to_f32((const uint16_t *)j->scales + off, n, buf);
    *sr = buf;
    *zr = NULL;
    if (j->has_zeros) {
        f16_to_f32((const uint16_t *)j->zeros + off, n, buf + n);
        *zr = buf + n;
    }
}

static void gemm_chunk(void *arg, int chunk) {
    gemm_job *j = arg;
    const size_t wbytes = (sizeof(int16_t) * NB * j->K + 63) / 64 * 64;
    const size_t pbytes = (sizeof(float) * ((size_t)(j->K / 16) * NB * MB + 4) + 63) / 64 * 64;
    const size_t need = wbytes + pbytes + sizeof(float) * 2 * NB * (size_t)j->ng;
    if (need > scratch_cap) {
        free(scratch);
        scratch = aligned_alloc(64, (need + 63) / 64 * 64);
        scratch_cap = scratch ? need : 0;
        if (!scratch) { atomic_store(&j->failed, 1); return; }
    }
    int16_t *wb = scratch;
    float *pt = (float *)((char *)scratch + wbytes), *sbuf = (float *)((char *)scratch + wbytes + pbytes);
    const float *sr, *zr;
    int per = (j->N + j->nchunks - 1) / j->nchunks;
    per = (per + NB - 1) / NB * NB;
    const int n0 = chunk * per, n1 = n0 + per < j->N ? n0 + per : j->N;
    const int direct = j->M <= DIRECT_MAX_ROWS;  /* else unpacked once into wb for the M / MB tiles */
    int n = n0;
    for (; n + NB <= n1; n += NB) {
        if (!direct) unpack_weight_rows(j->w, j->q4, j->K, n, NB, wb);
        row_scales(j, n, NB, sbuf, &sr, &zr);
        rows_block(j, wb, pt, sr, zr, n, NB, direct);
    }
    for (; n < n1; n++) {
        if (!direct) unpack_weight_rows(j->w, j->q4, j->K, n, 1, wb);
        row_scales(j, n, 1, sbuf, &sr, &zr);
        rows_block(j, wb, pt, sr, zr, n, 1, direct);
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
    j->mp = j->M + 4;  /* a tile reads 4 steps from its first row on */
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

/* From this many activation rows on, q4_gemm/q8_gemm hand over to the panel kernel (qgemm_panel_cpu.c); its
 * per-row arithmetic differs from this kernel's only in float summation order. */
static int panel_min_rows = 64;  /* cpu_kernels.PANEL_MIN_ROWS sets it */

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
