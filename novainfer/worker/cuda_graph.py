"""CUDA graphs of the decode forward, captured once per batch size of a ladder and replayed with static inputs.

A decode step launches a few hundred small kernels; replaying a captured graph launches them in one
call. The graph reads its inputs from fixed buffers, so a step copies its inputs in, pads the batch
up to the next captured size (padding rows write nowhere: slot -1) and replays. With query_len > 1 the same
class captures speculative decoding's verify step, where every sequence brings query_len tokens (its last
token and its guesses); those graphs run the prefill attention kernel, whose grid depends only on the
batch size and query_len. A hybrid model's graphs (state_slots=True) also take each sequence's state slot from a
static buffer (padding rows: slot -1, which the Gated DeltaNet kernels neither read nor write). A grouped KV cache
(worker/kv_layout.py) has a static block table and slot row per KV group, which each group's layers read.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable

import torch

from novainfer.attention.metadata import AttentionMetadata, attention_metadata
from novainfer.layers.linear_attention import StateSlotsMetadata

logger = logging.getLogger(__name__)


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def bucket(ladder: list[int], num_seqs: int) -> int:
    """The smallest ladder size that holds num_seqs (num_seqs itself past the ladder's end)."""
    return next((b for b in ladder if b >= num_seqs), num_seqs)


def split_k_parts(num_seqs: int, kv_heads: int, num_sms: int, max_model_len: int) -> int:
    """Split-K parts of the decode attention kernel for a batch (its graph bucket's size): enough programs to
    fill the GPU's num_sms, each part >= 256 tokens of the longest allowed context."""
    want = -(-2 * num_sms // (num_seqs * kv_heads))
    splits = 1
    while splits * 2 <= min(want, max_model_len // 256, 32):
        splits *= 2
    return splits


def graphs_for_step(decode: DecodeGraphs | None, verify: DecodeGraphs | None, inp: Any) -> DecodeGraphs | None:
    """The captured graphs that can run a step (StepInputs): a pure decode step, or a verify step in which every
    sequence checks the full number of guesses; None runs it eagerly."""
    num_seqs = len(inp.seq_lens)
    graphs = decode if inp.max_query_len == 1 else verify
    if graphs is None or not graphs.can_run(num_seqs) or inp.max_query_len != graphs.query_len:
        return None
    if inp.state_slots is not None and (inp.state_slots.restores or inp.state_slots.saves):
        return None  # a state checkpoint copy: the layers' eager prefill path does it
    if inp.max_query_len > 1 and (
        inp.spec_num_drafts is None
        or len(inp.spec_num_drafts) != num_seqs
        or inp.input_ids.shape[0] != num_seqs * graphs.query_len
    ):
        return None
    return graphs


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_splits: Callable[[int], int],
        query_len: int = 1,
        state_slots: bool = False,
        num_groups: int = 1,
    ):
        self.forward = forward  # (input_ids, positions) -> hidden states: the runner's decode_forward
        self.sizes = batch_size_ladder(max_num_seqs)
        self.num_splits = num_splits
        self.query_len = q = query_len
        n, i32 = self.sizes[-1], dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n * q, dtype=torch.long, device=device)
        self.positions = torch.zeros(n * q, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((num_groups, n * q), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.full((n,), q, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32) * q
        self.block_tables = torch.zeros(num_groups, n, max_blocks_per_seq, **i32)  # column 0 stays a valid block id
        self.hidden = torch.zeros(n * q, hidden_size, dtype=dtype, device=device)
        self.state_slots = torch.full((n,), -1, dtype=torch.long, device=device) if state_slots else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def metadata(self, bs: int) -> AttentionMetadata:
        q = self.query_len
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            slot_mapping=self.slot_mapping[0, : bs * q],
            block_tables=self.block_tables[0, :bs],
            max_query_len=q,
            max_seq_len=self.block_tables.shape[2],
            num_splits=self.num_splits(bs) if q == 1 else 1,
            cuda_graph=True,
            state_slots=None if self.state_slots is None else StateSlotsMetadata(self.state_slots[:bs], []),
        )
        if self.block_tables.shape[0] > 1:
            meta.groups = [meta] + [
                replace(meta, block_tables=self.block_tables[g, :bs], slot_mapping=self.slot_mapping[g, : bs * q])
                for g in range(1, self.block_tables.shape[0])
            ]
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            graph = torch.cuda.CUDAGraph()
            t = bs * self.query_len
            with attention_metadata(self.metadata(bs)):
                self.hidden[:t] = self.forward(self.input_ids[:t], self.positions[:t])  # warm-up, JIT compile
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, pool):
                    self.hidden[:t] = self.forward(self.input_ids[:t], self.positions[:t])
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %s CUDA graphs for batch sizes %s",
            "decode" if self.query_len == 1 else f"verify ({self.query_len} tokens a sequence)",
            self.sizes,
        )

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def load_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        state_slots: torch.Tensor | None = None,
    ) -> None:
        """Copy one step's inputs (host tensors, pinned) into the static buffers; pad to the graph's size. A grouped
        cache's block_tables [groups, seqs, width] and slot_mapping [groups, tokens] fill every group's."""
        n, q = seq_lens.shape[0], self.query_len
        bs = bucket(self.sizes, n)
        t = n * q
        groups = self.block_tables.shape[0]
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.slot_mapping[:, :t].copy_(slot_mapping.view(groups, t), non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        block_tables = block_tables.view(groups, n, -1)
        self.block_tables[:, :n, : block_tables.shape[2]].copy_(block_tables, non_blocking=True)
        if self.state_slots is not None:
            self.state_slots[:n].copy_(state_slots, non_blocking=True)
        if bs > n:
            self.slot_mapping[:, t : bs * q].fill_(-1)
            self.seq_lens[n:bs].fill_(q)
            if self.state_slots is not None:
                self.state_slots[n:bs].fill_(-1)

    def replay(self, num_seqs: int) -> torch.Tensor:
        """Hidden states [num_seqs * query_len, hidden] of the step whose inputs load_inputs copied in."""
        self.graphs[bucket(self.sizes, num_seqs)].replay()
        return self.hidden[: num_seqs * self.query_len]
