"""Block-scaled FP8 products (DeepSeek-V3 / Qwen3-FP8 style) for layers/quantization/fp8_block.py.

The weight is float8_e4m3fn [N, K] with one float32 scale per [BN_S, BK_S] block (weight_scale_inv, [N/BN_S,
K/BK_S]). fp8_block_linear picks by the number of rows of x:
- up to GEMV_MAX_M rows (decode at batch 1, where reading the weight is the whole cost) the weight-only GEMV of
  kernels/gemv.py: x stays bf16, each block's scale multiplies x's inputs and each weight byte is widened exactly
  in registers (the batch-1 decode stack calls it with its norm prologue and SiLU epilogue);
- more rows: x quantized per token per BK_S-wide group (per_token_group_quant, scale amax/448), then a float8 GEMM:
  - from CUBLAS_MIN_M rows (CUBLAS_MIN_M_WIDE for wide layers), where torch has it (Hopper, 128x128 blocks tiling
    the weight), cuBLAS's block-scaled GEMM (F.scaled_mm, 1x128 and 128x128 scales): on an H200 it beat the Triton
    GEMM on Qwen2.5-7B's layers from 100-192 rows (from 48 on the wide gate/up layer), and bf16 from 192-512 rows
    (from 48 on gate/up: 1.4-1.6x) (benchmarks/tuning/quant_paths.py);
  - else the Triton GEMM, one K step a group, its tl.dot scaled by the row's and the block's scales and added in
    float32, K split over programs where its output tiles would leave SMs idle (fp8_block_gemm also has a
    weight-only form, a_scale None, which the fused MoE's few-token path shares);
- without cuBLAS's GEMM, from DEQUANT_MIN_M rows (prefill, compute-bound) the weight dequantized into a bf16 scratch
  (fp8_block_dequantize) and cuBLAS's bf16 GEMM: the Triton float8 GEMM ran at 0.4-0.5x of bf16 there.
Weight-only is the dequantized model's product (closer to it than the quantized path, which also rounds x).
Tile shapes: GEMM_CANDIDATES, ranked by benchmarks/tuning/fp8_block_tiles.py's H200 sweep (the GEMV's: kernels/gemv.py).
The torch references are fp8_block.quantize_groups, fp8_block.block_reference (x quantized) and
fp8_block.weight_only_reference.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from novainfer.kernels.gemv import gemv
from novainfer.kernels.tiling import even_split, grouped_tile, row_bucket, split_k


@triton.jit
def _quant_group(x, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Rows [R, G] of groups -> each row's scale [R] and its clamped quotients (float32; the caller casts)."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 1), FP8_MAX), MIN_SCALE)
    return scale, tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX)


@triton.jit
def _group_quant_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    K,
    stride_xm,
    stride_sm,
    stride_sg,
    G: tl.constexpr,
    GROUPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    grps = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # GROUPS groups of the row a program
    offs = grps[:, None] * G + tl.arange(0, G)[None, :]
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale, q = _quant_group(x, FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row * stride_sm + grps * stride_sg, scale, mask=grps < tl.cdiv(K, G))
    tl.store(out_ptr + row * K + offs, q.to(out_ptr.dtype.element_ty), mask=mask)


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
    stride_am,
    stride_cm,
    KB_PER_SPLIT,
    A_FP8: tl.constexpr,
    EVEN_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """A [BLOCK_M, BLOCK_N] output tile over the K groups [KB_PER_SPLIT * s, KB_PER_SPLIT * (s + 1)) of split s
    (program_id 1); SPLIT_K stores float32 partials at c + s * M * N for _split_sum_kernel."""
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mload = tl.minimum(offs_m, M - 1).to(tl.int64)  # edge tiles re-read the last row / column: no M, N masks
    nload = tl.minimum(offs_n, N - 1).to(tl.int64)
    k_groups = tl.cdiv(K, BLOCK_K)
    a_s_row = as_ptr + mload * k_groups
    b_s_row = bs_ptr + (nload // GROUP_N) * k_groups
    # BLOCK_N <= GROUP_N: the tile's columns share one weight scale a K step, so both scales are one per row
    b_s_tile = bs_ptr + (pid_n * BLOCK_N // GROUP_N) * k_groups
    kb_begin = tl.program_id(1) * KB_PER_SPLIT
    kb_end = tl.minimum(kb_begin + KB_PER_SPLIT, k_groups)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(kb_begin, kb_end):
        a_ptrs = a_ptr + mload[:, None] * stride_am + (kb * BLOCK_K + offs_k)[None, :]
        b_ptrs = b_ptr + nload[None, :] * K + (kb * BLOCK_K + offs_k)[:, None]
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = kb * BLOCK_K + offs_k < K
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        if A_FP8:  # both quantized: the float8 product, scaled by the row's group and the weight's block
            a_s = tl.load(a_s_row + kb)
            if BLOCK_N <= GROUP_N:
                acc += tl.dot(a, b) * (a_s * tl.load(b_s_tile + kb))[:, None]  # one FMA an element
            else:
                acc += tl.dot(a, b) * a_s[:, None] * tl.load(b_s_row + kb)[None, :]
        elif BLOCK_N <= GROUP_N:  # weight-only: x as it is (bf16), the weight's float8 widened exactly
            acc += tl.dot(a, b.to(a.dtype)) * tl.load(b_s_tile + kb)
        else:
            acc += tl.dot(a, b.to(a.dtype)) * tl.load(b_s_row + kb)[None, :]
    cmask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K:
        part = c_ptr + tl.program_id(1).to(tl.int64) * M * N
        tl.store(part + offs_m[:, None] * N + offs_n[None, :], acc, mask=cmask)
    else:
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, MN, SPLIT, BLOCK: tl.constexpr):
    """out = the sum of the SPLIT float32 partials [SPLIT, M, N], added in split order (a deterministic result)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
