"""Linear layers with tensor-parallel sharding (vLLM's names). Each weight loads through weight_loader.

Column-parallel layers split the output dim (dim 0 of the weight) across ranks, row-parallel layers
the input dim (dim 1) and all-reduce their output. Fused layers (QKV, gate/up) load each HF tensor
into its own slice of the fused weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from novainfer.distributed import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tp_size={denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T (+ b) with weight [output_size, input_size] as stored by Hugging Face."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param.data, loaded, param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, _divide(output_size, get_tp_size(), "output_size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.data.shape[0]
        _copy_checked(param.data, loaded.narrow(0, self.tp_rank * size, size), param)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (gate_proj and up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        target = param.data.narrow(0, offset, size)
        _copy_checked(target, loaded.narrow(0, self.tp_rank * size, size), param)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds its own heads of each, concatenated."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
        output_size = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        target = param.data.narrow(0, offset, size)
        _copy_checked(target, loaded.narrow(0, self.tp_rank * size, size), param)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with one all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(_divide(input_size, get_tp_size(), "input_size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.data.dim() == 2:
            size = param.data.shape[1]
            loaded = loaded.narrow(1, self.tp_rank * size, size)
        _copy_checked(param.data, loaded, param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the bias is added once, after the reduction
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        return y if self.bias is None else y + self.bias


def _copy_checked(target: torch.Tensor, loaded: torch.Tensor, param: nn.Parameter) -> None:
    if target.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: expected local_shape={tuple(target.shape)}, "
                         f"got {tuple(loaded.shape)} (parameter of shape {tuple(param.shape)})")
    target.copy_(loaded)
