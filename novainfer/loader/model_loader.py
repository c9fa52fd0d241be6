"""Turns a model path (HF folder or .gguf file) into a loaded model; the path, config, tokenizer and eos ids
come from loader/model_info.py (re-exported here for the callers that load a model too)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from novainfer.distributed import ShardError
from novainfer.layers.quantization import QuantizationConfig, building_with
from novainfer.loader.kv_scales import take_kv_scales
from novainfer.loader.model_info import eos_token_ids, load_hf_config, load_tokenizer, resolve_model_path  # noqa: F401
from novainfer.models.registry import get_model_class

logger = logging.getLogger(__name__)
_build_lock = threading.Lock()  # the default dtype and device are process state; uni ranks build one at a time


def _iter_weights(model: str, keep_quantized: bool = False, keep_experts: bool = False):
    if model.endswith(".gguf"):
        from novainfer.loader.gguf_loader import count_gguf_weights, iter_gguf_weights

        return iter_gguf_weights(model, keep_quantized, keep_experts), count_gguf_weights(model)
    from novainfer.loader.safetensors_loader import count_safetensors_weights, iter_safetensors_weights

    return iter_safetensors_weights(model), count_safetensors_weights(model)


def load_model(
    model: str,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    quant_config: QuantizationConfig | None = None,
) -> nn.Module:
    """Build the model on device and fill every parameter through its weight_loader (load_format "dummy":
    random values in place, nothing read); with a quant_config its layers keep the checkpoint's GGUF blocks
    quantized (on the CPU) or quantize the weights once loaded or drawn (fp8).

    A weight the model needs but the checkpoint lacks fails here, naming it; so
    does one that cannot be sharded for this rank.
    """
    model_cls = get_model_class(hf_config)
    with _build_lock:
        prev_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device), building_with(quant_config):
                net = model_cls(hf_config)
        finally:
            torch.set_default_dtype(prev_dtype)
    if load_format == "dummy":
        return process_weights_after_loading(initialize_dummy_weights(net), quant_config).eval()
    keep_experts = quant_config is not None and quant_config.keeps_gguf_experts
    weights, total = _iter_weights(model, keep_quantized=quant_config is not None, keep_experts=keep_experts)
    bar = tqdm(weights, total=total, desc="Loading weights", unit="tensor", leave=False)
    current = [""]

    def named():
        for name, t in bar:
            current[0] = name
            # a quantized format's packed bytes, float8 weights and scales stay as stored
            integer = not getattr(t, "is_floating_point", lambda: True)()
            keep = integer or (quant_config is not None and quant_config.keeps_stored_dtype(name, t))
            yield name, t.to(device=device) if keep else t.to(device=device, dtype=dtype)

    try:
        missing = net.load_weights(take_kv_scales(net, named()))
    except ShardError as exc:
        raise exc.with_name(current[0]) from None
    if missing:
        raise ValueError(f"checkpoint {model} lacks weights the model needs: {', '.join(sorted(missing))}")
    return process_weights_after_loading(net, quant_config).eval()


def process_weights_after_loading(net: nn.Module, quant_config: QuantizationConfig | None = None) -> nn.Module:
    """Every quantized layer turns its loaded (or dummy-drawn) weight into its stored form (e.g. fp8), then the
    config places the model's stored weights as a whole."""
    for module in net.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    if quant_config is not None:
        quant_config.process_model_after_loading(net)
    return net


@torch.no_grad()
def initialize_dummy_weights(net: nn.Module, std: float = 0.02, seed: int = 0) -> nn.Module:
    """vLLM's dummy load format: matrices (and stacked experts) drawn from N(0, std^2) in place, biases zero,
    norm weights as their layers built them; every rank draws its own shards."""
    gen = torch.Generator(device=next(net.parameters()).device).manual_seed(seed)
    for name, param in net.named_parameters():
        if getattr(param, "draw_dummy", None) is not None:  # a quantized one draws its own (layers/quantization)
            param.draw_dummy(gen)
        elif name.endswith("bias"):
            param.zero_()
        elif param.dim() >= 2:
            param.normal_(0.0, std, generator=gen)
    for module in net.modules():  # a pre-quantized format's layers draw their weight and pack it as stored
        draw = getattr(getattr(module, "quant_method", None), "draw_dummy", None)
        if draw is not None:
            draw(module, std, gen)
    return net
