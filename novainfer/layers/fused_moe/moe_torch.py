"""The experts in plain torch: the CPU path and the oracle the Triton kernel is checked against.

Each expert takes the tokens routed to it, as transformers' loop does, so the sums round the same way."""

from __future__ import annotations

import torch
from torch import nn


def fused_experts_torch(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_and_mul: nn.Module,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_k weight_k * down_e(act(gate_e x) * up_e x) over each token's experts e = topk_ids[t, k].

    hidden_states: [tokens, hidden]; w13: [experts, 2 * inter, hidden] (gate rows, then up rows);
    w2: [experts, hidden, inter]; topk_*: [tokens, k]; the optional biases [experts, 2 * inter] and
    [experts, hidden] are added after each projection (gpt-oss), before the routing weight multiplies."""
    out = torch.zeros_like(hidden_states)
    weights = topk_weights.to(hidden_states.dtype)  # transformers multiplies in the activation dtype
    for expert in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == expert)
        x = hidden_states[token_idx]
        gate_up = torch.nn.functional.linear(x, w13[expert])
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert]
        y = torch.nn.functional.linear(act_and_mul(gate_up), w2[expert])
        if w2_bias is not None:
            y = y + w2_bias[expert]
        out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
    return out


def fused_experts_grouped(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_and_mul: nn.Module,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same sums as fused_experts_torch in two grouped matmuls: the (token, k) pairs sorted by expert,
    torch's grouped_mm over each expert's run, then the weighted rows added back per token in expert order.
    The CPU path: no Python loop over the experts, so a decode step costs a handful of ops per layer."""
    tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    ends = torch.cumsum(torch.bincount(flat, minlength=w13.shape[0]), 0).to(torch.int32)
    rows = order // top_k
    gate_up = torch.nn.functional.grouped_mm(hidden_states[rows], w13.transpose(1, 2), offs=ends)
    if w13_bias is not None:
        gate_up = gate_up + w13_bias[flat[order]]
    down = torch.nn.functional.grouped_mm(act_and_mul(gate_up), w2.transpose(1, 2), offs=ends)
    if w2_bias is not None:
        down = down + w2_bias[flat[order]]
    down = down * topk_weights.flatten()[order].to(hidden_states.dtype)[:, None]
    return torch.zeros_like(hidden_states).index_add_(0, rows, down)
