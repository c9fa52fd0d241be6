"""A CPU decode step's whole Gemma 4 decoder stack in one C call (kernels/cpu/gemma4_stack.py): the counterpart of
cpu_decode_stack.py for models/gemma4.py's dense models (PLE, KV-shared layers, k = v full layers, sliding windows,
grouped KV layouts).

The layer-by-layer path takes ~30 Python-level calls a Gemma 4 layer (norms after every block, q/k/v norms, the
per-layer input), over 1000 a 35-layer E2B step; the C stack calls the same kernels in the same order, so its hidden
states equal that path's to the bit. The embeddings and the per-layer inputs are computed by the model's own
modules first. Taken for a step whose every row is a decode row (one new token per sequence) on float32 activations
over the bf16 paged cache; every other step (prefill, chunks, verify steps, MoE models) runs the model's layers.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from novainfer.attention.metadata import AttentionMetadata, get_attention_metadata
from novainfer.kernels.cpu.decoder_stack import qlinear_desc
from novainfer.kernels.cpu.gemma4_stack import Gemma4LayerDesc, Gemma4StackKernel
from novainfer.layers.rotary import RotaryEmbedding
from novainfer.models.gemma4 import Gemma4Model, Gemma4RMSNorm
from novainfer.worker.cpu_decode_stack import c_attention_caches


def _linears(layer: nn.Module) -> list[nn.Module]:
    sa, mlp = layer.self_attn, layer.mlp
    out = [sa.q_proj if sa.shared else sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return out + ([layer.per_layer_input_gate, layer.per_layer_projection] if layer.ple_size else [])


def _norms(layer: nn.Module) -> list[nn.Module]:
    sa = layer.self_attn
    out = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm]
    out += [layer.post_feedforward_layernorm, sa.q_norm] + ([] if sa.shared else [sa.k_norm])
    return out + ([layer.post_per_layer_input_norm] if layer.ple_size else [])


def supports(model: nn.Module) -> bool:
    """Whether model is a dense Gemma 4 stack of exactly what the C stack computes (quantized weights on one rank,
    the fused CPU ops, GELU-tanh, no biases)."""
    if not isinstance(model, Gemma4Model) or not len(model.layers) or type(model.norm) is not Gemma4RMSNorm:
        return False
    if not model.norm.fused_cpu or model.norm.weight.dtype != torch.float32:
        return False
    for layer in model.layers:
        sa, mlp = layer.self_attn, layer.mlp
        rope = sa.rotary_emb
        if (
            layer.moe
            or layer.gelu != "tanh"
            or not getattr(mlp.act_fn, "fused_cpu", False)
            or type(rope) is not RotaryEmbedding
            or not rope.fused_cpu
            or rope.cos_cache.dtype != torch.float32
            or sa.head_dim % 8
            or sa.attn.logits_soft_cap is not None
            or sa.attn.sinks is not None
            or sa.attn.scale != 1.0
            or layer.layer_scalar.dtype != torch.float32
            or (not sa.shared and getattr(sa.v_norm, "ones", None) is None)
        ):
            return False
        if any(not n.fused_cpu or n.weight is None or n.weight.dtype != torch.float32 for n in _norms(layer)):
            return False
        for lin in _linears(layer):
            if lin.tp_size != 1 or lin.bias is not None or getattr(lin.weight, "packed", None) is None:
                return False
    return True


class CPUGemma4Stack:
    """The C decode path of one Gemma4Model (which supports() it); holds its layer descriptors and workspace."""

    kv_groups = True  # reads each layer's KV group's tables and slots (a grouped layout is fine)

    def __init__(self, model: Gemma4Model):
        self.model = model
        self.attns = [layer.self_attn.attn for layer in model.layers]
        self.owners = [a if a.kv_source is None else a.kv_source for a in self.attns]
        self.caches: tuple[weakref.ref, ...] = ()
        self.kernel: Gemma4StackKernel | None = None
        self.num_groups = 1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The final-normed hidden states [M, H] of a decode step, or None where this step needs the layers."""
        meta = get_attention_metadata()
        if not isinstance(meta, AttentionMetadata) or meta.per_token is not None:
            return None
        if meta.max_query_len != 1 or meta.num_seqs != input_ids.shape[0] or not self._bind():
            return None
        model = self.model
        embeds = model.embed_tokens(input_ids) * model.embed_scale
        if embeds.dtype != torch.float32 or embeds.dim() != 2 or not embeds.is_contiguous():
            return None
        ple = model.per_layer_inputs(input_ids, embeds).contiguous() if model.ple_size else None
        groups = meta.groups if meta.groups is not None else [meta]
        if len(groups) < self.num_groups:
            return None
        num_blocks = self.kernel.num_blocks
        step = [(g.slot_mapping, g.block_tables, g.seq_lens, num_blocks) for g in groups[: self.num_groups]]
        return self.kernel.run(model.norm.weight, model.norm.eps, embeds, ple, positions, step)

    def _bind(self) -> bool:
        """(Re)fill the descriptors when the runner bound another KV cache; False if it is not the bf16 cache the
        C attention reads."""
        owners = self.owners
        if len(self.caches) == len(owners) and all(a.k_cache is c() for a, c in zip(owners, self.caches)):
            return True
        if not c_attention_caches(owners):
            return False
        layers = (Gemma4LayerDesc * len(owners))()
        for desc, layer, owner in zip(layers, self.model.layers, owners):
            sa, mlp = layer.self_attn, layer.mlp
            a, rope = sa.attn, sa.rotary_emb
            desc.input_norm = layer.input_layernorm.weight.data_ptr()
            desc.post_attn_norm = layer.post_attention_layernorm.weight.data_ptr()
            desc.pre_ff_norm = layer.pre_feedforward_layernorm.weight.data_ptr()
            desc.post_ff_norm = layer.post_feedforward_layernorm.weight.data_ptr()
            desc.q_norm = sa.q_norm.weight.data_ptr()
            desc.eps, desc.layer_scalar = layer.input_layernorm.eps, float(layer.layer_scalar)
            desc.own_kv, desc.k_eq_v = int(not sa.shared), int(not sa.shared and sa.k_eq_v)
            if not sa.shared:
                desc.k_norm, desc.ones = sa.k_norm.weight.data_ptr(), sa.v_norm.ones.data_ptr()
            desc.qkv = qlinear_desc((sa.q_proj if sa.shared else sa.qkv_proj).weight.packed, None)
            desc.o = qlinear_desc(sa.o_proj.weight.packed, None)
            desc.gate_up = qlinear_desc(mlp.gate_up_proj.weight.packed, None)
            desc.down = qlinear_desc(mlp.down_proj.weight.packed, None)
            desc.ple = int(bool(layer.ple_size))
            if layer.ple_size:
                desc.ple_gate = qlinear_desc(layer.per_layer_input_gate.weight.packed, None)
                desc.ple_proj = qlinear_desc(layer.per_layer_projection.weight.packed, None)
                desc.ple_norm = layer.post_per_layer_input_norm.weight.data_ptr()
            desc.k_cache, desc.v_cache = owner.k_cache.data_ptr(), owner.v_cache.data_ptr()
            desc.cos, desc.sin = rope.cos_cache.data_ptr(), rope.sin_cache.data_ptr()
            desc.max_pos = rope.cos_cache.shape[0]
            desc.nh, desc.nkv, desc.D = a.num_heads, a.num_kv_heads, a.head_dim
            desc.block_size, desc.window = owner.k_cache.shape[1], a.sliding_window or 0
            desc.group = owner.kv_group
        self.num_groups = 1 + max(o.kv_group for o in owners)
        self.caches = tuple(weakref.ref(a.k_cache) for a in owners)
        self.kernel = Gemma4StackKernel(layers, self.num_groups)
        self.kernel.num_blocks = min(min(a.k_cache.shape[0], a.v_cache.shape[0]) for a in owners)
        return True
