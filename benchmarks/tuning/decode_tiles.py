"""The decode attention kernel's tiles, launch settings and split policy (kernels/paged_attention.DECODE_TILES,
ModelRunner.num_splits), swept on decode batches of the bench shape: each setting's output against the current
setting's (rounding only), its time and the bandwidth it reaches on the K/V bytes it must read.

    python3 benchmarks/tuning/decode_tiles.py --json out.json   # GPU: Qwen2.5-7B heads (28/4 x 128), 0.5B (14/2 x 64)
    python3 benchmarks/tuning/decode_tiles.py --device cpu --dry-run  # TRITON_INTERPRET=1, two settings, tiny shapes

A batch is the bench shape (prompts and outputs of 100-1024 tokens, seed 0) at decode step t: the sequences whose
output is longer than t, each with prompt + t tokens of context. The ceiling column is torch.sum over as many
contiguous bytes (a plain read).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.tuning.attention_backends import make  # noqa: E402
from benchmarks.tuning.fp8_gemm import timed  # noqa: E402
from novainfer.kernels import paged_attention  # noqa: E402

HEADS = {"7b": (28, 4, 128), "0.5b": (14, 2, 64)}
STEPS = [180, 430, 680, 915]  # batch ~232, ~161, ~94, ~30 of 256
TILES = [(64, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (32, 4, 3), (128, 4, 3), (128, 8, 3), (128, 8, 2)]
SPLITS = [(1, 64), (2, 256), (4, 256), (8, 256), (4, 128), (8, 128), (16, 128)]


def bench_batch(t: int, n: int = 256, seed: int = 0) -> list[int]:
    """Context lengths of the bench shape's running sequences at decode step t."""
    rng = random.Random(seed)
    pairs = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(n)]
    return [p + t for p, o in pairs if o > t]


def current_splits(num_seqs: int, kv_heads: int, num_sms: int, max_model_len: int = 32768) -> int:
    """ModelRunner.num_splits's policy (without the graph bucket)."""
    want, splits = -(-2 * num_sms // (num_seqs * kv_heads)), 1
    while splits * 2 <= min(want, max_model_len // 256, 32):
        splits *= 2
    return splits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dry-run", action="store_true", help="two settings on tiny batches")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    tiles, splits = (TILES, SPLITS) if not args.dry_run else (TILES[:2], SPLITS[:2])
    saved, rows = dict(paged_attention.DECODE_TILES), []
    print(
        "| heads | batch | ctx sum | setting (BLOCK_N, warps, stages; splits, min keys) | us | GB/s | "
        "vs current | max abs diff |\n|---|---|---|---|---|---|---|---|"
    )
    for name, (heads, kv_heads, hd) in HEADS.items():
        steps = STEPS if not args.dry_run else [950]
        if args.dry_run:
            heads, kv_heads, hd = heads // 2, kv_heads // 2, 16
        for t in steps:
            ctx = bench_batch(t) if not args.dry_run else [40, 70, 9]
            q, kc, vc, meta = make([c - 1 for c in ctx], [1] * len(ctx), heads, kv_heads, hd, dev=args.device)
            nbytes = sum(ctx) * kv_heads * hd * 2 * kc.element_size()
            flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
            ceiling = (
                nbytes / timed(lambda: flat.sum(dtype=torch.float32), dev, args.iters) / 1e3
                if dev.type == "cuda"
                else float("nan")
            )
            cur_splits = current_splits(len(ctx), kv_heads, num_sms)

            def run(ns: int, msk: int) -> torch.Tensor:
                return paged_attention.decode_attention(
                    q, kc, vc, meta.block_tables, meta.seq_lens, hd**-0.5, num_splits=ns, min_split_keys=msk
                )

            def measure(tile, ns, msk, ref, base):
                paged_attention.DECODE_TILES.clear()
                paged_attention.DECODE_TILES[1 << 30] = tile
                try:
                    out = run(ns, msk).float()
                    diff = (out - ref).abs().max().item() if ref is not None else 0.0
                    us = timed(lambda: run(ns, msk), dev, args.iters) if dev.type == "cuda" else float("nan")
                except Exception as exc:  # a setting the GPU cannot run: named, skipped
                    print(f"  {tile} {ns}/{msk}: {type(exc).__name__}: {str(exc)[:100]}")
                    out, diff, us = ref, float("nan"), float("nan")
                finally:
                    paged_attention.DECODE_TILES.clear()
                    paged_attention.DECODE_TILES.update(saved)
                gbs = nbytes / us / 1e3
                rows.append(
                    {
                        "heads": name,
                        "batch": len(ctx),
                        "ctx": sum(ctx),
                        "tile": tile,
                        "splits": ns,
                        "min_split_keys": msk,
                        "us": us,
                        "gbs": gbs,
                        "diff": diff,
                        "ceiling_gbs": ceiling,
                    }
                )
                print(
                    f"| {name} | {len(ctx)} | {sum(ctx):,} | {tile}; {ns}, {msk} | {us:,.1f} | {gbs:,.0f} | "
                    f"{(base or us) / us:.2f}x | {diff:.1e} |",
                    flush=True,
                )
                return out, us

            cur_tile = paged_attention.decode_tiles(hd)
            ref, base = measure(cur_tile, cur_splits, 64, None, None)
            print(f"| {name} | {len(ctx)} | ceiling (torch.sum, same bytes) | | | {ceiling:,.0f} | | |")
            timed_tiles = []
            for tile in tiles:
                if tile != cur_tile:
                    timed_tiles.append((measure(tile, cur_splits, 64, ref, base)[1], tile))
            best = [cur_tile] + [tl for _, tl in sorted(timed_tiles)[:1]]
            for tile in best:
                for ns, msk in splits:
                    if (ns, msk) != (cur_splits, 64):
                        measure(tile, ns, msk, ref, base)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "num_sms": num_sms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
