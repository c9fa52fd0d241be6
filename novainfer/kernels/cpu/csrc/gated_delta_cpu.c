/* The Gated DeltaNet decode step (one token per sequence) in float32: the causal-conv window update, SiLU,
 * q/k L2 normalisation and the gated delta rule on each value head's [Dk, Dv] state, for B sequences whose
 * states live in slots (layers/linear_attention.py: GatedDeltaNet._decode is the torch reference).
 *
 * Per value head h (key head h / (nv / nk): value heads are grouped by key head), with S its state:
 *   S *= exp(g);  u = beta (v - S^T k);  S += k u^T;  out = S^T q
 * done in two sweeps over S's rows (decay + S^T k, then the update + S^T q). gated_delta_head_ref is the
 * scalar form; AVX-512 and AVX2 forms of the same sweeps run where the CPU has them (picked at run time).
 * gated_rms_norm is the layer's output norm (layers/linear_attention.py: GatedRMSNorm is the torch reference). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_pool.h"
#include "simd_cpu.h"
#include "vec_ops_cpu.h"

typedef struct {
    const float *mixed; int64_t mixed_stride;
    float *conv_state, *ssm_state; const int64_t *slots; const uint8_t *continues;
    const float *conv_w, *g, *beta;
    int C, K, nk, nv, dk, dv;
    float *conv_out; /* scratch [B, C]: q, k and v after the conv (head_task normalises its q and k) */
    float *out;      /* [B, nv, dv] */
    int B, nthreads;
} gdn_job;

#define CONV_CHANNELS 1024 /* channels a conv task takes: one decode row's conv is split over the pool */

static inline int conv_tasks(const gdn_job *j) { return (j->C + CONV_CHANNELS - 1) / CONV_CHANNELS; }

/* Channels [c0, c0 + CONV_CHANNELS) of sequence task / conv_tasks: their conv window shifted by the new input,
 * the conv output (SiLU) into conv_out. Split by channels, not by sequence: at one decode row the whole conv on one
 * thread was 33 us of a Qwen3.5-0.8B layer's 77 us on a 2-core Zen 5. */
static void conv_task(void *arg, int task) {
    const gdn_job *j = arg;
    const int C = j->C, K = j->K, W = K - 1, per = conv_tasks(j), b = task / per;
    const int c0 = (task % per) * CONV_CHANNELS, c1 = c0 + CONV_CHANNELS < C ? c0 + CONV_CHANNELS : C;
    const float *x = j->mixed + (size_t)b * j->mixed_stride;
    float *win = j->conv_state + (size_t)j->slots[b] * C * W;  /* [W][C]: the last W inputs, oldest first */
    float *co = j->conv_out + (size_t)b * C;
    const int keep = j->continues[b];
    for (int c = c0; c < c1; c++) {
        const float *w = j->conv_w + (size_t)c * K;
        float acc = 0.f;
        for (int t = 0; t < W; t++) acc += (keep ? win[(size_t)t * C + c] : 0.f) * w[t];
        acc += x[c] * w[W];
        for (int t = 0; t + 1 < W; t++) win[(size_t)t * C + c] = keep ? win[(size_t)(t + 1) * C + c] : 0.f;
        if (W > 0) win[(size_t)(W - 1) * C + c] = x[c];
        co[c] = acc;
    }
    int c = c0;  /* SiLU, 8 at a time (simd_cpu.h's exp8): expf one channel at a time was most of the conv's time */
    for (const __m256 one = _mm256_set1_ps(1.f); c + 8 <= c1; c += 8) {
        const __m256 a = _mm256_loadu_ps(co + c);
        _mm256_storeu_ps(co + c, _mm256_div_ps(a, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), a)))));
    }
    for (; c < c1; c++) co[c] = co[c] / (1.f + expf(-co[c]));
}

