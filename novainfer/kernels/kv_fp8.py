"""The fp8 KV cache's number format, in plain torch (no Triton, so the CPU reference imports it anywhere): float8
e4m3 values of K/V divided by a per-layer scale and clamped to e4m3's +-448; read back times the scale."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether the cache is stored as float8 e4m3 (scaled)."""
    return cache.dtype == FP8_DTYPE


def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an fp8 cache stores it: divided by scale (in float32), clamped, rounded to nearest even."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def read_kv(rows: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache rows in dtype: an fp8 cache's dequantized (times its scale), any other's as stored."""
    return rows.to(dtype) * scale if is_fp8(rows) else rows.to(dtype)
