"""Gemma 4 text models (E2B, E4B, 26B-A4B MoE, 31B), and the language model of Gemma 4's multimodal checkpoints.

Against Gemma 3: attention scale 1 with q, k and (weightless) v RMS norms; RMSNorm weights multiply as they are
(no 1 + w); sliding layers use the default rope, full layers their own head size, KV head count and
proportional (partial) rope; on full layers of attention_k_eq_v models the key projection is the value too.
The last num_kv_shared_layers layers compute no K/V: each reads the cache of the last earlier layer of its
type (Attention's kv_source) and, with use_double_wide_mlp, has an MLP twice as wide. Per-layer embeddings
(PLE): a second token table plus a projection of the embeddings give each layer a small input, gated into
the residual after the MLP. MoE models run a dense MLP and routed experts side by side in every layer. Each
layer's output is scaled by its layer_scalar; final logits are soft-capped.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from novainfer.distributed import get_tp_group
from novainfer.kernels.cpu import ops as cpu_ops
from novainfer.layers.activation import GeluAndMul
from novainfer.layers.attention import Attention
from novainfer.layers.embedding import VocabParallelEmbedding
from novainfer.layers.fused_moe import FusedMoE
from novainfer.layers.fused_moe.routing import select_experts
from novainfer.layers.layernorm import GemmaRMSNorm, RMSNorm
from novainfer.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    _divide,
)
from novainfer.layers.quantization import current_quant_config
from novainfer.layers.rotary import get_rope
from novainfer.models.llama import LlamaMLP, sliding_window_of
from novainfer.models.moe import MoeForCausalLM

logger = logging.getLogger(__name__)

_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu": "none"}
# parts of a ForConditionalGeneration checkpoint that are not its language model
_MULTIMODAL_PREFIX = "model.language_model."


class Gemma4RMSNorm(GemmaRMSNorm):
    """x * rsqrt(mean(x^2) + eps) * weight in float32, cast back; with_scale=False has no weight (v norm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__(hidden_size, eps)
        if with_scale:
            self.weight.data.fill_(1.0)
        else:
            del self.weight
            self.register_parameter("weight", None)
            if self.fused_cpu:  # the C op's weight: times one is exact
                self.register_buffer("ones", torch.ones(hidden_size), persistent=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (xf if self.weight is None else xf * self.weight.float()).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Gemma's forward, but on the quantized CPU path RMSNorm's C op with the weight as stored (not 1 + w), or
        for the weightless v norm a weight of ones."""
        if self.fused_cpu and self.weight is not None:
            return RMSNorm.forward(self, x, residual)
        if self.fused_cpu and residual is None and cpu_ops.usable(x):
            return cpu_ops.add_rms_norm(x, None, self.ones, self.eps)[0]
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x): on the quantized CPU path one C pass (the same bits)."""
        w = self.weight
        if (
            self.fused_cpu
            and w is not None
            and w.dtype == torch.float32
            and cpu_ops.usable(x)
            and cpu_ops.usable(residual)
        ):
            return cpu_ops.rms_norm_add(x, self.weight, self.eps, residual)
        return residual + self(x)


class Gemma4GeluAndMul(GeluAndMul):
    """GELU-tanh gate of Gemma 4's MLPs: on the quantized CPU path the C op (the one the decode stack calls)."""

    def __init__(self):
        super().__init__("tanh")
        self.fused_cpu = getattr(current_quant_config(), "fused_cpu_ops", False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_cpu and cpu_ops.usable(x):
            d = x.shape[-1] // 2
            x2 = x.reshape(-1, 2 * d)
            return cpu_ops.gelu_tanh_mul(x2[:, :d], x2[:, d:]).view(*x.shape[:-1], d)
        return super().forward(x)


def check_supported(config: Any) -> None:
    """Refuse, naming the field, what this implementation does not run."""
    if getattr(config, "use_bidirectional_attention", None) == "all":
        raise NotImplementedError("Gemma 4 use_bidirectional_attention='all' is not supported (causal text only)")
    act = getattr(config, "hidden_activation", None) or config.hidden_act
    if act not in _GELU:
        raise NotImplementedError(f"Gemma 4 hidden_activation={act!r} is not supported")
    spec = vars(config).get("_heterogeneity_spec")  # transformers' per_layer_config: what differs per layer
    unread = sorted(set(getattr(spec, "per_layer_attributes", ())) - {"head_dim", "num_key_value_heads"})
    if unread:
        raise NotImplementedError(
            f"Gemma 4 per_layer_config overrides {unread}: only head_dim and "
            "num_key_value_heads may differ per layer here"
        )
    shared = config.num_kv_shared_layers or 0
    if shared >= config.num_hidden_layers:
        raise NotImplementedError(f"num_kv_shared_layers={shared} leaves no layer that computes K/V")
    if config.enable_moe_block and not (config.num_experts and config.top_k_experts and config.moe_intermediate_size):
        raise ValueError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")


def layer_config(config: Any, layer_idx: int) -> Any:
    """The config as one layer sees it (transformers' per_layer_config: full layers' head_dim and KV heads)."""
    per_layer = getattr(config, "per_layer_config", None)
    return per_layer[layer_idx] if per_layer is not None else config


def kv_source_layers(config: Any) -> dict[int, int]:
    """Each KV-shared layer -> the layer whose cache it reads: the last non-shared layer of its type."""
    first_shared = config.num_hidden_layers - (config.num_kv_shared_layers or 0)
    types = config.layer_types
    last = {t: i for i, t in enumerate(types[:first_shared])}
    missing = sorted({t for t in types[first_shared:] if t not in last})
    if missing:
        raise ValueError(f"num_kv_shared_layers: no earlier layer of type {missing} to share K/V from")
    return {i: last[types[i]] for i in range(first_shared, config.num_hidden_layers)}


class QKParallelLinear(MergedColumnParallelLinear):
    """q and k projections fused, no v (attention_k_eq_v: the key projection is the value too); checkpoint
    shards 'q' and 'k' as QKVParallelLinear names them."""

    shard_order = ["q", "k"]

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim], bias)
        self.shard_order = ["q", "k"]  # (the parent sets its own, by index: a quantized q/k would never be merged)
        self.num_heads = _divide(num_heads, self.tp_size, "num_attention_heads")
        self.num_kv_heads = _divide(num_kv_heads, self.tp_size, "num_key_value_heads")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        super().weight_loader(param, loaded, {"q": 0, "k": 1}[shard_id])


class Gemma4Attention(nn.Module):
    """Scale-1 attention over normed q/k/v, the layer type's window and rope; a KV-shared layer projects only
    q and attends over kv_source's cache."""

    def __init__(self, config: Any, layer_idx: int, kv_source: Attention | None):
        super().__init__()
        layer_type = config.layer_types[layer_idx]
        lc = layer_config(config, layer_idx)
        self.head_dim = lc.head_dim
        num_kv_heads = lc.num_key_value_heads
        bias = bool(config.attention_bias)
        self.shared = kv_source is not None
        self.k_eq_v = bool(config.attention_k_eq_v) and layer_type != "sliding_attention"
        if self.shared:  # only the query: K/V come from kv_source's cache
            self.q_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads * self.head_dim, bias)
            self.num_heads = self.q_proj.output_size // self.head_dim
            self.num_kv_heads = kv_source.num_kv_heads
        else:
            proj = QKParallelLinear if self.k_eq_v else QKVParallelLinear
            self.qkv_proj = proj(config.hidden_size, self.head_dim, config.num_attention_heads, num_kv_heads, bias)
            self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
            self.k_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, config, layer_type)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            1.0,
            self.num_kv_heads,
            sliding_window=sliding_window_of(config, layer_type),
            kv_source=kv_source,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.shared:
            q = self.q_norm(self.q_proj(hidden_states).view(-1, self.num_heads, self.head_dim))
            # the rotary module rotates a key too (in place on some paths): a one-head scratch copy
            q, _ = self.rotary_emb(positions, q, q[:, :1].clone())
            return self.o_proj(self.attn(q, None, None))
        if self.k_eq_v:
            q, k = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size], dim=-1)
            v = k
        else:
            q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        v = self.v_norm(v.reshape(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Gemma4Router(nn.Module):
    """Top-k experts of rms_norm(x) * scale / sqrt(hidden), renormalised, then scaled per expert."""

    def __init__(self, config: Any):
        super().__init__()
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.proj = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.scale = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts), requires_grad=False)
        self.root_size, self.top_k = config.hidden_size**-0.5, config.top_k_experts

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(self.norm(hidden_states) * self.scale * self.root_size)
        weights, ids = select_experts(logits, self.top_k, True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(nn.Module):
    """Pre/post-normed attention and MLP (plus, in MoE models, routed experts beside the MLP), then the
    per-layer input gated in, then the whole hidden state times layer_scalar (so no residual is carried)."""

    def __init__(self, config: Any, layer_idx: int, kv_source: Attention | None):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer_idx, kv_source)
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        wide = 2 if config.use_double_wide_mlp and kv_source is not None else 1
        self.mlp = LlamaMLP(h, config.intermediate_size * wide, act)
        if _GELU[act] == "tanh":
            self.mlp.act_fn = Gemma4GeluAndMul()
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            setattr(self, name, Gemma4RMSNorm(h, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.gelu = _GELU[act]
        self.ple_size = config.hidden_size_per_layer_input or 0
        if self.ple_size:
            self.per_layer_input_gate = ReplicatedLinear(h, self.ple_size)
            self.per_layer_projection = ReplicatedLinear(self.ple_size, h)
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, eps)
        self.moe = bool(config.enable_moe_block)
        if self.moe:
            self.tp_group = get_tp_group()
            self.router = Gemma4Router(config)
            self.experts = FusedMoE(
                config.num_experts, config.top_k_experts, h, config.moe_intermediate_size, True, act
            )
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, per_layer_input: torch.Tensor | None
    ) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden_states))
        residual = self.post_attention_layernorm.add_to(hidden_states, attn)
        out = self.mlp(self.pre_feedforward_layernorm(residual))
        if self.moe:
            weights, ids = self.router(residual)
            routed = self.experts.apply_routed(self.pre_feedforward_layernorm_2(residual), weights, ids)
            if self.tp_group.size > 1:
                routed = self.tp_group.all_reduce(routed)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        hidden_states = self.post_feedforward_layernorm.add_to(residual, out)
        if self.ple_size:
            gate = self.per_layer_input_gate(hidden_states)
            fused = getattr(self.mlp.act_fn, "fused_cpu", False)  # the C op of the MLP's gate
            if fused and cpu_ops.usable(gate) and cpu_ops.usable(per_layer_input):
                gate = cpu_ops.gelu_tanh_mul(gate, per_layer_input)
            else:
                gate = F.gelu(gate, approximate=self.gelu) * per_layer_input
            hidden_states = self.post_per_layer_input_norm.add_to(hidden_states, self.per_layer_projection(gate))
        return hidden_states * self.layer_scalar


