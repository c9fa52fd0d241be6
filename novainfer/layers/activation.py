"""SiLU-gated activation for the fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from novainfer.kernels.cpu import ops as cpu_ops
from novainfer.layers.quantization import current_quant_config


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input is [..., 2 * d] = concat(gate, up)."""

    def __init__(self):
        super().__init__()
        self.fused_cpu = getattr(current_quant_config(), "fused_cpu_ops", False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2:
            from novainfer.kernels.fused_ops import silu_and_mul

            return silu_and_mul(x)
        if self.fused_cpu and cpu_ops.usable(x):
            return cpu_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """gelu(gate) * up over concat(gate, up), tanh-approximated as Gemma's gelu_pytorch_tanh."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


class ClampedSwigluAndMul(nn.Module):
    """gpt-oss's expert activation over concat(gate, up): gate clamped above at limit, up to [-limit, limit],
    then (up + 1) * gate * sigmoid(alpha * gate), in transformers' order of operations."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.alpha, self.limit = float(alpha), float(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2:
            from novainfer.kernels.fused_moe import clamped_swiglu_and_mul

            return clamped_swiglu_and_mul(x, self.alpha, self.limit)
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation a config's hidden_act (or hidden_activation) names."""
    if hidden_act == "silu":
        return SiluAndMul()
    if hidden_act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return GeluAndMul("tanh")
    if hidden_act == "gelu":
        return GeluAndMul("none")
    raise NotImplementedError(f"hidden activation {hidden_act!r} is not supported")
