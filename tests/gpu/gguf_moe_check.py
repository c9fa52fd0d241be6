"""GGUF experts kept quantized on the GPU (kernels/fused_moe_gguf.py) on a Qwen3-30B-A3B MoE layer: one table.

128 experts, top-8, hidden 2048, moe_intermediate 768; gate/up Q4_K and down Q6_K (Q4_K_M's mix), random valid
blocks built directly in the repacked layout (the repack is a byte permutation, so random quants, sub-scales and
mins with sane float16 factors are what a file's random blocks become; no gguf package needed). For 1, 4, 32 and
256 tokens:
  - the kernels (the int8-x GEMV up to moe_gemv.MAX_TOKENS tokens, the grouped GEMMs above) against the torch
    reference (layers/fused_moe/gguf_torch.py: the routed experts dequantized, fused_experts_torch in float32; for
    the GEMV with x and the activation rounded to int8 per 32 inputs as it rounds them, its distance from the
    unrounded reference printed beside): max |err| / max |ref| and the norm ratio, bound 2e-2 on the first;
  - device time of the GGUF kernels and of the bf16 fused MoE (kernels/fused_moe.py) on the same experts
    dequantized: CUDA graphs of calls over routing copies that move to other experts each call (their weights not
    in L2 from the call before), as benchmarks/tuning/moe_gemv.py times them;
  - the experts' GPU bytes quantized and as bf16.
--sweep also times the grouped GEMMs' tile candidates above MAX_TOKENS (fused_moe_gguf.GGUF_MOE_TILES' choice).

    PYTHONPATH=. python tests/gpu/gguf_moe_check.py [--sweep]     # CUDA (from the repository root)
    PYTHONPATH=. TRITON_INTERPRET=1 python tests/gpu/gguf_moe_check.py --tiny   # CPU, tiny shapes, float32
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.tuning.gemv_tiles import graph_us  # noqa: E402
from novainfer.kernels.fused_moe import fused_experts  # noqa: E402
from novainfer.kernels.fused_moe_gguf import GGUF_MOE_TILES, fused_experts_gguf, gguf_moe_tiles  # noqa: E402
from novainfer.kernels.gguf_gemm import FORMATS, GGUFWeight  # noqa: E402
from novainfer.kernels.moe_gemv import MAX_TOKENS  # noqa: E402
from novainfer.layers.activation import get_act_and_mul  # noqa: E402
from novainfer.layers.fused_moe.gguf_torch import expert_weights, fused_experts_gguf_reference  # noqa: E402
from novainfer.layers.fused_moe.routing import select_experts  # noqa: E402

SHAPE = dict(experts=128, hidden=2048, inter=768, top_k=8, tokens=(1, 4, 32, 256))
TINY = dict(experts=8, hidden=256, inter=256, top_k=2, tokens=(1, 4, 9))
STD_PER_D = {"Q4_K": 258.0, "Q6_K": 1366.0}  # a weight's std per unit of d for these random blocks (below)
MAX_REL = 2e-2
L2_FLUSH_BYTES = 160 << 20  # the routing copies of one graph read this many weight bytes: none stays in L2 (50 MB)
SWEEP = [(16, 64, 128, 4, 3), (16, 128, 128, 4, 3), (32, 64, 128, 4, 3), (32, 128, 64, 4, 3), (64, 64, 128, 4, 3)]
SWEEP += [(64, 128, 64, 4, 3), (64, 128, 128, 8, 3), (128, 128, 64, 8, 3), (128, 64, 128, 8, 3)]


def random_experts(qtype: str, e: int, n: int, k: int, device: torch.device, g: torch.Generator) -> GGUFWeight:
    """E experts [n, k] of random valid blocks of qtype (Q4_K or Q6_K) in the repacked layout, weights of std about
    1 / sqrt(k): random quants, 6-bit scales and mins (Q4_K, with dmin = 7.5 d: mean about zero) or int8 scales
    (Q6_K), float16 d drawn around std / STD_PER_D."""
    f = FORMATS[qtype]

    def bytes_(*shape: int, high: int = 256) -> torch.Tensor:
        return torch.randint(0, high, (e, n, *shape), generator=g, device=device, dtype=torch.int32).to(torch.uint8)

    supers = k // 256
    d = torch.rand(e, n, supers, generator=g, device=device) * 0.5 + 0.75
    d = (d / (math.sqrt(k) * STD_PER_D[qtype])).half()
    qh = bytes_(k // 32 * 4 * f.hb) if f.hb else None
    if qtype == "Q4_K":
        sc, mn = bytes_(k // 32, high=64), bytes_(k // 32, high=64)
        return GGUFWeight(qtype, bytes_(k // 2), d, sc, -(d.float() * 7.5).half(), mn, qh, (n, k))
    sc = bytes_(k // 16).view(torch.int8)
    return GGUFWeight(qtype, bytes_(k // 2), d, sc, None, None, qh, (n, k))


def bf16_experts(w: GGUFWeight) -> torch.Tensor:
    """All experts dequantized to bf16 [E, N, K] (the bf16 kernel's weights), expert by expert."""
    e = w.qweight.shape[0]
    return torch.stack(
        [expert_weights([w], torch.tensor([i], device=w.d.device))[0].to(torch.bfloat16) for i in range(e)]
    )


def device_us(make_fn, bytes_per_call: int, on_gpu: bool) -> float:
    """Microseconds per call of make_fn(i)() over routing copies i whose experts L2 does not hold."""
    if not on_gpu:
        start = time.perf_counter()
        make_fn(0)()
        return (time.perf_counter() - start) * 1e6
    copies = max(2, -(-L2_FLUSH_BYTES // bytes_per_call))
    return graph_us([make_fn(i) for i in range(copies)], reps=max(3, 80 // copies))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, float32 (TRITON_INTERPRET=1 on a CPU)")
    ap.add_argument("--sweep", action="store_true", help="time the grouped GEMMs' tile candidates too")
    args = ap.parse_args()
    on_gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    sh = TINY if args.tiny else SHAPE
    e, hidden, inter, top_k = sh["experts"], sh["hidden"], sh["inter"], sh["top_k"]
    g = torch.Generator(device=device).manual_seed(0)
    w13 = [random_experts("Q4_K", e, 2 * inter, hidden, device, g)]
    w2 = [random_experts("Q6_K", e, hidden, inter, device, g)]
    d13, d2 = bf16_experts(w13[0]), bf16_experts(w2[0])
    if not on_gpu:
        d13, d2 = d13.float(), d2.float()
    act = get_act_and_mul("silu")
    quant_bytes = sum(p.nbytes() for p in w13 + w2)
    dense_bytes = (d13.numel() + d2.numel()) * 2
    per_expert = quant_bytes / e
    name = torch.cuda.get_device_name() if on_gpu else "CPU (interpreter)"
    print(f"## GGUF experts (gate/up Q4_K, down Q6_K) vs bf16 on {name}")
    print(f"E={e} top-{top_k} hidden={hidden} moe_intermediate={inter}")
    print(f"expert bytes on the GPU: GGUF {quant_bytes / 2**20:.1f} MiB, bf16 {dense_bytes / 2**20:.1f} MiB")
    print(f"({quant_bytes / dense_bytes:.3f} of bf16; {8 * quant_bytes / (dense_bytes / 2):.2f} bits a weight)\n")
    print("| tokens | GGUF path | max err / max ref | norm rel err | GGUF us | bf16 us | bf16 / GGUF |")
    print("|---|---|---|---|---|---|---|")
    failed = []
    for tokens in sh["tokens"]:
        x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
        weights, ids = select_experts(torch.randn(tokens, e, generator=g, device=device), top_k, True)
        got = fused_experts_gguf(x, w13, w2, weights, ids, act).float()
        ref = fused_experts_gguf_reference(x.float(), w13, w2, weights, ids, act)
        gemv = tokens <= MAX_TOKENS  # x and the activation rounded to int8 per 32 inputs: its reference rounds so
        want = fused_experts_gguf_reference(x.float(), w13, w2, weights, ids, act, q8_activations=True) if gemv else ref
        max_rel = ((got - want).abs().max() / want.abs().max()).item()
        norm_rel = ((got - want).norm() / want.norm()).item()
        unrounded = ((got - ref).abs().max() / ref.abs().max()).item()
        if not max_rel < MAX_REL:
            failed.append(tokens)
        touched = torch.unique(ids).numel()
        read = int(touched * per_expert)

        def make(fn, i: int):
            ids_i = (ids + i * top_k) % e  # copy i routes to experts the copy before did not
            return lambda: fn(ids_i)

        gguf_us = device_us(lambda i: make(lambda r: fused_experts_gguf(x, w13, w2, weights, r, act), i), read, on_gpu)
        bf16_us = device_us(lambda i: make(lambda r: fused_experts(x, d13, d2, weights, r, act), i), 4 * read, on_gpu)
        path = (
            f"int8-x GEMV ({unrounded:.1e} from unrounded x)"
            if gemv
            else f"grouped {gguf_moe_tiles(tokens * top_k, e, on_gpu)}"
        )
        print(
            f"| {tokens} | {path} | {max_rel:.2e} | {norm_rel:.2e} | {gguf_us:.1f} | {bf16_us:.1f} |"
            f" {bf16_us / gguf_us:.2f} |"
        )
        if args.sweep and tokens > MAX_TOKENS:
            for tiles in SWEEP if on_gpu else [(16, 32, 64, 4, 1)]:

                def run(r, tiles=tiles):
                    return fused_experts_gguf(x, w13, w2, weights, r, act, tiles=tiles)

                try:
                    us = device_us(lambda i: make(run, i), read, on_gpu)
                except Exception as exc:  # a tile this GPU cannot run: say so, go on
                    print(f"|   | tiles {tiles} | failed: {type(exc).__name__} |  |  |  |  |")
                    continue
                err = ((run(ids).float() - ref).abs().max() / ref.abs().max()).item()
                print(f"|   | tiles {tiles} | {err:.2e} |  | {us:.1f} | {bf16_us:.1f} | {bf16_us / us:.2f} |")
    print(f"\ncurrent GGUF_MOE_TILES (pairs per expert -> tiles): {GGUF_MOE_TILES}")
    if failed:
        print(f"FAILED: max err / max ref >= {MAX_REL} at tokens {failed}")
        return 1
    print(f"all within {MAX_REL} of the torch reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
