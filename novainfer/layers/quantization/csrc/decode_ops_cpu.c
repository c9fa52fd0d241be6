/* The small float32 ops of a CPU decode step, one call each instead of 5-10 torch ops: fused residual add
 * + RMSNorm, SiLU-and-mul, rotary embedding in place, the KV store into a bfloat16 paged cache, and decode
 * attention (one query per sequence) over that cache. AVX2+FMA; built with qgemm_cpu.c by cpu_kernels.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_pool.h"
#include "simd_cpu.h"

/* out = w * h / sqrt(mean(h^2) + eps) per row, where h = x + res (stored into res_out) or x alone. */
void add_rms_norm(const float *x, const float *res, float *res_out, const float *w, float eps, float *out,
                  int M, int H) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * H;
        float *h = res ? res_out + (size_t)m * H : (float *)xr;
        double ss = 0.0;
        for (int j = 0; j < H; j++) {
            float v = res ? xr[j] + res[(size_t)m * H + j] : xr[j];
            if (res) h[j] = v;
            ss += (double)v * v;
        }
        const float r = 1.0f / sqrtf((float)(ss / H) + eps);
        float *o = out + (size_t)m * H;
        for (int j = 0; j < H; j++) o[j] = w[j] * (h[j] * r);
    }
}

/* out[m, j] = silu(x[m, j]) * x[m, D + j] for x [M, 2D]. */
void silu_and_mul(const float *x, float *out, int M, int D) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int m = 0; m < M; m++) {
        const float *g = x + (size_t)m * 2 * D, *u = g + D;
        float *o = out + (size_t)m * D;
        int j = 0;
        for (; j + 8 <= D; j += 8) {
            __m256 gv = _mm256_loadu_ps(g + j);
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
        }
        for (; j < D; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* Rotates the first halves against the second halves of every head (GPT-NeoX layout), in place: q and k
 * are [T, heads, D] with row strides; cos/sin tables [max_pos, D]. Returns -1 for a position out of range. */
int rotary_neox(float *q, int q_stride, int nq, float *k, int k_stride, int nk, const int64_t *pos, int T,
                const float *cos_t, const float *sin_t, int max_pos, int D) {
    const int half = D / 2;
    for (int t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return -1;
    for (int t = 0; t < T; t++) {
        const float *c = cos_t + (size_t)pos[t] * D, *s = sin_t + (size_t)pos[t] * D;
        for (int h = 0; h < nq + nk; h++) {
            float *x = h < nq ? q + (size_t)t * q_stride + (size_t)h * D : k + (size_t)t * k_stride + (size_t)(h - nq) * D;
            for (int j = 0; j < half; j++) {
                const float x1 = x[j], x2 = x[j + half];
                x[j] = x1 * c[j] - x2 * s[j];
                x[j + half] = x2 * c[j + half] + x1 * s[j + half];
            }
        }
    }
    return 0;
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffff) > 0x7f800000) return (uint16_t)((b >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

/* k/v rows [T, kv_heads * D] (row strides given) -> bf16 cache [blocks, block_size, kv_heads, D] at slots. */
void store_kv_bf16(const float *k, int k_stride, const float *v, int v_stride, uint16_t *k_cache,
                   uint16_t *v_cache, const int64_t *slots, int T, int width) {
    for (int t = 0; t < T; t++) {
        if (slots[t] < 0) continue;  /* a padding token */
        uint16_t *kc = k_cache + (size_t)slots[t] * width, *vc = v_cache + (size_t)slots[t] * width;
        for (int j = 0; j < width; j++) {
            kc[j] = to_bf16(k[(size_t)t * k_stride + j]);
            vc[j] = to_bf16(v[(size_t)t * v_stride + j]);
        }
    }
}

typedef struct {
    const float *q; int q_stride; const uint16_t *k_cache, *v_cache; const int32_t *block_tables;
    int bt_stride; const int32_t *seq_lens; int nh, nkv, D, block_size, window, max_len; float scale, soft_cap;
    float *scores, *out;
} attn_job;

/* Sequence s = sk / nkv, kv head g = sk % nkv: the group of query heads that share it. Each cached K row is
 * widened from bf16 once for the whole group; positions are walked block by block (no division per position);
 * the softmax exponentials are vectorized; each head's output is accumulated in registers, 64 values at a time. */
static void attend(void *arg, int sk) {
    const attn_job *j = arg;
    const int nkv = j->nkv, D = j->D, bs = j->block_size, group = j->nh / nkv, nvec = D / 8, max_len = j->max_len;
    const int s = sk / nkv, g = sk % nkv, len = j->seq_lens[s];
    const int start = j->window > 0 && len > j->window ? len - j->window : 0;
    const int32_t *bt = j->block_tables + (size_t)s * j->bt_stride;
    const size_t row_stride = (size_t)nkv * D;  /* between positions of one block */
    const float *q0 = j->q + (size_t)s * j->q_stride + (size_t)g * group * D;
    float *sc = j->scores + (size_t)sk * group * max_len;
    float kf[D];
    for (int p = start; p < len;) {
        const int blk = p / bs, end = (blk + 1) * bs < len ? (blk + 1) * bs : len;
        const uint16_t *kp = j->k_cache + ((size_t)bt[blk] * bs + (p - blk * bs)) * row_stride + (size_t)g * D;
        for (; p < end; p++, kp += row_stride) {
            for (int c = 0; c < nvec; c++) _mm256_storeu_ps(kf + 8 * c, load_bf16(kp + 8 * c));
            for (int i = 0; i < group; i++) {
                const float *qh = q0 + (size_t)i * D;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                int c = 0;
                for (; c + 2 <= nvec; c += 2) {
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(kf + 8 * c), _mm256_loadu_ps(qh + 8 * c), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(kf + 8 * c + 8), _mm256_loadu_ps(qh + 8 * c + 8), a1);
                }
                if (c < nvec) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(kf + 8 * c), _mm256_loadu_ps(qh + 8 * c), a0);
                float v = hsum8(_mm256_add_ps(a0, a1)) * j->scale;
                if (j->soft_cap > 0.f) v = j->soft_cap * tanhf(v / j->soft_cap);
                sc[(size_t)i * max_len + p] = v;
            }
        }
    }
    for (int i = 0; i < group; i++) {
        float *row = sc + (size_t)i * max_len, mx = -INFINITY, sum = 0.f;
        int p = start;
        __m256 vmx = _mm256_set1_ps(-INFINITY);
        for (; p + 8 <= len; p += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(row + p));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
        for (; p < len; p++) mx = row[p] > mx ? row[p] : mx;
        const __m256 vm = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (p = start; p + 8 <= len; p += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + p), vm));
            _mm256_storeu_ps(row + p, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        sum = hsum8(vsum);
        for (; p < len; p++) { row[p] = expf(row[p] - mx); sum += row[p]; }
        const __m256 inv = _mm256_set1_ps(1.0f / sum);
        float *o = j->out + ((size_t)s * j->nh + g * group + i) * D;
        for (int c0 = 0; c0 < D; c0 += 64) {
            const int nv = nvec - c0 / 8 < 8 ? nvec - c0 / 8 : 8;
            __m256 acc[8];
            for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
            for (p = start; p < len;) {
                const int blk = p / bs, end = (blk + 1) * bs < len ? (blk + 1) * bs : len;
                const uint16_t *vp = j->v_cache + ((size_t)bt[blk] * bs + (p - blk * bs)) * row_stride + (size_t)g * D + c0;
                for (; p < end; p++, vp += row_stride) {
                    const __m256 w = _mm256_set1_ps(row[p]);
                    if (nv == 8) {
                        for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(w, load_bf16(vp + 8 * k), acc[k]);
                    } else {
                        for (int k = 0; k < nv; k++) acc[k] = _mm256_fmadd_ps(w, load_bf16(vp + 8 * k), acc[k]);
                    }
                }
            }
            for (int k = 0; k < nv; k++) _mm256_storeu_ps(o + c0 + 8 * k, _mm256_mul_ps(acc[k], inv));
        }
    }
}

/* One query per sequence: q [S, nh, D] (row stride q_stride) against the bf16 cache through block tables
 * [S, bt_stride]; out [S, nh, D]. A query at seq_len - 1 sees positions >= seq_len - window (window 0: all);
 * soft_cap > 0 caps scores as cap * tanh(s / cap). D must be a multiple of 8. Returns -1 without memory. */
int decode_attention_bf16(const float *q, int q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *block_tables, int bt_stride, const int32_t *seq_lens, int S, int nh,
                          int nkv, int D, int block_size, float scale, int window, float soft_cap, float *out,
                          int nthreads) {
    int max_len = 1;
    for (int s = 0; s < S; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    attn_job j = {q, q_stride, k_cache, v_cache, block_tables, bt_stride, seq_lens, nh, nkv, D, block_size,
                  window, max_len, scale, soft_cap, NULL, out};
    j.scores = malloc(sizeof(float) * (size_t)S * nh * max_len);
    if (!j.scores) return -1;
    const size_t work = (size_t)S * nh * max_len * D;
    pool_run(attend, &j, S * nkv, work > (1 << 18) ? nthreads : 1);  /* small steps: not worth waking a worker */
    free(j.scores);
    return 0;
}
