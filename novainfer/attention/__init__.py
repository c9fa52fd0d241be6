"""Attention metadata and backends: how the attention layers find this step's K/V."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def get_attn_backend(name: str, device: torch.device, kv_dtype: torch.dtype, dtype: torch.dtype) -> ModuleType:
    """The backend a runner binds to its KV cache (EngineConfig.attention_backend): 'auto' is the Triton kernels on
    CUDA, the batched CPU decode path elsewhere."""
    from novainfer.attention import cpu_backend, torch_backend

    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "torch" and (kv_dtype == dtype or kv_dtype.itemsize == 1):  # the same dtype, or the scaled fp8
        return torch_backend
    if name in ("cpu", "torch"):  # the torch reference needs the cache in the activations' dtype
        return cpu_backend
    if name == "triton":
        from novainfer.attention import triton_backend

        return triton_backend
    raise ValueError(f"attention_backend must be auto, cpu, torch or triton; got {name!r}")
