"""The sampled rows of a verify step: a sequence that checks d guesses samples d + 1 consecutive rows (its
last token and each guess predict the next position), each with the sampling state of that position."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from novainfer.attention.metadata import AttentionMetadata
from novainfer.layers.sampling_metadata import SamplingRow
from novainfer.sequence import Sequence
from novainfer.step_types import ScheduledSequence


def verify_rows(
    scheduled: list[ScheduledSequence],
    ends: list[int],
    row_of: Callable[[Sequence], SamplingRow],
    logits_indices: list[int],
    sample_seq_ids: list[int],
    sampling_rows: list[SamplingRow],
) -> tuple[list[int], list[int]]:
    """Fill the step's sampled rows (appending to the three lists) and return, per sampled sequence, how
    many guesses it verifies, and per row the guess it checks (-1: none)."""
    num_drafts: list[int] = []
    draft_ids: list[int] = []
    for s, end in zip(scheduled, ends):
        if not s.samples:
            continue
        spec = s.spec_token_ids
        d = len(spec)
        row = row_of(s.seq)
        sample_seq_ids.append(s.seq.seq_id)
        num_drafts.append(d)
        logits_indices.extend(range(end - 1 - d, end))
        draft_ids.extend(spec)
        draft_ids.append(-1)
        if not d:
            sampling_rows.append(row)
        elif row.output_token_ids or row.prompt_token_ids:  # penalties count the guesses before each position
            out = list(row.output_token_ids)
            sampling_rows.extend(
                SamplingRow(row.params, row.prompt_token_ids, out + spec[:j], row.generator, row.blocked_token_ids)
                for j in range(d + 1)
            )
        else:
            sampling_rows.extend([row] * (d + 1))
    return num_drafts, draft_ids


def per_token_metadata(
    query_start_loc: list[int], positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor
) -> AttentionMetadata:
    """A verify step's tokens as one-token sequences over their causal prefixes (the sequence's block table,
    length = position + 1): the CPU backend runs them through its decode path, whose per-sequence result does
    not depend on the batch, so each token is computed as decoding computes it and greedy choices match."""
    rows = torch.from_numpy(np.repeat(np.arange(len(query_start_loc) - 1), np.diff(query_start_loc)))
    seq_lens = (positions + 1).to(torch.int32)
    return AttentionMetadata(
        query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32),
        seq_lens=seq_lens,
        slot_mapping=slot_mapping,
        block_tables=block_tables[rows],
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
    )
