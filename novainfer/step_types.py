"""The messages of one engine step (SchedulerOutput in, ModelRunnerOutput out, DraftRequests), kept apart from
the modules that make them so that engine, executor, worker and spec_decode import this one, never each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from novainfer.sequence import Sequence


class ScheduledSequence:
    """One sequence's share of a step: from which position, how many new tokens, and whether its last logits
    row is sampled (the step reaches the sequence's end). A plain slotted class: a step makes one per
    running sequence."""

    __slots__ = ("seq", "num_new_tokens", "start", "samples", "spec_token_ids")

    def __init__(self, seq: Sequence, num_new_tokens: int, spec_token_ids: list[int] | None = None):
        self.seq = seq
        self.num_new_tokens = num_new_tokens  # including spec_token_ids, the guesses this step verifies
        self.start = seq.num_computed_tokens  # position of the step's first token for this sequence
        self.spec_token_ids = spec_token_ids or []
        self.samples = (
            self.start + num_new_tokens - len(self.spec_token_ids) == len(seq.token_ids) + seq.num_pending_tokens
        )

    def __repr__(self) -> str:
        return f"ScheduledSequence({self.seq!r}, num_new_tokens={self.num_new_tokens}, samples={self.samples})"


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    num_preempted: int = 0
    finished_seq_ids: list[int] = field(default_factory=list)  # finished since the last step
    grammar_bitmask: Any = None  # structured_output.GrammarBitmask of the constrained sampled rows, set by the engine
    num_spec_tokens: int = 0  # guesses verified in this step (speculative decoding)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_pure_decode(self) -> bool:
        return all(s.num_new_tokens == 1 and s.samples for s in self.scheduled)


@dataclass
class ModelRunnerOutput:
    """What the step produced, on the host: one entry per sampled sequence."""

    seq_ids: list[int]
    sampled_token_ids: list[int]
    logprobs: list[list[tuple[int, float, int]]] | None = None  # [(token_id, logprob, rank)] per row
    # seq_id -> (first prompt position, [(token_id, logprob, rank), ...] per next prompt token); see prompt_logprobs.py
    prompt_logprobs: dict[int, tuple[int, list[list[tuple[int, float, int]]]]] | None = None
    # a verify step (speculative decoding): per sampled sequence, the accepted guesses that come before its
    # sampled token, and their logprobs
    spec_accepted_token_ids: list[list[int]] | None = None
    spec_logprobs: list[list[list[tuple[int, float, int]]]] | None = None


class StepFuture(Protocol):
    """A launched step (the runner's StepHandle, an executor's DoneStep): get() waits for its output."""

    def get(self) -> ModelRunnerOutput: ...


class DraftRequest(msgspec.Struct, array_like=True):
    """One sequence's part of a draft pass: read token_ids (positions start...) into the draft's cache,
    then guess num_tokens tokens greedily. block_table maps positions to slots, as for the target."""

    seq_id: int
    start: int
    token_ids: list[int]
    block_table: list[int]
    num_tokens: int
