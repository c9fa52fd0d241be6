"""GGUF weights kept quantized on the GPU: each tensor's blocks repacked at load, without re-quantizing, into the
split layout of kernels/gguf_gemm.py (quants, block factors and sub-scales in separate contiguous arrays) and
multiplied by its Triton GEMV (decode) and GEMM (prefill).

Loading follows the CPU method (gguf_cpu.py, whose shard bookkeeping this subclasses): a fused layer's shards
(q/k/v, gate/up) are stacked by rows; shards of different GGML types (Q4_K_M's Q6_K v_proj beside Q4_K q/k) stay
separate parts of the layer, each written by its own kernel into its columns of the output. The quantized parts
hang on the weight Parameter (`param.packed`), so a tied lm_head shares the embedding's; an embedding lookup
gathers the ids' rows of blocks and dequantizes only those. Tensors of other types (Q5_0, IQ*, MXFP4 outside
the experts) and non-2-D ones (MoE `*_exps` stacks) load dequantized, as without this method.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from torch import nn

from novainfer.kernels.cpu.repack import BLOCK, CHUNK_BYTES, _k_scales, _repack_blocks
from novainfer.kernels.gguf_gemm import FORMATS, GGUFWeight, dequantize, gguf_matmul
from novainfer.layers.quantization.base import QuantizationConfig, QuantizeMethodBase
from novainfer.layers.quantization.gguf_cpu import GGUFCPULinearMethod, GGUFQuantTensor

logger = logging.getLogger(__name__)

GPU_TYPES = frozenset(T[name] for name in FORMATS)


def _f16(b: np.ndarray, n: int) -> np.ndarray:
    """Two bytes a block -> float16 [n, blocks] (as stored: exact)."""
    return np.ascontiguousarray(b).view(np.float16).reshape(n, -1)


def _factors(b: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """uint8 [n, blocks, bytes per block] -> (d, sc, dm, mn) of the GPU layout (kernels/gguf_gemm.py)."""
    n = b.shape[0]
    if qtype in (T.Q4_0, T.Q8_0):
        return _f16(b[..., 0:2], n), None, None, None
    if qtype == T.Q4_1:
        return _f16(b[..., 0:2], n), None, _f16(b[..., 2:4], n), None
    if qtype in (T.Q4_K, T.Q5_K):
        sc, mn = _k_scales(b[..., 4:16])
        u8 = np.uint8
        return _f16(b[..., 0:2], n), sc.astype(u8).reshape(n, -1), -_f16(b[..., 2:4], n), mn.astype(u8).reshape(n, -1)
    return _f16(b[..., 208:210], n), b[..., 192:208].view(np.int8).reshape(n, -1), None, None  # Q6_K


def gpu_layout(data: np.ndarray, qtype: T, shape: tuple[int, int], device: torch.device) -> GGUFWeight:
    """GGUF blocks of a [N, K] weight (uint8 [N, bytes per row]) -> the GPU layout on device, exactly; rows go
    CHUNK_BYTES at a time (a 152k-row lm_head would otherwise take GBs of temporaries)."""
    n, k = shape
    per, nbytes = BLOCK[qtype]
    if k % per:
        raise ValueError(f"row length {k} is not a multiple of {qtype.name}'s block of {per}")
    b = np.asarray(data, dtype=np.uint8).reshape(n, k // per, nbytes)
    step = max(1, CHUNK_BYTES // (k // per * nbytes))
    chunks = []
    for r in range(0, n, step):
        q = _repack_blocks(b[r : r + step], qtype)[0]
        chunks.append(
            [None if a is None else torch.from_numpy(a).to(device) for a in (q, *_factors(b[r : r + step], qtype))]
        )
    parts = [None if c[0] is None else torch.cat(list(c)) for c in zip(*chunks)]
    return GGUFWeight(qtype.name, *parts, shape)


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
    """Every linear/embedding layer of a one-rank GPU model keeps its GGUF blocks (types in GPU_TYPES)."""

    def get_quant_method(self, layer: nn.Module) -> QuantizeMethodBase | None:
        if getattr(layer, "tp_size", 1) != 1:
            return None
        return GGUFGPULinearMethod()

