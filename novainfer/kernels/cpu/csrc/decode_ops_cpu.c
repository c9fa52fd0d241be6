/* The small float32 ops of a CPU decode step, one call each instead of 5-10 torch ops: fused residual add
 * + RMSNorm, SiLU-and-mul, rotary embedding in place, and the KV store into a bfloat16 paged cache (decode
 * attention over that cache is decode_attention_cpu.c). AVX2+FMA; built with qgemm_cpu.c by kernels/cpu/library.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_pool.h"
#include "simd_cpu.h"

/* Row-parallel runs of the elementwise ops: a prefill's 512 rows take several ms each on one core, a decode
 * step's few rows microseconds (those stay on the calling thread). */
typedef void (*rows_fn)(const void *ctx, int r0, int r1);
typedef struct { rows_fn fn; const void *ctx; int M, per; } rows_job;

static void rows_chunk(void *arg, int c) {
    const rows_job *j = arg;
    const int r0 = c * j->per, r1 = r0 + j->per < j->M ? r0 + j->per : j->M;
    if (r0 < r1) j->fn(j->ctx, r0, r1);
}

#define ROWS_PARALLEL_MIN (1 << 15)  /* elements from which a worker joins */

static void run_rows(rows_fn fn, const void *ctx, int M, size_t elements, int nthreads) {
    if (nthreads <= 1 || M < 2 || elements < ROWS_PARALLEL_MIN) {
        fn(ctx, 0, M);
        return;
    }
    const int nchunks = M < 4 * nthreads ? M : 4 * nthreads;
    rows_job j = {fn, ctx, M, (M + nchunks - 1) / nchunks};
    pool_run(rows_chunk, &j, nchunks, nthreads);
}

/* The sum of h[0..H)^2 in double (two lanes of four, then a fixed tree: every norm rounds the same way). */
static inline double sum_squares(const float *h, int H) {
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    int k = 0;
    for (; k + 8 <= H; k += 8) {
        const __m256 v = _mm256_loadu_ps(h + k);
        const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        s0 = _mm256_fmadd_pd(lo, lo, s0);
        s1 = _mm256_fmadd_pd(hi, hi, s1);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(s0, s1));
    double ss = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; k < H; k++) ss += (double)h[k] * h[k];
    return ss;
}

typedef struct { const float *x, *res; float *res_out; const float *w; float eps; float *out; int H; } norm_job;

static void norm_rows(const void *arg, int r0, int r1) {
    const norm_job *j = arg;
    const int H = j->H;
    for (int m = r0; m < r1; m++) {
        const float *xr = j->x + (size_t)m * H, *rr = j->res ? j->res + (size_t)m * H : NULL;
        float *h = j->res ? j->res_out + (size_t)m * H : (float *)xr;
        int k = 0;
        if (rr) {
            for (; k + 8 <= H; k += 8) _mm256_storeu_ps(h + k, _mm256_add_ps(_mm256_loadu_ps(xr + k), _mm256_loadu_ps(rr + k)));
            for (; k < H; k++) h[k] = xr[k] + rr[k];
        }
        const double ss = sum_squares(h, H);
        const float r = 1.0f / sqrtf((float)(ss / H) + j->eps);
        const __m256 rv = _mm256_set1_ps(r);
        float *o = j->out + (size_t)m * H;
        for (k = 0; k + 8 <= H; k += 8)
            _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_loadu_ps(j->w + k), _mm256_mul_ps(_mm256_loadu_ps(h + k), rv)));
        for (; k < H; k++) o[k] = j->w[k] * (h[k] * r);
    }
}

/* out = w * h / sqrt(mean(h^2) + eps) per row, where h = x + res (stored into res_out) or x alone; the sum of
 * squares in double. */
void add_rms_norm(const float *x, const float *res, float *res_out, const float *w, float eps, float *out,
                  int M, int H, int nthreads) {
    const norm_job j = {x, res, res_out, w, eps, out, H};
    run_rows(norm_rows, &j, M, (size_t)M * H, nthreads);
}

typedef struct { const float *x; float *out; int D; } silu_job;

static void silu_rows(const void *arg, int r0, int r1) {
    const silu_job *j = arg;
    const int D = j->D;
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int m = r0; m < r1; m++) {
        const float *g = j->x + (size_t)m * 2 * D, *u = g + D;
        float *o = j->out + (size_t)m * D;
        int k = 0;
        for (; k + 8 <= D; k += 8) {
            __m256 gv = _mm256_loadu_ps(g + k);
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + k, _mm256_mul_ps(s, _mm256_loadu_ps(u + k)));
        }
        for (; k < D; k++) o[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
    }
}

