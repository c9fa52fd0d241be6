"""Which quantization config a model is built with (ModelConfig.quantization, see config.py)."""

from __future__ import annotations

import logging

import torch

from novainfer.config import ModelConfig
from novainfer.layers.quantization.base import QuantizationConfig

logger = logging.getLogger(__name__)


def get_quant_config(mc: ModelConfig, device: torch.device, tp_size: int = 1) -> QuantizationConfig | None:
    """Fp8Config for quantization="fp8"; GGUFCPUConfig for a GGUF model on one CPU rank (unless dequantizing
    was asked for); Mxfp4Config for a checkpoint whose quantization_config says mxfp4; else None."""
    hf_quant = getattr(mc.hf_config, "quantization_config", None) or {}
    if not isinstance(hf_quant, dict):
        hf_quant = hf_quant.to_dict()
    if hf_quant.get("quant_method") == "mxfp4":
        from novainfer.layers.quantization.mxfp4 import Mxfp4Config

        return Mxfp4Config(hf_quant, device, mc.quantization)
    if mc.quantization == "fp8":
        return _fp8_config(mc, device)
    if not mc.is_gguf or device.type != "cpu" or tp_size != 1 or mc.quantization == "none":
        return None
    if mc.quantization is None and mc.torch_dtype == torch.float32:
        return None  # dtype="float32" keeps the exact dequantized path
    from novainfer.kernels.cpu import library

    if not library.available():
        return None  # the reason was logged by kernels/cpu/library.py
    from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig

    return GGUFCPUConfig()


def _fp8_config(mc: ModelConfig, device: torch.device) -> QuantizationConfig:
    """vLLM's dynamic FP8 for the dense linear layers; refused (ValueError) where it would not cover the model."""
    if mc.is_gguf:  # config validation refuses this for the target; a draft model is checked here
        raise ValueError(
            f"quantization='fp8' quantizes a bf16/fp16 checkpoint at load; {mc.model} is a GGUF file, quantized already"
        )
    experts = getattr(mc.hf_config, "num_experts", None) or getattr(mc.hf_config, "num_local_experts", None)
    if experts:
        raise ValueError(
            f"quantization='fp8' does not cover MoE experts yet ({mc.model} has {experts} experts "
            "per layer, which would stay unquantized); leave quantization unset"
        )
    from novainfer.layers.quantization.fp8 import Fp8Config

    return Fp8Config(device)
