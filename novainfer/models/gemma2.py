"""Gemma 2: the Llama pieces with Gemma's changes.

Embeddings scaled by sqrt(hidden_size), RMSNorm with (1 + weight), norms before and after both the
attention and the MLP, a GELU-tanh MLP, attention scaled by query_pre_attn_scalar^-0.5 with logit
soft-capping, a sliding window on the config's sliding layers, and soft-capped final logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from novainfer.layers.layernorm import GemmaRMSNorm
from novainfer.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


class Gemma2DecoderLayer(LlamaDecoderLayer):
    """x + post_ff(mlp(pre_ff(h))) with h = x + post_attn(attn(input_norm(x))); the residual adds are
    fused into the next norm, as in the Llama layer."""

    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module):
        super().__init__(config, self_attn, mlp, GemmaRMSNorm)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        hidden_states, residual = self.input_norm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    def make_model(self, config: Any) -> LlamaModel:
        return LlamaModel(config, self.make_layer, embed_scale=config.hidden_size**0.5, norm_cls=GemmaRMSNorm)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        return Gemma2DecoderLayer(config, self.make_attention(config, layer_idx), self.make_mlp(config, layer_idx))

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaAttention(
            config,
            layer_idx,
            qkv_bias=getattr(config, "attention_bias", False),
            qk_norm=self.qk_norm,
            scale=config.query_pre_attn_scalar**-0.5,
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
            norm_cls=GemmaRMSNorm,
        )

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        return LlamaMLP(config.hidden_size, config.intermediate_size, act)
