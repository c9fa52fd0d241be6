"""llama.cpp's `gemma4` GGUF files (Gemma 4 dense with per-layer embeddings and KV sharing, and the MoE variant) read
back into the HF layout models/gemma4.py loads.

convert_hf_to_gguf.py (llama.cpp, as vendored by llama-cpp-python 0.3.36) writes the tensors unchanged (Gemma 4
stores its norms as w, not as an offset) under llama.cpp's names; what the config says it spreads over metadata and
tensors, read back here:
  * per-layer arrays: feed_forward_length (doubled on the KV-shared layers: use_double_wide_mlp) and head_count_kv
    (the sliding layers' count, and the full layers' num_global_key_value_heads);
  * key_length_swa / key_length: head_dim / global_head_dim; sliding_window_pattern: the layer types;
  * attention_k_eq_v: a full-attention layer that owns its KV and has no attn_v tensor;
  * the full layers' proportional rope: rope_freqs holds 1 for each rotated pair and 1e30 for the others, so
    partial_rotary_factor = 2 * (pairs at 1) / global_head_dim;
  * the router: ffn_gate_inp (proj), ffn_gate_inp.scale (scale), ffn_down_exps.scale (per_expert_scale, applied to
    the routing weights: the expert tensors themselves are as HF stores them); the experts' [E, 2I, H] gate_up
    stack (gate rows, then up) and [E, H, I] down stack, split here into one tensor per expert and projection:
    dequantized, or where the loader keeps experts (the one-GPU GGUF method: layers/quantization/gguf_moe.py) each
    expert's rows of blocks.
A gemma4.* metadata key this reader does not know is refused, naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from novainfer.loader.gguf_families import COMMON_KEYS, MOE_KEYS, SHARED_LAYER_NAMES

ARCH = "gemma4"
LAYER_NAMES = {
    **SHARED_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    # the MoE block beside the MLP
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
KNOWN_KEYS = (
    COMMON_KEYS
    | MOE_KEYS
    | {
        "final_logit_softcapping",
        "attention.sliding_window",
        "attention.sliding_window_pattern",
        "attention.shared_kv_layers",
        "attention.key_length_swa",
        "attention.value_length_swa",
        "embedding_length_per_layer_input",
        "rope.freq_base_swa",
        "rope.dimension_count_swa",
    }
)


def check_keys(metadata: dict[str, Any]) -> None:
    """Refuse, naming it, a gemma4.* key whose meaning this reader does not implement."""
    for key, value in metadata.items():
        if key.startswith(ARCH + ".") and key[len(ARCH) + 1 :] not in KNOWN_KEYS:
            raise NotImplementedError(f"GGUF metadata {key}={value!r} is not supported for {ARCH} files")


def _per_layer(value: Any, layers: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * layers


def config_kwargs(field: Any, shapes: dict[str, tuple[int, ...]], tensor: Any) -> dict[str, Any]:
    """Gemma4TextConfig keyword arguments from the file's gemma4.* metadata (field(key, default)), its tensors' HF
    shapes by name and, for the rope's rotated pairs, its rope_freqs tensor (tensor(name) -> float32 array or None)."""
    a = ARCH
    layers = int(field(f"{a}.block_count"))
    sliding = [bool(s) for s in field(f"{a}.attention.sliding_window_pattern")]
    shared = int(field(f"{a}.attention.shared_kv_layers", 0))
    head_dim, global_head_dim = int(field(f"{a}.attention.key_length_swa")), int(field(f"{a}.attention.key_length"))
    for key, want in (("value_length_swa", head_dim), ("value_length", global_head_dim)):
        if int(field(f"{a}.attention.{key}", want)) != want:
            raise NotImplementedError(f"{a}.attention.{key} differs from its key length {want}")
    if int(field(f"{a}.rope.dimension_count_swa", head_dim)) != head_dim:
        raise NotImplementedError(f"{a}.rope.dimension_count_swa: partial rope on sliding layers is not supported")
    kv_heads = _per_layer(field(f"{a}.attention.head_count_kv"), layers)
    ff = _per_layer(field(f"{a}.feed_forward_length"), layers)
    first_shared = layers - shared
    full = [i for i in range(first_shared) if not sliding[i]]
    freqs = tensor("rope_freqs.weight")
    rotated = global_head_dim if freqs is None else 2 * int((freqs == 1.0).sum())
    ple = int(field(f"{a}.embedding_length_per_layer_input", 0))
    kw: dict[str, Any] = dict(
        head_dim=head_dim,
        global_head_dim=global_head_dim,
        num_key_value_heads=kv_heads[sliding.index(True)] if any(sliding) else kv_heads[0],
        num_global_key_value_heads=kv_heads[full[0]] if full else None,
        attention_k_eq_v=bool(full) and all(f"blk.{i}.attn_v.weight" not in shapes for i in full),
        intermediate_size=ff[0],
        use_double_wide_mlp=shared > 0 and ff[first_shared] == 2 * ff[0],
        num_kv_shared_layers=shared,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        sliding_window=int(field(f"{a}.attention.sliding_window")),
        final_logit_softcapping=field(f"{a}.final_logit_softcapping"),
        hidden_size_per_layer_input=ple,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": float(field(f"{a}.rope.freq_base_swa", 1e4))},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": rotated / global_head_dim,
                "rope_theta": float(field(f"{a}.rope.freq_base", 1e6)),
            },
        },
    )
    bad = [i for i in range(layers) if ff[i] != ff[0] * (2 if kw["use_double_wide_mlp"] and i >= first_shared else 1)]
    if bad:
        raise NotImplementedError(f"{a}.feed_forward_length {ff}: layer {bad[0]} has a width Gemma 4 does not give it")
    if ple:
        kw["vocab_size_per_layer_input"] = shapes["per_layer_token_embd.weight"][0]
    experts = int(field(f"{a}.expert_count", 0))
    if experts:
        kw.update(
            enable_moe_block=True,
            num_experts=experts,
            top_k_experts=int(field(f"{a}.expert_used_count")),
            moe_intermediate_size=int(field(f"{a}.expert_feed_forward_length")),
        )
    return kw


class Gemma4Tensors:
    """Names a gemma4 file's tensors in HF terms and splits the expert stacks (module docstring)."""

    splits_experts = True  # fix() splits an [E, out, in] stack of blocks per expert as it splits a dense one

    def __init__(self, config: Any):
        self.num_experts = int(getattr(config, "num_experts", 0) or 0)

    def hf_name(self, gguf_name: str) -> str | None:
        """HF parameter name; None for rope_freqs (config instead)."""
        if gguf_name in GLOBAL_NAMES:
            return GLOBAL_NAMES[gguf_name]
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
        if m and m.group(2) in LAYER_NAMES:
            return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
        return None

    def count(self, name: str) -> int:
        """How many HF tensors fix() makes of this one (a gate_up stack: a gate and an up per expert)."""
        if name.endswith(".experts.gate_up_proj"):
            return 2 * self.num_experts
        return self.num_experts if name.endswith(".experts.down_proj") else 1

    def keep_quantized(self, name: str, shape: tuple[int, ...], block: int) -> bool:
        return True

    def fix(self, name: str, data: np.ndarray, block: int = 1) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, array): an expert stack (float32, or rows of blocks) one per expert and projection, the rest as
        stored."""
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            from novainfer.models.gemma4 import per_expert  # the model's own split (models import torch's layers)

            yield from per_expert(name, data)
        else:
            yield name, data
