"""Tile scheduling shared by the Triton kernels (the quantized GEMM/GEMVs, the Gated DeltaNet grids)."""

from __future__ import annotations

from functools import lru_cache

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


def row_bucket(m: int, table: dict[int, object]) -> int:
    """The key of a tile table by row count (ascending upper bounds) that m rows fall in."""
    return next(b for b in table if m <= b)
