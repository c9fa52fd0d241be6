"""MXFP4 experts on the GPU (kernels/fused_moe_mxfp4.py) on gpt-oss-20b and -120b layer shapes: one table.

For each model shape (hidden 2880, intermediate 2880, top-4 of 32 or 128 experts; random MXFP4 weights with
gpt-oss-like exponents, random biases) and token count:
  - rel err of the MXFP4 kernel (bf16 activations) against the torch reference on the dequantized weights in
    float32 (layers/fused_moe/moe_torch.py: fused_experts_torch); bound 1e-2 (bf16 rounding of the activations
    and of the gate/up result);
  - time of the MXFP4 kernel and of the bf16 kernel (kernels/fused_moe.py) on the same weights dequantized to
    bf16, both with the biases, CUDA events via triton's do_bench;
  - the experts' weight bytes as MXFP4 (blocks + scales) and as bf16.
The activation is gpt-oss's clamped SwiGLU over [gate; up] (swiglu_alpha 1.702, swiglu_limit 7).

    PYTHONPATH=. python tests/gpu/mxfp4_checks.py            # CUDA, real shapes (from the repository root)
    PYTHONPATH=. TRITON_INTERPRET=1 python tests/gpu/mxfp4_checks.py --tiny   # CPU, tiny shapes, float32
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from novainfer.kernels.fused_moe import fused_experts
from novainfer.kernels.fused_moe_mxfp4 import fused_experts_mxfp4
from novainfer.layers.activation import ClampedSwigluAndMul
from novainfer.layers.fused_moe import select_experts
from novainfer.layers.fused_moe.moe_torch import fused_experts_torch
from novainfer.layers.quantization.mxfp4 import dequantize_mxfp4

# name, experts, top_k, hidden, intermediate
SHAPES = [("gpt-oss-20b", 32, 4, 2880, 2880), ("gpt-oss-120b", 128, 4, 2880, 2880)]
TINY_SHAPES = [("tiny-a", 4, 2, 96, 64), ("tiny-b", 8, 2, 64, 96)]
TOKENS, TINY_TOKENS = (1, 8, 64, 512, 2048), (1, 9)
MAX_REL = 1e-2


def random_experts(e: int, n: int, k: int, gen: torch.Generator, device: torch.device):
    """blocks uint8 [e, n, k/2], scales uint8 [e, n, k/32] (exponents 2^-9..2^-5: gpt-oss's range), bias [e, n]."""
    blocks = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 123, (e, n, k // 32), dtype=torch.uint8, generator=gen)
    bias = torch.randn(e, n, generator=gen) * 0.02
    return blocks.to(device), scales.to(device), bias.to(device)


def bench(fn, device: torch.device) -> float:
    """Milliseconds a call takes (triton's do_bench on CUDA; a few timed calls elsewhere)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50)
    fn()
    t = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t) / 3 * 1e3


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(tiny: bool) -> bool:
    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter has no bfloat16 dot
    act = ClampedSwigluAndMul(1.702, 7.0)
    rows, ok = [], True
    for name, e, top_k, hidden, inter in TINY_SHAPES if tiny else SHAPES:
        gen = torch.Generator().manual_seed(e)
        b13, s13, bias13 = random_experts(e, 2 * inter, hidden, gen, device)
        b2, s2, bias2 = random_experts(e, hidden, inter, gen, device)
        bias13, bias2 = bias13.to(dtype), bias2.to(dtype)  # the layer holds them in the model's dtype
        mx_bytes = sum(t.numel() for t in (b13, s13, b2, s2))
        w13 = dequantize_mxfp4(b13, s13)  # float32: the reference's weights, exact
        w2 = dequantize_mxfp4(b2, s2)
        w13_bf16, w2_bf16 = w13.to(dtype), w2.to(dtype)
        dense_bytes = (w13.numel() + w2.numel()) * 2
        for tokens in TINY_TOKENS if tiny else TOKENS:
            x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
            weights, ids = select_experts(torch.randn(tokens, e, generator=gen).to(device), top_k, True)
            out = fused_experts_mxfp4(x, b13, s13, b2, s2, weights, ids, act, bias13, bias2)
            want = fused_experts_torch(x.float(), w13, w2, weights, ids, act, bias13, bias2)
            err = rel(out, want)
            good = bool(torch.isfinite(out).all()) and err <= MAX_REL
            ok &= good
            mx_args = (x, b13, s13, b2, s2, weights, ids, act, bias13, bias2)
            t_mx = bench(lambda a=mx_args: fused_experts_mxfp4(*a), device)
            bf_args = (x, w13_bf16, w2_bf16, weights, ids, act, bias13, bias2)
            t_bf = bench(lambda a=bf_args: fused_experts(*a), device)
            rows.append((name, tokens, err, "ok" if good else "FAIL", t_mx, t_bf, mx_bytes, dense_bytes))
        del w13, w2, w13_bf16, w2_bf16, mx_args, bf_args
        if device.type == "cuda":
            torch.cuda.empty_cache()
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (TRITON_INTERPRET)"
    print(f"MXFP4 fused MoE, one layer, {label}, activations {str(dtype).split('.')[-1]}")
    head = f"{'shape':<14}{'tokens':>7}{'rel err':>10}{'':>6}{'mxfp4 ms':>10}{'bf16 ms':>10}{'speedup':>9}"
    print(head + f"{'MXFP4 MiB':>11}{'bf16 MiB':>10}")
    for name, tokens, err, verdict, t_mx, t_bf, mxb, dnb in rows:
        print(
            f"{name:<14}{tokens:>7}{err:>10.1e}{verdict:>6}{t_mx:>10.3f}{t_bf:>10.3f}{t_bf / t_mx:>8.2f}x"
            f"{mxb / 2**20:>11.1f}{dnb / 2**20:>10.1f}"
        )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    sys.exit(0 if run(args.tiny) else 1)


if __name__ == "__main__":
    main()
