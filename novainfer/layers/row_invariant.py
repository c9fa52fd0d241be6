"""A dense linear layer whose every row gets the same bits whatever the number of rows beside it (on CUDA only in
batch-invariant mode, kernels/batch_invariant.py).

On the CPU, torch multiplies a single bfloat16 row through a matrix-vector kernel that sums in another order
than its matrix-matrix kernel, which gives every row of two or more the same bits (checked from 2 to 1,100 rows):
so a request decoding alone got other logits than in a batch, or than its prefill gave the same token. One row is
computed as two (the same row twice, no copy); memory-bound either way, it costs the same.

On CPUs with AMX (Xeons from Sapphire Rapids on) oneDNN's AMX bfloat16 kernels sum a row in an order that depends
on the rows beside it up to 256 (6 of 43 rows differed at 1-32 rows on a 2-core Xeon), where its AVX-512 BF16
kernels do not: oneDNN is capped at those. It reads the cap once, at its first use, so this module sets it on
import, before the engine's first matmul; a variable the user set wins.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), with one bfloat16 CPU row taking the many-row kernel; on CUDA in batch-invariant
    mode, kernels/batch_invariant.py's fixed-tile GEMM."""
    if x.is_cuda:
        from novainfer.kernels import batch_invariant  # Triton: only where CUDA runs

        if batch_invariant.enabled():
            return batch_invariant.linear(x, weight, bias)
    if x.dtype is torch.bfloat16 and x.numel() == x.shape[-1] and not x.is_cuda:
        return F.linear(x.reshape(1, -1).expand(2, -1), weight, bias)[:1].view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
