"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from novainfer.kernels.cpu import ops as cpu_ops
from novainfer.layers.quantization import current_quant_config


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.fused_cpu = getattr(current_quant_config(), "fused_cpu_ops", False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # computed in float32 as Hugging Face does, then cast back before the weight
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual). One Triton kernel on the GPU, also for
        q/k norms over [tokens, heads, head_dim] views."""
        if x.is_cuda and (x.dim() == 2 or (x.dim() == 3 and residual is None and x.stride(2) == 1)):
            from novainfer.kernels.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if self.fused_cpu and cpu_ops.usable(x) and self.weight.dtype == torch.float32:
            out, res = cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, res)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from one, and the product is taken in float32
    before the cast back, as transformers does for Gemma (Llama casts first)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual); on the quantized CPU path in float32
        the C op of RMSNorm with the weight 1 + w (equal in float32), one Triton kernel on the GPU, else torch."""
        if x.is_cuda and x.dim() == 3 and residual is None and x.stride(2) == 1 and not x.is_contiguous():
            from novainfer.kernels.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps, offset=True)  # heads of a fused projection's row, in place
        if x.is_cuda and x.is_contiguous():
            from novainfer.kernels.fused_ops import rms_norm

            flat = x.view(-1, x.shape[-1])
            if residual is None:
                return rms_norm(flat, self.weight, self.eps, offset=True).view(x.shape)
            out, res = rms_norm(flat, self.weight, self.eps, residual.reshape(flat.shape), offset=True)
            return out.view(x.shape), res.view(x.shape)
        if self.fused_cpu and cpu_ops.usable(x) and self.weight.dtype == torch.float32:
            out, res = cpu_ops.add_rms_norm(x, residual, 1.0 + self.weight, self.eps)
            return out if residual is None else (out, res)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
