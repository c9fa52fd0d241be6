/* Decode attention in C: one query per sequence over the bfloat16 paged cache (the KV store of decode_ops_cpu.c
 * wrote it), float32 softmax, GQA groups served from one widening of each key. Work items are (sequence, KV
 * head, chunk of ATTN_CHUNK positions) on the worker pool; a split context's chunks are merged flash-decoding
 * style. AVX2+FMA; built with qgemm_cpu.c by kernels/cpu/library.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"
#include "cpu_pool.h"
#include "simd_cpu.h"

typedef struct {
    const float *q; int q_stride; const uint16_t *k_cache, *v_cache; const int32_t *block_tables;
    int bt_stride; const int32_t *seq_lens; int nh, nkv, D, block_size, window, max_len; float scale, soft_cap;
    const float *sinks;  /* [nh] attention sink logits, or NULL */
    float *scores, *out;
    const int *items;  /* work item -> (sk, chunk), two ints each */
    float *part;       /* per item of a split context, per head: D partial sums, then the chunk's max and exp-sum */
} attn_job;

/* Positions per work item (the last of a context may be shorter). A context longer than this is split so both
 * cores share one sequence's heads (batch 1 has only nkv items otherwise); the split depends on the context
 * alone, so a row's bits never depend on what else is in the batch. */
#define ATTN_CHUNK 256

/* The 8 sums of 8 vectors, in order: lane t = the sum of v[t]'s lanes. */
static inline __m256 hsum8x8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* Scores of one query head against 8 widened keys kf [8][D]: sc[0..n) = scale * q . k_t (soft-capped). */
static inline void scores8(const float *qh, const float *kf, int D, int n, float scale, float soft_cap, float *sc) {
    __m256 acc[8];
    for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
    for (int c = 0; c < D; c += 8) {
        const __m256 qv = _mm256_loadu_ps(qh + c);
        for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(kf + (size_t)t * D + c), qv, acc[t]);
    }
    float out[8];
    _mm256_storeu_ps(out, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
    for (int t = 0; t < n; t++) sc[t] = soft_cap > 0.f ? soft_cap * tanhf(out[t] / soft_cap) : out[t];
}

#define PREFETCH_AHEAD 16  /* positions of keys requested ahead of their use */

/* Requests the D bfloat16 values at p into the cache (one prefetch per 64-byte line). */
static inline void prefetch_row(const uint16_t *p, int D) {
    for (int c = 0; c < D; c += 32) _mm_prefetch((const char *)(p + c), _MM_HINT_T0);
}

#define PV_HEADS 3  /* heads sharing one widened V vector: 3 x 4 accumulators + V + 3 weights fill the 16 ymm */

/* o_i[c0..c0 + 8 nv) += sum_p w_i[p] v_p for hb (<= PV_HEADS) heads, positions start..len through the table. */
static inline __attribute__((always_inline)) void weigh_heads(const attn_job *j, const int32_t *bt, int g, int start,
                                                             int len, int c0, int nv, const float *const *w, int hb,
                                                             __m256 acc[PV_HEADS][4]) {
    const int bs = j->block_size;
    const size_t row_stride = (size_t)j->nkv * j->D;
    for (int i = 0; i < hb; i++)
        for (int k = 0; k < 4; k++) acc[i][k] = _mm256_setzero_ps();
    for (int p = start; p < len;) {
        const int blk = p / bs, end = (blk + 1) * bs < len ? (blk + 1) * bs : len;
        const uint16_t *vp = j->v_cache + ((size_t)bt[blk] * bs + (p - blk * bs)) * row_stride + (size_t)g * j->D + c0;
        for (; p < end; p++, vp += row_stride)
            for (int k = 0; k < nv; k++) {
                const __m256 v = load_bf16(vp + 8 * k);
                for (int i = 0; i < hb; i++) acc[i][k] = _mm256_fmadd_ps(_mm256_set1_ps(w[i][p]), v, acc[i][k]);
            }
    }
}

/* Item it: sequence s = sk / nkv, kv head g = sk % nkv (the group of query heads that share it), positions of
 * chunk c. Keys are widened from bf16 8 positions at a time and serve every head of the group, each head's 8
 * scores reduced together (no horizontal sum per score); the softmax exponentials are vectorized; each widened
 * V vector serves up to PV_HEADS heads, accumulated in registers 32 values at a time. A context in one chunk
 * writes its output; a chunk of a split one writes its unnormalized sums, max and exp-sum for merge_chunks. */
