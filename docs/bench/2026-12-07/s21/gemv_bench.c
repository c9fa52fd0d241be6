/* Lab (session 21): the few-row q4 GEMV (M = 1, SCALE_SUPER scales and mins as Q4_K) streamed from DRAM, by weight size and
 * thread count; each size cycles through 256 MB of weight copies (beyond the 32 MiB L3), best of 5 passes. Build from
 * novainfer/kernels/cpu/csrc: gcc -O3 -mavx2 -mfma -mf16c -pthread -I. -o gemv_bench <this file> <library.py _SOURCES> -lm;
 * run: ./gemv_bench K. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "cpu_kernels.h"
#include "panel_cpu.h"
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    const int K = argc > 1 ? atoi(argv[1]) : 1024;
    const size_t total = 256u << 20;  /* bytes of weights cycled through: > L3 */
    int Ns[] = {512, 1024, 2048, 4096, 8192, 16384, 65536};
    float *x = malloc(sizeof(float) * K), *y = malloc(sizeof(float) * 65536);
    for (int k = 0; k < K; k++) x[k] = (float)((k * 7919) % 101) / 50.f - 1.f;
    for (int t = 1; t <= 2; t++) {
        for (unsigned i = 0; i < sizeof Ns / sizeof *Ns; i++) {
            const int N = Ns[i], P = N / PANEL;
            const size_t wb = (size_t)P * panel_bytes(QUANT_Q4, K);
            const size_t sb = (size_t)P * (K / SUPER) * (2 * PANEL + (SUPER / 32) * PANEL);
            int copies = (int)(total / (wb + 2 * sb)); if (copies < 2) copies = 2;
            uint8_t **w = malloc(sizeof(void *) * copies), **s = malloc(sizeof(void *) * copies), **z = malloc(sizeof(void *) * copies);
            for (int c = 0; c < copies; c++) {
                w[c] = aligned_alloc(64, wb); s[c] = aligned_alloc(64, sb); z[c] = aligned_alloc(64, sb);
                memset(w[c], 0x5a, wb); memset(s[c], 0x11, sb); memset(z[c], 0x01, sb);
            }
            double best = 1e9;
            for (int rep = 0; rep < 5; rep++) {
                double t0 = now();
                for (int c = 0; c < copies; c++) q4_gemm(x, 1, K, w[c], s[c], z[c], SCALE_SUPER, N, y, t);
                double dt = (now() - t0) / copies;
                if (dt < best) best = dt;
            }
            printf("threads %d N %6d K %d: %7.2f MB  %8.2f us  %6.1f GB/s\n", t, N, K, (wb + 2 * sb) / 1e6, best * 1e6, (wb + 2 * sb) / best / 1e9);
            for (int c = 0; c < copies; c++) { free(w[c]); free(s[c]); free(z[c]); }
            free(w); free(s); free(z);
        }
    }
    return 0;
}
