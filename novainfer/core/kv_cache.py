"""The SLOT cache's metadata: cells with a physical index, a logical pos and a set of sequence ids.

The persistent mapping is cell -> (seq ids, pos); per-sequence facts such as
pos_max are found by scanning. Allocation is two-phase: find_slots plans without touching anything,
commit_slots applies the plan. There is one global pool of cells: no eviction and no per-sequence
quota; out of cells is a status the caller sees. The K/V tensors live with the Context.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from novainfer.core.batch import BatchView

_POS_END = np.iinfo(np.int64).max


class Status(IntEnum):
    """Return codes of decode and the kv_seq_* operations, as llama.cpp's llama_decode."""

    OK = 0
    NO_KV_SLOT = 1  # not enough free cells for the batch; nothing was changed
    ABORTED = 2  # the abort callback asked to stop before the forward; nothing was changed
    INVALID_INPUT = -1  # the batch or a sequence id is invalid (the reason is logged)
    COMPUTE_FAILED = -2  # the forward raised; cell metadata was rolled back


@dataclass
class SlotInfo:
    """The plan for one batch: token i goes to cell idxs[i]."""

    idxs: np.ndarray


def _range(p0: int, p1: int) -> tuple[int, int]:
    """Half-open [p0, p1) with negative bounds meaning open ends (llama.cpp's convention)."""
    return max(p0, 0), _POS_END if p1 < 0 else p1