static void attend(void *arg, int it) {
    const attn_job *j = arg;
    const int sk = j->items[2 * it], c = j->items[2 * it + 1];
    const int nkv = j->nkv, D = j->D, bs = j->block_size, group = j->nh / nkv, max_len = j->max_len;
    const int s = sk / nkv, g = sk % nkv, len = j->seq_lens[s];
    const int start = j->window > 0 && len > j->window ? len - j->window : 0;
    const int lo = start + c * ATTN_CHUNK, hi = len - lo > ATTN_CHUNK ? lo + ATTN_CHUNK : len;
    const int whole = lo == start && hi == len;
    const int32_t *bt = j->block_tables + (size_t)s * j->bt_stride;
    const size_t row_stride = (size_t)nkv * D;  /* between positions of one block */
    const float *q0 = j->q + (size_t)s * j->q_stride + (size_t)g * group * D;
    float *sc = j->scores + (size_t)sk * group * max_len;
    float kf[8 * D];
    for (int p = lo; p < lo + PREFETCH_AHEAD && p < hi; p++)
        prefetch_row(j->k_cache + ((size_t)bt[p / bs] * bs + p % bs) * row_stride + (size_t)g * D, D);
    for (int p0 = lo; p0 < hi; p0 += 8) {
        const int n = hi - p0 < 8 ? hi - p0 : 8;
        for (int t = 0; t < 8; t++) {
            const int p = p0 + t;
            if (t >= n) {
                for (int cc = 0; cc < D; cc += 8) _mm256_storeu_ps(kf + (size_t)t * D + cc, _mm256_setzero_ps());
                continue;
            }
            const size_t row = ((size_t)bt[p / bs] * bs + p % bs) * row_stride + (size_t)g * D;
            const uint16_t *kp = j->k_cache + row;
            /* the cache is cold after a step's weights streamed through: fetch keys ahead, and the values the
             * weighted sum will read once the softmax is done */
            const int pa = p + PREFETCH_AHEAD;
            if (pa < hi)
                prefetch_row(j->k_cache + ((size_t)bt[pa / bs] * bs + pa % bs) * row_stride + (size_t)g * D, D);
            prefetch_row(j->v_cache + row, D);
            for (int cc = 0; cc < D; cc += 8) _mm256_storeu_ps(kf + (size_t)t * D + cc, load_bf16(kp + cc));
        }
        for (int i = 0; i < group; i++)
            scores8(q0 + (size_t)i * D, kf, D, n, j->scale, j->soft_cap, sc + (size_t)i * max_len + p0);
    }
    float inv[group], mx[group];
    for (int i = 0; i < group; i++) {  /* the soft cap was applied with the scores */
        inv[i] = softmax_row(sc + (size_t)i * max_len + lo, hi - lo, 0, hi - lo - 1, 0.f, &mx[i]);
        if (whole && j->sinks) inv[i] = sink_inv(inv[i], mx[i], j->sinks[g * group + i]);  /* split: at the merge */
    }
    float *part = whole ? NULL : j->part + (size_t)it * group * (D + 2);
    for (int i0 = 0; i0 < group; i0 += PV_HEADS) {
        const int hb = group - i0 < PV_HEADS ? group - i0 : PV_HEADS;
        const float *w[PV_HEADS];
        for (int i = 0; i < hb; i++) w[i] = sc + (size_t)(i0 + i) * max_len;
        for (int c0 = 0; c0 < D; c0 += 32) {
            const int nv = (D - c0) / 8 < 4 ? (D - c0) / 8 : 4;
            __m256 acc[PV_HEADS][4];
            if (hb == PV_HEADS && nv == 4) weigh_heads(j, bt, g, lo, hi, c0, 4, w, PV_HEADS, acc);
            else weigh_heads(j, bt, g, lo, hi, c0, nv, w, hb, acc);
            for (int i = 0; i < hb; i++) {
                float *o = part ? part + (size_t)(i0 + i) * (D + 2) + c0
                                : j->out + ((size_t)s * j->nh + g * group + i0 + i) * D + c0;
                const __m256 sv = _mm256_set1_ps(part ? 1.f : inv[i0 + i]);
                for (int k = 0; k < nv; k++) _mm256_storeu_ps(o + 8 * k, _mm256_mul_ps(acc[i][k], sv));
            }
        }
    }
    if (part)
        for (int i = 0; i < group; i++) {
            part[(size_t)i * (D + 2) + D] = mx[i];
            part[(size_t)i * (D + 2) + D + 1] = 1.f / inv[i];
        }
}

