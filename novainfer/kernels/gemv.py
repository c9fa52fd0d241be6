"""One-row matrix-vector products (y = W x + b) with the elementwise ops around them fused in.

At batch 1 a decode step is a chain of small kernels, each costing a launch and a ramp-up whatever
its size; cuBLAS also splits the long-K down projection into a GEMM and a reduction. These kernels
read each weight row once, in full-width tiles, with
- a NORM prologue: x is (hidden + residual) normalised by RMSNorm and scaled by its weight; program 0
  also writes hidden + residual, the next residual (each program recomputes the row's rstd: a few KB
  from L2);
- a SILU_MUL epilogue: W stacks gate's rows over up's (gate_up_proj), a program takes the same rows of
  both and writes silu(gate) * up, half as wide (so down_proj reads a plain row).
Both round as fused_ops' kernels do (the products to the activation dtype before the SiLU, as the
unfused GEMM's output is), so they equal the unfused path's bit for bit but for the dot products' float32
summation order. Tile shapes come from GEMV_TILES (benchmarks/gemv_tiles.py sweeps them on a GPU); the
torch reference is act(linear(norm(x))).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.kernels.fused_ops import rms_scale, silu_mul


@triton.jit
def _gemv_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    res_out_ptr,
    N,
    K,
    eps,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output rows (with SILU_MUL: gate's; up's are N further)
    rmask = rows < N
    kk = tl.arange(0, BLOCK_K)
    rstd = 0.0
    if NORM:  # the row's rstd first, over the whole of (hidden + residual)
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
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + kk
        kmask = offs < K
        if NORM:
            h = tl.load(x_ptr + offs, mask=kmask, other=0.0)
            if HAS_RESIDUAL:
                h = h + tl.load(res_ptr + offs, mask=kmask, other=0.0)
                tl.store(res_out_ptr + offs, h, mask=offs < res_len)
            x = rms_scale(h, tl.load(norm_w_ptr + offs, mask=kmask, other=0.0), rstd)
        else:
            x = tl.load(x_ptr + offs, mask=kmask, other=0.0)
        xf = x.to(tl.float32)[None, :]
        wmask = rmask[:, None] & kmask[None, :]
        acc += tl.sum(tl.load(w_rows + offs[None, :], mask=wmask, other=0.0).to(tl.float32) * xf, 1)
        if SILU_MUL:
            up = tl.load(w_rows + N * K + offs[None, :], mask=wmask, other=0.0)
            acc_up += tl.sum(up.to(tl.float32) * xf, 1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        if SILU_MUL:
            acc_up += tl.load(bias_ptr + N + rows, mask=rmask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    out = silu_mul(acc.to(dt), acc_up.to(dt)) if SILU_MUL else acc.to(dt)
    tl.store(out_ptr + rows, out, mask=rmask)


# (N, K, silu_and_mul) of the weight -> (BLOCK_N, BLOCK_K, num_warps), the fastest of benchmarks/gemv_tiles.py's
# sweep on an H200 (2026-11-24) for Qwen2.5-0.5B's and -7B's projections; other shapes take gemv_tiles()'s rule
GEMV_TILES: dict[tuple[int, int, bool], tuple[int, int, int]] = {
    (1152, 896, False): (2, 1024, 4),
    (896, 896, False): (2, 1024, 4),
    (9728, 896, True): (4, 1024, 4),
    (896, 4864, False): (1, 2048, 8),
    (4608, 3584, False): (4, 512, 4),
    (3584, 3584, False): (1, 2048, 2),
    (37888, 3584, True): (4, 512, 2),
    (3584, 18944, False): (2, 1024, 4),
}


def gemv_tiles(n: int, k: int, silu_and_mul: bool = False) -> tuple[int, int, int]:
    """Tile shape for an [n, k] weight: the sweep's where measured; else up to 1024 columns a tile and, as the
    sweep's winners mostly have, 2 rows for narrow outputs and 8 (of 512 columns) for wide ones."""
    if (n, k, silu_and_mul) in GEMV_TILES:
        return GEMV_TILES[(n, k, silu_and_mul)]
    block_k = min(triton.next_power_of_2(k), 1024)
    if n >= 8192:
        return (4 if silu_and_mul else 8), min(block_k, 512), 4
    return min(2, triton.next_power_of_2(n)), block_k, 4


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    silu_and_mul: bool = False,
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight @ x (+ bias) for one row x: [1, K]; weight [N, K] contiguous.

    norm_weight (with eps, and an optional residual, which makes it return (y, x + residual)): x is RMS-normed
    first. silu_and_mul: weight is concat(gate, up) by rows and the result silu(gate x) * (up x), [1, N / 2]."""
    n, k = weight.shape
    assert x.shape == (1, k) and x.is_contiguous() and weight.is_contiguous(), (x.shape, weight.shape)
    assert norm_weight is not None or residual is None
    n_out = n // 2 if silu_and_mul else n
    out = torch.empty(1, n_out, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else out
    block_n, block_k, warps = tiles or gemv_tiles(n, k, silu_and_mul)
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        weight,
        bias if bias is not None else x,
        out,
        res_out,
        n_out,
        k,
        eps,
        NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_and_mul,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return out if residual is None else (out, res_out)