class SlotKvCache:
    """n_cells cells for sequences 0..n_seq_max-1; a cell is used exactly when it has a sequence."""

    def __init__(self, n_cells: int, n_seq_max: int):
        if n_cells < 1 or n_seq_max < 1:
            raise ValueError(f"need n_cells >= 1 and n_seq_max >= 1, got {n_cells}, {n_seq_max}")
        self.n_cells, self.n_seq_max = n_cells, n_seq_max
        self.pos = np.full(n_cells, -1, dtype=np.int64)
        self.seqs = np.zeros((n_cells, n_seq_max), dtype=bool)

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def used(self) -> np.ndarray:
        return self.seqs.any(axis=1)

    @property
    def n_used(self) -> int:
        return int(self.used.sum())

    def valid_seq(self, seq_id: int) -> bool:
        return 0 <= seq_id < self.n_seq_max

    def cell_pos(self, idx: int) -> int:
        return int(self.pos[idx])

    def cell_has_seq(self, idx: int, seq_id: int) -> bool:
        return self.valid_seq(seq_id) and bool(self.seqs[idx, seq_id])

    def cell_has_any_seq(self, idx: int, seq_ids: list[int]) -> bool:
        return any(self.cell_has_seq(idx, s) for s in seq_ids)

    def seq_pos_max(self, seq_id: int) -> int:
        """The sequence's largest logical position, -1 when it has no cell (or the id is invalid)."""
        if not self.valid_seq(seq_id) or not self.seqs[:, seq_id].any():
            return -1
        return int(self.pos[self.seqs[:, seq_id]].max())

    def seq_pos_min(self, seq_id: int) -> int:
        if not self.valid_seq(seq_id) or not self.seqs[:, seq_id].any():
            return -1
        return int(self.pos[self.seqs[:, seq_id]].min())

    def seq_cells(self, seq_id: int, p0: int, p1: int) -> np.ndarray:
        """Indices of the sequence's cells with pos in [p0, p1)."""
        lo, hi = _range(p0, p1)
        return np.flatnonzero(self.seqs[:, seq_id] & (self.pos >= lo) & (self.pos < hi))

    # ---- two-phase allocation --------------------------------------------------------------------
    def find_slots(self, view: BatchView) -> SlotInfo | None:
        """Plan a free cell for every token (lowest index first); None when too few are free. Changes nothing."""
        free = np.flatnonzero(~self.used)
        if len(free) < view.n_tokens:
            return None
        return SlotInfo(idxs=free[: view.n_tokens].copy())

    def commit_slots(self, view: BatchView, slots: SlotInfo) -> None:
        """Give each planned cell its token's pos and sequence ids."""
        assert not self.used[slots.idxs].any(), "commit_slots: a planned cell is no longer free"
        self.pos[slots.idxs] = view.pos
        self.seqs[slots.idxs] = view.seq_mask
        self.check_invariants()

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.pos.copy(), self.seqs.copy()

    def restore(self, snap: tuple[np.ndarray, np.ndarray]) -> None:
        self.pos[:], self.seqs[:] = snap

    def check_invariants(self) -> None:
        """A free cell has no sequence and pos -1; a used cell has pos >= 0."""
        used = self.used
        assert (self.pos[~used] == -1).all(), "a free cell keeps a position"
        assert (self.pos[used] >= 0).all(), "a used cell has a negative position"

    # ---- attention visibility --------------------------------------------------------------------
    def visible_cells(self, view: BatchView) -> tuple[np.ndarray, np.ndarray]:
        """Cells the batch may read and the mask [n_tokens, n_candidates] of which query sees which.

        A query sees a cell when their seq-id sets intersect and cell.pos <= query.pos.
        """
        in_batch = view.seq_mask.any(axis=0)
        cells = np.flatnonzero(self.seqs[:, in_batch].any(axis=1))
        shared = (view.seq_mask.astype(np.float32) @ self.seqs[cells].T.astype(np.float32)) > 0
        causal = self.pos[cells][None, :] <= view.pos[:, None]
        return cells, shared & causal

    # ---- sequence operations (half-open [p0, p1), negative bounds = open ends) -------------------
    def _free(self, idxs: np.ndarray) -> None:
        self.seqs[idxs] = False
        self.pos[idxs] = -1

    def _release_empty(self) -> None:
        self.pos[~self.used] = -1

    def seq_cp(self, dst_seq: int, src_seq: int, p0: int, p1: int) -> None:
        """Attach dst_seq to src_seq's cells in the range: the K/V are shared, not copied."""
        self.seqs[self.seq_cells(src_seq, p0, p1), dst_seq] = True

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> None:
        """Detach seq_id (every sequence when seq_id < 0) from cells in the range; cells left empty are freed."""
        if seq_id < 0:
            lo, hi = _range(p0, p1)
            self._free(np.flatnonzero(self.used & (self.pos >= lo) & (self.pos < hi)))
            return
        self.seqs[self.seq_cells(seq_id, p0, p1), seq_id] = False
        self._release_empty()

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> np.ndarray:
        """Shift pos of seq_id's cells in the range by delta; returns the cells moved that are still used.

        A cell holds one pos for all its sequences, so a cell shared with another sequence moves for it
        too (as in llama.cpp). A cell shifted below position 0 is freed.
        """
        idxs = self.seq_cells(seq_id, p0, p1)
        self.pos[idxs] += delta
        gone = idxs[self.pos[idxs] < 0]
        self._free(gone)
        return idxs[self.pos[idxs] >= 0]

    def seq_keep(self, seq_id: int) -> None:
        """Drop every sequence but seq_id; cells without it are freed."""
        keep = self.seqs[:, seq_id].copy()
        self.seqs[:] = False
        self.seqs[keep, seq_id] = True
        self._release_empty()

    def clear(self) -> None:
        self._free(np.arange(self.n_cells))

    # ---- diagnostics -----------------------------------------------------------------------------
    def dump(self, view: BatchView | None = None, slots: SlotInfo | None = None, all_cells: bool = False) -> str:
        """`cell[idx] = {seq_ids, pos, used}` per used cell (or every cell), then `token[i] -> cell[idx]`."""
        lines = [f"slot cache: {self.n_used}/{self.n_cells} cells used"]
        for idx in range(self.n_cells) if all_cells else np.flatnonzero(self.used):
            ids = np.flatnonzero(self.seqs[idx]).tolist()
            lines.append(f"cell[{idx}] = {{seq_ids={ids}, pos={self.pos[idx]}, used={bool(ids)}}}")
        if view is not None and slots is not None:
            for i, idx in enumerate(slots.idxs):
                lines.append(f"token[{i}] -> cell[{idx}] (pos={view.pos[i]}, seq_ids={view.seq_ids(i)})")
        return "\n".join(lines)
