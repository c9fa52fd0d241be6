"""Pre-quantized formats on one GPU, in one run: the kernels against their torch references and bf16 on
Qwen2.5-7B's layer shapes, then the whole model (random weights packed in each format, load_format dummy)
in bf16, block FP8, compressed-tensors FP8 and INT4: bench-shape throughput, batch-1 decode, weight bytes.

    python benchmarks/quant_gpu.py --out /tmp/quant          # on an H100/H200
    TRITON_INTERPRET=1 python benchmarks/quant_gpu.py --tiny  # the same steps on the CPU, tiny shapes
    python benchmarks/quant_gpu.py --part moe                 # the MoE experts on Qwen3-30B-A3B's shapes
    TRITON_INTERPRET=1 python benchmarks/quant_gpu.py --tiny --part moe

--part moe: the fused-MoE grouped GEMMs (kernels/fused_moe_quant.py: block FP8, INT4 g128) against their torch
references and the bf16 fused MoE (kernels/fused_moe.py) on one Qwen3-30B-A3B layer (128 experts, 8 active,
hidden 2048, expert inter 768) by token count, then the whole random Qwen3-30B-A3B in bf16, block FP8 and INT4
(random:qwen3-moe-small with --tiny). Up to moe_gemv.MAX_TOKENS tokens each format's default is kernels/moe_gemv.py's
GEMV per (token, expert) pair; there INT4 is also timed on the grouped GEMMs ("grouped") and with each of
moe_gemv.INT4_CANDIDATES' tiles, and a table sets the INT4 GEMV beside them and the bf16 GEMV:

    python benchmarks/quant_gpu.py --part moe-kernels --moe-formats int4 --moe-tokens 1 2 3 4

Kernel times are device times: each call captured in a CUDA graph (as decode runs), over enough copies of the weight
that none is read from L2; each quantized kernel is also run with every candidate tile shape of its module (the
sweep), the package's default and the best printed per shape, then the best tiles per shape / row bucket to paste
into GEMV_TILES / GEMM_CANDIDATES. Every candidate is checked against the torch reference.

Targets (issue 38), printed beside the results: INT4 batch-1 >= 2.5x bf16 and bench shape >= bf16; block FP8
bench shape >= 1.1x bf16 and batch-1 >= 1.6x.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.checkpoints import resolve_model  # noqa: E402

# name, K (input), N (output): Qwen2.5-7B's dense layers, one rank
SHAPES_7B = [
    ("qkv_proj", 3584, 4608),
    ("o_proj", 3584, 3584),
    ("gate_up_proj", 3584, 37888),
    ("down_proj", 18944, 3584),
]
SHAPES_TINY = [("qkv_proj", 256, 384), ("down_proj", 512, 256)]
FORMATS = {  # name -> the quantization_config written into the random model's config.json
    "bf16": None,
    "fp8-block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
    "ct-fp8": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "token",
                    "dynamic": True,
                },
            }
        },
    },
    "int4-gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False},
}
MOE_FORMATS = ("bf16", "fp8-block", "ct-fp8", "int4-gptq")
# one Qwen3-30B-A3B MoE layer (one rank), and its tiny stand-in for the interpreter
MOE_SHAPE = dict(experts=128, hidden=2048, inter=768, top_k=8)
MOE_SHAPE_TINY = dict(experts=8, hidden=256, inter=128, top_k=2)
TARGETS = {"fp8-block": (1.1, 1.6), "int4-gptq": (1.0, 2.5)}  # (bench shape, batch-1) x bf16
# relative error against the torch reference on the GPU (bf16 output rounding, float32 accumulation); under the CPU
# interpreter the float8 cast truncates where CUDA rounds, so the fp8 figure is only printed there
MAX_REL = {"fp8-block": 1e-2, "int4": 1e-2}
# The fused MoE with FP8 activations (past WEIGHT_ONLY_MAX_M tokens) against its reference, which rounds the same
# inputs to e4m3: the kernel's gate/up output, summed in another order, differs from the reference's in its last
# bf16 bit (2^-8) now and then, and an input within that of an e4m3 rounding boundary (3 mantissa bits, steps 2^-3)
# moves by a whole step: about 1 input in 32, by ~1/16 on average, ~1e-2 in norm. Measured 1.3-1.5e-2 at 16-4,096
# tokens and 2.2e-2 at 4 (fewer inputs, more spread) on H100s (docs/bench/2026-12-05, 2026-12-06); a wrong scale or
# group gives errors of order 1.
MAX_REL_FP8_ACTIVATIONS = 3e-2


def timed(fn, iters: int) -> float:
    """Median seconds of fn (wall clock; the CPU path)."""
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


L2_FLUSH_BYTES = 160 << 20  # a graph's calls read this many weight bytes, over copies: none stays in L2 (50 MB)


def device_us(make_fn, weight_bytes: int, device: torch.device, iters: int) -> float:
    """Microseconds per call of make_fn(i)() for i over enough weight copies that L2 holds none from the call before:
    on the GPU one CUDA graph of one call per copy, replayed (decode runs in graphs: no launch cost counted)."""
    if device.type != "cuda":
        return timed(make_fn(0), iters) * 1e6
    from benchmarks.tuning.gemv_tiles import graph_us

    copies = max(1, -(-L2_FLUSH_BYTES // weight_bytes))
    return graph_us([make_fn(i) for i in range(copies)], reps=max(3, 4 * iters // copies))


class Operands:
    """One layer's random weight in bf16, block FP8 and INT4 (symmetric g128), each in copies for device_us."""

    def __init__(self, k: int, n: int, device: torch.device, g: torch.Generator):
        from novainfer.layers.quantization.fp8_block import expand_blocks
        from novainfer.layers.quantization.int4 import pack_int4

        w = torch.randn(n, k, device=device, generator=g) * 0.02
        nb, kb = -(-n // 128), -(-k // 128)
        pad = torch.nn.functional.pad(w, (0, kb * 128 - k, 0, nb * 128 - n)).view(nb, 128, kb, 128)
        self.ws = pad.abs().amax(dim=(1, 3)) / 448
        self.wq = (w / expand_blocks(self.ws, (128, 128), (n, k))).to(torch.float8_e4m3fn)
        wg = w.reshape(n, k // 128, 128)
        s4 = wg.abs().amax(2) / 7  # [N, K/G]
        codes = (wg / s4[:, :, None]).round().clamp(-8, 7).add(8).reshape(n, k).to(torch.uint8)
        self.q4, self.z4 = pack_int4(codes), torch.full(s4.shape, 8, dtype=torch.uint8, device=device)
        self.s4 = s4.half() if device.type == "cuda" else s4  # GPTQ's float16 scales, as the layer keeps them
        self.w16 = w.to(torch.bfloat16 if device.type == "cuda" else torch.float32)
        self.copies: dict[str, list] = {}

    def copy(self, what: str, i: int):
        """Copy i of a format's tensors (copy 0: the originals)."""
        base = {"bf16": (self.w16,), "fp8": (self.wq, self.ws), "int4": (self.q4, self.s4, self.z4)}[what]
        have = self.copies.setdefault(what, [base])
        while len(have) <= i:
            have.append(tuple(t.clone() for t in base))
        return have[i]


def candidates(fmt: str, m: int, n: int, k: int, device: torch.device) -> list[tuple[str, object]]:
    """(label, tiles) of a format's kernel at m rows: the package's choice first (tiles None), then on a GPU the
    sweep's (the CPU interpreter runs fixed tiles)."""
    from novainfer.kernels import fp8_block, int4_gemm
    from novainfer.kernels.tiling import row_bucket

    mod = fp8_block if fmt == "fp8-block" else int4_gemm
    if device.type != "cuda":
        return [("default", None)]
    if m <= mod.GEMV_MAX_M and fmt == "fp8-block":  # kernels/gemv.py's, swept by benchmarks/tuning/gemv_tiles.py
        return [("default", None)]
    if m <= mod.GEMV_MAX_M:
        default = mod.GEMV_TILES.get((n, k), mod.GEMV_DEFAULT)
        return [("default", None)] + [(f"gemv{t}", t) for t in mod.GEMV_CANDIDATES if t != default]
    bucket = row_bucket(m, mod.GEMM_CANDIDATES)
    return [("default", None)] + [(f"gemm{t}", t) for t in mod.GEMM_CANDIDATES[bucket][1:]]


def kernel_fn(fmt: str, x: torch.Tensor, ops: Operands, i: int, tiles):
    """The callable that runs fmt's kernel on copy i of the weight with the given tiles (None: the default)."""
    from novainfer.kernels.fp8_block import GEMV_MAX_M as FP8_GEMV, WEIGHT_ONLY_MAX_M, fp8_block_gemm
    from novainfer.kernels.fp8_block import per_token_group_quant
    from novainfer.kernels.gemv import gemv
    from novainfer.kernels.int4_gemm import GEMV_MAX_M as INT4_GEMV, int4_gemm, int4_gemv

    m = x.shape[0]
    if fmt == "bf16":
        (w16,) = ops.copy("bf16", i)
        return lambda: torch.nn.functional.linear(x, w16)
    if fmt == "fp8-block":
        wq, ws = ops.copy("fp8", i)
        if m <= FP8_GEMV:
            return lambda: gemv(x, wq, weight_scale=ws, tiles=tiles)
        if m <= WEIGHT_ONLY_MAX_M:
            return lambda: fp8_block_gemm(x, None, wq, ws, (128, 128), x.dtype, tiles)
        return lambda: fp8_block_gemm(*per_token_group_quant(x, 128), wq, ws, (128, 128), x.dtype, tiles)
    q4, s4, z4 = ops.copy("int4", i)
    if m <= INT4_GEMV:
        return lambda: int4_gemv(x, q4, s4, z4, 128, tiles)
    return lambda: int4_gemm(x, q4, s4, z4, 128, tiles)


def kernel_rows(shapes, rows: list[int], device: torch.device, iters: int) -> list[dict]:
    """Each layer shape and row count: bf16 F.linear and the block FP8 and INT4 (g128) kernels, each with every
    candidate tile shape (device time, CUDA graphs, weights not in L2); rel err of each against its torch
    reference. The package's default and the best candidate are both reported."""
    from novainfer.kernels.fp8_block import WEIGHT_ONLY_MAX_M
    from novainfer.layers.quantization.fp8_block import block_reference, weight_only_reference
    from novainfer.layers.quantization.int4 import dequantize_int4

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = []
    g = torch.Generator(device=device).manual_seed(0)
    for name, k, n in shapes:
        ops = Operands(k, n, device, g)
        nbytes = {"bf16": 2 * n * k, "fp8-block": n * k, "int4": n * k // 2}
        w4 = dequantize_int4(ops.q4, ops.s4, ops.z4, 128)
        for m in rows:
            x = torch.randn(m, k, device=device, generator=g).to(dtype)
            t_bf16 = device_us(lambda i: kernel_fn("bf16", x, ops, i, None), nbytes["bf16"], device, iters)
            ref8 = weight_only_reference if m <= WEIGHT_ONLY_MAX_M else block_reference
            refs = {"fp8-block": ref8(x, ops.wq, ops.ws, (128, 128)), "int4": x.float() @ w4}
            row = dict(layer=name, m=m, k=k, n=n, bf16_us=t_bf16)
            for fmt in ("fp8-block", "int4"):
                sweep = {}
                for label, tiles in candidates(fmt, m, n, k, device):
                    try:
                        err = rel(kernel_fn(fmt, x, ops, 0, tiles)(), refs[fmt])
                        us = device_us(lambda i: kernel_fn(fmt, x, ops, i, tiles), nbytes[fmt], device, iters)
                    except Exception as e:  # a candidate this GPU cannot run (shared memory): skipped, not fatal
                        if tiles is None:
                            raise
                        print(f"  {fmt} {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    sweep[label] = (us, err, tiles)
                best = min(sweep, key=lambda lb: sweep[lb][0])
                row[f"{fmt}_us"] = sweep["default"][0]
                row[f"{fmt}_x"] = t_bf16 / sweep["default"][0]
                row[f"{fmt}_gbs"] = nbytes[fmt] / sweep["default"][0] / 1e3
                row[f"{fmt}_best"] = best
                row[f"{fmt}_best_us"] = sweep[best][0]
                row[f"{fmt}_best_tiles"] = sweep[best][2]
                row[f"{fmt}_rel"] = max(e for _, e, _ in sweep.values())
                row[f"{fmt}_ok"] = device.type != "cuda" or row[f"{fmt}_rel"] <= MAX_REL[fmt]
                row[f"{fmt}_sweep"] = {lb: v[0] for lb, v in sweep.items()}
            out.append(row)
            print(
                f"{name:13s} M={m:5d} bf16 {t_bf16:8.1f} us | "
                + " | ".join(
                    f"{f} {row[f + '_us']:8.1f} us ({row[f + '_x']:.2f}x, {row[f + '_gbs']:.0f} GB/s, "
                    f"best {row[f + '_best_us']:.1f} {row[f + '_best']}, rel {row[f + '_rel']:.1e})"
                    for f in ("fp8-block", "int4")
                ),
                flush=True,
            )
    print_best_tiles(out)
    return out


def print_best_tiles(rows: list[dict]) -> None:
    """Per format: the best GEMV tiles per (N, K) (GEMV_TILES to paste) and, per GEMM row bucket, the candidate
    with the least total time over the shapes (its GEMM_CANDIDATES entry to put first)."""
    from novainfer.kernels import fp8_block, int4_gemm
    from novainfer.kernels.tiling import row_bucket

    for fmt, mod in (("fp8-block", fp8_block), ("int4", int4_gemm)):
        gemv = {(r["n"], r["k"]): r[f"{fmt}_best_tiles"] for r in rows if r["m"] == 1}
        print(f"{fmt}: GEMV_TILES (M=1 best) = " + repr({key: t for key, t in gemv.items() if t is not None}))
        buckets: dict[int, dict[str, float]] = {}
        runs: dict[int, dict[str, int]] = {}
        for r in rows:
            if r["m"] > mod.GEMV_MAX_M:
                b = row_bucket(r["m"], mod.GEMM_CANDIDATES)
                tot, cnt = buckets.setdefault(b, {}), runs.setdefault(b, {})
                for lb, us in r[f"{fmt}_sweep"].items():
                    tot[lb], cnt[lb] = tot.get(lb, 0.0) + us, cnt.get(lb, 0) + 1
        for b, tot in buckets.items():
            full = [lb for lb in tot if runs[b][lb] == runs[b]["default"]]  # ran on every shape of the bucket
            best = min(full, key=tot.get)
            print(
                f"{fmt}: GEMM bucket M<={b}: best {best} ({tot[best]:.1f} us over shapes; default {tot['default']:.1f})"
            )


class MoeOperands:
    """One MoE layer's random experts (std 0.02) in bf16, block FP8 and INT4 (symmetric g128, float16 scales), packed
    as the experts methods store them (layers/quantization/fp8_block.py, int4.py)."""

    def __init__(self, shape: dict, device: torch.device, g: torch.Generator):
        from types import SimpleNamespace

        from novainfer.layers.quantization.fp8_block import Fp8BlockMoEMethod
        from novainfer.layers.quantization.int4 import Int4Format, Int4LinearMethod, Int4MoEMethod

        e, h, inter = shape["experts"], shape["hidden"], shape["inter"]
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        fp8, int4 = (
            Fp8BlockMoEMethod((128, 128), "weight_scale_inv"),
            Int4MoEMethod(Int4LinearMethod(Int4Format("gptq", 128))),
        )
        held = SimpleNamespace(act_dtype=torch.float16 if device.type == "cuda" else torch.float32)
        self.bf16, self.fp8, self.int4 = {}, {}, {}
        for side, (n, k) in (("w13", (2 * inter, h)), ("w2", (h, inter))):
            w = torch.randn(e, n, k, device=device, generator=g) * 0.02
            self.bf16[side] = w.to(dtype)
            q = fp8.quantize(held, side, w)
            self.fp8[side] = (q[f"{side}_weight"], q[f"{side}_weight_scale"])
            q = int4.quantize(held, side, w)
            self.int4[side] = (q[f"{side}_qweight"], q[f"{side}_scales"], q[f"{side}_qzeros"])
            del w
        self.nbytes = {
            f: sum(
                t.numel() * t.element_size()
                for side in d.values()
                for t in (side if isinstance(side, tuple) else (side,))
            )
            for f, d in (("bf16", self.bf16), ("fp8-block", self.fp8), ("int4", self.int4))
        }


# (BLOCK_N, BLOCK_K, warps, stages) the MoE sweep tries for both quantized grouped GEMMs, each with the BLOCK_Ms of
# MOE_SWEEP_BLOCK_M (one alignment serves both GEMMs)
MOE_TILE_CANDIDATES = [
    (64, 128, 4, 3),
    (64, 128, 4, 4),
    (128, 128, 4, 3),
    (128, 128, 8, 3),
    (128, 128, 8, 4),
    (256, 128, 8, 3),
    (128, 64, 4, 4),
    (64, 64, 4, 4),
]
MOE_SWEEP_BLOCK_M = (32, 64, 128)


def moe_candidates(fmt: str, m: int, shape: dict, device: torch.device) -> list[tuple[str, object]]:
    """(label, tiles) of a quantized fused MoE at m tokens: the package's choice first (None), then on a GPU the
    grouped GEMMs' sweep ((gate/up tiles, down tiles)). INT4 up to moe_gemv.MAX_TOKENS tokens, where the package
    takes the GEMV: also the grouped GEMMs with the package's tiles ("grouped", the path before the GEMV) and on a GPU
    the GEMV with each of moe_gemv.INT4_CANDIDATES (("gemv", tiles))."""
    from novainfer.kernels import moe_gemv
    from novainfer.kernels.fused_moe import moe_tiles
    from novainfer.kernels.fused_moe_quant import INT4_MOE_TILES

    cands: list[tuple[str, object]] = [("default", None)]
    if fmt == "int4" and m <= moe_gemv.MAX_TOKENS:
        pairs, e, h, inter = m * shape["top_k"], shape["experts"], shape["hidden"], shape["inter"]
        up, down = (
            moe_tiles(pairs, e, n, k, d, INT4_MOE_TILES) for n, k, d in ((2 * inter, h, False), (h, inter, True))
        )
        cands.append(("grouped", (up, down)))
        if device.type == "cuda":
            cands += [(f"gemv{t}", ("gemv", t)) for t in moe_gemv.INT4_CANDIDATES if t != moe_gemv.INT4_TILES]
    if device.type != "cuda":
        return cands
    return cands + [
        (str((bm, *c)), ((bm, *c), (bm, *c)))
        for bm in MOE_SWEEP_BLOCK_M
        if bm <= max(32, 4 * m * shape["top_k"] // shape["experts"])  # tiles mostly padding: not worth a compile
        for c in MOE_TILE_CANDIDATES
    ]


def moe_kernel_rows(
    shape: dict, tokens: list[int], device: torch.device, iters: int, formats: tuple[str, ...] = ("fp8-block", "int4")
) -> list[dict]:
    """Per token count: the bf16 fused MoE, the block-FP8 one (the package's choice of weight-only or FP8
    activations by token count) and the INT4 one, device time each (CUDA graphs), each quantized one also with
    every candidate tile shape (the sweep: default and best printed); rel err of every run against its torch
    reference (the experts dequantized, float32)."""
    from novainfer.kernels.fp8_block import WEIGHT_ONLY_MAX_M
    from novainfer.kernels.fused_moe import experts_gemv, fused_experts
    from novainfer.kernels.fused_moe_quant import fused_experts_fp8_block, fused_experts_int4
    from novainfer.layers.activation import get_act_and_mul
    from novainfer.layers.fused_moe.routing import select_experts
    from novainfer.layers.quantization.fp8_block import fused_experts_fp8_block_reference
    from novainfer.layers.quantization.int4 import fused_experts_int4_reference

    g = torch.Generator(device=device).manual_seed(0)
    ops = MoeOperands(shape, device, g)
    act = get_act_and_mul("silu")
    dtype = ops.bf16["w13"].dtype
    out = []
    for m in tokens:
        x = torch.randn(m, shape["hidden"], device=device, generator=g).to(dtype)
        logits = torch.randn(m, shape["experts"], device=device, generator=g)
        weights, ids = select_experts(logits, shape["top_k"], True)

        def run(fmt: str, i: int, tiles):
            """fmt's call on routing copy i (its experts shifted by i * top_k: a graph of several copies reads
            experts that the call before did not leave in L2) with the given tiles (None: the package's)."""
            ids_i = (ids + i * shape["top_k"]) % shape["experts"]
            if fmt == "bf16":
                return lambda: fused_experts(x, ops.bf16["w13"], ops.bf16["w2"], weights, ids_i, act)
            if fmt == "fp8-block":
                w = (*ops.fp8["w13"], *ops.fp8["w2"], (128, 128))
                return lambda: fused_experts_fp8_block(x, *w, weights, ids_i, act, tiles=tiles)
            if tiles is not None and tiles[0] == "gemv":  # the INT4 GEMV with a candidate's tiles
                (q13, s13, z13), (q2, s2, z2) = ops.int4["w13"], ops.int4["w2"]
                w = (q13, q2, weights, ids_i, act, s13, s2)
                return lambda: experts_gemv(x, *w, tiles=tiles[1], w13_zeros=z13, w2_zeros=z2, group=128)
            w = (*ops.int4["w13"], *ops.int4["w2"], 128)
            return lambda: fused_experts_int4(x, *w, weights, ids_i, act, tiles=tiles)

        refs = {}
        if "fp8-block" in formats:
            refs["fp8-block"] = fused_experts_fp8_block_reference(
                x, *ops.fp8["w13"], *ops.fp8["w2"], (128, 128), weights, ids, act, m > WEIGHT_ONLY_MAX_M
            )
        if "int4" in formats:
            refs["int4"] = fused_experts_int4_reference(x, *ops.int4["w13"], *ops.int4["w2"], 128, weights, ids, act)
        touched = torch.unique(ids).numel() / shape["experts"]  # the share of the experts' bytes a call reads
        row = dict(tokens=m)
        row["bf16_us"] = device_us(lambda i: run("bf16", i, None), int(ops.nbytes["bf16"] * touched), device, iters)
        for fmt in formats:
            sweep = {}
            for label, tiles in moe_candidates(fmt, m, shape, device):
                try:
                    err = rel(run(fmt, 0, tiles)(), refs[fmt])
                    us = device_us(lambda i: run(fmt, i, tiles), int(ops.nbytes[fmt] * touched), device, iters)
                except Exception as e:  # a candidate this GPU cannot run: skipped, not fatal
                    if tiles is None:
                        raise
                    print(f"  {fmt} {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                sweep[label] = (us, err)
            best = min(sweep, key=lambda lb: sweep[lb][0])
            row[f"{fmt}_us"], row[f"{fmt}_best"], row[f"{fmt}_best_us"] = sweep["default"][0], best, sweep[best][0]
            row[f"{fmt}_x"] = row["bf16_us"] / row[f"{fmt}_us"]
            row[f"{fmt}_rel"] = max(e for _, e in sweep.values())
            row[f"{fmt}_sweep_us"] = {label: us for label, (us, _) in sweep.items()}
            bound = MAX_REL_FP8_ACTIVATIONS if fmt == "fp8-block" and m > WEIGHT_ONLY_MAX_M else MAX_REL[fmt]
            row[f"{fmt}_ok"] = device.type != "cuda" or row[f"{fmt}_rel"] <= bound
            if "grouped" in sweep:  # INT4 at a GEMV token count: the grouped GEMMs it replaced, the best GEMV tiles
                gemv = {lb: us for lb, (us, _) in sweep.items() if lb == "default" or lb.startswith("gemv")}
                row["int4_grouped_us"] = sweep["grouped"][0]
                row["int4_gemv_best"] = min(gemv, key=gemv.get)
        del refs
        out.append(row)
        print(
            f"MoE tokens={m:5d} bf16 {row['bf16_us']:9.1f} us | "
            + " | ".join(
                f"{f} {row[f + '_us']:9.1f} us ({row[f + '_x']:.2f}x, best {row[f + '_best_us']:.1f} "
                f"{row[f + '_best']}, rel {row[f + '_rel']:.1e})"
                for f in formats
            ),
            flush=True,
        )
        torch.cuda.empty_cache() if device.type == "cuda" else None
    print_int4_gemv_table(out)
    return out


def print_int4_gemv_table(rows: list[dict]) -> None:
    """The INT4 GEMV's rows (up to moe_gemv.MAX_TOKENS tokens) beside the INT4 grouped GEMMs and the bf16 GEMV,
    then the GEMV candidate with the least total time over them (INT4_TILES to paste)."""
    from novainfer.kernels.moe_gemv import INT4_TILES

    rows = [r for r in rows if "int4_grouped_us" in r]
    if not rows:
        return
    print(
        f"\nINT4 MoE GEMV (default: INT4_TILES {INT4_TILES} on a GPU) against the INT4 grouped GEMMs and the bf16 GEMV"
    )
    print(
        f"{'tokens':>6s} | {'bf16 GEMV':>9s} | {'INT4 GEMV':>9s} | {'x bf16':>6s} | {'INT4 grouped':>12s} | "
        f"{'x bf16':>6s} | {'GEMV x grouped':>14s} | {'best GEMV tiles (us)':>26s} | rel err"
    )
    for r in rows:
        us, grouped, best = r["int4_us"], r["int4_grouped_us"], r["int4_gemv_best"]
        print(
            f"{r['tokens']:6d} | {r['bf16_us']:9.1f} | {us:9.1f} | {r['bf16_us'] / us:6.2f} | {grouped:12.1f} | "
            f"{r['bf16_us'] / grouped:6.2f} | {grouped / us:14.2f} | {best:>17s} {r['int4_sweep_us'][best]:8.1f} | "
            f"{r['int4_rel']:.1e}"
        )
    labels = [lb for lb in rows[0]["int4_sweep_us"] if lb == "default" or lb.startswith("gemv")]
    total = {lb: sum(r["int4_sweep_us"].get(lb, float("inf")) for r in rows) for lb in labels}
    best = min(total, key=total.get)
    print(
        f"int4: INT4_TILES best over {[r['tokens'] for r in rows]} tokens: {best} ({total[best]:.1f} us in all; "
        f"default {total['default']:.1f})"
    )


def model_folder(base: str, fmt: str, out_dir: str) -> str:
    """A config-only copy of the random model with fmt's quantization_config."""
    import shutil

    path = os.path.join(out_dir, f"model-{fmt}")
    if os.path.exists(path):
        shutil.rmtree(path)
    shutil.copytree(base, path, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    if FORMATS[fmt] is not None:
        cfg["quantization_config"] = FORMATS[fmt]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def e2e_one(path: str, args: argparse.Namespace) -> dict:
    """One format in this process: weight bytes, batch-1 decode, bench-shape throughput."""
    from benchmarks.latency import nova_after_first
    from benchmarks.throughput import make_workload
    from novainfer import LLM, SamplingParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(load_format="dummy", device=device, max_model_len=args.max_model_len)
    if device == "cuda":
        kw["gpu_memory_utilization"] = 0.85
    llm = LLM(path, **kw)
    model = llm.llm_engine.executor.workers[0].model_runner.model
    linear = sum(  # the linear layers' and the experts' weights (biases aside)
        t.numel() * t.element_size()
        for m in model.modules()
        if hasattr(m, "quant_method") and type(m).__name__.endswith(("Linear", "FusedMoE"))
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        if t is not getattr(m, "bias", None)
        and t is not getattr(m, "w13_bias", None)
        and t is not getattr(m, "w2_bias", None)
    )
    total = sum(t.numel() * t.element_size() for t in model.parameters())
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(128)]
    nova_after_first(llm, prompt, 8)  # warm
    secs = min(nova_after_first(llm, prompt, args.decode_tokens) for _ in range(args.repeat))
    decode = (args.decode_tokens - 1) / secs
    prompts, outs = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, 0)
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, seed=0) for o in outs]
    llm.generate([{"prompt_token_ids": prompts[0]}], params[:1], use_tqdm=False)
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(r.outputs[0].token_ids) for r in res)
    return dict(linear_bytes=linear, param_bytes=total, decode_tok_s=decode, bench_tok_s=tokens / elapsed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and workloads (the CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--part", default="all", choices=["all", "kernels", "e2e", "moe", "moe-kernels", "moe-e2e"])
    ap.add_argument("--formats", default=None, help="e2e formats (default: all; with --part moe: MOE_FORMATS)")
    ap.add_argument("--moe-formats", default="fp8-block,int4", help="the quantized fused MoEs --part moe-kernels times")
    ap.add_argument("--moe-tokens", type=int, nargs="+", default=None, help="--part moe-kernels' token counts")
    ap.add_argument("--out", default="/tmp/novainfer-quant")
    ap.add_argument("--num-prompts", type=int, default=None, help="bench shape: 256 prompts of 100-1024 tokens")
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--decode-tokens", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--e2e-one", default=None, help=argparse.SUPPRESS)  # internal: one format, JSON on stdout
    args = ap.parse_args()
    if args.tiny:
        args.num_prompts = args.num_prompts or 2
        args.input_len, args.output_len = args.input_len or 16, args.output_len or 4
        args.decode_tokens, args.repeat, args.max_model_len = args.decode_tokens or 4, 1, 256
    args.num_prompts = args.num_prompts or 256
    args.decode_tokens = args.decode_tokens or 256
    if args.e2e_one:
        print("E2E " + json.dumps(e2e_one(args.e2e_one, args)), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if args.part in ("all", "kernels"):
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        shapes, rows = (SHAPES_TINY, [1, 3, 8, 20]) if args.tiny else (SHAPES_7B, [1, 4, 16, 32, 256, 4096])
        result["kernels"] = kernel_rows(shapes, rows, device, 1 if args.tiny else 50)
        bad = [f"{r['layer']} M={r['m']} {f}" for r in result["kernels"] for f in MAX_REL if not r[f"{f}_ok"]]
        print("kernel checks: " + (f"FAILED {bad}" if bad else f"all within {MAX_REL} of the torch references"))
        result["kernel_failures"] = bad
    if args.part in ("moe", "moe-kernels"):
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        shape, tokens = (
            (MOE_SHAPE_TINY, [1, 3, 5, 20])
            if args.tiny
            else (MOE_SHAPE, args.moe_tokens or [1, 2, 3, 4, 16, 64, 256, 1024, 4096])
        )
        formats = tuple(args.moe_formats.split(","))
        result["moe_kernels"] = moe_kernel_rows(shape, tokens, device, 1 if args.tiny else 20, formats)
        bad = [f"tokens={r['tokens']} {f}" for r in result["moe_kernels"] for f in formats if not r[f"{f}_ok"]]
        bounds = f"{MAX_REL}, fp8-block with FP8 activations {MAX_REL_FP8_ACTIVATIONS}"
        print("MoE kernel checks: " + (f"FAILED {bad}" if bad else f"all within {bounds} of the torch references"))
        result["kernel_failures"] = bad
    if args.part in ("moe", "moe-e2e"):
        name = "qwen3-moe-small" if args.tiny else "qwen3-30b-a3b"
        result["e2e"] = run_e2e(resolve_model(f"random:{name}"), (args.formats or ",".join(MOE_FORMATS)), args)
        print_table(result, name)
    if args.part in ("all", "e2e"):
        base = resolve_model("random:qwen3-dense-small" if args.tiny else "random:qwen2.5-7b")
        result["e2e"] = run_e2e(base, args.formats or ",".join(FORMATS), args)
        print_table(result, "qwen3-dense-small" if args.tiny else "Qwen2.5-7B")
    with open(os.path.join(args.out, "quant_gpu.json"), "w") as f:
        json.dump(result, f, indent=2)
    if result.get("kernel_failures"):
        sys.exit(1)


def run_e2e(base: str, formats: str, args: argparse.Namespace) -> dict:
    """Each format (comma-separated) of the random model at base in its own process: e2e_one's figures."""
    result = {}
    for fmt in formats.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--e2e-one", model_folder(base, fmt, args.out)]
        cmd += ["--num-prompts", str(args.num_prompts), "--decode-tokens", str(args.decode_tokens)]
        cmd += ["--repeat", str(args.repeat), "--max-model-len", str(args.max_model_len)]
        for flag, v in (("--input-len", args.input_len), ("--output-len", args.output_len)):
            if v:
                cmd += [flag, str(v)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("E2E ")]
        if proc.returncode or not line:
            print(f"{fmt}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        result[fmt] = json.loads(line[0][4:])
        print(fmt, result[fmt], flush=True)
        gc.collect()
    return result


def print_table(result: dict, shape: str) -> None:
    e2e = result.get("e2e", {})
    base = e2e.get("bf16")
    print(f"\n{result['device']}: random {shape} weights packed in each format (load_format dummy)")
    print(
        f"{'format':10s} | {'weight GB':>9s} | {'bench tok/s':>11s} | {'x bf16':>6s} | {'batch-1 tok/s':>13s} | "
        f"{'x bf16':>6s} | target (bench, batch-1)"
    )
    for fmt, r in e2e.items():
        xb = r["bench_tok_s"] / base["bench_tok_s"] if base else float("nan")
        xd = r["decode_tok_s"] / base["decode_tok_s"] if base else float("nan")
        tgt = TARGETS.get(fmt)
        tgt_s = f">= {tgt[0]}x, >= {tgt[1]}x" if tgt else ""
        if tgt and base:
            tgt_s += "  met" if xb >= tgt[0] and xd >= tgt[1] else "  NOT met"
        print(
            f"{fmt:10s} | {r['linear_bytes'] / 1e9:9.2f} | {r['bench_tok_s']:11.1f} | {xb:6.2f} | "
            f"{r['decode_tok_s']:13.1f} | {xd:6.2f} | {tgt_s}"
        )


if __name__ == "__main__":
    main()
