"""Mixture-of-experts routing on the GPU in three launches, where torch ops took about twenty-five per layer (the
Qwen3-30B-A3B decode step spent ~15% of its device time in them):

1. topk_softmax: per token, the top k router logits' experts and their softmax probabilities over all experts
   (renormalised to sum to one if asked). The experts are chosen on the logits themselves, so the choice is
   exact; transformers' softmax-then-topk picks the same ones, softmax being monotonic.
2. align_by_expert: each (token, k) pair sorted by its expert and every expert's run padded to BLOCK_M rows
   (vLLM's moe_align_block_size): one program per expert counts its pairs, then one program per expert reads
   every count, finds where its padded run begins and writes its pairs in order, its padding and its blocks'
   expert. Nothing syncs with the host, so a decode step stays capturable in a CUDA graph.

Beside each, the torch reference the CPU runs (align_by_expert_torch; the reference of topk_softmax is
layers/fused_moe/routing.select_experts). Arrays have the worst-case length, so their shapes never depend on data.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def aligned_length(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The worst-case length of the sorted pair ids: every expert's run padded to whole blocks."""
    n = num_pairs + num_experts * (block_m - 1)
    return (n + block_m - 1) // block_m * block_m


def align_by_expert_torch(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair ids padded per expert to block_m with the pair count as padding, each block's expert, the
    padded total [1] int32). Pair p = token * k + slot; within an expert, pairs keep their order."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.long))
    padded = (counts + block_m - 1) // block_m * block_m
    run_start = torch.cumsum(padded, 0) - padded  # where each expert's padded run begins
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order].long()
    rank_in_expert = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    max_len = aligned_length(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((max_len,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[run_start[expert_of] + rank_in_expert] = order.to(torch.int32)
    block_ends = torch.cumsum(padded, 0) // block_m
    blocks = torch.arange(max_len // block_m, device=flat.device)
    block_experts = torch.searchsorted(block_ends, blocks, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_experts, padded.sum().reshape(1).to(torch.int32)


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride,
    E: tl.constexpr,
    BE: tl.constexpr,
    TOP_K: tl.constexpr,
    BK: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BE)
    x = tl.load(logits_ptr + row * stride + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    top = tl.max(x, 0)
    denom = tl.sum(tl.where(offs < E, tl.exp(x - top), 0.0), 0)
    slots = tl.arange(0, BK)
    weights = tl.zeros([BK], tl.float32)
    ids = tl.zeros([BK], tl.int64)
    left = x
    for j in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        idx = tl.min(tl.where(left == best, offs, BE), 0)  # the lowest index among equal logits
        weights = tl.where(slots == j, tl.exp(best - top) / denom, weights)
        ids = tl.where(slots == j, idx.to(tl.int64), ids)
        left = tl.where(offs == idx, float("-inf"), left)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    tl.store(weights_ptr + row * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=slots < TOP_K)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [tokens, k] float32, topk_ids [tokens, k] int64), highest first: select_experts' contract
    (the Triton kernel on any tensor: callers send CUDA ones, tests CPU ones under TRITON_INTERPRET=1)."""
    tokens, experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if tokens:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        _topk_softmax_kernel[(tokens,)](
            logits,
            weights,
            ids,
            logits.stride(0),
            E=experts,
            BE=triton.next_power_of_2(experts),
            TOP_K=top_k,
            BK=triton.next_power_of_2(top_k),
            RENORMALIZE=renormalize,
            num_warps=1 if experts <= 128 else 2,
        )
    return weights, ids


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, P, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    n = tl.zeros([BLOCK], tl.int32)
    for p0 in range(0, P, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
        n += (ids == e).to(tl.int32)
    tl.store(counts_ptr + e, tl.sum(n, 0))


@triton.jit
def _align_kernel(
    ids_ptr,
    counts_ptr,
    sorted_ptr,
    block_experts_ptr,
    total_ptr,
    P,
    E: tl.constexpr,
    BE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
):
    e = tl.program_id(0)
    offs_e = tl.arange(0, BE)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(offs_e < e, padded, 0), 0)
    mine = tl.sum(tl.where(offs_e == e, counts, 0), 0)
    mine_padded = tl.sum(tl.where(offs_e == e, padded, 0), 0)
    if e == 0:
        tl.store(total_ptr, tl.sum(padded, 0))
    seen = start
    for p0 in range(0, P, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        hit = tl.load(ids_ptr + offs, mask=offs < P, other=-1) == e
        rank = tl.cumsum(hit.to(tl.int32), 0)
        tl.store(sorted_ptr + seen + rank - 1, offs, mask=hit)
        seen += tl.sum(hit.to(tl.int32), 0)
    for r0 in range(0, mine_padded - mine, BLOCK):  # the run's padding rows hold the pair count
        r = r0 + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + start + mine + r, P + r * 0, mask=r < mine_padded - mine)
    for b0 in range(0, mine_padded // BLOCK_M, BLOCK):
        b = b0 + tl.arange(0, BLOCK)
        tl.store(block_experts_ptr + start // BLOCK_M + b, e + b * 0, mask=b < mine_padded // BLOCK_M)


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_by_expert_torch's contract: the two launches on CUDA tensors, the reference elsewhere."""
    fn = align_by_expert_triton if topk_ids.is_cuda else align_by_expert_torch
    return fn(topk_ids, num_experts, block_m)


def align_by_expert_triton(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_by_expert_torch's contract in two Triton launches. Blocks past the padded total keep whatever they
    hold: the grouped GEMMs skip them."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    max_len = aligned_length(num_pairs, num_experts, block_m)
    dev = flat.device
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(max_len, dtype=torch.int32, device=dev)
    block_experts = torch.empty(max_len // block_m, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    block = min(1024, max(16, triton.next_power_of_2(num_pairs)))
    _count_kernel[(num_experts,)](flat, counts, num_pairs, BLOCK=block, num_warps=4)
    _align_kernel[(num_experts,)](
        flat,
        counts,
        sorted_ids,
        block_experts,
        total,
        num_pairs,
        E=num_experts,
        BE=triton.next_power_of_2(num_experts),
        BLOCK_M=block_m,
        BLOCK=block,
        num_warps=4,
    )
    return sorted_ids, block_experts, total
