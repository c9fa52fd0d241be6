"""Mixture-of-experts: top-k routing, the fused expert layer, its torch reference and the Triton kernel's entry."""

from novainfer.layers.fused_moe.layer import FusedMoE
from novainfer.layers.fused_moe.moe_torch import fused_experts_torch
from novainfer.layers.fused_moe.routing import select_experts

__all__ = ["FusedMoE", "fused_experts_torch", "select_experts"]
