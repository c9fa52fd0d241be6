"""Block-FP8 GEMM tiles (kernels/fp8_block.py's GEMM_CANDIDATES) swept against bf16 cuBLAS at decode-batch row
counts: every (BLOCK_M, BLOCK_N, warps, stages) candidate with and without split-K (`fill` programs per SM), on
Qwen2.5-7B's and Qwen3-8B's layers; the x quantization counted, as the layer runs it. Device time in CUDA graphs over
weight copies L2 cannot hold (benchmarks/quant_gpu.py's device_us); each candidate checked against the torch
reference. Also tries torch's own block-scaled GEMM (F.scaled_mm with 1x128 / 128x128 scales) and says what it did.

    python3 benchmarks/tuning/fp8_block_tiles.py [--write-table] [--json out.json]
    TRITON_INTERPRET=1 python3 benchmarks/tuning/fp8_block_tiles.py --tiny

--write-table replaces GEMM_CANDIDATES in novainfer/kernels/fp8_block.py by the sweep's ranking per row bucket (the
best by the sum over shapes and row counts of time / bf16 time, then the next three).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.quant_gpu import SHAPES_7B, SHAPES_TINY, Operands, device_us, rel  # noqa: E402

SHAPES_QWEN3_8B = [
    ("8b.qkv_proj", 4096, 6144),
    ("8b.o_proj", 4096, 4096),
    ("8b.gate_up_proj", 4096, 24576),
    ("8b.down_proj", 12288, 4096),
]
ROWS = [2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384]
BUCKETS = [8, 16, 32, 64, 128, 256, 511]  # upper bounds of the row buckets the table is keyed by (DEQUANT_MIN_M - 1)
TILES = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    (16, 32, 2, 4),
    (16, 64, 4, 4),
    (16, 64, 4, 5),
    (16, 128, 4, 4),
    (16, 128, 4, 5),
    (32, 64, 4, 4),
    (32, 128, 4, 4),
    (32, 128, 4, 5),
    (64, 64, 4, 4),
    (64, 128, 4, 3),
    (64, 128, 4, 4),
    (64, 128, 8, 4),
    (64, 256, 8, 3),
    (128, 64, 4, 4),
    (128, 128, 8, 3),
    (128, 128, 8, 4),
    (128, 256, 8, 3),
]
FILLS = [0, 1, 2, 4]


def fits(tile: tuple[int, int, int, int], m: int) -> bool:
    """Tiles worth timing at m rows: BLOCK_M no taller than m needs (16 at least) nor under half of it up to 64."""
    bm = tile[0]
    need = max(16, 1 << (m - 1).bit_length())
    return bm <= need and bm >= min(need, 64) // 2


def scaled_mm_probe(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, want: torch.Tensor) -> str:
    """torch's block-scaled GEMM on this device: its rel err and time, or why it did not run."""
    from novainfer.kernels.fp8_block import per_token_group_quant

    try:
        import torch.nn.functional as F
        from torch.nn.functional import ScalingType as st

        a, a_s = per_token_group_quant(x, 128)
        a_s_cm = a_s.t().contiguous().t()  # cuBLAS reads the 1x128 scales M-major
        y = F.scaled_mm(a, wq.t(), a_s_cm, st.BlockWise1x128, ws.t(), st.BlockWise128x128, output_dtype=x.dtype)
        return f"ran, rel {rel(y.float(), want):.1e}"
    except Exception as e:  # noqa: BLE001 - the probe reports whatever stops it
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def sweep(shapes, rows: list[int], device: torch.device, iters: int) -> list[dict]:
    """One row per (shape, m, candidate): device us, rel err; the bf16 and package-default times in each cell."""
    from novainfer.kernels.fp8_block import fp8_block_gemm, per_token_group_quant
    from novainfer.layers.quantization.fp8_block import block_reference

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for name, k, n in shapes:
        ops = Operands(k, n, device, g)
        for m in rows:
            x = torch.randn(m, k, device=device, generator=g).to(dtype)
            want = block_reference(x, ops.wq, ops.ws, (128, 128)).float()
            bf16 = device_us(
                lambda i: lambda w=ops.copy("bf16", i)[0]: torch.nn.functional.linear(x, w), 2 * n * k, device, iters
            )

            def run(i, cand):
                wq, ws = ops.copy("fp8", i)
                tiles = None if cand is None else cand[:4] + (cand[4],)
                return lambda: fp8_block_gemm(*per_token_group_quant(x, 128), wq, ws, (128, 128), x.dtype, tiles)

            cands = [None] if device.type != "cuda" else [None] + [t + (f,) for t in TILES if fits(t, m) for f in FILLS]
            cell = {"shape": name, "m": m, "k": k, "n": n, "bf16_us": bf16, "times": {}, "errors": {}}
            for cand in cands:
                label = "default" if cand is None else str(cand)
                try:
                    err = rel(run(0, cand)().float(), want)
                    us = device_us(lambda i: run(i, cand), n * k, device, iters)
                except Exception as e:  # noqa: BLE001 - a tile this GPU cannot run (shared memory): skipped
                    print(f"  {name} M={m} {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                cell["times"][label], cell["errors"][label] = us, err
            if device.type == "cuda" and m in (16, 128):
                cell["scaled_mm"] = scaled_mm_probe(x, ops.wq, ops.ws, want)
            best = min(cell["times"], key=cell["times"].get)
            worst_err = max(cell["errors"].values())
            print(
                f"{name:16s} M={m:4d} bf16 {bf16:7.1f} us | default {cell['times']['default']:7.1f} "
                f"({bf16 / cell['times']['default']:.2f}x) | best {cell['times'][best]:7.1f} "
                f"({bf16 / cell['times'][best]:.2f}x) {best} | max rel {worst_err:.1e}"
                + (f" | scaled_mm: {cell['scaled_mm']}" if "scaled_mm" in cell else ""),
                flush=True,
            )
            out.append(cell)
    return out


def ranking(cells: list[dict], buckets: list[int] = BUCKETS) -> dict[int, list[tuple[float, str]]]:
    """Per row bucket: (sum of time / bf16 over the bucket's cells, candidate), best first; only candidates timed in
    every cell of the bucket (labels naming a path rather than a tile: "default", "dequant", "gemv" are left out)."""
    per: dict[int, dict[str, list[float]]] = {}
    count: dict[int, int] = {}
    for c in cells:
        b = next(b for b in buckets if c["m"] <= b)
        count[b] = count.get(b, 0) + 1
        for label, us in c["times"].items():
            per.setdefault(b, {}).setdefault(label, []).append(us / c["bf16_us"])
    return {b: sorted((sum(v), lb) for lb, v in per[b].items() if len(v) == count[b] and lb[0] == "(") for b in per}


def write_table(ranks: dict[int, list[tuple[float, str]]], kernel_file: str = "fp8_block.py") -> str:
    """GEMM_CANDIDATES in novainfer/kernels/<kernel_file> replaced by the ranking (best four per bucket; the last
    bucket stays open-ended)."""
    path = os.path.join(ROOT, "novainfer", "kernels", kernel_file)
    src = open(path).read()
    lines = ["GEMM_CANDIDATES: dict[int, list[tuple[int, int, int, int, int]]] = {"]
    keys = sorted(ranks)
    for b in keys:
        key = "1 << 30" if b == keys[-1] else str(b)
        lines.append(f"    {key}: [{', '.join(lb for _, lb in ranks[b][:4])}],")
    lines.append("}")
    table = "\n".join(lines)
    new, n = re.subn(r"GEMM_CANDIDATES: dict\[.*?\n}\n", table + "\n", src, count=1, flags=re.S)
    assert n == 1, "GEMM_CANDIDATES not found"
    open(path, "w").write(new)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the interpreter's shapes and rows, the default tile only")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--models", default="7b,8b", help="7b, 8b: whose layer shapes")
    ap.add_argument("--write-table", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        shapes, rows = SHAPES_TINY, [3, 20]
    else:
        named = {"7b": SHAPES_7B, "8b": SHAPES_QWEN3_8B}
        shapes, rows = [s for m in args.models.split(",") for s in named[m]], ROWS
    cells = sweep(shapes, rows, device, args.iters)
    ranks = ranking(cells)
    print("\nper row bucket: sum over cells of (time / bf16), best four; the package's default for comparison")
    for b, r in ranks.items():
        dflt = sum(c["times"]["default"] / c["bf16_us"] for c in cells if next(x for x in BUCKETS if c["m"] <= x) == b)
        print(f"  M<={b:4d}: default {dflt:.2f} | " + " | ".join(f"{lb} {s:.2f}" for s, lb in r[:4]))
    if args.write_table and device.type == "cuda":
        print(write_table(ranks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(cells, f, indent=1)


if __name__ == "__main__":
    main()
