"""Tile scheduling shared by the Triton kernels (the quantized GEMM/GEMVs, the Gated DeltaNet grids)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import lru_cache
from typing import TypeVar

import torch
import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile column), GROUP_M row tiles at a time so neighbours share weight tiles in L2."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The GPU's multiprocessor count (looked up once per device); 1 elsewhere, so a grid rule sees one SM."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def split_k(k: int, tiles_n: int, block_k: int, device: torch.device, programs_per_sm: int) -> tuple[int, int]:
    """(splits, columns per split, a multiple of block_k): a GEMV of few output tiles split along K until the GPU
    has programs_per_sm programs per SM (each split at least 4 K steps long); 1 split on the CPU."""
    split = max(1, min(triton.cdiv(programs_per_sm * sm_count(device), tiles_n), k // (4 * block_k)))
    return even_split(k, split, block_k)


def even_split(k: int, split: int, step: int) -> tuple[int, int]:
    """(splits, length of each, a multiple of step): k cut into about `split` equal parts of whole steps (fewer
    where the rounding up leaves the last ones empty)."""
    per_split = triton.cdiv(triton.cdiv(k, split), step) * step
    return triton.cdiv(k, per_split), per_split


T = TypeVar("T")
_unfit: set[Hashable] = set()  # launch choices this process's GPU lacked the shared memory for


def fits(key: Hashable) -> bool:
    """Whether the choice remembered under key has not failed to launch on this GPU."""
    return key not in _unfit


def launch_or_fallback(launch: Callable[[T], None], choice: T, fallback: T, key: Hashable | None = None) -> None:
    """launch(choice); where this GPU's shared memory is short of it, launch(fallback) and remember that under key
    (choice by default), so later calls go straight to the fallback."""
    key = choice if key is None else key
    if key in _unfit:
        launch(fallback)
        return
    try:
        launch(choice)
    except triton.runtime.errors.OutOfResources as err:
        # Triton 3.6 keeps one copy of this error in its kernel cache and raises that same object at every later
        # launch of the choice, each raise appending the frames it crossed (and their tensors) to its traceback:
        # hence no second try of a choice that failed (a Qwen3.5-9B step kept 4-12 GiB of DeltaNet scratch so).
        err.__traceback__ = None
        _unfit.add(key)
        launch(fallback)


def row_bucket(m: int, table: dict[int, object]) -> int:
    """The key of a tile table by row count (ascending upper bounds) that m rows fall in."""
    return next(b for b in table if m <= b)
