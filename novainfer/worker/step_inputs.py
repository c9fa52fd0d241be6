"""A step's inputs on the host: the packed arrays the runner fills, and the pinned buffers they live in."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from novainfer.layers.sampler import SamplingMetadata, SamplingRow


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


class HostBuffers:
    """Preallocated (pinned on CUDA) host buffers the step inputs are written into, sized for the largest step."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, pin: bool):
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
