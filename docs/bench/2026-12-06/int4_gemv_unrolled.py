"""An experiment, not the package's kernel: the one-row INT4 decode GEMV of novainfer/kernels/int4_gemm.py with its
K loop unrolled UNROLL times, every step's codes, scales and zeros loaded before the first is unpacked, so a thread
has UNROLL 16-byte loads of codes in flight instead of one (the question: is the GEMV, 1.2-1.6 TB/s on H100s, short
of bytes in flight?). A stand-in for benchmarks/tuning/int4_gemv_tiles.py --kernels (int4_gemv, GEMV_CANDIDATES):
rows past one go to the package's GEMV. Candidates are (BLOCK_N, BLOCK_K, warps, stages, UNROLL)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.kernels import int4_gemm
from novainfer.kernels.int4_gemm import _codes


@triton.jit
def _step_weights(q_ptrs, s_ptr, z_ptr, grp, k0, K, chunk, EVEN_K: tl.constexpr):
    """A K step's words, float32 scales and 2^23 + zero; the tail step masks whole chunks."""
    if EVEN_K:
        q = tl.load(q_ptrs, eviction_policy="evict_first")
        s = tl.load(s_ptr + grp).to(tl.float32)
        zoff = (tl.load(z_ptr + grp).to(tl.float32) + 8388608.0)[:, :, None]
    else:
        cmask = (k0 + chunk * 32 < K)[None, :]
        q = tl.load(q_ptrs, mask=cmask[:, :, None], other=0, eviction_policy="evict_first")
        s = tl.load(s_ptr + grp, mask=cmask, other=0.0).to(tl.float32)
        zoff = (tl.load(z_ptr + grp, mask=cmask, other=0).to(tl.float32) + 8388608.0)[:, :, None]
    return q, s, zoff


@triton.jit
def _load_k(ptrs, kmask, EVEN_K: tl.constexpr):
    if EVEN_K:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=kmask, other=0.0)
    return v


@triton.jit
def _step(acc, q, s, zoff, x_ptr, k0, x_k, K, EVEN: tl.constexpr):
    """acc += one BLOCK_K step's products (q, s, zoff loaded by the caller)."""
    p = tl.zeros(q.shape, tl.float32)
    for j in tl.static_range(8):
        xj = x_ptr + k0 + 4 * j + x_k
        p += _load_k(xj, k0 + 4 * j + x_k < K, EVEN).to(tl.float32) * _codes(q, j, zoff)
    return acc + tl.sum(p, 2) * s


@triton.jit
def _gemv1_unrolled_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    K,
    stride_qn,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    C: tl.constexpr = BLOCK_K // 32
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rload = tl.minimum(rows, N - 1).to(tl.int64)
    chunk = tl.arange(0, C)
    lane = tl.arange(0, 4)
    q_ptrs = q_ptr + rload[:, None, None] * stride_qn + (chunk[:, None] * 4 + lane[None, :])[None, :, :]
    sz_row = rload[:, None] * (K // GROUP)
    x_k = (chunk[:, None] * 32 + lane[None, :])[None, :, :] + 0 * rows[:, None, None]
    acc = tl.zeros([BLOCK_N, C], tl.float32)
    for k0 in range(0, K, UNROLL * BLOCK_K):
        ka = k0
        kb = k0 + BLOCK_K
        ga = sz_row + ((ka + chunk * 32) // GROUP)[None, :]
        gb = sz_row + ((kb + chunk * 32) // GROUP)[None, :]
        # both steps' loads before either is used (EVEN_K: K a multiple of UNROLL * BLOCK_K)
        qa, sa, za = _step_weights(q_ptrs + ka // 8, s_ptr, z_ptr, ga, ka, K, chunk, EVEN_K)
        qb, sb, zb = _step_weights(q_ptrs + kb // 8, s_ptr, z_ptr, gb, kb, K, chunk, EVEN_K)
        acc = _step(acc, qa, sa, za, x_ptr, ka, x_k, K, EVEN_K)
        acc = _step(acc, qb, sb, zb, x_ptr, kb, x_k, K, EVEN_K)
    tl.store(out_ptr + rows, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=rows < N)


GEMV_CANDIDATES = [
    (4, 1024, 4, 1, 2),
    (4, 512, 2, 1, 2),
    (4, 512, 4, 1, 2),
    (8, 512, 4, 1, 2),
    (4, 256, 2, 1, 2),
    (2, 1024, 4, 1, 2),
    (8, 1024, 8, 1, 2),
]


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """One row: the unrolled kernel (UNROLL = 2 only: the kernel's two loads a step are written out); more rows,
    or tiles=None on the CPU interpreter with too small a K: the package's GEMV."""
    m, k = x.shape
    n = qweight.shape[0]
    if m > 1:
        return int4_gemm.int4_gemv(x, qweight, scales, zeros, group, None if tiles is None else tiles[:4])
    block_n, block_k, warps, stages, unroll = tiles or ((4, 64, 4, 1, 2) if not x.is_cuda else GEMV_CANDIDATES[0])
    assert unroll == 2, unroll
    block_k = min(block_k, triton.next_power_of_2(k))
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv1_unrolled_kernel[(triton.cdiv(n, block_n),)](
        x,
        qweight,
        scales,
        zeros,
        out,
        n,
        k,
        qweight.stride(0),
        GROUP=group,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UNROLL=unroll,
        EVEN_K=k % (unroll * block_k) == 0,
        num_warps=warps,
        num_stages=stages,
    )
    return out