GEMV_MAX_M = 1  # up to this many rows fp8_block_linear takes the GEMV (kernels/gemv.py with the block scales)
WEIGHT_ONLY_MAX_M = 1  # the fused MoE's tokens up to which x stays bf16 (kernels/fused_moe_quant.py)
DEQUANT_MIN_M = 512  # from this many rows: the weight dequantized to bf16, then cuBLAS (no block-scaled cuBLAS)
CUBLAS_MIN_M = 128  # from this many rows: cuBLAS's block-scaled float8 GEMM, where torch runs it (Hopper)
CUBLAS_MIN_M_WIDE = 48  # the same for layers four times wider than deep (gate/up projections)

# (BLOCK_M, BLOCK_N, num_warps, num_stages, fill) of the GEMM by the row count's bucket; BLOCK_K is the scale
# block. fill > 0 splits K until the GPU has `fill` programs per SM (kernels/tiling.split_k): a product of few
# output tiles (decode batches on a narrow layer) otherwise leaves most SMs idle while a few stream the weight.
GEMM_CANDIDATES: dict[int, list[tuple[int, int, int, int, int]]] = {
    8: [(16, 128, 4, 4, 2), (16, 128, 4, 4, 1), (16, 128, 4, 5, 1), (16, 128, 4, 4, 4)],
    16: [(16, 32, 2, 4, 4), (16, 64, 4, 4, 2), (16, 128, 4, 4, 2), (16, 128, 4, 4, 1)],
    32: [(32, 128, 4, 4, 2), (16, 128, 4, 4, 2), (32, 64, 4, 4, 2), (16, 128, 4, 5, 2)],
    64: [(64, 128, 4, 4, 1), (64, 128, 4, 3, 1), (64, 64, 4, 4, 2), (64, 128, 4, 3, 2)],
    128: [(64, 128, 4, 4, 1), (64, 128, 4, 3, 1), (64, 128, 4, 4, 2), (64, 128, 4, 3, 2)],
    256: [(64, 128, 4, 4, 1), (64, 128, 4, 3, 1), (64, 128, 4, 4, 0), (64, 128, 4, 4, 2)],
    1 << 30: [(64, 128, 4, 4, 1), (64, 128, 4, 4, 0), (64, 128, 4, 3, 0), (64, 128, 4, 3, 1)],
}


