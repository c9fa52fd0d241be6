"""Reference attention on the paged cache in plain torch: the CPU path and the GPU kernels' oracle.

An fp8 (e4m3) cache holds K/V divided by the layer's k_scale/v_scale and clamped to +-448; it is read back
dequantized (widened, times the scale), then attended as any other cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from novainfer.attention.metadata import AttentionMetadata, SlotAttentionMetadata
from novainfer.kernels.kv_fp8 import is_fp8, read_kv, to_fp8


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write the step's K/V [num_tokens, kv_heads, head_dim] into cache slots; slot -1 is skipped (k_scale,
    v_scale: an fp8 cache's scales)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    if is_fp8(k_cache):  # copied as bytes: torch's CPU index_copy_ has no float8 kernel
        key, value = to_fp8(key, k_scale).view(torch.uint8), to_fp8(value, v_scale).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[valid])
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[valid])


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(cap(q k^T * scale) masked) v over [heads, q_len, d] x [heads, k_len, d]; mask: [q_len, k_len].

    sinks [heads]: one more logit per head in each row's softmax, whose probability mass is dropped (gpt-oss)."""
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    sink = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


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
    """Causal attention of each sequence's new tokens over its cached context (the last sliding_window keys;
    sinks [heads]: each head's sink logit, see attend; k_scale/v_scale: an fp8 cache's scales).

    query: [num_tokens, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim].
    The i-th of a sequence's q new tokens sits at position seq_len - q + i and sees keys up to it.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_tables[i, :num_blocks]
        # a cache stored in a narrower dtype (bf16 KV on the CPU) is read in the activations' dtype
        k = read_kv(k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len], query.dtype, k_scale)
        v = read_kv(v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len], query.dtype, v_scale)
        q = query[q_start:q_end].transpose(0, 1)  # [heads, q_len, d]
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        dist = q_pos[:, None] - torch.arange(seq_len, device=query.device)[None, :]
        mask = dist >= 0 if sliding_window is None else (dist >= 0) & (dist < sliding_window)
        o = attend(q, k, v, mask, scale, logits_soft_cap, sinks)
        out[q_start:q_end] = o.transpose(0, 1)
    return out


def masked_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: SlotAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every query over the candidate cells its visibility mask allows (SLOT layout).

    query: [num_tokens, heads, head_dim]; caches: [num_cells, 1, kv_heads, head_dim]. Each query sees at
    least its own cell (distance 0), so no row of the mask is empty, with or without a window.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = k_cache.view(-1, num_kv_heads, head_dim)[meta.cells].transpose(0, 1).repeat_interleave(group, dim=0)
    v = v_cache.view(-1, num_kv_heads, head_dim)[meta.cells].transpose(0, 1).repeat_interleave(group, dim=0)
    mask = meta.visible
    if sliding_window is not None:
        mask = mask & (meta.query_pos[:, None] - meta.cell_pos[None, :] < sliding_window)
    o = attend(query.transpose(0, 1), k, v, mask, scale, logits_soft_cap, sinks)
    return o.transpose(0, 1)
