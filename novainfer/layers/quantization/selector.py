"""Which quantization config a model is built with (ModelConfig.quantization, see config.py)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from novainfer.config import ModelConfig
from novainfer.layers.quantization.base import QuantizationConfig

logger = logging.getLogger(__name__)


def get_quant_config(mc: ModelConfig, device: torch.device, tp_size: int = 1) -> QuantizationConfig | None:
    """Fp8Config for quantization="fp8"; GGUFCPUConfig for a GGUF model on one CPU rank, GGUFGPUConfig on one
    GPU (unless dequantizing was asked for: quantization="none", or dtype float32); a pre-quantized checkpoint's
    own format (quantization_config, prequantized_config: MXFP4 experts also from a GGUF file); else None."""
    qc = getattr(mc.hf_config, "quantization_config", None)
    if qc is not None and (not mc.is_gguf or _quant_method(qc) == "mxfp4"):
        return prequantized_config(mc, qc, device)
    if mc.quantization == "fp8":
        return _fp8_config(mc, device)
    if not mc.is_gguf or mc.quantization == "none":
        return None
    if mc.quantization is None and mc.torch_dtype == torch.float32:
        return None  # dtype="float32" keeps the exact dequantized path
    if device.type == "cuda":
        return _gguf_gpu_config(tp_size)
    if device.type != "cpu" or tp_size != 1:
        return None
    from novainfer.kernels.cpu import library

    if not library.available():
        return None  # the reason was logged by kernels/cpu/library.py
    from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig

    return GGUFCPUConfig()


def _gguf_gpu_config(tp_size: int) -> QuantizationConfig | None:
    """GGUF blocks kept quantized on one GPU; with tensor parallelism the layers load dequantized (logged once)."""
    if tp_size != 1:
        logger.warning(
            "GGUF on %d GPUs: the weights load dequantized to the model's dtype (GGUF layers stay quantized on one "
            "GPU only)",
            tp_size,
        )
        return None
    from novainfer.layers.quantization.gguf_gpu import GGUFGPUConfig

    return GGUFGPUConfig()


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


def _as_dict(qc: Any) -> dict:
    """A config.json quantization_config as a dict (transformers may hand over its config object)."""
    return qc if isinstance(qc, dict) else qc.to_dict()


def _quant_method(qc: Any) -> str | None:
    return _as_dict(qc).get("quant_method")


def prequantized_config(mc: ModelConfig, qc: Any, device: torch.device) -> QuantizationConfig:
    """The config of a checkpoint quantized already (its config.json's quantization_config); ValueError naming
    the field where we do not implement it."""
    qc = _as_dict(qc)
    method = qc.get("quant_method")
    if method == "mxfp4":  # MoE experts in four bits (gpt-oss); the config refuses what it does not cover
        from novainfer.layers.quantization.mxfp4 import Mxfp4Config

        return Mxfp4Config(qc, device, mc.quantization)
    if mc.quantization not in (None, "none", method):
        raise ValueError(
            f"quantization={mc.quantization!r} was asked for, but {mc.model} is quantized already "
            f"(quantization_config.quant_method={method!r}); leave quantization unset"
        )
    if mc.quantization == "none":
        raise ValueError(f"quantization='none': {mc.model} is stored quantized (quant_method={method!r})")
    if method == "fp8":
        from novainfer.layers.quantization.fp8_block import fp8_block_config

        return fp8_block_config(qc, device)
    if method in ("gptq", "awq"):
        from novainfer.layers.quantization.int4 import Int4Config, int4_format

        return Int4Config(int4_format(qc), device)
    if method == "compressed-tensors":
        from novainfer.layers.quantization.compressed_tensors import ct_config

        return ct_config(qc, device)
    raise ValueError(
        f"quantization_config.quant_method={method!r} is not implemented (implemented: fp8 with "
        "weight_block_size, gptq, awq, compressed-tensors, mxfp4)"
    )
