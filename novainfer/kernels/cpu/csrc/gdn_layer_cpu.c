/* A Gated DeltaNet decoder layer's decode step in one call (Qwen3.5 / Qwen3-Next, models/qwen3_5.py): gdn_mixer_decode
 * is the token mixer (layers/linear_attention.py): the four input projections, the gates (beta = sigmoid(b),
 * g = -exp(A_log) * softplus(a + dt_bias)), the conv window and the delta rule on the layer's state slots
 * (gated_delta_decode), the gated RMSNorm and out_proj; gdn_layer_decode wraps it in the decoder layer: residual add
 * + input RMSNorm, the mixer, residual add + post RMSNorm, the dense SiLU MLP. It runs the kernels the layer-by-layer
 * path calls, in the same order; what it saves is that path's ~40 Python-level calls a layer (18 of Qwen3.5-0.8B's
 * 24 layers are DeltaNet ones). Wrapper: kernels/cpu/gdn_layer.py. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "stack_cpu.h"

/* Everything the layer reads; the layout matches GDNLayerDesc in kernels/cpu/gdn_layer.py. */
typedef struct gdn_layer {
    qlinear in_qkv, in_z, in_b, in_a, out;
    const float *b_dense, *a_dense;  /* [nv, H] float32 where the file keeps in_b / in_a unquantized, else NULL */
    const float *input_norm, *post_norm;  /* the decoder layer's (weights 1 + w), NULL for the mixer alone */
    float input_eps, post_eps;
    qlinear gate_up, down;
    const float *conv_w;   /* [C, K] */
    const float *neg_a;    /* -exp(A_log) [nv] */
    const float *dt_bias;  /* [nv] */
    const float *norm_w;   /* [dv] */
    float eps;
    float *conv_state, *ssm_state;  /* [slots, K - 1, C], [slots, nv, dk, dv] */
    int C, K, nk, nv, dk, dv;
} gdn_layer;

/* Floats of workspace gdn_layer_decode needs for M rows (gdn_mixer_decode: the first part). */
size_t gdn_layer_workspace(const gdn_layer *d, int M) {
    const size_t vd = (size_t)d->nv * d->dv, H = (size_t)d->in_qkv.K;
    const size_t mixer = 2 * (size_t)d->C + 3 * vd + 4 * (size_t)d->nv;
    return (mixer + 2 * H + (size_t)d->gate_up.N + (size_t)d->gate_up.N / 2) * (size_t)M;
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

/* x [M, H]: the mixer's (normed) input, one decode row per sequence; out [M, H]. slots [M] (int64): each sequence's
 * state slot; continues[m] 0: the sequence starts from zero states. ws: gdn_layer_workspace(d, M) floats. */
int gdn_mixer_decode(const gdn_layer *d, const float *x, int M, const int64_t *slots, const uint8_t *continues,
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

/* The decoder layer: h [M, H] the previous layer's output, res its residual (NULL for the first layer: h is the
 * residual); res_out [M, H] the new residual, out [M, H] the MLP's output. Needs the descriptor's norms and MLP. */
int gdn_layer_decode(const gdn_layer *d, const float *h, const float *res, float *res_out, float *out, int M,
                     const int64_t *slots, const uint8_t *continues, float *ws, int nthreads) {
    const int H = d->in_qkv.K, I = d->gate_up.N / 2;
    const size_t vd = (size_t)d->nv * d->dv;
    float *normed = ws + (2 * (size_t)d->C + 3 * vd + 4 * (size_t)d->nv) * (size_t)M, *mixed = normed + (size_t)M * H;
    float *gate_up = mixed + (size_t)M * H, *act = gate_up + (size_t)M * d->gate_up.N;
    add_rms_norm(h, res, res ? res_out : NULL, d->input_norm, d->input_eps, normed, M, H, nthreads);
    if (!res) memcpy(res_out, h, sizeof(float) * (size_t)M * H);
    int rc = gdn_mixer_decode(d, normed, M, slots, continues, mixed, ws, nthreads);
    if (rc) return rc;
    add_rms_norm(mixed, res_out, res_out, d->post_norm, d->post_eps, normed, M, H, nthreads);
    if ((rc = linear(&d->gate_up, normed, M, gate_up, nthreads))) return rc;
    silu_and_mul(gate_up, act, M, I, nthreads);
    return linear(&d->down, act, M, out, nthreads);
}
