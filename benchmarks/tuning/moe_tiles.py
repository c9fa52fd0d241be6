"""Tile shapes of the MoE grouped GEMM (kernels/fused_moe.py) on a GPU: for each token count and each of the two
GEMMs (gate/up, down) of a Qwen3-30B-A3B-shape layer (128 experts, top-8, hidden 2048, expert width 768),
every (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of a small grid against the kernel's current choice; each
candidate is checked against the current tiles' output first. Prints one table; MOE_TILES takes the winners.

    python3 benchmarks/tuning/moe_tiles.py                         # on a GPU
    python3 benchmarks/tuning/moe_tiles.py --tokens 16 256 16384 --experts 128 --top-k 8 --hidden 2048 --inter 768
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402

from novainfer.kernels import fused_moe  # noqa: E402


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 2048, 16384])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    e, k, h, inter = args.experts, args.top_k, args.hidden, args.inter
    w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=dt, generator=g) * 0.02
    w2 = torch.randn(e, h, inter, device=dev, dtype=dt, generator=g) * 0.02
    grid = list(itertools.product([16, 32, 64, 128], [64, 128, 256], [64, 128], [4, 8], [3, 4]))
    print("| tokens | GEMM | current tiles (M, N, K, warps, stages) | ms | best tiles | ms | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for tokens in args.tokens:
        x = torch.randn(tokens, h, device=dev, dtype=dt, generator=g)
        logits = torch.randn(tokens, e, device=dev, generator=g)
        weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
        pairs = tokens * k
        act = torch.randn(pairs, inter, device=dev, dtype=dt, generator=g)
        rw = weights.to(dt).flatten().contiguous()
        for name, a, b, div, tw in (("gate_up", x, w13, k, None), ("down", act, w2, 1, rw)):
            down = name == "down"
            n = b.shape[1]
            out = torch.empty(pairs, n, device=dev, dtype=dt)
            cur = fused_moe.moe_tiles(pairs, e, n, b.shape[2], down)
            aligned = {}

            def run(t):
                bm = t[0]
                if bm not in aligned:
                    aligned[bm] = fused_moe.align_by_expert(ids, e, bm)
                s, be, npad = aligned[bm]
                fused_moe._grouped_gemm(a, b, out, s, be, npad, pairs, div, tw, t)

            run(cur)
            ref = out.clone()
            base = time_ms(lambda: run(cur))
            best, best_ms = cur, base
            by_m: dict[int, tuple[float, tuple]] = {}
            for t in grid:
                try:
                    run(t)
                except Exception:  # out of shared memory or registers for this shape
                    continue
                if not torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2):
                    print(f"| {tokens} | {name} | mismatch at {t} |")
                    continue
                ms = time_ms(lambda: run(t))
                if ms < best_ms:
                    best, best_ms = t, ms
                if t[0] not in by_m or ms < by_m[t[0]][0]:
                    by_m[t[0]] = (ms, t)
            print(
                f"| {tokens} | {name} | {cur} | {base:.3f} | {best} | {best_ms:.3f} | {base / best_ms:.2f}x |",
                flush=True,
            )
            print("  best per BLOCK_M: " + "; ".join(f"{t} {ms:.3f}" for _, (ms, t) in sorted(by_m.items())))


if __name__ == "__main__":
    main()
