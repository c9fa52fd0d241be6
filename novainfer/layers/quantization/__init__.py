"""Quantized weights: GGUF blocks kept quantized on the CPU (see gguf_cpu.py and docs/ARCHITECTURE.md)."""
from novainfer.layers.quantization.base import (QuantizationConfig, QuantizeMethodBase, building_with,
                                                current_quant_config)

__all__ = ["QuantizationConfig", "QuantizeMethodBase", "building_with", "current_quant_config"]
