"""Every path a pre-quantized linear layer can take, timed against bf16 at each row count: where each one wins sets
the thresholds of kernels/fp8_block.py (GEMV_MAX_M, CUBLAS_MIN_M, DEQUANT_MIN_M) and kernels/int4_gemm.py
(GEMV_MAX_M, DEQUANT_MIN_M).

Paths: bf16 F.linear (cuBLAS); block FP8: the weight-only GEMV, the Triton GEMM weight-only and with x quantized per
128-wide group, cuBLAS's block-scaled float8 GEMM (F.scaled_mm), dequantize to bf16 then cuBLAS; INT4 (g128): the
GEMV, the Triton GEMM, dequantize to bf16 then cuBLAS. Device time per call in CUDA graphs over weight copies that
L2 cannot hold (benchmarks/quant_gpu.py's device_us), each checked against its torch reference.

    python benchmarks/tuning/quant_paths.py                      # on the GPU
    TRITON_INTERPRET=1 python benchmarks/tuning/quant_paths.py --tiny
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.quant_gpu import SHAPES_TINY, Operands, device_us, rel  # noqa: E402

SHAPES = [("qkv_proj", 3584, 4608), ("o_proj", 3584, 3584), ("gate_up_proj", 3584, 37888), ("down_proj", 18944, 3584)]
ROWS = [1, 2, 4, 8, 16, 32, 48, 64, 100, 128, 192, 256, 384, 512, 1024, 4096]


def paths(m: int):
    """(name, fn(x, ops, i) -> y or None) of every path that applies at m rows."""
    from novainfer.kernels import fp8_block as f8
    from novainfer.kernels import int4_gemm as i4
    from novainfer.kernels.gemv import gemv

    blk = (128, 128)

    def fp8(name):
        def run(x, ops, i):
            wq, ws = ops.copy("fp8", i)
            if name == "gemv":
                return gemv(x, wq, weight_scale=ws, block=blk)
            if name == "gemm w-only":
                return f8.fp8_block_gemm(x, None, wq, ws, blk, x.dtype)
            if name == "gemm fp8":
                return f8.fp8_block_gemm(*f8.per_token_group_quant(x, 128), wq, ws, blk, x.dtype)
            if name == "cublas block":
                return f8.cublas_block_gemm(x, wq, ws)
            return torch.nn.functional.linear(x, f8.fp8_block_dequantize(wq, ws, blk, x.dtype))

        return run

    def int4(name):
        def run(x, ops, i):
            q, s, z = ops.copy("int4", i)
            if name == "gemv":
                return i4.int4_gemv(x, q, s, z, 128)
            if name == "gemm":
                return i4.int4_gemm(x, q, s, z, 128)
            return torch.nn.functional.linear(x, i4.int4_dequantize(q, s, z, 128, x.dtype))

        return run

    out = [("bf16", lambda x, ops, i: torch.nn.functional.linear(x, ops.copy("bf16", i)[0]))]
    if m <= f8.GEMV_MAX_M:
        out.append(("fp8 gemv", fp8("gemv")))
    if m <= 64:
        out.append(("fp8 gemm w-only", fp8("gemm w-only")))
    if m > 1:
        out += [("fp8 gemm fp8", fp8("gemm fp8")), ("fp8 dequant+cublas", fp8("dequant"))]
        out.append(("fp8 cublas block", fp8("cublas block")))
    if m <= i4.GEMV_MAX_M:
        out.append(("int4 gemv", int4("gemv")))
    if m > 1:
        out += [("int4 gemm", int4("gemm")), ("int4 dequant+cublas", int4("dequant"))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    shapes = SHAPES_TINY if args.tiny else SHAPES
    rows = [1, 3, 8, 20] if args.tiny else ROWS
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    table: dict[tuple[str, int], dict[str, float]] = {}
    for name, k, n in shapes:
        ops = Operands(k, n, device, g)
        from novainfer.layers.quantization.fp8_block import expand_blocks
        from novainfer.layers.quantization.int4 import dequantize_int4

        w_ref = {  # each format's own dequantized weight, [K, N]
            "bf16": ops.w16.float().t(),
            "fp8": (ops.wq.float() * expand_blocks(ops.ws, (128, 128), (n, k))).t(),
            "int4": dequantize_int4(ops.q4, ops.s4.float(), ops.z4, 128),
        }
        for m in rows:
            x = (torch.randn(m, k, device=device, generator=g)).to(dtype)
            cell = table.setdefault((name, m), {})
            for label, fn in paths(m):
                try:
                    y = fn(x, ops, 0)  # eager first: a path this torch or GPU lacks fails here, not in a graph
                except (RuntimeError, ValueError) as e:
                    print(f"{name:<13} M={m:<5} {label:<20} did not run: {str(e).splitlines()[0][:150]}", flush=True)
                    cell[label] = float("nan")
                    continue
                err = rel(y.float(), x.float() @ w_ref[label.split()[0]])
                tol = 5e-2 if label in ("fp8 gemm fp8", "fp8 cublas block") else 1e-2  # x quantized: e4m3 rounding
                bytes_ = ops.w16.numel() * ops.w16.element_size()
                us = device_us(lambda i, fn=fn: lambda: fn(x, ops, i), bytes_, device, args.iters)
                cell[label] = us
                flag = "" if err < tol else f"  REL ERR {err:.1e}"
                print(f"{name:<13} M={m:<5} {label:<20} {us:9.1f} us{flag}", flush=True)
    labels = [p for p, _ in paths(2)] + ["fp8 gemv", "int4 gemv"]
    labels = list(dict.fromkeys(labels))
    print("\nus per call (x bf16); best FP8 and INT4 path per row")
    print(f"{'shape':<13} {'M':>5} " + " ".join(f"{lb:>20}" for lb in labels) + "  best fp8 / int4")
    for (name, m), cell in table.items():
        b = cell["bf16"]
        cols = []
        for lb in labels:
            v = cell.get(lb)
            cols.append(f"{'-':>20}" if v is None or v != v else f"{v:8.1f} ({b / v:4.2f}x)".rjust(20))
        f8 = min((v, lb) for lb, v in cell.items() if lb.startswith("fp8") and v == v)
        i4 = min((v, lb) for lb, v in cell.items() if lb.startswith("int4") and v == v)
        print(f"{name:<13} {m:>5} " + " ".join(cols) + f"  {f8[1]} / {i4[1]}")


if __name__ == "__main__":
    main()
