"""The few-token MoE path (kernels/moe_gemv.py) against the grouped GEMMs, on Qwen3-30B-A3B's and Qwen3.5-35B-A3B's
MoE layers, bf16 and block-FP8 (weight-only) experts, 1 to 4 tokens: device time per layer (CUDA graphs over
routing copies whose experts L2 does not hold), each run checked against the torch reference, and the GEMV's tile
candidates. Sets moe_gemv.MAX_TOKENS (the token count up to which the GEMV wins) and its default tiles.

    python3 benchmarks/tuning/moe_gemv.py
    TRITON_INTERPRET=1 python3 benchmarks/tuning/moe_gemv.py --tiny
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.quant_gpu import device_us, rel  # noqa: E402

SHAPES = {
    "qwen3-30b-a3b": dict(experts=128, hidden=2048, inter=768, top_k=8),
    "qwen3.5-35b-a3b": dict(experts=256, hidden=2048, inter=512, top_k=8),
}
TINY = {"tiny": dict(experts=8, hidden=256, inter=128, top_k=2)}
TILES = [(16, 512, 4), (8, 512, 4), (16, 256, 4), (32, 256, 4), (8, 1024, 4), (16, 1024, 8), (32, 512, 8), (4, 1024, 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    from novainfer.kernels.fused_moe import experts_gemv, grouped_experts, moe_tiles
    from novainfer.kernels.fused_moe_quant import fused_experts_fp8_block
    from novainfer.layers.activation import get_act_and_mul
    from novainfer.layers.fused_moe.moe_torch import fused_experts_torch
    from novainfer.layers.fused_moe.routing import select_experts
    from novainfer.layers.quantization.fp8_block import fused_experts_fp8_block_reference

    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    act = get_act_and_mul("silu")
    g = torch.Generator(device=device).manual_seed(0)
    bad = []
    for name, sh in (TINY if args.tiny else SHAPES).items():
        e, h, inter, k = sh["experts"], sh["hidden"], sh["inter"], sh["top_k"]
        w13 = (torch.randn(e, 2 * inter, h, device=device, generator=g) * 0.02).to(dtype)
        w2 = (torch.randn(e, h, inter, device=device, generator=g) * 0.02).to(dtype)
        s13 = w13.float().view(e, 2 * inter // 128, 128, h // 128, 128).abs().amax((2, 4)) / 448
        s2 = w2.float().view(e, h // 128, 128, inter // 128, 128).abs().amax((2, 4)) / 448
        q13 = (w13.float() / s13.repeat_interleave(128, 1).repeat_interleave(128, 2)).to(torch.float8_e4m3fn)
        q2 = (w2.float() / s2.repeat_interleave(128, 1).repeat_interleave(128, 2)).to(torch.float8_e4m3fn)
        nbytes = {"bf16": (w13.numel() + w2.numel()) * w13.element_size(), "fp8": w13.numel() + w2.numel()}
        for tokens in (1, 2, 3, 4):
            x = torch.randn(tokens, h, device=device, generator=g).to(dtype)
            weights, ids = select_experts(torch.randn(tokens, e, device=device, generator=g), k, True)
            touched = torch.unique(ids).numel() / e
            refs = {
                "bf16": fused_experts_torch(x.float(), w13.float(), w2.float(), weights, ids, act),
                "fp8": fused_experts_fp8_block_reference(x, q13, s13, q2, s2, (128, 128), weights, ids, act, False),
            }
            grouped_tiles = (moe_tiles(tokens * k, e, 2 * inter, h, False), moe_tiles(tokens * k, e, h, inter, True))

            def run(fmt: str, path: str, i: int, tiles=None):
                ids_i = (ids + i * k) % e  # copy i reads experts the call before did not
                if fmt == "bf16" and path == "grouped":
                    return lambda: grouped_experts(x, w13, w2, weights, ids_i, act)
                if fmt == "bf16":
                    return lambda: experts_gemv(x, w13, w2, weights, ids_i, act, tiles=tiles)
                if path == "grouped":  # explicit tiles keep fused_experts_fp8_block on its grouped GEMMs
                    return lambda: fused_experts_fp8_block(
                        x, q13, s13, q2, s2, (128, 128), weights, ids_i, act, False, tiles=grouped_tiles
                    )
                return lambda: experts_gemv(x, q13, q2, weights, ids_i, act, s13, s2, tiles=tiles)

            for fmt in ("bf16", "fp8"):
                cells = {}
                for label, path, tiles in [("grouped", "grouped", None), ("gemv", "gemv", None)] + [
                    (f"gemv{t}", "gemv", t) for t in ([] if args.tiny else TILES)
                ]:
                    try:
                        err = rel(run(fmt, path, 0, tiles)().float(), refs[fmt].float())
                        us = device_us(lambda i: run(fmt, path, i, tiles), int(nbytes[fmt] * touched), device, 3)
                    except Exception as exc:  # noqa: BLE001 - a tile this GPU cannot run: reported, skipped
                        print(f"  {name} {fmt} {label}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        continue
                    cells[label] = us
                    if err > (2e-2 if dtype == torch.bfloat16 else 1e-4):
                        bad.append(f"{name} {fmt} tokens={tokens} {label} rel {err:.1e}")
                best = min((v, lb) for lb, v in cells.items() if lb.startswith("gemv"))
                gbs = nbytes[fmt] * touched / cells["gemv"] / 1e3
                print(
                    f"{name:16s} {fmt:4s} tokens={tokens}: grouped {cells['grouped']:7.1f} us | gemv {cells['gemv']:7.1f} "
                    f"us ({cells['grouped'] / cells['gemv']:.2f}x, {gbs:.0f} GB/s) | best gemv {best[0]:7.1f} {best[1]}",
                    flush=True,
                )
    print("moe_gemv checks:", "all pass" if not bad else "FAILED " + "; ".join(bad))


if __name__ == "__main__":
    main()
