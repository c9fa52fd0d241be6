"""A CPU decode step's whole llama-family decoder stack in one C call (kernels/cpu/decoder_stack.py).

The layer-by-layer path of the quantized CPU model makes ~300 Python-level calls per 30-layer step (ten
ctypes calls and several torch allocations and views per layer), about a third of the default model's
decode step. The C stack calls the same kernels in the same order, so its hidden states equal that path's
to the bit. Layer pointers (packed weights, norms, rotary tables, KV cache views) are gathered once into
ctypes descriptors and re-gathered only when the runner binds a new KV cache.

Taken for a step whose every row is a decode row (one new token per sequence, or a CPU verify step's
per-token rows) on float32 activations over the bf16 paged cache; every other step runs the model's layers.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from novainfer.attention import cpu_backend
from novainfer.attention.metadata import AttentionMetadata, get_attention_metadata
from novainfer.kernels.cpu.decoder_stack import DecoderLayerDesc, DecoderStackKernel, qlinear_desc
from novainfer.layers.activation import SiluAndMul
from novainfer.layers.layernorm import RMSNorm
from novainfer.layers.rotary import RotaryEmbedding
from novainfer.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel


def plain_llama_layers(model: LlamaModel) -> bool:
    """Whether every piece of the model is the plain llama one a fused stack computes (exact classes: a family
    that overrides one, e.g. Gemma's norms or Qwen3's q/k norms, keeps the layer-by-layer path), on one rank."""
    if model.embed_scale is not None or type(model.norm) is not RMSNorm:
        return False
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (
            type(layer) is not LlamaDecoderLayer
            or type(attn) is not LlamaAttention
            or attn.qk_norm
            or type(mlp) is not LlamaMLP
            or type(mlp.act_fn) is not SiluAndMul
            or type(attn.rotary_emb) is not RotaryEmbedding
            or any(type(n) is not RMSNorm for n in (layer.input_layernorm, layer.post_attention_layernorm))
            or any(lin.tp_size != 1 for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
        ):
            return False
    return True


def supports(model: LlamaModel) -> bool:
    """Whether every layer is exactly what the C stack computes (quantized weights, the fused CPU ops)."""
    if not len(model.layers) or not plain_llama_layers(model) or not model.norm.fused_cpu:
        return False
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms, rope = (layer.input_layernorm, layer.post_attention_layernorm), attn.rotary_emb
        if (
            not mlp.act_fn.fused_cpu
            or not rope.fused_cpu
            or rope.cos_cache.dtype != torch.float32
            or attn.head_dim % 8
            or any(not n.fused_cpu or n.weight.dtype != torch.float32 for n in norms)
        ):
            return False
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if getattr(lin.weight, "packed", None) is None or (
                lin.bias is not None and (lin.bias.dtype != torch.float32 or not lin.bias.is_contiguous())
            ):
                return False
    return True


class CPUDecodeStack:
    """The C decode path of one LlamaModel (which supports() it); holds its layer descriptors and workspace."""

    def __init__(self, model: LlamaModel):
        self.model = model
        self.attns = [layer.self_attn.attn for layer in model.layers]  # (nn.Module attribute reads are slow)
        self.caches: tuple[weakref.ref, ...] = ()  # the KV cache views the descriptors point into
        self.kernel: DecoderStackKernel | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The final-normed hidden states [M, H] of a decode step, or None where this step needs the layers."""
        meta = get_attention_metadata()
        if not isinstance(meta, AttentionMetadata):
            return None  # the core API's SLOT cache
        if meta.per_token is not None:
            meta = meta.per_token
        elif meta.max_query_len != 1 or meta.num_seqs != input_ids.shape[0]:
            return None
        if not self._bind():
            return None
        embeds = self.model.embed_tokens(input_ids)
        if embeds.dtype != torch.float32 or embeds.dim() != 2 or not embeds.is_contiguous():
            return None
        return self.kernel.run(
            self.model.norm.weight,
            self.model.norm.eps,
            embeds,
            positions,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
        )

    def _bind(self) -> bool:
        """(Re)fill the descriptors when the runner bound another KV cache; False if it is not the bf16 cache
        the C attention reads."""
        attns = self.attns
        if len(self.caches) == len(attns) and all(a.k_cache is c() for a, c in zip(attns, self.caches)):
            return True
        if not c_attention_caches(attns):
            return False
        layers = (DecoderLayerDesc * len(attns))()
        for desc, layer in zip(layers, self.model.layers):
            sa, mlp = layer.self_attn, layer.mlp
            a, rope = sa.attn, sa.rotary_emb
            desc.input_norm, desc.input_eps = layer.input_layernorm.weight.data_ptr(), layer.input_layernorm.eps
            desc.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            desc.post_eps = layer.post_attention_layernorm.eps
            desc.qkv, desc.o = _qlinear(sa.qkv_proj), _qlinear(sa.o_proj)
            desc.gate_up, desc.down = _qlinear(mlp.gate_up_proj), _qlinear(mlp.down_proj)
            desc.k_cache, desc.v_cache = a.k_cache.data_ptr(), a.v_cache.data_ptr()
            desc.cos, desc.sin = rope.cos_cache.data_ptr(), rope.sin_cache.data_ptr()
            desc.max_pos = rope.cos_cache.shape[0]
            desc.nh, desc.nkv, desc.D = a.num_heads, a.num_kv_heads, a.head_dim
            desc.block_size, desc.window = a.k_cache.shape[1], a.sliding_window or 0
            desc.scale, desc.soft_cap = a.scale, a.logits_soft_cap or 0.0
        # weak: a cache the runner releases must be freed (its views are then re-checked and re-gathered)
        self.caches = tuple(weakref.ref(a.k_cache) for a in attns)
        self.kernel = DecoderStackKernel(layers, min(min(a.k_cache.shape[0], a.v_cache.shape[0]) for a in attns))
        return True


def c_attention_caches(attns: list) -> bool:
    """Whether every Attention layer's cache is the contiguous bf16 [blocks, block_size, kv_heads, D] cache of the
    CPU backend, which the C attention reads."""
    return all(
        a.backend is cpu_backend
        and a.k_cache.dtype == torch.bfloat16
        and a.k_cache.dim() == 4
        and a.k_cache.is_contiguous()
        and a.v_cache.is_contiguous()
        for a in attns
    )


def _qlinear(layer: nn.Module):
    return qlinear_desc(layer.weight.packed, layer.bias)
