"""Draft-model speculation, the engine core's side: which tokens the draft still has to read, and what it
may keep after verification. The draft model itself runs with the workers (worker/draft_model_runner.py), with
its own paged KV cache addressed through the target's block tables (the scheduler reserves
num_speculative_tokens lookahead slots per sequence for the guesses it writes)."""

from __future__ import annotations

from typing import Any

from novainfer.sequence import Sequence
from novainfer.spec_decode.proposer import Proposer
from novainfer.step_types import DraftRequest


class DraftModelProposer(Proposer):
    """Sends the batch to the workers' draft model (Worker.propose_draft_tokens) and tracks, per sequence,
    how far the draft's KV is valid: everything it read, plus the guesses the target accepted."""

    def __init__(self, executor: Any):
        self.executor = executor

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        wanted = [(seq, k) for seq, k in zip(seqs, num_tokens) if k > 0]
        if not wanted:
            return [[] for _ in seqs]
        requests = [
            DraftRequest(
                seq.seq_id, seq.num_draft_computed, seq.token_ids[seq.num_draft_computed :], list(seq.block_table), k
            )
            for seq, k in wanted
        ]
        guesses = iter(self.executor.collective_rpc("propose_draft_tokens", requests)[0])
        for seq, _ in wanted:
            seq.num_draft_computed = len(seq.token_ids)
        return [next(guesses) if k > 0 else [] for k in num_tokens]

    def on_verified(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        # the draft wrote KV for its own guesses 1..k-1 (it never reads its last one); accepted ones stay valid
        seq.num_draft_computed += min(num_accepted, max(0, num_drafted - 1))