/* out[m, j] = silu(x[m, j]) * x[m, D + j] for x [M, 2D]. */
void silu_and_mul(const float *x, float *out, int M, int D, int nthreads) {
    const silu_job j = {x, out, D};
    run_rows(silu_rows, &j, M, (size_t)M * D, nthreads);
}

typedef struct {
    float *q; int q_stride, nq; float *k; int k_stride, nk; const int64_t *pos; const float *cos_t, *sin_t; int D;
} rope_job;

static void rope_rows(const void *arg, int t0, int t1) {
    const rope_job *j = arg;
    const int D = j->D, half = D / 2;
    for (int t = t0; t < t1; t++) {
        const float *c = j->cos_t + (size_t)j->pos[t] * D, *s = j->sin_t + (size_t)j->pos[t] * D;
        for (int h = 0; h < j->nq + j->nk; h++) {
            float *x = h < j->nq ? j->q + (size_t)t * j->q_stride + (size_t)h * D
                                 : j->k + (size_t)t * j->k_stride + (size_t)(h - j->nq) * D;
            for (int i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/* Rotates the first halves against the second halves of every head (GPT-NeoX layout), in place: q and k
 * are [T, heads, D] with row strides; cos/sin tables [max_pos, D]. Returns -1 for a position out of range. */
int rotary_neox(float *q, int q_stride, int nq, float *k, int k_stride, int nk, const int64_t *pos, int T,
                const float *cos_t, const float *sin_t, int max_pos, int D, int nthreads) {
    for (int t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return -1;
    const rope_job j = {q, q_stride, nq, k, k_stride, nk, pos, cos_t, sin_t, D};
    run_rows(rope_rows, &j, T, (size_t)T * (nq + nk) * D, nthreads);
    return 0;
}

/* The indices of a step, checked before a KV op writes or reads anything, so a scheduler or runner bug is a
 * clear error rather than memory corruption. *where (if not NULL) gets the offending token, or sequence and
 * table entry. */
int check_kv_slots(const int64_t *slots, int T, int64_t num_slots, int *where) {
    for (int t = 0; t < T; t++)
        if (slots[t] >= num_slots) {
            if (where) where[0] = t;
            return KV_BAD_SLOT;
        }
    return KV_OK;
}

/* Every sequence's length in [1, bt_stride * block_size] and each block id its length covers (from position
 * 0, window or not, as the torch reference reads them) in [0, num_blocks). */
int check_block_tables(const int32_t *block_tables, int bt_stride, const int32_t *seq_lens, int S, int block_size,
                       int num_blocks, int *where) {
    const int64_t cap = (int64_t)bt_stride * block_size;
    for (int s = 0; s < S; s++) {
        if (seq_lens[s] < 1 || seq_lens[s] > cap) {
            if (where) where[0] = s;
            return KV_BAD_SEQ_LEN;
        }
        const int32_t *bt = block_tables + (size_t)s * bt_stride;
        const int used = (seq_lens[s] - 1) / block_size + 1;
        for (int b = 0; b < used; b++)
            if (bt[b] < 0 || bt[b] >= num_blocks) {
                if (where) where[0] = s, where[1] = b;
                return KV_BAD_BLOCK;
            }
    }
    return KV_OK;
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffff) > 0x7f800000) return (uint16_t)((b >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

/* to_bf16 of 8 floats, bit for bit. */
static inline __m128i to_bf16x8(__m256 f) {
    const __m256i b = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i q = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
    const __m256i v = _mm256_blendv_epi8(r, q, nan);  /* 0..0xffff each: packus keeps them */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0xD8));
}

typedef struct {
    const float *k; int k_stride; const float *v; int v_stride; uint16_t *k_cache, *v_cache; const int64_t *slots;
    int width;
} store_job;

static void store_rows(const void *arg, int t0, int t1) {
    const store_job *j = arg;
    for (int t = t0; t < t1; t++) {
        if (j->slots[t] < 0) continue;  /* a padding token */
        uint16_t *kc = j->k_cache + (size_t)j->slots[t] * j->width, *vc = j->v_cache + (size_t)j->slots[t] * j->width;
        const float *k = j->k + (size_t)t * j->k_stride, *v = j->v + (size_t)t * j->v_stride;
        int i = 0;
        for (; i + 8 <= j->width; i += 8) {  /* (scalar, a prefill's stores took 6-10 ms of ~750) */
            _mm_storeu_si128((__m128i *)(kc + i), to_bf16x8(_mm256_loadu_ps(k + i)));
            _mm_storeu_si128((__m128i *)(vc + i), to_bf16x8(_mm256_loadu_ps(v + i)));
        }
        for (; i < j->width; i++) {
            kc[i] = to_bf16(k[i]);
            vc[i] = to_bf16(v[i]);
        }
    }
}

/* k/v rows [T, kv_heads * D] (row strides given) -> bf16 cache [blocks, block_size, kv_heads, D] at slots
 * (negative: padding, skipped). A slot >= num_slots writes nothing at all: KV_BAD_SLOT, *where = its token. */
int store_kv_bf16(const float *k, int k_stride, const float *v, int v_stride, uint16_t *k_cache, uint16_t *v_cache,
                  const int64_t *slots, int T, int width, int nthreads, int64_t num_slots, int *where) {
    const int rc = check_kv_slots(slots, T, num_slots, where);
    if (rc) return rc;
    const store_job j = {k, k_stride, v, v_stride, k_cache, v_cache, slots, width};
    run_rows(store_rows, &j, T, (size_t)T * width, nthreads);
    return KV_OK;
}

/* ---- Gemma's ops (Gemma 4: norms after each block, a GELU-gated MLP and per-layer-input gate) ---- */

typedef struct { const float *x; int x_stride; const float *w; float eps; const float *res; float *out; int H; } norm_add_job;

/* no fused multiply-add: the norm rounds as add_rms_norm's before the sum (-O3 would contract them) */
__attribute__((optimize("fp-contract=off"))) static void norm_add_rows(const void *arg, int r0, int r1) {
    const norm_add_job *j = arg;
    const int H = j->H;
    for (int m = r0; m < r1; m++) {
        const float *xr = j->x + (size_t)m * j->x_stride, *rr = j->res + (size_t)m * H;
        float *o = j->out + (size_t)m * H;
        const double ss = sum_squares(xr, H);
        int k;
        const float r = 1.0f / sqrtf((float)(ss / H) + j->eps);
        const __m256 rv = _mm256_set1_ps(r);
        for (k = 0; k + 8 <= H; k += 8) {
            const __m256 n = _mm256_mul_ps(_mm256_loadu_ps(j->w + k), _mm256_mul_ps(_mm256_loadu_ps(xr + k), rv));
            _mm256_storeu_ps(o + k, _mm256_add_ps(_mm256_loadu_ps(rr + k), n));
        }
        for (; k < H; k++) o[k] = rr[k] + j->w[k] * (xr[k] * r);
    }
}

/* out = res + add_rms_norm(x) (the norm as add_rms_norm computes it, then one float add): Gemma's residual after a
 * post-norm. x rows x_stride floats apart; res and out [M, H] (out may be res). */
void rms_norm_add(const float *x, int x_stride, const float *w, float eps, const float *res, float *out, int M, int H,
                  int nthreads) {
    const norm_add_job j = {x, x_stride, w, eps, res, out, H};
    run_rows(norm_add_rows, &j, M, (size_t)M * H, nthreads);
}

typedef struct { const float *g; int g_stride; const float *u; int u_stride; float *out; int D; } gelu_job;

static void gelu_rows(const void *arg, int r0, int r1) {
    const gelu_job *j = arg;
    const int D = j->D;
    /* gelu_tanh(g) = 0.5 g (1 + tanh(c (g + a g^3))) = g / (1 + exp(-2c (g + a g^3))) */
    const __m256 one = _mm256_set1_ps(1.0f), a = _mm256_set1_ps(0.044715f), c2 = _mm256_set1_ps(-1.5957691216057308f);
    for (int m = r0; m < r1; m++) {
        const float *g = j->g + (size_t)m * j->g_stride, *u = j->u + (size_t)m * j->u_stride;
        float *o = j->out + (size_t)m * D;
        int k = 0;
        for (; k + 8 <= D; k += 8) {
            const __m256 gv = _mm256_loadu_ps(g + k);
            const __m256 inner = _mm256_mul_ps(gv, _mm256_fmadd_ps(_mm256_mul_ps(a, gv), gv, one));
            const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_mul_ps(c2, inner))));
            _mm256_storeu_ps(o + k, _mm256_mul_ps(s, _mm256_loadu_ps(u + k)));
        }
        for (; k < D; k++) {
            const float inner = g[k] * (0.044715f * g[k] * g[k] + 1.0f);
            o[k] = g[k] / (1.0f + expf(fminf(fmaxf(-1.5957691216057308f * inner, -87.0f), 88.0f))) * u[k];
        }
    }
}

/* out[m, :] = gelu_tanh(g[m, :D]) * u[m, :D]; g and u rows g_stride / u_stride floats apart (x [M, 2D] of a fused
 * gate/up projection: g = x, u = x + D, both strides 2D). */
void gelu_tanh_mul(const float *g, int g_stride, const float *u, int u_stride, float *out, int M, int D,
                   int nthreads) {
    const gelu_job j = {g, g_stride, u, u_stride, out, D};
    run_rows(gelu_rows, &j, M, (size_t)M * D, nthreads);
}
