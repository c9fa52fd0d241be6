"""The paged KV cache of one model: its bytes per block and its one tensor, whose views the model's Attention
layers read. The target's runner and the draft model's runner (spec_decode/) both build theirs here."""
from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from novainfer.layers.attention import Attention


def kv_bytes_per_block(layers: list[Attention], block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes one block of block_size tokens takes over all of layers (K and V)."""
    a = layers[0]
    return 2 * len(layers) * block_size * a.num_kv_heads * a.head_dim * kv_dtype.itemsize


def allocate_kv_cache(layers: list[Attention], num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                      device: torch.device, backend: ModuleType) -> torch.Tensor:
    """One tensor [2, layers, blocks, block_size, kv_heads, head_dim]; each layer gets views and the backend."""
    a = layers[0]
    shape = (2, len(layers), num_blocks, block_size, a.num_kv_heads, a.head_dim)
    nbytes = kv_dtype.itemsize * int(np.prod(shape))
    # A large CPU cache is taken fresh from mmap, whose pages are zero and become resident only when
    # written, so RSS grows with the tokens cached, not the capacity (the same zeros torch.zeros writes).
    lazy = device.type == "cpu" and nbytes >= 64 << 20
    kv_cache = (torch.empty if lazy else torch.zeros)(shape, dtype=kv_dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]
        layer.backend = backend
    return kv_cache


def release_kv_cache(layers: list[Attention]) -> None:
    """Drop the layers' views, so the cache's memory is freed once its tensor is."""
    for layer in layers:
        layer.k_cache = layer.v_cache = torch.tensor([])
