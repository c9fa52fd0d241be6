"""Qwen3.5 / Qwen3-Next's whole decoder stack for a CPU decode step in one C call (csrc/hybrid_stack_cpu.c): the
layers' own descriptors (gdn_layer.py's, gated_attn_layer.py's) in order, and the call. The same kernels as one call
a layer, so the hidden states equal that path's to the bit; worker/cpu_hybrid_stack.py gathers the layers' kernels and
decides when it applies."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from novainfer.kernels.cpu import library, ops
from novainfer.kernels.cpu.decoder_stack import _BAD_KV, _ERRORS
from novainfer.kernels.cpu.gated_attn_layer import GatedAttnLayerKernel, attn_operands, kv_args
from novainfer.kernels.cpu.gdn_layer import GDNLayerKernel

_P, _I = ctypes.c_void_p, ctypes.c_int


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    lib = library._library()
    if lib is None or not hasattr(lib, "hybrid_stack_decode"):
        return None
    lib.hybrid_stack_workspace.argtypes = [_P, _P, _I, _I, _I]
    lib.hybrid_stack_workspace.restype = ctypes.c_size_t
    lib.hybrid_stack_decode.argtypes = [_P, _P, _I, _P, _P, _P, _P, _I, _I, _P, _P, _P, _P, _P, _I, _P, _I, _P, _I, _P]
    lib.hybrid_stack_decode.restype = _I
    return lib


def available() -> bool:
    """Whether the C library (with the hybrid stack) is built for this machine."""
    return _lib() is not None


class HybridStackKernel:
    """The stack of one model's layer kernels (each GDNLayerKernel filled for its whole decoder layer) and its
    workspace."""

    def __init__(self, kernels: list[GDNLayerKernel | GatedAttnLayerKernel]):
        self.kernels = kernels  # their descriptors and the tensors those point into stay alive with the stack
        n = len(kernels)
        self.layers = (_P * n)(*[ctypes.addressof(k.desc) for k in kernels])
        self.linear = (ctypes.c_uint8 * n)(*[isinstance(k, GDNLayerKernel) for k in kernels])
        attns = [k for k in kernels if isinstance(k, GatedAttnLayerKernel)]
        self.check = attns[0] if attns else None
        self.num_blocks = min((k.num_blocks for k in attns), default=0)
        self.workspace, self.workspace_rows = torch.empty(0), 0

    def run(
        self, embeds: torch.Tensor, state_slots: torch.Tensor, continues: torch.Tensor, positions: torch.Tensor, meta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, its residual) [M, H] for one decode row per embedding row (float32,
        contiguous); state_slots int64 and continues uint8 as GDNLayerKernel.run_layer takes them; meta the step's
        AttentionMetadata."""
        lib = _lib()
        m, h = embeds.shape
        if m > self.workspace_rows:
            rows = max(m, 2 * self.workspace_rows, 1)
            self.workspace = torch.empty(
                lib.hybrid_stack_workspace(self.layers, self.linear, len(self.kernels), rows, h)
            )
            self.workspace_rows = rows
        operands = attn_operands(positions, meta)
        out, res = torch.empty_like(embeds), torch.empty_like(embeds)
        where = ops.KVWhere()
        rc = lib.hybrid_stack_decode(
            self.layers,
            self.linear,
            len(self.kernels),
            None if self.check is None else ctypes.addressof(self.check.desc),
            embeds.data_ptr(),
            out.data_ptr(),
            res.data_ptr(),
            m,
            h,
            state_slots.data_ptr(),
            continues.data_ptr(),
            *kv_args(operands, self.num_blocks),
            self.workspace.data_ptr(),
            library.num_threads(),
            where,
        )
        if rc > _BAD_KV:
            _, slots, tables, lens = operands
            block_size = self.check.desc.block_size
            raise ops.kv_index_error(
                rc - _BAD_KV, where, self.num_blocks, block_size, slots=slots, tables=tables, seq_lens=lens
            )
        if rc:
            cls, msg = _ERRORS.get(rc, (RuntimeError, f"hybrid decoder stack: error {rc}"))
            raise cls(msg)
        return out, res
