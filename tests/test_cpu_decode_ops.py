"""The C ops of the quantized CPU decode step (kernels/cpu/ops.py) against the torch ops they
replace: residual add + RMSNorm, SiLU-and-mul, rotary embedding, the bf16 KV store and decode attention over
a paged cache (ragged lengths, shuffled blocks, GQA, sliding window, soft cap)."""

import types

import pytest
import torch
import torch.nn.functional as F

from novainfer.attention import torch_backend
from novainfer.attention.metadata import AttentionMetadata
from novainfer.kernels.cpu import library, ops as cpu_ops

pytestmark = pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA and a C compiler")
torch.manual_seed(0)


def test_add_rms_norm_matches_torch():
    from novainfer.layers.layernorm import RMSNorm

    norm = RMSNorm(72, 1e-5)
    norm.weight.data = torch.randn(72)
    x, res = torch.randn(5, 72), torch.randn(5, 72)
    out, new_res = cpu_ops.add_rms_norm(x, res, norm.weight, 1e-5)
    want_out, want_res = norm(x, res)  # the layer built outside the quantized path: torch ops
    assert torch.equal(new_res, want_res)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    out, same = cpu_ops.add_rms_norm(x, None, norm.weight, 1e-5)
    assert same is x
    torch.testing.assert_close(out, norm(x), rtol=1e-5, atol=1e-6)


def test_silu_and_mul_matches_torch():
    x = torch.randn(3, 2 * 100) * 8  # a width that is not a multiple of 8, values far into both tails
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), F.silu(x[:, :100]) * x[:, 100:], rtol=2e-6, atol=1e-6)


def test_rotary_in_place_on_a_fused_qkv_row_matches_torch():
    from novainfer.layers.rotary import RotaryEmbedding

    cfg = types.SimpleNamespace(rope_theta=10000.0)
    rope = RotaryEmbedding(32, 64, cfg)
    qkv = torch.randn(4, (4 + 2 + 2) * 32)
    q, k = qkv[:, :128].view(4, 4, 32), qkv[:, 128:192].view(4, 2, 32)
    pos = torch.tensor([0, 5, 63, 17])
    want_q, want_k = rope(pos, q.clone(), k.clone())
    cpu_ops.rotary_neox_(pos, q, k, rope.cos_cache, rope.sin_cache)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="outside the rotary table"):
        cpu_ops.rotary_neox_(torch.tensor([64, 0, 0, 0]), q, k, rope.cos_cache, rope.sin_cache)


