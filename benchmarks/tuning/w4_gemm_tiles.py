"""4-bit GEMM tiles at decode-batch row counts: kernels/int4_gemm.py's (GPTQ-family INT4, g128) and
kernels/gguf_gemm.py's (GGUF Q4_K and Q6_K, the Q4_K_M mix) GEMM candidates swept against bf16 cuBLAS on Qwen2.5-7B's
layers, each beside the other paths a layer can take at that row count (the GEMV, the dequantized weight and cuBLAS)
and the package's own choice ("default"). Device time in CUDA graphs over weight copies L2 cannot hold
(benchmarks/quant_gpu.py's device_us); every candidate checked against its torch reference.

    python3 benchmarks/tuning/w4_gemm_tiles.py [--write-table] [--json out.json]
    TRITON_INTERPRET=1 python3 benchmarks/tuning/w4_gemm_tiles.py --tiny

--write-table replaces GEMM_CANDIDATES in both kernel files by the sweep's ranking per row bucket (the sum over
shapes, row counts and, for GGUF, both types of time / bf16 time; best four). Where each path wins sets GEMV_MAX_M
and DEQUANT_MIN_M (int4_gemm.py) and GEMV_MAX_M / GEMM_MAX_M (gguf_gemm.py) by hand, from the table printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.quant_gpu import SHAPES_7B, SHAPES_TINY, Operands, device_us, rel  # noqa: E402
from benchmarks.tuning.fp8_block_tiles import fits, ranking, write_table  # noqa: E402

ROWS = [2, 4, 8, 16, 32, 64, 128, 256]
BUCKETS = [8, 16, 32, 64, 128, 256]
TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (16, 64, 128, 4, 4),
    (16, 128, 128, 4, 4),
    (16, 128, 64, 4, 4),
    (16, 256, 64, 8, 3),
    (16, 64, 64, 4, 5),
    (32, 64, 128, 4, 4),
    (32, 128, 128, 4, 4),
    (32, 128, 64, 4, 4),
    (32, 256, 64, 8, 3),
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 128, 128, 8, 3),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
]


def int4_paths(ops: Operands):
    """(label -> fn(x, i, tiles, split) of copy i) for INT4 g128, and its dequantized [K, N] reference."""
    from novainfer.kernels import int4_gemm as i4
    from novainfer.layers.quantization.int4 import dequantize_int4

    def gemm(x, i, tiles, split):
        return i4.int4_gemm(x, *ops.copy("int4", i), 128, tiles=tiles, split=split)

    paths = {
        "default": lambda x, i: i4.int4_linear(x, *ops.copy("int4", i), 128),
        "dequant": lambda x, i: torch.nn.functional.linear(x, i4.int4_dequantize(*ops.copy("int4", i), 128, x.dtype)),
        "gemv": lambda x, i: i4.int4_gemv(x, *ops.copy("int4", i), 128),
    }
    return paths, gemm, i4.GEMV_MAX_M, dequantize_int4(ops.q4, ops.s4.float(), ops.z4, 128)


def gguf_paths(w):
    """The same for one GGUF weight (gguf_gemm.GGUFWeight) and its copies."""
    from novainfer.kernels import gguf_gemm as gg

    copies = [w]

    def cp(i):
        while len(copies) <= i:
            copies.append(w.map(torch.clone, w.shape[0]))
        return copies[i]

    def gemm(x, i, tiles, split):
        return gg.gguf_gemm(x, cp(i), tiles=tiles, split=split)

    paths = {
        "default": lambda x, i: gg.gguf_matmul(x, [cp(i)]),
        "dequant": lambda x, i: torch.nn.functional.linear(x, gg.gguf_dequantize(cp(i), x.dtype)),
        "gemv": lambda x, i: gg.gguf_gemv(x, cp(i)),
    }
    return paths, gemm, gg.GEMV_ROWS, gg.dequantize(w).float().t()


def sweep(shapes, rows: list[int], device: torch.device, iters: int, formats: list[str]) -> list[dict]:
    """One cell per (format, shape, m): every path's and candidate's device us and rel err, and bf16's time."""
    from benchmarks.gguf_gpu import random_weight

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    rng = np.random.default_rng(0)
    out = []
    for name, k, n in shapes:
        ops = Operands(k, n, device, g)
        for fmt in formats:
            if fmt == "int4":
                paths, gemm, gemv_rows, ref = int4_paths(ops)
                nbytes = ops.q4.numel() * 4
            else:
                w, _ = random_weight(fmt, n, k, device, rng)
                paths, gemm, gemv_rows, ref = gguf_paths(w)
                nbytes = w.nbytes()
            for m in rows:
                x = torch.randn(m, k, device=device, generator=g).to(dtype)
                want = x.float() @ ref
                bf16 = device_us(
                    lambda i: lambda w=ops.copy("bf16", i)[0]: torch.nn.functional.linear(x, w),
                    2 * n * k,
                    device,
                    iters,
                )
                runs = {
                    lb: (lambda i, f=f: lambda: f(x, i)) for lb, f in paths.items() if lb != "gemv" or m <= gemv_rows
                }
                if device.type == "cuda":
                    for t in TILES:  # split-K as the package launches it: until the output tiles fill the SMs
                        if fits(t, m):
                            runs[str(t)] = lambda i, t=t: lambda: gemm(x, i, t, None)
                cell = {"format": fmt, "shape": name, "m": m, "bf16_us": bf16, "times": {}, "errors": {}}
                for lb, run in runs.items():
                    try:
                        err = rel(run(0)().float(), want)
                        us = device_us(run, nbytes, device, iters)
                    except Exception as e:  # noqa: BLE001 - a tile this GPU cannot run (shared memory): skipped
                        print(f"  {fmt} {name} M={m} {lb}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    cell["times"][lb], cell["errors"][lb] = us, err
                t = cell["times"]
                tiles_t = {lb: v for lb, v in t.items() if lb[0] == "("}
                best = min(tiles_t, key=tiles_t.get) if tiles_t else "default"
                print(
                    f"{fmt:5s} {name:13s} M={m:4d} bf16 {bf16:7.1f} | default {t['default']:7.1f} "
                    f"({bf16 / t['default']:.2f}x) | dequant {t['dequant']:7.1f} ({bf16 / t['dequant']:.2f}x) | "
                    + (f"gemv {t['gemv']:7.1f} ({bf16 / t['gemv']:.2f}x) | " if "gemv" in t else "")
                    + f"best gemm {t[best]:7.1f} ({bf16 / t[best]:.2f}x) {best} | max rel {max(cell['errors'].values()):.1e}",
                    flush=True,
                )
                out.append(cell)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the interpreter's shapes and rows, the default tile only")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--formats", default="int4,Q4_K,Q6_K")
    ap.add_argument("--rows", type=int, nargs="*", default=None)
    ap.add_argument("--layers", default=None, help="these of the 7B's layers only, e.g. down_proj,gate_up_proj")
    ap.add_argument("--write-table", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    shapes, rows = (SHAPES_TINY, [3, 20]) if args.tiny else (SHAPES_7B, args.rows or ROWS)
    if args.layers:
        shapes = [s for s in shapes if s[0] in args.layers.split(",")]
    cells = sweep(shapes, rows, device, args.iters, args.formats.split(","))
    for fmts, kernel_file in ((["int4"], "int4_gemm.py"), (["Q4_K", "Q6_K"], "gguf_gemm.py")):
        mine = [c for c in cells if c["format"] in fmts]
        if not mine or device.type != "cuda":
            continue
        ranks = ranking(mine, BUCKETS)
        print(f"\n{kernel_file}: per row bucket, sum over cells of (time / bf16), best four; the other paths' sums")
        for b, r in ranks.items():
            cs = [c for c in mine if next(x for x in BUCKETS if c["m"] <= x) == b]
            other = {lb: sum(c["times"][lb] / c["bf16_us"] for c in cs) for lb in ("default", "dequant")}
            if all("gemv" in c["times"] for c in cs):
                other["gemv"] = sum(c["times"]["gemv"] / c["bf16_us"] for c in cs)
            print(
                f"  M<={b:4d}: "
                + " | ".join(f"{lb} {v:.2f}" for lb, v in other.items())
                + " | "
                + " | ".join(f"{lb} {s:.2f}" for s, lb in r[:4])
            )
        if args.write_table:
            print(write_table(ranks, kernel_file))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(cells, f, indent=1)


if __name__ == "__main__":
    main()
