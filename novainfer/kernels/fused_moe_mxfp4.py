"""The mixture-of-experts layer on the GPU with MXFP4 expert weights read as stored (four bits a weight).

The steps of kernels/fused_moe.py (tokens aligned by expert, gate/up GEMM, activation, down GEMM with the routing
weight, per-token sum), with a grouped GEMM that dequantizes the weight tile in registers: each byte of the blocks
holds elements 2j (low nibble) and 2j + 1 (high) of a row, so the A tile is loaded as its even and odd columns and
each nibble plane is one tl.dot; an e2m1 code is decoded arithmetically (sign bit 3, exponent bits 1-2, mantissa
bit 0) and scaled by 2^(e - 127) of its block of 32, then rounded to the activation dtype (exact: 2 significant
bits). Expert biases are added before the routing weight, as transformers' GptOssExperts does.
The torch reference is layers/fused_moe/moe_torch.py's fused_experts_torch over layers/quantization/mxfp4.py's
dequantize_mxfp4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from novainfer.kernels.fused_moe import store_rows, tile_rows, launch_with_fallback, routed_experts


@triton.jit
def _e2m1_times_scale(codes, scale):
    """Nibbles (int32 0..15) -> their e2m1 values times scale (float32)."""
    mag = codes & 7
    e = mag >> 1
    m = mag & 1
    twice = tl.where(e == 0, m, ((2 + m) << e) >> 1)  # twice the magnitude: 0, 1, 2, 3, 4, 6, 8, 12
    v = twice.to(tl.float32) * 0.5 * scale
    return tl.where((codes & 8) != 0, -v, v)


@triton.jit
def _mxfp4_grouped_gemm_kernel(
    a_ptr,
    blocks_ptr,
    scales_ptr,
    bias_ptr,
    c_ptr,
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
    stride_se,
    stride_sn,
    stride_cm,
    stride_bias,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """C[pair] = A[pair // A_ROW_DIV] @ W[expert]^T (+ bias[expert]) (times the routing weight), W from MXFP4
    blocks uint8 [E, N, K/2] and scales uint8 [E, N, K/32]; BLOCK_K a multiple of 32."""
    if tl.program_id(0) * BLOCK_M >= tl.load(num_padded_ptr):  # the grid is sized for the worst case
        return
    pair, mmask, expert, cols, nmask = tile_rows(sorted_ids_ptr, block_experts_ptr, N, num_valid, BLOCK_M, BLOCK_N)
    jj = tl.arange(0, BLOCK_K // 2)  # byte j of the tile: elements 2j and 2j + 1
    a_rows = (pair // A_ROW_DIV).to(tl.int64)
    b_base = blocks_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn
    s_base = scales_ptr + expert * stride_se + cols[None, :].to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kbyte = k0 // 2 + jj
        kmask = kbyte < K // 2
        a_even = a_ptr + a_rows[:, None] * stride_am + 2 * kbyte[None, :]
        amask = mmask[:, None] & kmask[None, :]
        a_lo = tl.load(a_even, mask=amask, other=0.0)
        a_hi = tl.load(a_even + 1, mask=amask, other=0.0)
        wmask = nmask[None, :] & kmask[:, None]
        byte = tl.load(b_base + kbyte[:, None], mask=wmask, other=0).to(tl.int32)
        e8m0 = tl.load(s_base + (kbyte // 16)[:, None], mask=wmask, other=127).to(tl.int32)
        scale = (e8m0 << 23).to(tl.float32, bitcast=True)  # 2^(e - 127) (e = 0, a zero scale, is never written)
        w_lo = _e2m1_times_scale(byte & 15, scale).to(a_lo.dtype)
        w_hi = _e2m1_times_scale(byte >> 4, scale).to(a_lo.dtype)
        acc += tl.dot(a_lo, w_lo, input_precision=PRECISION)
        acc += tl.dot(a_hi, w_hi, input_precision=PRECISION)
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


def _grouped_gemm(a, blocks, scales, bias, out, sorted_ids, block_experts, num_padded, a_row_div, weights, tiles):
    """One grouped GEMM (blocks [E, N, K/2], scales [E, N, K/32]) with the tiles of kernels/fused_moe.py."""
    assert a.stride(1) == 1 and blocks.stride(2) == 1 and scales.stride(2) == 1 and out.stride(1) == 1
    assert bias is None or (bias.shape == blocks.shape[:2] and bias.stride(1) == 1)
    n, k = blocks.shape[1], blocks.shape[2] * 2

    def launch(t: tuple[int, int, int, int, int]) -> None:
        block_m, block_n, block_k, warps, stages = t
        _mxfp4_grouped_gemm_kernel[(sorted_ids.numel() // block_m, triton.cdiv(n, block_n))](
            a,
            blocks,
            scales,
            bias if bias is not None else out,
            out,
            weights if weights is not None else out,
            sorted_ids,
            block_experts,
            num_padded,
            n,
            k,
            out.shape[0],
            a.stride(0),
            blocks.stride(0),
            blocks.stride(1),
            scales.stride(0),
            scales.stride(1),
            out.stride(0),
            bias.stride(0) if bias is not None else 0,
            A_ROW_DIV=a_row_div,
            MUL_ROUTED_WEIGHT=weights is not None,
            HAS_BIAS=bias is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=max(32, block_k),  # whole blocks of 32 a step
            PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            num_warps=warps,
            num_stages=stages,
        )

    launch_with_fallback(launch, tiles)


def fused_experts_mxfp4(
    hidden_states: torch.Tensor,
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_and_mul: nn.Module,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[tokens, hidden] -> [tokens, hidden]: sum_k weight_k * (down_e(act(gate_up_e x + b13_e)) + b2_e).

    w13_blocks uint8 [E, 2 * inter, hidden / 2] (gate rows, then up rows), w13_scales uint8 [E, 2 * inter,
    hidden / 32], w2_blocks [E, hidden, inter / 2], w2_scales [E, hidden, inter / 32]; biases [E, N] or None."""

    def gemm(down: bool, a, out, ids, a_row_div: int, weights, tiles) -> None:
        blocks, scales, bias = (w2_blocks, w2_scales, w2_bias) if down else (w13_blocks, w13_scales, w13_bias)
        _grouped_gemm(a, blocks, scales, bias, out, *ids, a_row_div, weights, tiles)

    n13, inter = w13_blocks.shape[1], w2_blocks.shape[2] * 2
    return routed_experts(hidden_states, topk_weights, topk_ids, w13_blocks.shape[0], n13, inter, act_and_mul, gemm)
