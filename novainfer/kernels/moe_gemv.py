"""The mixture-of-experts layer for a few tokens (decode at batch 1-2): one matrix-vector product per (token,
expert) pair, the expert's weight rows read once, no sorting or padding.

The grouped GEMM of kernels/fused_moe.py pads each expert's pairs to BLOCK_M rows: at one token that is a 16-64-row
tile holding one live row, and a grid of (pairs x N / BLOCK_N) programs too few to stream the experts' bytes at
HBM speed. Here a program takes BLOCK_N rows of one pair's expert, accumulates products elementwise in a
[BLOCK_N, BLOCK_K] float32 tile and reduces it once, as kernels/gemv.py does (routing weight multiplied in before
the store); kernels/fused_moe.experts_gemv runs it for the gate/up and the down products.
Weights: bf16 / fp16 / float32 [E, N, K], or float8 with one float32 scale per [GROUP_N, GROUP_K] block
(pre-quantized block FP8, weight-only: each block's scale multiplies x's inputs; blocks of fewer rows than a program
takes, as compressed-tensors' one scale a row, multiply the weights instead). The torch references are
layers/fused_moe/moe_torch.fused_experts_torch and fp8_block.fused_experts_fp8_block_reference (weight-only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# up to this many tokens the MoE layers take these kernels; the tiles (BLOCK_N, BLOCK_K, warps): from
# benchmarks/tuning/moe_gemv.py on an H200 (Qwen3-30B-A3B / Qwen3.5-35B-A3B layers: bf16 1.07-1.47x the grouped
# GEMMs at 1-2 tokens and about even to 1.15x at 3-4; block FP8 weight-only 1.3-2.9x)
MAX_TOKENS = 4
TILES = (32, 256, 4)


@triton.jit
def _moe_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    ids_ptr,
    rw_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[pair, rows] = W[expert of pair, rows] @ x[pair // A_ROW_DIV] (times the pair's routing weight)."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rload = tl.minimum(rows, N - 1).to(tl.int64)  # the last tile re-reads row N - 1: no masks on the rows
    x_row = x_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_xm
    w_rows = w_ptr + expert * stride_we + rload[:, None] * stride_wn
    if HAS_SCALE:  # ROW_SCALES: blocks shorter than BLOCK_N rows (compressed-tensors' one scale a row)
        s_row = s_ptr + expert * stride_se + ((tl.program_id(1) * BLOCK_N) // GROUP_N) * stride_sn
        s_rows = s_ptr + expert * stride_se + (rload // GROUP_N)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        x = tl.load(x_row + kk, mask=kmask, other=0.0).to(tl.float32)
        if HAS_SCALE and not ROW_SCALES:  # the program's rows share one block row: the scales go on x's inputs
            x = x * tl.load(s_row + kk // GROUP_K, mask=kmask, other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=kmask[None, :], other=0.0, eviction_policy="evict_first").to(tl.float32)
        if HAS_SCALE and ROW_SCALES:
            w = w * tl.load(s_rows + (kk // GROUP_K)[None, :], mask=kmask[None, :], other=0.0)
        acc += w * x[None, :]
    y = tl.sum(acc, 1)
    if MUL_ROUTED_WEIGHT:
        y = y * tl.load(rw_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


def moe_gemv(
    a: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    a_row_div: int,
    out: torch.Tensor,
    routed_weights: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    tiles: tuple[int, int, int] | None = None,
) -> None:
    """out [pairs, N] = each pair's expert w[ids[pair]] [N, K] times a[pair // a_row_div] (unit stride along K),
    times routed_weights[pair] where given; scale: float8 w's block scales [E, N / block[0], K / block[1]]."""
    pairs, n = out.shape
    k = w.shape[2]
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1
    block_n, block_k, warps = tiles or (TILES if a.is_cuda else (8, 64, 4))
    block_k = min(block_k, triton.next_power_of_2(k))
    _moe_gemv_kernel[(pairs, triton.cdiv(n, block_n))](
        a,
        w,
        scale if scale is not None else w,
        ids,
        routed_weights if routed_weights is not None else out,
        out,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        scale.stride(0) if scale is not None else 0,
        scale.stride(1) if scale is not None else 0,
        out.stride(0),
        A_ROW_DIV=a_row_div,
        MUL_ROUTED_WEIGHT=routed_weights is not None,
        HAS_SCALE=scale is not None,
        ROW_SCALES=block[0] % block_n != 0,
        GROUP_N=block[0],
        GROUP_K=block[1],
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
