"""A GGUF file's MoE experts (llama.cpp's `ffn_{gate,up,down}_exps` stacks) kept quantized in a FusedMoE layer on
one GPU, in kernels/gguf_gemm.py's repacked layout with a leading expert dimension (kernels/fused_moe_gguf.py runs
them; on a CPU device its torch reference does, which serves tests: CPU ranks get the CPU config, which loads the
experts dequantized).

The loader hands each expert's projection over as its raw blocks (GGUFQuantTensor; loader/gguf_loader.py with
keep_experts), shard id (expert, w1 | w3 | w2). Once a side's shards are all in they are stacked and repacked at
once: w13_weight.packed holds gate and up rows per expert in one part where both are one GGML type, else two parts
(gate, then up: each written into its columns of the product); w2_weight.packed the down projection (Q4_K_M's down
is often Q6_K beside Q4_K gate/up: a part of its own type). A side with a shard of a type the kernels do not take,
or of a family whose reader does not split stacks of blocks (they arrive dequantized, written in place as they
come), is stored dense [E, N, K] in the model's dtype instead, as without this method, and run by the bf16 kernels.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from novainfer.kernels.fused_moe_gguf import Side, fused_experts_gguf
from novainfer.kernels.gguf_gemm import GGUFWeight, dequantize
from novainfer.layers.fused_moe.gguf_torch import fused_experts_gguf_reference
from novainfer.layers.quantization.base import FusedMoEMethodBase
from novainfer.layers.quantization.gguf_cpu import GGUFQuantTensor
from novainfer.layers.quantization.gguf_gpu_layout import GPU_TYPES, gpu_layout

logger = logging.getLogger(__name__)

SIDES = {"w13_weight": ("w1", "w3"), "w2_weight": ("w2",)}  # parameter -> the shard kinds stacked along its rows


class GGUFMoEMethod(FusedMoEMethodBase):
    """A FusedMoE layer's experts as GGUF blocks on the GPU (see the module docstring)."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        layer.gguf_shards = {}
        shapes = {
            "w13_weight": (num_experts, 2 * intermediate_size, hidden_size),
            "w2_weight": (num_experts, hidden_size, intermediate_size),
        }
        for name, shape in shapes.items():
            param = nn.Parameter(torch.empty(0), requires_grad=False)
            param.full_shape = shape
            param.packed = None  # list[GGUFWeight] once loaded quantized
            param.act_dtype = torch.get_default_dtype()  # the model's dtype while it is built
            param.weight_loader = partial(self._load, layer, name)
            layer.register_parameter(name, param)

    def _load(self, layer: nn.Module, name: str, param: nn.Parameter, loaded: Any, shard_id: tuple[int, str]) -> None:
        expert, kind = shard_id
        if not 0 <= expert < layer.num_experts:
            raise ValueError(f"expert {expert} out of range: the config has {layer.num_experts} experts")
        want = (param.full_shape[1] // len(SIDES[name]), param.full_shape[2])
        if tuple(loaded.shape) != want:
            raise ValueError(f"expert {expert}'s {kind} has shape {tuple(loaded.shape)}; the layer expects {want}")
        if isinstance(loaded, GGUFQuantTensor):
            layer.gguf_shards[(kind, expert)] = loaded
        else:  # dequantized by the loader (a type without a kernel, a family that does not split stacks): in place
            _rows(param, kind)[expert] = loaded
            layer.gguf_shards[(kind, expert)] = None
        keys = [(k, e) for k in SIDES[name] for e in range(layer.num_experts)]
        if all(key in layer.gguf_shards for key in keys):  # the side is complete: one side's blocks held at a time
            shards = [[layer.gguf_shards.pop((k, e)) for e in range(layer.num_experts)] for k in SIDES[name]]
            self._store(param, name, shards)

    def _store(self, param: nn.Parameter, name: str, shards: list[list[GGUFQuantTensor | None]]) -> None:
        """One side's shards (per kind, per expert; None: written dense already) -> param.packed where every shard is
        kept and each kind is one type, else the quantized ones dequantized into the dense param.data."""
        types = [{getattr(s, "qtype", None) for s in per_expert} for per_expert in shards]
        if all(len(t) == 1 and next(iter(t)) in GPU_TYPES for t in types):
            param.packed = stack_experts(shards, param.full_shape[2], param.device)
            return
        if any(s is not None for per_expert in shards for s in per_expert):
            names = sorted({getattr(q, "name", "float") for t in types for q in t})
            logger.info("GGUF experts of types %s: %s loads dequantized (no GPU kernel for a type)", names, name)
        for kind, per_expert in zip(SIDES[name], shards):
            for e, s in enumerate(per_expert):
                if s is not None:
                    _rows(param, kind)[e] = dequantize(gpu_layout(s.data, s.qtype, s.shape, param.device))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.gguf_shards:
            lacking = sorted({kind for kind, _ in layer.gguf_shards})
            raise ValueError(f"the GGUF file lacks some experts' {', '.join(lacking)} tensors")
        if layer.w13_bias is not None or layer.w2_bias is not None:
            raise ValueError("GGUF experts with biases are not supported by the GGUF GPU experts method")

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        w13, w2 = _side(layer.w13_weight), _side(layer.w2_weight)
        if x.is_cuda:
            return fused_experts_gguf(x, w13, w2, topk_weights, topk_ids, layer.act_fn)
        return fused_experts_gguf_reference(x, w13, w2, topk_weights, topk_ids, layer.act_fn)


def _rows(param: nn.Parameter, kind: str) -> torch.Tensor:
    """The dense rows [E, rows, K] of one shard kind (gate: the first half of w13, up: the second), the dense
    weight allocated on first use."""
    if param.numel() == 0:
        param.data = torch.empty(param.full_shape, dtype=param.act_dtype, device=param.device)
    rows = param.full_shape[1] // (2 if kind in ("w1", "w3") else 1)
    return param.data.narrow(1, rows if kind == "w3" else 0, rows)


def _side(param: nn.Parameter) -> Side:
    return param.packed if param.packed is not None else param.data


def stack_experts(shards: list[list[GGUFQuantTensor]], k: int, device: torch.device) -> list[GGUFWeight]:
    """Per kind the experts' raw blocks -> parts [E, rows, ...] in the GPU layout: consecutive kinds of one GGML type
    share a part (each expert's gate rows, then its up rows)."""
    groups: list[tuple[Any, list[np.ndarray]]] = []
    for per_expert in shards:
        qtype, data = per_expert[0].qtype, np.stack([s.data for s in per_expert])  # [E, rows, bytes a row]
        if groups and groups[-1][0] == qtype:
            groups[-1][1].append(data)
        else:
            groups.append((qtype, [data]))
    parts = []
    for qtype, stacks in groups:
        data = np.concatenate(stacks, axis=1) if len(stacks) > 1 else stacks[0]
        experts, rows = data.shape[:2]
        w = gpu_layout(data.reshape(experts * rows, -1), qtype, (experts * rows, k), device)
        parts.append(w.map(lambda t: t.view(experts, rows, -1), rows))
    return parts
