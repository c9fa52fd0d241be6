/* The Gated DeltaNet prefill in float32: the causal conv1d (+ SiLU, q/k L2 normalisation) of packed sequences'
 * tokens, then the gated delta rule token by token on each (sequence, value head)'s [Dk, Dv] state, read from and
 * left in the sequence's slot (kernels/gated_delta_rule.py: causal_conv1d_torch and chunk_gated_delta_rule_torch
 * are the torch references).
 *
 * Each column of a head's state evolves on its own, so the rule runs column block by column block, the block
 * (Dk x 64 floats; AVX2: Dk x 32, copied to rows of its own width) staying in L1 across all the sequence's tokens.
 * Per token t (decay a = exp(g_t)):
 *   kv = S^T k;  qs = S^T q;  u = beta (v - a kv);  out = a qs + (k.q) u;  S = a S + k u^T
 * and the vector forms (AVX-512, AVX2) sweep S once per token: the update of token t fused with S^T k and S^T q of
 * token t + 1.
 * prefill_head_ref is the scalar form of the same recurrence. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_pool.h"
#include "simd_cpu.h"
#include "vec_ops_cpu.h"

#define TOKEN_BLOCK 16 /* tokens per conv task */

typedef struct {
    const float *x; int64_t x_stride;
    float *conv_state, *ssm_state; const int64_t *slots; const int32_t *cu; int N;
    const float *conv_wt; /* [K, C]: the conv weight transposed */
    const float *g, *beta;
    int C, K, nk, nv, dk, dv;
    float *conv_out;   /* [T, C]: q (normalised, scaled), k (normalised), v */
    float *out;        /* [T, nv, dv] */
    float *kq;         /* [T, nk]: q . k of each token's key heads (scratch) */
    int *block_seq;    /* conv task -> its sequence */
    int *block_start;  /* conv task -> its first token */
} prefill_job;

/* Up to TOKEN_BLOCK tokens of one sequence: the conv over the slot's window and the sequence's earlier tokens,
 * SiLU, then each key head's q and k normalised. */
static void conv_block(void *arg, int task) {
    const prefill_job *j = arg;
    const int n = j->block_seq[task], s = j->cu[n], e = j->cu[n + 1], C = j->C, K = j->K, W = K - 1;
    const int t0 = j->block_start[task], t1 = t0 + TOKEN_BLOCK < e ? t0 + TOKEN_BLOCK : e;
    const float *win = j->conv_state + (size_t)j->slots[n] * W * C; /* [W][C]: positions s - W .. s - 1 */
    const int key_dim = j->nk * j->dk;
    for (int t = t0; t < t1; t++) {
        float *co = j->conv_out + (size_t)t * C;
        for (int c = 0; c < C; c++) co[c] = 0.f;
        for (int w = 0; w < K; w++) {
            const int p = t - W + w; /* the input position tap w reads */
            const float *in = p >= s ? j->x + (size_t)p * j->x_stride : win + (size_t)(p - s + W) * C;
            const float *wt = j->conv_wt + (size_t)w * C;
            for (int c = 0; c < C; c++) co[c] += in[c] * wt[c];
        }
        int c = 0;
        for (; c + 8 <= C; c += 8) {
            const __m256 a = _mm256_loadu_ps(co + c);
            const __m256 e8 = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
            _mm256_storeu_ps(co + c, _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.f), e8)));
        }
        for (; c < C; c++) co[c] = co[c] / (1.f + expf(-co[c]));
        for (int h = 0; h < j->nk; h++) {
            float *q = co + (size_t)h * j->dk, *k = co + key_dim + (size_t)h * j->dk;
            l2_normalize(q, j->dk, 1.f / sqrtf((float)j->dk));
            l2_normalize(k, j->dk, 1.f);
            j->kq[(size_t)t * j->nk + h] = dot_f32(q, k, j->dk);
        }
    }
}

/* The operands of token t for value head h (key head kh): pointers into conv_out, decay and beta. */
typedef struct { const float *q, *k, *v; float a, b, kq; } token_in;

static inline token_in token_at(const prefill_job *j, int t, int h, int kh) {
    const int key_dim = j->nk * j->dk;
    const float *co = j->conv_out + (size_t)t * j->C;
    token_in r = {co + (size_t)kh * j->dk, co + key_dim + (size_t)kh * j->dk, co + 2 * key_dim + (size_t)h * j->dv,
                  expf(j->g[(size_t)t * j->nv + h]), j->beta[(size_t)t * j->nv + h], j->kq[(size_t)t * j->nk + kh]};
    return r;
}

