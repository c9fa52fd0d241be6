"""INT4 weight-only (W4A16) products on the GPU for layers/quantization/int4.py.

The one layout every INT4 checkpoint (GPTQ, AWQ, compressed-tensors pack-quantized) is repacked to at load, row
major like a bf16 weight so that a decode GEMV reads each output row's codes contiguously along K:
- qweight int32 [N, K/8]; each 32 inputs of a row are four words, and nibble j of word w (0..3) of the four holds
  input 4j + w. A thread's one 16-byte load (four words) thus unpacks, nibble by nibble, to four CONSECUTIVE
  inputs, whose activations are one vector load too;
- scales [N, K/G] (any float dtype; GPTQ / AWQ store float16) and zeros [N, K/G] (uint8 zero points 0..15):
  w[n, k] = (code - zeros[n, k // G]) * scales[n, k // G].
Why not GPTQ's [K/8, N]: a GEMV over it must split K over programs to have enough of them for a narrow layer, so
its partial sums need a zeroed float32 buffer, atomics and a cast (three kernels a layer); here a program takes a
few whole rows, sums over all of K in registers and stores the result (one kernel), and a 7B's 3584-row layers
still make ~900 programs. The prefill GEMM reads the same tiles transposed.
Codes become floats without an int-to-float conversion (a quarter-rate instruction): code | 0x4B000000 read as a
float32 is 2^23 + code, and one subtraction of 2^23 + zero leaves code - zero exactly.
An act-order (GPTQ desc_act) checkpoint's inputs are sorted by group at load; the layer gathers x's columns in the
same order before calling these kernels.

int4_gemv: a few rows of x (decode); a program reads BLOCK_N whole weight rows once for all rows of x.
int4_gemm: more rows; a tile of codes is unpacked in registers and multiplied as the left operand of one tl.dot per
K step (out^T = W x^T: Hopper's wgmma reads a left operand from registers, and x's few rows fill the narrow side),
split over K (float32 atomics) where the output tiles alone would leave SMs idle.
int4_linear picks: the GEMV up to GEMV_MAX_M rows, the GEMM up to DEQUANT_MIN_M - 1, and from DEQUANT_MIN_M rows
(prefill, where the product is compute-bound) int4_dequantize into a bf16 scratch weight and cuBLAS: the unpacking
is then paid once per weight, not once per BLOCK_M rows, and the tensor cores run cuBLAS's tuned bf16 GEMM.
Tile shapes: GEMV_TILES / GEMM_TILES, candidates benchmarks/quant_gpu.py sweeps on a GPU. The torch reference is
int4.dequantize_int4 followed by a matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.kernels.tiling import even_split, grouped_tile, row_bucket, split_k

MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2^23: OR-ing a code 0..15 into the mantissa gives 2^23 + code


@triton.jit
def _codes(q, j: tl.constexpr, zoff):
    """Nibble j of each word as float32, minus its zero point (zoff = 2^23 + zero): exact small integers."""
    return (((q >> (4 * j)) & 0xF) | MAGIC).to(tl.float32, bitcast=True) - zoff


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    K,
    stride_qn,
    stride_xm,
    stride_om,
    M: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    C: tl.constexpr = BLOCK_K // 32  # 32-input chunks (four words) a step
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rload = tl.minimum(rows, N - 1).to(tl.int64)  # the last tile re-reads row N - 1: no masks on the loads
    chunk = tl.arange(0, C)
    lane = tl.arange(0, 4)
    q_ptrs = q_ptr + rload[:, None, None] * stride_qn + (chunk[:, None] * 4 + lane[None, :])[None, :, :]
    sz_row = rload[:, None] * (K // GROUP)
    # [BLOCK_N, C, 4]: input of nibble 0 of each word, the same for every row: x is loaded in the weight tile's own
    # layout (a [C, 4] load would be converted into it through shared memory, eight times a step)
    x_k = (chunk[:, None] * 32 + lane[None, :])[None, :, :] + 0 * rows[:, None, None]
    acc0 = tl.zeros([BLOCK_N, C], tl.float32)
    acc1 = tl.zeros([BLOCK_N, C], tl.float32)
    acc2 = tl.zeros([BLOCK_N, C], tl.float32)
    acc3 = tl.zeros([BLOCK_N, C], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        grp = sz_row + ((k0 + chunk * 32) // GROUP)[None, :]
        if EVEN_K:
            q = tl.load(q_ptrs + k0 // 8, eviction_policy="evict_first")
            s = tl.load(s_ptr + grp).to(tl.float32)
            zoff = (tl.load(z_ptr + grp).to(tl.float32) + 8388608.0)[:, :, None]
        else:  # K is a multiple of 32: the tail step masks whole chunks (their x and scales read as 0)
            cmask = (k0 + chunk * 32 < K)[None, :]
            q = tl.load(q_ptrs + k0 // 8, mask=cmask[:, :, None], other=0, eviction_policy="evict_first")
            s = tl.load(s_ptr + grp, mask=cmask, other=0.0).to(tl.float32)
            zoff = (tl.load(z_ptr + grp, mask=cmask, other=0).to(tl.float32) + 8388608.0)[:, :, None]
        p0 = tl.zeros([BLOCK_N, C, 4], tl.float32)
        p1 = tl.zeros([BLOCK_N, C, 4], tl.float32)
        p2 = tl.zeros([BLOCK_N, C, 4], tl.float32)
        p3 = tl.zeros([BLOCK_N, C, 4], tl.float32)
        xmask = k0 + x_k < K  # all true but in the tail step
        for j in tl.static_range(8):
            w = _codes(q, j, zoff)
            xj = x_ptr + k0 + 4 * j + x_k
            if EVEN_K:
                p0 += tl.load(xj).to(tl.float32) * w
                if M > 1:
                    p1 += tl.load(xj + stride_xm).to(tl.float32) * w
                if M > 2:
                    p2 += tl.load(xj + 2 * stride_xm).to(tl.float32) * w
                if M > 3:
                    p3 += tl.load(xj + 3 * stride_xm).to(tl.float32) * w
            else:
                p0 += tl.load(xj, mask=xmask, other=0.0).to(tl.float32) * w
                if M > 1:
                    p1 += tl.load(xj + stride_xm, mask=xmask, other=0.0).to(tl.float32) * w
                if M > 2:
                    p2 += tl.load(xj + 2 * stride_xm, mask=xmask, other=0.0).to(tl.float32) * w
                if M > 3:
                    p3 += tl.load(xj + 3 * stride_xm, mask=xmask, other=0.0).to(tl.float32) * w
        acc0 += tl.sum(p0, 2) * s  # a chunk lies in one group: its scale once per 32 inputs
        if M > 1:
            acc1 += tl.sum(p1, 2) * s
        if M > 2:
            acc2 += tl.sum(p2, 2) * s
        if M > 3:
            acc3 += tl.sum(p3, 2) * s
    dt = out_ptr.dtype.element_ty
    omask = rows < N
    tl.store(out_ptr + rows, tl.sum(acc0, 1).to(dt), mask=omask)
    if M > 1:
        tl.store(out_ptr + stride_om + rows, tl.sum(acc1, 1).to(dt), mask=omask)
    if M > 2:
        tl.store(out_ptr + 2 * stride_om + rows, tl.sum(acc2, 1).to(dt), mask=omask)
    if M > 3:
        tl.store(out_ptr + 3 * stride_om + rows, tl.sum(acc3, 1).to(dt), mask=omask)


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
    stride_qn,
    stride_xm,
    stride_om,
    K_PER_SPLIT,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr,
):
    C: tl.constexpr = BLOCK_K // 32
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mload = tl.minimum(offs_m, M - 1).to(tl.int64)  # edge tiles re-read the last row/column: unmasked loads
    nload = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    # a step's words as [BLOCK_N, BLOCK_K / 8], contiguous along K (coalesced); split to [BLOCK_N, C, 1, 4] and
    # unpacked by the nibble index j on axis 2, input c * 32 + 4 j + w is column k of the tile
    q_ptrs = q_ptr + nload[:, None] * stride_qn + tl.arange(0, BLOCK_K // 8)[None, :]
    xt_ptrs = x_ptr + mload[None, :] * stride_xm + offs_k[:, None]  # x transposed: [BLOCK_K, BLOCK_M]
    shifts = (tl.arange(0, 8) * 4)[None, None, :, None]
    sz_col = nload * (K // GROUP)
    k_begin = tl.program_id(1) * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    # out transposed: the dequantized weight tile is the dot's left operand, which Hopper's wgmma takes from
    # registers (a right operand would go through shared memory first), and few rows of x fill the narrow side
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):  # BLOCK_K divides GROUP and K: one scale column per step, no K mask
        xt = tl.load(xt_ptrs + k0)
        q = tl.reshape(tl.load(q_ptrs + k0 // 8), [BLOCK_N, C, 1, 4])
        codes = tl.reshape(((q >> shifts) & 0xF) | MAGIC, [BLOCK_N, BLOCK_K]).to(tl.float32, bitcast=True)
        g = k0 // GROUP
        s = tl.load(s_ptr + sz_col + g).to(tl.float32)
        zoff = tl.load(z_ptr + sz_col + g).to(tl.float32) + 8388608.0
        # code - zero (-15..15) is exact in xt's dtype: the products sum exactly, the scale multiplies their sum
        acc += tl.dot((codes - zoff[:, None]).to(xt.dtype), xt) * s[:, None]
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    if SPLIT > 1:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_dequant_kernel(q_ptr, s_ptr, z_ptr, out_ptr, K, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row's BLOCK_K inputs a program: codes [BLOCK_K / 8] words -> (code - zero) * scale in out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    C: tl.constexpr = BLOCK_K // 32
    chunk = k0 + tl.arange(0, C)[:, None, None] * 32  # the first input of each chunk
    # a row's last step may reach past K (BLOCK_K need not divide it): every load is masked, or the last row's
    # would read past the tensor's end (an illegal address on a GPU)
    q = tl.load(q_ptr + row * (K // 8) + chunk // 8 + tl.arange(0, 4)[None, None, :], mask=chunk < K, other=0)
    j = tl.arange(0, 8)[None, :, None]
    # input c * 32 + 4 j + w is nibble j of word w of chunk c
    k = chunk + 4 * j + tl.arange(0, 4)[None, None, :]
    grp = row * (K // GROUP) + k // GROUP
    zoff = tl.load(z_ptr + grp, mask=k < K, other=0).to(tl.float32) + 8388608.0
    codes = (((q >> (4 * j)) & 0xF) | MAGIC).to(tl.float32, bitcast=True) - zoff
    w = codes * tl.load(s_ptr + grp, mask=k < K, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * K + k, w.to(out_ptr.dtype.element_ty), mask=k < K)


GEMV_MAX_M = 4  # up to this many rows of x go through the GEMV (one read of the codes for all rows)
DEQUANT_MIN_M = 128  # from this many rows: dequantize into a scratch weight, then cuBLAS (w4_gemm_tiles.py measures)

# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMV. A step loads BLOCK_N * BLOCK_K / 2 bytes, a 16-byte vector
# or more per thread; all programs together have N * BLOCK_K / 2 bytes in flight, which must cover HBM's latency
# (~3-4 MB on an H200) even for a 3584-row layer: hence long K steps (a masked tail where BLOCK_K does not divide K).
# GEMV_TILES is by (N, K): the best of benchmarks/tuning/gemv_variants.py's sweep on an H200 (Qwen2.5-7B's layers,
# 2026-11-27); other shapes take GEMV_DEFAULT; GEMV_CANDIDATES are what benchmarks/quant_gpu.py sweeps
GEMV_CANDIDATES: list[tuple[int, int, int, int]] = [
    (8, 1024, 4, 3),
    (4, 1024, 4, 1),
    (4, 2048, 8, 1),
    (4, 512, 2, 1),
    (8, 512, 4, 3),
    (16, 1024, 8, 3),
]
GEMV_DEFAULT = (4, 1024, 4, 1)
GEMV_TILES: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (4608, 3584): (4, 2048, 8, 1),
    (3584, 3584): (4, 2048, 8, 3),
    (37888, 3584): (4, 512, 2, 1),
    (3584, 18944): (4, 1024, 4, 1),
}

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMM by the row count's bucket (BLOCK_K is capped at
# the group size); split-K fills the GPU where the output tiles cannot. The decode buckets are the best of
# benchmarks/tuning/w4_gemm_tiles.py's H200 sweep on Qwen2.5-7B's layers (2026-11-27)
GEMM_CANDIDATES: dict[int, list[tuple[int, int, int, int, int]]] = {
    16: [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 64, 4, 5)],
    32: [(32, 64, 128, 4, 4), (32, 128, 128, 4, 4)],
    127: [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4)],
    # prefill: a weight tile is dequantized once per BLOCK_M rows, so tall tiles amortize the unpacking
    1 << 30: [(128, 128, 64, 8, 3), (256, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3)],
}


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_M, unit stride along K) times the packed weight -> [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    assert m <= GEMV_MAX_M and x.stride(1) == 1, x.shape
    if tiles is None and not x.is_cuda:
        tiles = (4, 64, 4, 1)  # the interpreter: small tiles
    block_n, block_k, warps, stages = tiles or GEMV_TILES.get((n, k), GEMV_DEFAULT)
    block_k = min(block_k, triton.next_power_of_2(k))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _int4_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        qweight,
        scales,
        zeros,
        out,
        n,
        k,
        qweight.stride(0),
        x.stride(0),
        out.stride(0),
        M=m,
        GROUP=group,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    tiles: tuple[int, int, int, int, int] | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """x [M, K] (unit stride along K) times the packed weight -> [M, N] in x's dtype (K a multiple of 32); split:
    the K splits (None: as many as fill the GPU's SMs once with programs)."""
    m, k = x.shape
    n = qweight.shape[0]
    if x.is_cuda:
        block_m, block_n, block_k, warps, stages = tiles or GEMM_CANDIDATES[row_bucket(m, GEMM_CANDIDATES)][0]
    else:
        block_m, block_n, block_k, warps, stages = 16, 32, 32, 4, 1
    block_k = min(block_k, group)
    tiles_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split is None:
        split, per_split = split_k(k, tiles_mn, block_k, x.device, programs_per_sm=1)
    else:
        split, per_split = even_split(k, split, block_k)
    if split > 1:
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _int4_gemm_kernel[(tiles_mn, split)](
        x,
        qweight,
        scales,
        zeros,
        out,
        m,
        n,
        k,
        qweight.stride(0),
        x.stride(0),
        out.stride(0),
        per_split,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        SPLIT=split,
        num_warps=warps,
        num_stages=stages,
    )
    return out if split == 1 else out.to(x.dtype)


def int4_dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """The packed weight as a dense [N, K] tensor of dtype (K a multiple of 32)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_k = min(1024, triton.next_power_of_2(k))
    _int4_dequant_kernel[(n, triton.cdiv(k, block_k))](qweight, scales, zeros, out, k, GROUP=group, BLOCK_K=block_k)
    return out


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int):
    """x [M, K] (contiguous) times the packed weight -> [M, N] in x's dtype, by the kernel that suits M rows."""
    m = x.shape[0]
    if m <= GEMV_MAX_M:
        return int4_gemv(x, qweight, scales, zeros, group)
    if m < DEQUANT_MIN_M:
        return int4_gemm(x, qweight, scales, zeros, group)
    return torch.nn.functional.linear(x, int4_dequantize(qweight, scales, zeros, group, x.dtype))
