"""A step's inputs: the packed host arrays (StepInputs) in their pinned buffers (HostBuffers), built from the
scheduler's output by StepInputBuilder, which keeps what outlives a step (the persistent input batch, the
sampling rows and generators of running sequences) and uploads them for attention."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any, Iterator

import numpy as np
import torch

from novainfer.attention.metadata import AttentionMetadata
from novainfer.layers.sampling_metadata import SamplingMetadata, SamplingRow
from novainfer.spec_decode.verify_inputs import per_token_metadata, verify_rows
from novainfer.step_types import SchedulerOutput
from novainfer.worker.input_batch import InputBatch
from novainfer.worker.prompt_logprobs import plan_prompt_logprobs


@contextmanager
def nvtx_range(name: str, enabled: bool) -> Iterator[None]:
    """An NVTX range for Nsight timelines (prepare/*, attn_meta/*, forward/*, sample/*); free on the CPU."""
    if not enabled:
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


@dataclass
class StepInputs:
    """Host-side tensors for one step, in packed token order (pinned on CUDA, so uploads are asynchronous)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor  # [num_seqs, width] int32; entries past a sequence's blocks are unused
    seq_lens_t: torch.Tensor  # the two lists above as host tensors, for the upload
    query_start_loc_t: torch.Tensor
    max_query_len: int  # new tokens of the longest sequence: 1 means a pure decode step
    logits_indices: list[int]  # packed-token rows whose logits are sampled
    sample_seq_ids: list[int]  # the sequence of each sampled row
    sampling_rows: list[SamplingRow]
    sampling_metadata: SamplingMetadata | None = None
    logits_indices_t: torch.Tensor | None = None  # logits_indices in this step's host buffer, for the upload
    feed: Any = None  # TokenFeed: input tokens sampled by the step still in flight, filled in on the device
    prompt_logprob_rows: list = field(default_factory=list)  # PromptLogprobRows of sequences that want them
    prompt_logprobs: dict | None = None  # their results, filled by the forward
    grammar_bitmask: Any = None  # structured_output.GrammarBitmask of the constrained sampled rows
    # speculative decoding: per sampled sequence, how many guesses it verifies (its rows are that many plus
    # one, consecutive); per sampled row, the guess it checks (-1: none). None in a step without guesses.
    spec_num_drafts: list[int] | None = None
    spec_draft_ids: list[int] | None = None
    state_slots: Any = None  # hybrid models: linear_attention.StateSlotsMetadata (worker/state_cache.py)
    # a grouped KV cache (worker/kv_layout.py): every group's block tables [groups, num_seqs, width] and slots
    # [groups, num_tokens]; block_tables and slot_mapping above are group 0's
    group_block_tables: torch.Tensor | None = None
    group_slot_mapping: torch.Tensor | None = None


class HostBuffers:
    """Preallocated (pinned on CUDA) host buffers the step inputs are written into, sized for the largest step."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, pin: bool, num_groups: int = 1):
        def buf(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        self.input_ids = buf(max_tokens, torch.long)
        self.positions = buf(max_tokens, torch.long)
        self.slot_mapping = buf(max_tokens, torch.long)
        self.block_tables = buf(max_seqs * max_blocks_per_seq, torch.int32)
        self.seq_lens = buf(max_seqs, torch.int32)
        self.logits_indices = buf(max_tokens, torch.long)  # a verify step samples several rows per sequence
        self.query_start_loc = buf(max_seqs + 1, torch.int32)
        # TokenFeed's indices: a copy from pageable memory would wait for the step in flight, undoing the overlap
        self.feed_dst = buf(max_seqs, torch.long)
        self.feed_src = buf(max_seqs, torch.long)
        if num_groups > 1:
            self.group_block_tables = buf(num_groups * max_seqs * max_blocks_per_seq, torch.int32)
            self.group_slot_mapping = buf(num_groups * max_tokens, torch.long)


class TokenFeed:
    """Input tokens a step takes from the previous step's sampled ids, on the device (no host round trip)."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, prev: Any):
        self.dst, self.src, self.prev = dst, src, prev  # host tensors in the step's (pinned) buffers; PreviousStep

    def apply(self, input_ids: torch.Tensor, device: torch.device) -> None:
        dst = self.dst.to(device, non_blocking=True)
        src = self.src.to(device, non_blocking=True)
        input_ids[dst] = self.prev.sampled_ids()[src]


class StepInputBuilder:
    """Turns each SchedulerOutput into StepInputs, in two alternating sets of host buffers: with overlap the host
    fills step N+1's while step N still reads its own."""

    def __init__(
        self,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        state_cache: Any = None,
        group_block_sizes: list[int] | None = None,
    ):
        self.block_size, self.vocab_size, self.device = block_size, vocab_size, device
        self.state_cache = state_cache  # hybrid models: worker/state_cache.StateCache, else None
        # a grouped KV cache with several groups: each group's tokens a block, and a batch mirroring its tables
        self.group_block_sizes = group_block_sizes if group_block_sizes and len(group_block_sizes) > 1 else None
        groups = len(self.group_block_sizes or [0])
        self.group_batches = [InputBatch(max_seqs, max_blocks_per_seq) for _ in range(groups)]
        self.input_batch = self.group_batches[0]
        self.host_sets = [
            HostBuffers(max_tokens, max_seqs, max_blocks_per_seq, device.type == "cuda", groups) for _ in range(2)
        ]
        self.host = self.host_sets[0]
        self.num_steps = 0
        self.generators: dict[int, torch.Generator] = {}
        self._last_sampling: tuple[tuple[int, ...], SamplingMetadata] | None = None
        self._rows: dict[int, SamplingRow] = {}  # seq_id -> its sampling row, while it never changes

    def build(self, sched: SchedulerOutput, prev: Any = None) -> StepInputs:
        """Token ids, positions, slots, offsets and block tables on the host; sampling parameters on the device.

        Block tables come from the persistent input batch (updated by deltas); positions, slots and
        offsets are vectorized over the step, so a decode step costs a few list reads per sequence. prev:
        the overlap's PreviousStep, whose sampled ids feed the inputs still pending (worker/overlap.py)."""
        for seq_id in sched.finished_seq_ids:
            self.generators.pop(seq_id, None)
            for group_batch in self.group_batches:
                group_batch.remove(seq_id)
            self._rows.pop(seq_id, None)
        scheduled, batch = sched.scheduled, self.input_batch
        num_seqs = len(scheduled)
        rows, starts, counts = batch.gather(scheduled)
        num_tokens = int(counts.sum())
        self.num_steps += 1
        h = self.host = self.host_sets[self.num_steps % 2]
        ids, pos, slots = h.input_ids.numpy(), h.positions.numpy(), h.slot_mapping.numpy()
        ends = np.cumsum(counts)
        feed = None
        if num_tokens == num_seqs:  # one new token per sequence: a decode step
            known = [s.seq.token_ids[s.start] if s.start < len(s.seq.token_ids) else -1 for s in scheduled]
            if -1 in known:  # sampled by the step still in flight: taken from its ids on the device
                feed = self._feed_from_previous(prev, scheduled, known)
            ids[:num_tokens] = known
            positions, token_rows = starts, rows
        elif sched.num_spec_tokens:  # a verify step: a sequence's last token, then its guesses
            known = list(
                chain.from_iterable(
                    (s.seq.token_ids[s.start : s.start + s.num_new_tokens - len(s.spec_token_ids)] or [-1])
                    + s.spec_token_ids
                    for s in scheduled
                )
            )
            if -1 in known:
                raise RuntimeError("speculative decoding runs with async scheduling off")
            ids[:num_tokens] = known
            positions = np.arange(num_tokens) + np.repeat(starts - (ends - counts), counts)
            token_rows = np.repeat(rows, counts)
        else:
            known = list(
                chain.from_iterable(
                    # [] only for a decode whose input is pending: one token
                    s.seq.token_ids[s.start : s.start + s.num_new_tokens] or [-1]
                    for s in scheduled
                )
            )
            if -1 in known:
                feed = self._feed_from_previous(
                    prev, [scheduled[i] for i in np.repeat(np.arange(num_seqs), counts)], known
                )
            ids[:num_tokens] = known
            positions = np.arange(num_tokens) + np.repeat(starts - (ends - counts), counts)
            token_rows = np.repeat(rows, counts)
        pos[:num_tokens] = positions
        slots[:num_tokens] = batch.slots(token_rows, positions, self.block_size)
        width = int(batch.num_blocks[rows].max())
        h.block_tables[: num_seqs * width].numpy().reshape(num_seqs, width)[:] = batch.block_tables[rows, :width]
        seq_lens = starts + counts
        h.seq_lens.numpy()[:num_seqs] = seq_lens
        qsl = h.query_start_loc.numpy()
        qsl[0] = 0
        qsl[1 : num_seqs + 1] = ends
        logits_indices, sample_seq_ids, sampling_rows = [], [], []
        spec = None
        if sched.num_spec_tokens:
            spec = verify_rows(
                scheduled, ends.tolist(), self._sampling_row, logits_indices, sample_seq_ids, sampling_rows
            )
        else:
            for s, end in zip(scheduled, ends.tolist()):
                if s.samples:
                    logits_indices.append(end - 1)
                    sample_seq_ids.append(s.seq.seq_id)
                    sampling_rows.append(self._sampling_row(s.seq))
        h.logits_indices.numpy()[: len(logits_indices)] = logits_indices
        prompt_lp = [
            plan
            for s, end in zip(scheduled, ends.tolist())
            if s.seq.sampling_params.prompt_logprobs is not None
            and s.start < s.seq.num_prompt_tokens
            and (plan := plan_prompt_logprobs(s.seq, s.start, s.num_new_tokens, end - s.num_new_tokens))
        ]
        inp = StepInputs(
            h.input_ids[:num_tokens],
            h.positions[:num_tokens],
            h.slot_mapping[:num_tokens],
            qsl[: num_seqs + 1].tolist(),
            seq_lens.tolist(),
            h.block_tables[: num_seqs * width].view(num_seqs, width),
            h.seq_lens[:num_seqs],
            h.query_start_loc[: num_seqs + 1],
            int(counts.max()),
            logits_indices,
            sample_seq_ids,
            sampling_rows,
            feed=feed,
            logits_indices_t=h.logits_indices[: len(logits_indices)],
            prompt_logprob_rows=prompt_lp,
            grammar_bitmask=sched.grammar_bitmask,
        )
        if spec is not None:
            inp.spec_num_drafts, inp.spec_draft_ids = spec
        if self.group_block_sizes is not None:
            self._group_tables(inp, scheduled, token_rows, positions)
        if self.state_cache is not None:
            inp.state_slots = self.state_cache.step_metadata(scheduled)
        if sampling_rows:  # uploaded now, while the device is idle, so the forward is not waited on later
            inp.sampling_metadata = self._sampling_metadata(sampling_rows, sample_seq_ids if spec is None else None)
        return inp

    def _group_tables(self, inp: StepInputs, scheduled: list, token_rows: np.ndarray, positions: np.ndarray) -> None:
        """Every KV group's block tables and slots, packed [groups, ...] for one upload; group 0 is the step's."""
        h, num_seqs, num_tokens = self.host, len(scheduled), inp.input_ids.shape[0]
        rows = [batch.gather(scheduled, g)[0] for g, batch in enumerate(self.group_batches)]
        width = max(int(batch.num_blocks[r].max()) for batch, r in zip(self.group_batches, rows))
        groups = len(rows)
        tables = h.group_block_tables[: groups * num_seqs * width].view(groups, num_seqs, width)
        slots = h.group_slot_mapping[: groups * num_tokens].view(groups, num_tokens)
        assert all(np.array_equal(r, rows[0]) for r in rows), "the KV groups' input batches disagree on rows"
        for g, (batch, r, bs) in enumerate(zip(self.group_batches, rows, self.group_block_sizes)):
            tables.numpy()[g] = batch.block_tables[r, :width]
            slots.numpy()[g] = batch.slots(token_rows, positions, bs)  # every batch has the same rows
        inp.group_block_tables, inp.group_slot_mapping = tables, slots
        inp.block_tables, inp.slot_mapping = tables[0], slots[0]

    def _feed_from_previous(self, prev: Any, scheduled: list, known: list[int]) -> TokenFeed:
        """Where each pending input token (-1 in known) lies in the previous step's sampled ids."""
        if prev is None:
            raise RuntimeError("a step's input token is pending but no earlier step sampled it")
        dst = [i for i, t in enumerate(known) if t < 0]
        src = [prev.rows[scheduled[i].seq.seq_id] for i in dst]
        h = self.host
        h.feed_dst.numpy()[: len(dst)] = dst
        h.feed_src.numpy()[: len(src)] = src
        return TokenFeed(h.feed_dst[: len(dst)], h.feed_src[: len(src)], prev)

    def _sampling_metadata(self, rows: list[SamplingRow], seq_ids: list[int] | None) -> SamplingMetadata:
        """Built and uploaded again only when the rows' parameters may have changed: decode steps of the same
        sequences without penalties or min_tokens blocking reuse the last step's tensors (seq_ids None: the
        rows are not one per sequence, as in a verify step; always built)."""
        static = seq_ids is not None and all(
            not r.blocked_token_ids and not r.output_token_ids and not r.prompt_token_ids for r in rows
        )
        key = tuple(seq_ids or ())
        if static and self._last_sampling is not None and self._last_sampling[0] == key:
            return self._last_sampling[1]
        meta = SamplingMetadata.build(rows, self.vocab_size, self.device)
        self._last_sampling = (key, meta) if static else None
        return meta

    def _sampling_row(self, seq) -> SamplingRow:
        """The row's sampling inputs; a row without penalties or blocked ids is the same every step (cached)."""
        row = self._rows.get(seq.seq_id)
        if row is not None:
            return row
        params = seq.sampling_params
        gen = None
        if params.seed is not None:
            gen = self.generators.get(seq.seq_id)
            if gen is None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed + seq.index)
                self.generators[seq.seq_id] = gen
        penalised = params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
        row = SamplingRow(
            params=params,  # token histories are copied only for rows that are penalised
            prompt_token_ids=seq.prompt_token_ids if penalised else [],
            output_token_ids=seq.output_token_ids if penalised else [],
            generator=gen,
            blocked_token_ids=seq.min_tokens_blocked,
        )
        if not penalised and not seq.min_tokens_blocked:
            self._rows[seq.seq_id] = row
        return row

    def attention_metadata(self, inp: StepInputs, num_splits: int, per_token: bool) -> AttentionMetadata:
        """Upload the step's inputs once (asynchronously from pinned memory) and describe them for attention;
        num_splits: the decode kernel's split-K parts; per_token: a CPU verify step's rows as decode rows."""

        def up(x: torch.Tensor) -> torch.Tensor:
            return x.to(self.device, non_blocking=True)

        max_query_len = inp.max_query_len
        grouped = inp.group_block_tables is not None
        tables = up(inp.group_block_tables if grouped else inp.block_tables)
        slots = up(inp.group_slot_mapping if grouped else inp.slot_mapping)
        meta = AttentionMetadata(
            query_start_loc=up(inp.query_start_loc_t),
            seq_lens=up(inp.seq_lens_t),
            slot_mapping=slots[0] if grouped else slots,
            block_tables=tables[0] if grouped else tables,
            max_query_len=max_query_len,
            max_seq_len=max(inp.seq_lens),
            query_start_loc_cpu=inp.query_start_loc,
            seq_lens_cpu=inp.seq_lens,
            num_splits=num_splits if max_query_len == 1 else 1,
            state_slots=inp.state_slots.on(self.device) if inp.state_slots is not None else None,
        )
        num_tokens = inp.input_ids.shape[0]
        per_token = (
            per_token
            and inp.spec_num_drafts is not None
            and sum(inp.spec_num_drafts) + len(inp.spec_num_drafts) == num_tokens
        )  # only sequences that verify
        if per_token:
            meta.per_token = per_token_metadata(
                inp.query_start_loc, inp.positions, meta.slot_mapping, meta.block_tables
            )
        if grouped:
            meta.groups = [meta] + [
                replace(
                    meta,
                    block_tables=tables[g],
                    slot_mapping=slots[g],
                    per_token=per_token_metadata(inp.query_start_loc, inp.positions, slots[g], tables[g])
                    if per_token
                    else None,
                )
                for g in range(1, tables.shape[0])
            ]
        return meta
