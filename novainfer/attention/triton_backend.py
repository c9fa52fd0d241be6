"""Attention on the paged cache with the Triton kernels: the GPU path. Same interface as torch_backend."""

from __future__ import annotations

import torch

from novainfer.attention.metadata import AttentionMetadata
from novainfer.kernels.kv_store import store_kv
from novainfer.kernels.paged_attention import decode_attention, prefill_attention

__all__ = ["store_kv", "paged_attention"]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One new token per sequence takes the split-K decode kernel; anything else the prefill kernel (k_scale,
    v_scale: an fp8 cache's scales)."""
    if meta.max_query_len == 1:
        return decode_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            meta.num_splits,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            sinks=sinks,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    return prefill_attention(
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        meta.max_query_len,
        scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
    )
