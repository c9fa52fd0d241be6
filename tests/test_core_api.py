"""The llama.cpp-style core API on the SLOT cache, against transformers' logits and recomputation (fp32, CPU)."""

import logging

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from novainfer.core import Batch, Context, Status
from novainfer.core.batch import resolve_batch
from tests.tiny_models import hf_greedy

ATOL = 1e-4
PROMPT = [5, 17, 99, 230, 41, 8, 77, 150, 3, 260]


@pytest.fixture(scope="module")
def hf_models():
    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get


def hf_logits(model, tokens, positions=None):
    """transformers' logits [len(tokens), vocab] for one sequence (optionally at given positions)."""
    kw = {} if positions is None else {"position_ids": torch.tensor([positions])}
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens]), **kw).logits[0].float()


def seq_batch(tokens_by_seq, start=None, all_logits=False):
    """One batch holding several sequences' tokens interleaved (token order: round robin)."""
    start = start or {}
    batch = Batch.init(sum(len(t) for t in tokens_by_seq.values()), n_seq_max=2)
    longest = max(len(t) for t in tokens_by_seq.values())
    for j in range(longest):
        for s, toks in tokens_by_seq.items():
            if j < len(toks):
                batch.add(toks[j], start.get(s, 0) + j, [s], logits=all_logits or j == len(toks) - 1)
    return batch


def cache_state(ctx):
    return ctx.cache.pos.copy(), ctx.cache.seqs.copy(), ctx.kv_data.clone()


def assert_same_state(ctx, state):
    pos, seqs, kv = state
    assert np.array_equal(ctx.cache.pos, pos) and np.array_equal(ctx.cache.seqs, seqs)
    assert torch.equal(ctx.kv_data, kv)


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_llama", "tiny_qwen3"])
def test_single_sequence_matches_transformers(fixture, request, hf_models):
    path = request.getfixturevalue(fixture)
    ctx = Context(path, n_cells=64)
    batch = Batch.init(len(PROMPT), n_seq_max=1)
    for i, t in enumerate(PROMPT):
        batch.add(t, i, [0], logits=True)
    assert ctx.decode(batch) == Status.OK
    ref = hf_logits(hf_models(path), PROMPT)
    assert ctx.n_outputs() == len(PROMPT)
    torch.testing.assert_close(ctx.get_logits(), ref, atol=ATOL, rtol=0)
    # then token by token through the compatibility helper: the same greedy tokens as transformers
    ctx.kv_clear()
    tokens, out = list(PROMPT), []
    nxt = ctx.infer(tokens)
    for _ in range(8):
        out.append(nxt)
        nxt = ctx.infer([nxt])
    assert out == hf_greedy(path, PROMPT, 8)


def test_output_rows_are_the_flagged_tokens_in_order(tiny_qwen2, hf_models):
    ctx = Context(tiny_qwen2, n_cells=64)
    flagged = [1, 4, 5, 9]
    batch = Batch.init(16, n_seq_max=1)
    for i, t in enumerate(PROMPT):
        batch.add(t, i, [0], logits=i in flagged)
    assert ctx.decode(batch) == Status.OK
    ref = hf_logits(hf_models(tiny_qwen2), PROMPT)
    assert ctx.n_outputs() == 4 and ctx.output_ids().tolist() == flagged
    torch.testing.assert_close(ctx.get_logits(), ref[flagged], atol=ATOL, rtol=0)
    torch.testing.assert_close(ctx.get_logits_ith(4), ref[4], atol=ATOL, rtol=0)
    torch.testing.assert_close(ctx.get_logits_ith(-1), ref[9], atol=ATOL, rtol=0)
    torch.testing.assert_close(ctx.get_logits_ith(-4), ref[1], atol=ATOL, rtol=0)
    for bad in (0, 3, 10, -5):
        with pytest.raises(IndexError):
            ctx.get_logits_ith(bad)
    # the buffer was reserved before decode: a later decode with fewer rows reuses the same memory
    ptr = ctx.get_logits().data_ptr()
    batch.clear()
    batch.add(11, 10, [0], logits=True)
    assert ctx.decode(batch) == Status.OK
    assert ctx.get_logits().data_ptr() == ptr and ctx.n_outputs() == 1 and ctx.output_ids().tolist() == [0]
    torch.testing.assert_close(
        ctx.get_logits_ith(0), hf_logits(hf_models(tiny_qwen2), PROMPT + [11])[-1], atol=ATOL, rtol=0
    )


