"""The quantization-method hook of the linear and embedding layers (vLLM's QuantizeMethodBase).

A layer keeps its class and weight_loader; its method decides how the weight is stored and how forward
multiplies. The CPU GGUF method (gguf_cpu.py) is the first; a Triton dequant-GEMM for CUDA would be a
second method with the same four calls.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn


class QuantizeMethodBase:
    """How one layer stores and applies its (quantized) weight."""

    def create_weights(self, layer: nn.Module, output_size: int, input_size: int) -> nn.Parameter:
        """The layer's `weight` parameter (a placeholder the method fills while loading)."""
        raise NotImplementedError

    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: Any, shard_id: Any, dense_loader) -> None:
        """Take one checkpoint tensor (a fused layer gets several, by shard_id)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded shards into the stored form, once every shard is in."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W^T (+ bias)."""
        raise NotImplementedError

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of W for the ids (the embedding lookup)."""
        raise NotImplementedError


class FusedMoEMethodBase:
    """How a FusedMoE layer stores its experts' weights and runs them (vLLM's FusedMoEMethodBase)."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        """Register the layer's expert parameters (intermediate_size: this rank's), each with its weight_loader."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded parameters into the stored form, once every one is in."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial sum over each token's experts (FusedMoE.apply_routed's contract)."""
        raise NotImplementedError


class QuantizationConfig:
    """Picks a method per layer while a model is built; None keeps the layer dense.

    fused_cpu_ops: the model's norms, activation and rotary run the C ops of kernels/cpu/ops.py on float32 CPU
    tensors (the quantized CPU path; the float32 exact path keeps torch's ops).
    activation_dtype: the dtype the methods' kernels take activations in, which a CPU model then computes in
    unless a dtype was asked for (None: the device's default, platform.default_cpu_dtype).
    keeps_gguf_experts: the config's MoE method takes a GGUF file's experts as their blocks (else dequantized).
    """

    fused_cpu_ops = False
    activation_dtype: torch.dtype | None = None
    keeps_gguf_experts = False  # a GGUF file's `*_exps` stacks reach the FusedMoE layers as raw blocks per expert

    def get_quant_method(self, layer: nn.Module) -> QuantizeMethodBase | None:
        raise NotImplementedError

    def keeps_stored_dtype(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether the loader hands this checkpoint tensor over as stored (a packed or float8 weight, its scales)
        instead of cast to the model's dtype."""
        return False

    def get_moe_method(self, layer: nn.Module) -> FusedMoEMethodBase | None:
        """The method of a FusedMoE layer's experts; None keeps them dense."""
        return None

    def process_model_after_loading(self, net: nn.Module) -> None:
        """Once every layer holds its stored weight: whole-model placement (e.g. the CPU weight arena)."""


_state = threading.local()


def current_quant_config() -> QuantizationConfig | None:
    """The config of the model being built on this thread (set by the loader), else None."""
    return getattr(_state, "config", None)


@contextmanager
def building_with(config: QuantizationConfig | None) -> Iterator[None]:
    """Layers constructed inside ask `config` for their method (models need not pass it through)."""
    prev = current_quant_config()
    _state.config = config
    try:
        yield
    finally:
        _state.config = prev
