"""The mixture-of-experts layer on the GPU with GGUF experts kept quantized (layers/quantization/gguf_moe.py).

Each side's experts are stacked per array of kernels/gguf_gemm.py's repacked layout: a GGUFWeight whose arrays have
a leading expert dimension (qweight [E, N, K/2], d [E, N, K/SUPER], ...) and shape (N, K), each expert's rows
contiguous after the previous expert's, so weight row n of expert e is row e * N + n of the arrays seen as 2-D and
gguf_gemm's jit helpers (_group_scales, _quants, _gemv_q8_rows) read it unchanged. A side is a list of such parts
along N (gate and up of different GGML types: two parts, each written into its columns), or a dense [E, N, K]
tensor where a type has no kernel (then kernels/fused_moe.py's bf16 kernels run that side).

Above moe_gemv.MAX_TOKENS tokens, the steps of kernels/fused_moe.py (routed_experts: pairs aligned by expert, gate/up
grouped GEMM, activation, down grouped GEMM with the routing weight, per-token sum) with _gguf_moe_kernel: a
[BLOCK_N, BLOCK_K] weight tile dequantized in registers in x's dtype, as gguf_gemm's GEMM does, and tl.dot against
the tile's rows of x (out transposed: the weight tile is the dot's register operand; two dots a step for the 4-bit
types, the low and the high nibbles with x's matching columns). Up to MAX_TOKENS tokens one GEMV per (token, expert)
pair: x (then the activation) rounded to int8 per 32 inputs (gguf_gemm.quantize_q8, one launch for all rows) and
gguf_gemm's dp4a GEMV body over BLOCK_N rows of the pair's expert, so each routed expert's blocks are read once per
pair and the routing weight is multiplied in before the store.
The torch reference is layers/quantization/gguf_moe.py's fused_experts_gguf_reference: the routed experts
dequantized (gguf_gemm.dequantize) and layers/fused_moe/moe_torch.fused_experts_torch, with x and the activation
rounded as the GEMV rounds them where asked. Tiles: reasoned defaults (not yet swept on a GPU; tests/gpu/gguf_moe_check.py times them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from novainfer.kernels.fused_moe import _grouped_gemm as dense_grouped_gemm
from novainfer.kernels.fused_moe import fused_experts, moe_tiles, pair_products, routed_experts, store_rows, tile_rows
from novainfer.kernels.fused_moe_quant import _grouped_gemm
from novainfer.kernels.gguf_gemm import (
    GEMV_DEFAULT,
    GEMV_NARROW,
    GEMV_NARROW_N,
    GGUFWeight,
    _args,
    _consts,
    _gemv_q8_rows,
    _group_scales,
    _quants,
    q8_operands,
    quantize_q8,
)
from novainfer.kernels.moe_gemv import MAX_TOKENS, moe_gemv

Side = list[GGUFWeight] | torch.Tensor  # one side's experts: quantized parts along N, or dense [E, N, K]

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by pairs per expert (kernels/fused_moe.py's MOE_TILES' way);
# BLOCK_K is halved until it divides K. Swept on an H200 at 2 and 16 pairs per expert (Qwen3-30B-A3B's layer at 32
# and 256 tokens: tests/gpu/gguf_moe_check.py --sweep); the larger buckets are reasoned from gguf_gemm's GEMM tiles
GGUF_MOE_TILES: dict[int, tuple[int, int, int, int, int]] = {
    4: (16, 64, 128, 4, 3),
    16: (32, 128, 64, 4, 3),
    64: (32, 64, 128, 4, 3),
    256: (64, 128, 64, 4, 3),
    1 << 62: (128, 128, 64, 8, 3),
}
INTERPRETER_TILES = (16, 128, 256, 4, 1)  # small programs for Triton's CPU interpreter
INTERPRETER_GEMV = (64, 256)  # (BLOCK_N, BLOCK_K cap)


@triton.jit
def _gguf_moe_kernel(
    a_ptr,
    q_ptr,
    d_ptr,
    sc_ptr,
    dm_ptr,
    mn_ptr,
    h_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    N,
    K,
    num_valid,
    stride_am,
    stride_qn,
    stride_hn,
    stride_cm,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    Q4: tl.constexpr,
    HB: tl.constexpr,
    W: tl.constexpr,
    NB: tl.constexpr,
    HALF: tl.constexpr,
    SUB: tl.constexpr,
    OFF: tl.constexpr,
    HAS_SC: tl.constexpr,
    HAS_DM: tl.constexpr,
    HAS_MN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """C[pair] = A[pair // A_ROW_DIV] @ W[expert]^T (times the routing weight), W an expert stack in the GGUF layout
    (the module docstring); BLOCK_K a multiple of 32 dividing K."""
    if tl.program_id(0) * BLOCK_M >= tl.load(num_padded_ptr):  # the grid is sized for the worst case
        return
    pair, mmask, expert, cols, nmask = tile_rows(sorted_ids_ptr, block_experts_ptr, N, num_valid, BLOCK_M, BLOCK_N)
    C: tl.constexpr = BLOCK_K // 32
    chunk = tl.arange(0, C)
    lane = tl.arange(0, W)
    wrow = expert * N + tl.minimum(cols, N - 1)  # the expert's rows; edge tiles re-read the last: unmasked loads
    q_ptrs = q_ptr + wrow[:, None, None] * stride_qn + (chunk[:, None] * W + lane[None, :])[None, :, :]
    h_ptrs = h_ptr + wrow[:, None, None] * stride_hn + (chunk[:, None] * NB + lane[None, :] % NB)[None, :, :]
    x_cols = tl.reshape(chunk[:, None] * 32 + lane[None, :], [C * W])  # the inputs of the tile's (low) bytes
    a_rows = (pair // A_ROW_DIV).to(tl.int64)
    xt_ptrs = a_ptr + a_rows[None, :] * stride_am + x_cols[:, None]  # x transposed: [C * W, BLOCK_M]
    xmask = mmask[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // 32 + chunk
        s_lo, z_lo, s_hi, z_hi = _group_scales(
            d_ptr, sc_ptr, dm_ptr, mn_ptr, wrow, g, K, HALF, SUB, HAS_SC, HAS_DM, HAS_MN
        )
        q = tl.load(q_ptrs + k0 // (32 // W))
        h = q
        if HB > 0:
            h = tl.load(h_ptrs + (k0 // 32) * NB)
        lo, hi = _quants(q, h, lane, Q4, HB, NB, OFF)
        xt = tl.load(xt_ptrs + k0, mask=xmask, other=0.0)
        lo = lo * s_lo[:, :, None] + z_lo[:, :, None]
        acc = tl.dot(tl.reshape(lo, [BLOCK_N, C * W]).to(xt.dtype), xt, acc, input_precision=PRECISION)
        if Q4:
            hi = hi * s_hi[:, :, None] + z_hi[:, :, None]
            xh = tl.load(xt_ptrs + k0 + 16, mask=xmask, other=0.0)
            acc = tl.dot(tl.reshape(hi, [BLOCK_N, C * W]).to(xt.dtype), xh, acc, input_precision=PRECISION)
    store_rows(
        tl.trans(acc),
        c_ptr,
        stride_cm,
        c_ptr,
        0,
        topk_weights_ptr,
        pair,
        mmask,
        expert,
        cols,
        nmask,
        False,
        MUL_ROUTED_WEIGHT,
    )


@triton.jit
def _gguf_moe_gemv_kernel(
    xq_ptr,
    dx_ptr,
    sx_ptr,
    q_ptr,
    d_ptr,
    sc_ptr,
    dm_ptr,
    mn_ptr,
    h_ptr,
    ids_ptr,
    rw_ptr,
    out_ptr,
    N,
    K,
    stride_qw,
    stride_hw,
    stride_om,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    Q4: tl.constexpr,
    HB: tl.constexpr,
    HALF: tl.constexpr,
    SUB: tl.constexpr,
    OFF: tl.constexpr,
    HAS_SC: tl.constexpr,
    HAS_DM: tl.constexpr,
    HAS_MN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ASM: tl.constexpr,
):
    """out[pair, rows] = W[expert of pair, rows] @ x[pair // A_ROW_DIV] (times the pair's routing weight), x rows
    quantized by gguf_gemm.quantize_q8 (K / 4 int32 words, K / 32 dx and K / 16 sx a row)."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rload = expert * N + tl.minimum(rows, N - 1)  # the last tile re-reads row N - 1: no masks on the rows
    x_row = (pair // A_ROW_DIV).to(tl.int64)
    y = _gemv_q8_rows(
        xq_ptr + x_row * (K // 4),
        dx_ptr + x_row * (K // 32),
        sx_ptr + x_row * (K // 16),
        q_ptr,
        d_ptr,
        sc_ptr,
        dm_ptr,
        mn_ptr,
        h_ptr,
        rload,
        K,
        stride_qw,
        stride_hw,
        Q4,
        HB,
        HALF,
        SUB,
        OFF,
        HAS_SC,
        HAS_DM,
        HAS_MN,
        BLOCK_N,
        BLOCK_K,
        ASM,
    )
    if MUL_ROUTED_WEIGHT:
        y = y * tl.load(rw_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


def gguf_moe_tiles(num_pairs: int, num_experts: int, on_gpu: bool) -> tuple[int, int, int, int, int]:
    """The grouped GEMMs' tiles (both sides: one alignment) for this many pairs over the experts."""
    if not on_gpu:
        return INTERPRETER_TILES
    per_expert = num_pairs / num_experts
    return next(t for bound, t in sorted(GGUF_MOE_TILES.items()) if per_expert <= bound)


def _parts_at(side: Side) -> list[tuple[int, torch.Tensor | GGUFWeight]]:
    """(first output column, part) of each part of a side (a dense side: one part)."""
    if isinstance(side, torch.Tensor):
        return [(0, side)]
    at, parts = 0, []
    for p in side:
        parts.append((at, p))
        at += p.shape[0]
    return parts


def side_shape(side: Side) -> tuple[int, int, int]:
    """(experts, N, K) of a side."""
    if isinstance(side, torch.Tensor):
        return tuple(side.shape)
    return side[0].qweight.shape[0], sum(p.shape[0] for p in side), side[0].shape[1]


def _gguf_gemm(w: GGUFWeight, a, out, ids, a_row_div: int, weights, tiles) -> None:
    """One grouped GEMM of an expert stack w in the GGUF layout (fused_moe_quant._grouped_gemm's launch)."""
    n, k = w.shape

    def block_k(bk: int) -> int:
        bk = max(32, bk)
        while k % bk:  # whole groups of 32 dividing K: no K masks
            bk //= 2
        return bk

    _grouped_gemm(
        _gguf_moe_kernel,
        a,
        _args(w),
        (w.qweight.stride(1), 0 if w.qh is None else w.qh.stride(1)),
        out,
        ids,
        a_row_div,
        weights,
        tiles,
        n,
        k,
        block_k,
        **_consts(w),
    )


def _gguf_gemv(w: GGUFWeight, q8, ids: torch.Tensor, a_row_div: int, out: torch.Tensor, weights) -> None:
    """out [pairs, N] = each pair's expert of w times its row of x, x already quantized by quantize_q8."""
    pairs, (n, k) = out.shape[0], w.shape
    on_gpu = out.is_cuda
    if on_gpu:
        block_n, cap, warps = GEMV_NARROW if n <= GEMV_NARROW_N else GEMV_DEFAULT
    else:
        (block_n, cap), warps = INTERPRETER_GEMV, 4
    block_k = max(32, min(cap, k & -k))  # a power of two dividing K: no masked tail step
    words, strides, consts = q8_operands(w)
    xq, dx, sx = q8
    _gguf_moe_gemv_kernel[(pairs, triton.cdiv(n, block_n))](
        xq.view(torch.int32),
        dx,
        sx,
        *words,
        ids,
        weights if weights is not None else out,
        out,
        n,
        k,
        *strides,
        out.stride(0),
        A_ROW_DIV=a_row_div,
        MUL_ROUTED_WEIGHT=weights is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ASM=on_gpu,
        num_warps=warps,
        **consts,
    )


def fused_experts_gguf(
    hidden_states: torch.Tensor,
    w13: Side,
    w2: Side,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_and_mul: nn.Module,
    tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """[tokens, hidden] -> [tokens, hidden]: sum_k weight_k * down_e(act(gate_up_e x)) with GGUF experts: w13 parts
    [E, 2 * inter, hidden] along N (gate rows, then up rows), w2 [E, hidden, inter] (module docstring). Up to
    MAX_TOKENS tokens the int8-x GEMV per pair, else the grouped GEMMs; tiles: the grouped GEMMs' (a sweep's, which
    also takes the grouped GEMMs at any token count)."""
    if isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor):  # no type with a kernel: the bf16 MoE as is
        return fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, act_and_mul)
    tokens = hidden_states.shape[0]
    num_experts, n13, _ = side_shape(w13)
    if tokens <= MAX_TOKENS and tiles is None:
        return _experts_gemv(hidden_states, w13, w2, topk_weights, topk_ids, act_and_mul, n13)
    if tiles is None:
        tiles = gguf_moe_tiles(tokens * topk_ids.shape[1], num_experts, hidden_states.is_cuda)

    def gemm(down: bool, a, out, ids, a_row_div: int, weights, side_tiles) -> None:
        a = a.contiguous()
        for at, part in _parts_at(w2 if down else w13):
            if isinstance(part, torch.Tensor):  # kernels/fused_moe.py's bf16 GEMM, on this alignment's BLOCK_M
                dense = moe_tiles(out.shape[0], num_experts, part.shape[1], part.shape[2], down)
                dense_grouped_gemm(a, part, out, *ids, out.shape[0], a_row_div, weights, (tiles[0], *dense[1:]))
            else:
                _gguf_gemm(part, a, out[:, at : at + part.shape[0]], ids, a_row_div, weights, side_tiles)

    inter = side_shape(w2)[2]
    return routed_experts(
        hidden_states, topk_weights, topk_ids, num_experts, n13, inter, act_and_mul, gemm, (tiles, tiles)
    )


def _experts_gemv(hidden_states, w13: Side, w2: Side, topk_weights, topk_ids, act_and_mul, n13: int) -> torch.Tensor:
    """fused_experts_gguf for a few tokens: one GEMV per (token, expert) pair, no alignment."""
    ids = topk_ids.flatten().to(torch.int32)

    def product(down: bool, a, out, a_row_div: int, weights) -> None:
        parts = _parts_at(w2 if down else w13)
        q8 = None
        for at, part in parts:
            if isinstance(part, torch.Tensor):
                moe_gemv(a, part, ids, a_row_div, out, weights)
                continue
            if q8 is None:  # every row of a rounded once, for all parts
                q8 = quantize_q8(a.contiguous().view(1, -1))
            _gguf_gemv(part, q8, ids, a_row_div, out[:, at : at + part.shape[0]], weights)

    return pair_products(hidden_states, topk_weights, topk_ids.shape[1], n13, act_and_mul, product)
