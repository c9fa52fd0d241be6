"""The mixture-of-experts layer for a few tokens (decode at batch 1-2): one matrix-vector product per (token,
expert) pair, the expert's weight rows read once, no sorting or padding.

The grouped GEMM of kernels/fused_moe.py pads each expert's pairs to BLOCK_M rows: at one token that is a 16-64-row
tile holding one live row, and a grid of (pairs x N / BLOCK_N) programs too few to stream the experts' bytes at
HBM speed. Here a program takes BLOCK_N rows of one pair's expert, accumulates products elementwise in a
[BLOCK_N, BLOCK_K] float32 tile and reduces it once, as kernels/gemv.py does (routing weight multiplied in before
the store); kernels/fused_moe.experts_gemv runs it for the gate/up and the down products.
Weights: bf16 / fp16 / float32 [E, N, K], or float8 with one float32 scale per [GROUP_N, GROUP_K] block
(pre-quantized block FP8, weight-only: each block's scale multiplies x's inputs; blocks of fewer rows than a program
takes, as compressed-tensors' one scale a row, multiply the weights instead), or INT4 in kernels/fused_moe_quant.py's
layout (_int4_moe_gemv_kernel below: each 16-byte load of codes is a row's 32 inputs, unpacked in registers with the
zero point and the scale applied once per 32 inputs). The torch references are
layers/fused_moe/moe_torch.fused_experts_torch, fp8_block.fused_experts_fp8_block_reference (weight-only) and
int4.fused_experts_int4_reference.
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
# The INT4 kernel's (BLOCK_N, BLOCK_K, warps): the best over 1, 2 and 4 tokens in two H100 sweeps (2026-12-05, -06;
# 2.7% under (8, 1024, 2), the first guess); not measured on an H200 (`benchmarks/quant_gpu.py --part moe-kernels`
# times INT4_CANDIDATES, docs/bench/2026-12-06/h100_call_a). From its sm_90
# SASS (ptxas, no GPU): a thread holds BLOCK_N * BLOCK_K / (1024 * warps) rows of one 32-input chunk; with four (the
# first six candidates; the last two hold two and eight) its four 16-byte loads of codes are in flight together and
# x's 32 inputs are widened once for the four rows: ~4.5 instructions a weight, against ~5.4 with two rows and ~7.5
# in kernels/int4_gemm.py's GEMV.
# (4, 1024, 1) makes 3,072 one-warp programs of Qwen3-30B-A3B's gate/up at one token; its down product (K = 768)
# leaves a quarter of the chunks idle, which (16, 256, 1) or (32, 256, 2) would not.
INT4_TILES = (4, 1024, 1)
INT4_CANDIDATES = [
    (4, 1024, 1),
    (8, 1024, 2),
    (16, 512, 2),
    (16, 256, 1),
    (32, 256, 2),
    (16, 1024, 4),
    (8, 512, 2),
    (8, 1024, 1),
]
INTERPRETER_INT4_TILES = (64, 256, 4)  # few programs: the interpreter runs one at a time
F16_BITS = 0x41800000  # float32 bits of 16.0: OR-ing a code into mantissa bits 19..22 gives 16 + code


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


@triton.jit
def _int4_moe_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    ids_ptr,
    rw_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sn,
    stride_om,
    f16_bits,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[pair, rows] = W[expert of pair, rows] @ x[pair // A_ROW_DIV] (times the pair's routing weight), W INT4:
    codes q [E, N, K / 8], scales and zero points [E, N, K / GROUP] (one stride pair for both); K a multiple of 32.

    Each code is OR-ed into mantissa bits 19..22 of 16.0 (f16_bits): the float 16 + code, exact, by a shift and an
    and-or, with no zero point subtracted per weight. Per 32-input chunk (within one group), with
    p = sum (16 + code) x and sx = sum x: sum (code - zero) * scale * x = scale * (p - (16 + zero) * sx). f16_bits
    comes as an argument: as an immediate, ptxas re-materializes it before most uses (~0.6 instructions a weight)."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rload = tl.minimum(rows, N - 1).to(tl.int64)  # the last tile re-reads row N - 1: no masks on the rows
    C: tl.constexpr = BLOCK_K // 32  # 32-input chunks (four words) a step
    chunk = tl.arange(0, C)
    lane = tl.arange(0, 4)
    # every load is a [BLOCK_N, C, 4] tile (word w of chunk c of a row), so all take the codes' layout and nothing
    # goes through shared memory: x's inputs of nibble 0 broadcast over the rows, a chunk's scale and zero point over
    # its four words (equal loads, which the compiler merges)
    same = 0 * rows[:, None, None] + 0 * lane[None, None, :]
    q_rows = q_ptr + expert * stride_qe + rload[:, None, None] * stride_qn + lane[None, None, :]
    sz_rows = expert * stride_se + rload[:, None, None] * stride_sn + same
    x_lanes = x_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_xm + lane[None, None, :] + same
    acc = tl.zeros([BLOCK_N, C, 1], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # chunks past K (BLOCK_K need not divide K) re-read the last chunk, unmasked, and take a scale of 0
        ci = k0 // 32 + chunk[None, :, None]
        cl = tl.minimum(ci, K // 32 - 1)
        q = tl.load(q_rows + cl * 4, eviction_policy="evict_first")
        grp = sz_rows + cl // (GROUP // 32)
        s = tl.load(s_ptr + grp)
        z = tl.load(z_ptr + grp)
        p = tl.zeros([BLOCK_N, C, 4], tl.float32)
        sx = tl.zeros([BLOCK_N, C, 4], tl.float32)
        for j in tl.static_range(8):  # nibble j of word w is input 32 c + 4 j + w
            x = tl.load(x_lanes + cl * 32 + 4 * j).to(tl.float32)
            if 4 * j <= 19:
                bits = ((q << (19 - 4 * j)) & 0x780000) | f16_bits
            else:
                bits = ((q >> (4 * j - 19)) & 0x780000) | f16_bits
            p += bits.to(tl.float32, bitcast=True) * x
            sx += x
        # the four lanes of a chunk hold one scale and zero point: max takes it
        scale = tl.where(ci < K // 32, tl.max(s, 2, keep_dims=True).to(tl.float32), 0.0)
        zoff = 16.0 + tl.max(z, 2, keep_dims=True).to(tl.float32)
        acc += scale * (tl.sum(p, 2, keep_dims=True) - zoff * tl.sum(sx, 2, keep_dims=True))
    y = tl.sum(tl.reshape(acc, [BLOCK_N, C]), 1)
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
    zeros: torch.Tensor | None = None,
    group: int = 128,
) -> None:
    """out [pairs, N] = each pair's expert w[ids[pair]] [N, K] times a[pair // a_row_div] (unit stride along K),
    times routed_weights[pair] where given; scale: float8 w's block scales [E, N / block[0], K / block[1]]. With
    zeros, w is INT4 (the module docstring): int32 codes [E, N, K / 8], scale and zeros [E, N, K / group]."""
    if zeros is not None:
        _int4_moe_gemv(a, w, scale, zeros, group, ids, a_row_div, out, routed_weights, tiles)
        return
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


def _int4_moe_gemv(a, qweight, scales, zeros, group: int, ids, a_row_div: int, out, routed_weights, tiles) -> None:
    """moe_gemv for INT4 experts (_int4_moe_gemv_kernel); K a multiple of group, group a multiple of 32."""
    pairs, n = out.shape
    k = qweight.shape[2] * 8
    assert a.stride(1) == 1 and qweight.stride(2) == 1 and out.stride(1) == 1
    assert scales.stride() == zeros.stride() and scales.stride(2) == 1 and k % group == 0 and group % 32 == 0
    block_n, block_k, warps = tiles or (INT4_TILES if a.is_cuda else INTERPRETER_INT4_TILES)
    block_k = max(32, min(block_k, triton.next_power_of_2(k)))
    _int4_moe_gemv_kernel[(pairs, triton.cdiv(n, block_n))](
        a,
        qweight,
        scales,
        zeros,
        ids,
        routed_weights if routed_weights is not None else out,
        out,
        n,
        k,
        a.stride(0),
        qweight.stride(0),
        qweight.stride(1),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        F16_BITS,
        A_ROW_DIV=a_row_div,
        MUL_ROUTED_WEIGHT=routed_weights is not None,
        GROUP=group,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
