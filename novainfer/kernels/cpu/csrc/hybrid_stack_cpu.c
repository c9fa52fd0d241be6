/* A Qwen3.5 / Qwen3-Next CPU decode step's whole decoder stack in one call (models/qwen3_5.py's hybrid layers): each
 * Gated DeltaNet layer through gdn_layer_decode (gdn_layer_cpu.c), each gated-attention layer through
 * gated_attn_layer_decode (gated_attn_layer_cpu.c), in order. The same kernels as one C call a layer, so the hidden
 * states are those to the bit; what it saves is each layer's Python-level dispatch (~70 us a layer on a 2-core Zen 5,
 * 1.7 ms of Qwen3.5-0.8B's 17.8 ms step). The KV indices and positions are checked before the first layer, so a bad
 * one stops the step before any DeltaNet state moves. Wrapper: kernels/cpu/hybrid_stack.py. */
#include <stdint.h>
#include <string.h>

#include "stack_cpu.h"

/* Floats of workspace hybrid_stack_decode needs for M rows of width H: the largest layer's, and two hidden states
 * and two residuals that the layers write in turn. */
size_t hybrid_stack_workspace(const void *const *layers, const uint8_t *linear, int n, int M, int H) {
    size_t most = 0;
    for (int i = 0; i < n; i++) {
        const size_t w = linear[i] ? gdn_layer_workspace(layers[i], M) : gated_attn_layer_workspace(layers[i], M);
        if (w > most) most = w;
    }
    return most + 4 * (size_t)M * H;
}

/* embeds [M, H]: the step's embedded tokens, one decode row per sequence; h_out, res_out [M, H]: the last layer's
 * output and residual (the final norm adds them). layers[i] is a gdn_layer where linear[i], else a gated_attn_layer;
 * check: one of the gated-attention layers (their KV cache shares one layout), or NULL where there is none.
 * state_slots, continues: gdn_layer_decode's; pos .. num_blocks, where: gated_attn_layer_decode's. */
int hybrid_stack_decode(const void *const *layers, const uint8_t *linear, int n, const void *check,
                        const float *embeds, float *h_out, float *res_out, int M, int H, const int64_t *state_slots,
                        const uint8_t *continues, const int64_t *pos, const int64_t *kv_slots,
                        const int32_t *block_tables, int bt_stride, const int32_t *seq_lens, int num_blocks, float *ws,
                        int nthreads, int *where) {
    int rc = check ? gated_attn_layer_check(check, M, pos, kv_slots, block_tables, bt_stride, seq_lens, num_blocks,
                                            where)
                   : STACK_OK;
    if (rc) return rc;
    const size_t rows = (size_t)M * H;
    float *hs[2] = {ws, ws + rows}, *rs[2] = {ws + 2 * rows, ws + 3 * rows}, *layer_ws = ws + 4 * rows;
    const float *h = embeds, *res = NULL;
    for (int i = 0; i < n; i++) {
        float *out = hs[i & 1], *r = rs[i & 1];
        rc = linear[i] ? gdn_layer_decode(layers[i], h, res, r, out, M, state_slots, continues, layer_ws, nthreads)
                       : gated_attn_layer_decode(layers[i], h, res, r, out, M, pos, kv_slots, block_tables, bt_stride,
                                                 seq_lens, num_blocks, layer_ws, nthreads, where);
        if (rc) return rc;
        h = out;
        res = r;
    }
    memcpy(h_out, h, sizeof(float) * rows);
    memcpy(res_out, res ? res : embeds, sizeof(float) * rows);
    return STACK_OK;
}
