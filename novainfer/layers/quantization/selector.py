"""Which quantization config a model is built with (ModelConfig.quantization, see config.py)."""
from __future__ import annotations

import logging

import torch

from novainfer.config import ModelConfig
from novainfer.layers.quantization.base import QuantizationConfig

logger = logging.getLogger(__name__)


def get_quant_config(mc: ModelConfig, device: torch.device, tp_size: int = 1) -> QuantizationConfig | None:
    """GGUFCPUConfig for a GGUF model on one CPU rank (unless dequantizing was asked for), else None."""
    if not mc.is_gguf or device.type != "cpu" or tp_size != 1 or mc.quantization == "none":
        return None
    if mc.quantization is None and mc.torch_dtype == torch.float32:
        return None  # dtype="float32" keeps the exact dequantized path
    from novainfer.layers.quantization import cpu_kernels
    if not cpu_kernels.available():
        return None  # the reason was logged by cpu_kernels
    from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig
    return GGUFCPUConfig(decoder_stack=mc.cpu_decode_stack)
