"""Reference attention on the paged cache in plain torch: the CPU path and the GPU kernels' oracle."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from novainfer.attention.metadata import AttentionMetadata, SlotAttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write the step's K/V [num_tokens, kv_heads, head_dim] into cache slots; slot -1 is skipped."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[valid])
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[valid])


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.

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
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        q = query[q_start:q_end].transpose(0, 1)  # [heads, q_len, d]
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[q_start:q_end] = o.transpose(0, 1)
    return out


def masked_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: SlotAttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of every query over the candidate cells its visibility mask allows (SLOT layout).

    query: [num_tokens, heads, head_dim]; caches: [num_cells, 1, kv_heads, head_dim]. Each query sees at
    least its own cell, so no row of the mask is empty.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = k_cache.view(-1, num_kv_heads, head_dim)[meta.cells].transpose(0, 1).repeat_interleave(group, dim=0)
    v = v_cache.view(-1, num_kv_heads, head_dim)[meta.cells].transpose(0, 1).repeat_interleave(group, dim=0)
    o = F.scaled_dot_product_attention(query.transpose(0, 1), k, v, attn_mask=meta.visible, scale=scale)
    return o.transpose(0, 1)
