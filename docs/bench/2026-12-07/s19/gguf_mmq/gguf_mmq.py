"""The int8 tensor-core GEMM for GGUF weights on the GPU at 2-256 rows, measured on 2026-12-07 and not merged
(README.md beside this file): x quantized per 32 inputs by gguf_gemm.quantize_q8 (as the one-row GEMV does), one
group of 32 inputs a loop step, the group's quants unpacked from the repacked words into an int8 [BLOCK_N, 32] tile,
one integer wgmma against x's int8 [32, BLOCK_M] (Q6_K: two, one per half-group scale), the float32 scales applied to
the exact integer sums. Correct (interpreter and GPU: rel err 1.7e-3 against the int8-x reference), but 3-6x slower
than dequantizing the layer into bf16 and cuBLAS on an H200. Imports the package's helpers; run under
TRITON_INTERPRET=1 on the CPU or on a GPU:

    PYTHONPATH=<a tree> python -c "import runpy; m = runpy.run_path('gguf_mmq.py'); ..."
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.kernels.gguf_gemm import Q8, GGUFWeight, _group_scales, _q8_words, q8_operands, quantize_q8
from novainfer.kernels.tiling import row_bucket

# gguf_mmq's (BLOCK_M, BLOCK_N, num_warps, num_stages) by the rows of x (up to the key); MMQ_CANDIDATES are what
# benchmarks/gguf_gpu.py sweeps
MMQ_TILES: dict[int, tuple[int, int, int, int]] = {16: (16, 64, 4, 4), 32: (32, 64, 4, 4), 1 << 30: (64, 64, 4, 4)}
MMQ_CANDIDATES: list[tuple[int, int, int, int]] = [
    (16, 64, 4, 4),
    (16, 128, 4, 4),
    (32, 64, 4, 4),
    (32, 128, 4, 4),
    (64, 64, 4, 4),
    (64, 128, 8, 4),
    (128, 64, 4, 4),
    (32, 64, 4, 2),
]


@triton.jit
def _gguf_mmq_kernel(
    xq_ptr,
    dx_ptr,
    sx_ptr,
    q_ptr,
    d_ptr,
    sc_ptr,
    dm_ptr,
    mn_ptr,
    h_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_qn,
    stride_hn,
    stride_om,
    Q4: tl.constexpr,
    HB: tl.constexpr,
    HALF: tl.constexpr,
    SUB: tl.constexpr,
    OFF: tl.constexpr,
    HAS_SC: tl.constexpr,
    HAS_DM: tl.constexpr,
    HAS_MN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out [M, N] = x w^T over x quantized by quantize_q8, one group of 32 inputs a step: the group's quants as an
    int8 [BLOCK_N, 32] tile times x's int8 [32, BLOCK_M] in one integer tensor-core dot (exact), then
    scale * dx * dot + zero * sx in float32, as _gemv_q8_rows does per row (llama.cpp's MMQ in Triton)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rload = tl.minimum(rows, N - 1).to(tl.int64)  # edge tiles re-read the last row / column: unmasked loads
    mload = tl.minimum(ms, M - 1).to(tl.int64)
    col = tl.arange(0, 32)
    ng = K // 32
    one = tl.arange(0, 1)
    word = tl.arange(0, 4)
    byte = (8 * tl.arange(0, 4))[None, None, :]
    # a group's tile in the order the word form gives: position 8 w + 2 j + h holds input 4 w + j + 16 h (byte j of
    # word w of the low (h = 0) or the high half); x's rows are gathered in the same order
    x_ptrs = xq_ptr + mload[None, :] * K + ((col // 2) + 16 * (col % 2))[:, None]  # x transposed: [32, BLOCK_M]
    # out transposed, as _gguf_gemm_kernel's: the weight tile is the dot's left operand (wgmma reads it from
    # registers) and few rows of x fill the narrow side
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for g in range(0, ng):
        gmask = (g + one < ng)[None, :, None]
        lo, hi = _q8_words(q_ptr, h_ptr, rload, one, word, g * 32, stride_qn, stride_hn, gmask, Q4, HB)
        lo = (tl.reshape(lo, [BLOCK_N, 4])[:, :, None] >> byte) & 0xFF
        hi = (tl.reshape(hi, [BLOCK_N, 4])[:, :, None] >> byte) & 0xFF
        xt = tl.load(x_ptrs + g * 32)
        dx = tl.load(dx_ptr + mload * ng + g)[None, :]
        s_lo, z_lo, s_hi, z_hi = _group_scales(
            d_ptr, sc_ptr, dm_ptr, mn_ptr, rload, g + one, K, HALF, SUB, HAS_SC, HAS_DM, HAS_MN
        )
        if HALF:  # the low and the high halves have their own scales: two dots, each with the other half zero
            w_lo = tl.reshape(tl.join(lo, tl.zeros_like(lo)), [BLOCK_N, 32]).to(tl.int8)
            w_hi = tl.reshape(tl.join(tl.zeros_like(hi), hi), [BLOCK_N, 32]).to(tl.int8)
            acc += tl.dot(w_lo, xt, out_dtype=tl.int32).to(tl.float32) * (s_lo * dx)
            acc += tl.dot(w_hi, xt, out_dtype=tl.int32).to(tl.float32) * (s_hi * dx)
        else:
            w = tl.reshape(tl.join(lo, hi), [BLOCK_N, 32]).to(tl.int8)
            acc += tl.dot(w, xt, out_dtype=tl.int32).to(tl.float32) * (s_lo * dx)
        sx_lo = tl.load(sx_ptr + mload * (2 * ng) + 2 * g)[None, :]
        sx_hi = tl.load(sx_ptr + mload * (2 * ng) + 2 * g + 1)[None, :]
        if HALF:
            acc += (z_lo - OFF * s_lo) * sx_lo + (z_hi - OFF * s_hi) * sx_hi
        elif HAS_DM or OFF != 0:  # one zero a group: x's sum over the whole group
            acc += (z_lo - OFF * s_lo) * (sx_lo + sx_hi)
    mask = (rows < N)[:, None] & (ms < M)[None, :]
    tl.store(out_ptr + ms[None, :] * stride_om + rows[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


def gguf_mmq(
    x: torch.Tensor,
    w: GGUFWeight,
    out: torch.Tensor | None = None,
    q8: Q8 | None = None,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] times w^T -> out [M, N] (x's dtype; out may be a column slice of a wider output) on int8 tensor-core
    dots over x quantized per 32 inputs (q8: quantize_q8 of x's rows, shared by a fused layer's parts)."""
    m, k = x.shape
    n = w.shape[0]
    assert k == w.shape[1], (x.shape, w.shape)
    xq, dx, sx = q8 if q8 is not None else quantize_q8(x.reshape(1, -1))
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n, warps, stages = tiles or mmq_tiles(m, x.is_cuda)
    words, strides, consts = q8_operands(w)
    _gguf_mmq_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        xq,
        dx,
        sx,
        *words,
        out,
        m,
        n,
        k,
        *strides,
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
        num_stages=stages,
        **consts,
    )
    return out


def mmq_tiles(m: int, cuda: bool = True) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of gguf_mmq for m rows of x: x's rows in one tile up to 64."""
    if not cuda:
        return 16, 16, 4, 1  # the interpreter: small tiles
    return MMQ_TILES[row_bucket(m, MMQ_TILES)]
