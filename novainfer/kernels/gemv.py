"""One-row matrix-vector products (y = W x + b) with the elementwise ops around them fused in.

At batch 1 a decode step is a chain of small kernels, each costing a launch and a ramp-up whatever
its size; cuBLAS also splits the long-K down projection into a GEMM and a reduction. These kernels
read each weight row once, in full-width tiles, with
- a NORM prologue: x is (hidden + residual) normalised by RMSNorm and scaled by its weight; program 0
  also writes hidden + residual, the next residual. Each program sums the row's squares as the weights stream
  and multiplies its dot products by the row's rstd at the end (a scalar a row), so no pass over x comes before
  the weight loads;
- a SILU_MUL epilogue: W stacks gate's rows over up's (gate_up_proj), a program takes the same rows of
  both and writes silu(gate) * up, half as wide (so down_proj reads a plain row).
The epilogue rounds as fused_ops' kernels do (the products to the activation dtype before the SiLU, as the
unfused GEMM's output is); the prologue keeps the normed input in float32 where the unfused path rounds it to the
activation dtype, so the two differ by that rounding and the dot products' float32 summation order.
The weight may also be float8 with one float32 scale per [GROUP_N, GROUP_K] block (pre-quantized block FP8): each
block's scale multiplies x's inputs, one multiply an input rather than a weight, and the float8 byte widens
exactly; so the decode stack fuses FP8 layers as it does bf16 ones. Products accumulate elementwise in
a [BLOCK_N, BLOCK_K] float32 tile, reduced once at the end (no reduction across threads a step). Tile shapes come
from GEMV_TILES (benchmarks/tuning/gemv_tiles.py sweeps them on a GPU); the torch reference is
act(linear(norm(x))) over the dequantized weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.kernels.fused_ops import silu_mul


@triton.jit
def _gemv_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    gate_ptr,
    out_ptr,
    res_out_ptr,
    N,
    K,
    eps,
    gate_head_stride,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    GATE_D: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output rows (with SILU_MUL: gate's; up's are N further)
    rmask = rows < N
    kk = tl.arange(0, BLOCK_K)
    sq = tl.zeros([BLOCK_K], tl.float32)  # NORM: (hidden + residual)^2, summed as the weights stream
    res_len = tl.where(pid == 0, K, 0)  # program 0 writes the new residual
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    w_rows = w_ptr + tl.minimum(rows, N - 1)[:, None].to(tl.int64) * K  # the last tile re-reads row N - 1
    # a program's rows share one scale block row (BLOCK_N divides GROUP_N; with SILU_MUL, N is whole blocks too)
    s_row = scale_ptr + (pid * BLOCK_N // GROUP_N) * tl.cdiv(K, GROUP_K)
    s_up_row = scale_ptr + ((N + pid * BLOCK_N) // GROUP_N) * tl.cdiv(K, GROUP_K)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + kk
        kmask = offs < K
        if NORM:  # x * norm weight now; the row's rstd, a scalar, multiplies the sums at the end
            h = tl.load(x_ptr + offs, mask=kmask, other=0.0)
            if HAS_RESIDUAL:
                h = h + tl.load(res_ptr + offs, mask=kmask, other=0.0)
                tl.store(res_out_ptr + offs, h, mask=offs < res_len)
            hf = h.to(tl.float32)
            sq += hf * hf
            xf = hf * tl.load(norm_w_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
        elif GATE_D > 0:  # x * sigmoid(gate), each rounded to x's dtype as torch's two ops
            xv = tl.load(x_ptr + offs, mask=kmask, other=0.0)
            gv = tl.load(gate_ptr + (offs // GATE_D) * gate_head_stride + offs % GATE_D, mask=kmask, other=0.0)
            sg = (1.0 / (1.0 + tl.exp(-gv.to(tl.float32)))).to(xv.dtype)
            xf = (xv.to(tl.float32) * sg.to(tl.float32)).to(xv.dtype).to(tl.float32)
        else:
            xf = tl.load(x_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
        xw = xf
        if HAS_SCALE:
            xw = xf * tl.load(s_row + offs // GROUP_K, mask=kmask, other=0.0)
        w = tl.load(w_rows + offs[None, :], mask=kmask[None, :], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * xw[None, :]
        if SILU_MUL:
            xu = xf
            if HAS_SCALE:
                xu = xf * tl.load(s_up_row + offs // GROUP_K, mask=kmask, other=0.0)
            up = tl.load(w_rows + N * K + offs[None, :], mask=kmask[None, :], other=0.0, eviction_policy="evict_first")
            acc_up += up.to(tl.float32) * xu[None, :]
    y = tl.sum(acc, 1)
    y_up = tl.sum(acc_up, 1)
    if NORM:
        rstd = tl.rsqrt(tl.sum(sq, 0) / K + eps)
        y *= rstd
        y_up *= rstd
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        if SILU_MUL:
            y_up += tl.load(bias_ptr + N + rows, mask=rmask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    out = silu_mul(y.to(dt), y_up.to(dt)) if SILU_MUL else y.to(dt)
    tl.store(out_ptr + rows, out, mask=rmask)


# (N, K, silu_and_mul, block-scaled float8) of the weight -> (BLOCK_N, BLOCK_K, num_warps, num_stages), the fastest
# of benchmarks/tuning/gemv_tiles.py's sweep on an H200 for Qwen2.5-0.5B's (2026-11-24), -7B's (bf16 and float8,
# 2026-11-27) and Qwen3.5-9B's (the hybrid stack's, --quick, 2026-11-27) projections; other shapes take
# gemv_tiles()'s rule
GEMV_TILES: dict[tuple[int, int, bool, bool], tuple[int, int, int, int]] = {
    (1152, 896, False, False): (2, 1024, 4, 3),
    (896, 896, False, False): (2, 1024, 4, 3),
    (9728, 896, True, False): (4, 1024, 4, 3),
    (896, 4864, False, False): (1, 2048, 8, 3),
    (4608, 3584, False, False): (4, 512, 4, 3),
    (3584, 3584, False, False): (2, 512, 2, 3),
    (37888, 3584, True, False): (2, 512, 2, 3),
    (3584, 18944, False, False): (2, 2048, 2, 3),
    (4608, 3584, False, True): (4, 512, 4, 1),
    (3584, 3584, False, True): (4, 1024, 4, 3),
    (37888, 3584, True, True): (16, 256, 4, 1),
    (3584, 18944, False, True): (4, 1024, 4, 1),
    (12352, 4096, False, False): (8, 256, 2, 1),
    (4096, 4096, False, False): (8, 1024, 2, 3),
    (10240, 4096, False, False): (8, 256, 4, 1),
    (24576, 4096, True, False): (8, 512, 2, 3),
    (4096, 12288, False, False): (1, 1024, 4, 3),
}


def gemv_tiles(n: int, k: int, silu_and_mul: bool = False, scaled: bool = False) -> tuple[int, int, int, int]:
    """Tile shape for an [n, k] weight: the sweep's where measured; else up to 1024 columns a tile and, as the
    sweep's winners mostly have, 2 rows for narrow outputs and 8 (of 512 columns) for wide ones (4 and 1024 for
    float8, whose rows are half as long in bytes)."""
    if (n, k, silu_and_mul, scaled) in GEMV_TILES:
        return GEMV_TILES[(n, k, silu_and_mul, scaled)]
    block_k = min(triton.next_power_of_2(k), 1024)
    if scaled:
        return 4, block_k, 4, 1
    if n >= 8192:
        return (4 if silu_and_mul else 8), min(block_k, 512), 4, 3
    return min(2, triton.next_power_of_2(n)), block_k, 4, 3


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_scale: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    silu_and_mul: bool = False,
    gate: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight @ x (+ bias) for one row x: [1, K]; weight [N, K] contiguous.

    weight_scale: weight is float8 with float32 scales [ceil(N / block[0]), ceil(K / block[1])], one a block.
    norm_weight (with eps, and an optional residual, which makes it return (y, x + residual)): x is RMS-normed
    first. silu_and_mul: weight is concat(gate, up) by rows and the result silu(gate x) * (up x), [1, N / 2].
    gate (no norm): [1, heads, head_dim], heads possibly strided (Qwen3.5's attention output gate, a view of its
    qkv row): x is x * sigmoid(gate) first."""
    n, k = weight.shape
    assert x.shape == (1, k) and x.is_contiguous() and weight.is_contiguous(), (x.shape, weight.shape)
    assert norm_weight is not None or residual is None
    assert gate is None or (norm_weight is None and gate.stride(2) == 1 and gate[0].numel() == k), gate
    n_out = n // 2 if silu_and_mul else n
    out = torch.empty(1, n_out, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else out
    block_n, block_k, warps, stages = tiles or gemv_tiles(n, k, silu_and_mul, weight_scale is not None)
    if not x.is_cuda and tiles is None:  # the CPU interpreter (tests): its cost is per program, so few wide ones
        block_n = min(triton.next_power_of_2(n_out), 64)
    if weight_scale is not None:  # a program's rows within one scale block row
        assert not silu_and_mul or n_out % block[0] == 0, (n, block)
        block_n = min(block_n, block[0])
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        weight,
        weight_scale if weight_scale is not None else x,
        bias if bias is not None else x,
        gate if gate is not None else x,
        out,
        res_out,
        n_out,
        k,
        eps,
        gate.stride(1) if gate is not None else 0,
        NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_and_mul,
        HAS_SCALE=weight_scale is not None,
        GATE_D=gate.shape[2] if gate is not None else 0,
        GROUP_N=block[0],
        GROUP_K=block[1],
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out if residual is None else (out, res_out)
