"""A decode step's whole llama-family decoder stack in one C call (csrc/decoder_stack_cpu.c).

The layer-by-layer path of the quantized CPU model makes ~300 Python-level calls per 30-layer step (ten
ctypes calls and several torch allocations and views per layer), about a third of the default model's
decode step. The C stack calls the same kernels in the same order, so its hidden states equal that path's
to the bit. Layer pointers (packed weights, norms, rotary tables, KV cache views) are gathered once into
ctypes descriptors and re-gathered only when the runner binds a new KV cache.

Taken for a step whose every row is a decode row (one new token per sequence, or a CPU verify step's
per-token rows) on float32 activations over the bf16 paged cache; every other step, and every model with a
piece the C stack lacks, runs the layers as before. Switched by ModelConfig.cpu_decode_stack.
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Any

import torch
from torch import nn

from novainfer.attention import cpu_backend
from novainfer.attention.metadata import AttentionMetadata, get_attention_metadata
from novainfer.kernels.cpu import library, ops as cpu_ops

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_ERRORS = {1: (MemoryError, "decoder stack: no memory for a kernel's scratch"),
           2: (ValueError, "decoder stack: a position is outside the rotary table")}
_BAD_KV = 2  # error codes from 3 on: 2 + a bad KV index's code (cpu_ops.kv_index_error)


class QLinearDesc(ctypes.Structure):
    """qlinear of decoder_stack_cpu.c, field for field (scale_f16: float16 scales and zeros)."""
    _fields_ = [("w", _P), ("scales", _P), ("zeros", _P), ("bias", _P), ("q4", _I), ("group", _I),
                ("has_zeros", _I), ("scale_f16", _I), ("N", _I), ("K", _I)]


class DecoderLayerDesc(ctypes.Structure):
    """decoder_layer of decoder_stack_cpu.c, field for field."""
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("input_eps", _F), ("post_eps", _F), ("qkv", QLinearDesc),
                ("o", QLinearDesc), ("gate_up", QLinearDesc), ("down", QLinearDesc), ("k_cache", _P),
                ("v_cache", _P), ("cos", _P), ("sin", _P), ("max_pos", _I), ("nh", _I), ("nkv", _I), ("D", _I),
                ("block_size", _I), ("window", _I), ("scale", _F), ("soft_cap", _F)]


def _qlinear(layer: nn.Module) -> QLinearDesc:
    w = layer.weight.packed
    bias = layer.bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise _Unsupported("a bias that is not a contiguous float32 vector")
    return QLinearDesc(w.qweight.data_ptr(), w.scales.data_ptr(), 0 if w.zeros is None else w.zeros.data_ptr(),
                       0 if bias is None else bias.data_ptr(), int(w.kind == "q4"), w.group,
                       int(w.zeros is not None), int(w.scale_f16), w.shape[0], w.shape[1])


class _Unsupported(Exception):
    """A model piece the C stack does not implement: the model keeps the layer-by-layer path."""


def _check_model(model: nn.Module) -> None:
    """Raises _Unsupported unless every layer is exactly what the C stack computes."""
    from novainfer.layers.activation import SiluAndMul
    from novainfer.layers.layernorm import RMSNorm
    from novainfer.layers.rotary import RotaryEmbedding
    from novainfer.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
    if model.embed_scale is not None or type(model.norm) is not RMSNorm or not model.norm.fused_cpu:
        raise _Unsupported("an embedding scale or another final norm")
    if not len(model.layers):
        raise _Unsupported("no layers")
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (type(layer) is not LlamaDecoderLayer or type(attn) is not LlamaAttention or attn.qk_norm
                or type(mlp) is not LlamaMLP or type(mlp.act_fn) is not SiluAndMul or not mlp.act_fn.fused_cpu):
            raise _Unsupported(f"layer class {type(layer).__name__} / {type(attn).__name__} / {type(mlp).__name__}")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(norm) is not RMSNorm or not norm.fused_cpu or norm.weight.dtype != torch.float32:
                raise _Unsupported("a norm other than the float32 RMSNorm")
        rope = attn.rotary_emb
        if type(rope) is not RotaryEmbedding or not rope.fused_cpu or rope.cos_cache.dtype != torch.float32:
            raise _Unsupported("a rotary embedding other than the plain neox table")
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if getattr(lin.weight, "packed", None) is None or getattr(lin, "tp_size", 1) != 1:
                raise _Unsupported(f"{type(lin).__name__} without a quantized weight")
        if attn.head_dim % 8:
            raise _Unsupported(f"head_dim {attn.head_dim} is not a multiple of 8")


class CPUDecoderStack:
    """The C decode path of one LlamaModel; holds its layer descriptors and workspace, not the model."""

    def __init__(self) -> None:
        self.supported: bool | None = None  # decided at the first decode step, once the weights are loaded
        self.layers: Any = None
        self.attns: list[nn.Module] | None = None
        self.caches: tuple[weakref.ref, ...] = ()  # the KV cache views the descriptors point into
        self.num_blocks = 0  # of the smallest of them: the bound every block id and slot is checked against
        self.workspace = torch.empty(0)
        self.workspace_rows = 0

    def forward(self, model: nn.Module, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The final-normed hidden states [M, H] of a decode step, or None where this step or this model
        needs the layer-by-layer path."""
        meta = get_attention_metadata()
        if not isinstance(meta, AttentionMetadata):
            return None  # the core API's SLOT cache
        m = embeds.shape[0]
        if meta.per_token is not None:
            meta = meta.per_token
        elif meta.max_query_len != 1 or meta.num_seqs != m:
            return None
        if embeds.dtype != torch.float32 or embeds.dim() != 2 or not embeds.is_contiguous():
            return None
        if self.supported is None:
            try:
                _check_model(model)
                self.supported = True
            except _Unsupported:
                self.supported = False
        if not self.supported or not self._bind(model):
            return None
        return self._run(model, embeds, positions, meta)

    def _bind(self, model: nn.Module) -> bool:
        """(Re)fill the descriptors when the runner bound another KV cache; False if it is not the bf16 cache
        the C attention reads."""
        if self.attns is None:
            self.attns = [layer.self_attn.attn for layer in model.layers]  # (nn.Module attribute reads are slow)
        attns = self.attns
        if len(self.caches) == len(attns) and all(a.k_cache is c() for a, c in zip(attns, self.caches)):
            return True
        for a in attns:
            if (a.backend is not cpu_backend or a.k_cache.dtype != torch.bfloat16 or a.k_cache.dim() != 4
                    or not a.k_cache.is_contiguous() or not a.v_cache.is_contiguous()):
                return False
        layers = (DecoderLayerDesc * len(attns))()
        for desc, layer in zip(layers, model.layers):
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
        self.layers, self.caches, self.workspace_rows = layers, tuple(weakref.ref(a.k_cache) for a in attns), 0
        self.num_blocks = min(min(a.k_cache.shape[0], a.v_cache.shape[0]) for a in attns)
        return True

    def _run(self, model: nn.Module, embeds: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata) -> torch.Tensor | None:
        lib = library.library()
        m, h = embeds.shape
        if m > self.workspace_rows:
            rows = max(m, 2 * self.workspace_rows, 1)
            self.workspace = torch.empty(lib.decoder_stack_workspace(self.layers, len(self.layers), rows, h))
            self.workspace_rows = rows
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()  # (its row stride is the width checked)
        lens = meta.seq_lens.to(torch.int32).contiguous()
        out = torch.empty_like(embeds)
        where = cpu_ops.KVWhere()
        rc = lib.decoder_stack_decode(self.layers, len(self.layers), model.norm.weight.data_ptr(), model.norm.eps,
                                      embeds.data_ptr(), out.data_ptr(), m, h, pos.data_ptr(), slots.data_ptr(),
                                      tables.data_ptr(), tables.stride(0), lens.data_ptr(),
                                      self.workspace.data_ptr(), library.num_threads(), self.num_blocks, where)
        if rc > _BAD_KV:
            raise cpu_ops.kv_index_error(rc - _BAD_KV, where, self.num_blocks, self.layers[0].block_size,
                                         slots=slots, tables=tables, seq_lens=lens)
        if rc:
            cls, msg = _ERRORS.get(rc, (RuntimeError, f"decoder stack: error {rc}"))
            raise cls(msg)
        return out
