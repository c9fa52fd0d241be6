"""gpt-oss (20B, 120B): the Llama decoder with gpt-oss's attention and experts.

Attention has q/k/v/o biases and learned sinks (one logit per head that joins every softmax and emits nothing),
alternates sliding-window (layer_types, sliding_window) and full layers, and rotates with YaRN rope (the
config's rope_parameters, computed by layers/rotary.py as transformers computes them). Every MLP is a block of
experts with biases behind a router with a bias: the top-k router logits are softmaxed among themselves, and
each expert applies the clamped SwiGLU ((up + 1) * gate * sigmoid(alpha * gate), gate clamped above at
swiglu_limit, up to [-limit, limit]). The checkpoint stacks the experts with gate and up interleaved on the last
dim (gate_up_proj [E, hidden, 2I]: gate = [..., ::2], up = [..., 1::2]); they are handed to FusedMoE per expert,
through its weight_loader, as unfused HF names. The released checkpoints (quantization_config quant_method
mxfp4) store the experts as MXFP4 blocks and scales (gate_up_proj_blocks [E, 2I, hidden/32, 16], rows
interleaved likewise); those load whole, as stored, into the MXFP4 method's parameters and stay four bits a
weight (layers/quantization/mxfp4.py); the biases stay float either way.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from novainfer.distributed import get_tp_group, shard_dim
from novainfer.layers.activation import ClampedSwigluAndMul
from novainfer.layers.attention import Attention
from novainfer.layers.fused_moe import FusedMoE
from novainfer.layers.fused_moe.routing import select_experts_top_logits
from novainfer.layers.linear import ReplicatedLinear, RowParallelLinear
from novainfer.models.llama import LlamaAttention, layer_type_of, sliding_window_of
from novainfer.models.moe import MoeForCausalLM

_LAYER_TYPES = ("sliding_attention", "full_attention")
_MXFP4 = (("gate_up_proj", "w13"), ("down_proj", "w2"))  # HF stacked expert tensor -> FusedMoE parameter prefix
_PARTS = ("blocks", "scales")


def check_supported(config: Any) -> None:
    """Refuse, naming the field, what this implementation does not run."""
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        if method != "mxfp4":  # its other fields are checked by layers/quantization/mxfp4.py's Mxfp4Config
            raise NotImplementedError(
                f"gpt-oss quantization_config quant_method={method!r} is not supported: only 'mxfp4' (the released "
                "checkpoints' experts) and unquantized bf16/fp32 checkpoints load"
            )
    unknown = sorted(set(config.layer_types) - set(_LAYER_TYPES))
    if unknown:
        raise NotImplementedError(f"gpt-oss layer_types {unknown} are not supported (only {list(_LAYER_TYPES)})")
    if len(config.layer_types) != config.num_hidden_layers:
        raise ValueError(f"layer_types lists {len(config.layer_types)} layers, not num_hidden_layers")


class GptOssAttention(LlamaAttention):
    """Llama attention with biases on q/k/v/o and a learned sink per head (sharded with the heads)."""

    def __init__(self, config: Any, layer_idx: int):
        bias = bool(config.attention_bias)
        super().__init__(config, layer_idx, qkv_bias=bias)
        if bias:
            self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=True)
        self.tp_rank, self.tp_size = get_tp_group().rank, get_tp_group().size
        # zeros, not empty: the dummy load format draws only matrices and biases
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks
        layer_type = layer_type_of(config, layer_idx)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=sliding_window_of(config, layer_type),
            sinks=self.sinks,
        )

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's heads' sinks."""
        param.data.copy_(shard_dim(loaded, 0, self.tp_rank, self.tp_size, tuple(param.shape)))


class GptOssMLP(nn.Module):
    """The router (with a bias) and the experts (with biases, clamped SwiGLU); one all-reduce of their sum."""

    def __init__(self, config: Any):
        super().__init__()
        self.tp_group = get_tp_group()
        self.top_k = config.num_experts_per_tok
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = FusedMoE(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=False,
            bias=True,
            # transformers before 5.2x fixes alpha in the module and has no config field for it
            act_fn=ClampedSwigluAndMul(getattr(config, "swiglu_alpha", 1.702), getattr(config, "swiglu_limit", 7.0)),
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts_top_logits(self.router(hidden_states), self.top_k)
        out = self.experts.apply_routed(hidden_states, weights, ids)
        return self.tp_group.all_reduce(out) if self.tp_group.size > 1 else out


class GptOssForCausalLM(MoeForCausalLM):
    # MXFP4 checkpoints: each layer's stacked experts as blocks and scales, loaded whole by the MXFP4 method
    checkpoint_renames = {f"experts.{hf}_{part}": f"experts.{ours}_{part}" for hf, ours in _MXFP4 for part in _PARTS}

    def __init__(self, config: Any):
        check_supported(config)
        super().__init__(config)

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return GptOssAttention(config, layer_idx)

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        return GptOssMLP(config)

    def split_fused_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """The stacked float experts as per-expert HF names (gate and up de-interleaved, transposed to [out, in]);
        MXFP4 blocks and scales pass whole, as stored (the MXFP4 method's loader takes them so)."""
        for name, tensor in weights:
            if ".mlp.experts." not in name or name.endswith(("_blocks", "_scales")):
                yield name, tensor
                continue
            prefix, stacked = name.rsplit(".", 1)
            for e in range(tensor.shape[0]):
                t = tensor[e]
                if stacked == "gate_up_proj":  # [hidden, 2I]
                    yield f"{prefix}.{e}.gate_proj.weight", t[:, ::2].t()
                    yield f"{prefix}.{e}.up_proj.weight", t[:, 1::2].t()
                elif stacked == "gate_up_proj_bias":  # [2I]
                    yield f"{prefix}.{e}.gate_proj.bias", t[::2]
                    yield f"{prefix}.{e}.up_proj.bias", t[1::2]
                elif stacked == "down_proj":  # [I, hidden]
                    yield f"{prefix}.{e}.down_proj.weight", t.t()
                elif stacked == "down_proj_bias":  # [hidden]
                    yield f"{prefix}.{e}.down_proj.bias", t
                else:
                    raise KeyError(f"checkpoint weight {name!r} is not a gpt-oss expert tensor")