void gated_delta_head_ref(float *S, const float *q, const float *k, const float *v, float decay, float beta,
                          float *out, int dk, int dv) {
    float kv[dv], u[dv];
    for (int c = 0; c < dv; c++) kv[c] = out[c] = 0.f;
    for (int i = 0; i < dk; i++) {
        float *row = S + (size_t)i * dv;
        for (int c = 0; c < dv; c++) {
            row[c] *= decay;
            kv[c] += row[c] * k[i];
        }
    }
    for (int c = 0; c < dv; c++) u[c] = beta * (v[c] - kv[c]);
    for (int i = 0; i < dk; i++) {
        float *row = S + (size_t)i * dv;
        for (int c = 0; c < dv; c++) {
            row[c] += k[i] * u[c];
            out[c] += row[c] * q[i];
        }
    }
}

/* The same sweeps one vector of X's width at a time (dv a multiple of it), for the op sets of vec_ops_cpu.h. */
#define GATED_DELTA_HEAD(X)                                                                                            \
    X##_TARGET static void gated_delta_head_##X(float *S, const float *q, const float *k, const float *v,              \
                                                float decay, float beta, float *out, int dk, int dv) {                 \
        float kv[dv];                                                                                                  \
        const X##_T vd = X##_SET1(decay), vb = X##_SET1(beta);                                                         \
        for (int c = 0; c < dv; c += X##_W) X##_STORE(kv + c, X##_ZERO());                                             \
        for (int i = 0; i < dk; i++) {                                                                                 \
            float *row = S + (size_t)i * dv;                                                                           \
            const X##_T ki = X##_SET1(k[i]);                                                                           \
            for (int c = 0; c < dv; c += X##_W) {                                                                      \
                const X##_T s = X##_MUL(X##_LOAD(row + c), vd);                                                        \
                X##_STORE(row + c, s);                                                                                 \
                X##_STORE(kv + c, X##_FMADD(s, ki, X##_LOAD(kv + c)));                                                 \
            }                                                                                                          \
        }                                                                                                              \
        for (int c = 0; c < dv; c += X##_W) { /* kv becomes u */                                                       \
            X##_STORE(kv + c, X##_MUL(vb, X##_SUB(X##_LOAD(v + c), X##_LOAD(kv + c))));                                \
            X##_STORE(out + c, X##_ZERO());                                                                            \
        }                                                                                                              \
        for (int i = 0; i < dk; i++) {                                                                                 \
            float *row = S + (size_t)i * dv;                                                                           \
            const X##_T ki = X##_SET1(k[i]), qi = X##_SET1(q[i]);                                                      \
            for (int c = 0; c < dv; c += X##_W) {                                                                      \
                const X##_T s = X##_FMADD(ki, X##_LOAD(kv + c), X##_LOAD(row + c));                                    \
                X##_STORE(row + c, s);                                                                                 \
                X##_STORE(out + c, X##_FMADD(s, qi, X##_LOAD(out + c)));                                               \
            }                                                                                                          \
        }                                                                                                              \
    }
GATED_DELTA_HEAD(V16)
GATED_DELTA_HEAD(V8)

static int level = -1; /* vec_level's: -1 not yet probed; set_gated_delta_isa overrides */

/* (sequence, value head) pair `task`: that head's state updated in its slot, its output written. */
static void head_task(void *arg, int claim) {
    const gdn_job *j = arg;
    const int task = pool_chunk_order(claim, j->B * j->nv, j->nthreads);  /* a thread's heads: adjacent states */
    const int b = task / j->nv, h = task % j->nv, rep = j->nv / j->nk, kh = h / rep;
    const int key_dim = j->nk * j->dk;
    const float *co = j->conv_out + (size_t)b * j->C;
    float *S = j->ssm_state + ((size_t)j->slots[b] * j->nv + h) * j->dk * j->dv;
    if (!j->continues[b]) memset(S, 0, sizeof(float) * j->dk * j->dv);
    const float decay = expf(j->g[(size_t)b * j->nv + h]), beta = j->beta[(size_t)b * j->nv + h];
    float q[j->dk], k[j->dk];  /* this head's key head, normalised here (value heads may share it) */
    memcpy(q, co + (size_t)kh * j->dk, sizeof(float) * j->dk);
    memcpy(k, co + key_dim + (size_t)kh * j->dk, sizeof(float) * j->dk);
    l2_normalize(q, j->dk, 1.f / sqrtf((float)j->dk));
    l2_normalize(k, j->dk, 1.f);
    const float *v = co + 2 * key_dim + (size_t)h * j->dv;
    float *out = j->out + ((size_t)b * j->nv + h) * j->dv;
    if (level == 2 && j->dv % 16 == 0)
        gated_delta_head_V16(S, q, k, v, decay, beta, out, j->dk, j->dv);
    else if (level >= 1 && j->dv % 8 == 0)
        gated_delta_head_V8(S, q, k, v, decay, beta, out, j->dk, j->dv);
    else
        gated_delta_head_ref(S, q, k, v, decay, beta, out, j->dk, j->dv);
}

/* isa: 0 scalar, 1 AVX2, 2 AVX-512 (each where the CPU has it), -1 the best available; returns the level used. */
int set_gated_delta_isa(int isa) { return level = vec_level(isa); }

/* One decode step of B sequences. mixed [B, C] (row stride mixed_stride), conv_state [slots, K-1, C],
 * ssm_state [slots, nv, dk, dv], conv_w [C, K], g and beta [B, nv]; continues[b] 0: the sequence starts from
 * zero states. conv_out is scratch of B * C floats; out [B, nv, dv]. */
void gated_delta_decode(const float *mixed, int64_t mixed_stride, float *conv_state, float *ssm_state,
                        const int64_t *slots, const uint8_t *continues, int B, const float *conv_w, const float *g,
                        const float *beta, int C, int K, int nk, int nv, int dk, int dv, float *conv_out, float *out,
                        int nthreads) {
    if (level < 0) set_gated_delta_isa(-1);
    gdn_job j = {mixed, mixed_stride, conv_state, ssm_state, slots, continues, conv_w, g, beta, C, K, nk, nv, dk, dv,
                 conv_out, out, B, nthreads};
    pool_run(conv_task, &j, B * conv_tasks(&j), nthreads);
    pool_run(head_task, &j, B * nv, nthreads);
}

#define NORM_ROWS 64 /* rows per gated_rms_norm task */

typedef struct { const float *x, *z, *w; float eps; int rows, D; float *out; } norm_job;

static void norm_rows(void *arg, int task) {
    const norm_job *j = arg;
    const int r1 = (task + 1) * NORM_ROWS < j->rows ? (task + 1) * NORM_ROWS : j->rows, D = j->D;
    for (int r = task * NORM_ROWS; r < r1; r++) {
        const float *x = j->x + (size_t)r * D, *z = j->z + (size_t)r * D;
        float *o = j->out + (size_t)r * D;
        float ss = 0.f;
        for (int c = 0; c < D; c++) ss += x[c] * x[c];
        const float rs = 1.f / sqrtf(ss / D + j->eps);
        int c = 0;
        for (; c + 8 <= D; c += 8) {
            const __m256 zv = _mm256_loadu_ps(z + c);
            const __m256 ez = exp8(_mm256_sub_ps(_mm256_setzero_ps(), zv));
            const __m256 silu = _mm256_div_ps(zv, _mm256_add_ps(_mm256_set1_ps(1.f), ez));
            const __m256 xn = _mm256_mul_ps(_mm256_loadu_ps(x + c), _mm256_set1_ps(rs));
            _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(j->w + c), xn), silu));
        }
        for (; c < D; c++) o[c] = j->w[c] * (x[c] * rs) * (z[c] / (1.f + expf(-z[c])));
    }
}

/* out = w * x / sqrt(mean(x^2) + eps) * silu(z) over each of the rows of D floats of x and z (contiguous). */
void gated_rms_norm(const float *x, const float *z, const float *w, float eps, int rows, int D, float *out,
                    int nthreads) {
    const norm_job j = {x, z, w, eps, rows, D, out};
    const int tasks = (rows + NORM_ROWS - 1) / NORM_ROWS;
    if (tasks > 0) pool_run(norm_rows, (void *)&j, tasks, nthreads < tasks ? nthreads : tasks);
}
