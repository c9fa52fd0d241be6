"""Write the step's new K/V rows into the paged cache at their slots (slot -1: padding, skipped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    key_stride,
    value_stride,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < tl.where(slot >= 0, D, 0)  # a padding slot (-1) writes nothing
    k = tl.load(key_ptr + token * key_stride + offs, mask=mask)
    v = tl.load(value_ptr + token * value_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * D + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * D + offs, v, mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value: [tokens, kv_heads, head_dim] (rows may be strided); caches: [blocks, block_size, kv_heads, dim]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    d = num_kv_heads * head_dim
    assert key.stride(1) == head_dim and key.stride(2) == 1 and value.stride(1) == head_dim and value.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
    )
