"""Quantization methods the linear and embedding layers call: GGUF blocks kept quantized on the CPU (gguf_cpu.py,
whose kernels are novainfer/kernels/cpu/), dynamic FP8 (fp8.py); selector.py picks one for a model."""

from novainfer.layers.quantization.base import (
    QuantizationConfig,
    QuantizeMethodBase,
    building_with,
    current_quant_config,
)

__all__ = ["QuantizationConfig", "QuantizeMethodBase", "building_with", "current_quant_config"]