/* Scalar: columns c0 .. c0 + nc - 1 of state S (row stride dv) over tokens s .. e - 1, out's columns written. */
static void prefill_head_ref(const prefill_job *j, float *S, int h, int kh, int s, int e, int c0, int nc) {
    const int dk = j->dk, dv = j->dv;
    float kv[nc], qs[nc];
    for (int t = s; t < e; t++) {
        const token_in in = token_at(j, t, h, kh);
        for (int c = 0; c < nc; c++) kv[c] = qs[c] = 0.f;
        for (int i = 0; i < dk; i++) {
            const float *row = S + (size_t)i * dv + c0;
            for (int c = 0; c < nc; c++) {
                kv[c] += row[c] * in.k[i];
                qs[c] += row[c] * in.q[i];
            }
        }
        float *o = j->out + ((size_t)t * j->nv + h) * dv + c0;
        for (int c = 0; c < nc; c++) {
            kv[c] = in.b * (in.v[c0 + c] - in.a * kv[c]); /* kv becomes u */
            o[c] = in.a * qs[c] + in.kq * kv[c];
        }
        for (int i = 0; i < dk; i++) {
            float *row = S + (size_t)i * dv + c0;
            for (int c = 0; c < nc; c++) row[c] = in.a * row[c] + in.k[i] * kv[c];
        }
    }
}

/* NB vectors of op set X (vec_ops_cpu.h) of the state's columns from c0, one sweep of them per token (token t's
 * update fused with token t + 1's S^T k and S^T q). S points at those columns of row 0; ld is its row stride. */
