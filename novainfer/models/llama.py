"""Llama-family decoder (Llama, and through flags Qwen2 and Qwen3): forward only, weights by name.

The Qwen models differ from Llama in two switches: Qwen2 puts a bias on q/k/v, Qwen3 RMS-normalises
each head of q and k before rotary. Subclasses set them; everything else is shared.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from novainfer.layers.activation import SiluAndMul
from novainfer.layers.attention import Attention
from novainfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from novainfer.layers.layernorm import RMSNorm
from novainfer.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from novainfer.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          num_kv_heads, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=getattr(config, "o_proj_bias", False))
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, config)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

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
    def __init__(self, config: Any):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, qkv_bias, qk_norm)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    # HF checkpoint name -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        qkv_bias = self.qkv_bias or getattr(config, "attention_bias", False)
        self.model = LlamaModel(config, qkv_bias, self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states for every token; the runner picks the rows that need logits."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Route each HF tensor to its (possibly fused) parameter; returns the HF names expected but not seen."""
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = self.expected_weight_names()
        seen: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            target, shard_id = name, None
            for hf_part, (ours, shard) in self.packed_modules_mapping.items():
                if f".{hf_part}." in name:
                    target, shard_id = name.replace(f".{hf_part}.", f".{ours}."), shard
                    break
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

    def expected_weight_names(self) -> set[str]:
        """The HF checkpoint names this model needs, unfused."""
        names = set()
        unpack = {ours: [hf for hf, (o, _) in self.packed_modules_mapping.items() if o == ours]
                  for ours, _ in self.packed_modules_mapping.values()}
        for name, _ in self.named_parameters():
            for ours, hf_parts in unpack.items():
                if f".{ours}." in name:
                    names.update(name.replace(f".{ours}.", f".{hf}.") for hf in hf_parts)
                    break
            else:
                names.add(name)
        if self.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names
