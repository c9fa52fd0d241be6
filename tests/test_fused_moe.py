"""Mixture-of-experts pieces: routing and the torch experts against transformers' own modules, the Triton
grouped-GEMM kernel (TRITON_INTERPRET=1 on the CPU) against the torch reference, and tensor-parallel
shards of the expert weights summing to the whole."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts, Qwen2MoeTopKRouter

from novainfer.distributed import TPGroup, set_tp_group
from novainfer.layers.activation import SiluAndMul
from novainfer.layers.fused_moe import FusedMoE, fused_experts_torch, select_experts

H, INTER, E = 32, 48, 6


def uneven_case(seed: int, tokens: int, top_k: int):
    """Router logits biased so expert 0 takes most tokens and expert 5 none; weights [E, 2I, H] and [E, H, I]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    logits = torch.randn(tokens, E, generator=g) + torch.tensor([3.0, 1.0, 0.5, 0.0, 0.0, -30.0])
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.2
    w2 = torch.randn(E, H, INTER, generator=g) * 0.2
    return x, logits, w13, w2


def hf_config(top_k: int, norm: bool) -> Qwen2MoeConfig:
    return Qwen2MoeConfig(
        hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=top_k, norm_topk_prob=norm
    )


@pytest.mark.parametrize("top_k,norm", [(1, False), (2, True), (3, False)])
def test_routing_and_torch_experts_match_transformers(top_k, norm):
    x, _, w13, w2 = uneven_case(0, 11, top_k)
    cfg = hf_config(top_k, norm)
    router, experts = Qwen2MoeTopKRouter(cfg), Qwen2MoeExperts(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(1)))
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        logits, hf_weights, hf_ids = router(x)
        weights, ids = select_experts(logits, top_k, norm)
        assert torch.equal(ids, hf_ids) and torch.allclose(weights, hf_weights, rtol=0, atol=1e-7)
        ours = fused_experts_torch(x, w13, w2, weights, ids, SiluAndMul())
        assert torch.allclose(ours, experts(x, hf_ids, hf_weights), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (2, 3), (3, 1)])
def test_moe_gemv_matches_torch_reference(tokens, top_k):
    """The few-token path (one GEMV per token-expert pair, kernels/moe_gemv.py) under the interpreter: the reference's
    output, with tiles that leave a partial row tile and a masked K tail (N = 96 rows in tiles of 64, K = 32 in 64)."""
    from novainfer.kernels.fused_moe import experts_gemv

    x, logits, w13, w2 = uneven_case(100 + tokens, tokens, top_k)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    ref = fused_experts_torch(x, w13, w2, weights, ids, SiluAndMul())
    for tiles in (None, (64, 64, 4)):
        out = experts_gemv(x, w13, w2, weights, ids, SiluAndMul(), tiles=tiles)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    none = experts_gemv(x[:0], w13, w2, weights[:0], ids[:0], SiluAndMul())  # an empty batch: no launch
    assert none.shape == (0, H)


