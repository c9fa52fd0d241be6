/* A whole decode step of a Gemma 4 decoder stack in one call (decoder_stack_cpu.c's counterpart for Gemma 4): per
 * layer, RMSNorm, the q/k/v (or k = v, or q alone on a KV-shared layer) GEMM, per-head q/k/v norms, rotary, the
 * bf16 KV store, decode attention over the layer's own or its source layer's cache, o_proj, post-norm + residual,
 * the GELU-gated MLP, post-norm + residual, the per-layer input (gate GEMM, GELU times the layer's slice of the
 * per-layer inputs, projection, norm + residual), the layer scalar; then the final norm. It calls the kernels the
 * layer-by-layer path of models/gemma4.py calls on the quantized CPU path, in the same order, so the hidden states
 * are the same to the bit. Wrapper: kernels/cpu/gemma4_stack.py; worker/cpu_gemma4_stack.py fills the descriptors.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "stack_cpu.h"

/* The tables and slots of one KV group (a layout with sliding-window groups gives each group its own). */
typedef struct {
    const int64_t *slots;
    const int32_t *block_tables;
    const int32_t *seq_lens;
    int bt_stride, num_blocks;
} kv_group;

/* Everything one layer reads; the layout matches Gemma4LayerDesc in kernels/cpu/gemma4_stack.py. */
typedef struct {
    const float *input_norm, *post_attn_norm, *pre_ff_norm, *post_ff_norm, *q_norm, *k_norm, *ones, *ple_norm;
    float eps, layer_scalar;
    qlinear qkv, o, gate_up, down, ple_gate, ple_proj;  /* qkv: q, k(, v); q alone where own_kv is 0 */
    uint16_t *k_cache, *v_cache;                        /* [blocks, block_size, nkv, D] bf16: own or the source's */
    const float *cos, *sin;                             /* rotary tables [max_pos, D] */
    int max_pos, nh, nkv, D, block_size, window, own_kv, k_eq_v, group, ple;
} gemma4_layer;

/* Floats of workspace gemma4_stack_decode needs for M rows. */
size_t gemma4_stack_workspace(const gemma4_layer *layers, int L, int M, int H) {
    size_t widest = 0;
    for (int l = 0; l < L; l++) {
        const gemma4_layer *d = layers + l;
        const size_t kv = (size_t)d->nkv * d->D;
        size_t w = (size_t)d->qkv.N + 2 * kv + (size_t)d->nh * d->D;  /* qkv, normed k and v, attention output */
        if ((size_t)d->gate_up.N + d->gate_up.N / 2 > w) w = (size_t)d->gate_up.N + d->gate_up.N / 2;
        if ((size_t)d->ple_gate.N * 2 > w) w = (size_t)d->ple_gate.N * 2;
        if (w > widest) widest = w;
    }
    return (4 * (size_t)H + widest) * (size_t)M;
}

/* embeds [M, H]: the step's scaled token embeddings (one decode row each); ple [M, L, P]: the per-layer inputs (or
 * NULL); out [M, H]: final_norm(h). pos [M] int64; groups[layer.group] holds each layer's slots, block tables and
 * sequence lengths. ws: gemma4_stack_workspace(...) floats. Returns STACK_OK or an error code; the KV indices are
 * checked before the first layer writes (where: the offending token, or sequence and table entry). */
