"""An fp8 KV cache's per-layer scales from the checkpoint, as vLLM and compressed-tensors name them:
`<attn>.k_scale` / `<attn>.v_scale`, the older `<attn>.kv_scale` (both), and compressed-tensors' earlier
`<attn>.k_proj.output_scale` / `<attn>.v_proj.output_scale`. Each is one float32 per layer, which the layer's
Attention module reads (a cache of another dtype ignores it)."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from novainfer.layers.attention import Attention

_SUFFIXES = {
    ".k_scale": ("k_scale",),
    ".v_scale": ("v_scale",),
    ".kv_scale": ("k_scale", "v_scale"),
    ".k_proj.output_scale": ("k_scale",),
    ".v_proj.output_scale": ("v_scale",),
}


def take_kv_scales(net: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights, less the KV-cache scales, which are set on the Attention layer under the module they name."""
    modules = dict(net.named_modules())
    for name, tensor in weights:
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        attn = _attention_under(modules, name[: -len(suffix)])
        if attn is None:
            raise ValueError(f"checkpoint KV-cache scale {name!r} belongs to no attention layer of the model")
        if tensor.numel() != 1:
            raise ValueError(
                f"checkpoint KV-cache scale {name!r} has shape {tuple(tensor.shape)}: only per-tensor scales "
                "(one per layer) are supported"
            )
        value = float(tensor.float().item())
        if not value > 0:
            raise ValueError(f"checkpoint KV-cache scale {name!r} is {value}, not positive")
        for attr in _SUFFIXES[suffix]:
            setattr(attn, attr, value)


def _attention_under(modules: dict[str, nn.Module], prefix: str) -> Attention | None:
    """The Attention layer at prefix or among its direct children (self_attn.attn)."""
    module = modules.get(prefix)
    if isinstance(module, Attention) or module is None:
        return module
    return next((m for m in module.children() if isinstance(m, Attention)), None)
