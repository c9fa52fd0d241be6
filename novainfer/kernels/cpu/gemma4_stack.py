"""A decode step's whole Gemma 4 decoder stack in one C call (csrc/gemma4_stack_cpu.c): the descriptors it reads
and the call. It calls the quantized layer-by-layer path's kernels in the same order, so its hidden states equal
that path's to the bit; worker/cpu_gemma4_stack.py fills the descriptors from a model and decides when it applies."""

from __future__ import annotations

import ctypes

import torch

from novainfer.kernels.cpu import library, ops
from novainfer.kernels.cpu.decoder_stack import _BAD_KV, _ERRORS, QLinearDesc

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class KVGroupDesc(ctypes.Structure):
    """kv_group of gemma4_stack_cpu.c: one KV group's slots, block tables and sequence lengths for this step."""

    _fields_ = [("slots", _P), ("block_tables", _P), ("seq_lens", _P), ("bt_stride", _I), ("num_blocks", _I)]


class Gemma4LayerDesc(ctypes.Structure):
    """gemma4_layer of gemma4_stack_cpu.c, field for field."""

    _fields_ = [
        ("input_norm", _P),
        ("post_attn_norm", _P),
        ("pre_ff_norm", _P),
        ("post_ff_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("ones", _P),
        ("ple_norm", _P),
        ("eps", _F),
        ("layer_scalar", _F),
        ("qkv", QLinearDesc),
        ("o", QLinearDesc),
        ("gate_up", QLinearDesc),
        ("down", QLinearDesc),
        ("ple_gate", QLinearDesc),
        ("ple_proj", QLinearDesc),
        ("k_cache", _P),
        ("v_cache", _P),
        ("cos", _P),
        ("sin", _P),
        ("max_pos", _I),
        ("nh", _I),
        ("nkv", _I),
        ("D", _I),
        ("block_size", _I),
        ("window", _I),
        ("own_kv", _I),
        ("k_eq_v", _I),
        ("group", _I),
        ("ple", _I),
    ]


class Gemma4StackKernel:
    """The filled descriptors of a Gemma 4 model's layers and the stack's workspace."""

    def __init__(self, layers: ctypes.Array, num_groups: int):
        self.layers, self.num_groups = layers, num_groups
        self.workspace = torch.empty(0)
        self.workspace_rows = 0

    def run(
        self,
        norm_weight: torch.Tensor,
        eps: float,
        embeds: torch.Tensor,
        ple: torch.Tensor | None,
        positions: torch.Tensor,
        groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
    ) -> torch.Tensor | None:
        """The final-normed hidden states [M, H] of one decode row per embedding row (float32, contiguous), or None
        where a KV index is out of range (nothing written; the layer-by-layer path raises naming it); ple:
        the per-layer inputs [M, layers, P] (contiguous float32) or None; groups: per KV group (slot_mapping,
        block_tables, seq_lens, its cache's block count)."""
        lib = library.library()
        m, h = embeds.shape
        if m > self.workspace_rows:
            rows = max(m, 2 * self.workspace_rows, 1)
            self.workspace = torch.empty(lib.gemma4_stack_workspace(self.layers, len(self.layers), rows, h))
            self.workspace_rows = rows
        pos = positions.to(torch.int64).contiguous()
        kept = []  # the converted index tensors, alive through the call
        descs = (KVGroupDesc * self.num_groups)()
        for desc, (slot_mapping, block_tables, seq_lens, num_blocks) in zip(descs, groups):
            slots = slot_mapping.to(torch.int64).contiguous()
            tables = block_tables.to(torch.int32).contiguous()
            lens = seq_lens.to(torch.int32).contiguous()
            kept.append((slots, tables, lens))
            desc.slots, desc.block_tables, desc.seq_lens = slots.data_ptr(), tables.data_ptr(), lens.data_ptr()
            desc.bt_stride, desc.num_blocks = tables.stride(0), num_blocks
        out = torch.empty_like(embeds)
        where = ops.KVWhere()
        rc = lib.gemma4_stack_decode(
            self.layers,
            len(self.layers),
            norm_weight.data_ptr(),
            eps,
            embeds.data_ptr(),
            None if ple is None else ple.data_ptr(),
            out.data_ptr(),
            m,
            h,
            pos.data_ptr(),
            descs,
            self.workspace.data_ptr(),
            library.num_threads(),
            where,
        )
        if rc > _BAD_KV:  # checked before any write: the layers' own ops name the bad index
            return None
        if rc:
            cls, msg = _ERRORS.get(rc, (RuntimeError, f"gemma4 stack: error {rc}"))
            raise cls(msg)
        return out
