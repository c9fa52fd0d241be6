/* What the whole-stack decode kernels share (decoder_stack_cpu.c, gemma4_stack_cpu.c, hybrid_stack_cpu.c): a quantized
 * linear layer's descriptor and call (static inline), their error codes, and the Qwen3.5 layer calls the hybrid stack
 * chains. */
#ifndef NOVAINFER_STACK_CPU_H
#define NOVAINFER_STACK_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "cpu_kernels.h"
#include "panel_cpu.h"

/* One quantized linear layer (a PackedWeight): y[M, N] = x[M, K] W^T (+ bias); QLinearDesc in
 * kernels/cpu/decoder_stack.py. */
typedef struct {
    const void *w;
    const void *scales, *zeros;  /* in format scale_fmt (panel_cpu.h); zeros: NULL when has_zeros is 0 */
    const float *bias;           /* may be NULL */
    int quant, group, has_zeros, scale_fmt, N, K;  /* quant: QUANT_Q8, Q4, Q6, F16 or BF16 (panel_cpu.h) */
} qlinear;

/* Error codes (the wrappers turn them into exceptions); a bad KV index is STACK_BAD_KV + its KV_BAD_* code. */
enum { STACK_OK = 0, STACK_NO_MEMORY = 1, STACK_BAD_POSITION = 2, STACK_BAD_KV = 2 };

static inline int kv_error(int rc) { return rc == KV_NO_MEMORY ? STACK_NO_MEMORY : STACK_BAD_KV + rc; }

static inline int linear(const qlinear *l, const float *x, int M, float *y, int nthreads) {
    const int wide = l->quant == QUANT_F16 || l->quant == QUANT_BF16;
    const int rc = wide ? f16_gemm(x, M, l->K, l->w, l->quant == QUANT_BF16, l->N, y, nthreads)
                   : l->quant == QUANT_Q4 ? q4_gemm(x, M, l->K, l->w, l->scales, l->zeros, l->scale_fmt, l->N, y, nthreads)
                   : l->quant == QUANT_Q6 ? q6_gemm(x, M, l->K, l->w, l->scales, l->scale_fmt, l->N, y, nthreads)
                                          : q8_gemm(x, M, l->K, l->w, l->group, l->scales, l->zeros, l->has_zeros,
                                                    l->scale_fmt, l->N, y, nthreads);
    if (rc) return STACK_NO_MEMORY;
    if (l->bias)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < l->N; n++) y[(size_t)m * l->N + n] += l->bias[n];
    return STACK_OK;
}

/* Qwen3.5's two decoder layers (gdn_layer_cpu.c, gated_attn_layer_cpu.c), which hybrid_stack_cpu.c chains. */
struct gdn_layer;
struct gated_attn_layer;
size_t gdn_layer_workspace(const struct gdn_layer *d, int M);
int gdn_layer_decode(const struct gdn_layer *d, const float *h, const float *res, float *res_out, float *out, int M,
                     const int64_t *slots, const uint8_t *continues, float *ws, int nthreads);
size_t gated_attn_layer_workspace(const struct gated_attn_layer *d, int M);
int gated_attn_layer_check(const struct gated_attn_layer *d, int M, const int64_t *pos, const int64_t *slots,
                           const int32_t *block_tables, int bt_stride, const int32_t *seq_lens, int num_blocks,
                           int *where);
int gated_attn_layer_decode(const struct gated_attn_layer *d, const float *h, const float *res, float *res_out,
                            float *out, int M, const int64_t *pos, const int64_t *slots, const int32_t *block_tables,
                            int bt_stride, const int32_t *seq_lens, int num_blocks, float *ws, int nthreads,
                            int *where);

#endif