#define PREFILL_HEAD(X, NB)                                                                                            \
    X##_TARGET static void prefill_head_##X##_##NB(                                                                    \
        const prefill_job *j, float *S, int ld, int h, int kh, int s, int e, int c0) {                                 \
        const int dk = j->dk, dv = j->dv;                                                                              \
        X##_T kv[NB], qs[NB];                                                                                          \
        token_in in = token_at(j, s, h, kh);                                                                           \
        for (int b = 0; b < NB; b++) kv[b] = qs[b] = X##_ZERO();                                                       \
        for (int i = 0; i < dk; i++) {                                                                                 \
            const float *row = S + (size_t)i * ld;                                                                     \
            const X##_T ki = X##_SET1(in.k[i]), qi = X##_SET1(in.q[i]);                                                \
            for (int b = 0; b < NB; b++) {                                                                             \
                const X##_T x = X##_LOAD(row + X##_W * b);                                                             \
                kv[b] = X##_FMADD(x, ki, kv[b]);                                                                       \
                qs[b] = X##_FMADD(x, qi, qs[b]);                                                                       \
            }                                                                                                          \
        }                                                                                                              \
        for (int t = s; t < e; t++) {                                                                                  \
            const X##_T a = X##_SET1(in.a), beta = X##_SET1(in.b), kq = X##_SET1(in.kq);                               \
            X##_T u[NB];                                                                                               \
            float *o = j->out + ((size_t)t * j->nv + h) * dv + c0;                                                     \
            for (int b = 0; b < NB; b++) {                                                                             \
                const X##_T v = X##_LOAD(in.v + c0 + X##_W * b);                                                       \
                u[b] = X##_MUL(beta, X##_FNMADD(a, kv[b], v));                                                         \
                X##_STORE(o + X##_W * b, X##_FMADD(a, qs[b], X##_MUL(kq, u[b])));                                      \
            }                                                                                                          \
            const float *k = in.k;                                                                                     \
            if (t + 1 == e) {                                                                                          \
                for (int i = 0; i < dk; i++) {                                                                         \
                    float *row = S + (size_t)i * ld;                                                                   \
                    const X##_T ki = X##_SET1(k[i]);                                                                   \
                    for (int b = 0; b < NB; b++)                                                                       \
                        X##_STORE(row + X##_W * b, X##_FMADD(ki, u[b], X##_MUL(a, X##_LOAD(row + X##_W * b))));        \
                }                                                                                                      \
                break;                                                                                                 \
            }                                                                                                          \
            in = token_at(j, t + 1, h, kh);                                                                            \
            for (int b = 0; b < NB; b++) kv[b] = qs[b] = X##_ZERO();                                                   \
            for (int i = 0; i < dk; i++) {                                                                             \
                float *row = S + (size_t)i * ld;                                                                       \
                const X##_T ki = X##_SET1(k[i]), nk = X##_SET1(in.k[i]), nq = X##_SET1(in.q[i]);                       \
                for (int b = 0; b < NB; b++) {                                                                         \
                    const X##_T x = X##_FMADD(ki, u[b], X##_MUL(a, X##_LOAD(row + X##_W * b)));                        \
                    X##_STORE(row + X##_W * b, x);                                                                     \
                    kv[b] = X##_FMADD(x, nk, kv[b]);                                                                   \
                    qs[b] = X##_FMADD(x, nq, qs[b]);                                                                   \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
    }
PREFILL_HEAD(V16, 4)
PREFILL_HEAD(V16, 1)
PREFILL_HEAD(V8, 4)
PREFILL_HEAD(V8, 1)

static int level = -1; /* vec_level's: -1 not yet probed; set_gated_delta_prefill_isa overrides */

/* (sequence, value head) pair `task`: the rule over the sequence's tokens on that head's state in its slot. */
static void rule_task(void *arg, int task) {
    const prefill_job *j = arg;
    const int n = task / j->nv, h = task % j->nv, kh = h / (j->nv / j->nk), s = j->cu[n], e = j->cu[n + 1];
    if (e == s) return;
    float *S = j->ssm_state + ((size_t)j->slots[n] * j->nv + h) * j->dk * j->dv;
    int c = 0;
    if (level == 2) {
        for (; c + 64 <= j->dv; c += 64) prefill_head_V16_4(j, S + c, j->dv, h, kh, s, e, c);
        for (; c + 16 <= j->dv; c += 16) prefill_head_V16_1(j, S + c, j->dv, h, kh, s, e, c);
    }
    if (level >= 1) {
        /* Rows dv floats apart map a column block to a few L1 sets, more lines than their ways: each 32-column
         * block is copied out to rows of its own width, run there and copied back. */
        float blk[j->dk * 32];
        for (; c + 32 <= j->dv; c += 32) {
            for (int i = 0; i < j->dk; i++) memcpy(blk + i * 32, S + (size_t)i * j->dv + c, sizeof(float) * 32);
            prefill_head_V8_4(j, blk, 32, h, kh, s, e, c);
            for (int i = 0; i < j->dk; i++) memcpy(S + (size_t)i * j->dv + c, blk + i * 32, sizeof(float) * 32);
        }
        for (; c + 8 <= j->dv; c += 8) prefill_head_V8_1(j, S + c, j->dv, h, kh, s, e, c);
    }
    if (c < j->dv) prefill_head_ref(j, S, h, kh, s, e, c, j->dv - c);
}

/* isa: 0 scalar, 1 AVX2, 2 AVX-512 (each where the CPU has it), -1 the best available; returns the level used. */
int set_gated_delta_prefill_isa(int isa) { return level = vec_level(isa); }

/* Each sequence's conv window becomes its last W inputs (positions e - W .. e - 1; older ones from the window). */
static void keep_windows(const prefill_job *j) {
    const int C = j->C, W = j->K - 1;
    for (int n = 0; n < j->N; n++) {
        const int s = j->cu[n], e = j->cu[n + 1];
        float *win = j->conv_state + (size_t)j->slots[n] * W * C;
        for (int w = 0; w < W; w++) { /* ascending: row w reads row w + (e - s) > w, not yet overwritten */
            const int p = e - W + w;
            const float *src = p >= s ? j->x + (size_t)p * j->x_stride : win + (size_t)(p - s + W) * C;
            memmove(win + (size_t)w * C, src, sizeof(float) * C);
        }
    }
}

/* The prefill of N packed sequences (tokens cu[n] .. cu[n+1] - 1 of x [T, C], row stride x_stride): each continues
 * from conv_state[slots[n]] ([slots, K-1, C]) and ssm_state[slots[n]] ([slots, nv, dk, dv]) and leaves its final
 * states there (a fresh sequence's slot must hold zeros). conv_wt [K, C]; g, beta [T, nv]; conv_out scratch of
 * T * C floats; out [T, nv, dv]. Returns 0, or -1 when out of memory for its scratch. */
int gated_delta_prefill(const float *x, int64_t x_stride, float *conv_state, float *ssm_state, const int64_t *slots,
                        const int32_t *cu, int N, const float *conv_wt, const float *g, const float *beta, int C, int K,
                        int nk, int nv, int dk, int dv, float *conv_out, float *out, int nthreads) {
    if (level < 0) set_gated_delta_prefill_isa(-1);
    int blocks = 0;
    for (int n = 0; n < N; n++) blocks += (cu[n + 1] - cu[n] + TOKEN_BLOCK - 1) / TOKEN_BLOCK;
    if (blocks == 0) return 0;
    int *table = malloc(sizeof(int) * 2 * (blocks + 1));
    float *kq = malloc(sizeof(float) * ((size_t)cu[N] * nk + 1));
    if (table == NULL || kq == NULL) {
        free(table), free(kq);
        return -1;
    }
    prefill_job j = {.x = x, .x_stride = x_stride, .conv_state = conv_state, .ssm_state = ssm_state, .slots = slots,
                     .cu = cu, .N = N, .conv_wt = conv_wt, .g = g, .beta = beta, .C = C, .K = K, .nk = nk, .nv = nv,
                     .dk = dk, .dv = dv, .conv_out = conv_out, .out = out, .kq = kq, .block_seq = table,
                     .block_start = table + blocks + 1};
    for (int n = 0, b = 0; n < N; n++)
        for (int t = cu[n]; t < cu[n + 1]; t += TOKEN_BLOCK, b++) j.block_seq[b] = n, j.block_start[b] = t;
    pool_run(conv_block, &j, blocks, nthreads < blocks ? nthreads : blocks);
    keep_windows(&j);
    pool_run(rule_task, &j, N * nv, nthreads);
    free(table), free(kq);
    return 0;
}
