"""CPU attention over the paged cache: a decode step is one batched gather + matmul for all sequences
(no per-sequence Python loop), a prefill step (whole prompts, chunks, tokens after a cached prefix) one C call
over a bfloat16 cache (csrc/prefill_attention_cpu.c); other steps use the torch reference. The cache may be
stored narrower than the activations (bfloat16 K/V under float32 activations): K/V are widened after the gather.

Honours sliding_window (a query at p sees key k iff p - k < window), logits_soft_cap
(cap * tanh(score / cap)) and sinks (a per-head logit in each softmax that emits nothing), the interface agreed
with layers/attention.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from novainfer.attention import torch_backend
from novainfer.attention.metadata import AttentionMetadata
from novainfer.kernels.cpu import library, ops as cpu_ops


def _c_path(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """The C ops take float32 activations over a bfloat16 cache (the default CPU path)."""
    return cache.dtype == torch.bfloat16 and cache.is_contiguous() and cpu_ops.usable(x) and library.available()


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write the step's K/V [num_tokens, kv_heads, head_dim] into cache slots (cast to the cache's dtype; the
    scales are an fp8 cache's, which the engine gives this backend none of: resolve_cache_dtype refuses it)."""
    if _c_path(key, k_cache) and key.stride(1) == key.shape[2] and value.stride(1) == value.shape[2]:
        return cpu_ops.store_kv_bf16(key, value, k_cache, v_cache, slot_mapping)
    if k_cache.dtype != key.dtype:
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    torch_backend.store_kv(key, value, k_cache, v_cache, slot_mapping)


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
    """query [num_tokens, heads, head_dim] -> output of the same shape (see torch_backend.paged_attention; no fp8
    cache comes here, so the scales are unused)."""
    if query.dtype is torch.bfloat16 and query.shape[2] % 16 == 0:
        # dense bfloat16: the C kernels on the query widened exactly, so a token gets the same bits decoded, in a
        # prefill, a chunk or after a cached prefix (torch's flash, masked and batched paths each round otherwise)
        wide = query.float()
        if _c_path(wide, k_cache):
            out = paged_attention(wide, k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap, sinks)
            return out.to(query.dtype)
    if meta.max_query_len == 1 and query.shape[0] == meta.num_seqs:
        return decode_attention(query, k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap, sinks)
    if meta.per_token is not None:  # a verify step: every token as a decode step computes it
        return decode_attention(query, k_cache, v_cache, meta.per_token, scale, sliding_window, logits_soft_cap, sinks)
    if _c_path(query, k_cache) and query.stride(1) == query.shape[2] and query.shape[2] % 16 == 0:
        return cpu_ops.prefill_attention_bf16(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            sliding_window,
            logits_soft_cap,
            sinks,
        )
    if sliding_window is None and logits_soft_cap is None and sinks is None and _fresh_prompts_only(meta):
        return prefill_attention(query, k_cache, v_cache, meta, scale)
    extra = {
        k: v
        for k, v in (("sliding_window", sliding_window), ("logits_soft_cap", logits_soft_cap), ("sinks", sinks))
        if v is not None
    }
    # prefill: the reference, which reads a narrower cache in the query's dtype (computing in bf16 made the
    # result depend on how a prompt was chunked and batched)
    return torch_backend.paged_attention(query, k_cache, v_cache, meta, scale, **extra)


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence: gather every sequence's blocks at once, mask past its length, softmax
    (in C for float32 queries over a bfloat16 cache)."""
    if _c_path(query, k_cache) and query.stride(1) == query.shape[2] and query.shape[2] % 8 == 0:
        return cpu_ops.decode_attention_bf16(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window, logits_soft_cap, sinks
        )
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = meta.max_seq_len
    tables = meta.block_tables[:, : (max_len + block_size - 1) // block_size].long()
    # [seqs, blocks, block_size, kv_heads, d] -> [seqs, kv_heads, d, ctx] / [seqs, kv_heads, ctx, d]
    k = k_cache[tables].flatten(1, 2)[:, :max_len].to(query.dtype).permute(0, 2, 3, 1)
    v = v_cache[tables].flatten(1, 2)[:, :max_len].to(query.dtype).transpose(1, 2)
    q = query.view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, k).mul_(scale)  # [seqs, kv_heads, group, ctx]
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    pos = torch.arange(max_len, device=query.device)
    seq_lens = meta.seq_lens.to(query.device).long()[:, None]
    hidden = pos[None, :] >= seq_lens  # [seqs, ctx]
    if sliding_window is not None:
        hidden |= (seq_lens - 1 - pos[None, :]) >= sliding_window
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # the sink's column takes its share of the softmax, then is dropped
        sink = sinks.to(scores.dtype).view(1, num_kv_heads, group, 1).expand(num_seqs, -1, -1, -1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v).view(num_seqs, num_heads, head_dim)


def _fresh_prompts_only(meta: AttentionMetadata) -> bool:
    """Every sequence of the step is a whole prompt (no cached prefix): plain causal attention each."""
    starts = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    return all(starts[i + 1] - starts[i] == n for i, n in enumerate(seq_lens))


def prefill_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Whole prompts: torch's causal scaled_dot_product_attention per sequence (its CPU flash kernel skips
    the masked half), over K/V read back from the cache in the query's dtype as the reference reads them.
    The reference's explicit mask and softmax took 30% of a 512-token prefill of the default model."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    out = torch.empty_like(query)
    starts = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    for i, n in enumerate(meta.seq_lens_cpu or meta.seq_lens.tolist()):
        blocks = meta.block_tables[i, : (n + block_size - 1) // block_size]
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].to(query.dtype).transpose(0, 1)
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].to(query.dtype).transpose(0, 1)
        q = query[starts[i] : starts[i + 1]].transpose(0, 1)
        # 4-D: with 3-D inputs torch takes its math path, 7x slower than the flash kernel here
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=num_kv_heads != query.shape[1]
        )
        out[starts[i] : starts[i + 1]] = o[0].transpose(0, 1)
    return out
