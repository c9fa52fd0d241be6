"""Llama-family decoder (Llama, and through flags Qwen2 and Qwen3): forward only, weights by name.

The Qwen models differ from Llama in two switches: Qwen2 puts a bias on q/k/v, Qwen3 RMS-normalises
each head of q and k before rotary. Other families build on the same pieces through the make_* hooks
(their own attention scale, soft-cap, norms, MLP or MoE per layer); the sliding window and the rotary
base of a layer come from the config (layer_types, sliding_window, rope_parameters).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from novainfer.layers.activation import get_act_and_mul
from novainfer.layers.attention import Attention
from novainfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from novainfer.layers.layernorm import RMSNorm
from novainfer.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from novainfer.layers.rotary import get_rope


def layer_type_of(config: Any, layer_idx: int) -> str | None:
    """'sliding_attention' / 'full_attention' where the config lists layer types, else None."""
    types = getattr(config, "layer_types", None)
    return types[layer_idx] if types else None


def sliding_window_of(config: Any, layer_type: str | None) -> int | None:
    """The layer's window: the config's sliding_window on its sliding layers, or on every layer of a
    config without layer types (Mistral, Mixtral, Phi-3); None (or 0) means full attention."""
    window = getattr(config, "sliding_window", None) or None
    if window is None or layer_type is None:
        return window
    return window if layer_type == "sliding_attention" else None


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int = 0,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        scale: float | None = None,
        logits_soft_cap: float | None = None,
        norm_cls: type[RMSNorm] = RMSNorm,
    ):
        super().__init__()
        layer_type = layer_type_of(config, layer_idx)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, num_kv_heads, bias=qkv_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=getattr(config, "o_proj_bias", False)
        )
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, config, layer_type)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            scale or self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=sliding_window_of(config, layer_type),
            logits_soft_cap=logits_soft_cap,
        )
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = norm_cls(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm_cls(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    """down(act(gate) * up); reduce_results=False leaves the tensor-parallel sum to the caller."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce_results=reduce_results)
        self.act_fn = get_act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module, norm_cls: type[RMSNorm] = RMSNorm):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)

    def input_norm(self, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        """(input_layernorm(h + residual), h + residual); the first layer has no residual yet."""
        if residual is None:
            return self.input_layernorm(hidden_states), hidden_states
        return self.input_layernorm(hidden_states, residual)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        hidden_states, residual = self.input_norm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding (times embed_scale, when given), the decoder layers make_layer builds, the final norm."""

    def __init__(
        self,
        config: Any,
        make_layer: Callable[[Any, int], nn.Module],
        embed_scale: float | None = None,
        norm_cls: type[RMSNorm] = RMSNorm,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm_cls(config.hidden_size, config.rms_norm_eps)
        # rounded to the model's dtype as transformers rounds it (Gemma: sqrt(hidden_size))
        self.register_buffer(
            "embed_scale", None if embed_scale is None else torch.tensor(embed_scale), persistent=False
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            hidden_states = hidden_states * self.embed_scale
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    # HF checkpoint name -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    checkpoint_renames: dict[str, str] = {}  # HF name fragment -> ours, where a family names a module otherwise

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.model = self.make_model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_soft_cap = getattr(config, "final_logit_softcapping", None)

    # ---- hooks the other families override ---------------------------------------------------------
    def make_model(self, config: Any) -> LlamaModel:
        return LlamaModel(config, self.make_layer)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaDecoderLayer(config, self.make_attention(config, layer_idx), self.make_mlp(config, layer_idx))

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        qkv_bias = self.qkv_bias or getattr(config, "attention_bias", False)
        return LlamaAttention(config, layer_idx, qkv_bias=qkv_bias, qk_norm=self.qk_norm)

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"))

    # ---- forward --------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states for every token; the runner picks the rows that need logits."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        if self.final_logit_soft_cap:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.final_logit_soft_cap) * self.final_logit_soft_cap
        return logits

    # ---- weights --------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Route each HF tensor to its (possibly fused) parameter; returns the HF names expected but not seen."""
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = self.expected_weight_names()
        seen: set[str] = set()
        for name, tensor in self.split_fused_weights(weights):
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            target, shard_id = self.param_target(name)
            param = params.get(target)
            if param is None:
                raise KeyError(f"checkpoint weight {name!r} has no parameter in {type(self).__name__}")
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            elif shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
            seen.add(name)
        return expected - seen

    def split_fused_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Checkpoint tensors as unfused HF names; a family that ships fused tensors (Phi-3) splits them here."""
        return weights

    def param_target(self, name: str) -> tuple[str, Any]:
        """Our parameter for an HF checkpoint name, and the shard id its weight_loader takes (None: whole)."""
        for hf, ours in self.checkpoint_renames.items():
            name = name.replace(hf, ours)
        for hf_part, (ours, shard) in self.packed_modules_mapping.items():
            if f".{hf_part}." in name:
                return name.replace(f".{hf_part}.", f".{ours}."), shard
        return name, None

    def checkpoint_names(self, param_name: str) -> list[str]:
        """The HF checkpoint names that fill one of our parameters (the inverse of param_target)."""
        names = [param_name]
        for hf_part, (ours, _) in self.packed_modules_mapping.items():
            if f".{ours}." in param_name:
                names = [n for n in names if f".{ours}." not in n] + [param_name.replace(f".{ours}.", f".{hf_part}.")]
        for hf, ours in self.checkpoint_renames.items():
            names = [n.replace(ours, hf) for n in names]
        return names

    def expected_weight_names(self) -> set[str]:
        """The HF checkpoint names this model needs, unfused."""
        names = {hf for name, _ in self.named_parameters() for hf in self.checkpoint_names(name)}
        if self.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names
