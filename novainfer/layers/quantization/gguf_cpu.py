"""GGUF weights kept quantized on the CPU: repacked at load (kernels/cpu/repack.py), multiplied by the C
kernels (kernels/cpu/qgemm.py). A tensor of a type without a repack arrives dequantized and the layer stays dense.

The quantized state hangs on the weight Parameter (`param.packed`), so a tied lm_head, which shares the
embedding's Parameter, shares its packed weight too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from novainfer.kernels.cpu.qgemm import dequantize, quant_gemm
from novainfer.kernels.cpu.repack import SUPPORTED, PackedWeight, merge_rows, mergeable, repack
from novainfer.kernels.cpu.weight_arena import move_to_arena
from novainfer.layers.quantization.base import QuantizationConfig, QuantizeMethodBase


class GGUFQuantTensor:
    """One GGUF tensor's raw blocks as the loader yields them when weights stay quantized."""

    def __init__(self, name: str, data, qtype, shape: tuple[int, int]):
        self.name, self.data, self.qtype, self.shape = name, data, qtype, shape

    def to(self, *args: Any, **kwargs: Any) -> "GGUFQuantTensor":
        return self  # stays on the host, in its own format

    def dequantize(self) -> torch.Tensor:
        return repack(self.data, self.qtype, self.shape).dequantize()


class GGUFCPULinearMethod(QuantizeMethodBase):
    """Linear/embedding layers whose GGUF blocks stay quantized, multiplied by the CPU kernel."""

    TYPES = SUPPORTED  # the GGML types pack() takes; a layer with a shard of another type loads dense

    def create_weights(self, layer: nn.Module, output_size: int, input_size: int) -> nn.Parameter:
        param = nn.Parameter(torch.empty(0), requires_grad=False)
        param.full_shape = (output_size, input_size)
        param.shards = {}
        param.packed = None
        param.act_dtype = torch.get_default_dtype()  # the model's dtype while it is built
        return param

    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: Any, shard_id: Any, dense_loader) -> None:
        param.shards[shard_id] = loaded
        param.dense_loader = dense_loader
        if set(getattr(layer, "shard_order", [None])) <= param.shards.keys():
            self.process_weights_after_loading(layer)  # repack now: one layer's raw blocks alive at a time

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        param = layer.weight
        if param.packed is not None or not param.shards:
            return  # done already (a tied weight), or nothing loaded (the loader reports missing weights)
        order = getattr(layer, "shard_order", [None])
        shards = [param.shards[s] for s in order if s in param.shards]
        kept = all(isinstance(s, GGUFQuantTensor) and s.qtype in self.TYPES for s in shards)
        if len(shards) == len(order) and kept and mergeable([s.qtype for s in shards]):
            param.packed = self.pack(shards)
            rows = sum(s.shape[0] for s in shards)
            if (rows, shards[0].shape[1]) != param.full_shape:
                raise ValueError(
                    f"weight shape mismatch: expected {param.full_shape}, got {(rows, shards[0].shape[1])}"
                )
        else:  # a shard of a type without a kernel (or F16 beside quantized shards): the layer goes dense, exactly
            param.data = torch.empty(param.full_shape, dtype=param.act_dtype, device=param.device)
            for shard_id, t in param.shards.items():
                dense = t.dequantize() if isinstance(t, GGUFQuantTensor) else t
                dense = dense.to(param.act_dtype)
                param.dense_loader(param, dense) if shard_id is None else param.dense_loader(param, dense, shard_id)
        param.shards = {}

    def pack(self, shards: list[GGUFQuantTensor]) -> PackedWeight:
        """The stored form of a layer's shards (stacked by rows), each of a type in TYPES."""
        return merge_rows([repack(s.data, s.qtype, s.shape) for s in shards])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed: PackedWeight | None = layer.weight.packed
        if packed is None:
            return F.linear(x, layer.weight, bias)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        y = quant_gemm(x2, packed)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if bias is not None:
            y += bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        packed = layer.weight.packed
        if packed is None:
            return F.embedding(input_ids, layer.weight)
        rows = dequantize(packed, input_ids).to(layer.weight.act_dtype)  # in C: torch took 30 ms for 512 tokens
        return rows.view(*input_ids.shape, -1)


class GGUFCPUConfig(QuantizationConfig):
    """Every replicated linear/embedding layer of a one-rank CPU model gets the GGUF CPU method."""

    fused_cpu_ops = True
    activation_dtype = torch.float32  # the C kernels round float32 rows to int8/int16 themselves; bf16 would only
    # add conversions and leave the C decoder stack and ops (float32) out: 33 vs 173 tok/s on an AVX512-BF16 CPU

    def get_quant_method(self, layer: nn.Module) -> QuantizeMethodBase | None:
        if getattr(layer, "tp_size", 1) != 1:
            return None
        return GGUFCPULinearMethod()

    def process_model_after_loading(self, net: nn.Module) -> None:
        """The packed weights into one huge-page arena, in the order a step reads them (kernels/cpu/weight_arena.py)."""
        packs = [
            m.weight.packed
            for m in net.modules()
            if isinstance(getattr(m, "quant_method", None), GGUFCPULinearMethod) and m.weight.packed is not None
        ]
        move_to_arena(packs)
