"""The batch-1 decode stack's kernels against the layer-by-layer ones they replace, on a GPU; sweeps GEMV tiles.

    python3 benchmarks/tuning/gemv_tiles.py [--models 0.5b 7b qwen3.5-9b] [--fp8] [--quick] [--out tiles.json]

For each projection of Qwen2.5-0.5B / -7B (and Qwen3.5-9B's, the hybrid stack's) at one row: the unfused path (Triton RMSNorm kernel, cuBLAS through
F.linear, Triton SiLU-and-mul kernel) against novainfer.kernels.gemv with each tile shape of the sweep; and the
attention (rotary + K/V store + split decode + merge) against the one fused decode kernel at several context
lengths. Each variant is captured as a CUDA graph of one call per layer over as many copies of the weights
as the model has layers (so the L2 cache holds no weight from the call before, as in a real step), replayed
back to back; microseconds per call. Prints the best tile per shape and the GEMV_TILES dict to paste. --fp8: the
weights are float8 with 128x128 block scales (pre-quantized block FP8), the unfused path over their bf16
dequantization.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SHAPES = {  # model -> (layers, hidden, heads, kv_heads, head_dim, intermediate)
    "0.5b": (24, 896, 14, 2, 64, 4864),
    "7b": (28, 3584, 28, 4, 128, 18944),
}
# hybrid models (gpu_hybrid_decode_stack.py): layers, then name -> (N, K, norm prologue, SiLU-and-mul epilogue)
HYBRID = {
    "qwen3.5-9b": (
        32,
        {
            "deltanet in_proj": (2 * 2048 + 4096 + 4096 + 2 * 32, 4096, True, False),
            "deltanet out_proj / o_proj": (4096, 4096, False, False),
            "attention qkv": (2 * 16 * 256 + 2 * 4 * 256, 4096, True, False),
            "gate_up": (2 * 12288, 4096, True, True),
            "down": (4096, 12288, False, False),
        },
    )
}


def graph_us(fns: list, reps: int = 20) -> float:
    """Microseconds per call of a CUDA graph holding one call of each fn, replayed reps times."""
    import torch

    for fn in fns:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(fns))


SWEEP = {  # (BLOCK_N, BLOCK_K, num_warps, num_stages) candidates
    False: list(itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8), (1, 3))),
    True: list(itertools.product((2, 4, 8, 16, 32), (256, 512, 1024), (4, 8), (1, 3))),
}


def projections(model: str, dev: str, fp8: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    from novainfer.kernels.fused_ops import rms_norm, silu_and_mul
    from novainfer.kernels.gemv import gemv

    dt = torch.bfloat16
    if model in HYBRID:
        layers, shapes = HYBRID[model]
    else:  # name -> (N, K, norm prologue, SiLU-and-mul epilogue)
        layers, hidden, heads, kv_heads, hd, inter = SHAPES[model]
        shapes = {
            "qkv": ((heads + 2 * kv_heads) * hd, hidden, True, False),
            "o_proj": (hidden, heads * hd, False, False),
            "gate_up": (2 * inter, hidden, True, True),
            "down": (hidden, inter, False, False),
        }
    if fp8:  # gate/up normed but not multiplied: the alternative to the SiLU epilogue (+ a silu_and_mul kernel)
        shapes["gate_up_no_silu"] = (2 * inter, hidden, True, False)
    out = {}
    for name, (n, k, norm, act) in shapes.items():
        if fp8:  # float8 weights, one scale per 128x128 block; the unfused path reads their bf16 dequantization
            scales = [torch.rand(n // 128, k // 128, device=dev) * 1e-4 + 1e-4 for _ in range(layers)]
            ws = [(torch.randn(n, k, device=dev) * 100).to(torch.float8_e4m3fn) for _ in range(layers)]
            deq = [
                (w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(dt) for w, s in zip(ws, scales)
            ]
        else:
            scales = [None] * layers
            ws = deq = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
        nw = torch.rand(k, device=dev, dtype=dt) + 0.5
        x = torch.randn(1, k, device=dev, dtype=dt)
        r = torch.randn(1, k, device=dev, dtype=dt)

        def unfused(i):
            y = F.linear(rms_norm(x, nw, 1e-6, r)[0] if norm else x, deq[i])
            return silu_and_mul(y) if act else y

        def fused(i, t):
            w, sc = ws[i], scales[i]
            if norm:
                return gemv(x, w, weight_scale=sc, norm_weight=nw, eps=1e-6, residual=r, silu_and_mul=act, tiles=t)[0]
            return gemv(x, w, weight_scale=sc, tiles=t)

        ref = unfused(0).float()
        row = {
            "n": n,
            "k": k,
            "silu_and_mul": act,
            "unfused_us": graph_us([lambda i=i: unfused(i) for i in range(layers)]),
            "tiles": {},
        }
        for t in SWEEP[fp8]:
            bn, bk = t[:2]
            if bn * bk > 16384 or bk > 2 * triton_pow2(k):
                continue
            err = ((fused(0, t).float() - ref).norm() / ref.norm()).item()
            if err > 1e-2:
                row["tiles"][str(t)] = {"error": err}
                continue
            row["tiles"][str(t)] = {"us": graph_us([lambda i=i: fused(i, t) for i in range(layers)]), "rel_err": err}
        best_us, best = min((v["us"], k_) for k_, v in row["tiles"].items() if "us" in v)
        row["best"], row["best_us"] = [int(t) for t in best.strip("()").split(",")], best_us
        print(f"| {model} {name} [{n}x{k}] | {row['unfused_us']:.2f} | {best_us:.2f} {best} |", flush=True)
        out[name] = row
        ws = deq = scales = None  # free this shape's copies before the next
    return out


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def attention(model: str, dev: str, contexts: tuple[int, ...] = (64, 512, 2048, 8192)) -> dict:
    import torch

    from novainfer.kernels.fused_ops import rotary_embedding
    from novainfer.kernels.kv_store import store_kv
    from novainfer.kernels.paged_attention import DecodeRope, decode_attention

    layers, hidden, heads, kv_heads, hd, _ = SHAPES[model]
    dt, bs = torch.bfloat16, 16
    out = {}
    for ctx in contexts:
        blocks = ctx // bs + 2
        caches = [
            (
                torch.randn(blocks, bs, kv_heads, hd, device=dev, dtype=dt),
                torch.randn(blocks, bs, kv_heads, hd, device=dev, dtype=dt),
            )
            for _ in range(layers)
        ]
        bt = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
        seq_lens = torch.tensor([ctx], device=dev, dtype=torch.int32)
        pos = torch.tensor([ctx - 1], device=dev)
        slots = pos.clone()
        qkv = torch.randn(1, (heads + 2 * kv_heads) * hd, device=dev, dtype=dt)
        q = qkv[:, : heads * hd].view(1, heads, hd)
        k = qkv[:, heads * hd : (heads + kv_heads) * hd].view(1, kv_heads, hd)
        v = qkv[:, (heads + kv_heads) * hd :].view(1, kv_heads, hd)
        inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device=dev).float() / hd))
        ang = torch.arange(ctx + 1, device=dev).float()[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        splits = 32  # what the runner picks for batch 1 on an H200 with a long max_model_len

        def unfused(kc, vc):
            rq, rk = rotary_embedding(pos, q, k, cos, sin)
            store_kv(rk, v, kc, vc, slots)
            return decode_attention(rq, kc, vc, bt, seq_lens, hd**-0.5, splits, min_split_keys=1)

        def fused(kc, vc):
            return decode_attention(
                q, kc, vc, bt, seq_lens, hd**-0.5, splits, rope=DecodeRope(pos, cos, sin, k, v, slots)
            )

        a, b = unfused(*caches[0]), fused(*caches[0])
        err = ((a.float() - b.float()).norm() / a.float().norm()).item()
        row = {
            "unfused_us": graph_us([lambda c=c: unfused(*c) for c in caches]),
            "fused_us": graph_us([lambda c=c: fused(*c) for c in caches]),
            "rel_err": err,
        }
        print(
            f"| {model} attention ctx {ctx} | {row['unfused_us']:.2f} | {row['fused_us']:.2f} (err {err:.1e}) |",
            flush=True,
        )
        out[ctx] = row
        del caches
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["0.5b", "7b"], choices=sorted(SHAPES) + sorted(HYBRID))
    ap.add_argument("--quick", action="store_true", help="a smaller sweep (block_n <= 8, block_k <= 1024)")
    ap.add_argument("--fp8", action="store_true", help="block-scaled float8 weights")
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--out", "--json", dest="out", default=None)
    args = ap.parse_args()
    if args.quick:
        for fp8 in SWEEP:
            SWEEP[fp8] = [t for t in SWEEP[fp8] if t[0] <= 8 and t[1] <= 1024]
    import torch

    print(torch.cuda.get_device_name(), torch.__version__)
    print("| kernel | layer-by-layer (us) | fused stack (us, best tile) |\n| --- | --- | --- |")
    res = {
        m: {"projections": projections(m, "cuda", args.fp8)}
        | ({} if args.no_attention or m in HYBRID else {"attention": attention(m, "cuda")})
        for m in args.models
    }
    tiles = {
        (r["n"], r["k"], r["silu_and_mul"], args.fp8): tuple(r["best"])
        for m in res.values()
        for r in m["projections"].values()
    }
    print("GEMV_TILES =", tiles)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
