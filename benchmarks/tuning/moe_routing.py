"""MoE routing on the GPU, the Triton kernels (kernels/moe_routing.py) against the torch ops they replaced
(softmax + topk + renormalise, and the ~20-op alignment now align_by_expert_torch): the same experts and alignment,
and the device time per layer inside a CUDA graph (as a decode step runs it), for Qwen3-30B-A3B's routing (128
experts, top 8) and Qwen3.5-35B-A3B's (256, top 8) from 1 to 4,096 tokens.

    python benchmarks/tuning/moe_routing.py          # on the GPU: one table
    TRITON_INTERPRET=1 python benchmarks/tuning/moe_routing.py --tiny
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from novainfer.kernels import moe_routing  # noqa: E402

BLOCK_M = 16  # the decode tiles' BLOCK_M (kernels/fused_moe.MOE_TILES)


def torch_route(logits: torch.Tensor, top_k: int):
    """The routing the engine ran before: transformers' softmax-then-topk in torch ops, then the torch alignment."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return w, ids, moe_routing.align_by_expert_torch(ids, logits.shape[1], BLOCK_M)


def triton_route(logits: torch.Tensor, top_k: int):
    w, ids = moe_routing.topk_softmax(logits, top_k, True)
    return w, ids, moe_routing.align_by_expert_triton(ids, logits.shape[1], BLOCK_M)


def graph_us(fn, reps: int = 48) -> float:
    """Device time of one call inside a CUDA graph of reps calls (a decode step's layers), median of 5 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return sorted(times)[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small shapes, no timing (TRITON_INTERPRET=1 on the CPU)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(128, 8), (256, 8)] if not args.tiny else [(16, 4)]
    token_counts = [1, 8, 32, 128, 256, 1024, 4096] if not args.tiny else [1, 9]
    print("| experts, top k | tokens | same experts | max |dw| | same alignment | torch us/layer | triton us/layer |")
    print("|---|---|---|---|---|---|---|")
    failures = 0
    for experts, top_k in shapes:
        for tokens in token_counts:
            g = torch.Generator(device=dev).manual_seed(tokens)
            logits = torch.randn(tokens, experts, generator=g, device=dev).to(torch.bfloat16)
            rw, rids, _ = torch_route(logits, top_k)
            w, ids, (s, b, t) = triton_route(logits, top_k)
            # the same experts up to ties between equal bf16 logits (torch.topk orders ties as it likes)
            same_ids = torch.equal(logits.gather(1, ids), logits.gather(1, rids))
            dw = (w.sort(1).values - rw.sort(1).values).abs().max().item()
            rs, rb, rt = moe_routing.align_by_expert_torch(ids, experts, BLOCK_M)
            total = rt.item()
            same_align = (
                t.item() == total
                and torch.equal(s[:total], rs[:total])
                and torch.equal(b[: total // BLOCK_M], rb[: total // BLOCK_M])
            )
            ok = same_ids and same_align and dw < 1e-6
            failures += not ok
            timing = ("-", "-")
            if dev == "cuda":
                timing = (f"{graph_us(lambda: torch_route(logits, top_k)):.1f}",)
                timing += (f"{graph_us(lambda: triton_route(logits, top_k)):.1f}",)
            print(
                f"| {experts}, {top_k} | {tokens} | {same_ids} | {dw:.1e} | {same_align} | {timing[0]} | {timing[1]} |"
            )
    print("routing checks:", "all pass" if not failures else f"{failures} FAILED")


if __name__ == "__main__":
    main()
