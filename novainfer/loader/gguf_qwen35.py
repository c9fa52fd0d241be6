"""llama.cpp's `qwen35` / `qwen35moe` GGUF files (Qwen3.5 dense and MoE) read back into the HF layout
models/qwen3_5.py loads.

convert_hf_to_gguf.py (llama.cpp, as vendored by llama-cpp-python 0.3.36) writes a Qwen3.5 checkpoint with these
changes, undone here tensor by tensor:
  * every RMSNorm weight but the DeltaNet's gated norm is stored as 1 + w (HF stores the offset w);
  * linear_attn.A_log is stored as ssm_a = -exp(A_log); dt_bias as ssm_dt.bias; conv1d squeezed to [C, K];
  * with fewer key heads than value heads, the value heads are reordered from grouped by key head
    [k0v0, k0v1, k1v0, k1v1] to tiled [k0v0, k1v0, k0v1, k1v1]: the v rows of attn_qkv, the rows of attn_gate
    (in_proj_z), ssm_alpha / ssm_beta, the entries of ssm_a / ssm_dt, the v channels of ssm_conv1d and the
    columns of ssm_out (out_proj).
The MoE's [E, out, in] expert stacks split into one tensor per expert (the HF names): dequantized, or where the
loader keeps experts (the one-GPU GGUF method: layers/quantization/gguf_moe.py) each expert's rows of blocks, which
no transform touches.
Row permutations apply to quantized blocks as they are (a row's blocks move whole); a column permutation of
ssm_out moves whole blocks when a value head spans whole blocks, else that tensor loads dequantized.
The metadata maps to a Qwen3_5TextConfig; a qwen35.* key this reader does not know is refused, naming it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from novainfer.loader.gguf_families import COMMON_KEYS, MOE_KEYS, SHARED_LAYER_NAMES

logger = logging.getLogger(__name__)

ARCH = "qwen35"
ARCHS = ("qwen35", "qwen35moe")  # Qwen3.5 dense and MoE
# per-layer GGUF tensor (name before its ".weight"/".bias", or the whole name) -> HF name after "model.layers.N."
LAYER_NAMES = {
    **SHARED_LAYER_NAMES,
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    # qwen35moe: [E, ...] expert stacks (split per expert by fix), the router, the gated shared expert
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# stored as 1 + w by the converter
SHIFTED_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "model.norm.weight",
)
SMALL_ROWS = 16  # 2-D tensors of fewer output rows (ssm_alpha / ssm_beta) load dequantized

# qwen35.* metadata this reader maps (or checks); any other qwen35.* key is refused
KNOWN_KEYS = (
    COMMON_KEYS
    | MOE_KEYS
    | {
        "rope.dimension_sections",
        "ssm.conv_kernel",
        "ssm.state_size",
        "ssm.group_count",
        "ssm.time_step_rank",
        "ssm.inner_size",
        "attention.recurrent_layers",
        "full_attention_interval",
        "nextn_predict_layers",
    }
)


def hf_name(gguf_name: str, num_layers: int) -> str | None:
    """HF parameter name of a qwen35 tensor; None for tensors NovaInfer does not use (the MTP blocks past
    num_layers)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in LAYER_NAMES and int(m.group(1)) < num_layers:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
    return None


def check_keys(metadata: dict[str, Any]) -> None:
    """Refuse, naming it, a qwen35.* / qwen35moe.* key whose meaning this reader does not implement."""
    arch = metadata["general.architecture"]
    for key, value in metadata.items():
        if key.startswith(arch + ".") and key[len(arch) + 1 :] not in KNOWN_KEYS:
            raise NotImplementedError(f"GGUF metadata {key}={value!r} is not supported for {arch} files")


