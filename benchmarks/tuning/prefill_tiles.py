"""The prefill attention kernel's tile shapes and launch settings (kernels/paged_attention.PREFILL_TILES), swept on
the bench shape's prompts: each setting's output against the current setting's (bf16 rounding only) and its time.

    python3 benchmarks/tuning/prefill_tiles.py --json out.json  # GPU: Qwen2.5-7B heads (28/4 x 128), 0.5B (14/2 x 64)
    python3 benchmarks/tuning/prefill_tiles.py --device cpu --dry-run   # TRITON_INTERPRET=1, two settings, tiny shapes
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
SETTINGS = [
    (64, 32, 4, 3),
    (64, 64, 4, 3),
    (64, 64, 4, 2),
    (64, 64, 8, 2),
    (128, 32, 8, 2),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (64, 128, 4, 2),
    (128, 64, 4, 2),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seqs", type=int, default=16, help="prompts per step, lengths uniform in 100-1024")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true", help="two settings on tiny prompts")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    lens = [rng.randint(100, 1024) for _ in range(args.seqs)] if not args.dry_run else [40, 70]
    settings = SETTINGS if not args.dry_run else SETTINGS[:2]
    saved, rows = dict(paged_attention.PREFILL_TILES), []
    print(
        "| heads | BLOCK_M, BLOCK_N, warps, stages | us per call | vs current | max abs diff |\n|---|---|---|---|---|"
    )
    for name, (heads, kv_heads, hd) in HEADS.items():
        if args.dry_run:
            heads, kv_heads, hd = heads // 2, kv_heads // 2, 16
        q, kc, vc, meta = make([0] * len(lens), lens, heads, kv_heads, hd, dev=args.device)  # fresh prompts
        run = lambda: paged_attention.prefill_attention(
            q, kc, vc, meta.block_tables, meta.query_start_loc, meta.seq_lens, max(lens), hd**-0.5
        )
        current = paged_attention.prefill_tiles(hd, max(lens))
        time_us = lambda: timed(run, torch.device(args.device), args.iters) if args.device == "cuda" else float("nan")
        ref, base = run().float(), time_us()
        for setting in settings:
            paged_attention.PREFILL_TILES.clear()
            paged_attention.PREFILL_TILES[1 << 30] = setting
            try:
                out = run().float()
                diff = (out - ref).abs().max().item()
                us = time_us()
            except Exception as exc:  # a setting that does not fit the GPU's shared memory: skipped, named
                diff, us = float("nan"), float("nan")
                print(f"  {setting}: {type(exc).__name__}: {str(exc)[:120]}")
            finally:
                paged_attention.PREFILL_TILES.clear()
                paged_attention.PREFILL_TILES.update(saved)
            mark = " (current)" if setting == current else ""
            rows.append({"heads": name, "setting": setting, "us": us, "diff": diff, "current": setting == current})
            print(f"| {name} | {setting}{mark} | {us:,.1f} | {base / us:.2f}x | {diff:.1e} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lens": lens, "device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
