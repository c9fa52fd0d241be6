"""GGUF experts (kernels/fused_moe_gguf.py's stacked layout, or a dense side) in torch: the reference the kernels are
checked against and the CPU path of layers/quantization/gguf_moe.py. Imports nothing of the gguf package, so the GPU
check script (tests/gpu/gguf_moe_check.py) runs it where that package is not installed."""

from __future__ import annotations

import torch
from torch import nn

from novainfer.kernels.fused_moe_gguf import Side, side_shape
from novainfer.kernels.gguf_gemm import dequantize, quantize_q8_reference
from novainfer.layers.fused_moe.moe_torch import fused_experts_torch


def expert_weights(side: Side, experts: torch.Tensor) -> torch.Tensor:
    """The given experts of a side as float32 [len(experts), N, K] (the reference's weights)."""
    if isinstance(side, torch.Tensor):
        return side[experts].float()
    e = experts.numel()
    dense = [
        dequantize(p.map(lambda t: t[experts].flatten(0, 1), e * p.shape[0])).view(e, p.shape[0], -1) for p in side
    ]
    return torch.cat(dense, dim=1)


def _q8_rounded(x: torch.Tensor) -> torch.Tensor:
    """Rows of x as the GEMV multiplies them: int8 per 32 inputs times their scale (quantize_q8_reference)."""
    xq, dx, _ = quantize_q8_reference(x.float().reshape(1, -1))
    return (xq.float().view(-1, 32) * dx[:, None]).view(x.shape)


def fused_experts_gguf_reference(
    hidden_states: torch.Tensor,
    w13: Side,
    w2: Side,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_and_mul: nn.Module,
    q8_activations: bool = False,
) -> torch.Tensor:
    """fused_experts_gguf in torch, float32: the routed experts dequantized, then fused_experts_torch;
    q8_activations: x and the activation rounded to int8 per 32 inputs where a quantized side multiplies them, as the
    few-token GEMV rounds them."""
    used = torch.unique(topk_ids)
    remap = torch.zeros(side_shape(w13)[0], dtype=torch.long, device=topk_ids.device)
    remap[used] = torch.arange(used.numel(), device=topk_ids.device)
    x, act = hidden_states.float(), act_and_mul
    if q8_activations and not isinstance(w13, torch.Tensor):
        x = _q8_rounded(x)
    if q8_activations and not isinstance(w2, torch.Tensor):
        act = lambda h: _q8_rounded(act_and_mul(h))  # noqa: E731
    out = fused_experts_torch(
        x, expert_weights(w13, used), expert_weights(w2, used), topk_weights, remap[topk_ids], act
    )
    return out.to(hidden_states.dtype)
