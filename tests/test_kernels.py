"""Each Triton kernel against its torch reference, on the CPU under TRITON_INTERPRET=1 (set in conftest.py).

Shapes are small but cover GQA, a cached prefix, sequences that end exactly on and just past a block
boundary, shuffled (non-contiguous) block tables, and padding slots (-1) that must not be written.
"""

from __future__ import annotations

import pytest
import torch

from novainfer.attention import torch_backend
from novainfer.attention.metadata import AttentionMetadata

kernels = pytest.importorskip("novainfer.kernels.paged_attention")
from novainfer.kernels.kv_store import store_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 4


def make_case(
    seed: int,
    ctx_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 16,
    dtype=torch.float32,
):
    """A random cache holding each sequence's context, and a query batch of q_lens new tokens per sequence."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    blocks_per_seq = [(s + BLOCK_SIZE - 1) // BLOCK_SIZE for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()  # shuffled physical blocks
    tables, used = [], 0
    for nb in blocks_per_seq:
        tables.append(perm[used : used + nb])
        used += nb
    width = max(blocks_per_seq)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_tables=bt.long(),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    to = dict(device=DEVICE)
    return (
        q.to(**to),
        k_cache.to(**to),
        v_cache.to(**to),
        bt.to(**to),
        meta.query_start_loc.to(**to),
        meta.seq_lens.to(**to),
        meta,
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def reference(q, k_cache, v_cache, meta, scale):
    return torch_backend.paged_attention(q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(), meta, scale)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 2)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_matches_reference(num_heads, num_kv_heads, num_splits):
    # contexts: one token, exactly one block, one past a block boundary, several blocks
    ctx = [0, 3, 4, 13]
    q, kc, vc, bt, qsl, sl, meta = make_case(1, ctx, [1] * len(ctx), num_heads, num_kv_heads)
    out = torch.full_like(q, float("nan"))
    kernels.decode_attention(q, kc, vc, bt, sl, 0.25, num_splits=num_splits, out=out)
    assert not out.isnan().any(), "every output element must be written"
    assert rel_err(out.cpu(), reference(q, kc, vc, meta, 0.25)) < 1e-5


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2)])
def test_prefill_with_cached_prefix_matches_reference(num_heads, num_kv_heads):
    # fresh prompt; prompt after a cached prefix (block aligned and not); a chunk of one; a long chunk
    ctx, qlen = [0, 8, 5, 9, 2], [7, 5, 6, 1, 21]
    q, kc, vc, bt, qsl, sl, meta = make_case(2, ctx, qlen, num_heads, num_kv_heads)
    out = torch.full_like(q, float("nan"))
    kernels.prefill_attention(q, kc, vc, bt, qsl, sl, max(qlen), 0.3, out=out)
    assert not out.isnan().any()
    assert rel_err(out.cpu(), reference(q, kc, vc, meta, 0.3)) < 1e-5


@pytest.mark.parametrize("cap", [None, 30.0])
def test_prefill_long_contexts_match_reference(cap):
    """Contexts of several key tiles before a query block's first row (a fresh 70-token prompt's second block of
    64 rows, prompts after a 37- and a 64-token prefix), with and without a soft cap."""
    ctx, qlen = [0, 37, 64], [70, 45, 3]
    q, kc, vc, bt, qsl, sl, meta = make_case(5, ctx, qlen, 4, 2)
    out = torch.full_like(q, float("nan"))
    kernels.prefill_attention(q, kc, vc, bt, qsl, sl, max(qlen), 0.3, out=out, logits_soft_cap=cap)
    assert not out.isnan().any()
    ref = torch_backend.paged_attention(q.cpu(), kc.cpu(), vc.cpu(), meta, 0.3, None, cap)
    assert rel_err(out.cpu(), ref) < 1e-5


def test_decode_split_merge_matches_reference_twice():
    """Contexts long enough to be split: the last split to finish merges, and leaves its counter at zero
    for the next launch (the second call must give the same result)."""
    ctx = [0, 15, 40, 77]
    q, kc, vc, bt, qsl, sl, meta = make_case(6, ctx, [1] * len(ctx), 6, 2)
    ref = reference(q, kc, vc, meta, 0.25)
    for _ in range(2):
        out = kernels.decode_attention(q, kc, vc, bt, sl, 0.25, num_splits=4, min_split_keys=16)
        assert rel_err(out.cpu(), ref) < 1e-5
    assert not kernels._split_counters(q.device, 8)[:8].any()


def test_decode_with_rope_equals_rotary_store_then_decode():
    """decode_attention(rope=...) rotates q and the new key and stores key/value itself: the same output and
    the same cache as the rotary kernel, store_kv and plain decode one after the other (padding row: slot -1)."""
    from types import SimpleNamespace

    from novainfer.kernels import fused_ops
    from novainfer.layers.rotary import RotaryEmbedding

    ctx = [5, 0, 30, 2]
    q, kc, vc, bt, qsl, sl, meta = make_case(7, ctx, [1] * len(ctx), 6, 2)
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(4, (6 + 2 * 2) * 16, generator=g).to(DEVICE)  # strided q/k/v views, as in the model
    q, k, v = qkv[:, :96].view(4, 6, 16), qkv[:, 96:128].view(4, 2, 16), qkv[:, 128:].view(4, 2, 16)
    positions = sl.long() - 1
    slots = torch.tensor([bt[i, c // BLOCK_SIZE].item() * BLOCK_SIZE + c % BLOCK_SIZE for i, c in enumerate(ctx)])
    slots[3] = -1
    rope = RotaryEmbedding(16, 64, SimpleNamespace(rope_theta=10000.0))
    cos, sin = rope.cos_cache.to(DEVICE), rope.sin_cache.to(DEVICE)
    kc2, vc2 = kc.clone(), vc.clone()
    rq, rk = fused_ops.rotary_embedding(positions, q, k, cos, sin)
    store_kv(rk, v, kc, vc, slots.to(DEVICE))
    for splits in (1, 4):
        kc2.copy_(kc), vc2.copy_(vc)
        ref = kernels.decode_attention(rq, kc, vc, bt, sl, 0.25, num_splits=splits, min_split_keys=16)
        out = kernels.decode_attention(
            q,
            kc2,
            vc2,
            bt,
            sl,
            0.25,
            num_splits=splits,
            min_split_keys=16,
            rope=kernels.DecodeRope(positions, cos, sin, k, v, slots.to(DEVICE)),
        )
        assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
        assert rel_err(out[:3].cpu(), ref[:3].cpu()) < 1e-6


def test_prefill_kernel_equals_decode_kernel_on_single_tokens():
    q, kc, vc, bt, qsl, sl, meta = make_case(3, [6, 1, 11], [1, 1, 1], 4, 2)
    a = kernels.prefill_attention(q, kc, vc, bt, qsl, sl, 1, 0.25)
    b = kernels.decode_attention(q, kc, vc, bt, sl, 0.25, num_splits=2)
    assert rel_err(a.cpu(), b.cpu()) < 1e-5


def test_store_kv_matches_reference_and_skips_padding():
    g = torch.Generator().manual_seed(4)
    num_blocks, kvh, hd = 6, 2, 16
    qkv = torch.randn(5, (4 + 2 * kvh) * hd, generator=g)  # keys/values are strided views, as in the model
    key = qkv[:, 4 * hd : (4 + kvh) * hd].view(5, kvh, hd)
    value = qkv[:, (4 + kvh) * hd :].view(5, kvh, hd)
    slots = torch.tensor([3, -1, 9, 10, 23])  # a padding slot, a block boundary (9 -> 10), the last slot
    caches = [torch.randn(num_blocks, BLOCK_SIZE, kvh, hd, generator=g) for _ in range(2)]
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    torch_backend.store_kv(key, value, ref_k, ref_v, slots)
    k_cache, v_cache = caches[0].to(DEVICE), caches[1].to(DEVICE)
    store_kv(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    assert torch.equal(k_cache.cpu(), ref_k) and torch.equal(v_cache.cpu(), ref_v)
    untouched = torch.ones(num_blocks * BLOCK_SIZE, dtype=torch.bool)
    untouched[[3, 9, 10, 23]] = False
    assert torch.equal(k_cache.cpu().view(-1, kvh, hd)[untouched], caches[0].view(-1, kvh, hd)[untouched])


def test_engine_on_triton_backend_matches_transformers(tiny_qwen2):
    """The whole engine with the Triton kernels (interpreted on the CPU): prefix-cache hit, chunked prefill,
    batched decode, and greedy tokens equal to transformers'."""
    from novainfer import LLM, SamplingParams
    from tests.tiny_models import hf_greedy

    llm = LLM(tiny_qwen2, dtype="float32", attention_backend="triton", block_size=4, max_num_batched_tokens=32)
    tok = llm.get_tokenizer()
    shared = "Paged attention stores keys and values in fixed-size blocks. "
    prompts = [shared + "Hello", shared + "The quick brown fox"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # fills the prefix cache
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[1].num_cached_tokens > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_qwen2, tok.encode(prompt), 10), prompt


