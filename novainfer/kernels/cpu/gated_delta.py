"""The Gated DeltaNet on the CPU in C: the decode step (csrc/gated_delta_cpu.c) and the prefill of packed sequences
(csrc/gated_delta_prefill_cpu.c), each one call for conv window, SiLU, q/k normalisation and the gated delta rule
of every (sequence, value head), in place of many small torch ops per layer (kernels/gated_delta_rule.py holds
the torch references)."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from novainfer.kernels.cpu import library

_P, _I = ctypes.c_void_p, ctypes.c_int


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    lib = library._library()
    if lib is None or not hasattr(lib, "gated_delta_decode"):
        return None
    lib.gated_delta_decode.argtypes = [
        _P,
        ctypes.c_int64,
        _P,
        _P,
        _P,
        _P,
        _I,
        _P,
        _P,
        _P,
        _I,
        _I,
        _I,
        _I,
        _I,
        _I,
        _P,
        _P,
        _I,
    ]
    lib.gated_delta_decode.restype = None
    lib.set_gated_delta_isa.argtypes = [_I]
    lib.set_gated_delta_isa.restype = _I
    lib.gated_delta_prefill.argtypes = [_P, ctypes.c_int64, _P, _P, _P, _P, _I, _P, _P, _P, *[_I] * 6, _P, _P, _I]
    lib.gated_delta_prefill.restype = _I
    lib.set_gated_delta_prefill_isa.argtypes = [_I]
    lib.set_gated_delta_prefill_isa.restype = _I
    lib.gated_rms_norm.argtypes = [_P, _P, _P, ctypes.c_float, _I, _I, _P, _I]
    lib.gated_rms_norm.restype = None
    return lib


def set_isa(isa: str) -> str:
    """ "scalar", "avx2", "avx512" (each where the CPU has it) or "auto"; returns the one in use (tests run each)."""
    names = ("scalar", "avx2", "avx512")
    code = -1 if isa == "auto" else names.index(isa)
    used = _lib().set_gated_delta_isa(code)
    _lib().set_gated_delta_prefill_isa(code)
    return names[used]


def usable(mixed: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> bool:
    """Whether the C step takes these: float32 CPU tensors, the states contiguous, the kernels built."""
    return (
        not mixed.is_cuda
        and mixed.dtype is torch.float32
        and conv_state.dtype is torch.float32
        and ssm_state.dtype is torch.float32
        and conv_state.is_contiguous()
        and ssm_state.is_contiguous()
        and mixed.stride(-1) == 1
        and _lib() is not None
    )


def _operands(
    mixed: torch.Tensor,
    ssm_state: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """g, beta (float32) and slots (int64) as the C calls take them, once the state's shape fits the channels."""
    c = mixed.shape[1]
    nv, dk, dv = ssm_state.shape[1:]
    if dk != head_k_dim or c != 2 * num_k_heads * head_k_dim + nv * dv:
        raise ValueError(f"gated_delta: state {tuple(ssm_state.shape)} does not fit {c} conv channels")
    return g.float().contiguous(), beta.float().contiguous(), slots.to(torch.int64).contiguous()


def _tail(g: torch.Tensor, beta: torch.Tensor, dims: tuple[int, ...], scratch: torch.Tensor, out: torch.Tensor) -> list:
    """The arguments both C calls end with: g, beta, (C, K, nk, nv, dk, dv), scratch, out, threads."""
    return [g.data_ptr(), beta.data_ptr(), *dims, scratch.data_ptr(), out.data_ptr(), library.num_threads()]


def decode_step(
    mixed: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    continues: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
) -> torch.Tensor:
    """One token of B sequences: updates conv_state / ssm_state in their slots, returns out [B, nv, dv]."""
    b, c = mixed.shape
    nv, dk, dv = ssm_state.shape[1:]
    g, beta, slots64 = _operands(mixed, ssm_state, g, beta, slots, num_k_heads, head_k_dim)
    weight = conv_weight.reshape(c, -1).float().contiguous()
    cont = continues.to(torch.uint8).contiguous()
    scratch = torch.empty(b, c, dtype=torch.float32)
    out = torch.empty(b, nv, dv, dtype=torch.float32)
    _lib().gated_delta_decode(
        mixed.data_ptr(),
        mixed.stride(0),
        conv_state.data_ptr(),
        ssm_state.data_ptr(),
        slots64.data_ptr(),
        cont.data_ptr(),
        b,
        weight.data_ptr(),
        *_tail(g, beta, (c, weight.shape[1], num_k_heads, nv, dk, dv), scratch, out),
    )
    return out


def prefill(
    mixed: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
) -> torch.Tensor:
    """Packed sequences' tokens mixed [T, C] (sequence n: rows cu_seqlens[n] .. cu_seqlens[n+1] - 1), each from
    its slot's conv window and recurrent state (zeros for a fresh sequence), both left updated in the slot;
    returns out [T, nv, dv]."""
    t, c = mixed.shape
    nv, dk, dv = ssm_state.shape[1:]
    g, beta, slots64 = _operands(mixed, ssm_state, g, beta, slots, num_k_heads, head_k_dim)
    weight_t = conv_weight.reshape(c, -1).float().t().contiguous()  # [K, C]: the conv's taps over channels
    cu = cu_seqlens.to(torch.int32).contiguous()
    scratch = torch.empty(t, c, dtype=torch.float32)
    out = torch.empty(t, nv, dv, dtype=torch.float32)
    rc = _lib().gated_delta_prefill(
        mixed.data_ptr(),
        mixed.stride(0),
        conv_state.data_ptr(),
        ssm_state.data_ptr(),
        slots64.data_ptr(),
        cu.data_ptr(),
        slots64.shape[0],
        weight_t.data_ptr(),
        *_tail(g, beta, (c, weight_t.shape[0], num_k_heads, nv, dk, dv), scratch, out),
    )
    if rc:
        raise MemoryError("gated_delta prefill: out of memory for its scratch")
    return out


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2) + eps) * silu(z) over the last dim, in one C call; None where the C kernels do not
    take these (not float32 CPU tensors, or not built): the caller runs its torch form."""
    if x.is_cuda or not (x.dtype is z.dtype is weight.dtype is torch.float32) or _lib() is None:
        return None
    x, z, weight = x.contiguous(), z.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    d = x.shape[-1]
    _lib().gated_rms_norm(
        x.data_ptr(), z.data_ptr(), weight.data_ptr(), eps, x.numel() // d, d, out.data_ptr(), library.num_threads()
    )
    return out
