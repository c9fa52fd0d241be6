"""Block-scaled FP8 products (DeepSeek-V3 / Qwen3-FP8 style) for layers/quantization/fp8_block.py.

The weight is float8_e4m3fn [N, K] with one float32 scale per [BN_S, BK_S] block (weight_scale_inv, [N/BN_S,
K/BK_S]); activations are quantized per token per BK_S-wide group at run time (scale amax/448). One K step of
the GEMM is one group: its float8 tl.dot is scaled by the row's and the block's scales and added in float32.

per_token_group_quant: x [M, K] -> float8 [M, K] and float32 scales [M, K/BK_S] (one program per row and group).
fp8_block_gemm: the prefill/batched product of the quantized x and the weight.
fp8_block_gemv: decode (a few rows); reads each weight byte once for all rows, quantizing x's groups in registers
exactly as per_token_group_quant does, so both paths give the same product.
The torch references are fp8_block.quantize_groups and fp8_block.block_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.kernels.tiling import grouped_tile, split_k


@triton.jit
def _quant_group(x, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Rows [R, G] of groups -> each row's scale [R] and its clamped quotients (float32; the caller casts)."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 1), FP8_MAX), MIN_SCALE)
    return scale, tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX)


@triton.jit
def _group_quant_kernel(
    x_ptr, out_ptr, scale_ptr, K, stride_xm, G: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    offs = grp * G + tl.arange(0, G)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale, q = _quant_group(x[None, :], FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row * tl.cdiv(K, G) + grp + tl.arange(0, 1), scale)
    tl.store(out_ptr + row * K + offs[None, :], q.to(out_ptr.dtype.element_ty), mask=mask[None, :])


@triton.jit
def _block_gemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_cm,
    GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask, nmask = offs_m < M, offs_n < N
    k_groups = tl.cdiv(K, BLOCK_K)
    a_s_row = as_ptr + offs_m * k_groups
    b_s_row = bs_ptr + (offs_n // GROUP_N) * k_groups
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, k_groups):
        kmask = kb * BLOCK_K + offs_k < K
        a = tl.load(
            a_ptr + offs_m[:, None] * K + (kb * BLOCK_K + offs_k)[None, :],
            mask=mmask[:, None] & kmask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + offs_n[None, :] * K + (kb * BLOCK_K + offs_k)[:, None],
            mask=kmask[:, None] & nmask[None, :],
            other=0.0,
        )
        a_s = tl.load(a_s_row + kb, mask=mmask, other=0.0)
        b_s = tl.load(b_s_row + kb, mask=nmask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], c, mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _block_gemv_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    K_PER_SPLIT,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    GROUP_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mrows = tl.arange(0, M_PAD)
    nmask = offs_n < N
    k_groups = tl.cdiv(K, BLOCK_K)
    k_begin = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):  # the weight tile and its scales are loaded once for all M rows
        kmask = k0 + offs_k < K
        xmask = (mrows < M)[:, None] & kmask[None, :]
        x = tl.load(x_ptr + mrows[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=xmask, other=0.0)
        x_s, xq = _quant_group(x.to(tl.float32), FP8_MAX, MIN_SCALE)
        xq = xq.to(w_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(
            w_ptr + offs_n[:, None] * K + (k0 + offs_k)[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0
        ).to(tl.float32)
        w_s = tl.load(ws_ptr + (offs_n // GROUP_N) * k_groups + k0 // BLOCK_K, mask=nmask, other=0.0)
        for m in tl.static_range(M):
            pick = mrows == m
            xq_m = tl.sum(tl.where(pick[:, None], xq, 0.0), 0)
            x_s_m = tl.sum(tl.where(pick, x_s, 0.0), 0)
            part = tl.sum(w * xq_m[None, :], axis=1) * (w_s * x_s_m)
            acc += tl.where(pick[:, None], part[None, :], 0.0)
    omask = (mrows < M)[:, None] & nmask[None, :]
    tl.atomic_add(out_ptr + mrows[:, None] * N + offs_n[None, :], acc, mask=omask)


FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
GEMV_MAX_M = 4


def per_token_group_quant(x: torch.Tensor, group: int, out_dtype: torch.dtype = torch.float8_e4m3fn):
    """x [M, K] -> (quantized [M, K] in out_dtype, float32 scales [M, ceil(K / group)]); out_dtype float32
    returns the clamped quotients before the cast (the interpreter's float8 cast does not round as CUDA's)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    groups = triton.cdiv(k, group)
    out = torch.empty((m, k), dtype=out_dtype, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _group_quant_kernel[(m, groups)](
            x, out, scale, k, x.stride(0), G=group, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, num_warps=1
        )
    return out, scale


def fp8_block_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Quantized x [M, K] (contiguous) with its group scales times weight [N, K] with its block scales."""
    m, k = xq.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if xq.is_cuda:
        if m <= 32:  # few rows: narrow N tiles so that enough programs run; many: large tiles
            block_m, block_n, warps, stages = 16, 64, 4, 4
        elif m <= 256:
            block_m, block_n, warps, stages = 64, 128, 4, 3
        else:
            block_m, block_n, warps, stages = 128, 128, 8, 3
    else:
        block_m, block_n, warps, stages = 16, 32, 4, 1
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _block_gemm_kernel[grid](
        xq,
        x_scale,
        weight,
        w_scale,
        out,
        m,
        n,
        k,
        out.stride(0),
        GROUP_N=block[0],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block[1],
        GROUP_M=8,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def fp8_block_gemv(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int]):
    """x [M, K] (M <= GEMV_MAX_M, unquantized) times the block-scaled weight -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    block_n = 32 if x.is_cuda else 16
    tiles_n = triton.cdiv(n, block_n)
    split, k_per_split = split_k(k, tiles_n, block[1], x.device, programs_per_sm=4)
    out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    _block_gemv_kernel[(tiles_n, split)](
        x,
        weight,
        w_scale,
        out,
        n,
        k,
        x.stride(0),
        k_per_split,
        M=m,
        M_PAD=triton.next_power_of_2(m),
        GROUP_N=block[0],
        BLOCK_N=block_n,
        BLOCK_K=block[1],
        FP8_MAX=FP8_MAX,
        MIN_SCALE=MIN_SCALE,
        num_warps=4,
    )
    return out.to(x.dtype)
