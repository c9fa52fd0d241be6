"""Per-step attention metadata, set by the runner and read by every attention layer.

The model only runs forward(input_ids, positions); whether a token is part of a prefill or a decode,
and where its K/V go, is described here.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch


@dataclass
class AttentionMetadata:
    """Paged (BLOCK) layout: tokens of several sequences packed back to back.

    query_start_loc: [num_seqs + 1] offsets of each sequence's new tokens in the packed batch.
    seq_lens: [num_seqs] tokens of context (cached + new) each sequence attends over.
    slot_mapping: [num_tokens] flat cache slot (block_id * block_size + offset) per new token; -1 = skip.
    block_tables: [num_seqs, max_blocks] physical block ids (int32); entries past a sequence's blocks are
        never read and may hold anything.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int] | None = None  # host copies, for the torch backend's loop
    seq_lens_cpu: list[int] | None = None
    num_splits: int = 1  # decode kernel: parts each context is split into (split-K), a power of two
    cuda_graph: bool = False  # the forward of a decode graph (its warm-up or capture), not an eager step
    # a verify step (speculative decoding) on the CPU: each token as a one-token sequence over its causal prefix,
    # so the backend's decode path computes it as a decode step would
    per_token: "AttentionMetadata | None" = None
    # hybrid models: the state slot each sequence's linear-attention layers continue, and the prefix cache's
    # checkpoint copies (layers/linear_attention.StateSlotsMetadata); None runs them stateless (a profiling forward)
    state_slots: Any = None
    # a grouped KV cache (worker/kv_layout.py): each KV group's metadata (its block tables and slots; this one is
    # group 0's); None where every layer reads these
    groups: "list[AttentionMetadata] | None" = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass
class SlotAttentionMetadata:
    """SLOT layout (core API): cells of block size 1, visibility given per query as a mask.

    slot_mapping: [num_tokens] cell index each new token's K/V are written to.
    cells: [num_candidates] cell indices the step may read (those sharing a sequence with the batch).
    visible: [num_tokens, num_candidates] bool: query i sees cells[j] (seq-id sets meet, cell pos <= query pos).
    query_pos, cell_pos: [num_tokens] and [num_candidates] logical positions, for sliding-window layers.
    """

    slot_mapping: torch.Tensor
    cells: torch.Tensor
    visible: torch.Tensor
    query_pos: torch.Tensor | None = None
    cell_pos: torch.Tensor | None = None


# per thread: the uni backend runs one tensor-parallel rank per thread, each with its own step metadata
_state = threading.local()


def get_attention_metadata() -> AttentionMetadata | SlotAttentionMetadata:
    meta = getattr(_state, "current", None)
    if meta is None:
        raise RuntimeError("attention metadata is not set: run the model through the model runner")
    return meta


@contextmanager
def attention_metadata(meta: AttentionMetadata | SlotAttentionMetadata) -> Iterator[None]:
    """Make meta visible to this thread's attention layers for the duration of one forward."""
    prev = getattr(_state, "current", None)
    _state.current = meta
    try:
        yield
    finally:
        _state.current = prev
