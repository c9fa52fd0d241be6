/* Row-layout quants -> the panel layout of panel_cpu.h, at load time (panel_layout.py's numpy version is the
 * reference and the fallback; this one saves most of a second of the default model's start). Panels are split
 * over the worker pool; rows past n are written as zero. */
#include <stddef.h>
#include <stdint.h>

#include "cpu_pool.h"
#include "panel_cpu.h"

typedef struct {
    const uint8_t *rows; uint8_t *out; int n, K, quant;
} repack_job;

/* Weight row r's value at element k in the row layout (q4: GGML's order, byte j of a group of 32 holds elements
 * j (low nibble) and j + 16 (high); q6, q8: int8); 0 past the last row. */
static inline int value_at(const repack_job *j, int r, int k) {
    if (r >= j->n) return 0;
    if (j->quant == QUANT_Q4) {
        const uint8_t b = j->rows[(size_t)r * (j->K / 2) + (k / 32) * 16 + k % 16];
        return k % 32 < 16 ? b & 15 : b >> 4;
    }
    return (int8_t)j->rows[(size_t)r * j->K + k];
}

static void repack_panel(void *arg, int panel) {
    const repack_job *j = arg;
    uint8_t *o = j->out + (size_t)panel * panel_bytes(j->quant, j->K);
    const int r0 = panel * PANEL;
    if (j->quant == QUANT_Q6) {  /* per 8 elements: q4's 64 bytes of low nibbles, then the signed top 2 bits */
        for (int b = 0; b < j->K / 8; b++) {
            uint8_t *blk = o + (size_t)b * Q6_BLOCK;
            for (int c = 0; c < 2; c++)
                for (int lane = 0; lane < 16; lane++) {
                    int hi = 0;
                    for (int s = 0; s < 2; s++) {  /* vector t = 2s + h: nibble t of the lane, bits 2t.. of its byte */
                        const int i = lane / 2, k = 8 * b + 4 * c + 2 * s + lane % 2;
                        const int u0 = value_at(j, r0 + i, k) + 32, u1 = value_at(j, r0 + 8 + i, k) + 32;
                        blk[32 * c + 2 * lane + s] = (uint8_t)((u0 & 15) | (u1 & 15) << 4);
                        hi |= ((u0 >> 4) ^ 2) << (4 * s) | ((u1 >> 4) ^ 2) << (4 * s + 2);  /* (u >> 4) - 2, 2 bits */
                    }
                    blk[64 + 16 * c + lane] = (uint8_t)hi;
                }
        }
    } else if (j->quant == QUANT_Q4) {  /* 32 bytes per 4 elements: byte 2L + s of lane L = (i, e) holds rows i (low nibble), 8 + i */
        for (int c = 0; c < j->K / 4; c++)
            for (int lane = 0; lane < 16; lane++)
                for (int s = 0; s < 2; s++) {
                    const int i = lane / 2, k = 4 * c + 2 * s + lane % 2;
                    o[c * 32 + 2 * lane + s] = (uint8_t)(value_at(j, r0 + i, k) | value_at(j, r0 + 8 + i, k) << 4);
                }
    } else {  /* 32 bytes per k-pair: byte 2L + h of lane L = (i, e) holds row 8h + i */
        for (int p = 0; p < j->K / 2; p++)
            for (int lane = 0; lane < 16; lane++)
                for (int h = 0; h < 2; h++)
                    o[p * 32 + 2 * lane + h] = (uint8_t)value_at(j, r0 + 8 * h + lane / 2, 2 * p + lane % 2);
    }
}

/* rows: q4 uint8 [n, K/2], q6 or q8 int8 [n, K] (quant: QUANT_Q4, QUANT_Q6, QUANT_Q8) -> out: ceil(n / 16) panels of
 * panel_bytes(quant, K). */
void repack_panels(const void *rows, int quant, int n, int K, void *out, int nthreads) {
    repack_job j = {.rows = rows, .out = out, .n = n, .K = K, .quant = quant};
    pool_run(repack_panel, &j, (n + PANEL - 1) / PANEL, nthreads);
}
