"""Attention on the paged cache: the Triton kernels against PyTorch's SDPA (the torch backend, which gathers
each sequence's context from its blocks and calls scaled_dot_product_attention), on Qwen2.5-0.5B heads.

    python benchmarks/tuning/attention_backends.py        # GPU; prints median times from triton.testing.do_bench
"""

from __future__ import annotations

import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from novainfer.attention import torch_backend, triton_backend  # noqa: E402
from novainfer.attention.metadata import AttentionMetadata  # noqa: E402


def make(
    ctx: list[int], q_lens: list[int], heads: int = 14, kv_heads: int = 2, hd: int = 64, bs: int = 16, dev: str = "cuda"
):
    seq_lens = [c + q for c, q in zip(ctx, q_lens)]
    nb = [(s + bs - 1) // bs for s in seq_lens]
    perm = torch.randperm(sum(nb), device=dev).to(torch.int32)
    width, tables, used = max(nb), [], 0
    for n in nb:
        tables.append(torch.cat([perm[used : used + n], perm.new_zeros(width - n)]))
        used += n
    kc = torch.randn(sum(nb), bs, kv_heads, hd, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(sum(q_lens), heads, hd, device=dev, dtype=torch.bfloat16)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32, device=dev),
        torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        torch.zeros(0, dtype=torch.long, device=dev),
        torch.stack(tables),
        max(q_lens),
        max(seq_lens),
        qsl,
        seq_lens,
        num_splits=1,
    )
    return q, kc, vc, meta


def main() -> None:
    from triton.testing import do_bench

    cases = {
        "decode, 64 seqs x 1024 context": ([1023] * 64, [1] * 64),
        "decode, 256 seqs x 600 context": ([599] * 256, [1] * 256),
        "decode, 1 seq x 4096 context": ([4095], [1]),
        "prefill, 8 prompts x 1024": ([0] * 8, [1024] * 8),
        "prefill, 8 x 512 after a 512-token cached prefix": ([512] * 8, [512] * 8),
    }
    print("| case | torch SDPA (gather) ms | Triton ms | speed-up |\n|---|---|---|---|")
    for name, (ctx, q_lens) in cases.items():
        q, kc, vc, meta = make(ctx, q_lens)
        if meta.max_query_len == 1:
            meta.num_splits = 8 if len(ctx) < 16 else 1
        ref = torch_backend.paged_attention(q, kc, vc, meta, 0.125)
        out = triton_backend.paged_attention(q, kc, vc, meta, 0.125)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        t_ref = do_bench(partial(torch_backend.paged_attention, q, kc, vc, meta, 0.125), return_mode="median")
        t_tri = do_bench(partial(triton_backend.paged_attention, q, kc, vc, meta, 0.125), return_mode="median")
        print(f"| {name} | {t_ref:.3f} | {t_tri:.3f} | {t_ref / t_tri:.1f}x (rel err {err:.1e}) |")


if __name__ == "__main__":
    main()
