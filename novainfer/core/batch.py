"""The core API's input: a batch in SoA form (token, pos, n_seq_id, seq_id, logits), as llama.cpp's llama_batch.

A Batch is what the user fills; `resolve_batch` checks it and fills the optional columns (positions
tracked per sequence, seq id 0, logits for the last token only) into a BatchView the cache and the
forward read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


class Batch:
    """Contiguous columns of capacity n_tokens_max; the first n_tokens rows are the batch.

    pos, n_seq_id, seq_id and logits may be None: positions then continue each sequence, every token
    belongs to sequence 0, and only the last token gets a logits row.
    """

    def __init__(
        self,
        token: np.ndarray,
        pos: np.ndarray | None,
        n_seq_id: np.ndarray | None,
        seq_id: np.ndarray | None,
        logits: np.ndarray | None,
        n_tokens: int,
    ):
        self.token, self.pos, self.n_seq_id, self.seq_id, self.logits = token, pos, n_seq_id, seq_id, logits
        self.n_tokens = n_tokens

    @classmethod
    def init(cls, n_tokens: int, embd: int = 0, n_seq_max: int = 1) -> "Batch":
        """Room for n_tokens tokens of up to n_seq_max sequence ids each; arguments in llama_batch_init's order."""
        if embd:
            raise NotImplementedError("embedding input (embd != 0) is not supported; pass token ids")
        if n_tokens < 1 or n_seq_max < 1:
            raise ValueError(f"Batch.init needs n_tokens >= 1 and n_seq_max >= 1, got {n_tokens}, {n_seq_max}")
        return cls(
            token=np.zeros(n_tokens, np.int64),
            pos=np.zeros(n_tokens, np.int64),
            n_seq_id=np.zeros(n_tokens, np.int32),
            seq_id=np.zeros((n_tokens, n_seq_max), np.int64),
            logits=np.zeros(n_tokens, np.int8),
            n_tokens=0,
        )

    @classmethod
    def get_one(cls, tokens: Sequence[int]) -> "Batch":
        """A single-sequence batch of tokens: sequence 0, automatic positions, logits for the last token."""
        token = np.array([_int64("token", t) for t in tokens], dtype=np.int64)
        return cls(token=token, pos=None, n_seq_id=None, seq_id=None, logits=None, n_tokens=len(token))

    @property
    def capacity(self) -> int:
        return len(self.token)

    def add(self, token: int, pos: int, seq_ids: Sequence[int], logits: bool = False) -> None:
        """Append one token (as llama.cpp's common_batch_add); needs a batch made by Batch.init.

        Every argument is checked before anything is written: a refused token (ValueError) leaves the batch as it was.
        """
        if self.pos is None or self.seq_id is None or self.n_seq_id is None or self.logits is None:
            raise ValueError("Batch.add needs the columns of a batch made by Batch.init")
        i = self.n_tokens
        if i >= self.capacity:
            raise IndexError(f"batch is full ({self.capacity} tokens)")
        if not 1 <= len(seq_ids) <= self.seq_id.shape[1]:
            raise ValueError(f"a token takes 1..{self.seq_id.shape[1]} sequence ids, got {len(seq_ids)}")
        token, pos, seq_ids = _int64("token", token), _int64("pos", pos), [_int64("seq_id", s) for s in seq_ids]
        self.token[i], self.pos[i], self.logits[i] = token, pos, int(bool(logits))
        self.n_seq_id[i] = len(seq_ids)
        self.seq_id[i, : len(seq_ids)] = seq_ids
        self.n_tokens = i + 1

    def clear(self) -> None:
        """Forget the tokens, keep the buffers."""
        self.n_tokens = 0


