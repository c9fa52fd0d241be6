"""A step as the mp driver sends it: only what changed since the last step, not whole sequences.

Pickling a SchedulerOutput copies every scheduled sequence's full token history (about a megabyte, tens
of milliseconds at 256 sequences). Instead the driver sends, per scheduled sequence, the tokens appended
since it last sent it and its block table only when the table changed; each worker keeps a mirror
Sequence per live sequence and rebuilds the SchedulerOutput the runner expects. Mirrors are dropped with
the scheduler's finished_seq_ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from novainfer.sampling_params import SamplingParams
from novainfer.sequence import Sequence
from novainfer.step_types import ScheduledSequence, SchedulerOutput


@dataclass
class StepMessage:
    new_seqs: list[tuple[int, int, Any, int]]  # (seq_id, index, sampling_params, num_prompt_tokens), first sight
    # (seq_id, the step's start position, num_new_tokens, samples, appended token ids, block table or None, blocked ids,
    # hybrid models' (state_slot, state_restore, state_save) or None, a grouped cache's other block tables or None)
    rows: list[tuple[int, int, int, bool, list[int], list[int] | None, list[int], tuple | None, list | None]]
    finished_seq_ids: list[int]
    num_preempted: int
    grammar_bitmask: Any = None  # sent resolved (host tensor), see SchedulerOutput


class StepPacker:
    """Driver side: remembers, per live sequence, how many tokens and which block table the workers have."""

    def __init__(self):
        self.sent: dict[int, list] = {}  # seq_id -> [tokens sent, block table object, its length]

    def pack(self, sched: SchedulerOutput) -> StepMessage:
        for seq_id in sched.finished_seq_ids:
            self.sent.pop(seq_id, None)
        new, rows = [], []
        for s in sched.scheduled:
            seq = s.seq
            state = self.sent.get(seq.seq_id)
            if state is None:
                state = self.sent[seq.seq_id] = [0, None, -1, None]
                new.append((seq.seq_id, seq.index, seq.sampling_params, seq.num_prompt_tokens))
            tokens = seq.token_ids[state[0] :]
            state[0] = len(seq.token_ids)
            table = seq.block_table
            if table is state[1] and len(table) == state[2]:
                table = None  # the workers' copy is current
            else:
                state[1], state[2] = table, len(table)
                table = list(table)
            groups = None  # a grouped KV cache's other tables, sent when one was replaced or grew
            if seq.group_tables:
                shape = tuple((id(t), len(t)) for t in seq.group_tables)
                if shape != state[3]:
                    state[3], groups = shape, [list(t) for t in seq.group_tables]
            state = (seq.state_slot, seq.state_restore, seq.state_save) if seq.state_slot >= 0 else None
            rows.append(
                (seq.seq_id, s.start, s.num_new_tokens, s.samples, tokens, table, seq.min_tokens_blocked, state, groups)
            )
        return StepMessage(new, rows, list(sched.finished_seq_ids), sched.num_preempted, sched.grammar_bitmask)


class StepReceiver:
    """Worker side: applies StepMessages to mirror sequences and runs the rebuilt step on the worker."""

    def __init__(self, worker):
        self.worker = worker
        self.seqs: dict[int, Sequence] = {}
        self._template = dict(vars(Sequence([], SamplingParams())))

    def unpack(self, msg: StepMessage) -> SchedulerOutput:
        for seq_id in msg.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for seq_id, index, params, num_prompt_tokens in msg.new_seqs:
            mirror = Sequence.__new__(Sequence)
            vars(mirror).update(
                self._template,
                seq_id=seq_id,
                index=index,
                sampling_params=params,
                num_prompt_tokens=num_prompt_tokens,
                token_ids=[],
                block_table=[],
                group_tables=[],
            )
            self.seqs[seq_id] = mirror
        scheduled = []
        for seq_id, computed, num_new, samples, tokens, table, blocked, state, groups in msg.rows:
            seq = self.seqs[seq_id]
            seq.token_ids.extend(tokens)
            seq.num_computed_tokens = computed
            if table is not None:
                seq.block_table = table
            if groups is not None:
                seq.group_tables = groups
            seq.min_tokens_blocked = blocked
            if state is not None:
                seq.state_slot, seq.state_restore, seq.state_save = state
            s = ScheduledSequence(seq, num_new)
            s.samples = samples
            scheduled.append(s)
        return SchedulerOutput(scheduled, msg.num_preempted, msg.finished_seq_ids, msg.grammar_bitmask)

    def execute_step(self, msg: StepMessage):
        return self.worker.execute_model(self.unpack(msg))

    def launch_step(self, msg: StepMessage):
        """Launch the step on the runner's async path; the handle's get() reads it back (step_pipeline.py)."""
        return self.worker.execute_model_async(self.unpack(msg))
