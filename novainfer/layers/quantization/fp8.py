"""vLLM's `quantization="fp8"` (dynamic FP8): a bf16/fp16 checkpoint's dense linear weights are quantized to
float8_e4m3fn at load, one float32 scale per output row; activations get one scale per token at run time and
torch._scaled_mm multiplies with row-wise scales into the model's dtype.

The weight is loaded dense (the layer's own weight_loader, tensor-parallel shards included; or drawn by
load_format="dummy") and quantized in process_weights_after_loading, so each rank's scales cover exactly its
own rows and columns. The embedding and lm_head stay dense, as in vLLM; MoE experts are refused (selector).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from novainfer.layers.linear import LinearBase
from novainfer.layers.quantization.base import QuantizationConfig, QuantizeMethodBase

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor on a per-token scale: an all-zero row quantizes to zeros
ALIGN = 16  # _scaled_mm on CUDA needs K and N multiples of 16 (M is free)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of a 2-D tensor to float8_e4m3fn with its own float32 scale amax/448: (x_fp8, scale [M, 1])."""
    xf = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    scale = xf.abs().amax(dim=-1, keepdim=True).div_(FP8_MAX).clamp_(min=MIN_SCALE)
    return xf.div_(scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in one Triton kernel (kernels/fp8_quant.py): what CUDA tensors use."""
    from novainfer.kernels.fp8_quant import per_token_quant_fp8

    return per_token_quant_fp8(x, FP8_MAX, MIN_SCALE)


@dataclass(frozen=True)
class Fp8Options:
    """How a device runs the fp8 product (probed at start-up: check_device_support, cuda_quantizer)."""

    fuse_bias: bool = False  # _scaled_mm adds a bf16 bias itself
    fast_accum: bool = False  # Hopper's fast float8 accumulation (vLLM's CUTLASS kernels use it too)
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = quantize_rows


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    opts: Fp8Options = Fp8Options(),
) -> torch.Tensor:
    """y = x W^T (+ bias) with W float8 [N, K] and its scales [1, N]; x quantized per token by opts.quantize.

    Shapes depend only on x's shape (no host sync), so the call is captured by CUDA graphs."""
    k, n = weight.shape[1], weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], n)
    x_fp8, x_scale = opts.quantize(x2)
    # row-wise scaling outputs bf16 on CUDA; a float32/float16 model casts back
    out_dtype = x.dtype if x.device.type == "cpu" or x.dtype == torch.bfloat16 else torch.bfloat16
    fused = bias is not None and opts.fuse_bias and bias.dtype == out_dtype == torch.bfloat16
    y = torch._scaled_mm(
        x_fp8,
        weight.t(),
        scale_a=x_scale,
        scale_b=weight_scale,
        out_dtype=out_dtype,
        bias=bias if fused else None,
        use_fast_accum=opts.fast_accum,
    )
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if bias is not None and not fused:
        y = y + bias
    return y.view(*x.shape[:-1], n)


