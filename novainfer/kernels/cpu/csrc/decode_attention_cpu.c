/* Decode attention in C: one query per sequence over the bfloat16 paged cache (the KV store of decode_ops_cpu.c
 * wrote it), float32 softmax, GQA groups served from one widening of each key. Work items are (sequence, KV
 * head, chunk of ATTN_CHUNK positions) on the worker pool. AVX2+FMA; built with qgemm_cpu.c by
 * kernels/cpu/library.py.
 *
 * A query gets the same bits here as at its position in prefill_attention_cpu.c (so a sequence recomputed after
 * preemption, or a prefix-cache hit, continues exactly as it decoded): each score is one lane's FMA chain over
 * d = 0..D-1, then times scale; the softmax is one softmax_row over the whole visible row; P V is one FMA chain
 * over the positions in order, times the row's 1 / sum.
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
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
    _Atomic int *done; /* per (sequence, KV head) of a split context: its chunks whose scores are written */
} attn_job;

/* Positions per work item (the last of a context may be shorter). A context longer than this has its scores
 * computed in chunks so both cores share one sequence's heads (batch 1 has only nkv items otherwise); the chunk
 * that finishes last then takes the softmax over the whole row and P V: a split never changes a row's bits. */
#define ATTN_CHUNK 256

#define SK 16  /* keys per score block: two vectors of 8 keys */
#define SH 4   /* query heads per pass over a score block: 2 x SH independent FMA chains */

/* Scores of the group's query heads q0 [group][D] against SK widened keys kt [D][SK] (key t in lane t):
 * sc_i[t] = scale * (q_i . k_t) as prefill_attention_cpu.c's scores() computes it (FMA over d in order), soft-capped,
 * for t < n. */