class Gemma4Model(nn.Module):
    """Scaled embeddings, the per-layer inputs (PLE), the decoder layers, the final norm."""

    def __init__(self, config: Any):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h)
        # rounded to the model's dtype, as transformers rounds it
        self.register_buffer("embed_scale", torch.tensor(h**0.5), persistent=False)
        sources = kv_source_layers(config)
        layers: list[Gemma4DecoderLayer] = []
        for i in range(config.num_hidden_layers):
            source = layers[sources[i]].self_attn.attn if i in sources else None
            layers.append(Gemma4DecoderLayer(config, i, source))
        self.layers = nn.ModuleList(layers)
        self.norm = Gemma4RMSNorm(h, eps)
        self.ple_size = config.hidden_size_per_layer_input or 0
        if self.ple_size:
            width = config.num_hidden_layers * self.ple_size
            self.embed_tokens_per_layer = VocabParallelEmbedding(config.vocab_size_per_layer_input, width)
            self.register_buffer("ple_embed_scale", torch.tensor(self.ple_size**0.5), persistent=False)
            self.per_layer_model_projection = ReplicatedLinear(h, width)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.ple_size, eps)
            self.projection_scale = h**-0.5

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[tokens, layers, ple_size]: the token's own per-layer embedding averaged with a projection of its
        embedding (both scaled as transformers scales them)."""
        shape = (input_ids.shape[0], len(self.layers), self.ple_size)
        own = (self.embed_tokens_per_layer(input_ids) * self.ple_embed_scale).reshape(shape)
        projected = self.per_layer_projection_norm(
            (self.per_layer_model_projection(embeds) * self.projection_scale).reshape(shape)
        )
        return (projected + own) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) * self.embed_scale
        ple = self.per_layer_inputs(input_ids, hidden_states) if self.ple_size else None
        for i, layer in enumerate(self.layers):
            hidden_states = layer(positions, hidden_states, None if ple is None else ple[:, i])
        return self.norm(hidden_states)


def per_expert(name: str, stack: Any) -> Iterator[tuple[str, Any]]:
    """experts.gate_up_proj [E, 2I, H] (gate rows, then up) / experts.down_proj [E, H, I] as experts.e.<proj>.weight:
    row slices of a tensor, or of a GGUF file's rows of blocks (loader/gguf_gemma4.py)."""
    prefix = name[: name.rindex(".") + 1]
    for e in range(stack.shape[0]):
        if name.endswith("gate_up_proj"):
            half = stack.shape[1] // 2
            yield f"{prefix}{e}.gate_proj.weight", stack[e, :half]
            yield f"{prefix}{e}.up_proj.weight", stack[e, half:]
        else:
            yield f"{prefix}{e}.down_proj.weight", stack[e]