def per_token_group_quant(
    x: torch.Tensor, group: int, out_dtype: torch.dtype = torch.float8_e4m3fn, m_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (quantized [M, K] in out_dtype, float32 scales [M, ceil(K / group)]); out_dtype float32
    returns the clamped quotients before the cast (the interpreter's float8 cast does not round as CUDA's);
    m_major stores the scales with M the unit stride, the layout cuBLAS's block-scaled GEMM reads."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    groups = triton.cdiv(k, group)
    out = torch.empty((m, k), dtype=out_dtype, device=x.device)
    if m_major:
        scale = torch.empty((groups, m), dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    per = 8  # groups a program: 8 KB of bf16 read, far fewer programs than one a group
    if m:
        _group_quant_kernel[(m, triton.cdiv(groups, per))](
            x,
            out,
            scale,
            k,
            x.stride(0),
            scale.stride(0),
            scale.stride(1),
            G=group,
            GROUPS=per,
            FP8_MAX=FP8_MAX,
            MIN_SCALE=MIN_SCALE,
            num_warps=4,
        )
    return out, scale


def fp8_block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
    tiles: tuple[int, int, int, int, int] | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """a [M, K] (unit stride along K) times weight [N, K] with its block scales: a quantized with its group scales
    a_scale, or (a_scale None) weight-only, a as it is. split: the K splits (None: the tile's fill rule)."""
    m, k = a.shape
    n = weight.shape[0]
    if a.is_cuda:
        block_m, block_n, warps, stages, fill = tiles or GEMM_CANDIDATES[row_bucket(m, GEMM_CANDIDATES)][0]
    else:
        block_m, block_n, warps, stages, fill = 16, 32, 4, 1, 0
    tiles_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_groups = triton.cdiv(k, block[1])
    if split is None:
        split = split_k(k, tiles_mn, block[1], a.device, fill)[0] if fill else 1
    split, per_split = even_split(k_groups, split, 1)  # per_split: K groups a split
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=a.device) if split > 1 else out
    _block_gemm_kernel[(tiles_mn, split)](
        a,
        a_scale if a_scale is not None else w_scale,
        weight,
        w_scale,
        part,
        m,
        n,
        k,
        a.stride(0),
        out.stride(0),
        per_split,
        A_FP8=a_scale is not None,
        EVEN_K=k % block[1] == 0,
        GROUP_N=block[0],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block[1],
        GROUP_M=8,
        SPLIT_K=split > 1,
        num_warps=warps,
        num_stages=stages,
    )
    if split > 1:
        _split_sum_kernel[(triton.cdiv(m * n, 1024),)](part, out, m * n, split, BLOCK=1024)
    return out


@triton.jit
def _block_dequant_kernel(
    w_ptr, ws_ptr, out_ptr, N, K, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK: tl.constexpr
):
    """One [GROUP_N, BLOCK] tile a program (BLOCK a multiple of GROUP_K): float8 times its block's scale."""
    rows = tl.program_id(0) * GROUP_N + tl.arange(0, GROUP_N)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    s = tl.load(ws_ptr + tl.program_id(0) * tl.cdiv(K, GROUP_K) + cols // GROUP_K, mask=cols < K, other=0.0)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * s[None, :]
    tl.store(out_ptr + offs, w.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_block_dequantize(weight: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype):
    """The block-scaled weight as a dense [N, K] tensor of dtype."""
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    width = block[1] * max(1, 1024 // block[1])
    _block_dequant_kernel[(triton.cdiv(n, block[0]), triton.cdiv(k, width))](
        weight, w_scale, out, n, k, GROUP_N=block[0], GROUP_K=block[1], BLOCK=width
    )
    return out


@lru_cache(maxsize=None)
def _cublas_block_scaled(index: int) -> bool:
    """Whether cuBLAS's 1x128 / 128x128 block-scaled float8 GEMM is there: torch's F.scaled_mm on a Hopper GPU."""
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType") and torch.cuda.get_device_capability(index)[0] == 9


def cublas_block_gemm(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the 128x128 block-scaled weight by cuBLAS: x quantized per 128-wide group (scales M-major),
    the same product as fp8_block_gemm's quantized form. cuBLAS takes a multiple of 4 rows (16-byte scale columns):
    other counts are padded with rows it computes and we drop (rows are independent)."""
    m = x.shape[0]
    pad = -m % 4
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    a, a_scale = per_token_group_quant(x, 128, m_major=True)
    st = F.ScalingType
    y = F.scaled_mm(a, weight.t(), a_scale, st.BlockWise1x128, w_scale.t(), st.BlockWise128x128, output_dtype=x.dtype)
    return y[:m] if pad else y


def takes_cublas(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """cuBLAS's block-scaled GEMM serves this product: enough rows (CUBLAS_MIN_M, or CUBLAS_MIN_M_WIDE for a layer
    at least four times wider than deep, whose many output tiles fill the GPU early), 128x128 blocks that tile the
    weight whole with a multiple of 4 along K (cuBLAS's scale layout), a GPU where it runs."""
    n, k = weight.shape
    m = x.shape[0]
    return (
        (m >= CUBLAS_MIN_M or (m >= CUBLAS_MIN_M_WIDE and n >= 4 * k))
        and x.is_cuda
        and block == (128, 128)
        and n % 128 == 0
        and k % 512 == 0
        and _cublas_block_scaled(x.device.index if x.device.index is not None else torch.cuda.current_device())
    )


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int]):
    """x [M, K] (contiguous) times the block-scaled weight -> [M, N] in x's dtype: the weight-only GEMV (x as it is)
    up to GEMV_MAX_M rows, where reading the weight is the cost; x quantized per group and the float8 GEMM above:
    cuBLAS's block-scaled one from CUBLAS_MIN_M rows where it runs, else ours, and from DEQUANT_MIN_M rows the
    dequantized weight and cuBLAS's bf16 GEMM."""
    m = x.shape[0]
    if m <= GEMV_MAX_M:
        return gemv(x, weight, weight_scale=w_scale, block=block)
    if takes_cublas(x, weight, block):
        return cublas_block_gemm(x, weight, w_scale)
    if m >= DEQUANT_MIN_M:
        return torch.nn.functional.linear(x, fp8_block_dequantize(weight, w_scale, block, x.dtype))
    return fp8_block_gemm(*per_token_group_quant(x, block[1]), weight, w_scale, block, x.dtype)
