"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias); sparse layers route to top-k
experts plus a shared expert behind a sigmoid gate; layers in mlp_only_layers, or off the
decoder_sparse_step, keep a dense MLP."""

from __future__ import annotations

from typing import Any

from torch import nn

from novainfer.models.llama import LlamaMLP
from novainfer.models.moe import MoeForCausalLM, SparseMoeBlock, num_experts_of


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and num_experts_of(config) > 0
        and (layer_idx + 1) % step == 0
    )


class Qwen2MoeForCausalLM(MoeForCausalLM):
    qkv_bias = True
    shared_expert = True

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        act = getattr(config, "hidden_act", "silu")
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config.hidden_size, config.intermediate_size, act)
        shared = config.shared_expert_intermediate_size if self.shared_expert else None
        return SparseMoeBlock(config, config.moe_intermediate_size, bool(config.norm_topk_prob), shared)