def config_kwargs(field: Any) -> dict[str, Any]:
    """Qwen3_5(Moe)TextConfig keyword arguments from the file's qwen35.* / qwen35moe.* metadata (field(key,
    default) reads it)."""
    a = field("general.architecture")
    nextn = int(field(f"{a}.nextn_predict_layers", 0))
    layers = int(field(f"{a}.block_count")) - nextn  # the MTP blocks follow the decoder's
    head_dim = int(field(f"{a}.attention.key_length"))
    if int(field(f"{a}.attention.value_length", head_dim)) != head_dim:
        raise NotImplementedError(
            f"{a}.attention.value_length={field(f'{a}.attention.value_length')} differs "
            f"from {a}.attention.key_length={head_dim}"
        )
    recurrent = list(field(f"{a}.attention.recurrent_layers"))[:layers]
    if len(recurrent) != layers:
        raise ValueError(f"{a}.attention.recurrent_layers lists {len(recurrent)} layers, expected {layers}")
    v_heads = int(field(f"{a}.ssm.time_step_rank"))
    rotary = int(field(f"{a}.rope.dimension_count", head_dim))
    # rope.dimension_sections (mRoPE) needs no handling: for text the three position rows are equal, and
    # interleaved mRoPE with equal rows is plain rotary over rope.dimension_count
    if a == "qwen35moe":
        mlp = {
            "num_experts": int(field(f"{a}.expert_count")),
            "num_experts_per_tok": int(field(f"{a}.expert_used_count")),
            "moe_intermediate_size": int(field(f"{a}.expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(field(f"{a}.expert_shared_feed_forward_length")),
        }
    else:
        mlp = {"intermediate_size": int(field(f"{a}.feed_forward_length"))}
    return dict(
        num_hidden_layers=layers,
        head_dim=head_dim,
        **mlp,
        layer_types=["linear_attention" if r else "full_attention" for r in recurrent],
        full_attention_interval=int(field(f"{a}.full_attention_interval", 4)),
        linear_conv_kernel_dim=int(field(f"{a}.ssm.conv_kernel")),
        linear_key_head_dim=int(field(f"{a}.ssm.state_size")),
        linear_num_key_heads=int(field(f"{a}.ssm.group_count")),
        linear_num_value_heads=v_heads,
        linear_value_head_dim=int(field(f"{a}.ssm.inner_size")) // v_heads,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(field(f"{a}.rope.freq_base", 1e7)),
            "partial_rotary_factor": rotary / head_dim,
        },
        hidden_act="silu",
    )


class Qwen35Tensors:
    """Undoes the converter's transforms on one file's tensors (see the module docstring)."""

    splits_experts = True  # fix() splits an [E, out, in] stack of blocks per expert as it splits a dense one

    def __init__(self, config: Any):
        self.nk, self.nv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_layers = config.num_hidden_layers
        self.num_experts = getattr(config, "num_experts", 0)

    def hf_name(self, gguf_name: str) -> str | None:
        return hf_name(gguf_name, self.num_layers)

    def count(self, name: str) -> int:
        """How many HF tensors fix() makes of this one (in_proj_qkv: its three shards)."""
        if ".mlp.experts." in name:
            return self.num_experts
        return 3 if name.endswith(".in_proj_qkv.weight") else 1

    def _grouped(self, width: int) -> np.ndarray:
        """Index map: position i of the HF (grouped) order reads position idx[i] of the file's tiled order."""
        if self.nv == self.nk:
            return np.arange(self.nv * width)
        r = self.nv // self.nk
        return np.arange(self.nv * width).reshape(r, self.nk, width).transpose(1, 0, 2).reshape(-1)

    def keep_quantized(self, name: str, shape: tuple[int, ...], block: int) -> bool:
        """Whether this 2-D tensor can stay quantized: not a small one, not the conv kernel (a plain parameter,
        reshaped here; F32 in llama.cpp's files, but an F16 one must not arrive as raw bytes), and ssm_out only if
        its column reorder moves whole blocks."""
        if shape[0] < SMALL_ROWS or name.endswith(".conv1d.weight"):
            return False
        if name.endswith("out_proj.weight") and self.nv != self.nk:
            return self.dv % block == 0
        return True

    def fix(self, name: str, data: np.ndarray, block: int = 1) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, array in HF layout) for one tensor: float32 in HF shape, or uint8 quantized rows (one row
        of blocks per output row, `block` elements a block)."""
        if name.endswith(SHIFTED_NORMS) and ".linear_attn." not in name:
            yield name, data - np.float32(1)
        elif name.endswith(".A_log"):
            yield name, np.log(-data[self._grouped(1)]).astype(np.float32)
        elif name.endswith((".dt_bias", ".in_proj_a.weight", ".in_proj_b.weight")):
            yield name, data[self._grouped(1)]
        elif name.endswith(".in_proj_z.weight"):
            yield name, data[self._grouped(self.dv)]
        elif name.endswith(".conv1d.weight"):  # [C, K] -> [C, 1, K], the v channels regrouped
            qk = 2 * self.nk * self.dk
            data = np.concatenate([data[:qk], data[qk:][self._grouped(self.dv)]])
            yield name, data.reshape(data.shape[0], 1, data.shape[-1])
        elif ".mlp.experts." in name:  # [E, out, in] (dequantized, or rows of blocks): one tensor per expert
            prefix, _, part = name.rpartition(".experts.")
            for e in range(data.shape[0]):
                yield f"{prefix}.experts.{e}.{part}", data[e]
        elif name.endswith(".in_proj_qkv.weight"):  # three shards of one fused parameter (in_proj_q/_k/_v)
            qk = self.nk * self.dk
            prefix = name[: -len("qkv.weight")]
            yield prefix + "q.weight", data[:qk]
            yield prefix + "k.weight", data[qk : 2 * qk]
            yield prefix + "v.weight", data[2 * qk :][self._grouped(self.dv)]
        elif name.endswith(".out_proj.weight") and self.nv != self.nk:
            if data.dtype == np.uint8:  # whole blocks per value head (keep_quantized checked)
                rows = data.shape[0]
                cols = self._grouped(self.dv // block)
                blocks = data.reshape(rows, cols.size, -1)
                yield name, np.ascontiguousarray(blocks[:, cols].reshape(rows, -1))
            else:
                yield name, np.ascontiguousarray(data[:, self._grouped(self.dv)])
        else:
            yield name, data
