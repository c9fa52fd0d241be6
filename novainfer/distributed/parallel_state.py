"""The tensor-parallel group the layers shard by and reduce over. With one rank every collective is a no-op.

Layers read the current group when they are built and keep it, so one algorithm serves every backend:
  - TPGroup: one rank, all_reduce is the identity (tp_size == 1).
  - ThreadGroup (uni backend): every rank is a thread of one process; the ranks meet at a barrier and
    each sums all ranks' tensors in rank order on its own device (identical results on every rank).
  - TorchDistGroup (mp backend): one rank per process over torch.distributed (NCCL on GPU, gloo on CPU).
The current group is thread-local (uni runs several ranks in one process), falling back to the process's.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist


class TPGroup:
    """A tensor-parallel group of one rank: the collectives do nothing."""

    name = "single"

    def __init__(self, rank: int = 0, size: int = 1):
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks; returns the sum (may be x itself, reduced in place)."""
        return x

    def abort(self) -> None:
        """Wake ranks blocked in a collective after another rank failed (where the group can)."""

    def _annotate(self, exc: BaseException, x: torch.Tensor) -> None:
        """A failed collective names op, group, rank and device."""
        exc.add_note(f"all_reduce failed: group={self.name} rank={self.rank}/{self.size} device={x.device}")


class InProcessReducer:
    """The meeting point of a ThreadGroup's ranks: one slot per rank and a barrier."""

    def __init__(self, size: int, timeout: float = 300.0):
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout)


class ThreadGroup(TPGroup):
    """One rank of a group whose ranks are threads of this process (the uni backend)."""

    name = "uni-threads"

    def __init__(self, rank: int, size: int, reducer: InProcessReducer):
        super().__init__(rank, size)
        self.reducer = reducer

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        r = self.reducer
        r.slots[self.rank] = x
        try:
            r.barrier.wait()  # every rank's partial sum is in place
            total = r.slots[0].to(x.device, copy=True)
            for part in r.slots[1:]:
                total.add_(part.to(x.device))
            r.barrier.wait()  # nobody overwrites a slot before every rank has read it
        except Exception as exc:
            self._annotate(exc, x)
            raise
        return total

    def abort(self) -> None:
        self.reducer.barrier.abort()


class TorchDistGroup(TPGroup):
    """This process's rank of the torch.distributed default group (the mp backend)."""

    name = "torch.distributed"

    def __init__(self):
        super().__init__(dist.get_rank(), dist.get_world_size())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        try:
            dist.all_reduce(x)
        except Exception as exc:
            self._annotate(exc, x)
            raise
        return x


_process_group: TPGroup = TPGroup()
_thread = threading.local()


def set_tp_group(group: TPGroup, process_wide: bool = False) -> None:
    """Make group current for this thread (uni ranks), or for the whole process (mp workers)."""
    global _process_group
    if process_wide:
        _process_group = group
    _thread.group = group


def get_tp_group() -> TPGroup:
    return getattr(_thread, "group", None) or _process_group


def get_tp_size() -> int:
    return get_tp_group().size