static inline void scores16(const float *q0, int group, const float *kt, int D, int n, float scale, float soft_cap,
                            float *sc, int sc_stride) {
    for (int i0 = 0; i0 < group; i0 += SH) {
        const int hb = group - i0 < SH ? group - i0 : SH;
        __m256 a[SH][2];
        for (int i = 0; i < hb; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m256 k0 = _mm256_loadu_ps(kt + (size_t)d * SK), k1 = _mm256_loadu_ps(kt + (size_t)d * SK + 8);
            for (int i = 0; i < hb; i++) {
                const __m256 qb = _mm256_broadcast_ss(q0 + (size_t)(i0 + i) * D + d);
                a[i][0] = _mm256_fmadd_ps(qb, k0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(qb, k1, a[i][1]);
            }
        }
        const __m256 sv = _mm256_set1_ps(scale);
        for (int i = 0; i < hb; i++) {
            float out[SK];
            _mm256_storeu_ps(out, _mm256_mul_ps(a[i][0], sv));
            _mm256_storeu_ps(out + 8, _mm256_mul_ps(a[i][1], sv));
            float *row = sc + (size_t)(i0 + i) * sc_stride;
            for (int t = 0; t < n; t++) row[t] = soft_cap > 0.f ? soft_cap * tanhf(out[t] / soft_cap) : out[t];
        }
    }
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

/* o = sum_p w_i[p] v_p * inv_i over positions start..len for the hb heads i0.. of kv head g, dims c0..c0 + 32. */
static void weigh_block(const attn_job *j, const int32_t *bt, int s, int g, int start, int len, int i0, int hb, int c0,
                        const float *w0, const float *inv) {
    const int D = j->D, group = j->nh / j->nkv, nv = (D - c0) / 8 < 4 ? (D - c0) / 8 : 4;
    const float *w[PV_HEADS];
    for (int i = 0; i < hb; i++) w[i] = w0 + (size_t)(i0 + i) * j->max_len;
    __m256 acc[PV_HEADS][4];
    if (hb == PV_HEADS && nv == 4) weigh_heads(j, bt, g, start, len, c0, 4, w, PV_HEADS, acc);
    else weigh_heads(j, bt, g, start, len, c0, nv, w, hb, acc);
    for (int i = 0; i < hb; i++) {
        float *o = j->out + ((size_t)s * j->nh + g * group + i0 + i) * D + c0;
        const __m256 sv = _mm256_set1_ps(inv[i0 + i]);
        for (int k = 0; k < nv; k++) _mm256_storeu_ps(o + 8 * k, _mm256_mul_ps(acc[i][k], sv));
    }
}

/* The visible positions start..len of sequence s's context. */
static inline void visible_range(const attn_job *j, int s, int *start, int *len) {
    *len = j->seq_lens[s];
    *start = j->window > 0 && *len > j->window ? *len - j->window : 0;
}

/* Work items of one sequence's context for one KV head: its visible positions in chunks of ATTN_CHUNK. */
static int context_chunks(int len, int window) {
    const int visible = window > 0 && len > window ? window : len;
    return visible > ATTN_CHUNK ? (visible + ATTN_CHUNK - 1) / ATTN_CHUNK : 1;
}

/* Item it: sequence s = sk / nkv, kv head g = sk % nkv (the group of query heads that share it), positions of
 * chunk c. Keys are widened from bf16 SK positions at a time, transposed (a lane per key), and serve every head
 * of the group; the softmax exponentials are vectorized; each widened V vector serves up to PV_HEADS heads,
 * accumulated in registers 32 values at a time. A context in one chunk is finished here; a chunk of a split one
 * leaves its scores; the last of its chunks to finish finishes it. */
static void attend(void *arg, int it) {
    const attn_job *j = arg;
    const int sk = j->items[2 * it], c = j->items[2 * it + 1];
    const int nkv = j->nkv, D = j->D, bs = j->block_size, group = j->nh / nkv, max_len = j->max_len;
    const int s = sk / nkv, g = sk % nkv;
    int start, len;
    visible_range(j, s, &start, &len);
    const int lo = start + c * ATTN_CHUNK, hi = len - lo > ATTN_CHUNK ? lo + ATTN_CHUNK : len;
    const int whole = lo == start && hi == len;
    const int32_t *bt = j->block_tables + (size_t)s * j->bt_stride;
    const size_t row_stride = (size_t)nkv * D;  /* between positions of one block */
    const float *q0 = j->q + (size_t)s * j->q_stride + (size_t)g * group * D;
    float *sc = j->scores + (size_t)sk * group * max_len;
    float kt[SK * D];
    for (int p = lo; p < lo + PREFETCH_AHEAD && p < hi; p++)
        prefetch_row(j->k_cache + ((size_t)bt[p / bs] * bs + p % bs) * row_stride + (size_t)g * D, D);
    for (int p0 = lo; p0 < hi; p0 += SK) {
        const int n = hi - p0 < SK ? hi - p0 : SK;
        for (int h = 0; h < SK; h += 8) {
            const uint16_t *kr[8];
            for (int t = 0; t < 8; t++) {
                const int p = p0 + h + t;
                if (p >= hi) {
                    kr[t] = NULL;
                    continue;
                }
                const size_t row = ((size_t)bt[p / bs] * bs + p % bs) * row_stride + (size_t)g * D;
                kr[t] = j->k_cache + row;
                /* the cache is cold after a step's weights streamed through: fetch keys ahead, and the values the
                 * weighted sum will read once the softmax is done */
                const int pa = p + PREFETCH_AHEAD;
                if (pa < hi)
                    prefetch_row(j->k_cache + ((size_t)bt[pa / bs] * bs + pa % bs) * row_stride + (size_t)g * D, D);
                prefetch_row(j->v_cache + row, D);
            }
            int d0 = 0;
            /* 16 dims at a time: transpose 8 keys' dim pairs (one 32-bit element each), then widen the even dim of a
             * pair by a shift and the odd one by a mask: no conversion shuffles */
            for (; d0 + 16 <= D; d0 += 16) {
                __m256i r[8];
                for (int t = 0; t < 8; t++)
                    r[t] = kr[t] ? _mm256_loadu_si256((const __m256i *)(kr[t] + d0)) : _mm256_setzero_si256();
                transpose8(r);
                const __m256i hi16 = _mm256_set1_epi32((int)0xFFFF0000u);
                for (int e = 0; e < 8; e++) {
                    _mm256_storeu_ps(kt + (size_t)(d0 + 2 * e) * SK + h, _mm256_castsi256_ps(_mm256_slli_epi32(r[e], 16)));
                    _mm256_storeu_ps(kt + (size_t)(d0 + 2 * e + 1) * SK + h,
                                     _mm256_castsi256_ps(_mm256_and_si256(r[e], hi16)));
                }
            }
            for (; d0 < D; d0 += 8) {
                __m256i r[8];
                for (int t = 0; t < 8; t++)
                    r[t] = kr[t] ? _mm256_castps_si256(load_bf16(kr[t] + d0)) : _mm256_setzero_si256();
                transpose8(r);
                for (int t = 0; t < 8; t++) _mm256_storeu_ps(kt + (size_t)(d0 + t) * SK + h, _mm256_castsi256_ps(r[t]));
            }
        }
        scores16(q0, group, kt, D, n, j->scale, j->soft_cap, sc + p0, max_len);
    }
    /* a split context: the last of its chunks to finish (the others' scores are visible after the atomic) goes on */
    if (!whole && atomic_fetch_add(&j->done[sk], 1) + 1 < context_chunks(len, j->window)) return;
    float inv[group];
    for (int i = 0; i < group; i++) {  /* the soft cap was applied with the scores; a sink as the prefill takes it */
        float mx;
        inv[i] = softmax_row(sc + (size_t)i * max_len + start, len - start, 0, len - start - 1, 0.f, &mx);
        if (j->sinks) inv[i] = sink_inv(inv[i], mx, j->sinks[g * group + i]);
    }
    for (int i0 = 0; i0 < group; i0 += PV_HEADS)
        for (int c0 = 0; c0 < D; c0 += 32)
            weigh_block(j, bt, s, g, start, len, i0, group - i0 < PV_HEADS ? group - i0 : PV_HEADS, c0, sc, inv);
}

/* One query per sequence: q [S, nh, D] (row stride q_stride) against the bf16 cache through block tables
 * [S, bt_stride]; out [S, nh, D]. A query at seq_len - 1 sees positions >= seq_len - window (window 0: all);
 * soft_cap > 0 caps scores as cap * tanh(s / cap); sinks (NULL: none) holds each head's sink logit. D must be a
 * multiple of 8. Returns KV_OK, KV_NO_MEMORY, or
 * (reading nothing) check_block_tables' error for a cache of num_blocks blocks. */
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
    j.done = split ? calloc((size_t)S * nkv, sizeof(_Atomic int)) : NULL;
    if (!items || !j.scores || (split && !j.done)) {
        free(items), free(j.scores), free((void *)j.done);
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
    free(items), free(j.scores), free((void *)j.done);
    return KV_OK;
}
