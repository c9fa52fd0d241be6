"""Cost of the KV index checks the CPU store / attention kernels run before touching memory (check_kv_slots +
check_block_tables of csrc/decode_ops_cpu.c), timed in C against the built library: a ctypes call (~1 us)
would hide them. Decode shapes of the default model: block size 16, rows 1 and 16, contexts 128 and 4096.
    python benchmarks/kv_bounds_checks.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HARNESS = r"""
#include <stdint.h>
#include <stdio.h>
#include <time.h>
int check_kv_slots(const int64_t *slots, int T, int64_t num_slots, int *where);
int check_block_tables(const int32_t *bt, int bt_stride, const int32_t *lens, int S, int bs, int nb, int *where);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(void) {
    enum { S = 16, W = 256, BS = 16, BLOCKS = 2048, N = 200000 };
    static int32_t bt[S * W];
    int32_t lens[S]; int64_t slots[S]; int where[2];
    for (int i = 0; i < S * W; i++) bt[i] = i % BLOCKS;
    const int contexts[2] = {128, 4096};
    for (int c = 0; c < 2; c++)
        for (int rows = 1; rows <= S; rows += S - 1) {
            for (int s = 0; s < S; s++) lens[s] = contexts[c], slots[s] = 1000 + s;
            int bad = 0;
            double t = now();
            for (int i = 0; i < N; i++) {
                bad |= check_kv_slots(slots, rows, (int64_t)BLOCKS * BS, where);
                bad |= check_block_tables(bt, W, lens, rows, BS, BLOCKS, where);
            }
            t = (now() - t) / N;
            printf("rows=%2d context=%4d: %.3f us per layer (slots + block tables), %.1f us per 30-layer decode step "
                   "(31 checks: the C stack's once + each layer's)%s\n", rows, contexts[c], 1e6 * t, 31e6 * t,
                   bad ? " BAD" : "");
        }
    return 0;
}
"""


def main() -> None:
    from novainfer.kernels.cpu import library
    lib = library.library()._name
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "harness.c"), os.path.join(tmp, "harness")
        with open(src, "w") as f:
            f.write(HARNESS)
        subprocess.run(["gcc", "-O2", "-o", exe, src, lib, f"-Wl,-rpath,{os.path.dirname(lib)}"], check=True)
        subprocess.run([exe], check=True)


if __name__ == "__main__":
    main()