int gemma4_stack_decode(const gemma4_layer *layers, int L, const float *final_norm, float final_eps,
                        const float *embeds, const float *ple, float *out, int M, int H, const int64_t *pos,
                        const kv_group *groups, float *ws, int nthreads, int *where) {
    for (int l = 0; l < L; l++) {
        const gemma4_layer *d = layers + l;
        const kv_group *g = groups + d->group;
        int rc = d->own_kv ? check_kv_slots(g->slots, M, (int64_t)g->num_blocks * d->block_size, where) : 0;
        if (!rc) rc = check_block_tables(g->block_tables, g->bt_stride, g->seq_lens, M, d->block_size, g->num_blocks, where);
        if (rc) return kv_error(rc);
    }
    float *h = ws, *normed = h + (size_t)M * H, *res = normed + (size_t)M * H, *tmp = res + (size_t)M * H;
    float *scratch = tmp + (size_t)M * H;
    memcpy(h, embeds, sizeof(float) * (size_t)M * H);
    for (int l = 0; l < L; l++) {
        const gemma4_layer *d = layers + l;
        const kv_group *g = groups + d->group;
        const int qkv_w = d->qkv.N, q_size = d->nh * d->D, kv_size = d->nkv * d->D;
        float *qkv = scratch, *k = scratch + (size_t)M * qkv_w, *v = k + (size_t)M * kv_size;
        float *attn = v + (size_t)M * kv_size;
        add_rms_norm(h, NULL, NULL, d->input_norm, d->eps, normed, M, H, nthreads);
        int rc = linear(&d->qkv, normed, M, qkv, nthreads);
        if (rc) return rc;
        for (int m = 0; m < M; m++) {  /* per-head norms, into q in place and k / v apart (v: weightless) */
            float *row = qkv + (size_t)m * qkv_w;
            add_rms_norm(row, NULL, NULL, d->q_norm, d->eps, row, d->nh, d->D, nthreads);
            if (!d->own_kv) continue;
            const float *raw_v = d->k_eq_v ? row + q_size : row + q_size + kv_size;
            add_rms_norm(row + q_size, NULL, NULL, d->k_norm, d->eps, k + (size_t)m * kv_size, d->nkv, d->D, nthreads);
            add_rms_norm(raw_v, NULL, NULL, d->ones, d->eps, v + (size_t)m * kv_size, d->nkv, d->D, nthreads);
        }
        if (rotary_neox(qkv, qkv_w, d->nh, k, kv_size, d->own_kv ? d->nkv : 0, pos, M, d->cos, d->sin, d->max_pos,
                        d->D, nthreads))
            return STACK_BAD_POSITION;
        if (d->own_kv && (rc = store_kv_bf16(k, kv_size, v, kv_size, d->k_cache, d->v_cache, g->slots, M, kv_size,
                                             nthreads, (int64_t)g->num_blocks * d->block_size, where)))
            return kv_error(rc);
        if ((rc = decode_attention_bf16(qkv, qkv_w, d->k_cache, d->v_cache, g->block_tables, g->bt_stride,
                                        g->seq_lens, M, d->nh, d->nkv, d->D, d->block_size, 1.0f, d->window, 0.0f,
                                        NULL, attn, nthreads, g->num_blocks, where)))
            return kv_error(rc);
        if ((rc = linear(&d->o, attn, M, tmp, nthreads))) return rc;
        rms_norm_add(tmp, H, d->post_attn_norm, d->eps, h, res, M, H, nthreads);
        add_rms_norm(res, NULL, NULL, d->pre_ff_norm, d->eps, normed, M, H, nthreads);
        float *gate_up = scratch, *act = scratch + (size_t)M * d->gate_up.N;
        const int I = d->gate_up.N / 2;
        if ((rc = linear(&d->gate_up, normed, M, gate_up, nthreads))) return rc;
        gelu_tanh_mul(gate_up, 2 * I, gate_up + I, 2 * I, act, M, I, nthreads);
        if ((rc = linear(&d->down, act, M, tmp, nthreads))) return rc;
        rms_norm_add(tmp, H, d->post_ff_norm, d->eps, res, h, M, H, nthreads);
        if (d->ple) {
            const int P = d->ple_gate.N;
            float *gate = scratch, *gated = scratch + (size_t)M * P;
            if ((rc = linear(&d->ple_gate, h, M, gate, nthreads))) return rc;
            gelu_tanh_mul(gate, P, ple + (size_t)l * P, L * P, gated, M, P, nthreads);
            if ((rc = linear(&d->ple_proj, gated, M, tmp, nthreads))) return rc;
            rms_norm_add(tmp, H, d->ple_norm, d->eps, h, h, M, H, nthreads);
        }
        const float s = d->layer_scalar;
        for (size_t i = 0; i < (size_t)M * H; i++) h[i] *= s;
    }
    add_rms_norm(h, NULL, NULL, final_norm, final_eps, out, M, H, nthreads);
    return STACK_OK;
}