class Gemma4ForCausalLM(MoeForCausalLM):
    """Gemma4ForCausalLM checkpoints, and Gemma4ForConditionalGeneration ones as their language model (the
    vision and audio towers' weights are skipped)."""

    def __init__(self, config: Any):
        check_supported(config)
        super().__init__(config)
        self.multimodal = any("ConditionalGeneration" in a for a in getattr(config, "architectures", None) or [])
        self.shared_layers = set(kv_source_layers(config))
        first_shared = config.num_hidden_layers - len(self.shared_layers)
        self.k_eq_v_layers = {
            i
            for i, t in enumerate(config.layer_types[:first_shared])
            if config.attention_k_eq_v and t != "sliding_attention"
        }

    def make_model(self, config: Any) -> Gemma4Model:
        return Gemma4Model(config)

    # ---- weights --------------------------------------------------------------------------------------
    def split_fused_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """HF names as the Llama/MoE routing takes them: the language model's prefix dropped, other towers
        skipped, stacked experts per expert, and the K/V weights a KV-shared layer does not use dropped."""
        skipped = 0
        for name, tensor in weights:
            if self.multimodal:
                if name.startswith(_MULTIMODAL_PREFIX):
                    name = "model." + name[len(_MULTIMODAL_PREFIX) :]
                elif name != "lm_head.weight":
                    skipped += 1
                    continue
            parts = name.split(".")
            layer = int(parts[2]) if name.startswith("model.layers.") else None
            if layer in self.shared_layers and len(parts) > 4 and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm"):
                continue
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                yield from per_expert(name, tensor)
                continue
            yield name, tensor
        if skipped:
            logger.info("Gemma 4: skipped %d vision/audio weights (the language model runs alone)", skipped)

    def expected_weight_names(self) -> set[str]:
        """A k_eq_v layer has no v_proj."""
        return {
            n
            for n in super().expected_weight_names()
            if not (".self_attn.v_proj." in n and int(n.split(".")[2]) in self.k_eq_v_layers)
        }

    def param_target(self, name: str) -> tuple[str, Any]:
        """A KV-shared layer's own q_proj is not fused into a qkv_proj."""
        if ".self_attn.q_proj." in name and int(name.split(".")[2]) in self.shared_layers:
            return name, None
        return super().param_target(name)
