"""llama.cpp's GGUF files of Gemma 2, Gemma 3, Phi-3, Mixtral (and Mistral), Qwen2-MoE and Qwen3-MoE read back into
the HF layout the model files load.

What convert_hf_to_gguf.py (llama.cpp, as vendored by llama-cpp-python 0.3.36) changes, undone here tensor by
tensor, and what llama.cpp assumes where the file says nothing:
  * Gemma 2 / 3 store every RMSNorm weight as 1 + w (HF stores the offset w); their pre-feed-forward norm is
    ffn_norm and the post-norms post_attention_norm / post_ffw_norm. The file has no query_pre_attn_scalar:
    llama.cpp scales queries by 1/sqrt(head_dim), by 1/sqrt(hidden/heads) for the 27B shapes (46 and 62 layers);
    the sliding layers follow sliding_window_pattern, else llama.cpp's default (every 2nd layer of Gemma 2 full,
    every 6th of Gemma 3).
  * Phi-3 fuses attn_qkv (q, k, v rows) and ffn_up (gate rows, then up rows); LongRoPE's factors are the tensors
    rope_factors_short / rope_factors_long. llama.cpp ignores Phi-3's sliding window; NovaInfer keeps the HF
    model's (the file records it).
  * Mistral and Mixtral are written as `llama` (q / k rows permuted, undone by gguf_loader); Mixtral's experts
    and every MoE family's are [E, out, in] stacks (ffn_gate_exps / ffn_up_exps / ffn_down_exps), split here
    into one tensor per expert: dequantized, or where the loader keeps experts (the one-GPU GGUF method:
    layers/quantization/gguf_moe.py) each expert's rows of blocks; Qwen2-MoE's shared-expert gate is a [H, 1] column.
  * Qwen3-MoE renormalises the top-k routing weights, Qwen2-MoE does not (as llama.cpp's graphs).
An <arch>.* metadata key this reader does not know is refused, naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np

# GGUF architecture -> (HF architecture, transformers config class name); `llama` with experts is Mixtral
ARCHITECTURES = {
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
}
MIXTRAL = ("MixtralForCausalLM", "MixtralConfig")

# per-layer GGUF tensor (name before ".weight"/".bias") -> HF module after "model.layers.N."
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: split by fix
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",  # Gemma: pre_feedforward_layernorm (GEMMA_NAMES)
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",  # Phi-3: gate and up rows, split by fix
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",  # [E, out, in]: split per expert by fix
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# per-layer tensors the newer families' readers (gguf_qwen35, gguf_gemma4) name alike: GGUF name after "blk.N." ->
# HF name after "model.layers.N."
SHARED_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GEMMA_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
MIXTRAL_EXPERTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

COMMON_KEYS = {
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "vocab_size",
}
MOE_KEYS = {"expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length"}
KNOWN_KEYS = {
    "llama": COMMON_KEYS | MOE_KEYS,
    "gemma2": COMMON_KEYS
    | {"attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window", "rope.freq_base_swa"},
    "gemma3": COMMON_KEYS
    | {
        "final_logit_softcapping",
        "attention.sliding_window",
        "attention.sliding_window_pattern",
        "rope.freq_base_swa",
        "rope.scaling.type",
        "rope.scaling.factor",
    },
    "phi3": COMMON_KEYS
    | {"attention.sliding_window", "rope.scaling.attn_factor", "rope.scaling.original_context_length"},
    "qwen2moe": COMMON_KEYS | MOE_KEYS,
    "qwen3moe": COMMON_KEYS | MOE_KEYS,
}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's 27B: queries scaled by 1/sqrt(hidden / heads)
DEFAULT_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's default: layer i slides unless i % n == n - 1


def handles(arch: str, metadata: dict[str, Any]) -> bool:
    """Whether this module reads the file: a family it maps, or a `llama` file with experts (Mixtral)."""
    return arch in ARCHITECTURES or (arch == "llama" and int(metadata.get("llama.expert_count", 0) or 0) > 0)


def architecture(arch: str, metadata: dict[str, Any]) -> tuple[str, str]:
    """(HF architecture, transformers config class name) of a file this module reads."""
    return MIXTRAL if arch == "llama" else ARCHITECTURES[arch]


def check_keys(metadata: dict[str, Any]) -> None:
    """Refuse, naming it, an <arch>.* key whose meaning this reader does not implement."""
    arch = metadata["general.architecture"]
    for key, value in metadata.items():
        if key.startswith(arch + ".") and key[len(arch) + 1 :] not in KNOWN_KEYS[arch]:
            raise NotImplementedError(f"GGUF metadata {key}={value!r} is not supported for {arch} files")


def _layer_types(field: Any, arch: str, layers: int) -> list[str]:
    """Sliding / full per layer: the file's sliding_window_pattern (a period or a per-layer list), else llama.cpp's
    default for the family."""
    pattern = field(f"{arch}.attention.sliding_window_pattern", DEFAULT_SWA_PATTERN[arch])
    if isinstance(pattern, (list, tuple)):
        sliding = [bool(s) for s in pattern][:layers]
    else:
        sliding = [int(pattern) > 0 and i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def config_kwargs(field: Any, tensor: Any) -> dict[str, Any]:
    """Config keyword arguments beyond gguf_loader's common ones, from the file's metadata (field(key, default))
    and, for Phi-3's LongRoPE factors, its tensors (tensor(name) -> float32 array or None)."""
    a = field("general.architecture")
    layers = int(field(f"{a}.block_count"))
    hidden, heads = int(field(f"{a}.embedding_length")), int(field(f"{a}.attention.head_count"))
    head_dim = int(field(f"{a}.attention.key_length", hidden // heads))
    if int(field(f"{a}.attention.value_length", head_dim)) != head_dim:
        raise NotImplementedError(f"{a}.attention.value_length differs from {a}.attention.key_length={head_dim}")
    kw: dict[str, Any] = {"intermediate_size": int(field(f"{a}.feed_forward_length", 0))}
    experts = int(field(f"{a}.expert_count", 0))
    if experts:
        kw["num_local_experts" if a == "llama" else "num_experts"] = experts
        kw["num_experts_per_tok"] = int(field(f"{a}.expert_used_count"))
    if a in ("qwen2moe", "qwen3moe"):
        kw["moe_intermediate_size"] = int(field(f"{a}.expert_feed_forward_length"))
        kw["norm_topk_prob"] = a == "qwen3moe"
    if a == "qwen2moe":
        kw.update(
            shared_expert_intermediate_size=int(field(f"{a}.expert_shared_feed_forward_length")),
            mlp_only_layers=[],
            decoder_sparse_step=1,
        )
    if a in ("gemma2", "gemma3"):
        big = layers == GEMMA_27B_LAYERS[a]
        kw.update(
            query_pre_attn_scalar=hidden // heads if big else head_dim,
            sliding_window=int(field(f"{a}.attention.sliding_window", 4096)),
            layer_types=_layer_types(field, a, layers),
            final_logit_softcapping=field(f"{a}.final_logit_softcapping"),
            hidden_activation="gelu_pytorch_tanh",
        )
    if a == "gemma2":
        kw["attn_logit_softcapping"] = field(f"{a}.attn_logit_softcapping")
        base = float(field(f"{a}.rope.freq_base", 10000.0))
        if float(field(f"{a}.rope.freq_base_swa", base)) != base:
            raise NotImplementedError(f"{a}.rope.freq_base_swa differs from {a}.rope.freq_base")
    if a == "gemma3":
        full = {"rope_type": "default", "rope_theta": float(field(f"{a}.rope.freq_base", 1e6))}
        scaling = field(f"{a}.rope.scaling.type", "none")
        if scaling == "linear":
            full.update(rope_type="linear", factor=float(field(f"{a}.rope.scaling.factor")))
        elif scaling != "none":
            raise NotImplementedError(f"{a}.rope.scaling.type={scaling!r} is not supported for gemma3 files")
        sliding = {"rope_type": "default", "rope_theta": float(field(f"{a}.rope.freq_base_swa", 10000.0))}
        kw["rope_parameters"] = {"full_attention": full, "sliding_attention": sliding}
    if a == "phi3":
        rotary = int(field(f"{a}.rope.dimension_count", head_dim))
        window = field(f"{a}.attention.sliding_window")
        kw.update(partial_rotary_factor=rotary / head_dim, sliding_window=int(window) if window else None)
        short, long = tensor("rope_factors_short.weight"), tensor("rope_factors_long.weight")
        if short is not None and long is not None:
            kw["original_max_position_embeddings"] = int(field(f"{a}.rope.scaling.original_context_length"))
            kw["rope_scaling"] = {
                "rope_type": "longrope",
                "short_factor": [float(x) for x in short],
                "long_factor": [float(x) for x in long],
            }
    return kw


class FamilyTensors:
    """Names a family's GGUF tensors in HF terms and undoes its converter's transforms (module docstring)."""

    splits_experts = True  # fix() splits an [E, out, in] stack of blocks per expert as it splits a dense one

    def __init__(self, arch: str, config: Any):
        self.arch, self.config = arch, config
        self.num_experts = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0)
        self.gemma = arch in ("gemma2", "gemma3")

    def hf_name(self, gguf_name: str) -> str | None:
        """HF parameter name (fused ones as the family's HF checkpoint names them); None for tensors with no
        parameter (rope_freqs, rope_factors_*: config instead)."""
        base, _, suffix = gguf_name.rpartition(".")
        if base in GLOBAL_NAMES:
            return f"{GLOBAL_NAMES[base]}.{suffix}"
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if m is None:
            return None
        part = (GEMMA_NAMES if self.gemma else {}).get(m.group(2)) or LAYER_NAMES.get(m.group(2))
        if part is None:
            return None
        if self.arch == "phi3" and part == "mlp.up_proj":
            part = "mlp.gate_up_proj"
        return f"model.layers.{m.group(1)}.{part}.{suffix}"

    def count(self, name: str) -> int:
        """How many HF tensors fix() makes of this one."""
        if ".mlp.experts." in name:
            return self.num_experts
        return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1

    def keep_quantized(self, name: str, shape: tuple[int, ...], block: int) -> bool:
        """Every 2-D tensor of a repackable type stays quantized (row splits move whole rows of blocks)."""
        return True

    def fix(self, name: str, data: np.ndarray, block: int = 1) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, array in HF layout): float32 in HF shape, or uint8 quantized rows (one row of blocks per output
        row)."""
        c = self.config
        if self.gemma and name.endswith("norm.weight"):
            yield name, data - np.float32(1)
        elif ".mlp.experts." in name:  # [E, out, in] (dequantized, or rows of blocks): one tensor per expert
            prefix, _, part = name.rpartition(".experts.")
            proj = part.split(".")[0]
            if self.arch == "llama":  # Mixtral: block_sparse_moe.experts.E.w1/w2/w3
                prefix, part = prefix.replace(".mlp", ".block_sparse_moe"), part.replace(proj, MIXTRAL_EXPERTS[proj])
            for e in range(data.shape[0]):
                yield f"{prefix}.experts.{e}.{part}", data[e]
        elif self.arch == "llama" and name.endswith(".mlp.gate.weight"):
            yield name.replace(".mlp.", ".block_sparse_moe."), data
        elif name.endswith(".shared_expert_gate.weight"):
            yield name, data.reshape(1, -1)
        elif ".qkv_proj." in name:
            q = c.num_attention_heads * (data.shape[0] // (c.num_attention_heads + 2 * c.num_key_value_heads))
            kv = (data.shape[0] - q) // 2
            for part, rows in (("q_proj", data[:q]), ("k_proj", data[q : q + kv]), ("v_proj", data[q + kv :])):
                yield name.replace(".qkv_proj.", f".{part}."), rows
        elif ".gate_up_proj." in name:
            half = data.shape[0] // 2
            yield name.replace(".gate_up_proj.", ".gate_proj."), data[:half]
            yield name.replace(".gate_up_proj.", ".up_proj."), data[half:]
        else:
            yield name, data
