"""Per-token float8 quantization of activations in one kernel (quantization="fp8", layers/quantization/fp8.py).

torch's ops take five kernels and about six passes over the rows (abs, amax, a float32 copy, divide, clamp,
cast); this reads a row once (twice past ONE_PASS_MAX: its amax, then the quantized values) and writes it
once as float8. The torch version, fp8.quantize_rows, is its reference: the same float32 amax, scale amax/448 floored at 1/(448*512),
correctly rounded division (div_rn), clamp to +-448, then the cast (round to nearest even on sm_89+).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _per_token_fp8_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    x_stride,
    out_stride,
    n,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:  # the row fits one block: read once, keep it in registers
        mask = offs < n
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), FP8_MAX), MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(out_ptr + row * out_stride + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            mask = start + offs < n
            x = tl.load(x_ptr + row * x_stride + start + offs, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), FP8_MAX), MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        for start in range(0, n, BLOCK):
            mask = start + offs < n
            x = tl.load(x_ptr + row * x_stride + start + offs, mask=mask, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
            tl.store(out_ptr + row * out_stride + start + offs, q.to(out_ptr.dtype.element_ty), mask=mask)


ONE_PASS_MAX = 8192  # rows up to this long are read once (a 7B's hidden size); longer ones twice, 4096 at a time


def per_token_quant_fp8(
    x: torch.Tensor, fp8_max: float, min_scale: float, out_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows with unit stride) -> (x quantized [M, K] in out_dtype, float32 scales [M, 1]).

    out_dtype float32 returns the clamped quotients before the cast (the CPU interpreter's float8 cast does not
    round like the hardware, so tests compare these)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, k), dtype=out_dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        one_pass = k <= ONE_PASS_MAX
        block = triton.next_power_of_2(k) if one_pass else 4096
        _per_token_fp8_kernel[(m,)](
            x,
            out,
            scale,
            x.stride(0),
            out.stride(0),
            k,
            FP8_MAX=fp8_max,
            MIN_SCALE=min_scale,
            BLOCK=block,
            ONE_PASS=one_pass,
            num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16,
        )
    return out, scale
