"""llama.cpp's `gpt-oss` GGUF files read back into the layout of transformers' gpt-oss checkpoints.

convert_hf_to_gguf.py (llama.cpp) writes gpt-oss with these changes, undone here:
  * the experts' gate_up (output rows interleaved: gate even, up odd) is split into ffn_gate_exps and ffn_up_exps
    (their biases likewise); they are interleaved back into gate_up_proj;
  * MXFP4 experts are stored as GGUF type MXFP4 [E, out, in] (per 32 weights the e8m0 byte, then 16 bytes with
    element i low and i + 16 high); they come back as gate_up_proj_blocks / _scales and down_proj_blocks / _scales
    (uint8, transformers' nibble order), bytes for bytes, and the config gets quantization_config
    {quant_method: mxfp4}, so the experts stay in four bits (layers/quantization/mxfp4.py);
  * experts of another type load dequantized as transformers' bf16 layout: gate_up_proj [E, hidden, 2I],
    down_proj [E, I, hidden];
  * the attention sinks are "attn_sinks.weight".
Every other tensor loads dequantized (float32): gpt-oss's experts are nearly all of its weights.
The metadata maps to a GptOssConfig; a gpt-oss.* key this reader does not know is refused, naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np

ARCH = "gpt-oss"
MXFP4 = 39  # GGMLQuantizationType.MXFP4
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias",
    "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
    **{
        f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}"
        for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
        for kind in ("weight", "bias")
    },
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
KNOWN_KEYS = {
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "vocab_size",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "attention.sliding_window",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
}
DENSE_MODULES = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": DENSE_MODULES}  # the released checkpoints'


def check_keys(metadata: dict[str, Any]) -> None:
    """Refuse, naming it, a gpt-oss.* key whose meaning this reader does not implement."""
    for key, value in metadata.items():
        if key.startswith(ARCH + ".") and key[len(ARCH) + 1 :] not in KNOWN_KEYS:
            raise NotImplementedError(f"GGUF metadata {key}={value!r} is not supported for {ARCH} files")


def experts_mxfp4(tensor_types: dict[str, int]) -> bool:
    """Whether every expert weight of the file is MXFP4 (then they stay so); else all load dequantized."""
    types = [t for name, t in tensor_types.items() if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight", name)]
    return bool(types) and all(t == MXFP4 for t in types)


def config_kwargs(field: Any, tensor_types: dict[str, int]) -> dict[str, Any]:
    """GptOssConfig keyword arguments from the gpt-oss.* metadata (field(key, default) reads it)."""
    a = ARCH
    head_dim = int(field(f"{a}.attention.key_length"))
    if int(field(f"{a}.attention.value_length", head_dim)) != head_dim:
        raise NotImplementedError(f"{a}.attention.value_length differs from {a}.attention.key_length={head_dim}")
    if int(field(f"{a}.rope.dimension_count", head_dim)) != head_dim:
        raise NotImplementedError(f"{a}.rope.dimension_count differs from {a}.attention.key_length={head_dim}")
    scaling = field(f"{a}.rope.scaling.type", "none")
    if scaling == "yarn":
        rope = {
            "rope_type": "yarn",
            "factor": float(field(f"{a}.rope.scaling.factor")),
            "original_max_position_embeddings": int(field(f"{a}.rope.scaling.original_context_length")),
            "beta_fast": float(field(f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(field(f"{a}.rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False,
        }
    elif scaling == "none":
        rope = {"rope_type": "default"}
    else:
        raise NotImplementedError(f"GGUF metadata {a}.rope.scaling.type={scaling!r} is not supported for {a} files")
    rope["rope_theta"] = float(field(f"{a}.rope.freq_base", 150000.0))
    kwargs = dict(
        head_dim=head_dim,
        num_local_experts=int(field(f"{a}.expert_count")),
        num_experts_per_tok=int(field(f"{a}.expert_used_count")),
        intermediate_size=int(field(f"{a}.expert_feed_forward_length")),
        sliding_window=int(field(f"{a}.attention.sliding_window")),
        rope_parameters=rope,
        rms_norm_eps=float(field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
    )
    if experts_mxfp4(tensor_types):
        kwargs["quantization_config"] = dict(QUANTIZATION_CONFIG)
    return kwargs


def ggml_to_hf(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """block_mxfp4 bytes [..., K/32 * 17] -> transformers' blocks uint8 [..., K/32, 16] and scales [..., K/32]
    (the inverse of kernels/cpu/repack.py's mxfp4_from_hf)."""
    b = data.reshape(*data.shape[:-1], -1, 17)
    qs = b[..., 1:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [..., 32] in element order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(b[..., 0])


def interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Rows (axis 1) gate[0], up[0], gate[1], up[1], ...: transformers' gate_up order."""
    return np.stack([gate, up], axis=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])


class GptOssTensors:
    """Undoes the converter's transforms on one file's tensors (see the module docstring)."""

    def __init__(self, config: Any):
        self.num_layers = config.num_hidden_layers
        self.mxfp4 = getattr(config, "quantization_config", None) is not None
        self._pending: dict[str, np.ndarray] = {}  # a layer's gate tensor until its up tensor comes

    def hf_name(self, gguf_name: str) -> str | None:
        if gguf_name in GLOBAL_NAMES:
            return GLOBAL_NAMES[gguf_name]
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
        if m and m.group(2) in LAYER_NAMES and int(m.group(1)) < self.num_layers:
            return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
        return None

    def count(self, name: str) -> int:
        """How many tensors fix() yields for this one (a gate part none: its up part yields the pair)."""
        if ".experts.gate_proj" in name:
            return 0
        return 2 if self.mxfp4 and name.endswith(("experts.up_proj", "experts.down_proj")) else 1

    def keep_quantized(self, name: str, shape: tuple[int, ...], block: int) -> bool:
        return False  # only the experts stay quantized, as raw MXFP4 (keep_raw)

    def keep_raw(self, name: str) -> bool:
        """Whether the loader hands this tensor's GGUF bytes as they are (an MXFP4 expert weight)."""
        return self.mxfp4 and name.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj"))

    def fix(self, name: str, data: np.ndarray, block: int = 1) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, array in transformers' layout) for one tensor."""
        prefix, _, part = name.rpartition(".experts.")
        if not prefix:
            yield name, data
            return
        if part.startswith("gate_proj"):
            self._pending[prefix + part] = data
            return
        if part == "down_proj_bias":
            yield name, data
            return
        if part == "up_proj_bias":
            yield f"{prefix}.experts.gate_up_proj_bias", interleave(self._pending.pop(prefix + "gate_proj_bias"), data)
            return
        gate = self._pending.pop(prefix + "gate_proj") if part == "up_proj" else None
        if self.mxfp4:  # raw bytes [E, rows, K/32 * 17]
            blocks, scales = ggml_to_hf(data)
            if gate is not None:
                gate_blocks, gate_scales = ggml_to_hf(gate)
                blocks, scales = interleave(gate_blocks, blocks), interleave(gate_scales, scales)
            hf = "down_proj" if gate is None else "gate_up_proj"
            yield f"{prefix}.experts.{hf}_blocks", blocks
            yield f"{prefix}.experts.{hf}_scales", scales
        elif gate is None:  # dequantized [E, hidden, I] -> transformers' [E, I, hidden]
            yield f"{prefix}.experts.down_proj", np.ascontiguousarray(data.transpose(0, 2, 1))
        else:  # [E, I, hidden] each -> [E, hidden, 2I]
            yield f"{prefix}.experts.gate_up_proj", np.ascontiguousarray(interleave(gate, data).transpose(0, 2, 1))
