"""Batch-invariant mode on CUDA (EngineConfig.batch_invariant; vLLM's VLLM_BATCH_INVARIANT, SGLang's
--enable-deterministic-inference): a row of a step gets the same bits whatever the other rows of the batch.

cuBLAS picks its GEMM algorithm (tile shape, split-K count) by the number of rows, so a request's logits change
with the batch around it. In this mode every dense projection runs `linear` below: one fixed tile shape, the
reduction over K always in BLOCK_K steps in order, no split-K, whatever M is. The attention kernels' tile shapes
and split counts are fixed by the callers that read `enabled()` (kernels/paged_attention.prefill_tiles, the
runner's split-K choice). Its torch reference is F.linear, equal up to the float32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# one tile shape for every M: the bits of a row depend on BLOCK_K (the order of its sums) alone
BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64
NUM_WARPS, NUM_STAGES = 4, 3

_enabled = False


def set_enabled(on: bool) -> None:
    """Turn the mode on or off for this process (the model runner, from EngineConfig.batch_invariant)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    """Whether this process runs the batch-invariant kernels."""
    return _enabled


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    x_stride,
    w_stride,
    y_stride,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None].to(tl.int64) * x_stride + kk[None, :], (rm[:, None] < M) & (kk[None, :] < K), 0.0
        )
        w = tl.load(
            w_ptr + rn[None, :].to(tl.int64) * w_stride + kk[:, None], (rn[None, :] < N) & (kk[:, None] < K), 0.0
        )
        acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, rn < N, 0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * y_stride + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N], each row's bits independent of the other rows."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, n = x2.shape[0], w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _linear_kernel[grid](
            x2,
            w,
            bias if bias is not None else w,
            y,
            m,
            n,
            k,
            x2.stride(0),
            w.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
        )
    return y.view(*x.shape[:-1], n)
