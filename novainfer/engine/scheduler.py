"""Continuous batching: each step picks which sequences run and how many of their tokens.

One token budget (max_num_batched_tokens) per step. Running sequences go first, oldest first: a
decode takes one token, an unfinished (chunked) prefill takes what the budget leaves. Waiting
sequences are then admitted in arrival order while the budget, max_num_seqs and free blocks allow,
reusing cached prefix blocks. When blocks run out the newest running sequence is preempted: its
blocks are freed and it waits at the head of the queue to be recomputed.
"""

from __future__ import annotations

import logging
from collections import deque

from novainfer.config import SchedulerConfig
from novainfer.engine.block_manager import BlockManager
from novainfer.sequence import Sequence, SequenceStatus
from novainfer.step_types import ScheduledSequence, SchedulerOutput

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        num_lookahead_slots: int = 0,
        mixed_steps: bool = True,
    ):
        self.config = config
        # False (batch-invariant mode): a step carries prompt tokens or decode tokens, never both, so a decode token
        # always takes the decode attention kernel, as it does alone
        self.mixed_steps = mixed_steps
        self.block_manager = block_manager
        self.num_lookahead_slots = num_lookahead_slots  # KV slots a draft model writes past each step's tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._finished_since_step: list[int] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        if self.mixed_steps or not self._has_prompt_work():
            out = self._schedule(decodes=True)
        else:
            out = self._schedule(decodes=False)
            if not out.scheduled and not out.num_preempted:  # no prompt could go (memory, limits): decode instead
                out = self._schedule(decodes=True)
        out.finished_seq_ids, self._finished_since_step = self._finished_since_step, []
        return out

    def _has_prompt_work(self) -> bool:
        """Whether a running sequence has prompt tokens left or a waiting one could start."""
        return any(self._remaining(seq) > 1 for seq in self.running) or bool(
            self.waiting and len(self.running) < self.config.max_num_seqs
        )

    @staticmethod
    def _remaining(seq: Sequence) -> int:
        return len(seq.token_ids) + seq.num_pending_tokens - seq.num_computed_tokens

    def _schedule(self, decodes: bool) -> SchedulerOutput:
        """One step's work; decodes False leaves the running sequences' one-token decode steps out."""
        out = SchedulerOutput(finished_seq_ids=[])
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        lookahead = self.num_lookahead_slots
        # 1. running sequences, oldest first; preempt the newest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not decodes and self._remaining(seq) == 1:
                i += 1
                continue
            n = min(self._remaining(seq), budget)
            spec = seq.spec_token_ids
            if spec:  # a decode step that also verifies the proposer's guesses, as many as the budget leaves
                spec = spec[: budget - n] if n == 1 else []
                n += len(spec)
            if bm.needs_blocks(seq, n + lookahead):
                while not bm.can_append(seq, n + lookahead):
                    victim = self.running[-1]
                    self._preempt(victim)
                    out.num_preempted += 1
                    if victim is seq:
                        break
                if seq.status != SequenceStatus.RUNNING:
                    break
            self._launch(seq, n, out, spec)
            budget -= n
            i += 1

        # 2. admit waiting sequences (not in a step that had to preempt: memory is short)
        while self.waiting and budget > 0 and not out.num_preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending_tokens:  # preempted while a launched step samples its next token: wait for it
                break
            cached = bm.find_cached_prefix(seq)
            uncached = len(seq) - bm.num_cached_tokens(cached)
            n = min(uncached, budget)
            if not self.config.enable_chunked_prefill and n < uncached:
                break
            if not bm.can_admit(seq, cached, n + lookahead):
                break
            self.waiting.popleft()
            bm.admit(seq, cached)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._launch(seq, n, out)
            budget -= n
        return out

    def _launch(self, seq: Sequence, n: int, out: SchedulerOutput, spec: list[int] | None = None) -> None:
        """Give the step n tokens of seq: their slots, and the sequence's progress as if the step ran
        (so the next step can be planned before this one is read back). Rejected guesses are given back
        when the step is read (Scheduler.rollback)."""
        self.block_manager.allocate_slots(seq, n, self.num_lookahead_slots)
        s = ScheduledSequence(seq, n, spec)
        out.scheduled.append(s)
        out.num_spec_tokens += len(s.spec_token_ids)
        seq.num_computed_tokens += n
        if s.samples:
            seq.num_pending_tokens += 1

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free the blocks and put the sequence back at the head of the queue."""
        logger.debug("preempting %r", seq)
        self.requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def requeue(self, seq: Sequence) -> None:
        """Back to the head of the queue with no blocks, to be recomputed (a preemption, or a step that
        failed for another request)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:  # already requeued (a discarded step, then the failed one before it)
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.spec_token_ids, seq.num_draft_computed = [], 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def rollback(self, seq: Sequence, num_rejected: int) -> None:
        """A verified step rejected the last num_rejected guesses: their KV is never read and their slots
        are written again by the next step (the prefix cache only ever hashed accepted tokens)."""
        seq.num_computed_tokens -= num_rejected

    def undo_step(self, scheduled: list[ScheduledSequence]) -> None:
        """A step that will not be read back (it failed): its tokens will not arrive."""
        for s in scheduled:
            if s.samples:
                s.seq.num_pending_tokens = max(0, s.seq.num_pending_tokens - 1)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence wherever it is."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        self._finished_since_step.append(seq.seq_id)