def _int64(name: str, value: object) -> int:
    """value as an int64 (token id, position, sequence id); ValueError for floats, bools, text or overflow."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not -(2**63) <= value < 2**63:
        raise ValueError(f"{name} must be an int64 integer, got {value!r}")
    return int(value)


def _column(name: str, column: object, n: int, ndim: int, kinds: str = "iu") -> tuple[np.ndarray | None, str]:
    """The column as an array when it can describe n tokens (integers, ndim dims, >= n rows); else (None, why)."""
    a = np.asarray(column)
    if a.ndim != ndim or a.dtype.kind not in kinds or len(a) < n:
        return None, (
            f"{name} must be a {ndim}-d integer array of at least n_tokens={n} rows, got shape {a.shape} of {a.dtype}"
        )
    return a, ""


@dataclass
class BatchView:
    """A checked batch with every column filled: what find_slots, the mask and the forward read."""

    tokens: np.ndarray  # [n] int64
    pos: np.ndarray  # [n] int64 logical positions
    seq_mask: np.ndarray  # [n, n_seq_max] bool: token i belongs to sequence s
    outputs: np.ndarray  # [n] bool: token i gets a logits row

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def seq_ids(self, i: int) -> list[int]:
        return np.flatnonzero(self.seq_mask[i]).tolist()

    def slice(self, start: int, end: int) -> "BatchView":
        """Tokens [start, end): one ubatch."""
        return BatchView(self.tokens[start:end], self.pos[start:end], self.seq_mask[start:end], self.outputs[start:end])


def resolve_batch(
    batch: Batch, n_seq_max: int, vocab_size: int, max_pos: int, seq_pos_max: Callable[[int], int]
) -> tuple[BatchView | None, str]:
    """Check the batch against the context and fill the optional columns; (None, reason) when invalid.

    seq_pos_max(s) is the cache's last position of sequence s (-1 when empty): a sequence's positions
    must rise strictly through the batch and start after it.
    """
    n = batch.n_tokens
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        return None, f"n_tokens must be an integer, got {n!r}"
    if n <= 0:
        return None, "the batch is empty"
    columns = {}  # every given column is checked for shape and type before any row is read
    for name, ndim, kinds in (
        ("token", 1, "iu"),
        ("pos", 1, "iu"),
        ("n_seq_id", 1, "iu"),
        ("seq_id", 2, "iu"),
        ("logits", 1, "iub"),
    ):
        if getattr(batch, name) is not None:
            columns[name], why = _column(name, getattr(batch, name), n, ndim, kinds)
            if columns[name] is None:
                return None, why
    tokens = columns["token"][:n].astype(np.int64)
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if len(bad):
        return None, f"token[{bad[0]}] = {tokens[bad[0]]} is outside the vocabulary [0, {vocab_size})"
    seq_mask = np.zeros((n, n_seq_max), dtype=bool)
    for i in range(n):
        count = 1 if "n_seq_id" not in columns else int(columns["n_seq_id"][i])
        if "seq_id" not in columns:
            ids = [0]
        elif not 1 <= count <= columns["seq_id"].shape[1]:
            return None, f"token[{i}] has n_seq_id = {count}, outside [1, {columns['seq_id'].shape[1]}]"
        else:
            ids = [int(s) for s in columns["seq_id"][i, :count]]
        for s in ids:
            if not 0 <= s < n_seq_max:
                return None, f"token[{i}] has seq_id {s} outside [0, {n_seq_max}) (the context's n_seq_max)"
        seq_mask[i, ids] = True
    next_pos = {}  # sequence -> the smallest position its next token may take
    pos = np.empty(n, dtype=np.int64)
    for i in range(n):
        ids = np.flatnonzero(seq_mask[i]).tolist()
        for s in ids:
            if s not in next_pos:
                next_pos[s] = seq_pos_max(s) + 1
        p = next_pos[ids[0]] if "pos" not in columns else int(columns["pos"][i])
        if p >= max_pos:  # checked first: a uint64 position may not even fit the int64 column
            return None, f"token[{i}] has pos {p} beyond the model's {max_pos} positions"
        pos[i] = p
        for s in ids:
            if pos[i] < next_pos[s]:
                return None, (
                    f"token[{i}] has pos {pos[i]} but sequence {s} already reaches {next_pos[s] - 1}: "
                    "positions of a sequence must rise through the cache and the batch"
                )
            next_pos[s] = pos[i] + 1
    if "logits" not in columns:
        outputs = np.zeros(n, dtype=bool)
        outputs[-1] = True
    else:
        outputs = columns["logits"][:n] != 0
    return BatchView(tokens=tokens, pos=pos, seq_mask=seq_mask, outputs=outputs), ""
