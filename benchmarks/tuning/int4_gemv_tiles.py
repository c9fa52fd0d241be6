"""The INT4 (W4A16, g128) decode GEMV over its tile candidates, on Qwen2.5-7B's and Qwen3-30B-A3B's dense layer
shapes at 1, 2 and 4 rows: device time (CUDA graphs, weights not in L2) beside bf16 F.linear, the error against the
dequantized torch product, the best tile per shape (GEMV_TILES to paste into kernels/int4_gemm.py).

It imports novainfer from the current directory, so one script times two trees in one call:

    python benchmarks/tuning/int4_gemv_tiles.py --out new.json
    (cd /path/to/old/tree && python /path/to/this/benchmarks/tuning/int4_gemv_tiles.py --out old.json)
    python benchmarks/tuning/int4_gemv_tiles.py --kernels docs/bench/2026-12-05/s12/int4_gemm_pair_form.py

--kernels: a file that stands in for kernels/int4_gemm.py's GEMV (its int4_gemv and GEMV_CANDIDATES).
    TRITON_INTERPRET=1 python benchmarks/tuning/int4_gemv_tiles.py --tiny
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from benchmarks.quant_gpu import SHAPES_7B, Operands, device_us, rel  # noqa: E402

SHAPES_30B = [("30b qkv_proj", 2048, 5120), ("30b o_proj", 4096, 2048)]  # name, K, N
SHAPES_TINY = [("qkv_proj", 256, 384), ("down_proj", 512, 256)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernels", default=None, help="a file with int4_gemv and GEMV_CANDIDATES (default: the package)")
    args = ap.parse_args()
    if args.kernels:
        spec = importlib.util.spec_from_file_location("int4_gemv_under_test", args.kernels)
        int4_gemm = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(int4_gemm)
    else:
        from novainfer.kernels import int4_gemm
    from novainfer.layers.quantization.int4 import dequantize_int4

    device = torch.device("cpu" if args.tiny else "cuda")
    shapes = SHAPES_TINY if args.tiny else SHAPES_7B + SHAPES_30B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cands = [None] + ([] if args.tiny else list(int4_gemm.GEMV_CANDIDATES))
    g = torch.Generator(device=device).manual_seed(0)
    rows, start = [], time.time()
    for name, k, n in shapes:
        ops = Operands(k, n, device, g)
        w4 = dequantize_int4(ops.q4, ops.s4, ops.z4, 128).float()
        for m in args.rows:
            x = torch.randn(m, k, device=device, generator=g).to(dtype)
            ref = x.float() @ w4
            (w16,) = ops.copy("bf16", 0)
            bf16 = device_us(lambda i: lambda w=ops.copy("bf16", i)[0]: torch.nn.functional.linear(x, w), 2 * n * k,
                             device, args.iters)  # fmt: skip
            row = dict(layer=name, k=k, n=n, m=m, bf16_us=bf16, tiles={})
            for t in cands:
                try:
                    err = rel(int4_gemm.int4_gemv(x, *ops.copy("int4", 0), 128, t).float(), ref)
                    us = device_us(lambda i, t=t: lambda c=ops.copy("int4", i): int4_gemm.int4_gemv(x, *c, 128, t),
                                   n * k // 2, device, args.iters)  # fmt: skip
                except Exception as e:  # a tile this GPU cannot take
                    print(f"  {name} m={m} {t}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                row["tiles"][str(t)] = (us, err)
            best = min((v[0], key) for key, v in row["tiles"].items() if key != "None")[1] if len(cands) > 1 else "None"
            d, b = row["tiles"]["None"], row["tiles"][best]
            print(
                f"{name:14s} m={m} bf16 {bf16:7.1f} us | int4 default {d[0]:7.1f} us ({bf16 / d[0]:.2f}x, "
                f"{n * k / 2 / d[0] / 1e6:.2f} TB/s, rel {d[1]:.1e}) | best {best} {b[0]:7.1f} us ({bf16 / b[0]:.2f}x, "
                f"rel {b[1]:.1e})",
                flush=True,
            )
            row["best"] = best
            rows.append(row)
    print("GEMV_TILES (m=1 best) =", {(r["n"], r["k"]): r["best"] for r in rows if r["m"] == 1})
    print(f"total {time.time() - start:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
