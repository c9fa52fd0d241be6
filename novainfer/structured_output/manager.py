"""StructuredOutputManager: the engine's one handle on grammars.

Compiled grammars are cached by constraint (LRU). Each constrained Sequence carries a GrammarState (its
matcher and how many of its output tokens the matcher has accepted). Before a step, grammar_bitmask()
fills one bitmask row per constrained sequence that samples; after it, accept() advances the matcher with
the appended token. A matcher that is behind or ahead of its sequence's tokens (preemption by recompute, a
re-queued step, a future overlapped loop or speculative rollback) is rebuilt from the tokens, so the state
always follows the accepted output. A state with `after` tokens (a thinking model's end of reasoning) is
gated: the grammar starts on the token after them, and until then the sequence samples freely (as vLLM's
reasoning-aware structured outputs).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from novainfer.sampling_params import StructuredOutputsParams
from novainfer.structured_output.backend import CompiledGrammar, GrammarMatcher, bitmask_words

if TYPE_CHECKING:  # the front-end only compiles (no torch there); bitmasks are built in the engine core
    import torch

logger = logging.getLogger(__name__)


@dataclass
class GrammarState:
    matcher: GrammarMatcher
    num_accepted: int = 0  # output tokens the state has followed (gated ones included)
    after: tuple[int, ...] = ()  # the grammar starts once the output contains these tokens
    start: int | None = 0  # the output index where the grammar starts; None while the gate is closed

    def open_at(self, output_token_ids: list[int]) -> int | None:
        """Where the grammar starts in this output (just past the first occurrence of `after`), or None."""
        k = len(self.after)
        for i in range(len(output_token_ids) - k + 1):
            if tuple(output_token_ids[i : i + k]) == self.after:
                return i + k
        return None


@dataclass
class GrammarBitmask:
    """The step's constrained rows: seq_ids[i]'s allowed next tokens are the set bits of bitmask[i]."""

    seq_ids: list[int]
    bitmask: torch.Tensor  # [len(seq_ids), ceil(vocab / 32)] int32, on the host


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], max_cached: int = 256):
        """tokenizer: the tokenizer, or a function that loads it (the engine core, which never tokenizes,
        loads it only when the first constrained request arrives)."""
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.max_cached = max_cached
        self._backend = None  # built on the first constrained request (wrapping the tokenizer takes ~1 s)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()

    @property
    def backend(self):
        if self._backend is None:
            from novainfer.structured_output.guidance_backend import GuidanceBackend

            if callable(self.tokenizer) and not hasattr(self.tokenizer, "encode"):
                self.tokenizer = self.tokenizer()
            self._backend = GuidanceBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._backend

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar for params, from the cache when the same constraint was seen; ValueError if invalid."""
        key = params.key()
        grammar = self._cache.get(key)
        if grammar is None:
            grammar = self.backend.compile(params)
            self._cache[key] = grammar
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return grammar

    @staticmethod
    def new_state(grammar: CompiledGrammar, after: list[int] | None = None) -> GrammarState:
        """A sequence's state at the grammar's start; with `after`, gated until those tokens are generated."""
        return GrammarState(grammar.matcher(), after=tuple(after or ()), start=None if after else 0)

    def accept(self, state: GrammarState, output_token_ids: list[int]) -> None:
        """The sequence's output grew by its last token: advance the matcher (rebuilding it first if it drifted)."""
        if state.num_accepted != len(output_token_ids) - 1:
            self._rebuild(state, output_token_ids[:-1])
        state.num_accepted += 1
        if state.start is None:  # still reasoning: the grammar opens after the end-of-reasoning tokens
            k = len(state.after)
            if tuple(output_token_ids[-k:]) == state.after:
                state.start = len(output_token_ids)
            return
        token = output_token_ids[-1]
        if not state.matcher.accept_token(token) and token not in self.eos_token_ids:
            raise ValueError(f"token {token} does not follow the structured output grammar")

    def grammar_bitmask(self, seqs: list) -> GrammarBitmask | None:
        """One row per given sequence that carries a grammar state (those about to sample), or None."""
        constrained = []
        for seq in seqs:
            state = seq.grammar
            if state is None:
                continue
            if state.num_accepted != seq.num_output_tokens:
                self._rebuild(state, seq.output_token_ids)
            if state.start is not None:  # a gated state samples freely until its grammar opens
                constrained.append(seq)
        if not constrained:
            return None
        import torch

        bitmask = torch.full((len(constrained), bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        for row, seq in enumerate(constrained):
            seq.grammar.matcher.fill_bitmask(bitmask, row)
            if seq.min_tokens_blocked and not self._allows_other_than(bitmask[row], seq.min_tokens_blocked):
                seq.min_tokens_blocked = []  # only the grammar's end is left: min_tokens cannot outlast it
        return GrammarBitmask([s.seq_id for s in constrained], bitmask)

    @staticmethod
    def _allows_other_than(row: torch.Tensor, token_ids: list[int]) -> bool:
        """Whether the bitmask row allows a token outside token_ids."""
        row = row.clone()
        for t in token_ids:
            if t < row.numel() * 32:
                row[t // 32] = int(row[t // 32]) & ~(1 << (t % 32))
        return bool(row.any())

    @staticmethod
    def _rebuild(state: GrammarState, output_token_ids: list[int]) -> None:
        logger.debug("rebuilding a grammar matcher from %d tokens", len(output_token_ids))
        state.matcher.reset()
        state.start = state.open_at(output_token_ids) if state.after else 0
        for t in output_token_ids[state.start :] if state.start is not None else ():
            if not state.matcher.accept_token(t):
                break
        state.num_accepted = len(output_token_ids)
