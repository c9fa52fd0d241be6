/* Lab (session 21): the Gated DeltaNet decode step (B = 1, a Qwen3.5-0.8B layer: C 6144, K 4, 16 x 16 heads of 128),
 * its conv and its heads timed apart, 18 layers' states cycled with a 64 MB eviction between passes. Build from
 * novainfer/kernels/cpu/csrc: gcc -O3 -mavx2 -mfma -mf16c -pthread -I. -o gdn_bench <this file> cpu_pool.c -lm;
 * run: ./gdn_bench THREADS. */

#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "gated_delta_cpu.c"
static char *junk;
static void evict(void) { if (!junk) junk = malloc(64 << 20); for (size_t i = 0; i < (64u << 20); i += 64) junk[i]++; }
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    const int L = 18, C = 6144, K = 4, nk = 16, nv = 16, dk = 128, dv = 128, T = argc > 1 ? atoi(argv[1]) : 2;
    set_gated_delta_isa(-1);
    float *mixed = malloc(sizeof(float) * C), *convw = malloc(sizeof(float) * C * K), g[16], beta[16];
    float *co = malloc(sizeof(float) * C), *out = malloc(sizeof(float) * nv * dv);
    for (int c = 0; c < C; c++) mixed[c] = (c % 13) * 0.01f;
    for (int c = 0; c < C * K; c++) convw[c] = (c % 7) * 0.1f;
    for (int h = 0; h < 16; h++) { g[h] = -0.1f; beta[h] = 0.5f; }
    float *cs[18], *ss[18];
    for (int l = 0; l < L; l++) {
        cs[l] = calloc((size_t)(K - 1) * C, sizeof(float));
        ss[l] = calloc((size_t)nv * dk * dv, sizeof(float));
    }
    int64_t slot = 0; uint8_t cont = 1;
    double best_all = 1e9, best_conv = 1e9, best_heads = 1e9;
    for (int rep = 0; rep < 30; rep++) {
        evict();
        double t0 = now();
        for (int l = 0; l < L; l++)
            gated_delta_decode(mixed, C, cs[l], ss[l], &slot, &cont, 1, convw, g, beta, C, K, nk, nv, dk, dv, co, out, T);
        double t1 = now();
        evict();
        const double t1b = now();
        for (int l = 0; l < L; l++) {
            gdn_job j = {mixed, C, cs[l], ss[l], &slot, &cont, convw, g, beta, C, K, nk, nv, dk, dv, co, out, 1, T};
            pool_run(conv_task, &j, conv_tasks(&j), T);
        }
        double t2 = now();
        evict();
        const double t2b = now();
        for (int l = 0; l < L; l++) {
            gdn_job j = {mixed, C, cs[l], ss[l], &slot, &cont, convw, g, beta, C, K, nk, nv, dk, dv, co, out, 1, T};
            pool_run(head_task, &j, nv, T);
        }
        double t3 = now();
        if (t1 - t0 < best_all) best_all = t1 - t0;
        if (t2 - t1b < best_conv) best_conv = t2 - t1b;
        if (t3 - t2b < best_heads) best_heads = t3 - t2b;
    }
    printf("threads %d, 18 layers: whole %.1f us (%.1f a layer); conv alone %.1f; heads alone %.1f\n", T,
           best_all * 1e6, best_all * 1e6 / L, best_conv * 1e6 / L, best_heads * 1e6 / L);
    return 0;
}
