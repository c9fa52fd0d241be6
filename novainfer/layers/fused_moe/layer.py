"""FusedMoE: every expert's gate/up and down weights in two stacked tensors, sharded for tensor parallelism.

w13_weight [experts, 2 * inter / tp, hidden] holds each expert's gate rows then up rows (column-parallel:
each rank keeps its slice of the intermediate size), w2_weight [experts, hidden, inter / tp] the down
projection (row-parallel). The output is this rank's partial sum; the MoE block all-reduces once. With
bias (gpt-oss), w13_bias [experts, 2 * inter / tp] is sharded as w13's rows and w2_bias [experts, hidden] is
held by rank 0 alone (zeros elsewhere), so the all-reduce adds it once.
On CUDA the Triton kernel (kernels/fused_moe.py) runs the experts, elsewhere torch's grouped_mm over the
tokens sorted by expert (the loop reference where torch lacks grouped_mm). Under a quantization config with an
experts method (MXFP4: layers/quantization/mxfp4.py) that method registers, loads and runs the expert weights
instead; the biases and act_fn stay the layer's, and the method reads them from it.
"""

from __future__ import annotations

import torch
from torch import nn

from novainfer.distributed import get_tp_group, shard_dim
from novainfer.layers.activation import get_act_and_mul
from novainfer.layers.fused_moe.moe_torch import fused_experts_grouped, fused_experts_torch
from novainfer.layers.fused_moe.routing import select_experts
from novainfer.layers.quantization import current_quant_config


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        hidden_act: str = "silu",
        bias: bool = False,
        act_fn: nn.Module | None = None,
    ):
        """act_fn: the gated activation over concat(gate, up), where hidden_act names none (gpt-oss's)."""
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank, self.tp_group.size
        if intermediate_size % self.tp_size:
            raise ValueError(f"moe_intermediate_size={intermediate_size} is not divisible by tp_size={self.tp_size}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_act = hidden_act
        self.local_inter = intermediate_size // self.tp_size
        config = current_quant_config()
        self.quant_method = config.get_moe_method(self) if config is not None else None
        if self.quant_method is not None:  # the method registers the expert parameters it stores
            self.quant_method.create_weights(self, num_experts, hidden_size, self.local_inter)
        else:
            self.w13_weight = nn.Parameter(
                torch.empty(num_experts, 2 * self.local_inter, hidden_size), requires_grad=False
            )
            self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_inter), requires_grad=False)
            self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        self.w13_bias = self.w2_bias = None
        if bias:  # dense in either case: the quantization method reads them from the layer
            self.w13_bias = nn.Parameter(torch.zeros(num_experts, 2 * self.local_inter), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden_size), requires_grad=False)
            self.w13_bias.weight_loader = self.w2_bias.weight_loader = self.weight_loader
        self.act_fn = act_fn if act_fn is not None else get_act_and_mul(hidden_act)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """One HF expert tensor (a weight, or a bias: param w13_bias / w2_bias): shard_id = (expert, 'w1' gate |
        'w3' up | 'w2' down)."""
        expert, kind = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: the config has {self.num_experts} experts")
        if param.dim() == 2 and kind == "w2":  # the down bias: whole on rank 0, zero on the others
            target = param.data[expert]
            if loaded.shape != target.shape:
                raise ValueError(
                    f"expert {expert}'s down bias has shape {tuple(loaded.shape)}, not {tuple(target.shape)}"
                )
            target.copy_(loaded) if self.tp_rank == 0 else target.zero_()
            return
        if kind == "w2":
            target = param.data[expert]
            part = shard_dim(loaded, 1, self.tp_rank, self.tp_size, tuple(target.shape))
        else:
            target = param.data[expert].narrow(0, 0 if kind == "w1" else self.local_inter, self.local_inter)
            part = shard_dim(loaded, 0, self.tp_rank, self.tp_size, tuple(target.shape))
        target.copy_(part)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """This rank's partial output [tokens, hidden] (the caller all-reduces)."""
        return self.apply_routed(hidden_states, *select_experts(router_logits, self.top_k, self.renormalize))

    def apply_routed(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The experts over routing already chosen (a family whose router scales the weights: Gemma 4)."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden_states, topk_weights, topk_ids)
        if hidden_states.is_cuda:
            from novainfer.kernels.fused_moe import fused_experts

            experts = fused_experts
        else:
            experts = fused_experts_grouped if hasattr(torch.nn.functional, "grouped_mm") else fused_experts_torch
        return experts(
            hidden_states,
            self.w13_weight,
            self.w2_weight,
            topk_weights,
            topk_ids,
            self.act_fn,
            self.w13_bias,
            self.w2_bias,
        )


def expert_params_mapping(gate: str, down: str, up: str) -> dict[str, tuple[str, str]]:
    """HF per-expert projection name -> (our stacked parameter, shard kind); vLLM's mapping, by name."""
    return {gate: ("w13_weight", "w1"), up: ("w13_weight", "w3"), down: ("w2_weight", "w2")}
