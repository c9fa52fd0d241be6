/* Dequantization of a PackedWeight (the panel layout of panel_cpu.h) to float32 rows: the embedding lookup's rows,
 * or all of them (the tests' C reference). Rows are split over the worker pool of cpu_pool.c.
 * Built with the other kernels by kernels/cpu/library.py. */
#include <stddef.h>
#include <stdint.h>

#include "cpu_kernels.h"
#include "cpu_pool.h"
#include "panel_cpu.h"
#include "simd_cpu.h"

/* out [R, K] = q * scale + zero, per group of G, for weight rows rows[0..R) (NULL: rows 0..R). */
typedef struct {
    const void *w; const void *scales, *zeros; const int64_t *rows; int K, G, R, quant, scale_fmt, nchunks;
    float *out;
} dequant_job;

/* Weight row n's quant at element k (panel_cpu.h: row r of a panel is lane 2 (r % 8) + k % 2 of half r / 8): the
 * scalar reference of the layouts the GEMMs unpack with SIMD. */
static inline int quant_at(const dequant_job *j, int64_t n, int k) {
    const int r = (int)(n % PANEL), h = r / 8, lane = 2 * (r % 8) + (k & 1);
    const uint8_t *b = (const uint8_t *)j->w + (size_t)(n / PANEL) * panel_bytes(j->quant, j->K);
    if (j->quant == QUANT_Q8) return ((const int8_t *)b)[(size_t)(k / 2) * 32 + 2 * lane + h];  /* low byte: half 0 */
    /* nibbles: 4 elements per 32 bytes (q6: two such blocks, then their 32 bytes of high bits); nibble t = 2 *
     * (k-pair % 2) + h of the lane's uint16 */
    const int c = (k / 4) & 1, t = 2 * ((k / 2) & 1) + h;
    const uint8_t *q6 = b + (size_t)(k / 8) * Q6_BLOCK;  /* (q6 only) */
    const uint8_t *u = (j->quant == QUANT_Q6 ? q6 + 32 * c : b + (size_t)(k / 4) * 32) + 2 * lane;
    const int v = ((u[0] | u[1] << 8) >> (4 * t)) & 15;
    if (j->quant == QUANT_E2M1) return E2M1_X2[v];
    if (j->quant == QUANT_Q6) {  /* plus 16 times the signed top 2 bits */
        const int top = (q6[64 + 16 * c + lane] >> (2 * t)) & 3;
        return v + 16 * (top >= 2 ? top - 4 : top);
    }
    return v;
}

static void dequant_chunk(void *arg, int chunk) {
    const dequant_job *j = arg;
    const int K = j->K, G = j->G, ng = K / G, per = (j->R + j->nchunks - 1) / j->nchunks;
    const int r0 = chunk * per, r1 = r0 + per < j->R ? r0 + per : j->R;
    for (int r = r0; r < r1; r++) {
        const int64_t n = j->rows ? j->rows[r] : r;
        float *o = j->out + (size_t)r * K;
        for (int g = 0; g < ng; g++) {
            const size_t pnl = (size_t)(n / PANEL);
            const int row = (int)(n % PANEL);
            const float s = panel_scale_at(j->scales, pnl, ng, G, g, row, j->scale_fmt);
            const float z = j->zeros ? panel_scale_at(j->zeros, pnl, ng, G, g, row, j->scale_fmt) : 0.f;
            for (int k = g * G; k < (g + 1) * G; k++) o[k] = __builtin_fmaf((float)quant_at(j, n, k), s, z);
        }
    }
}

/* Weights [N, K] in panels of layout quant (panel_cpu.h's QUANT_*: q4 and e2m1 G=32, q6 G=16, q8 G 16 or 32;
 * zeros may be NULL) -> out float32 [R, K]:
 * rows[0..R) of the weight (NULL: its first R rows; the caller checks the ids). scales and zeros are in format
 * scale_fmt (panel_cpu.h's SCALE_*). */
void dequantize(const void *w, int quant, int G, const void *scales, const void *zeros, int scale_fmt, int K,
                const int64_t *rows, int R, float *out, int nthreads) {
    dequant_job j = {.w = w, .scales = scales, .zeros = zeros, .rows = rows, .K = K, .G = G, .R = R, .quant = quant,
                     .scale_fmt = scale_fmt, .out = out};
    j.nchunks = num_chunks(R, nthreads);
    pool_run(dequant_chunk, &j, j.nchunks, nthreads);
}
