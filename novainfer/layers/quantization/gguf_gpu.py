"""GGUF weights kept quantized on the GPU: each tensor's blocks repacked at load, without re-quantizing, into the
split layout of kernels/gguf_gemm.py (low nibbles, high-bit planes, block factors and sub-scales in separate
contiguous arrays, each type about its file size) and multiplied by its Triton GEMV (decode) and GEMM (prefill).

Loading follows the CPU method (gguf_cpu.py, whose shard bookkeeping this subclasses): a fused layer's shards
(q/k/v, gate/up) are stacked by rows; shards of different GGML types (Q4_K_M's Q6_K v_proj beside Q4_K q/k) stay
separate parts of the layer, each written by its own kernel into its columns of the output. The quantized parts
hang on the weight Parameter (`param.packed`), so a tied lm_head shares the embedding's; an embedding lookup
gathers the ids' rows of blocks and dequantizes only those. Tensors of other types (Q5_0, IQ*, MXFP4 outside
the experts) load dequantized, as without this method. MoE `*_exps` stacks of these types stay quantized too, in the
same layout with a leading expert dimension (layers/quantization/gguf_moe.py, kernels/fused_moe_gguf.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from novainfer.kernels.gguf_gemm import GGUFWeight, dequantize, gguf_matmul
from novainfer.layers.quantization.base import FusedMoEMethodBase, QuantizationConfig, QuantizeMethodBase
from novainfer.layers.quantization.gguf_cpu import GGUFCPULinearMethod, GGUFQuantTensor
from novainfer.layers.quantization.gguf_gpu_layout import GPU_TYPES, gpu_layout

logger = logging.getLogger(__name__)


class GGUFGPULinearMethod(GGUFCPULinearMethod):
    """Linear/embedding layers whose GGUF blocks stay quantized on the GPU (see the module docstring)."""

    TYPES = GPU_TYPES

    def pack(self, shards: list[GGUFQuantTensor]) -> list[GGUFWeight]:
        device = self.device
        parts: list[GGUFWeight] = []
        for s in shards:
            w = gpu_layout(s.data, s.qtype, s.shape, device)
            if parts and parts[-1].qtype == w.qtype:
                w = GGUFWeight.cat_rows([parts.pop(), w])
            parts.append(w)
        return parts

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.device = layer.weight.device  # where the model was built
        super().process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        parts: list[GGUFWeight] | None = layer.weight.packed
        if parts is None:
            return torch.nn.functional.linear(x, layer.weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.is_cuda:
            y = gguf_matmul(x2, parts)
        else:  # the torch reference (a CPU rank gets the CPU method; this serves tests)
            y = (x2.float() @ torch.cat([dequantize(p) for p in parts]).T).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], y.shape[-1])

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        parts: list[GGUFWeight] | None = layer.weight.packed
        if parts is None:
            return torch.nn.functional.embedding(input_ids, layer.weight)
        if len(parts) != 1:
            raise ValueError("a GGUF embedding of several tensors")  # only fused linear layers have several
        rows = dequantize(parts[0].select_rows(input_ids.reshape(-1)))
        return rows.to(layer.weight.act_dtype).view(*input_ids.shape, -1)


class GGUFGPUConfig(QuantizationConfig):
    """Every linear/embedding layer and every FusedMoE layer's experts of a one-rank GPU model keep their GGUF blocks
    (types in GPU_TYPES)."""

    keeps_gguf_experts = True

    def get_quant_method(self, layer: nn.Module) -> QuantizeMethodBase | None:
        if getattr(layer, "tp_size", 1) != 1:
            return None
        return GGUFGPULinearMethod()

    def get_moe_method(self, layer: nn.Module) -> FusedMoEMethodBase | None:
        if getattr(layer, "tp_size", 1) != 1:
            return None
        from novainfer.layers.quantization.gguf_moe import GGUFMoEMethod

        return GGUFMoEMethod()
