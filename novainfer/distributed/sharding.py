"""Sharding rules: contiguous equal chunks, divisibility checked before anything loads.

Errors name the fields the seed asks for: `weight_name/global_shape/local_shape/tp_size/tp_rank` for a
weight and `tp_size/tp_rank/global_nkvh/local_nkvh/device_id` for the KV heads.
"""

from __future__ import annotations

from typing import Any

import torch


class ShardError(ValueError):
    """A weight that cannot be split as the model expects; weight_name is filled in by the loader."""

    def __init__(
        self, global_shape: tuple, local_shape: tuple, tp_size: int, tp_rank: int, reason: str, weight_name: str = "?"
    ):
        self.fields = dict(global_shape=global_shape, local_shape=local_shape, tp_size=tp_size, tp_rank=tp_rank)
        self.reason, self.weight_name = reason, weight_name
        super().__init__(self._message())

    def _message(self) -> str:
        f = self.fields
        return (
            f"cannot shard weight: {self.reason} (weight_name={self.weight_name} "
            f"global_shape={f['global_shape']} local_shape={f['local_shape']} "
            f"tp_size={f['tp_size']} tp_rank={f['tp_rank']})"
        )

    def __reduce__(self):  # picklable, so it can cross process boundaries
        f = self.fields
        return ShardError, (
            f["global_shape"],
            f["local_shape"],
            f["tp_size"],
            f["tp_rank"],
            self.reason,
            self.weight_name,
        )

    def with_name(self, weight_name: str) -> "ShardError":
        f = self.fields
        return ShardError(f["global_shape"], f["local_shape"], f["tp_size"], f["tp_rank"], self.reason, weight_name)


def shard_dim(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int, local_shape: tuple) -> torch.Tensor:
    """This rank's contiguous chunk [rank * chunk, (rank + 1) * chunk) of full along dim, of shape local_shape."""
    glob, local = tuple(full.shape), tuple(local_shape)
    if dim >= full.dim() or full.shape[dim] % tp_size:
        raise ShardError(glob, local, tp_size, tp_rank, f"dim {dim} is not divisible by tp_size")
    chunk = full.shape[dim] // tp_size
    part = full.narrow(dim, tp_rank * chunk, chunk)
    if tuple(part.shape) != local:
        raise ShardError(glob, local, tp_size, tp_rank, f"the shard has shape {tuple(part.shape)}")
    return part


def check_tp_divisibility(hf_config: Any, tp_size: int, tp_rank: int, device_id: int | str) -> None:
    """Fail at start, before any weight is read, when heads, KV heads or the MLP width don't split evenly."""
    missing = [f for f in ("num_attention_heads", "hidden_size") if getattr(hf_config, f, None) is None]
    if missing:
        raise ValueError(
            f"the model's config has no {', '.join(missing)} "
            f"(architectures={getattr(hf_config, 'architectures', None)})"
        )
    nh = hf_config.num_attention_heads
    nkvh = getattr(hf_config, "num_key_value_heads", None) or nh
    if nkvh % tp_size:
        raise ValueError(
            f"num_key_value_heads must be divisible by tensor_parallel_size (KV heads are split, "
            f"never replicated): tp_size={tp_size} tp_rank={tp_rank} global_nkvh={nkvh} "
            f"local_nkvh={nkvh / tp_size:g} device_id={device_id}"
        )
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // nh
    di, hs = getattr(hf_config, "intermediate_size", None), hf_config.hidden_size  # None: every MLP is an MoE
    mlp = (("gate_proj.weight", di, 0), ("down_proj.weight", di, 1)) if di else ()
    for name, rows, dim in (
        ("q_proj.weight", nh * head_dim, 0),
        ("k_proj.weight", nkvh * head_dim, 0),
        ("o_proj.weight", nh * head_dim, 1),
        *mlp,
    ):
        if rows % tp_size or (name.startswith("q") and nh % tp_size):
            glob = (rows, hs) if dim == 0 else (hs, rows)
            local = tuple(s / tp_size if d == dim else s for d, s in enumerate(glob))
            raise ShardError(
                glob,
                local,
                tp_size,
                tp_rank,
                "heads or intermediate_size not divisible by tp_size",
                weight_name=f"model.layers.*.{name}",
            )
