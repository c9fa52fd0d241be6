/* A Gated DeltaNet layer's decode step in one call (Qwen3.5 / Qwen3-Next, layers/linear_attention.py): the four
 * input projections, the gates (beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)), the conv window and
 * the delta rule on the layer's state slots (gated_delta_decode), the gated RMSNorm and out_proj. It runs the
 * kernels the layer-by-layer path calls, in the same order; what it saves is that path's ~30 Python-level calls
 * a layer (18 of Qwen3.5-0.8B's 24 layers are DeltaNet ones). Wrapper: kernels/cpu/gdn_layer.py. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "stack_cpu.h"

/* Everything the layer reads; the layout matches GDNLayerDesc in kernels/cpu/gdn_layer.py. */
typedef struct {
    qlinear in_qkv, in_z, in_b, in_a, out;
    const float *b_dense, *a_dense;  /* [nv, H] float32 where the file keeps in_b / in_a unquantized, else NULL */
    const float *conv_w;   /* [C, K] */
    const float *neg_a;    /* -exp(A_log) [nv] */
    const float *dt_bias;  /* [nv] */
    const float *norm_w;   /* [dv] */
    float eps;
    float *conv_state, *ssm_state;  /* [slots, K - 1, C], [slots, nv, dk, dv] */
    int C, K, nk, nv, dk, dv;
} gdn_layer;

/* Floats of workspace gdn_layer_decode needs for M rows. */
size_t gdn_layer_workspace(const gdn_layer *d, int M) {
    const size_t vd = (size_t)d->nv * d->dv;
    return (2 * (size_t)d->C + 3 * vd + 4 * (size_t)d->nv) * (size_t)M;
}

/* y [M, N] = x [M, K] W^T: the packed layer, or a dense float32 W (a few rows: the heads' gate inputs). */
static int small_linear(const qlinear *l, const float *dense, const float *x, int M, int N, int K, float *y,
                        int nthreads) {
    if (!dense) return linear(l, x, M, y, nthreads);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            const float *w = dense + (size_t)n * K, *xm = x + (size_t)m * K;
            float acc = 0.f;
            for (int k = 0; k < K; k++) acc += xm[k] * w[k];
            y[(size_t)m * N + n] = acc;
        }
    return STACK_OK;
}

static inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

/* x [M, H]: the layer's normed input, one decode row per sequence; out [M, H]. slots [M] (int64): each sequence's
 * state slot; continues[m] 0: the sequence starts from zero states. ws: gdn_layer_workspace(d, M) floats. */
int gdn_layer_decode(const gdn_layer *d, const float *x, int M, const int64_t *slots, const uint8_t *continues,
                     float *out, float *ws, int nthreads) {
    const size_t vd = (size_t)d->nv * d->dv;
    float *mixed = ws, *conv = mixed + (size_t)M * d->C, *z = conv + (size_t)M * d->C, *core = z + (size_t)M * vd;
    float *normed = core + (size_t)M * vd, *b = normed + (size_t)M * vd, *a = b + (size_t)M * d->nv;
    float *g = a + (size_t)M * d->nv, *beta = g + (size_t)M * d->nv;
    int rc;
    if ((rc = linear(&d->in_qkv, x, M, mixed, nthreads))) return rc;
    if ((rc = linear(&d->in_z, x, M, z, nthreads))) return rc;
    if ((rc = small_linear(&d->in_b, d->b_dense, x, M, d->nv, d->in_qkv.K, b, nthreads))) return rc;
    if ((rc = small_linear(&d->in_a, d->a_dense, x, M, d->nv, d->in_qkv.K, a, nthreads))) return rc;
    for (int m = 0; m < M; m++)
        for (int h = 0; h < d->nv; h++) {
            const size_t i = (size_t)m * d->nv + h;
            beta[i] = 1.f / (1.f + expf(-b[i]));
            g[i] = d->neg_a[h] * softplus(a[i] + d->dt_bias[h]);
        }
    gated_delta_decode(mixed, d->C, d->conv_state, d->ssm_state, slots, continues, M, d->conv_w, g, beta, d->C, d->K,
                       d->nk, d->nv, d->dk, d->dv, conv, core, nthreads);
    gated_rms_norm(core, z, d->norm_w, d->eps, M * d->nv, d->dv, normed, nthreads);
    return linear(&d->out, normed, M, out, nthreads);
}