# Triton's CPU interpreter has no bfloat16 arithmetic; bf16 is checked on the GPU (tests/gpu/gpu_check.py)
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_fused_elementwise_kernels_match_torch_layers(dtype):
    """Residual add + RMSNorm, rotary and SiLU-and-multiply kernels against the torch layers they replace."""
    from types import SimpleNamespace

    from novainfer.kernels import fused_ops
    from novainfer.layers.activation import SiluAndMul
    from novainfer.layers.layernorm import RMSNorm
    from novainfer.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(5)
    tol = 0 if dtype == torch.float32 else 1e-2
    x = torch.randn(7, 96, generator=g).to(dtype)
    res = torch.randn(7, 96, generator=g).to(dtype)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.rand(96, generator=g).to(dtype) + 0.5
    ref_out, ref_res = norm(x, res)
    out, new_res = fused_ops.rms_norm(x.to(DEVICE), norm.weight.data.to(DEVICE), 1e-6, res.to(DEVICE))
    assert torch.equal(new_res.cpu(), ref_res)
    assert rel_err(out.cpu(), ref_out) <= max(tol, 1e-6)
    assert rel_err(fused_ops.rms_norm(x.to(DEVICE), norm.weight.data.to(DEVICE), 1e-6).cpu(), norm(x)) <= max(tol, 1e-6)
    # q/k norms: [tokens, heads, head_dim] views of a fused qkv row, every head normed in one launch
    head_norm = RMSNorm(16, 1e-6)
    head_norm.weight.data = torch.rand(16, generator=g).to(dtype) + 0.5
    qkv_rows = torch.randn(5, 10 * 16, generator=g).to(dtype)
    heads = qkv_rows[:, 16:112].view(5, 6, 16)  # a strided view: rows 160 apart, heads 16
    got = fused_ops.rms_norm(heads.to(DEVICE), head_norm.weight.data.to(DEVICE), 1e-6).cpu()
    assert got.shape == (5, 6, 16) and got.is_contiguous()
    assert rel_err(got, head_norm._norm(heads)) <= max(tol, 1e-6)

    rope = RotaryEmbedding(16, 64, SimpleNamespace(rope_theta=10000.0))
    qkv = torch.randn(5, (6 + 2 * 2) * 16, generator=g).to(dtype)  # strided q/k views, as in the model
    q, k = qkv[:, :96].view(5, 6, 16), qkv[:, 96:128].view(5, 2, 16)
    positions = torch.tensor([0, 3, 17, 63, 1])
    ref_q, ref_k = rope(positions, q, k)
    out_q, out_k = fused_ops.rotary_embedding(
        positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE), rope.cos_cache.to(DEVICE), rope.sin_cache.to(DEVICE)
    )
    assert rel_err(out_q.cpu(), ref_q) <= max(tol, 1e-6) and rel_err(out_k.cpu(), ref_k) <= max(tol, 1e-6)

    gate_up = torch.randn(4, 2 * 40, generator=g).to(dtype)
    assert rel_err(fused_ops.silu_and_mul(gate_up.to(DEVICE)).cpu(), SiluAndMul()(gate_up)) <= max(tol, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_hybrid_elementwise_kernels_match_torch_layers(dtype):
    """Gemma's offset RMSNorm, the DeltaNet's gating, q/k L2 norm and gated RMSNorm kernels against the torch
    layers (their CPU path) they replace on the GPU."""
    import torch.nn.functional as F

    from novainfer.kernels import fused_ops
    from novainfer.layers.layernorm import GemmaRMSNorm
    from novainfer.layers.linear_attention import GatedRMSNorm

    g = torch.Generator().manual_seed(6)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    x = torch.randn(5, 3, 32, generator=g).to(dtype)  # [tokens, heads, head_dim], as the q/k norms see it
    res = torch.randn(15, 32, generator=g).to(dtype)
    norm = GemmaRMSNorm(32, 1e-6)
    norm.weight.data = (torch.rand(32, generator=g) - 0.5).to(dtype)
    w = norm.weight.data.to(DEVICE)
    assert (
        rel_err(fused_ops.rms_norm(x.view(15, 32).to(DEVICE), w, 1e-6, offset=True).cpu(), norm(x).view(15, 32)) <= tol
    )
    out, new_res = fused_ops.rms_norm(x.view(15, 32).to(DEVICE), w, 1e-6, res.to(DEVICE), offset=True)
    ref_out, ref_res = norm(x.view(15, 32), res)
    assert torch.equal(new_res.cpu(), ref_res) and rel_err(out.cpu(), ref_out) <= tol

    a, b = torch.randn(6, 8, generator=g) * 10, torch.randn(6, 8, generator=g)  # a + dt_bias crosses softplus's 20
    a_log, dt_bias = torch.randn(8, generator=g), torch.randn(8, generator=g) * 10
    gk, bk = fused_ops.gdn_gating(a.to(DEVICE), b.to(DEVICE), a_log.to(DEVICE), dt_bias.to(DEVICE))
    assert rel_err(gk.cpu(), -a_log.exp() * F.softplus(a + dt_bias)) <= 1e-6
    assert rel_err(bk.cpu(), torch.sigmoid(b)) <= 1e-6

    conv = torch.randn(4, 2 * 3 * 16 + 40, generator=g).to(dtype)  # q (3 heads of 16), k, then v
    qk = conv[:, :96].float().view(4, 6, 16)
    ref = (qk * torch.rsqrt((qk * qk).sum(-1, keepdim=True) + 1e-6)).to(dtype)
    dev = conv.to(DEVICE)
    fused_ops.l2_norm_heads_(dev, 6, 16)
    assert rel_err(dev[:, :96].cpu().view(4, 6, 16), ref) <= tol and torch.equal(dev[:, 96:].cpu(), conv[:, 96:])

    gated = GatedRMSNorm(16, 1e-6)
    gated.weight.data = (torch.rand(16, generator=g) + 0.5).to(dtype)
    xv, z = torch.randn(4, 5, 16, generator=g).to(dtype), torch.randn(4, 5, 16, generator=g).to(dtype)
    got = fused_ops.gated_rms_norm(xv.to(DEVICE), z.to(DEVICE), gated.weight.data.to(DEVICE), 1e-6)
    assert rel_err(got.cpu(), gated(xv, z)) <= tol
    wide = torch.randn(4, 7 * 16, generator=g).to(dtype)  # z as a column range of a fused projection's rows
    zs = wide[:, 16:96].view(4, 5, 16)
    got = fused_ops.gated_rms_norm(
        xv.to(DEVICE), wide.to(DEVICE)[:, 16:96].view(4, 5, 16), gated.weight.data.to(DEVICE), 1e-6
    )
    assert torch.equal(got.cpu(), fused_ops.gated_rms_norm(xv, zs.contiguous(), gated.weight.data, 1e-6).cpu())
    assert rel_err(got.cpu(), gated(xv, zs)) <= tol

    # partial rotary (Qwen3.5: a quarter of each head turns), against the model's torch rotation (its CPU path)
    from types import SimpleNamespace

    from novainfer.models.qwen3_5 import PartialRotaryEmbedding

    cfg = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
    rope = PartialRotaryEmbedding(48, 64, cfg)  # rotary_dim 12: the other 36 dims (not a power of two) are copied
    q, k = torch.randn(3, 4, 48, generator=g).to(dtype), torch.randn(3, 2, 48, generator=g).to(dtype)
    positions = torch.tensor([0, 9, 63])
    ref_q, ref_k = rope(positions, q, k)
    out_q, out_k = fused_ops.rotary_embedding(
        positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE), rope.cos_cache.to(DEVICE), rope.sin_cache.to(DEVICE), 12
    )
    assert torch.equal(out_q.cpu(), ref_q) and torch.equal(out_k.cpu(), ref_k)

    # q/k Gemma norms + partial rotary in one kernel, q and k as strided head views of a fused qkv row (q's heads
    # interleaved with their gates, Qwen3.5's layout) against the model's torch path (norm, then rotate)
    qkv = torch.randn(3, 4 * 2 * 48 + 2 * 48, generator=g).to(dtype)
    qv = qkv[:, : 4 * 96].view(3, 4, 96)[..., :48]
    kv = qkv[:, 4 * 96 :].view(3, 2, 48)
    qn, kn = GemmaRMSNorm(48, 1e-6), GemmaRMSNorm(48, 1e-6)
    qn.weight.data, kn.weight.data = ((torch.rand(48, generator=g) - 0.5).to(dtype) for _ in range(2))
    ref_q, ref_k = rope(positions, qn(qv), kn(kv))
    dev = qkv.to(DEVICE)
    out_q, out_k = fused_ops.qk_norm_rope(
        positions.to(DEVICE),
        dev[:, : 4 * 96].view(3, 4, 96)[..., :48],
        dev[:, 4 * 96 :].view(3, 2, 48),
        qn.weight.data.to(DEVICE),
        kn.weight.data.to(DEVICE),
        1e-6,
        rope.cos_cache.to(DEVICE),
        rope.sin_cache.to(DEVICE),
        12,
    )
    assert out_q.is_contiguous() and out_k.is_contiguous()
    assert rel_err(out_q.cpu(), ref_q) <= tol and rel_err(out_k.cpu(), ref_k) <= tol
