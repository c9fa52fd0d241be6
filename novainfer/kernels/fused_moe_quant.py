"""The mixture-of-experts layer on the GPU with pre-quantized expert weights (block FP8, INT4) read as stored.

The steps of kernels/fused_moe.py (pairs aligned by expert, one expert per tile of rows, gate/up GEMM, activation,
down GEMM with the routing weight, per-token sum), with grouped GEMMs that dequantize the weight tile in registers:
- block FP8: w float8_e4m3fn [E, N, K] with float32 scales [E, N/BN_S, K/BK_S] (weight_scale_inv per expert,
  stacked). Up to WEIGHT_ONLY_MAX_M tokens the product is weight-only (x stays bf16, each weight byte widened and
  scaled by its block's scale in the tile); more tokens quantize x per token per BK_S-wide group
  (kernels/fp8_block.py's per_token_group_quant) and the float8 tl.dot of a step is scaled by the row's group
  scale and the block's scale. BLOCK_K divides BK_S, so one scale column a step.
- INT4: kernels/int4_gemm.py's layout per expert, stacked: qweight int32 [E, N, K/8] (of each 32 inputs, input
  4j + w in nibble j of word w), scales [E, N, K/G], zero points uint8 [E, N, K/G]; w = (code - zero) * scale.
  BLOCK_K divides G, so one scale and zero column a step.
Up to moe_gemv.MAX_TOKENS tokens both formats (block FP8 weight-only) take kernels/moe_gemv.py's one GEMV per
(token, expert) pair instead: no alignment, and each routed expert's rows read once, not padded to BLOCK_M rows.
The torch references are layers/quantization/prequantized_moe.py's dequantize_* followed by
layers/fused_moe/moe_torch.py's fused_experts_torch.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl
from torch import nn

from novainfer.kernels.fp8_block import WEIGHT_ONLY_MAX_M, per_token_group_quant
from novainfer.kernels.fused_moe import (
    experts_gemv,
    launch_with_fallback,
    moe_tiles,
    routed_experts,
    store_rows,
    tile_rows,
)
from novainfer.kernels.int4_gemm import MAGIC
from novainfer.kernels.moe_gemv import MAX_TOKENS

# kernels/fused_moe.py's MOE_TILES for the block-FP8 GEMMs with FP8 activations: `benchmarks/quant_gpu.py --part
# moe-kernels`'s sweep, Qwen3-30B-A3B's layer. BLOCK_N <= the 128-wide scale block keeps one weight scale a step.
FP8_MOE_TILES: dict[int, tuple[tuple[int, int, int, int, int], tuple[int, int, int, int, int]]] = {
    32: ((32, 64, 128, 4, 3), (32, 64, 128, 4, 3)),
    96: ((64, 64, 128, 4, 3), (64, 64, 128, 4, 3)),
    1 << 62: ((64, 128, 128, 4, 3), (64, 128, 128, 4, 3)),
}
# The same for the INT4 GEMMs (C transposed: BLOCK_N is the dot's tall side), from a sweep on an H100
# (docs/bench/2026-12-05/int4_moe_h100.log) at 16 / 256 / 4,096 tokens; the middle bucket between its neighbours'.
INT4_MOE_TILES: dict[int, tuple[tuple[int, int, int, int, int], tuple[int, int, int, int, int]]] = {
    32: ((32, 64, 128, 4, 3), (32, 64, 128, 4, 3)),
    96: ((64, 64, 128, 4, 3), (64, 64, 128, 4, 3)),
    1 << 62: ((128, 128, 128, 8, 3), (128, 128, 128, 8, 3)),
}


@triton.jit
def _fp8_block_moe_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    N,
    K,
    num_valid,
    stride_am,
    stride_asm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_cm,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    A_QUANTIZED: tl.constexpr,
    BN_S: tl.constexpr,
    BK_S: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """C[pair] = A[pair // A_ROW_DIV] @ (W[expert] * block scales)^T (times the routing weight); A_QUANTIZED: A
    holds float8 values with per-row group scales a_scale [rows, K/BK_S]."""
    if tl.program_id(0) * BLOCK_M >= tl.load(num_padded_ptr):  # the grid is sized for the worst case
        return
    pair, mmask, expert, cols, nmask = tile_rows(sorted_ids_ptr, block_experts_ptr, N, num_valid, BLOCK_M, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    a_rows = (pair // A_ROW_DIV).to(tl.int64)
    b_base = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn
    s_base = bs_ptr + expert * stride_bse + (cols // BN_S).to(tl.int64) * stride_bsn
    # BLOCK_N <= BN_S: the tile's columns share one scale block, so a step's two scales are one per row
    s_tile = bs_ptr + expert * stride_bse + (tl.program_id(1) * BLOCK_N // BN_S).to(tl.int64) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + kk) < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + (k0 + kk)[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0
        )
        b = tl.load(b_base + (k0 + kk)[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
        if A_QUANTIZED:
            a_scale = tl.load(a_scale_ptr + a_rows * stride_asm + k0 // BK_S, mask=mmask, other=0.0)
            part = tl.dot(a, b.to(a.dtype), input_precision=PRECISION)
            if BLOCK_N <= BN_S:
                acc += part * (a_scale * tl.load(s_tile + k0 // BK_S))[:, None]  # one FMA an element
            else:
                acc += part * a_scale[:, None] * tl.load(s_base + k0 // BK_S, mask=nmask, other=0.0)[None, :]
        else:
            b_scale = tl.load(s_base + k0 // BK_S, mask=nmask, other=0.0)
            w = (b.to(tl.float32) * b_scale[None, :]).to(a.dtype)
            acc += tl.dot(a, w, input_precision=PRECISION)
    store_rows(
        acc, c_ptr, stride_cm, c_ptr, 0, topk_weights_ptr, pair, mmask, expert, cols, nmask, False, MUL_ROUTED_WEIGHT
    )


@triton.jit
def _int4_moe_kernel(
    a_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    N,
    K,
    num_valid,
    stride_am,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sn,
    stride_cm,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """C[pair] = A[pair // A_ROW_DIV] @ W[expert]^T (times the routing weight), W from the INT4 layout (the module
    docstring); K a multiple of GROUP, BLOCK_K a divisor of it."""
    if tl.program_id(0) * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair, mmask, expert, cols, nmask = tile_rows(sorted_ids_ptr, block_experts_ptr, N, num_valid, BLOCK_M, BLOCK_N)
    C: tl.constexpr = BLOCK_K // 32
    kk = tl.arange(0, BLOCK_K)
    a_rows = (pair // A_ROW_DIV).to(tl.int64)
    nload = tl.minimum(cols, N - 1).to(tl.int64)  # edge tiles re-read the last row: unmasked weight loads
    # a step's words [BLOCK_N, BLOCK_K / 8], split to [BLOCK_N, C, 1, 4] and unpacked by nibble j on axis 2: input
    # c * 32 + 4 j + w is column k of the tile
    q_ptrs = q_ptr + expert * stride_qe + nload[:, None] * stride_qn + tl.arange(0, BLOCK_K // 8)[None, :]
    shifts = (tl.arange(0, 8) * 4)[None, None, :, None]
    sz = expert * stride_se + nload * stride_sn
    at_ptrs = a_ptr + a_rows[None, :] * stride_am + kk[:, None]  # A transposed: [BLOCK_K, BLOCK_M]
    # C transposed, as kernels/int4_gemm.py's GEMM: the code tile is the dot's left operand, which Hopper's wgmma
    # reads from registers, and code - zero (-15..15) is exact in A's dtype, so the scale multiplies the sums
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        at = tl.load(at_ptrs + k0, mask=mmask[None, :], other=0.0)
        q = tl.reshape(tl.load(q_ptrs + k0 // 8), [BLOCK_N, C, 1, 4])
        codes = tl.reshape(((q >> shifts) & 0xF) | MAGIC, [BLOCK_N, BLOCK_K]).to(tl.float32, bitcast=True)
        g = k0 // GROUP
        s = tl.load(s_ptr + sz + g).to(tl.float32)
        zoff = tl.load(z_ptr + sz + g).to(tl.float32) + 8388608.0  # 2^23 + zero: code - zero exactly
        acc += tl.dot((codes - zoff[:, None]).to(at.dtype), at, input_precision=PRECISION) * s[:, None]
    acc = tl.trans(acc)
    store_rows(
        acc, c_ptr, stride_cm, c_ptr, 0, topk_weights_ptr, pair, mmask, expert, cols, nmask, False, MUL_ROUTED_WEIGHT
    )


def _grouped_gemm(kernel, a, operands, strides, out, ids, a_row_div, weights, tiles, n, k, block_k, **meta) -> None:
    """Launch one quantized grouped GEMM: kernel(a, *operands, out, routing..., N, K, pairs, stride_am, *strides,
    stride_cm, meta) over the aligned pairs ids (sorted ids, block experts, padded total); block_k(t) narrows the
    tiles' BLOCK_K to the format's scale blocks."""
    assert a.stride(1) == 1 and out.stride(1) == 1
    sorted_ids, block_experts, num_padded = ids

    def launch(t: tuple[int, int, int, int, int]) -> None:
        block_m, block_n, bk, warps, stages = t
        kernel[(sorted_ids.numel() // block_m, triton.cdiv(n, block_n))](
            a,
            *operands,
            out,
            weights if weights is not None else out,
            sorted_ids,
            block_experts,
            num_padded,
            n,
            k,
            out.shape[0],
            a.stride(0),
            *strides,
            out.stride(0),
            A_ROW_DIV=a_row_div,
            MUL_ROUTED_WEIGHT=weights is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k(bk),
            PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            num_warps=warps,
            num_stages=stages,
            **meta,
        )

    launch_with_fallback(launch, tiles)


def _tiles(
    hidden_states: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, n13: int, inter: int, table: dict
) -> tuple[tuple[int, int, int, int, int], tuple[int, int, int, int, int]]:
    """(gate/up, down) tiles of a format's grouped GEMMs from its table (MOE_TILES' form)."""
    pairs, hidden = hidden_states.shape[0] * topk_ids.shape[1], hidden_states.shape[1]
    up = moe_tiles(pairs, num_experts, n13, hidden, False, table)
    return up, moe_tiles(pairs, num_experts, hidden, inter, True, table)


def fused_experts_fp8_block(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    block: tuple[int, int],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_and_mul: nn.Module,
    quantize_activations: bool | None = None,
    act_quant: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    tiles: tuple | None = None,
) -> torch.Tensor:
    """[tokens, hidden] -> [tokens, hidden]: sum_k weight_k * down_e(act(gate_up_e x)) with block-FP8 experts:
    w13 float8 [E, 2 * inter, hidden] (gate rows, then up rows), w13_scale [E, 2 * inter / BN_S, hidden / BK_S],
    w2 [E, hidden, inter], w2_scale [E, hidden / BN_S, inter / BK_S]. quantize_activations None: per-token-group
    FP8 activations above WEIGHT_ONLY_MAX_M tokens, weight-only below (float32 activations: quantized values
    kept in float32, the interpreter's way). act_quant: x -> (float8 x, float32 scales [rows, K / BK_S]) instead of
    per_token_group_quant (compressed-tensors' per-token rows: block (1, K), one scale a row). tiles: (gate/up,
    down) tiles instead of FP8_MOE_TILES' (FP8 activations) or MOE_TILES' (a benchmark's sweep)."""
    if quantize_activations is None:
        quantize_activations = hidden_states.shape[0] > WEIGHT_ONLY_MAX_M
    if not quantize_activations and hidden_states.shape[0] <= MAX_TOKENS and tiles is None:
        return experts_gemv(hidden_states, w13, w2, topk_weights, topk_ids, act_and_mul, w13_scale, w2_scale, block)

    def gemm(down: bool, a, out, ids, a_row_div: int, weights, tiles) -> None:
        w, s = (w2, w2_scale) if down else (w13, w13_scale)
        a_scale = None
        if quantize_activations:
            interpreted = a.dtype == torch.float32  # float8 values held in float32, rounded by torch
            if act_quant is not None:
                q, a_scale = act_quant(a.contiguous())
            else:
                out_dtype = torch.float32 if interpreted else torch.float8_e4m3fn
                q, a_scale = per_token_group_quant(a.contiguous(), block[1], out_dtype=out_dtype)
            a = q.to(torch.float8_e4m3fn).float() if interpreted else q
        assert w.stride(2) == 1 and s.stride(2) == 1
        strides = (a_scale.stride(0) if a_scale is not None else 0, *w.stride()[:2], *s.stride()[:2])
        operands = (a_scale if a_scale is not None else out, w, s)
        _grouped_gemm(
            _fp8_block_moe_kernel,
            a,
            operands,
            strides,
            out,
            ids,
            a_row_div,
            weights,
            tiles,
            w.shape[1],
            w.shape[2],
            lambda bk: min(bk, block[1]),  # one scale column a step
            A_QUANTIZED=a_scale is not None,
            BN_S=block[0],
            BK_S=block[1],
        )

    n13, inter = w13.shape[1], w2.shape[2]
    if tiles is None and quantize_activations:
        tiles = _tiles(hidden_states, topk_ids, w13.shape[0], n13, inter, FP8_MOE_TILES)
    return routed_experts(hidden_states, topk_weights, topk_ids, w13.shape[0], n13, inter, act_and_mul, gemm, tiles)


def fused_experts_int4(
    hidden_states: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_zeros: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_zeros: torch.Tensor,
    group: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_and_mul: nn.Module,
    tiles: tuple | None = None,
) -> torch.Tensor:
    """[tokens, hidden] -> [tokens, hidden] with INT4 experts: w13_qweight int32 [E, 2 * inter, hidden / 8] (gate
    rows, then up rows), w13_scales / w13_zeros [E, 2 * inter, hidden / G]; w2_* [E, hidden, inter / 8] and
    [E, hidden, inter / G]. Up to MAX_TOKENS tokens one GEMV per (token, expert) pair (kernels/moe_gemv.py), else
    the grouped GEMMs; tiles: their (gate/up, down) tiles instead of INT4_MOE_TILES' (a benchmark's sweep, which
    also takes the grouped GEMMs at any token count)."""
    if hidden_states.shape[0] <= MAX_TOKENS and tiles is None:
        w = (w13_qweight, w2_qweight, topk_weights, topk_ids, act_and_mul, w13_scales, w2_scales)
        return experts_gemv(hidden_states, *w, w13_zeros=w13_zeros, w2_zeros=w2_zeros, group=group)

    def gemm(down: bool, a, out, ids, a_row_div: int, weights, tiles) -> None:
        q, s, z = (w2_qweight, w2_scales, w2_zeros) if down else (w13_qweight, w13_scales, w13_zeros)
        assert q.stride(2) == 1 and s.stride() == z.stride() and s.stride(2) == 1
        strides = (*q.stride()[:2], *s.stride()[:2])
        n, k = q.shape[1], q.shape[2] * 8
        block_k = lambda bk: max(32, min(bk, group))  # noqa: E731  whole 32-input chunks, one group a step
        _grouped_gemm(
            _int4_moe_kernel,
            a.contiguous(),
            (q, s, z),
            strides,
            out,
            ids,
            a_row_div,
            weights,
            tiles,
            n,
            k,
            block_k,
            GROUP=group,
        )

    n13, inter = w13_qweight.shape[1], w2_qweight.shape[2] * 8
    num_experts = w13_qweight.shape[0]
    if tiles is None:
        tiles = _tiles(hidden_states, topk_ids, num_experts, n13, inter, INT4_MOE_TILES)
    return routed_experts(hidden_states, topk_weights, topk_ids, num_experts, n13, inter, act_and_mul, gemm, tiles)
