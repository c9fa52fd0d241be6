/* The entry points of qgemm_cpu.c, decode_ops_cpu.c and decode_attention_cpu.c (and the helpers the kernels
 * share), for C callers (decoder_stack_cpu.c, dequantize_cpu.c); see those files for what each computes. Python
 * calls them through ctypes (kernels/cpu/qgemm.py, ops.py). */
#ifndef NOVAINFER_CPU_KERNELS_H
#define NOVAINFER_CPU_KERNELS_H

#include <stdint.h>

/* scales/zeros: in format scale_fmt (panel_cpu.h's SCALE_F32, SCALE_F16, SCALE_SUPER: a PackedWeight's scale_format). */
int q4_gemm(const float *x, int M, int K, const uint8_t *w, const void *scales, const void *zeros, int scale_fmt,
            int N, float *y, int nthreads);
int q8_gemm(const float *x, int M, int K, const int8_t *w, int G, const void *scales, const void *zeros,
            int has_zeros, int scale_fmt, int N, float *y, int nthreads);
/* MXFP4: q4 panels of e2m1 codes, scales 2^(e - 128) (kernels/cpu/repack.py); mxfp4_gemm_ref: the scalar
 * reference on GGUF's block_mxfp4 rows (mxfp4_ref_cpu.c) */
int mxfp4_gemm(const float *x, int M, int K, const uint8_t *w, const void *scales, int scale_fmt, int N, float *y,
               int nthreads);
int mxfp4_gemm_panel(const float *x, int M, int K, const uint8_t *w, const void *scales, int scale_fmt, int N,
                     float *y, int nthreads);
void mxfp4_gemm_ref(const float *x, int M, int K, const uint8_t *blocks, int N, float *y);
/* Q6_K: q6 panels (panel_cpu.h), groups of 16, no zeros */
int q6_gemm(const float *x, int M, int K, const uint8_t *w, const void *scales, int scale_fmt, int N, float *y,
            int nthreads);
int q6_gemm_panel(const float *x, int M, int K, const uint8_t *w, const void *scales, int scale_fmt, int N, float *y,
                  int nthreads);
/* 16-bit float weights as stored (w [N, K]: F16 bits, or BF16 with bf16 = 1), widened exactly, float32 sums
 * (f16gemm_cpu.c); f16_gemm_ref: its scalar reference, the same bits */
int f16_gemm(const float *x, int M, int K, const uint16_t *w, int bf16, int N, float *y, int nthreads);
void f16_gemm_ref(const float *x, int M, int K, const uint16_t *w, int bf16, int N, float *y);
void set_panel_min_rows(int rows);
int num_chunks(int N, int nthreads);  /* chunks of output rows a kernel splits N rows into for the pool */
int q4_gemm_panel(const float *x, int M, int K, const uint8_t *w, const void *scales, const void *zeros,
                  int scale_fmt, int N, float *y, int nthreads);
int q8_gemm_panel(const float *x, int M, int K, const int8_t *w, int G, const void *scales, const void *zeros,
                  int has_zeros, int scale_fmt, int N, float *y, int nthreads);
/* the elementwise ops split their rows over the pool from ~32k elements (a prefill), else run on the caller */
void add_rms_norm(const float *x, const float *res, float *res_out, const float *w, float eps, float *out, int M,
                  int H, int nthreads);
void silu_and_mul(const float *x, float *out, int M, int D, int nthreads);
void rms_norm_add(const float *x, int x_stride, const float *w, float eps, const float *res, float *out, int M, int H,
                  int nthreads);
void gelu_tanh_mul(const float *g, int g_stride, const float *u, int u_stride, float *out, int M, int D,
                   int nthreads);
int rotary_neox(float *q, int q_stride, int nq, float *k, int k_stride, int nk, const int64_t *pos, int T,
                const float *cos_t, const float *sin_t, int max_pos, int D, int nthreads);
/* The KV ops (and prefill_attention_bf16 of prefill_attention_cpu.c) check a step's indices before touching
 * memory: what they return, with the offending token, or sequence and block-table entry, in where[0..1].
 * num_blocks / num_slots (the cache's size) and where come last. */
enum { KV_OK = 0, KV_NO_MEMORY = -1, KV_BAD_SLOT = 1, KV_BAD_SEQ_LEN = 2, KV_BAD_BLOCK = 3, KV_BAD_QUERIES = 4 };
int check_kv_slots(const int64_t *slots, int T, int64_t num_slots, int *where);
int check_block_tables(const int32_t *block_tables, int bt_stride, const int32_t *seq_lens, int S, int block_size,
                       int num_blocks, int *where);
int store_kv_bf16(const float *k, int k_stride, const float *v, int v_stride, uint16_t *k_cache, uint16_t *v_cache,
                  const int64_t *slots, int T, int width, int nthreads, int64_t num_slots, int *where);
int decode_attention_bf16(const float *q, int q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *block_tables, int bt_stride, const int32_t *seq_lens, int S, int nh, int nkv,
                          int D, int block_size, float scale, int window, float soft_cap, const float *sinks,
                          float *out, int nthreads, int num_blocks, int *where);
/* gated_delta_cpu.c: one Gated DeltaNet decode step on the state slots, and the gated RMSNorm of its output */
void gated_delta_decode(const float *mixed, int64_t mixed_stride, float *conv_state, float *ssm_state,
                        const int64_t *slots, const uint8_t *continues, int B, const float *conv_w, const float *g,
                        const float *beta, int C, int K, int nk, int nv, int dk, int dv, float *conv_out, float *out,
                        int nthreads);
void gated_rms_norm(const float *x, const float *z, const float *w, float eps, int rows, int D, float *out,
                    int nthreads);

#endif
