"""Tensor-parallel group: rank, size and the collectives the layers call."""
from novainfer.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce

__all__ = ["get_tp_rank", "get_tp_size", "tensor_model_parallel_all_reduce"]
