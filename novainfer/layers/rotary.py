"""Rotary position embedding (neox layout, as Hugging Face Llama/Qwen), with the config's rope scaling.

Models whose layers differ in rope (Gemma 3: local and global bases) name a layer_type; the config then
holds one parameter set per layer type. LongRoPE (Phi-3) keeps a short and a long table.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from novainfer.kernels.cpu import ops as cpu_ops
from novainfer.layers.quantization import current_quant_config


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict:
    """The config's rope settings as one dict, for transformers 4 (rope_scaling) and 5 (rope_parameters);
    with a layer_type, that type's own set where the config keeps one per type."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _is_per_layer_type(hf_config: Any, layer_type: str | None) -> bool:
    return layer_type is not None and isinstance(
        (getattr(hf_config, "rope_parameters", None) or {}).get(layer_type), dict
    )


def compute_inv_freq(
    hf_config: Any, head_dim: int, layer_type: str | None = None, **init_kwargs: Any
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling factor, using transformers' rope formulas for scaled types."""
    params = rope_parameters(hf_config, layer_type)
    # proportional rope (Gemma 4) rotates the first part of the head only, by zero frequencies past it
    if params.get("partial_rotary_factor", 1.0) != 1.0 and params["rope_type"] != "proportional":
        raise NotImplementedError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported")
    if params["rope_type"] == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim)), 1.0
    if params["rope_type"] == "dynamic":
        raise NotImplementedError("dynamic rope scaling is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"rope_type {params['rope_type']!r} is not supported")
    if _is_per_layer_type(hf_config, layer_type):
        init_kwargs["layer_type"] = layer_type
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, torch.device("cpu"), **init_kwargs)
    return inv_freq.float(), float(scaling)


# cos/sin tables by (inv_freq, scaling, max_position, device): every layer of a model (and every model with the
# same rope) shares one table instead of holding its own copy (30 layers x 4 MB for the default model); an
# entry lives as long as some layer holds it
_TABLES: "weakref.WeakValueDictionary[tuple, torch.Tensor]" = weakref.WeakValueDictionary()


def _cos_sin(inv_freq: torch.Tensor, scaling: float, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    device = torch.get_default_device()
    key = (inv_freq.numpy().tobytes(), scaling, max_position, str(device))
    cos, sin = _TABLES.get(("cos", *key)), _TABLES.get(("sin", *key))
    if cos is None or sin is None:
        # tables are computed on the CPU (as transformers computes inv_freq), then moved to the model's device
        freqs = torch.arange(max_position, dtype=torch.float, device="cpu")[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * scaling).to(device), (emb.sin() * scaling).to(device)
        _TABLES[("cos", *key)], _TABLES[("sin", *key)] = cos, sin
    return cos, sin


class RotaryEmbedding(nn.Module):
    """Precomputes cos/sin for every position once; forward rotates q and k in place of copies."""

    def __init__(self, head_dim: int, max_position: int, hf_config: Any, layer_type: str | None = None):
        super().__init__()
        cos, sin = _cos_sin(*compute_inv_freq(hf_config, head_dim, layer_type), max_position)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        # the in-place C rotation of the quantized CPU path, for this class's own (single) table
        self.fused_cpu = type(self) is RotaryEmbedding and getattr(current_quant_config(), "fused_cpu_ops", False)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]. One Triton kernel on the GPU."""
        if q.is_cuda:
            from novainfer.kernels.fused_ops import rotary_embedding

            return rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache)
        if self.fused_cpu and cpu_ops.usable(q) and cpu_ops.usable(k) and self.cos_cache.dtype == torch.float32:
            cpu_ops.rotary_neox_(positions, q, k, self.cos_cache, self.sin_cache)
            return q, k
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """LongRoPE (Phi-3): a sequence uses the short factors while it is no longer than
    original_max_position_embeddings, the long ones once it is, as transformers decides per forward.

    The table holds the short rows, then the long rows; a token reads the long half when its sequence's last
    position in this step reaches the original length (a prompt longer than it is rotated with the long
    factors throughout, a decode step past it too). Keys cached earlier keep their rotation, as in
    transformers' cache. Chunked prefill decides per chunk (a first chunk that ends below the original
    length uses the short factors), and the core API's SLOT path per token."""

    def __init__(self, head_dim: int, max_position: int, hf_config: Any, layer_type: str | None = None):
        nn.Module.__init__(self)
        params = rope_parameters(hf_config, layer_type)
        self.original = int(
            params.get("original_max_position_embeddings") or getattr(hf_config, "original_max_position_embeddings")
        )
        self.max_position = max_position
        short_cos, short_sin = _cos_sin(*compute_inv_freq(hf_config, head_dim, layer_type), max_position)
        long_cos, long_sin = _cos_sin(
            *compute_inv_freq(hf_config, head_dim, layer_type, seq_len=self.original + 1), max_position
        )
        self.register_buffer("cos_cache", torch.cat([short_cos, long_cos]), persistent=False)
        self.register_buffer("sin_cache", torch.cat([short_sin, long_sin]), persistent=False)
        self.fused_cpu = False  # the C rotation reads one table; this one picks a half per sequence

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        from novainfer.attention.metadata import AttentionMetadata, get_attention_metadata

        meta = get_attention_metadata()
        if not isinstance(meta, AttentionMetadata):  # SLOT layout: no sequence lengths, per token
            last = positions
        elif meta.max_query_len == 1:  # decode (and its CUDA graphs): one token per sequence
            last = meta.seq_lens[: positions.shape[0]] - 1
        else:
            q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
            last = torch.repeat_interleave(meta.seq_lens - 1, q_lens, output_size=positions.shape[0])
        return super().forward(positions + (last >= self.original).to(positions.dtype) * self.max_position, q, k)


def get_rope(head_dim: int, max_position: int, hf_config: Any, layer_type: str | None = None) -> RotaryEmbedding:
    """The rotary module the config's rope type needs (vLLM's name)."""
    cls = (
        LongRopeRotaryEmbedding
        if rope_parameters(hf_config, layer_type)["rope_type"] == "longrope"
        else RotaryEmbedding
    )
    return cls(head_dim, max_position, hf_config, layer_type)
