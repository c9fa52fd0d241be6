"""The pair form of the INT4 decode GEMV, measured on 2026-12-05 and not merged (README.md beside this file): a
stand-in for novainfer/kernels/int4_gemm.py's GEMV (kernel, tile candidates, int4_gemv), everything else the
package's. Time it against the package's with benchmarks/tuning/int4_gemv_tiles.py --kernels <this file>; count
its instructions with sass_count.py <this file>."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.kernels.int4_gemm import GEMV_MAX_M


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
    hi_bits,
    lo_bits,
    M: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m, rows] = W[rows] @ x[m] for M <= 4 rows of x; a program takes BLOCK_N rows over all of K.

    One shift of a word puts two codes in place: nibble 2h at mantissa bits 15..18 of 256.0 (hi_bits) and nibble
    2h + 1 at bits 19..22 of 16.0 (lo_bits); one and-or then makes each a float, 256 + code or 16 + code, exact, and
    one FMA multiplies it in: about 2.6 instructions a weight against 7.5 for code - zero a weight. Per 32-input
    chunk (one group): sum (code - zero) * scale * x = scale * (p - sum_j offset_j x_j - zero * sum x), the two sums
    of x per chunk computed once for all rows. The bit patterns come as arguments: as immediates ptxas
    re-materializes them before most uses."""
    C: tl.constexpr = BLOCK_K // 32  # 32-input chunks (four words) a step
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rload = tl.minimum(rows, N - 1).to(tl.int64)  # the last tile re-reads row N - 1: no masks on the rows
    chunk = tl.arange(0, C)
    lane = tl.arange(0, 4)
    # every per-weight load is a [BLOCK_N, C, 4] tile (word w of chunk c of a row), so all take the codes' layout
    # and nothing goes through shared memory: x's inputs broadcast over the rows, a chunk's scale and zero point
    # over its four words (equal loads, which the compiler merges)
    same = 0 * rows[:, None, None] + 0 * lane[None, None, :]
    q_rows = q_ptr + rload[:, None, None] * stride_qn + lane[None, None, :]
    sz_rows = rload[:, None, None] * (K // GROUP) + same
    x_lanes = x_ptr + lane[None, None, :] + same
    # the chunk sums of x take a [C, 32] tile of their own: input 4 j + w of a chunk is nibble j of word w
    i32 = tl.arange(0, 32)
    offset = tl.where((i32 // 4) % 2 == 0, 256.0, 16.0)
    acc0 = tl.zeros([BLOCK_N, C, 1], tl.float32)
    acc1 = tl.zeros([BLOCK_N, C, 1], tl.float32)
    acc2 = tl.zeros([BLOCK_N, C, 1], tl.float32)
    acc3 = tl.zeros([BLOCK_N, C, 1], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # chunks past K (BLOCK_K need not divide K) re-read the last chunk, unmasked, and take a scale of 0
        ci = k0 // 32 + chunk[None, :, None]
        cl = tl.minimum(ci, K // 32 - 1)
        q = tl.load(q_rows + cl * 4, eviction_policy="evict_first")
        grp = sz_rows + cl // (GROUP // 32)
        # the four lanes of a chunk hold one scale and zero point: max takes it
        s = tl.where(ci < K // 32, tl.max(tl.load(s_ptr + grp), 2, keep_dims=True).to(tl.float32), 0.0)
        z = tl.max(tl.load(z_ptr + grp), 2, keep_dims=True).to(tl.float32)
        x_chunk = x_ptr + tl.minimum(k0 // 32 + chunk, K // 32 - 1)[:, None] * 32 + i32[None, :]
        c0 = _chunk_sums(x_chunk, offset, z, C)
        c1 = _chunk_sums(x_chunk + stride_xm, offset, z, C) if M > 1 else c0
        c2 = _chunk_sums(x_chunk + 2 * stride_xm, offset, z, C) if M > 2 else c0
        c3 = _chunk_sums(x_chunk + 3 * stride_xm, offset, z, C) if M > 3 else c0
        p0 = tl.zeros([BLOCK_N, C, 4], tl.float32)
        p1 = tl.zeros([BLOCK_N, C, 4], tl.float32)
        p2 = tl.zeros([BLOCK_N, C, 4], tl.float32)
        p3 = tl.zeros([BLOCK_N, C, 4], tl.float32)
        for h in tl.static_range(4):  # nibbles 2h, 2h + 1 of word w are inputs 8h + w and 8h + 4 + w
            if h < 2:
                qs = q << (15 - 8 * h)
            else:
                qs = q >> (8 * h - 15)
            we = ((qs & 0x78000) | hi_bits).to(tl.float32, bitcast=True)
            wo = ((qs & 0x780000) | lo_bits).to(tl.float32, bitcast=True)
            xh = x_lanes + cl * 32 + 8 * h
            p0 += we * tl.load(xh).to(tl.float32)
            p0 += wo * tl.load(xh + 4).to(tl.float32)
            if M > 1:
                p1 += we * tl.load(xh + stride_xm).to(tl.float32)
                p1 += wo * tl.load(xh + stride_xm + 4).to(tl.float32)
            if M > 2:
                p2 += we * tl.load(xh + 2 * stride_xm).to(tl.float32)
                p2 += wo * tl.load(xh + 2 * stride_xm + 4).to(tl.float32)
            if M > 3:
                p3 += we * tl.load(xh + 3 * stride_xm).to(tl.float32)
                p3 += wo * tl.load(xh + 3 * stride_xm + 4).to(tl.float32)
        acc0 += s * (tl.sum(p0, 2, keep_dims=True) - c0)
        if M > 1:
            acc1 += s * (tl.sum(p1, 2, keep_dims=True) - c1)
        if M > 2:
            acc2 += s * (tl.sum(p2, 2, keep_dims=True) - c2)
        if M > 3:
            acc3 += s * (tl.sum(p3, 2, keep_dims=True) - c3)
    dt = out_ptr.dtype.element_ty
    omask = rows < N
    tl.store(out_ptr + rows, tl.sum(tl.reshape(acc0, [BLOCK_N, C]), 1).to(dt), mask=omask)
    if M > 1:
        tl.store(out_ptr + stride_om + rows, tl.sum(tl.reshape(acc1, [BLOCK_N, C]), 1).to(dt), mask=omask)
    if M > 2:
        tl.store(out_ptr + 2 * stride_om + rows, tl.sum(tl.reshape(acc2, [BLOCK_N, C]), 1).to(dt), mask=omask)
    if M > 3:
        tl.store(out_ptr + 3 * stride_om + rows, tl.sum(tl.reshape(acc3, [BLOCK_N, C]), 1).to(dt), mask=omask)


@triton.jit
def _chunk_sums(x_chunk, offset, z, C: tl.constexpr):
    """Per chunk of one row of x: sum_j offset_j x_j + zero * sum x, as [1, C, 1] (z [BLOCK_N, C, 1])."""
    xc = tl.load(x_chunk).to(tl.float32)  # [C, 32]
    return tl.reshape(tl.sum(xc * offset[None, :], 1), [1, C, 1]) + z * tl.reshape(tl.sum(xc, 1), [1, C, 1])


HI_BITS = 0x43800000  # float32 bits of 256.0: a code at mantissa bits 15..18 makes 256 + code
LO_BITS = 0x41800000  # float32 bits of 16.0: a code at bits 19..22 makes 16 + code

# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMV. A thread holds BLOCK_N * BLOCK_K / (1024 * num_warps) rows
# of a chunk: each x value it converts serves that many rows, so 4-8 rows a thread halve the instructions a weight
# against one. All programs together must keep enough bytes in flight to cover HBM's latency (~3-4 MB on an H200)
# even for a 3584-row layer. GEMV_TILES is by (N, K): the best of benchmarks/tuning/int4_gemv_tiles.py's sweep on
# an H200 (Qwen2.5-7B's layers); other shapes take GEMV_DEFAULT; GEMV_CANDIDATES are what the sweeps try
GEMV_CANDIDATES: list[tuple[int, int, int, int]] = [
    (32, 512, 2, 1),
    (16, 512, 2, 1),
    (16, 1024, 4, 1),
    (32, 1024, 4, 1),
    (16, 1024, 2, 1),
    (64, 1024, 8, 1),
    (32, 1024, 8, 1),
    (16, 512, 1, 1),
    (32, 512, 2, 2),
    (16, 1024, 4, 2),
]
GEMV_DEFAULT = (32, 512, 2, 1)
GEMV_TILES: dict[tuple[int, int], tuple[int, int, int, int]] = {}


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
        HI_BITS,
        LO_BITS,
        M=m,
        GROUP=group,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out
