"""Top-k expert routing as transformers does it: softmax over every expert in float32, then the top k,
renormalised to sum to one when the config says so (norm_topk_prob; Mixtral always); or (gpt-oss) the top k
logits first, softmaxed among themselves. On CUDA the first is one Triton kernel (kernels/moe_routing.py)."""

from __future__ import annotations

import torch


def _check_top_k(router_logits: torch.Tensor, top_k: int) -> None:
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={router_logits.shape[-1]}]")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [tokens, k] float32, topk_ids [tokens, k] int64) from router_logits [tokens, experts]."""
    _check_top_k(router_logits, top_k)
    if router_logits.is_cuda:
        from novainfer.kernels.moe_routing import topk_softmax

        return topk_softmax(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def select_experts_top_logits(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: the top_k logits, softmaxed among themselves in the logits' dtype (as transformers does);
    (topk_weights [tokens, k], topk_ids [tokens, k] int64)."""
    _check_top_k(router_logits, top_k)
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids
