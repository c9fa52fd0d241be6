"""Compiles, before the first request, the Triton kernels a step may need that neither the profile run nor the
CUDA graph capture launches: the prefill kernel's tiles for short queries (<= 32 tokens: chunk tails, short
prompts) and the one-pass temperature sampler. A fresh machine otherwise compiled them (~1.5 s) inside its first
timed run, 7-10% of the 7B bench shape (benchmarks/tuning/triton_compiles.py)."""

from __future__ import annotations

from itertools import accumulate

import torch

from novainfer.attention.metadata import AttentionMetadata, attention_metadata
from novainfer.layers.sampling_metadata import SamplingMetadata, SamplingRow
from novainfer.sampling_params import SamplingParams

SHORT_PREFILL = 16  # tokens: under prefill_tiles' 32-token bound for the small tiles


def packed_prefill_metadata(lens: list[int], block_size: int, device: torch.device) -> AttentionMetadata:
    """A step that prefills fresh sequences of lens tokens, packed back to back, each into its own run of the
    cache's first blocks (in order)."""
    blocks = [(n + block_size - 1) // block_size for n in lens]
    first = list(accumulate(blocks, initial=0))
    starts = list(accumulate(lens, initial=0))
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for i, b in enumerate(blocks):
        tables[i, :b] = torch.arange(first[i], first[i] + b, dtype=torch.int32)
    slots = torch.cat([torch.arange(n) + first[i] * block_size for i, n in enumerate(lens)])
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        slot_mapping=slots.to(device),
        block_tables=tables.to(device),
        max_query_len=max(lens),
        max_seq_len=max(lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(lens),
    )


@torch.inference_mode()
def warm_up_kernels(model: torch.nn.Module, sampler: torch.nn.Module, block_size: int, device: torch.device) -> None:
    """A short prefill into the (still unused) cache's first block and a temperature-sampling pass. Every
    rank runs it (the forward's collectives need all of them); what it writes to the cache no sequence owns."""
    n = SHORT_PREFILL
    ids = torch.zeros(n, dtype=torch.long, device=device)
    with attention_metadata(packed_prefill_metadata([n], block_size, device)):
        hidden = model(ids, torch.arange(n, device=device))
    logits = model.compute_logits(hidden[-1:]).float()
    rows = [SamplingRow(SamplingParams(temperature=1.0), [0], [0])]
    sampler(logits, SamplingMetadata.build(rows, logits.shape[-1], device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
