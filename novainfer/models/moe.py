"""The sparse MoE block the MoE families share, and how their per-expert checkpoint tensors find the
stacked FusedMoE parameters.

A block routes each token to its top-k experts (FusedMoE), optionally adds a shared expert scaled by a
sigmoid gate (Qwen2-MoE), and all-reduces the sum once: the shared expert's down projection and the
experts both leave their tensor-parallel partial sums unreduced.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from novainfer.distributed import get_tp_group
from novainfer.layers.fused_moe import FusedMoE
from novainfer.layers.fused_moe.layer import expert_params_mapping
from novainfer.layers.linear import ReplicatedLinear
from novainfer.layers.quantization.prequantized_moe import EXPERT_TENSOR_NAMES
from novainfer.models.llama import LlamaForCausalLM, LlamaMLP


def num_experts_of(config: Any) -> int:
    return getattr(config, "num_experts", None) or config.num_local_experts


class SparseMoeBlock(nn.Module):
    def __init__(
        self, config: Any, intermediate_size: int, renormalize: bool, shared_intermediate_size: int | None = None
    ):
        super().__init__()
        self.tp_group = get_tp_group()
        act = getattr(config, "hidden_act", "silu")
        num_experts = num_experts_of(config)
        self.gate = ReplicatedLinear(config.hidden_size, num_experts)
        self.experts = FusedMoE(
            num_experts, config.num_experts_per_tok, config.hidden_size, intermediate_size, renormalize, act
        )
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(config.hidden_size, shared_intermediate_size, act, reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return self.tp_group.all_reduce(out) if self.tp_group.size > 1 else out


class MoeForCausalLM(LlamaForCausalLM):
    """Adds per-expert checkpoint names (experts.E.<proj>.weight, .bias where the experts have biases, and a
    pre-quantized format's tensors, e.g. .qweight: layers/quantization/prequantized_moe.py) to the Llama weight
    routing; experts.E.<proj>.<tensor> fills the stacked parameter w13_<tensor> or w2_<tensor>."""

    expert_projections = ("gate_proj", "down_proj", "up_proj")  # HF names of gate, down, up (Mixtral: w1, w2, w3)
    _TENSORS = ("weight", "bias", *EXPERT_TENSOR_NAMES)
    _EXPERT = re.compile(rf"\.experts\.(\d+)\.(\w+)\.({'|'.join(_TENSORS)})$")

    def param_target(self, name: str) -> tuple[str, Any]:
        for hf, ours in self.checkpoint_renames.items():
            name = name.replace(hf, ours)
        m = self._EXPERT.search(name)
        mapping = expert_params_mapping(*self.expert_projections)
        if m and m.group(2) in mapping:
            param, kind = mapping[m.group(2)]
            param = param.replace("_weight", f"_{m.group(3)}")
            return f"{name[: m.start()]}.experts.{param}", (int(m.group(1)), kind)
        return super().param_target(name)

    def checkpoint_names(self, param_name: str) -> list[str]:
        mapping = expert_params_mapping(*self.expert_projections)
        for param in (f"{side}_{tensor}" for side in ("w13", "w2") for tensor in self._TENSORS):
            if param_name.endswith(f".experts.{param}"):
                prefix, (side, kind) = param_name[: -len(param)], param.split("_", 1)
                if kind in EXPERT_TENSOR_NAMES and not getattr(self.get_parameter(param_name), "per_expert", False):
                    break  # a stacked checkpoint tensor of the same name (gpt-oss's MXFP4 scales)
                names = [
                    f"{prefix}{e}.{hf}.{kind}"
                    for e in range(num_experts_of(self.config))
                    for hf, (p, _) in mapping.items()
                    if p == f"{side}_weight"
                ]
                for hf, ours in self.checkpoint_renames.items():
                    names = [n.replace(ours, hf) for n in names]
                return names
        return super().checkpoint_names(param_name)
