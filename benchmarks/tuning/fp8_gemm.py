"""quantization="fp8"'s linear layer in pieces against the bf16 GEMM, on Qwen2.5-7B's layer shapes: where the fp8
layer's time goes (the per-token quantization, the row-wise float8 GEMM) and what per-tensor scaling (vLLM's
default dynamic FP8 on cuBLASLt) would cost instead.

    python3 benchmarks/tuning/fp8_gemm.py --json out.json                 # CUDA: CUDA-event timing, 7B shapes
    python3 benchmarks/tuning/fp8_gemm.py --device cpu --shapes tiny      # a CPU dry run
Times: on CUDA the mean of --iters calls queued back to back after a warm-up, each variant timed alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from novainfer.layers.quantization.fp8 import Fp8Config, fp8_linear, quantize_rows  # noqa: E402

SHAPES = {
    "7b": [("qkv_proj", 3584, 4608), ("o_proj", 3584, 3584), ("gate_up_proj", 3584, 37888), ("down_proj", 18944, 3584)],
    "tiny": [("tiny", 64, 128)],
}


def timed(fn, device: torch.device, iters: int) -> float:
    """Microseconds of one call: on CUDA the mean of `iters` calls queued back to back between two events (a
    sync per call would time the launch and let the clocks drop between calls), else the median wall time."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / iters
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def measure(device: torch.device, name: str, k: int, n: int, m: int, iters: int, opts) -> dict:
    g = torch.Generator(device=device).manual_seed(k + n + m)
    x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(torch.bfloat16)
    wq, ws = quantize_rows(w)
    ws = ws.view(1, -1).contiguous()
    xq, xs = opts.quantize(x)
    one = torch.ones((), device=device)
    variants = {
        "bf16_linear": lambda: F.linear(x, w),
        "fp8_layer": lambda: fp8_linear(x, wq, ws, None, opts),
        "quantize": lambda: opts.quantize(x),
        "rowwise_gemm": lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16, use_fast_accum=opts.fast_accum
        ),
        "rowwise_gemm_exact_accum": lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16
        ),
        "tensorwise_gemm": lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=opts.fast_accum
        ),
    }
    row = {"shape": name, "M": m, "K": k, "N": n}
    for key, fn in variants.items():
        try:
            row[key + "_us"] = timed(fn, device, iters)
        except RuntimeError as exc:  # e.g. a variant this torch build lacks on this device
            row[key + "_us"] = None
            row[key + "_error"] = str(exc).splitlines()[0][:120]
    flops = 2 * m * k * n
    for key in ("bf16_linear", "fp8_layer", "rowwise_gemm", "tensorwise_gemm"):
        if row[key + "_us"]:
            row[key + "_tflops"] = flops / row[key + "_us"] / 1e6
    if row["fp8_layer_us"]:
        row["speedup_fp8_layer"] = row["bf16_linear_us"] / row["fp8_layer_us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 256, 2048, 8192], help="M: tokens in the step")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    opts = Fp8Config(device).opts
    rows = [measure(device, name, k, n, m, args.iters, opts) for name, k, n in SHAPES[args.shapes] for m in args.rows]
    print(
        f"\n{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
        f"fast_accum={opts.fast_accum}, quantize={opts.quantize.__name__}; microseconds per call (median)"
    )
    print(
        "| shape | M | bf16 linear | fp8 layer | quantize | row-wise GEMM | same, exact accumulation | "
        "tensor-wise GEMM | bf16 / fp8 layer |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:,.1f}"  # noqa: E731
    for r in rows:
        print(
            f"| {r['shape']} | {r['M']} | {fmt(r['bf16_linear_us'])} | {fmt(r['fp8_layer_us'])} | "
            f"{fmt(r['quantize_us'])} | {fmt(r['rowwise_gemm_us'])} | {fmt(r['rowwise_gemm_exact_accum_us'])} | "
            f"{fmt(r['tensorwise_gemm_us'])} | "
            f"{r.get('speedup_fp8_layer', 0):.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
