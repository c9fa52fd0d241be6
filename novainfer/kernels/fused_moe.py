"""The mixture-of-experts layer on the GPU: tokens sorted by expert, then two grouped GEMMs.

1. align: each (token, k) pair is sorted by its expert and every expert's run is padded to BLOCK_M rows,
   so a block of rows belongs to one expert (vLLM's moe_align_block_size: kernels/moe_routing.py).
2. grouped GEMM over gate/up: for each block, rows of the hidden states times its expert's w13 (plus the
   expert's bias, where the layer has one).
3. act-and-mul on the [pairs, 2 * inter] result (the fused SiLU kernel, or gpt-oss's clamped SwiGLU below).
4. grouped GEMM over down, the expert's bias added and the routing weight multiplied in before the store;
   then each token's k rows are summed.
The torch reference is layers/fused_moe/moe_torch.py.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl
from torch import nn

from novainfer.kernels.moe_gemv import MAX_TOKENS, moe_gemv
from novainfer.kernels.moe_routing import align_by_expert
from novainfer.kernels.tiling import fits, launch_or_fallback


@triton.jit
def tile_rows(sorted_ids_ptr, block_experts_ptr, N, num_valid, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's pairs (padding rows hold num_valid), their mask, the block's expert, its columns and mask."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pair, pair < num_valid, expert, cols, cols < N


@triton.jit
def store_rows(
    acc,
    c_ptr,
    stride_cm,
    bias_ptr,
    stride_bias,
    topk_weights_ptr,
    pair,
    mmask,
    expert,
    cols,
    nmask,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
):
    """The grouped GEMMs' epilogue: acc (+ bias[expert]) (times the pair's routing weight) stored at C[pair]."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pair, mask=mmask, other=0.0)
        acc = acc * w[:, None]
    tl.store(
        c_ptr + pair.to(tl.int64)[:, None] * stride_cm + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=mmask[:, None] & nmask[None, :],
    )


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    N,
    K,
    num_valid,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_bias,
    A_ROW_DIV: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """C[pair] = (A[pair // A_ROW_DIV] @ B[expert]^T + bias[expert]) (times the pair's routing weight) for one
    block of pairs."""
    if tl.program_id(0) * BLOCK_M >= tl.load(num_padded_ptr):  # the grid is sized for the worst case
        return
    pair, mmask, expert, cols, nmask = tile_rows(sorted_ids_ptr, block_experts_ptr, N, num_valid, BLOCK_M, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    a_rows = (pair // A_ROW_DIV).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + kk) < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + (k0 + kk)[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0
        )
        b = tl.load(
            b_ptr + expert * stride_be + cols[None, :] * stride_bn + (k0 + kk)[:, None],
            mask=nmask[None, :] & kmask[:, None],
            other=0.0,
        )
        acc += tl.dot(a, b, input_precision=PRECISION)
    store_rows(
        acc,
        c_ptr,
        stride_cm,
        bias_ptr,
        stride_bias,
        topk_weights_ptr,
        pair,
        mmask,
        expert,
        cols,
        nmask,
        HAS_BIAS,
        MUL_ROUTED_WEIGHT,
    )


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the gate/up and the down GEMM, by the pairs an expert gets on
# average (up to the key): benchmarks/moe_tiles.py's sweep on an H200, Qwen3-30B-A3B's layer shape (0.5B-7B
# class MoE layers alike); one BLOCK_M for both GEMMs, since one alignment serves them.
MOE_TILES: dict[int, tuple[tuple[int, int, int, int, int], tuple[int, int, int, int, int]]] = {
    32: ((32, 128, 128, 4, 3), (32, 64, 128, 4, 3)),
    96: ((64, 128, 64, 4, 3), (64, 256, 64, 8, 4)),
    1 << 62: ((128, 256, 64, 8, 4), (128, 256, 64, 8, 4)),
}
FALLBACK_TILES = (64, 64, 64, 4, 3)  # what the kernel ran before the sweep: fits any GPU's shared memory


def moe_tiles(
    num_pairs: int, num_experts: int, n: int, k: int, down: bool, table: dict = MOE_TILES
) -> tuple[int, int, int, int, int]:
    """Tiles of one grouped GEMM ([pairs, k] x [n, k]^T per expert) from table (MOE_TILES' form; a format's own
    sweep may give another), narrowed to a small N or K."""
    per_expert = num_pairs / num_experts
    block_m, block_n, block_k, warps, stages = next(t for bound, t in sorted(table.items()) if per_expert <= bound)[
        int(down)
    ]
    narrow = min(block_n, max(32, triton.next_power_of_2(n))), min(block_k, max(32, triton.next_power_of_2(k)))
    tiles = (block_m, *narrow, warps, stages)
    return tiles if fits(tiles) else (block_m, *FALLBACK_TILES[1:])


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    sorted_ids,
    block_experts,
    num_padded,
    num_pairs: int,
    a_row_div: int,
    topk_weights: torch.Tensor | None,
    tiles: tuple[int, int, int, int, int],
    bias: torch.Tensor | None = None,
) -> None:
    assert a.stride(1) == 1 and b.stride(2) == 1 and out.stride(1) == 1
    assert bias is None or (bias.shape == b.shape[:2] and bias.stride(1) == 1)
    args = (a, b, out, sorted_ids, block_experts, num_padded, num_pairs, a_row_div, topk_weights, bias)
    launch_with_fallback(lambda t: _launch(*args, t), tiles)


