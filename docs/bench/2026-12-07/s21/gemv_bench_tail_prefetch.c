/* Lab (session 21, not kept): gemv_bench.c with the caller thread prefetching the next GEMV's two lane starts (the first
 * PF bytes of each half of its weight, and of its scales) once it has no chunk left to claim, while the worker
 * finishes. Needs a hook in cpu_pool.c's pool_run, after the caller's `work(gen);`:
 *     if (pool_idle_hook) pool_idle_hook();
 * with `void (*pool_idle_hook)(void);` defined there. Run: ./gemv_bench_tail_prefetch K PF (PF 0: no hook). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "cpu_kernels.h"
#include "panel_cpu.h"
#include <immintrin.h>
extern void (*pool_idle_hook)(void);
static const uint8_t *nx_w, *nx_s; static size_t nx_half, nx_shalf; static int PF_BYTES = 8192;
static void hook(void) {
    if (!nx_w) return;
    for (int l = 0; l < PF_BYTES; l += 64) { _mm_prefetch((const char *)nx_w + l, _MM_HINT_T1); _mm_prefetch((const char *)nx_w + nx_half + l, _MM_HINT_T1); }
    for (int l = 0; l < 1024; l += 64) { _mm_prefetch((const char *)nx_s + l, _MM_HINT_T1); _mm_prefetch((const char *)nx_s + nx_shalf + l, _MM_HINT_T1); }
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    const int K = argc > 1 ? atoi(argv[1]) : 1024;
    if (argc > 2) { PF_BYTES = atoi(argv[2]); pool_idle_hook = PF_BYTES > 0 ? hook : 0; }
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
                for (int c = 0; c < copies; c++) {
                    const int n = (c + 1) % copies;
                    nx_w = w[n]; nx_s = s[n]; nx_half = wb / 2 / 64 * 64; nx_shalf = sb / 2 / 64 * 64;
                    q4_gemm(x, 1, K, w[c], s[c], z[c], SCALE_SUPER, N, y, t);
                }
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