@pytest.mark.parametrize("tokens,top_k", [(1, 1), (9, 1), (9, 3), (40, 2)])
def test_triton_grouped_gemm_matches_torch_reference(tokens, top_k):
    kernels = pytest.importorskip("novainfer.kernels.fused_moe")
    x, logits, w13, w2 = uneven_case(tokens, tokens, top_k)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert tokens < 9 or (counts[5] == 0 and counts.max() > counts.min())  # uneven, one expert idle
    ref = fused_experts_torch(x, w13, w2, weights, ids, SiluAndMul())
    out = kernels.fused_experts(x, w13, w2, weights, ids, SiluAndMul())
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("tokens,top_k", [(1, 1), (9, 3), (40, 2)])
def test_grouped_cpu_path_matches_torch_reference(tokens, top_k):
    from novainfer.layers.fused_moe.moe_torch import fused_experts_grouped

    x, logits, w13, w2 = uneven_case(tokens, tokens, top_k)
    weights, ids = select_experts(logits, top_k, renormalize=False)
    ref = fused_experts_torch(x, w13, w2, weights, ids, SiluAndMul())
    assert ((fused_experts_grouped(x, w13, w2, weights, ids, SiluAndMul()) - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_align_pads_each_expert_to_whole_blocks(impl):
    from novainfer.kernels import moe_routing

    align = {"torch": moe_routing.align_by_expert_torch, "triton": moe_routing.align_by_expert_triton}[impl]
    ids = torch.tensor([[2, 0], [2, 1], [2, 0]])  # pairs 0..5 -> experts 2,0,2,1,2,0
    sorted_ids, block_experts, num_padded = align(ids, 4, 4)
    assert num_padded.item() == 12  # experts 0, 1, 2 take one block of 4 each; expert 3 none
    assert sorted_ids[:12].tolist() == [1, 5, 6, 6, 3, 6, 6, 6, 0, 2, 4, 6]  # 6 = padding
    assert block_experts[:3].tolist() == [0, 1, 2]


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 8, 2, 16), (37, 60, 8, 16), (300, 128, 8, 64)])
def test_triton_align_equals_the_torch_reference(tokens, experts, top_k, block_m):
    """The two-launch Triton alignment (TRITON_INTERPRET on the CPU) against the torch ops it replaced: the same
    padded total, pair order (stable within an expert), padding and block experts, idle experts included."""
    from novainfer.kernels import moe_routing

    g = torch.Generator().manual_seed(tokens)
    skew = torch.linspace(0, 3, experts)  # uneven loads; some experts get no pair
    ids = torch.topk(torch.randn(tokens, experts, generator=g) + skew, top_k, dim=-1).indices
    ref = moe_routing.align_by_expert_torch(ids, experts, block_m)
    got = moe_routing.align_by_expert_triton(ids, experts, block_m)
    total = ref[2].item()
    assert got[2].item() == total and got[0].shape == ref[0].shape
    assert torch.equal(got[0][:total], ref[0][:total])
    assert torch.equal(got[1][: total // block_m], ref[1][: total // block_m])


@pytest.mark.parametrize("experts,top_k", [(8, 1), (60, 4), (128, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_triton_topk_softmax_matches_select_experts(experts, top_k, renormalize):
    """The fused routing kernel (TRITON_INTERPRET on the CPU) picks select_experts' experts, highest first, with
    its probabilities; ties go to the lower expert id."""
    from novainfer.kernels.moe_routing import topk_softmax

    logits = torch.randn(33, experts, generator=torch.Generator().manual_seed(experts)) * 3
    logits[0, :] = 0.5  # all tied: experts 0..k-1
    ref_w, ref_ids = select_experts(logits, top_k, renormalize)
    w, ids = topk_softmax(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert ids[0].tolist() == list(range(top_k))
    assert torch.equal(ids[1:], ref_ids[1:])
    assert torch.allclose(w, ref_w, rtol=1e-6, atol=1e-7)


def test_tensor_parallel_shards_sum_to_the_whole():
    """Each rank keeps a column slice of every expert's gate/up and the matching row slice of down; the
    partial outputs add up to the unsharded layer's."""
    x, logits, w13, w2 = uneven_case(3, 7, 2)
    parts = []
    try:
        for rank, size in [(0, 1), (0, 2), (1, 2)]:
            set_tp_group(TPGroup(rank, size))
            moe = FusedMoE(E, 2, H, INTER, renormalize=False)
            for e in range(E):
                moe.weight_loader(moe.w13_weight, w13[e, :INTER], (e, "w1"))
                moe.weight_loader(moe.w13_weight, w13[e, INTER:], (e, "w3"))
                moe.weight_loader(moe.w2_weight, w2[e], (e, "w2"))
            assert moe.w13_weight.shape == (E, 2 * INTER // size, H) and moe.w2_weight.shape == (E, H, INTER // size)
            parts.append(moe(x, logits))
    finally:
        set_tp_group(TPGroup())
    assert torch.allclose(parts[1] + parts[2], parts[0], atol=1e-5)
    assert not torch.allclose(parts[1], parts[0], atol=1e-3)
