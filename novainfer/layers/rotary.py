"""Rotary position embedding (neox layout, as Hugging Face Llama/Qwen), with the config's rope scaling."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_parameters(hf_config: Any) -> dict:
    """The config's rope settings as one dict, for transformers 4 (rope_scaling) and 5 (rope_parameters)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def compute_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling factor, using transformers' rope formulas for scaled types."""
    params = rope_parameters(hf_config)
    if params["rope_type"] == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim)), 1.0
    if params["rope_type"] == "dynamic":
        raise NotImplementedError("dynamic rope scaling is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"rope_type {params['rope_type']!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Precomputes cos/sin for every position once; forward rotates q and k in place of copies."""

    def __init__(self, head_dim: int, max_position: int, hf_config: Any):
        super().__init__()
        # tables are computed on the CPU (as transformers computes inv_freq), then moved to the model's device
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim)
        freqs = torch.arange(max_position, dtype=torch.float, device="cpu")[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        device = torch.get_default_device()
        self.register_buffer("cos_cache", (emb.cos() * scaling).to(device), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scaling).to(device), persistent=False)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]. One Triton kernel on the GPU."""
        if q.is_cuda:
            from novainfer.kernels.fused_ops import rotary_embedding
            return rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache)
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