def launch_with_fallback(launch: Callable[[tuple[int, int, int, int, int]], None], tiles) -> None:
    """launch(tiles); where this GPU's shared memory is short of them (a smaller GPU than the sweep's), launch with
    FALLBACK_TILES' N, K, warps and stages instead (moe_tiles picks those next time)."""
    launch_or_fallback(launch, tiles, (tiles[0], *FALLBACK_TILES[1:]))


def _launch(a, b, out, sorted_ids, block_experts, num_padded, num_pairs, a_row_div, topk_weights, bias, tiles) -> None:
    n, k = b.shape[1], b.shape[2]
    block_m, block_n, block_k, warps, stages = tiles
    grid = (sorted_ids.numel() // block_m, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        b,
        out,
        bias if bias is not None else out,
        topk_weights if topk_weights is not None else out,
        sorted_ids,
        block_experts,
        num_padded,
        n,
        k,
        num_pairs,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        bias.stride(0) if bias is not None else 0,
        A_ROW_DIV=a_row_div,
        HAS_BIAS=bias is not None,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=stages,
    )


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_and_mul: nn.Module,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as layers/fused_moe/moe_torch.fused_experts_torch: [tokens, hidden] -> [tokens, hidden]; up to
    moe_gemv.MAX_TOKENS tokens (and no biases) one GEMV per (token, expert) pair, else the grouped GEMMs."""
    if hidden_states.shape[0] <= MAX_TOKENS and w13_bias is None and w2_bias is None:
        return experts_gemv(hidden_states, w13, w2, topk_weights, topk_ids, act_and_mul)
    return grouped_experts(hidden_states, w13, w2, topk_weights, topk_ids, act_and_mul, w13_bias, w2_bias)


def grouped_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_and_mul: nn.Module,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fused_experts by the grouped GEMMs (steps 1-4 of the module docstring) at any token count."""

    def gemm(down: bool, a, out, ids, a_row_div: int, weights, tiles) -> None:
        b, bias = (w2, w2_bias) if down else (w13, w13_bias)
        _grouped_gemm(a, b, out, *ids, out.shape[0], a_row_div, weights, tiles, bias)

    return routed_experts(
        hidden_states, topk_weights, topk_ids, w13.shape[0], w13.shape[1], w2.shape[2], act_and_mul, gemm
    )


