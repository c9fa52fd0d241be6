"""Lab (session 22): the INT4 decode GEMV with its weight loads issued one K step ahead (the codes, scales and zeros
of step k + 1 loaded before step k is unpacked), the one idea session 12 left untried for a GEMV bound by the bytes
in flight rather than by issue (docs/bench/2026-12-05/s12/README.md). A stand-in for novainfer/kernels/int4_gemm.py's
GEMV: time it against the package's with benchmarks/tuning/int4_gemv_tiles.py --kernels <this file>."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.kernels.int4_gemm import GEMV_DEFAULT, GEMV_MAX_M, GEMV_TILES, MAGIC  # noqa: F401


@triton.jit
def _step_loads(q_ptrs, s_ptr, z_ptr, sz_row, chunk, k0, K, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr):  # fmt: skip
    """One K step's codes [BLOCK_N, C, 4], scales [BLOCK_N, C] and 2^23 + zeros [BLOCK_N, C, 1]."""
    if EVEN_K:
        k0 = tl.minimum(k0, K - BLOCK_K)
        grp = sz_row + ((k0 + chunk * 32) // GROUP)[None, :]
        q = tl.load(q_ptrs + k0 // 8, eviction_policy="evict_first")
        s = tl.load(s_ptr + grp).to(tl.float32)
        zoff = (tl.load(z_ptr + grp).to(tl.float32) + 8388608.0)[:, :, None]
    else:
        cmask = (k0 + chunk * 32 < K)[None, :]
        grp = sz_row + ((k0 + chunk * 32) // GROUP)[None, :]
        q = tl.load(q_ptrs + k0 // 8, mask=cmask[:, :, None], other=0, eviction_policy="evict_first")
        s = tl.load(s_ptr + grp, mask=cmask, other=0.0).to(tl.float32)
        zoff = (tl.load(z_ptr + grp, mask=cmask, other=0).to(tl.float32) + 8388608.0)[:, :, None]
    return q, s, zoff


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
    # the first step's codes, scales and zeros; each step then issues the next step's loads before it unpacks its own
    q_n, s_n, z_n = _step_loads(q_ptrs, s_ptr, z_ptr, sz_row, chunk, 0, K, GROUP, BLOCK_K, EVEN_K)
    for k0 in range(0, K, BLOCK_K):
        q, s, zoff = q_n, s_n, z_n
        # past the last step the loads re-read it (EVEN_K: clamped) or are masked off: never out of bounds
        q_n, s_n, z_n = _step_loads(q_ptrs, s_ptr, z_ptr, sz_row, chunk, k0 + BLOCK_K, K, GROUP, BLOCK_K, EVEN_K)
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


GEMV_CANDIDATES: list[tuple[int, int, int, int]] = [
    (8, 1024, 4, 3),
    (4, 1024, 4, 1),
    (4, 2048, 8, 1),
    (4, 512, 2, 1),
    (8, 512, 4, 3),
    (16, 1024, 8, 3),
]


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
