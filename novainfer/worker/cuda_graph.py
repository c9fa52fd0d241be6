"""CUDA graphs of the decode forward, captured once per batch size of a ladder and replayed with static inputs.

A decode step launches a few hundred small kernels; replaying a captured graph launches them in one
call. The graph reads its inputs from fixed buffers, so a step copies its inputs in, pads the batch
up to the next captured size (padding rows write nowhere: slot -1) and replays.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from novainfer.attention.metadata import AttentionMetadata, attention_metadata

logger = logging.getLogger(__name__)


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def bucket(ladder: list[int], num_seqs: int) -> int:
    """The smallest ladder size that holds num_seqs (num_seqs itself past the ladder's end)."""
    return next((b for b in ladder if b >= num_seqs), num_seqs)


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, num_splits: Callable[[int], int]):
        self.model = model
        self.sizes = batch_size_ladder(max_num_seqs)
        self.num_splits = num_splits
        n, i32 = self.sizes[-1], dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i32)  # column 0 stays a valid block id
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:bs + 1], seq_lens=self.seq_lens[:bs],
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            max_query_len=1, max_seq_len=self.block_tables.shape[1], num_splits=self.num_splits(bs))

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            graph = torch.cuda.CUDAGraph()
            with attention_metadata(self.metadata(bs)):
                self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])  # warm-up, JIT compile
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, pool):
                    self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def load_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor) -> None:
        """Copy one decode step's inputs (host tensors, pinned) into the static buffers; pad to the graph's size."""
        n = input_ids.shape[0]
        bs = bucket(self.sizes, n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        if bs > n:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)

    def replay(self, num_seqs: int) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of the decode step whose inputs load_inputs copied in."""
        self.graphs[bucket(self.sizes, num_seqs)].replay()
        return self.hidden[:num_seqs]
