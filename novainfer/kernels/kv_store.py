"""Write the step's new K/V rows into the paged cache at their slots (slot -1: padding, skipped).

An fp8 (e4m3) cache stores each value divided by its layer's scale (k_scale, v_scale) and clamped to e4m3's
+-448; the attention kernels multiply the scales back in (kernels/paged_attention.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from novainfer.kernels.kv_fp8 import is_fp8


@triton.jit
def to_cache(x, scale, cache_ptr, FP8: tl.constexpr):
    """x as the cache at cache_ptr stores it: divided by scale and clamped into e4m3 for an fp8 cache."""
    if FP8:
        x = _round_to_e4m3(tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0))  # kv_fp8.FP8_MAX
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _round_to_e4m3(y):
    """float32 y (|y| <= 448) rounded to nearest even on e4m3's grid, so the cast after it is exact: the GPU's
    conversion gives these bits anyway, Triton's CPU interpreter rounds some values wrongly (31.9 -> 16)."""
    bits = y.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    a = tl.abs(y)
    sub = (a + 16384.0) - 16384.0  # below 2**-6: multiples of 2**-9, the float32 ulp at 2**14
    return tl.where(a < 0.015625, tl.where(y < 0, -sub, sub), normal)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    key_stride,
    value_stride,
    k_scale,
    v_scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < tl.where(slot >= 0, D, 0)  # a padding slot (-1) writes nothing
    k = tl.load(key_ptr + token * key_stride + offs, mask=mask)
    v = tl.load(value_ptr + token * value_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * D + offs, to_cache(k, k_scale, k_cache_ptr, FP8), mask=mask)
    tl.store(v_cache_ptr + slot * D + offs, to_cache(v, v_scale, v_cache_ptr, FP8), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value: [tokens, kv_heads, head_dim] (rows may be strided); caches: [blocks, block_size, kv_heads, dim].
    k_scale/v_scale: an fp8 cache's scales (other caches store the values as they are)."""
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
        float(k_scale),
        float(v_scale),
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        FP8=is_fp8(k_cache),
    )
