"""Tensor-parallel group: rank, size and the collectives the layers call; sharding rules."""

from novainfer.distributed.parallel_state import TPGroup, get_tp_group, get_tp_size, set_tp_group
from novainfer.distributed.sharding import ShardError, check_tp_divisibility, shard_dim

__all__ = ["TPGroup", "get_tp_group", "get_tp_size", "set_tp_group", "ShardError", "check_tp_divisibility", "shard_dim"]