def routed_experts(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    n13: int,
    inter: int,
    act_and_mul: nn.Module,
    gemm: Callable[..., None],
    tiles: tuple[tuple[int, int, int, int, int], tuple[int, int, int, int, int]] | None = None,
) -> torch.Tensor:
    """Steps 1-4 of the module docstring for any weight format: gemm(down, a, out, (sorted ids, block experts,
    padded total), a_row_div, routing weights or None, tiles) runs one grouped GEMM of the format's gate/up
    (n13 outputs) or down (inter inputs) weights. tiles: (gate/up, down) instead of moe_tiles' (a sweep's)."""
    tokens, hidden = hidden_states.shape
    top_k = topk_ids.shape[1]
    num_pairs = tokens * top_k
    if tokens == 0:  # pair_products would return the same, without the alignment's launches
        return torch.zeros_like(hidden_states)
    up_tiles = moe_tiles(num_pairs, num_experts, n13, hidden, down=False) if tiles is None else tiles[0]
    down_tiles = moe_tiles(num_pairs, num_experts, hidden, inter, down=True) if tiles is None else tiles[1]
    assert up_tiles[0] == down_tiles[0]  # one alignment serves both GEMMs
    ids = align_by_expert(topk_ids, num_experts, up_tiles[0])

    def product(down: bool, a, out, a_row_div: int, weights) -> None:
        gemm(down, a, out, ids, a_row_div, weights, down_tiles if down else up_tiles)

    return pair_products(hidden_states, topk_weights, top_k, n13, act_and_mul, product)


def pair_products(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    top_k: int,
    n13: int,
    act_and_mul: nn.Module,
    product: Callable[..., None],
) -> torch.Tensor:
    """Gate/up, the activation, down (the routing weight multiplied in) over the (token, k) pairs, then each token's
    k rows summed: product(down, a, out, a_row_div, routing weights or None) runs one of the two products."""
    tokens, hidden = hidden_states.shape
    if tokens == 0:
        return torch.zeros_like(hidden_states)
    x = hidden_states.contiguous()
    gate_up = torch.empty(tokens * top_k, n13, dtype=x.dtype, device=x.device)
    product(False, x, gate_up, top_k, None)
    act = act_and_mul(gate_up)
    down = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.to(x.dtype).contiguous().flatten()  # rounded as the reference rounds them
    product(True, act, down, 1, weights)
    return down.view(tokens, top_k, hidden).sum(dim=1)


def experts_gemv(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_and_mul: nn.Module,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    tiles: tuple[int, int, int] | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
    group: int = 128,
) -> torch.Tensor:
    """fused_experts for a few tokens by one GEMV per (token, expert) pair (kernels/moe_gemv.py), no alignment;
    w13 / w2 float8 with their block scales, INT4 codes with their scales and zero points (one each per group
    inputs: kernels/fused_moe_quant.py's layout), or unquantized."""
    ids = topk_ids.flatten().to(torch.int32)

    def product(down: bool, a, out, a_row_div: int, weights) -> None:
        w, scale, zeros = (w2, w2_scale, w2_zeros) if down else (w13, w13_scale, w13_zeros)
        moe_gemv(a, w, ids, a_row_div, out, weights, scale=scale, block=block, tiles=tiles, zeros=zeros, group=group)

    return pair_products(hidden_states, topk_weights, topk_ids.shape[1], w13.shape[1], act_and_mul, product)


@triton.jit
def _clamped_swiglu_kernel(x_ptr, out_ptr, x_stride, out_stride, n, alpha, limit, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + n + offs, mask=mask, other=0.0)
    # torch rounds each op's result to the activations' dtype: so does this (clamping is exact)
    dt = gate.dtype
    g = tl.minimum(gate.to(tl.float32), limit)
    u = tl.minimum(tl.maximum(up.to(tl.float32), -limit), limit)
    z = (g * alpha).to(dt).to(tl.float32)
    glu = (g * (1.0 / (1.0 + tl.exp(-z))).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    u1 = (u + 1.0).to(dt).to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, (u1 * glu).to(dt), mask=mask)


def clamped_swiglu_and_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation over x = concat(gate, up) [rows, 2 * d]: gate clamped above at limit, up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate) (layers/activation.py's ClampedSwigluAndMul)."""
    rows, two_d = x.shape
    n = two_d // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _clamped_swiglu_kernel[(rows, triton.cdiv(n, block))](
            x, out, x.stride(0), out.stride(0), n, alpha, limit, BLOCK=block
        )
    return out
