"""The paged KV cache of one model: its bytes per block and its one tensor, whose views the model's Attention
layers read. The target's runner and the draft model's runner (spec_decode/) both build theirs here.

A layer that reads another's cache (kv_source, Gemma 4's KV sharing) gets no cache of its own. Where the
layers' K/V shapes differ (Gemma 4: wider heads on its full-attention layers), the one tensor is flat and each
layer's views are consecutive slices of it."""
from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from novainfer.layers.attention import Attention


def _cache_owners(layers: list[Attention]) -> list[Attention]:
    """The layers that store K/V (the others read an owner's)."""
    return [layer for layer in layers if layer.kv_source is None]


def kv_bytes_per_block(layers: list[Attention], block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes one block of block_size tokens takes over all of layers (K and V)."""
    return sum(2 * block_size * a.num_kv_heads * a.head_dim * kv_dtype.itemsize for a in _cache_owners(layers))


def allocate_kv_cache(layers: list[Attention], num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                      device: torch.device, backend: ModuleType) -> torch.Tensor:
    """One tensor [2, layers, blocks, block_size, kv_heads, head_dim] (flat where the layers' shapes differ);
    each layer gets views and the backend."""
    owners = _cache_owners(layers)
    shapes = {(a.num_kv_heads, a.head_dim) for a in owners}
    a = owners[0]
    shape = (2, len(owners), num_blocks, block_size, a.num_kv_heads, a.head_dim)
    per_layer = [num_blocks * block_size * o.num_kv_heads * o.head_dim for o in owners]
    numel = int(np.prod(shape)) if len(shapes) == 1 else 2 * sum(per_layer)
    # A large CPU cache is taken fresh from mmap, whose pages are zero and become resident only when
    # written, so RSS grows with the tokens cached, not the capacity (the same zeros torch.zeros writes).
    lazy = device.type == "cpu" and numel * kv_dtype.itemsize >= 64 << 20
    kv_cache = (torch.empty if lazy else torch.zeros)(shape if len(shapes) == 1 else (numel,), dtype=kv_dtype,
                                                      device=device)
    offset = 0
    for i, layer in enumerate(owners):
        if len(shapes) == 1:
            layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]
            continue
        view = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        k, v = kv_cache[offset:offset + 2 * per_layer[i]].chunk(2)
        layer.k_cache, layer.v_cache = k.view(view), v.view(view)
        offset += 2 * per_layer[i]
    for layer in layers:
        layer.backend = backend
    return kv_cache


def release_kv_cache(layers: list[Attention]) -> None:
    """Drop the layers' views, so the cache's memory is freed once its tensor is."""
    for layer in layers:
        layer.k_cache = layer.v_cache = torch.tensor([])
