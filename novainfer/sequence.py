"""A Sequence is one stream of tokens being generated; its KV lives in the blocks of its block table."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from novainfer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt plus output tokens, how many of them have KV computed, and where that KV lives."""

    _ids = itertools.count()

    def __init__(
        self,
        token_ids: list[int],
        sampling_params: "SamplingParams",
        request_id: str = "",
        index: int = 0,
        arrival_time: float = 0.0,
    ):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions this is
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache, or being written by a launched step
        self.num_pending_tokens = 0  # tokens sampled by a launched step, not yet appended (0 or 1)
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at (first) admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hash of each full block in block_table, in order
        # a grouped KV cache (worker/kv_layout.py): the tables and hashes of KV groups 1.. (block_table is group 0's)
        self.group_tables: list[list[int]] = []
        self.group_hashes: list[list[int]] = []
        # hybrid models (engine/state_slots.py): the state slot it owns while admitted, and the prefix cache's
        # (position, checkpoint slot) to restore its state from at admission and to save its state to
        self.state_slot = -1
        self.state_restore: tuple[int, int] | None = None
        self.state_save: tuple[int, int] | None = None
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict] = []
        self.min_tokens_blocked: list[int] = []  # ids it may not sample yet (eos, stop ids) under min_tokens
        self.grammar = None  # structured_output GrammarState when its output is constrained
        self.spec_token_ids: list[int] = []  # a proposer's guesses for the next step (spec_decode/)
        self.num_draft_computed = 0  # tokens whose KV the draft model has (draft_model speculation)
        self.num_spec_draft_tokens = 0  # guesses checked so far, and how many of them were accepted
        self.num_spec_accepted_tokens = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        """The token a step sampled for this sequence (its pending token, once the step is read back)."""
        self.token_ids.append(token_id)
        if self.num_pending_tokens:
            self.num_pending_tokens -= 1

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, {self.status.value}, "
            f"len={len(self)}, computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