@pytest.mark.parametrize("window,cap", [(None, None), (7, None), (None, 20.0)])
def test_store_and_decode_attention_match_the_torch_reference(window, cap):
    blocks, bs, nkv, nh, d = 12, 4, 2, 6, 16
    k_cache = torch.randn(blocks, bs, nkv, d).to(torch.bfloat16)
    v_cache = torch.randn(blocks, bs, nkv, d).to(torch.bfloat16)
    seq_lens = torch.tensor([1, 9, 13], dtype=torch.int32)
    tables = torch.tensor([[5, 0, 0, 0], [2, 7, 11, 0], [9, 1, 3, 4]], dtype=torch.int32)  # shuffled blocks
    slots = torch.tensor([5 * bs + 0, 11 * bs + 0, 4 * bs + 0])  # each sequence's newest position
    k_new, v_new = torch.randn(3, nkv, d), torch.randn(3, nkv, d)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_backend.store_kv(k_new.to(torch.bfloat16), v_new.to(torch.bfloat16), ref_k, ref_v, slots)
    cpu_ops.store_kv_bf16(k_new, v_new, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # the same rounding as torch's cast
    q = torch.randn(3, nh, d)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(4, dtype=torch.int32),
        seq_lens=seq_lens,
        slot_mapping=slots,
        block_tables=tables,
        max_query_len=1,
        max_seq_len=13,
        query_start_loc_cpu=[0, 1, 2, 3],
        seq_lens_cpu=seq_lens.tolist(),
    )
    extra = {k: v for k, v in (("sliding_window", window), ("logits_soft_cap", cap)) if v is not None}
    want = torch_backend.paged_attention(q, k_cache.float(), v_cache.float(), meta, 0.25, **extra)
    got = cpu_ops.decode_attention_bf16(q, k_cache, v_cache, tables, seq_lens, 0.25, window, cap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prefill_attention_of_whole_prompts_matches_the_reference():
    from novainfer.attention import cpu_backend

    blocks, bs, nkv, nh, d = 10, 4, 2, 6, 16
    k_cache = torch.randn(blocks, bs, nkv, d).to(torch.bfloat16)
    v_cache = torch.randn(blocks, bs, nkv, d).to(torch.bfloat16)
    tables = torch.tensor([[3, 8, 0], [1, 6, 2]], dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 7, 17], dtype=torch.int32),
        seq_lens=torch.tensor([7, 10], dtype=torch.int32),
        slot_mapping=torch.arange(17),
        block_tables=tables,
        max_query_len=10,
        max_seq_len=10,
        query_start_loc_cpu=[0, 7, 17],
        seq_lens_cpu=[7, 10],
    )
    q = torch.randn(17, nh, d)
    want = torch_backend.paged_attention(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(cpu_backend.paged_attention(q, k_cache, v_cache, meta, 0.25), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "d,window,cap,nh,nkv",
    [
        (64, None, None, 9, 3),
        (64, 50, None, 9, 3),
        (136, None, 30.0, 9, 3),
        (64, None, None, 14, 2),
        (32, 20, None, 8, 2),
        (64, 300, None, 9, 3),
        (64, None, 20.0, 9, 3),
    ],
)
def test_decode_attention_over_long_contexts_matches_the_reference(d, window, cap, nh, nkv):
    """Contexts of several blocks and lengths that are not multiples of 8 (the key tiles' and the softmax's
    tails); head_dim 136: output chunks of 32 values and a tail of 8; groups of 3, 7 and 4 query heads (the
    output accumulates 3 heads at a time, then the rest). Contexts past 256 keys (and a 300-key window) are
    split into chunks whose partial results are merged."""
    bs = 16
    seq_lens = torch.tensor([203, 1, 77, 700], dtype=torch.int32)
    blocks = int(sum((n + bs - 1) // bs for n in seq_lens.tolist()))
    order = torch.randperm(blocks, dtype=torch.int32)
    tables, at = torch.zeros(4, 44, dtype=torch.int32), 0
    for i, n in enumerate(seq_lens.tolist()):
        nb = (n + bs - 1) // bs
        tables[i, :nb] = order[at : at + nb]
        at += nb
    k_cache = torch.randn(blocks, bs, nkv, d).to(torch.bfloat16)
    v_cache = torch.randn(blocks, bs, nkv, d).to(torch.bfloat16)
    q = torch.randn(4, nh, d) * 0.5
    meta = AttentionMetadata(
        query_start_loc=torch.arange(5, dtype=torch.int32),
        seq_lens=seq_lens,
        slot_mapping=torch.zeros(4, dtype=torch.long),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=700,
        query_start_loc_cpu=[0, 1, 2, 3, 4],
        seq_lens_cpu=seq_lens.tolist(),
    )
    extra = {k: v for k, v in (("sliding_window", window), ("logits_soft_cap", cap)) if v is not None}
    want = torch_backend.paged_attention(q, k_cache.float(), v_cache.float(), meta, d**-0.5, **extra)
    got = cpu_ops.decode_attention_bf16(q, k_cache, v_cache, tables, seq_lens, d**-0.5, window, cap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_elementwise_ops_split_over_threads_give_each_row_its_single_row_result():
    """Prefill-sized inputs run their rows on the worker pool: every row equals the op run on that row alone
    (the batch-invariance greedy identity needs), and the torch ops within rounding; widths with tails."""
    from novainfer.layers.rotary import RotaryEmbedding

    m, h = 600, 100  # 60k elements: past the pool's threshold
    w, x, res = torch.randn(h), torch.randn(m, h), torch.randn(m, h)
    out, new_res = cpu_ops.add_rms_norm(x, res, w, 1e-6)
    one, _ = cpu_ops.add_rms_norm(x[7:8], res[7:8], w, 1e-6)
    assert torch.equal(out[7:8], one) and torch.equal(new_res, x + res)
    hr = x + res
    torch.testing.assert_close(out, w * hr * torch.rsqrt(hr.pow(2).mean(-1, keepdim=True) + 1e-6), rtol=1e-5, atol=1e-5)
    g = torch.randn(m, 2 * h) * 4
    act = cpu_ops.silu_and_mul(g)
    assert torch.equal(act[599:600], cpu_ops.silu_and_mul(g[599:600]))
    torch.testing.assert_close(act, F.silu(g[:, :h]) * g[:, h:], rtol=1e-5, atol=1e-5)
    cfg = types.SimpleNamespace(rope_theta=10000.0, rope_scaling=None)
    rope = RotaryEmbedding(32, 1024, cfg)
    t = 400
    qkv = torch.randn(t, 8 * 32)
    q, k = qkv[:, :128].view(t, 4, 32), qkv[:, 128:192].view(t, 2, 32)
    pos = torch.randint(0, 1024, (t,))
    want_q, want_k = rope(pos, q.clone(), k.clone())
    cpu_ops.rotary_neox_(pos, q, k, rope.cos_cache, rope.sin_cache)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
    kv = torch.randn(t, 2, 2, 32)
    k_cache = torch.zeros(64, 16, 2, 32, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(64 * 16)[:t]
    slots[5] = -1  # a padding token: not written
    cpu_ops.store_kv_bf16(kv[:, 0], kv[:, 1], k_cache, v_cache, slots)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    torch_backend.store_kv(kv[:, 0].to(torch.bfloat16), kv[:, 1].to(torch.bfloat16), ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_a_split_context_gives_the_same_bits_alone_in_a_batch_and_on_one_thread():
    """A 1,000-key context is split into chunks over the cores; the split depends on its length alone, so its
    row is bit-identical whatever the batch around it and the thread count (greedy identity across batches)."""
    from novainfer.kernels.cpu import library

    bs, nkv, nh, d = 16, 3, 9, 64
    lens = [1000, 300, 5]
    nb = [(n + bs - 1) // bs for n in lens]
    order = torch.randperm(sum(nb), dtype=torch.int32)
    tables = torch.zeros(3, max(nb), dtype=torch.int32)
    for i, at in enumerate([0, nb[0], nb[0] + nb[1]]):
        tables[i, : nb[i]] = order[at : at + nb[i]]
    k_cache = torch.randn(sum(nb), bs, nkv, d).to(torch.bfloat16)
    v_cache = torch.randn(sum(nb), bs, nkv, d).to(torch.bfloat16)
    q = torch.randn(3, nh, d)
    batch = cpu_ops.decode_attention_bf16(
        q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.125, None, None
    )
    alone = cpu_ops.decode_attention_bf16(
        q[:1], k_cache, v_cache, tables[:1], torch.tensor(lens[:1], dtype=torch.int32), 0.125, None, None
    )
    threads = library.num_threads()
    library.set_num_threads(1)
    try:
        one_thread = cpu_ops.decode_attention_bf16(
            q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.125, None, None
        )
    finally:
        library.set_num_threads(threads)
    assert torch.equal(batch[:1], alone) and torch.equal(batch, one_thread)


def _bad_index_case():
    """A valid decode step (3 sequences over a 12-block cache of 4 positions), for the bounds tests to break."""
    blocks, bs, nkv, nh, d = 12, 4, 2, 6, 16
    k_cache = torch.randn(blocks, bs, nkv, d).to(torch.bfloat16)
    v_cache = torch.randn(blocks, bs, nkv, d).to(torch.bfloat16)
    tables = torch.tensor([[5, 0, 0], [2, 7, 11], [9, 1, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([1, 9, 12], dtype=torch.int32)
    slots = torch.tensor([5 * bs, 11 * bs, 3 * bs + 3])
    return k_cache, v_cache, tables, seq_lens, slots, torch.randn(3, nkv, d), torch.randn(3, nh, d)


@pytest.mark.parametrize("slot", [12 * 4, 10**12])
def test_a_slot_outside_the_cache_raises_and_writes_nothing(slot):
    k_cache, v_cache, _, _, slots, kv, _ = _bad_index_case()
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots[1] = slot  # the other two tokens are valid: none of them may be written either
    with pytest.raises(ValueError, match=rf"KV slot {slot} \(token 1\) is outside the cache of 48 slots"):
        cpu_ops.store_kv_bf16(kv, kv, k_cache, v_cache, slots)
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)
    with pytest.raises(IndexError):  # the torch reference refuses it too
        torch_backend.store_kv(kv.to(torch.bfloat16), kv.to(torch.bfloat16), k_cache, v_cache, slots)
    slots[1] = -1  # padding: skipped, the others written as the reference writes them
    cpu_ops.store_kv_bf16(kv, kv, k_cache, v_cache, slots)
    torch_backend.store_kv(kv.to(torch.bfloat16), kv.to(torch.bfloat16), before_k, before_v, slots)
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)
    with pytest.raises(ValueError, match="do not fit caches"):  # rows wider than the cache's
        cpu_ops.store_kv_bf16(torch.randn(3, 4, 16), torch.randn(3, 4, 16), k_cache, v_cache, slots)


@pytest.mark.parametrize(
    "row,entry,block,message",
    [
        (1, 2, -1, r"block id -1 \(sequence 1, block table entry 2\) is outside the cache of 12 blocks"),
        (2, 0, 12, r"block id 12 \(sequence 2, block table entry 0\) is outside the cache of 12 blocks"),
        (0, 0, 2**31 - 1, r"block id 2147483647 \(sequence 0, block table entry 0\) is outside the cache of 12"),
    ],
)
def test_a_block_id_outside_the_cache_raises(row, entry, block, message):
    k_cache, v_cache, tables, seq_lens, _, _, q = _bad_index_case()
    before_k = k_cache.clone()
    tables[row, entry] = block
    with pytest.raises(ValueError, match=message):
        cpu_ops.decode_attention_bf16(q, k_cache, v_cache, tables, seq_lens, 0.25, None, None)
    with pytest.raises(ValueError, match=message):  # with a window that starts past it too: the reference's rule
        cpu_ops.decode_attention_bf16(q, k_cache, v_cache, tables, seq_lens, 0.25, 1, None)
    assert torch.equal(k_cache, before_k)


def test_entries_past_a_sequences_length_are_not_checked_and_valid_steps_still_match():
    k_cache, v_cache, tables, seq_lens, _, _, q = _bad_index_case()
    tables[0, 1:] = -7  # sequence 0 has one position: entries 1.. are never read ("may hold anything")
    tables[1, 2] = 99  # sequence 1: 9 positions, entry 2 is its third block...
    seq_lens[1] = 8  # ...which a length of 8 does not reach
    meta = AttentionMetadata(
        query_start_loc=torch.arange(4, dtype=torch.int32),
        seq_lens=seq_lens,
        slot_mapping=torch.zeros(3, dtype=torch.long),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=12,
        query_start_loc_cpu=[0, 1, 2, 3],
        seq_lens_cpu=seq_lens.tolist(),
    )
    want = torch_backend.paged_attention(q, k_cache.float(), v_cache.float(), meta, 0.25)
    got = cpu_ops.decode_attention_bf16(q, k_cache, v_cache, tables, seq_lens, 0.25, None, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [13, 0, -5, 2**31 - 1])
def test_a_seq_len_outside_the_block_table_raises(length):
    k_cache, v_cache, tables, seq_lens, _, _, q = _bad_index_case()
    seq_lens[2] = length  # the table holds 3 blocks of 4: lengths 1..12
    with pytest.raises(
        ValueError,
        match=rf"sequence 2's length {length} is outside \[1, 12\] \(its block table "
        r"holds 3 blocks of 4 tokens\)",
    ):
        cpu_ops.decode_attention_bf16(q, k_cache, v_cache, tables, seq_lens, 0.25, None, None)
    with pytest.raises(ValueError, match="decode attention of 3 sequences"):  # a table with too few rows
        cpu_ops.decode_attention_bf16(q, k_cache, v_cache, tables[:2], seq_lens, 0.25, None, None)


@pytest.mark.parametrize(
    "field,index,value,message",
    [
        ("tables", (1, 2), 10, r"block id 10 \(sequence 1, block table entry 2\) is outside the cache of 10 blocks"),
        ("tables", (0, 0), -3, r"block id -3 \(sequence 0, block table entry 0\) is outside the cache of 10 blocks"),
        ("lens", 1, 13, r"sequence 1's length 13 is outside \[1, 12\]"),
        ("lens", 0, 0, r"sequence 0's length 0 is outside \[1, 12\]"),
        ("starts", 1, 8, r"sequence 0's new tokens 0\.\.8 are .* more than its length 7"),
        ("starts", 1, -1, r"sequence 0's new tokens 0\.\.-1 are out of order"),
        ("rows", None, 16, r"sequence 1's new tokens 7\.\.17 are out of order, past the step's tokens"),
    ],
)
def test_prefill_attention_refuses_a_bad_block_id_length_or_query_range(field, index, value, message):
    blocks, bs, nkv, nh, d = 10, 4, 2, 6, 16
    k_cache = torch.randn(blocks, bs, nkv, d).to(torch.bfloat16)
    v_cache = torch.randn(blocks, bs, nkv, d).to(torch.bfloat16)
    args = {
        "tables": torch.tensor([[3, 8, 0], [1, 6, 2]], dtype=torch.int32),
        "starts": torch.tensor([0, 7, 17], dtype=torch.int32),
        "lens": torch.tensor([7, 10], dtype=torch.int32),
    }
    rows = value if field == "rows" else 17  # query rows of the step
    if field != "rows":
        args[field][index] = value
    with pytest.raises(ValueError, match=message):
        cpu_ops.prefill_attention_bf16(
            torch.randn(rows, nh, d), k_cache, v_cache, args["tables"], args["starts"], args["lens"], 0.25, None, None
        )
