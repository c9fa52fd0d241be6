"""One-row matrix-vector products (y = W x + b) with the elementwise op before them fused in.

At batch 1 a decode step is a chain of small kernels, each costing a launch and a ramp-up whatever
its size; cuBLAS also splits the long-K down projection into a GEMM and a reduction. These kernels
read each weight row once, in full-width tiles, and compute their input on the fly:
- NORM: x is (hidden + residual) normalised by RMSNorm and scaled by its weight; program 0 also writes
  hidden + residual, the next residual (each program recomputes the row's rstd: a few KB from L2);
- SILU: x is silu(gate) * up of a concat(gate, up) row;
- none: x as given.
The prologues round as fused_ops' kernels do, so the inputs equal the unfused path's bit for bit; the
dot products accumulate in float32. Tile shapes come from GEMV_TILES (benchmarks/gemv_tiles.py sweeps
them on a GPU); the torch reference is linear(act(x)).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.kernels.fused_ops import rms_scale, silu_mul

NONE, NORM, SILU = 0, 1, 2


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, res_out_ptr, N, K, eps,
                 PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    kk = tl.arange(0, BLOCK_K)
    rstd = 0.0
    if PROLOGUE == 1:  # the row's rstd first, over the whole of (hidden + residual)
        sq = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + kk
            h = tl.load(x_ptr + offs, mask=offs < K, other=0.0)
            if HAS_RESIDUAL:
                h = h + tl.load(res_ptr + offs, mask=offs < K, other=0.0)
            hf = h.to(tl.float32)
            sq += hf * hf
        rstd = tl.rsqrt(tl.sum(sq, 0) / K + eps)
    res_len = tl.where(pid == 0, K, 0)  # program 0 writes the new residual
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + kk
        kmask = offs < K
        if PROLOGUE == 1:
            h = tl.load(x_ptr + offs, mask=kmask, other=0.0)
            if HAS_RESIDUAL:
                h = h + tl.load(res_ptr + offs, mask=kmask, other=0.0)
                tl.store(res_out_ptr + offs, h, mask=offs < res_len)
            x = rms_scale(h, tl.load(norm_w_ptr + offs, mask=kmask, other=0.0), rstd)
        elif PROLOGUE == 2:
            x = silu_mul(tl.load(x_ptr + offs, mask=kmask, other=0.0), tl.load(x_ptr + K + offs, mask=kmask, other=0.0))
        else:
            x = tl.load(x_ptr + offs, mask=kmask, other=0.0)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + offs[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=rmask)


# (N, K) of the weight -> (BLOCK_N, BLOCK_K, num_warps), the fastest of benchmarks/gemv_tiles.py's sweep on an
# H200 (2026-11-24) for Qwen2.5-0.5B and -7B's projections; other shapes take gemv_tiles()'s rule
GEMV_TILES: dict[tuple[int, int], tuple[int, int, int]] = {
    (1152, 896): (2, 1024, 4), (896, 896): (2, 1024, 4), (9728, 896): (16, 512, 4), (896, 4864): (1, 1024, 4),
    (4608, 3584): (4, 512, 4), (3584, 3584): (2, 1024, 4), (37888, 3584): (8, 512, 4), (3584, 18944): (8, 1024, 8),
}


def gemv_tiles(n: int, k: int) -> tuple[int, int, int]:
    """Tile shape for an [n, k] weight: the sweep's where measured; else up to 1024 columns a tile and, as the
    sweep's winners mostly have, 2 rows for narrow outputs and 8 (of 512 columns) for wide ones."""
    if (n, k) in GEMV_TILES:
        return GEMV_TILES[(n, k)]
    block_k = min(triton.next_power_of_2(k), 1024)
    if n >= 8192:
        return 8, min(block_k, 512), 4
    return min(2, triton.next_power_of_2(n)), block_k, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, prologue: int = NONE,
         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         tiles: tuple[int, int, int] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight @ act(x) (+ bias) for one row x: [1, K] (SILU: [1, 2K]); weight [N, K] contiguous.

    NORM takes norm_weight and eps (and an optional residual, which makes it return (y, x + residual));
    SILU takes x = concat(gate, up)."""
    n, k = weight.shape
    assert x.shape[0] == 1 and x.shape[1] == (2 * k if prologue == SILU else k), (x.shape, weight.shape)
    assert x.is_contiguous() and weight.is_contiguous()
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else out
    if prologue == NORM:
        assert norm_weight is not None and norm_weight.shape == (k,)
    block_n, block_k, warps = tiles or gemv_tiles(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else x, out, res_out, n, k, eps, PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps)
    return out if residual is None else (out, res_out)