/* Work items of one sequence's context for one KV head: its visible positions in chunks of ATTN_CHUNK. */
static int context_chunks(int len, int window) {
    const int visible = window > 0 && len > window ? window : len;
    return visible > ATTN_CHUNK ? (visible + ATTN_CHUNK - 1) / ATTN_CHUNK : 1;
}

/* The output of each head of a split context from its n chunks' partial results (items first..first + n - 1):
 * sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c, chunks in order. */
static void merge_chunks(const attn_job *j, int s, int g, int first, int n) {
    const int D = j->D, group = j->nh / j->nkv;
    for (int i = 0; i < group; i++) {
        const float *p0 = j->part + ((size_t)first * group + i) * (D + 2);
        const size_t step = (size_t)group * (D + 2);  /* between one head's rows of consecutive items */
        float M = -INFINITY, L = 0.f;
        for (int c = 0; c < n; c++) M = p0[c * step + D] > M ? p0[c * step + D] : M;
        float *o = j->out + ((size_t)s * j->nh + g * group + i) * D;
        for (int d = 0; d < D; d++) o[d] = 0.f;
        for (int c = 0; c < n; c++) {
            const float *p = p0 + c * step, f = expf(p[D] - M);
            L += f * p[D + 1];
            for (int d = 0; d < D; d++) o[d] += f * p[d];
        }
        if (j->sinks) L += expf(j->sinks[g * group + i] - M);
        for (int d = 0; d < D; d++) o[d] /= L;
    }
}

/* One query per sequence: q [S, nh, D] (row stride q_stride) against the bf16 cache through block tables
 * [S, bt_stride]; out [S, nh, D]. A query at seq_len - 1 sees positions >= seq_len - window (window 0: all);
 * soft_cap > 0 caps scores as cap * tanh(s / cap); sinks (NULL: none) holds each head's sink logit. D must be a
 * multiple of 8. Returns KV_OK, KV_NO_MEMORY, or (reading nothing) check_block_tables' error for a cache of
 * num_blocks blocks. */
int decode_attention_bf16(const float *q, int q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *block_tables, int bt_stride, const int32_t *seq_lens, int S, int nh,
                          int nkv, int D, int block_size, float scale, int window, float soft_cap,
                          const float *sinks, float *out, int nthreads, int num_blocks, int *where) {
    const int rc = check_block_tables(block_tables, bt_stride, seq_lens, S, block_size, num_blocks, where);
    if (rc) return rc;
    int max_len = 1;
    for (int s = 0; s < S; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    attn_job j = {q, q_stride, k_cache, v_cache, block_tables, bt_stride, seq_lens, nh, nkv, D, block_size,
                  window, max_len, scale, soft_cap, sinks, NULL, out, NULL, NULL};
    int nitems = 0, split = 0;
    for (int s = 0; s < S; s++) {
        const int n = context_chunks(seq_lens[s], window);
        nitems += nkv * n;
        split |= n > 1;
    }
    int *items = malloc(sizeof(int) * 2 * (size_t)nitems);
    j.scores = malloc(sizeof(float) * (size_t)S * nh * max_len);
    j.part = split ? malloc(sizeof(float) * (size_t)nitems * (nh / nkv) * (D + 2)) : NULL;
    if (!items || !j.scores || (split && !j.part)) {
        free(items), free(j.scores), free(j.part);
        return KV_NO_MEMORY;
    }
    for (int s = 0, it = 0; s < S; s++) {
        const int n = context_chunks(seq_lens[s], window);
        for (int g = 0; g < nkv; g++)
            for (int c = 0; c < n; c++, it++) items[2 * it] = s * nkv + g, items[2 * it + 1] = c;
    }
    j.items = items;
    const size_t work = (size_t)S * nh * max_len * D;
    pool_run(attend, &j, nitems, work > (1 << 14) ? nthreads : 1);  /* small steps: not worth waking a worker */
    for (int it = 0; split && it < nitems;) {
        int n = 1;
        while (it + n < nitems && items[2 * (it + n)] == items[2 * it]) n++;
        if (n > 1) merge_chunks(&j, items[2 * it] / nkv, items[2 * it] % nkv, it, n);
        it += n;
    }
    free(items), free(j.scores), free(j.part);
    return KV_OK;
}
