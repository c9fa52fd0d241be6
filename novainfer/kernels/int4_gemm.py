"""INT4 weight-only (W4A16) products on the GPU for layers/quantization/int4.py.

The one layout every INT4 checkpoint (GPTQ, AWQ, compressed-tensors pack-quantized) is repacked to at load:
- qweight int32 [K/8, N]: word (i, n) holds the 4-bit codes of input rows 8i..8i+7 of output column n, row 8i+j
  in bits 4j..4j+3 (GPTQ's packing: a tile of rows x columns is one coalesced load along N);
- scales [K/G, N] (any float dtype; GPTQ / AWQ store float16) and zeros [K/G, N] (uint8 zero points 0..15):
  w[k, n] = (code - zeros[k // G, n]) * scales[k // G, n].
An act-order (GPTQ desc_act) checkpoint's rows are sorted by group at load; the layer gathers x's columns
in the same order before calling these kernels.

int4_gemv: decode (a few rows of x); each program reads its [K-slice, N-tile] of codes once for all rows of x,
split over K so that a 7B's narrow layers still fill the GPU, partial sums added in float32 (atomics).
int4_gemm: prefill; a tile of codes is unpacked and dequantized in registers, then one tl.dot per K step.
The torch reference is int4.dequantize_int4 followed by a matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.kernels.tiling import grouped_tile, split_k


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    K_PER_SPLIT,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    mrows = tl.arange(0, M_PAD)
    rows8 = tl.arange(0, BLOCK_K // 8)  # word rows of one K step
    k_begin = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):  # each word, scale and zero is loaded once for all M rows
        wrow = k0 // 8 + rows8
        wmask = (wrow * 8 < k_end)[:, None] & nmask[None, :]
        q = tl.load(q_ptr + wrow[:, None] * N + offs_n[None, :], mask=wmask, other=0)
        g = (wrow * 8) // GROUP
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=wmask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=wmask, other=0).to(tl.float32)
        # sum_k x_k (code_k - z) s = s (sum_k x_k code_k - z sum_k x_k): the zero point once per word row
        part = tl.zeros([M_PAD, BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
        xsum = tl.zeros([M_PAD, BLOCK_K // 8], dtype=tl.float32)
        for j in tl.static_range(8):
            xk = wrow * 8 + j
            xmask = (mrows < M)[:, None] & (xk < k_end)[None, :]
            xj = tl.load(x_ptr + mrows[:, None] * stride_xm + xk[None, :], mask=xmask, other=0.0).to(tl.float32)
            part += xj[:, :, None] * ((q >> (4 * j)) & 0xF).to(tl.float32)[None, :, :]
            xsum += xj
        acc += tl.sum((part - xsum[:, :, None] * z[None, :, :]) * s[None, :, :], axis=1)
    omask = (mrows < M)[:, None] & nmask[None, :]
    tl.atomic_add(out_ptr + mrows[:, None] * N + offs_n[None, :], acc, mask=omask)


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    GROUP: tl.constexpr,
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
    rows8 = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    mmask, nmask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides GROUP and K: one scale row per step, no K mask
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=mmask[:, None], other=0.0)
        q = tl.load(q_ptr + (k0 // 8 + rows8)[:, None] * N + offs_n[None, :], mask=nmask[None, :], other=0)
        codes = (q[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]: row 8i + j
        codes = tl.reshape(codes, [BLOCK_K, BLOCK_N])
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + offs_n, mask=nmask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + offs_n, mask=nmask, other=0).to(tl.float32)
        w = ((codes.to(tl.float32) - z[None, :]) * s[None, :]).to(a.dtype)
        acc = tl.dot(a, w, acc)
    c = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], c, mask=mmask[:, None] & nmask[None, :])


GEMV_MAX_M = 4  # up to this many rows of x go through the GEMV (one read of the codes for all rows)


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int):
    """x [M, K] (M <= GEMV_MAX_M, unit stride along K) times the packed weight -> [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    block_n, block_k = (128, 128) if x.is_cuda else (32, 32)
    tiles_n = triton.cdiv(n, block_n)
    split, k_per_split = split_k(k, tiles_n, block_k, x.device, programs_per_sm=2)
    out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    _int4_gemv_kernel[(tiles_n, split)](
        x,
        qweight,
        scales,
        zeros,
        out,
        n,
        k,
        x.stride(0),
        k_per_split,
        M=m,
        M_PAD=triton.next_power_of_2(m),
        GROUP=group,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4 if m <= 2 else 8,
    )
    return out.to(x.dtype)


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int):
    """x [M, K] (unit stride along K) times the packed weight -> [M, N] in x's dtype (K a multiple of 32)."""
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if x.is_cuda:  # few rows: narrow N tiles so that enough programs run; many: large tiles for the tensor cores
        if m <= 16:
            block_m, block_n, block_k, warps, stages = 16, 64, 128, 4, 4
        elif m <= 128:
            block_m, block_n, block_k, warps, stages = 64, 128, 64, 4, 4
        else:
            block_m, block_n, block_k, warps, stages = 128, 128, 64, 8, 3
    else:
        block_m, block_n, block_k, warps, stages = 16, 32, 32, 4, 1
    block_k = min(block_k, group)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _int4_gemm_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        num_warps=warps,
        num_stages=stages,
    )
    return out
