"""A decode step's whole llama-family decoder stack in one C call (csrc/decoder_stack_cpu.c): the descriptors it
reads and the call. It calls the layer-by-layer path's kernels in the same order, so its hidden states equal that
path's to the bit; worker/cpu_decode_stack.py fills the descriptors from a model and decides when it applies."""

from __future__ import annotations

import ctypes

import torch

from novainfer.kernels.cpu import library, ops
from novainfer.kernels.cpu.repack import PackedWeight

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_ERRORS = {
    1: (MemoryError, "decoder stack: no memory for a kernel's scratch"),
    2: (ValueError, "decoder stack: a position is outside the rotary table"),
}
_BAD_KV = 2  # error codes from 3 on: 2 + a bad KV index's code (ops.kv_index_error)


class QLinearDesc(ctypes.Structure):
    """qlinear of csrc/stack_cpu.h, field for field (scale_fmt: the weight's scale_format)."""

    _fields_ = [
        ("w", _P),
        ("scales", _P),
        ("zeros", _P),
        ("bias", _P),
        ("quant", _I),
        ("group", _I),
        ("has_zeros", _I),
        ("scale_fmt", _I),
        ("N", _I),
        ("K", _I),
    ]


class DecoderLayerDesc(ctypes.Structure):
    """decoder_layer of decoder_stack_cpu.c, field for field."""

    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("input_eps", _F),
        ("post_eps", _F),
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
        ("block_size", _I),
        ("window", _I),
        ("scale", _F),
        ("soft_cap", _F),
    ]


def packed_weight(linear) -> PackedWeight | None:
    """A linear layer's packed (quantized GGUF) weight where the C stacks read it (not MXFP4), else None."""
    packed = getattr(linear.weight, "packed", None)
    return None if packed is None or packed.e2m1 else packed


def qlinear_desc(w: PackedWeight, bias: torch.Tensor | None) -> QLinearDesc:
    """A packed weight and its (contiguous float32) bias as the C stack reads them."""
    if w.e2m1:
        raise ValueError("the C decoder stack does not read MXFP4 (e2m1) weights; GGUF type MXFP4 outside the experts")
    return QLinearDesc(
        w.qweight.data_ptr(),
        w.scales.data_ptr(),
        0 if w.zeros is None else w.zeros.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        w.quant_code,
        w.group,
        int(w.zeros is not None),
        w.scale_format,
        w.shape[0],
        w.shape[1],
    )


class DecoderStackKernel:
    """The filled descriptors of a model's layers, the blocks of its KV cache, and the stack's workspace."""

    def __init__(self, layers: ctypes.Array, num_blocks: int):
        self.layers, self.num_blocks = layers, num_blocks  # num_blocks: the bound every block id and slot is checked
        self.workspace = torch.empty(0)
        self.workspace_rows = 0

    def run(
        self,
        norm_weight: torch.Tensor,
        eps: float,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """The final-normed hidden states [M, H] of one decode row per embedding row (float32, contiguous)."""
        lib = library.library()
        m, h = embeds.shape
        if m > self.workspace_rows:
            rows = max(m, 2 * self.workspace_rows, 1)
            self.workspace = torch.empty(lib.decoder_stack_workspace(self.layers, len(self.layers), rows, h))
            self.workspace_rows = rows
        pos = positions.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        tables = block_tables.to(torch.int32).contiguous()  # (its row stride is the width checked)
        lens = seq_lens.to(torch.int32).contiguous()
        out = torch.empty_like(embeds)
        where = ops.KVWhere()
        rc = lib.decoder_stack_decode(
            self.layers,
            len(self.layers),
            norm_weight.data_ptr(),
            eps,
            embeds.data_ptr(),
            out.data_ptr(),
            m,
            h,
            pos.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            lens.data_ptr(),
            self.workspace.data_ptr(),
            library.num_threads(),
            self.num_blocks,
            where,
        )
        if rc > _BAD_KV:
            raise ops.kv_index_error(
                rc - _BAD_KV,
                where,
                self.num_blocks,
                self.layers[0].block_size,
                slots=slots,
                tables=tables,
                seq_lens=lens,
            )
        if rc:
            cls, msg = _ERRORS.get(rc, (RuntimeError, f"decoder stack: error {rc}"))
            raise cls(msg)
        return out
