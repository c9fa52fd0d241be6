"""Linear layers with tensor-parallel sharding (vLLM's names). Each weight loads through weight_loader.

Column-parallel layers split the output dim (dim 0 of the weight) across ranks, row-parallel layers
the input dim (dim 1) and all-reduce their output: two all-reduces per decoder layer (o_proj, down_proj).
Fused layers (QKV, gate/up) shard each HF tensor on its own, then place it in its slice of the fused
weight. Each layer keeps the group current when it was built (see parallel_state).
"""

from __future__ import annotations

import torch
from torch import nn

from novainfer.distributed import get_tp_group, get_tp_size, shard_dim
from novainfer.layers.quantization import current_quant_config
from novainfer.layers.row_invariant import linear


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tp_size={denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T (+ b) with weight [output_size, input_size] as stored by Hugging Face.

    A quant method (from the config of the model being built) may store the weight its own way; the
    layer's weight_loader then hands each checkpoint tensor to it.
    """

    shard_order: list = [None]  # the shard ids a fused layer's weight is stacked from, in row order

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank, self.tp_group.size
        self.input_size, self.output_size = input_size, output_size  # this rank's (what a quant method sees)
        config = current_quant_config()
        self.quant_method = config.get_quant_method(self) if config is not None else None
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        else:
            self.weight = self.quant_method.create_weights(self, output_size, input_size)
            self.weight.weight_loader = self._quant_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param.data, loaded, param)

    def _quant_weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        self.quant_method.load_shard(self, param, loaded, shard_id, self.weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return dense_linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, _divide(output_size, get_tp_size(), "output_size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param.data, self._shard(loaded, 0, param.data.shape), param)

    def _shard(self, loaded: torch.Tensor, dim: int, local_shape) -> torch.Tensor:
        return shard_dim(loaded, dim, self.tp_rank, self.tp_size, tuple(local_shape))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (gate_proj and up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        self.shard_order = list(range(len(output_sizes)))
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        target = param.data.narrow(0, offset, size)
        _copy_checked(target, self._shard(loaded, 0, target.shape), param)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds its own heads of each, concatenated."""

    shard_order = ["q", "k", "v"]

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
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
        _copy_checked(target, self._shard(loaded, 0, target.shape), param)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with one all-reduce.

    reduce_results=False leaves the partial sum to the caller, which reduces several at once (an MoE
    layer's shared expert and routed experts share one all-reduce)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True):
        super().__init__(_divide(input_size, get_tp_size(), "input_size"), output_size, bias)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.data.dim() == 2:  # the bias is replicated
            loaded = shard_dim(loaded, 1, self.tp_rank, self.tp_size, tuple(param.data.shape))
        _copy_checked(param.data, loaded, param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the bias is added once, after the reduction
        y = dense_linear(x, self.weight) if self.quant_method is None else self.quant_method.apply(self, x)
        if self.tp_size > 1 and self.reduce_results:
            y = self.tp_group.all_reduce(y)
        return y if self.bias is None else y + self.bias


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); one row on the GPU through the Triton GEMV, which reads each weight row once in one
    launch (cuBLAS splits a one-row product into a GEMM and a reduction), except in batch-invariant mode."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype != torch.float32 and weight.is_contiguous():
        from novainfer.kernels import batch_invariant
        from novainfer.kernels.gemv import gemv

        if not batch_invariant.enabled():
            return gemv(x.contiguous(), weight, bias)
    return linear(x, weight, bias)


def adjacent_weights(linears: list[LinearBase]) -> torch.Tensor | None:
    """Rebinds the weights of unquantized, bias-free layers of one input size to consecutive row ranges of one new
    tensor, which it returns, so one GEMM (dense_linear) computes all their outputs side by side; None (nothing
    changed) if any is quantized or has a bias. Call it before loading: the loaders write into the views."""
    if any(lin.quant_method is not None or lin.bias is not None for lin in linears):
        return None
    first = linears[0].weight
    fused = torch.empty(
        sum(lin.weight.shape[0] for lin in linears), first.shape[1], dtype=first.dtype, device=first.device
    )
    row = 0
    for lin in linears:
        old, rows = lin.weight, lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[row : row + rows], requires_grad=False)
        lin.weight.__dict__.update(old.__dict__)  # weight_loader and the like
        row += rows
    return fused


def _copy_checked(target: torch.Tensor, loaded: torch.Tensor, param: nn.Parameter) -> None:
    if target.shape != loaded.shape:
        raise ValueError(
            f"weight shape mismatch: expected local_shape={tuple(target.shape)}, "
            f"got {tuple(loaded.shape)} (parameter of shape {tuple(param.shape)})"
        )
    target.copy_(loaded)
