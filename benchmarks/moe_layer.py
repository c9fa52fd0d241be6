"""The CPU MoE layer alone: the torch expert loop (the reference) against the grouped_mm path, interleaved
in one process so both see the same machine. Example:
    OMP_NUM_THREADS=1 python benchmarks/moe_layer.py --experts 16 --top-k 4 --hidden 512 --inter 256
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from novainfer.layers.activation import SiluAndMul  # noqa: E402
from novainfer.layers.fused_moe.moe_torch import fused_experts_grouped, fused_experts_torch  # noqa: E402
from novainfer.layers.fused_moe.routing import select_experts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--tokens", default="1,256")
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(args.experts, 2 * args.inter, args.hidden, generator=g) * 0.02
    w2 = torch.randn(args.experts, args.hidden, args.inter, generator=g) * 0.02
    print(f"threads={torch.get_num_threads()} experts={args.experts} top_k={args.top_k} hidden={args.hidden} "
          f"inter={args.inter}\n| tokens | torch loop (ms) | grouped_mm (ms) | speed-up |\n|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, args.hidden, generator=g)
        weights, ids = select_experts(torch.randn(tokens, args.experts, generator=g), args.top_k, True)
        times = {fn: [] for fn in (fused_experts_torch, fused_experts_grouped)}
        for _ in range(args.repeat):
            for fn in times:  # interleaved: both paths see the same load
                t0 = time.perf_counter()
                fn(x, w13, w2, weights, ids, SiluAndMul())
                times[fn].append(time.perf_counter() - t0)
        loop, grouped = (statistics.median(t) * 1e3 for t in times.values())
        print(f"| {tokens} | {loop:.3f} | {grouped:.3f} | {loop / grouped:.1f}x |")


if __name__ == "__main__":
    main()