def test_get_one_tracks_positions_and_outputs_the_last_token(tiny_qwen2, hf_models):
    ctx = Context(tiny_qwen2, n_cells=64)
    assert ctx.decode(Batch.get_one(PROMPT[:6])) == Status.OK
    assert ctx.decode(Batch.get_one(PROMPT[6:])) == Status.OK
    assert ctx.kv_seq_pos_max(0) == len(PROMPT) - 1 and ctx.n_outputs() == 1
    assert ctx.output_ids().tolist() == [len(PROMPT) - 7]
    torch.testing.assert_close(ctx.get_logits_ith(-1), hf_logits(hf_models(tiny_qwen2), PROMPT)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_ubatch", [512, 3])  # 3: the batch runs as several forwards
def test_two_sequences_in_one_batch_are_isolated(n_ubatch, tiny_qwen2, hf_models):
    hf = hf_models(tiny_qwen2)
    a, b = PROMPT, [300, 12, 9, 44, 71, 2]
    ctx = Context(tiny_qwen2, n_cells=64, n_ubatch=n_ubatch)
    assert ctx.decode(seq_batch({0: a, 1: b}, all_logits=True)) == Status.OK
    rows = ctx.get_logits()
    ids = ctx.output_ids()
    order = [(0, j) for j in range(len(a))]
    order = sorted(order + [(1, j) for j in range(len(b))], key=lambda sj: (sj[1], sj[0]))  # round robin
    ref = {0: hf_logits(hf, a), 1: hf_logits(hf, b)}
    for row, token_index in enumerate(ids):
        s, j = order[token_index]
        torch.testing.assert_close(rows[row], ref[s][j], atol=ATOL, rtol=0)
    # one more token each, again in one batch
    assert ctx.decode(seq_batch({0: [33], 1: [34]}, start={0: len(a), 1: len(b)})) == Status.OK
    torch.testing.assert_close(ctx.get_logits_ith(0), hf_logits(hf, a + [33])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(ctx.get_logits_ith(1), hf_logits(hf, b + [34])[-1], atol=ATOL, rtol=0)


def test_token_with_two_seq_ids_sees_both_sequences(tiny_qwen2, hf_models):
    hf = hf_models(tiny_qwen2)
    a, b, q = PROMPT[:4], PROMPT[4:7], PROMPT[7]
    ctx = Context(tiny_qwen2, n_cells=64, n_seq_max=4)
    batch = Batch.init(8, n_seq_max=2)
    for i, t in enumerate(a):
        batch.add(t, i, [0])
    for i, t in enumerate(b):  # b belongs to sequences 0 and 1, so it sees a: HF's a + b
        batch.add(t, len(a) + i, [0, 1])
    assert ctx.decode(batch) == Status.OK
    # the mask: a query of {1} sees b's cells only, a query of {0} sees a and b
    v1, _ = resolve_batch(seq_batch({1: [q]}, start={1: 7}), 4, ctx.vocab_size, ctx.max_pos, ctx.cache.seq_pos_max)
    cells, visible = ctx.cache.visible_cells(v1)
    assert sorted(cells[visible[0]].tolist()) == [4, 5, 6]
    v2, _ = resolve_batch(seq_batch({0: [q]}, start={0: 7}), 4, ctx.vocab_size, ctx.max_pos, ctx.cache.seq_pos_max)
    cells, visible = ctx.cache.visible_cells(v2)
    assert sorted(cells[visible[0]].tolist()) == list(range(7))
    batch.clear()
    batch.add(q, 7, [0, 1], logits=True)
    assert ctx.decode(batch) == Status.OK
    torch.testing.assert_close(ctx.get_logits_ith(0), hf_logits(hf, a + b + [q])[-1], atol=ATOL, rtol=0)
    # the same token in sequence 1 alone misses a: its logits differ from HF's a + b + q
    assert ctx.kv_seq_rm(-1, 7, -1) == Status.OK
    assert ctx.decode(seq_batch({1: [q]}, start={1: 7})) == Status.OK
    assert not torch.allclose(ctx.get_logits_ith(0), hf_logits(hf, a + b + [q])[-1], atol=1e-3)


def test_kv_seq_cp_prefix_reuse_matches_recompute(tiny_qwen2, hf_models):
    hf = hf_models(tiny_qwen2)
    system, tails = PROMPT[:7], {1: [300, 12], 2: [9], 3: [44, 71, 2]}
    ctx = Context(tiny_qwen2, n_cells=32, n_seq_max=4)
    assert ctx.decode(Batch.get_one(system)) == Status.OK
    for s in tails:
        assert ctx.kv_seq_cp(s, 0, 0, -1) == Status.OK
    assert ctx.cache.n_used == len(system)  # shared, not copied
    assert ctx.decode(seq_batch(tails, start={s: len(system) for s in tails})) == Status.OK
    # round robin: seq 2 ends at token 1, seq 1 at token 3, seq 3 at token 5
    assert ctx.n_outputs() == 3 and ctx.output_ids().tolist() == [1, 3, 5]
    for row, s in zip(ctx.get_logits(), [2, 1, 3]):
        torch.testing.assert_close(row, hf_logits(hf, system + tails[s])[-1], atol=ATOL, rtol=0)
    assert ctx.cache.n_used == len(system) + sum(len(t) for t in tails.values())


def test_kv_seq_rm_frees_cells_that_find_slots_reuses(tiny_qwen2, hf_models):
    hf = hf_models(tiny_qwen2)
    ctx = Context(tiny_qwen2, n_cells=len(PROMPT))
    assert ctx.decode(Batch.get_one(PROMPT)) == Status.OK
    assert ctx.decode(Batch.get_one([1])) == Status.NO_KV_SLOT
    assert ctx.kv_seq_rm(0, 6, -1) == Status.OK
    assert ctx.kv_seq_pos_max(0) == 5 and ctx.cache.n_used == 6
    other = [300, 12, 9, 44]
    assert ctx.decode(Batch.get_one(other)) == Status.OK  # continues at pos 6 in the freed cells
    assert ctx._last[1].idxs.tolist() == [6, 7, 8, 9]
    torch.testing.assert_close(ctx.get_logits_ith(-1), hf_logits(hf, PROMPT[:6] + other)[-1], atol=ATOL, rtol=0)
    text = ctx.dump_cells()
    assert "cell[6] = {seq_ids=[0], pos=6, used=True}" in text and "token[3] -> cell[9]" in text


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_llama"])  # llama: llama3 rope scaling
def test_kv_seq_add_matches_recompute_at_shifted_positions(fixture, request, hf_models):
    path = request.getfixturevalue(fixture)
    hf = hf_models(path)
    ctx = Context(path, n_cells=32)
    assert ctx.decode(Batch.get_one(PROMPT)) == Status.OK
    for delta in (37, -30):
        assert ctx.kv_seq_add(0, 0, -1, delta) == Status.OK
    start = 7
    assert ctx.kv_seq_pos_min(0) == start and ctx.kv_seq_pos_max(0) == start + len(PROMPT) - 1
    assert ctx.decode(Batch.get_one([11])) == Status.OK  # auto position: start + len(PROMPT)
    ref = hf_logits(hf, PROMPT + [11], list(range(start, start + len(PROMPT) + 1)))[-1]
    torch.testing.assert_close(ctx.get_logits_ith(-1), ref, atol=ATOL, rtol=0)
    # keys left at their old rotation would be HF's keys at 0..9 seen from pos 17: not the same logits
    stale = hf_logits(hf, PROMPT + [11], list(range(len(PROMPT))) + [start + len(PROMPT)])[-1]
    assert not torch.allclose(ref, stale, atol=1e-3)
    # the shifted cache holds the K/V a fresh decode at the shifted positions writes
    fresh = Context(path, n_cells=32)
    batch = Batch.init(len(PROMPT) + 1)
    for i, t in enumerate(PROMPT + [11]):
        batch.add(t, start + i, [0])
    assert fresh.decode(batch) == Status.OK
    torch.testing.assert_close(
        ctx.kv_data[:, :, : len(PROMPT) + 1], fresh.kv_data[:, :, : len(PROMPT) + 1], atol=ATOL, rtol=0
    )


def test_ranges_are_half_open_with_open_ends(tiny_qwen2):
    ctx = Context(tiny_qwen2, n_cells=16, n_seq_max=2)
    assert ctx.decode(Batch.get_one(PROMPT[:6])) == Status.OK  # sequence 0: pos 0..5 in cells 0..5
    used = lambda: np.flatnonzero(ctx.cache.used).tolist()  # noqa: E731
    assert ctx.kv_seq_cp(1, 0, 2, 4) == Status.OK
    assert np.flatnonzero(ctx.cache.seqs[:, 1]).tolist() == [2, 3]
    assert ctx.kv_seq_rm(0, -1, 2) == Status.OK and used() == [2, 3, 4, 5]  # p0 < 0: from the start
    assert ctx.kv_seq_rm(0, 5, -1) == Status.OK and used() == [2, 3, 4]  # p1 < 0: to the end
    assert ctx.kv_seq_rm(0, 2, 4) == Status.OK and used() == [2, 3, 4]  # cells 2, 3 stay with sequence 1
    assert (ctx.kv_seq_pos_min(0), ctx.kv_seq_pos_max(0), ctx.kv_seq_pos_max(1)) == (4, 4, 3)
    assert ctx.kv_seq_add(1, 3, -1, 10) == Status.OK and ctx.cache.pos[2:5].tolist() == [2, 13, 4]
    assert ctx.kv_seq_add(1, 0, 3, -3) == Status.OK and used() == [3, 4]  # pushed below 0: freed
    assert ctx.cache.pos[2] == -1 and ctx.kv_seq_pos_max(1) == 13
    assert ctx.kv_seq_keep(0) == Status.OK and used() == [4]


def test_kv_seq_keep_drops_other_sequences(tiny_qwen2, hf_models):
    hf = hf_models(tiny_qwen2)
    ctx = Context(tiny_qwen2, n_cells=32, n_seq_max=3)
    assert ctx.decode(Batch.get_one(PROMPT[:5])) == Status.OK
    assert ctx.kv_seq_cp(1, 0, 0, 3) == Status.OK  # seq 1 shares the first 3 cells
    tails = {1: [300, 12], 2: [9, 44, 71]}
    assert ctx.decode(seq_batch(tails, start={1: 3, 2: 0})) == Status.OK
    assert ctx.kv_seq_keep(1) == Status.OK
    assert ctx.kv_seq_pos_max(0) == -1 and ctx.kv_seq_pos_max(2) == -1 and ctx.kv_seq_pos_max(1) == 4
    assert ctx.cache.n_used == 5 and not ctx.cache.seqs[:, [0, 2]].any()
    assert ctx.decode(Batch.get_one([7])) == Status.OK  # sequence 0 starts over, alone
    torch.testing.assert_close(ctx.get_logits_ith(-1), hf_logits(hf, [7])[-1], atol=ATOL, rtol=0)
    assert ctx.decode(seq_batch({1: [8]}, start={1: 5})) == Status.OK
    torch.testing.assert_close(ctx.get_logits_ith(-1), hf_logits(hf, PROMPT[:3] + [300, 12, 8])[-1], atol=ATOL, rtol=0)


def test_empty_and_no_hit_ranges_are_no_ops(tiny_qwen2):
    ctx = Context(tiny_qwen2, n_cells=16, n_seq_max=2)
    assert ctx.decode(Batch.get_one(PROMPT[:6])) == Status.OK
    state = cache_state(ctx)
    for op in (
        lambda: ctx.kv_seq_rm(0, 3, 3),
        lambda: ctx.kv_seq_rm(0, 4, 2),
        lambda: ctx.kv_seq_rm(0, 6, 100),
        lambda: ctx.kv_seq_rm(1, 0, -1),
        lambda: ctx.kv_seq_cp(1, 0, 5, 5),
        lambda: ctx.kv_seq_cp(1, 0, 20, -1),
        lambda: ctx.kv_seq_add(0, 2, 2, 5),
        lambda: ctx.kv_seq_add(0, 50, -1, 5),
        lambda: ctx.kv_seq_add(1, 0, -1, 5),
        lambda: ctx.kv_seq_add(0, 0, -1, 0),
        lambda: ctx.kv_seq_keep(0),
    ):
        assert op() == Status.OK
        assert_same_state(ctx, state)
    for op in (
        lambda: ctx.kv_seq_rm(2, 0, -1),
        lambda: ctx.kv_seq_cp(5, 0, 0, -1),
        lambda: ctx.kv_seq_add(-1, 0, -1, 1),
        lambda: ctx.kv_seq_keep(9),
    ):
        assert op() == Status.INVALID_INPUT
        assert_same_state(ctx, state)
    assert ctx.kv_seq_pos_max(1) == -1 and ctx.kv_seq_pos_max(7) == -1


def test_full_cache_fails_with_1_and_changes_nothing(tiny_qwen2, hf_models):
    ctx = Context(tiny_qwen2, n_cells=8)
    assert ctx.decode(Batch.get_one(PROMPT[:6])) == Status.OK
    logits = ctx.get_logits().clone()
    state = cache_state(ctx)
    assert ctx.decode(Batch.get_one(PROMPT[6:9])) == Status.NO_KV_SLOT
    assert_same_state(ctx, state)
    torch.testing.assert_close(ctx.get_logits(), logits, atol=0, rtol=0)  # previous outputs still readable
    # one sequence may take every cell: no per-sequence quota
    assert ctx.decode(Batch.get_one(PROMPT[6:8])) == Status.OK and ctx.cache.n_used == 8
    torch.testing.assert_close(
        ctx.get_logits_ith(-1), hf_logits(hf_models(tiny_qwen2), PROMPT[:8])[-1], atol=ATOL, rtol=0
    )
    state = cache_state(ctx)
    assert ctx.decode(Batch.get_one([1])) == Status.NO_KV_SLOT
    assert_same_state(ctx, state)
    assert Context(tiny_qwen2, n_cells=4).decode(Batch.get_one(PROMPT)) == Status.NO_KV_SLOT


def test_invalid_batches_return_minus_1_with_a_reason(tiny_qwen2, caplog):
    ctx = Context(tiny_qwen2, n_cells=16, n_seq_max=2)
    assert ctx.decode(Batch.get_one(PROMPT[:4])) == Status.OK
    state = cache_state(ctx)
    cases = {
        "empty": Batch.init(4),
        "vocabulary": Batch.get_one([ctx.vocab_size]),
        "n_seq_max": seq_batch({2: [5]}),
        "already reaches 3": seq_batch({0: [5]}, start={0: 2}),
        "must rise": seq_batch({1: [5, 6]}),
        "beyond the model": seq_batch({1: [5]}, start={1: ctx.max_pos}),
    }
    cases["must rise"].pos[1] = 0  # second token of sequence 1 goes back to pos 0
    for reason, batch in cases.items():
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="novainfer.core.context"):
            assert ctx.decode(batch) == Status.INVALID_INPUT, reason
        assert reason in caplog.text
        assert_same_state(ctx, state)


def test_abort_and_forward_failure_leave_the_cache_as_it_was(tiny_qwen2, hf_models, monkeypatch):
    ctx = Context(tiny_qwen2, n_cells=16, n_ubatch=2)
    assert ctx.decode(Batch.get_one(PROMPT[:4])) == Status.OK
    state = cache_state(ctx)
    ctx.set_abort_callback(lambda: True)
    assert ctx.decode(Batch.get_one(PROMPT[4:6])) == Status.ABORTED  # before anything is planned
    assert_same_state(ctx, state)
    calls = []
    ctx.set_abort_callback(lambda: calls.append(1) or len(calls) == 3)  # between the 2nd and 3rd ubatch
    assert ctx.decode(Batch.get_one(PROMPT[4:10])) == Status.ABORTED and len(calls) == 3
    pos, seqs, kv = state
    assert np.array_equal(ctx.cache.pos, pos) and np.array_equal(ctx.cache.seqs, seqs)
    assert torch.equal(ctx.kv_data[:, :, :4], kv[:, :, :4])  # the used cells' K/V
    ctx.set_abort_callback(None)

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(ctx.model, "compute_logits", boom)
    assert ctx.decode(Batch.get_one(PROMPT[4:6])) == Status.COMPUTE_FAILED
    assert np.array_equal(ctx.cache.pos, pos) and np.array_equal(ctx.cache.seqs, seqs)
    monkeypatch.undo()
    assert ctx.decode(Batch.get_one(PROMPT[4:])) == Status.OK and ctx.kv_seq_pos_max(0) == len(PROMPT) - 1
    torch.testing.assert_close(ctx.get_logits_ith(-1), hf_logits(hf_models(tiny_qwen2), PROMPT)[-1], atol=ATOL, rtol=0)


def test_batch_init_and_add():
    batch = Batch.init(2, n_seq_max=2)
    batch.add(1, 0, [0, 1], logits=True)
    batch.add(2, 1, [1])
    assert batch.n_tokens == 2 and batch.n_seq_id.tolist() == [2, 1] and batch.logits.tolist() == [1, 0]
    with pytest.raises(IndexError):
        batch.add(3, 2, [0])
    with pytest.raises(ValueError):
        Batch.init(1, n_seq_max=1).add(1, 0, [0, 1])
    with pytest.raises(NotImplementedError):
        Batch.init(1, embd=64)


def test_example_shares_the_system_prompt_and_matches_transformers(tiny_qwen2):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "examples" / "core_api.py"
    spec = importlib.util.spec_from_file_location("core_api_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    system, prompts, generated = example.run(tiny_qwen2, max_new_tokens=6, verbose=False)
    assert len(prompts) == len(example.QUESTIONS) > 1
    for s, ids in prompts.items():
        ref = hf_greedy(tiny_qwen2, system + ids, 6)
        assert generated[s] == ref[: len(generated[s])], s
