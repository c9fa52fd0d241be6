"""The tensor-parallel group the layers shard by. With one rank every collective is a no-op.

Layers always call these functions, so a single algorithm serves tp_size 1 and tp_size N; the
multi-rank group lands with the tensor-parallelism issue.
"""
from __future__ import annotations

import torch

_tp_rank = 0
_tp_size = 1


def get_tp_rank() -> int:
    return _tp_rank


def get_tp_size() -> int:
    return _tp_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the tensor-parallel ranks (identity with one rank)."""
    if _tp_size == 1:
        return x
    torch.distributed.all_reduce(x)
    return x
