"""A Qwen3.5 / Qwen3-Next gated-attention decoder layer's CPU decode step in one C call (csrc/gated_attn_layer_cpu.c):
the descriptor it reads, filled once from a models/qwen3_5.HybridDecoderLayer whose projections are packed (quantized
GGUF) weights over the CPU backend's bf16 KV cache (models/qwen3_5_cpu_decode.py decides where it applies), and
the call. The layer-by-layer path takes ~35 Python-level calls for the same work (the norms, the q / gate split,
q / k norms, the partial rotary, the attention, the gate, the MLP)."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
from torch import nn

from novainfer.kernels.cpu import library, ops
from novainfer.kernels.cpu.decoder_stack import _BAD_KV, _ERRORS, QLinearDesc, packed_weight, qlinear_desc

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class GatedAttnLayerDesc(ctypes.Structure):
    """gated_attn_layer of gated_attn_layer_cpu.c, field for field."""

    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("input_eps", _F),
        ("post_eps", _F),
        ("qk_eps", _F),
        ("scale", _F),
        ("qkv", QLinearDesc),
        ("o", QLinearDesc),
        ("gate_up", QLinearDesc),
        ("down", QLinearDesc),
        ("k_cache", _P),
        ("v_cache", _P),
        ("cos", _P),
        ("sin", _P),
        ("max_pos", _I),
        ("nh", _I),
        ("nkv", _I),
        ("D", _I),
        ("rot", _I),
        ("block_size", _I),
    ]


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    lib = library._library()
    if lib is None or not hasattr(lib, "gated_attn_layer_decode"):
        return None
    lib.gated_attn_layer_workspace.argtypes = [ctypes.POINTER(GatedAttnLayerDesc), _I]
    lib.gated_attn_layer_workspace.restype = ctypes.c_size_t
    lib.gated_attn_layer_decode.argtypes = [ctypes.POINTER(GatedAttnLayerDesc), *[_P] * 4, _I, _P, _P, _P, _I]
    lib.gated_attn_layer_decode.argtypes += [_P, _I, _P, _I, _P]
    lib.gated_attn_layer_decode.restype = _I
    return lib


def available() -> bool:
    """Whether the C call is built on this machine."""
    return _lib() is not None


def attn_operands(positions: torch.Tensor, meta) -> tuple[torch.Tensor, ...]:
    """(positions int64, KV slots int64, block tables int32, seq lens int32) of a decode step, contiguous: built once
    a step (kept on its metadata), the same for every gated-attention layer and the hybrid stack."""
    operands = meta.__dict__.get("cpu_attn_operands")
    if operands is None:
        operands = (
            positions.to(torch.int64).contiguous(),
            meta.slot_mapping.to(torch.int64).contiguous(),
            meta.block_tables.to(torch.int32).contiguous(),
            meta.seq_lens.to(torch.int32).contiguous(),
        )
        meta.__dict__["cpu_attn_operands"] = operands
    return operands


def kv_args(operands: tuple[torch.Tensor, ...], num_blocks: int) -> list[int]:
    """The C calls' arguments from pos to num_blocks (gated_attn_layer_decode's order) for attn_operands(...)."""
    pos, slots, tables, lens = operands
    return [pos.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(), num_blocks]


class GatedAttnLayerKernel:
    """One layer's filled descriptor (with the tensors it points into) and its workspace."""

    def __init__(self, decoder: nn.Module):
        sa, mlp = decoder.self_attn, decoder.mlp
        a, rope = sa.attn, sa.rotary_emb
        norms = [1.0 + n.weight for n in (decoder.input_layernorm, decoder.post_attention_layernorm, sa.q_norm)]
        norms.append(1.0 + sa.k_norm.weight)
        self.kept = norms + [rope.cos_cache.contiguous(), rope.sin_cache.contiguous()]
        cos, sin = self.kept[-2:]
        self.num_blocks = min(a.k_cache.shape[0], a.v_cache.shape[0])
        self.desc = GatedAttnLayerDesc(
            *[n.data_ptr() for n in norms],
            decoder.input_layernorm.eps,
            decoder.post_attention_layernorm.eps,
            sa.q_norm.eps,
            a.scale,
            *[
                qlinear_desc(packed_weight(lin), None)
                for lin in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ],
            a.k_cache.data_ptr(),
            a.v_cache.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            cos.shape[0],
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            rope.rotary_dim,
            a.k_cache.shape[1],
        )
        self.workspace = torch.empty(0)

    def run(
        self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, meta
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the MLP's output, the new residual) as HybridDecoderLayer.forward returns them, one decode row per
        sequence; None where a KV index is out of range (nothing written: the layer path raises naming it)."""
        lib = _lib()
        m = h.shape[0]
        need = lib.gated_attn_layer_workspace(ctypes.byref(self.desc), m)
        if self.workspace.numel() < need:
            self.workspace = torch.empty(need)
        h = h.contiguous()
        residual = None if residual is None else residual.contiguous()
        out, res_out = torch.empty_like(h), torch.empty_like(h)
        where = ops.KVWhere()
        rc = lib.gated_attn_layer_decode(
            ctypes.byref(self.desc),
            h.data_ptr(),
            None if residual is None else residual.data_ptr(),
            res_out.data_ptr(),
            out.data_ptr(),
            m,
            *kv_args(attn_operands(positions, meta), self.num_blocks),
            self.workspace.data_ptr(),
            library.num_threads(),
            where,
        )
        if rc > _BAD_KV:
            return None
        if rc:
            cls, msg = _ERRORS.get(rc, (RuntimeError, f"gated attention layer: error {rc}"))
            raise cls(msg)
        return out, res_out