class Fp8LinearMethod(QuantizeMethodBase):
    """A dense linear layer whose weight becomes float8_e4m3fn [N, K] plus float32 scales [1, N] after loading."""

    def __init__(self, opts: Fp8Options = Fp8Options()):
        self.opts = opts

    def create_weights(self, layer: nn.Module, output_size: int, input_size: int) -> nn.Parameter:
        return nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)

    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: Any, shard_id: Any, dense_loader) -> None:
        dense_loader(param, loaded) if shard_id is None else dense_loader(param, loaded, shard_id)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight
        if w.dtype == FP8_DTYPE:
            return  # done already
        w_fp8, scale = quantize_rows(w.data)
        layer.weight = nn.Parameter(w_fp8.contiguous(), requires_grad=False)  # [N, K]: w.t() is column-major
        layer.weight_scale = nn.Parameter(scale.view(1, -1).contiguous(), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.weight.dtype != FP8_DTYPE:
            raise RuntimeError("fp8 layer used before process_weights_after_loading quantized its weight")
        return fp8_linear(x, layer.weight, layer.weight_scale, bias, self.opts)


class Fp8Config(QuantizationConfig):
    """Dense linear layers (qkv, o_proj, gate_up, down, ...) get Fp8LinearMethod; embeddings and lm_head none.

    Built for one device: start-up fails with the reason where float8 _scaled_mm cannot run there."""

    def __init__(self, device: torch.device):
        self.device = device
        fuse_bias, fast_accum = check_device_support(device)
        quantize = cuda_quantizer(device) if device.type == "cuda" else quantize_rows
        self.opts = Fp8Options(fuse_bias, fast_accum, quantize)
        self._skipped: set[tuple[int, int]] = set()

    def get_quant_method(self, layer: nn.Module) -> QuantizeMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None  # VocabParallelEmbedding / ParallelLMHead stay in the model's dtype
        if self.keeps_dense(layer.output_size, layer.input_size):
            return None
        return Fp8LinearMethod(self.opts)

    def keeps_dense(self, output_size: int, input_size: int) -> bool:
        """A layer whose N or K is not a multiple of 16 stays dense (one log line per shape)."""
        if output_size % ALIGN == 0 and input_size % ALIGN == 0:
            return False
        if (output_size, input_size) not in self._skipped:
            self._skipped.add((output_size, input_size))
            logger.info(
                "fp8: a linear layer of shape [%d, %d] stays dense (_scaled_mm needs multiples of %d)",
                output_size,
                input_size,
                ALIGN,
            )
        return True


def cuda_quantizer(device: torch.device):
    """The Triton per-token kernel where it gives the torch ops' scales and bytes on a probe, else the torch ops
    (one warning)."""
    x = torch.randn(5, 3 * ALIGN, device=device, dtype=torch.bfloat16) * torch.logspace(-2, 2, 3 * ALIGN, device=device)
    try:
        same = same_quantization(*quantize_rows_triton(x), *quantize_rows(x))
        reason = "" if same else "its result differs from the torch ops' by more than rounding"
    except Exception as exc:  # a Triton/driver failure of any kind: the torch ops still work
        reason = f"{type(exc).__name__}: {exc}"
    if not reason:
        return quantize_rows_triton
    logger.warning("fp8: the Triton per-token quantization kernel is not used (%s); torch ops instead", reason)
    return quantize_rows


def same_quantization(q: torch.Tensor, s: torch.Tensor, want_q: torch.Tensor, want_s: torch.Tensor) -> bool:
    """Whether two per-token quantizations agree up to rounding: scales within a float32 ulp or two (CUDA's
    torch divides by a scalar as a multiply by its reciprocal, the kernel divides), and every value within one
    float8 step of the other."""
    if not torch.allclose(s, want_s, rtol=1e-6, atol=0):
        return False
    a, b = q.float() * s, want_q.float() * want_s
    step = torch.maximum(a.abs(), b.abs()) * 2.0**-3 + s * 2.0**-9  # e4m3: 3 mantissa bits, subnormals
    return bool(((a - b).abs() <= step).all())


def check_device_support(device: torch.device) -> tuple[bool, bool]:
    """Raise ValueError naming why float8 row-wise _scaled_mm cannot run on device; return whether it fuses
    a bf16 bias and whether it takes fast accumulation (CUDA only)."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(
                f"quantization='fp8' needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, "
                f"Hopper); {torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}"
            )
    elif device.type != "cpu":
        raise ValueError(f"quantization='fp8' runs on CUDA (sm_89+) or the CPU, not on {device.type}")
    x = torch.ones(1, 2 * ALIGN, device=device, dtype=torch.bfloat16)
    w = torch.ones(ALIGN, 2 * ALIGN, device=device, dtype=torch.bfloat16)
    xq, xs = quantize_rows(x)
    wq, ws = quantize_rows(w)
    try:
        y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        raise ValueError(
            f"quantization='fp8': this torch {torch.__version__} build cannot multiply float8 "
            f"with row-wise scales on {device}: {exc}"
        ) from None
    if not torch.allclose(y.float(), torch.full_like(y.float(), 2 * ALIGN)):
        raise ValueError(f"quantization='fp8': float8 _scaled_mm on {device} gives wrong results")
    args = dict(scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)
    fast_accum = device.type == "cuda" and _runs(xq, wq.t(), use_fast_accum=True, **args)
    bias = torch.zeros(ALIGN, device=device, dtype=torch.bfloat16)
    return _runs(xq, wq.t(), bias=bias, use_fast_accum=fast_accum, **args), fast_accum


def _runs(*args: Any, **kwargs: Any) -> bool:
    try:
        torch._scaled_mm(*args, **kwargs)
        return True
    except (RuntimeError, NotImplementedError):
        return False
