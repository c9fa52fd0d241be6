"""Hypothesis properties of input validation: SamplingParams and the core API's Batch / Context.decode.

Invalid input is refused (ValueError naming the field; decode's -1), never another exception; valid input is
accepted; a refused decode leaves cell metadata and K/V byte-identical.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from novainfer import SamplingParams
from novainfer.core import Batch, Context, Status

# ---- SamplingParams ----------------------------------------------------------------------------------
# The documented ranges (vLLM's), written out here as the oracle: (integer, low, high, low excluded, None ok); an
# integer's largest is int64's, since requests cross to the engine core in msgpack
I64 = 2**63 - 1
SPEC = {
    "n": (True, 1, I64, False, False),
    "presence_penalty": (False, -2, 2, False, False),
    "frequency_penalty": (False, -2, 2, False, False),
    "repetition_penalty": (False, 0, None, True, False),
    "temperature": (False, 0, None, False, False),
    "top_p": (False, 0, 1, True, False),
    "top_k": (True, -1, I64, False, False),
    "min_p": (False, 0, 1, False, False),
    "seed": (True, -(2**63), 2**63 - 1, False, True),
    "max_tokens": (True, 1, I64, False, True),
    "min_tokens": (True, 0, I64, False, False),
    "logprobs": (True, 0, I64, False, True),
    "prompt_logprobs": (True, 0, I64, False, True),
}

ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.integers(-3, 3), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers()),
)


def in_spec(name: str, value: object) -> bool:
    integer, low, high, low_open, nullable = SPEC[name]
    if value is None:
        return nullable
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return (value > low if low_open else value >= low) and (high is None or value <= high)


@given(name=st.sampled_from(sorted(SPEC)), value=ANY_VALUE)
def test_each_numeric_field_is_accepted_exactly_within_its_range(name, value):
    if name == "min_tokens":  # min_tokens <= max_tokens is a rule of its own; lift max_tokens out of the way
        kw = {"min_tokens": value, "max_tokens": None}
    else:
        kw = {name: value}
    if in_spec(name, value):
        params = SamplingParams(**kw)
        assert getattr(params, name) == value
    else:
        with pytest.raises(ValueError) as err:
            SamplingParams(**kw)
        assert str(err.value).startswith(name)


FIELDS = sorted(SPEC) + ["stop", "stop_token_ids"]


@given(
    kw=st.dictionaries(
        st.sampled_from(FIELDS), st.one_of(ANY_VALUE, st.lists(st.text(max_size=3), max_size=3)), max_size=5
    )
)
def test_any_combination_is_accepted_whole_or_refused_naming_a_given_field(kw):
    try:
        params = SamplingParams(**kw)
    except ValueError as exc:
        assert str(exc).split(" ", 1)[0] in kw, exc
        return
    assert all(isinstance(s, str) and s for s in params.stop)
    assert all(type(t) is int and t >= 0 for t in params.stop_token_ids)
    assert params.max_tokens is None or params.min_tokens <= params.max_tokens
    for name in SPEC:
        assert in_spec(name, getattr(params, name)), name


# ---- core API: Batch and Context.decode ------------------------------------------------------------------
N_SEQ, CELLS, PREFIX = 3, 24, [5, 17, 99, 230]


@pytest.fixture(scope="module")
def ctx(tiny_qwen2):
    return Context(tiny_qwen2, n_cells=CELLS, n_seq_max=N_SEQ)


def fresh(ctx: Context) -> tuple:
    """The cache holding PREFIX in sequence 0 (positions 0..3); returns its exact state."""
    ctx.kv_clear()
    assert ctx.decode(Batch.get_one(PREFIX)) == Status.OK
    return ctx.cache.pos.copy(), ctx.cache.seqs.copy(), ctx.kv_data.clone()


def unchanged(ctx: Context, state: tuple) -> bool:
    pos, seqs, kv = state
    return np.array_equal(ctx.cache.pos, pos) and np.array_equal(ctx.cache.seqs, seqs) and torch.equal(ctx.kv_data, kv)


@st.composite
def valid_batches(draw) -> Batch:
    """A batch Batch.add builds by the rules: tokens in the vocabulary, each sequence's positions rising
    after what the cache holds, 1..N_SEQ ids per token."""
    n = draw(st.integers(1, 8))
    batch = Batch.init(n, n_seq_max=N_SEQ)
    next_pos = {0: len(PREFIX), 1: 0, 2: 0}
    for _ in range(n):
        ids = draw(st.lists(st.integers(0, N_SEQ - 1), min_size=1, max_size=N_SEQ, unique=True))
        pos = max(next_pos[s] for s in ids) + draw(st.integers(0, 3))
        for s in ids:
            next_pos[s] = pos + 1
        batch.add(draw(st.integers(0, 399)), pos, ids, logits=draw(st.booleans()))
    return batch


def break_one(batch: Batch, how: str, i: int, vocab: int, max_pos: int) -> str:
    """Make the valid batch invalid in one way at token i (i < n_tokens); returns what was broken."""
    if how == "token":
        batch.token[i] = vocab + i if i % 2 else -1 - i
    elif how == "seq_id":
        batch.seq_id[i, 0] = N_SEQ + i if i % 2 else -1
    elif how == "n_seq_id":
        batch.n_seq_id[i] = (0, -1, N_SEQ + 1)[i % 3]
    elif how == "pos back":
        s = int(batch.seq_id[i, 0])
        batch.pos[i] = (len(PREFIX) if s == 0 else 0) - 1  # at or before what sequence s already holds
    elif how == "pos beyond":
        batch.pos[i] = max_pos + i
    elif how == "n_tokens":
        batch.n_tokens = (0, -1, batch.capacity + 1)[i % 3]
    elif how == "short column":
        batch.pos = batch.pos[:i]  # the pos column ends before token i
    elif how == "flat seq_id":
        batch.seq_id = batch.seq_id[:, 0].copy()  # one id per token, but not the [n, n_seq_max] shape
    return how


SETTINGS = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(batch=valid_batches())
def test_a_valid_batch_is_decoded_into_its_cells(ctx, batch):
    fresh(ctx)
    assert ctx.decode(batch) == Status.OK
    assert ctx.cache.n_used == len(PREFIX) + batch.n_tokens
    assert ctx.n_outputs() == int(batch.logits[: batch.n_tokens].sum())
    for i in range(batch.n_tokens):
        ids = sorted(batch.seq_id[i, : batch.n_seq_id[i]].tolist())
        cells = [
            c
            for c in range(CELLS)
            if ctx.cache.pos[c] == batch.pos[i] and np.flatnonzero(ctx.cache.seqs[c]).tolist() == ids
        ]
        assert len(cells) == 1, (i, ids)


HOW = ["token", "seq_id", "n_seq_id", "pos back", "pos beyond", "n_tokens", "short column", "flat seq_id"]


@SETTINGS
@given(batch=valid_batches(), how=st.sampled_from(HOW), data=st.data())
def test_a_broken_batch_is_refused_and_changes_nothing(ctx, batch, how, data):
    i = data.draw(st.integers(0, batch.n_tokens - 1))
    if how == "pos back":
        assume(batch.pos[i] > 0)
    state = fresh(ctx)
    break_one(batch, how, i, ctx.vocab_size, ctx.max_pos)
    assert ctx.decode(batch) == Status.INVALID_INPUT, how
    assert unchanged(ctx, state)


COLUMN = st.one_of(
    st.none(),
    st.lists(st.integers(-(2**40), 2**40), max_size=6).map(np.array),
    st.lists(st.integers(-3, 500), max_size=6).map(np.array),
    st.lists(st.floats(-3, 500), max_size=6).map(np.array),
    st.lists(st.lists(st.integers(-2, 4), min_size=1, max_size=4), min_size=1, max_size=6).map(
        lambda rows: np.array([r[:1] * 4 for r in rows])
    ),
)


@SETTINGS
@given(
    token=COLUMN.filter(lambda c: c is not None),
    pos=COLUMN,
    n_seq_id=COLUMN,
    seq_id=COLUMN,
    logits=COLUMN,
    n_tokens=st.integers(-2, 8),
)
def test_any_columns_are_decoded_or_refused_never_raised(ctx, token, pos, n_seq_id, seq_id, logits, n_tokens):
    state = fresh(ctx)
    rc = ctx.decode(Batch(token, pos, n_seq_id, seq_id, logits, n_tokens))
    assert rc in (Status.OK, Status.NO_KV_SLOT, Status.INVALID_INPUT)
    if rc != Status.OK:
        assert unchanged(ctx, state)
    else:
        assert ctx.cache.n_used == len(PREFIX) + n_tokens


@given(
    token=st.one_of(st.integers(), st.floats(), st.text(max_size=2)),
    pos=st.one_of(st.integers(), st.none()),
    seq_ids=st.lists(st.one_of(st.integers(), st.floats()), max_size=3),
)
def test_batch_add_appends_whole_or_refuses(token, pos, seq_ids):
    batch = Batch.init(2, n_seq_max=2)
    batch.add(7, 0, [0])
    before = [c.copy() for c in (batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits)]
    try:
        batch.add(token, pos, seq_ids)
    except ValueError:
        assert batch.n_tokens == 1
        assert all(
            np.array_equal(a[:1], b[:1])
            for a, b in zip(before, (batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits))
        )
        return
    assert batch.n_tokens == 2 and batch.token[1] == token and batch.pos[1] == pos
    assert batch.seq_id[1, : batch.n_seq_id[1]].tolist() == seq_ids


@given(tokens=st.lists(st.one_of(st.integers(), st.floats(), st.text(max_size=1)), max_size=4))
def test_get_one_takes_int64_token_ids_or_refuses(tokens):
    try:
        batch = Batch.get_one(tokens)
    except ValueError:
        assert any(not isinstance(t, int) or not -(2**63) <= t < 2**63 for t in tokens)
        return
    assert batch.token.tolist() == tokens and batch.n_tokens == len(tokens)
