/* A whole decode step of a llama-family decoder stack in one call: per layer, residual add + RMSNorm, the
 * fused qkv GEMM (+ bias), rotary, the bf16 KV store, decode attention over the paged cache, o_proj, add +
 * RMSNorm, gate_up, SiLU-and-mul, down; then the final norm. It calls the same kernels (cpu_kernels.h) in
 * the same order as the layer-by-layer Python path, so the result is the same to the bit; what it saves is
 * the ~300 Python-level calls, ctypes crossings and small torch allocations of a 30-layer step.
 * Wrapper: kernels/cpu/decoder_stack.py; worker/decode_strategy.py fills the layer descriptors once.
 */
#include <stddef.h>
#include <stdint.h>

#include "stack_cpu.h"

/* Everything one decoder layer reads; the layout matches DecoderLayerDesc in kernels/cpu/decoder_stack.py. */
typedef struct {
    const float *input_norm, *post_norm;
    float input_eps, post_eps;
    qlinear qkv, o, gate_up, down;
    uint16_t *k_cache, *v_cache;  /* [blocks, block_size, nkv, D] bfloat16 */
    const float *cos, *sin;       /* rotary tables [max_pos, D] */
    int max_pos, nh, nkv, D, block_size, window;
    float scale, soft_cap;
} decoder_layer;

/* Floats of workspace decoder_stack_decode needs for M rows (the wrapper allocates it once and reuses it). */
size_t decoder_stack_workspace(const decoder_layer *layers, int L, int M, int H) {
    size_t width = 2 * (size_t)H;  /* residual, normed */
    size_t widest = H;             /* hidden */
    for (int l = 0; l < L; l++) {
        const decoder_layer *d = layers + l;
        size_t w = (size_t)d->qkv.N + (size_t)d->nh * d->D;  /* qkv and the attention output live at once */
        if ((size_t)d->gate_up.N + d->gate_up.N / 2 > w) w = (size_t)d->gate_up.N + d->gate_up.N / 2;
        if (w > widest) widest = w;
    }
    return (width + H + widest) * (size_t)M;
}

/* embeds [M, H]: the step's token embeddings (one decode row each); out [M, H]: final_norm(h + residual).
 * pos/slots [M] int64, block_tables [M, bt_stride] and seq_lens [M] int32 describe each row as a one-query
 * sequence over caches of num_blocks blocks. ws: decoder_stack_workspace(...) floats. Returns STACK_OK or an
 * error code; the KV indices are checked before the first layer writes, so a bad one changes no cache (where:
 * the offending token, or sequence and table entry). */
int decoder_stack_decode(const decoder_layer *layers, int L, const float *final_norm, float final_eps,
                         const float *embeds, float *out, int M, int H, const int64_t *pos, const int64_t *slots,
                         const int32_t *block_tables, int bt_stride, const int32_t *seq_lens, float *ws,
                         int nthreads, int num_blocks, int *where) {
    for (int l = 0; l < L; l++) {  /* every KV index, before the first layer writes (once per block size) */
        if (l > 0 && layers[l].block_size == layers[l - 1].block_size) continue;
        int rc = check_kv_slots(slots, M, (int64_t)num_blocks * layers[l].block_size, where);
        if (!rc) rc = check_block_tables(block_tables, bt_stride, seq_lens, M, layers[l].block_size, num_blocks, where);
        if (rc) return kv_error(rc);
    }
    float *res = ws, *normed = res + (size_t)M * H, *hidden = normed + (size_t)M * H, *scratch = hidden + (size_t)M * H;
    const float *residual = embeds;  /* the first layer's residual is the embedding itself */
    for (int l = 0; l < L; l++) {
        const decoder_layer *d = layers + l;
        const int qkv_w = d->qkv.N, q_size = d->nh * d->D, kv_size = d->nkv * d->D;
        float *qkv = scratch, *attn = scratch + (size_t)M * qkv_w;
        if (l == 0) add_rms_norm(embeds, NULL, NULL, d->input_norm, d->input_eps, normed, M, H, nthreads);
        else add_rms_norm(hidden, residual, res, d->input_norm, d->input_eps, normed, M, H, nthreads);
        if (l > 0) residual = res;
        int rc = linear(&d->qkv, normed, M, qkv, nthreads);
        if (rc) return rc;
        if (rotary_neox(qkv, qkv_w, d->nh, qkv + q_size, qkv_w, d->nkv, pos, M, d->cos, d->sin, d->max_pos, d->D,
                        nthreads))
            return STACK_BAD_POSITION;
        if ((rc = store_kv_bf16(qkv + q_size, qkv_w, qkv + q_size + kv_size, qkv_w, d->k_cache, d->v_cache, slots, M,
                                kv_size, nthreads, (int64_t)num_blocks * d->block_size, where)))
            return kv_error(rc);
        if ((rc = decode_attention_bf16(qkv, qkv_w, d->k_cache, d->v_cache, block_tables, bt_stride, seq_lens, M,
                                        d->nh, d->nkv, d->D, d->block_size, d->scale, d->window, d->soft_cap,
                                        NULL /* no sinks */, attn, nthreads, num_blocks, where)))
            return kv_error(rc);
        if ((rc = linear(&d->o, attn, M, hidden, nthreads))) return rc;
        add_rms_norm(hidden, residual, res, d->post_norm, d->post_eps, normed, M, H, nthreads);
        residual = res;
        float *gate_up = scratch, *act = scratch + (size_t)M * d->gate_up.N;
        if ((rc = linear(&d->gate_up, normed, M, gate_up, nthreads))) return rc;
        silu_and_mul(gate_up, act, M, d->gate_up.N / 2, nthreads);
        if ((rc = linear(&d->down, act, M, hidden, nthreads))) return rc;
    }
    add_rms_norm(hidden, residual, res, final_norm, final_eps, out, M, H, nthreads);
    return STACK_OK;
}
