"""The attention layer: stores this step's K/V in the paged cache, then attends over the context."""

from __future__ import annotations

import torch
from torch import nn

from novainfer.attention import torch_backend
from novainfer.attention.metadata import SlotAttentionMetadata, get_attention_metadata


class Attention(nn.Module):
    """Paged attention over q/k/v of shape [tokens, heads * head_dim]; the cache is bound by the runner.

    sliding_window: a query at position p sees key position k iff k <= p and p - k < sliding_window
    (transformers' rule); None attends over the whole context. logits_soft_cap: scores become
    cap * tanh(score / cap) before the softmax (Gemma 2); None leaves them as they are.
    sinks: a per-head logit ([num_heads] of this rank) that joins every row's softmax and emits nothing (gpt-oss's
    learned attention sinks); the owner module keeps the parameter, this layer only reads it.
    kv_source: another (earlier) layer whose cache this one reads instead of its own (Gemma 4's KV sharing);
    such a layer takes no k/v, stores nothing and is given no cache of its own.
    kv_group: the KV group whose block table the cache's layout gives this layer (worker/kv_layout.py).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        kv_source: Attention | None = None,
        sinks: torch.Tensor | None = None,
    ):
        super().__init__()
        self.__dict__["kv_source"] = kv_source  # a plain reference: not registered as a submodule of this one
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must hold one logit per head ({num_heads}), got shape {tuple(sinks.shape)}")
        self.__dict__["sinks"] = sinks  # the owner's parameter, not registered twice
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.k_cache = self.v_cache = torch.tensor([])
        self.k_scale = self.v_scale = 1.0  # an fp8 cache's scales (kernels/kv_fp8.py); other caches ignore them
        self.kv_group = 0
        self.backend = torch_backend  # the runner binds triton_backend on the GPU

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        meta = get_attention_metadata()
        q = q.view(-1, self.num_heads, self.head_dim)
        owner = self if self.kv_source is None else self.kv_source
        if getattr(meta, "groups", None) is not None:  # a grouped cache: this layer's group's tables and slots
            meta = meta.groups[owner.kv_group]
        if self.kv_source is None:
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        window, cap = self.sliding_window, self.logits_soft_cap
        if isinstance(meta, SlotAttentionMetadata):  # the core API's SLOT cache: per-query visibility mask
            o = torch_backend.masked_attention(
                q, owner.k_cache, owner.v_cache, meta, self.scale, window, cap, self.sinks
            )
        else:
            o = self.backend.paged_attention(
                q, owner.k_cache, owner.v_cache, meta, self.scale, window, cap, self.sinks, owner.k_scale, owner.v_scale
            )
        return o.reshape(-1, self.num_heads * self.head_dim)
