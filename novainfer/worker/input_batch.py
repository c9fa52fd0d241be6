"""The persistent input batch: one row per live sequence, kept across steps and updated by deltas.

A row holds the sequence's block table as an int32 array. A steady decode step touches each row only
when the block manager handed the sequence a new block (once every block_size tokens), so building a
step's block tables and slots is a handful of vectorized gathers instead of Python work per token.
Rows are compacted when sequences leave: the last row moves into the hole.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


class InputBatch:
    """Rows of per-sequence state in preallocated arrays, addressed by seq_id."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int):
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_tables = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int32)
        self.seq_ids = np.full(max_num_seqs, -1, dtype=np.int64)
        self._sources: list[list[int] | None] = [None] * max_num_seqs  # the block-table list each row mirrors
        self._lengths = [0] * max_num_seqs  # num_blocks as Python ints: gather()'s unchanged-row check
        self.row_of: dict[int, int] = {}

    def _grow(self) -> None:
        """More rows than planned (preempted sequences keep theirs while they wait): double the arrays."""
        n = len(self.seq_ids)
        self.block_tables = np.concatenate([self.block_tables, np.zeros_like(self.block_tables)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(n, dtype=np.int32)])
        self.seq_ids = np.concatenate([self.seq_ids, np.full(n, -1, dtype=np.int64)])
        self._sources += [None] * n
        self._lengths += [0] * n

    def row(self, seq_id: int, block_table: list[int]) -> int:
        """The sequence's row, added if new, with its block table brought up to date."""
        row = self.row_of.get(seq_id)
        if row is None:
            row = len(self.row_of)
            if row == len(self.seq_ids):
                self._grow()
            self.row_of[seq_id] = row
            self.seq_ids[row] = seq_id
            self._sources[row] = None
        n = int(self.num_blocks[row])
        if self._sources[row] is block_table and len(block_table) >= n:  # grown in place, or unchanged
            if len(block_table) > n:
                self.block_tables[row, n : len(block_table)] = block_table[n:]
        else:  # new, or the block manager gave the sequence a new table (preempted and readmitted)
            self.block_tables[row, : len(block_table)] = block_table
            self._sources[row] = block_table
        self.num_blocks[row] = self._lengths[row] = len(block_table)
        return row

    def gather(self, scheduled: Sequence[Any], group: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A step's rows, start positions and new-token counts (int64 arrays) in one pass over its
        ScheduledSequences; rows are added or brought up to date as row() does, which only new or grown
        tables need (a steady decode step calls it once per block_size steps per sequence). group: the KV group
        whose tables this batch mirrors (a grouped cache, worker/kv_layout.py; 0 is Sequence.block_table)."""
        row_of, sources, lengths = self.row_of, self._sources, self._lengths
        rows, starts, counts = [], [], []
        for s in scheduled:
            seq = s.seq
            table = seq.block_table if not group else seq.group_tables[group - 1]
            row = row_of.get(seq.seq_id)
            if row is None or sources[row] is not table or lengths[row] != len(table):
                row = self.row(seq.seq_id, table)
            rows.append(row)
            starts.append(s.start)
            counts.append(s.num_new_tokens)
        return np.array(rows, np.int64), np.array(starts, np.int64), np.array(counts, np.int64)

    def remove(self, seq_id: int) -> None:
        """Drop the sequence's row; the last row moves into its place."""
        row = self.row_of.pop(seq_id, None)
        if row is None:
            return
        last = len(self.row_of)
        if row != last:
            moved = int(self.seq_ids[last])
            width = int(self.num_blocks[last])
            self.block_tables[row, :width] = self.block_tables[last, :width]
            self.num_blocks[row] = self._lengths[row] = width
            self.seq_ids[row] = moved
            self._sources[row] = self._sources[last]
            self.row_of[moved] = row
        self.seq_ids[last] = -1
        self.num_blocks[last] = self._lengths[last] = 0
        self._sources[last] = None

    def slots(self, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
        """The cache slot of each (row, position) pair: its block's id * block_size + the offset in it."""
        return self.block_tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
