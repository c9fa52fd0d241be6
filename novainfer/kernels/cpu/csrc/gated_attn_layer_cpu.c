/* A Qwen3.5 / Qwen3-Next gated full-attention decoder layer's decode step in one call (models/qwen3_5.py's
 * GatedAttention in a HybridDecoderLayer): residual add + input RMSNorm, the qkv GEMM (each head's query then its
 * output gate, then k and v), per-head q / k RMSNorms, rotary over the first `rot` dims of each head, the bf16 KV
 * store, decode attention, the output times sigmoid(gate), o_proj, residual add + post RMSNorm, the dense SiLU MLP.
 * The layer-by-layer path's kernels in its order, with the partial rotary and the gate as plain loops here (torch
 * ops there). Wrapper: kernels/cpu/gated_attn_layer.py. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "stack_cpu.h"

/* Everything the layer reads; the layout matches GatedAttnLayerDesc in kernels/cpu/gated_attn_layer.py. */
typedef struct gated_attn_layer {
    const float *input_norm, *post_norm, *q_norm, *k_norm;  /* weights 1 + w (offset norms) */
    float input_eps, post_eps, qk_eps, scale;
    qlinear qkv, o, gate_up, down;
    uint16_t *k_cache, *v_cache;  /* [blocks, block_size, nkv, D] bf16 */
    const float *cos, *sin;       /* [max_pos, rot] */
    int max_pos, nh, nkv, D, rot, block_size;
} gated_attn_layer;

/* Floats of workspace gated_attn_layer_decode needs for M rows. */
size_t gated_attn_layer_workspace(const gated_attn_layer *d, int M) {
    const size_t H = (size_t)d->qkv.K, q = (size_t)d->nh * d->D, kv = (size_t)d->nkv * d->D;
    const size_t attn = (size_t)d->qkv.N + 2 * q + 2 * kv, mlp = (size_t)d->gate_up.N + d->gate_up.N / 2;
    return (2 * H + (attn > mlp ? attn : mlp)) * (size_t)M;
}

/* x [rot] of one head at table row p: x * cos + rotate_half(x) * sin over the first rot dims. */
static void rotate(float *x, const float *c, const float *s, int rot) {
    const int half = rot / 2;
    for (int i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i + half] + x1 * s[i + half];
    }
}

/* h [M, H] the previous layer's output, res its residual (NULL: h is the residual); res_out [M, H] the new
 * residual, out [M, H] the MLP's output. pos/slots [M] int64; block_tables [M, bt_stride] and seq_lens [M] int32:
 * one query per sequence over a cache of num_blocks blocks. ws: gated_attn_layer_workspace(d, M) floats. Returns
 * STACK_OK or an error code; the KV indices are checked before anything is written (where: the offender). */
/* A decode step's KV slots, block tables and positions against the layer's cache and rotary table: STACK_OK, or the
 * error (and where). hybrid_stack_cpu.c checks them once before its first layer, so that a bad index stops the
 * step before any DeltaNet state has moved. */
int gated_attn_layer_check(const gated_attn_layer *d, int M, const int64_t *pos, const int64_t *slots,
                           const int32_t *block_tables, int bt_stride, const int32_t *seq_lens, int num_blocks,
                           int *where) {
    int rc = check_kv_slots(slots, M, (int64_t)num_blocks * d->block_size, where);
    if (!rc) rc = check_block_tables(block_tables, bt_stride, seq_lens, M, d->block_size, num_blocks, where);
    if (rc) return kv_error(rc);
    for (int m = 0; m < M; m++)
        if (pos[m] < 0 || pos[m] >= d->max_pos) return STACK_BAD_POSITION;
    return STACK_OK;
}

int gated_attn_layer_decode(const gated_attn_layer *d, const float *h, const float *res, float *res_out, float *out,
                            int M, const int64_t *pos, const int64_t *slots, const int32_t *block_tables,
                            int bt_stride, const int32_t *seq_lens, int num_blocks, float *ws, int nthreads,
                            int *where) {
    const int H = d->qkv.K, D = d->D, qs = d->nh * D, kvs = d->nkv * D, W = d->qkv.N;
    int rc = gated_attn_layer_check(d, M, pos, slots, block_tables, bt_stride, seq_lens, num_blocks, where);
    if (rc) return rc;
    float *normed = ws, *mixed = normed + (size_t)M * H, *qkvg = mixed + (size_t)M * H;
    float *q = qkvg + (size_t)M * W, *k = q + (size_t)M * qs, *v = k + (size_t)M * kvs, *attn = v + (size_t)M * kvs;
    add_rms_norm(h, res, res ? res_out : NULL, d->input_norm, d->input_eps, normed, M, H, nthreads);
    if (!res) memcpy(res_out, h, sizeof(float) * (size_t)M * H);
    if ((rc = linear(&d->qkv, normed, M, qkvg, nthreads))) return rc;
    for (int m = 0; m < M; m++) {  /* the queries apart from their gates; k and v as they are */
        const float *row = qkvg + (size_t)m * W;
        for (int hd = 0; hd < d->nh; hd++) memcpy(q + (size_t)m * qs + (size_t)hd * D, row + (size_t)hd * 2 * D, sizeof(float) * D);
        memcpy(k + (size_t)m * kvs, row + 2 * qs, sizeof(float) * kvs);
        memcpy(v + (size_t)m * kvs, row + 2 * qs + kvs, sizeof(float) * kvs);
    }
    add_rms_norm(q, NULL, NULL, d->q_norm, d->qk_eps, q, M * d->nh, D, nthreads);
    add_rms_norm(k, NULL, NULL, d->k_norm, d->qk_eps, k, M * d->nkv, D, nthreads);
    for (int m = 0; m < M; m++) {
        const float *c = d->cos + (size_t)pos[m] * d->rot, *s = d->sin + (size_t)pos[m] * d->rot;
        for (int hd = 0; hd < d->nh; hd++) rotate(q + (size_t)m * qs + (size_t)hd * D, c, s, d->rot);
        for (int hd = 0; hd < d->nkv; hd++) rotate(k + (size_t)m * kvs + (size_t)hd * D, c, s, d->rot);
    }
    if ((rc = store_kv_bf16(k, kvs, v, kvs, d->k_cache, d->v_cache, slots, M, kvs, nthreads,
                            (int64_t)num_blocks * d->block_size, where)))
        return kv_error(rc);
    if ((rc = decode_attention_bf16(q, qs, d->k_cache, d->v_cache, block_tables, bt_stride, seq_lens, M, d->nh,
                                    d->nkv, D, d->block_size, d->scale, 0, 0.0f, NULL, attn, nthreads, num_blocks,
                                    where)))
        return kv_error(rc);
    for (int m = 0; m < M; m++)
        for (int hd = 0; hd < d->nh; hd++) {
            const float *gate = qkvg + (size_t)m * W + (size_t)hd * 2 * D + D;
            float *o = attn + (size_t)m * qs + (size_t)hd * D;
            for (int i = 0; i < D; i++) o[i] *= 1.f / (1.f + expf(-gate[i]));
        }
    if ((rc = linear(&d->o, attn, M, mixed, nthreads))) return rc;
    add_rms_norm(mixed, res_out, res_out, d->post_norm, d->post_eps, normed, M, H, nthreads);
    float *gate_up = qkvg, *act = qkvg + (size_t)M * d->gate_up.N;
    if ((rc = linear(&d->gate_up, normed, M, gate_up, nthreads))) return rc;
    silu_and_mul(gate_up, act, M, d->gate_up.N / 2, nthreads);
    return linear(&d->down, act, M, out, nthreads);
}
