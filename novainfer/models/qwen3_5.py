"""Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next: hybrid decoders of Gated DeltaNet layers (linear attention,
layers/linear_attention.py) and gated full-attention layers, as config.layer_types lists them (3 to 1).

The full-attention layer is Qwen3's with three changes: q_proj yields each head's query and a gate (the output is
multiplied by sigmoid(gate) before o_proj), rotary covers only the first partial_rotary_factor of each head (the
mRoPE sections reduce to plain rotary for text, whose three position rows are equal), and every RMSNorm but the
DeltaNet's gated one stores its weight as an offset from one. MoE layers route top-k with a sigmoid-gated shared
expert (models/moe.py). Qwen3-Next ships the DeltaNet input projections fused per key-head group
(in_proj_qkvz, in_proj_ba); they are split into Qwen3.5's layout on load. mtp.* weights (the multi-token
prediction head) are not used; a ForConditionalGeneration checkpoint loads its language model only.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from novainfer.layers.attention import Attention
from novainfer.layers.layernorm import GemmaRMSNorm
from novainfer.layers.linear import QKVParallelLinear, RowParallelLinear
from novainfer.layers.linear_attention import GatedDeltaNet
from novainfer.layers.rotary import RotaryEmbedding, _cos_sin, rope_parameters
from novainfer.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from novainfer.models.moe import MoeForCausalLM, SparseMoeBlock
from novainfer.models import qwen3_5_cpu_decode as cpu_decode
from novainfer.models.qwen2_moe import is_sparse_layer

logger = logging.getLogger(__name__)

LINEAR, FULL = "linear_attention", "full_attention"
# prefixes of checkpoint tensors a text-only model does not use
SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.")


def is_hybrid(hf_config: Any) -> bool:
    """Whether the config has linear-attention layers (their per-sequence state needs state slots)."""
    return LINEAR in (getattr(hf_config, "layer_types", None) or [])


class PartialRotaryEmbedding(RotaryEmbedding):
    """Neox rotary over the first rotary_dim of each head; the rest passes through."""

    def __init__(self, head_dim: int, max_position: int, hf_config: Any):
        nn.Module.__init__(self)
        params = rope_parameters(hf_config)
        if params["rope_type"] != "default":
            raise NotImplementedError(
                f"rope_parameters.rope_type={params['rope_type']!r} is not supported "
                "for Qwen3.5/Qwen3-Next (only 'default')"
            )
        self.rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        base = params["rope_theta"]
        steps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float, device="cpu")  # the tables start on the CPU
        inv_freq = 1.0 / (base ** (steps / self.rotary_dim))
        cos, sin = _cos_sin(inv_freq, 1.0, max_position)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        self.fused_cpu = False

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if q.is_cuda:  # one Triton kernel (the same roundings as below)
            from novainfer.kernels.fused_ops import rotary_embedding

            return rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache, self.rotary_dim)
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        d = self.rotary_dim
        q = torch.cat([self._rotate(q[..., :d], cos, sin), q[..., d:]], dim=-1)
        k = torch.cat([self._rotate(k[..., :d], cos, sin), k[..., d:]], dim=-1)
        return q, k


class GatedAttention(nn.Module):
    """Full attention whose q_proj holds, per head, the query then a gate of the same size."""

    def __init__(self, config: Any):
        super().__init__()
        self.head_dim = config.head_dim
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        # 2 * num_heads "heads" of head_dim: each head's query and gate are adjacent, so ranks get whole pairs
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, 2 * num_heads, num_kv_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = 2 * self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = PartialRotaryEmbedding(self.head_dim, config.max_position_embeddings, config)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(hidden_states)))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The attention output times sigmoid(gate), [tokens, heads * head_dim], from qkv_proj's output."""
        out, gate = self.attend_ungated(positions, qkv)
        return out * torch.sigmoid(gate.reshape(out.shape))

    def attend_ungated(self, positions: torch.Tensor, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention output [tokens, heads * head_dim], the gate [tokens, heads, head_dim]: a view of qkv) from
        qkv_proj's output; the batch-1 GPU stack multiplies them in its o_proj GEMV's prologue."""
        qg, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.reshape(-1, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if qkv.is_cuda:  # q/k norms and rotary in one kernel
            from novainfer.kernels.fused_ops import qk_norm_rope

            rope = self.rotary_emb
            q, k = qk_norm_rope(
                positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                rope.cos_cache, rope.sin_cache, rope.rotary_dim,
            )  # fmt: skip
        else:
            q, k = self.rotary_emb(positions, self.q_norm(q), self.k_norm(k))
        out = self.attn(q.contiguous(), k.contiguous(), v.contiguous())
        return out, gate


class HybridDecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose token mixer is linear_attn (Gated DeltaNet) or self_attn (gated attention)."""

    def __init__(self, config: Any, layer_type: str, mlp: nn.Module):
        self.is_linear = layer_type == LINEAR
        mixer = GatedDeltaNet(config) if self.is_linear else GatedAttention(config)
        super().__init__(config, mixer, mlp, norm_cls=GemmaRMSNorm)
        if self.is_linear:  # the checkpoint's name for this mixer
            del self.self_attn
            self.linear_attn = mixer

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        if self.is_linear and (step := self.linear_attn.cpu_decode_step(hidden_states)) is not None:
            kernel = cpu_decode.gdn_decoder_kernel(self)
            if kernel is not None:  # a CPU decode step: the whole layer in one C call
                return kernel.run_layer(hidden_states, residual, *step)
        if not self.is_linear and (meta := cpu_decode.decode_meta(hidden_states)) is not None:
            kernel = cpu_decode.gated_attn_kernel(self)
            done = None if kernel is None else kernel.run(hidden_states, residual, positions, meta)
            if done is not None:  # (None: a bad KV index, which the layers' own ops report)
                return done
        hidden_states, residual = self.input_norm(hidden_states, residual)
        if self.is_linear:
            hidden_states = self.linear_attn(hidden_states)
        else:
            hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3_5ForCausalLM(MoeForCausalLM):
    """Qwen3.5 dense; the MoE and Qwen3-Next subclasses change the MLP plan and the projection layout."""

    moe = False
    weight_prefix = ""  # ForConditionalGeneration: "model.language_model." in place of "model."

    # in_proj_qkv is one checkpoint tensor; split_fused_weights cuts it into q, k and v for the rank's shards
    packed_modules_mapping = {
        **MoeForCausalLM.packed_modules_mapping,
        "in_proj_q": ("in_proj_qkv", 0),
        "in_proj_k": ("in_proj_qkv", 1),
        "in_proj_v": ("in_proj_qkv", 2),
    }

    def __init__(self, config: Any):
        check_hybrid_config(config)
        super().__init__(config)

    def make_model(self, config: Any) -> LlamaModel:
        return LlamaModel(config, self.make_layer, norm_cls=GemmaRMSNorm)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        return HybridDecoderLayer(config, config.layer_types[layer_idx], self.make_mlp(config, layer_idx))

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        act = getattr(config, "hidden_act", "silu")
        if not self.moe or not self.sparse_layer(config, layer_idx):
            return LlamaMLP(config.hidden_size, config.intermediate_size, act)
        return SparseMoeBlock(
            config, config.moe_intermediate_size, self.renormalize(config), config.shared_expert_intermediate_size
        )

    def sparse_layer(self, config: Any, layer_idx: int) -> bool:
        """Whether the layer's MLP is the MoE block (for an MoE model)."""
        return True

    def renormalize(self, config: Any) -> bool:
        """Whether the top-k routing weights are renormalised to sum to one."""
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The language model's tensors through the Llama routing; see _language_model_weights."""
        return super().load_weights(self._language_model_weights(weights))

    def _language_model_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator:
        """The checkpoint's language-model tensors under our names; the rest skipped, the vision tower with
        one log line."""
        skipped_vision = 0
        for name, tensor in weights:
            if self.weight_prefix and name.startswith(self.weight_prefix):
                name = "model." + name[len(self.weight_prefix) :]
            if name.startswith(SKIPPED_PREFIXES):
                skipped_vision += "visual." in name
                continue
            yield name, tensor
        if skipped_vision:
            logger.info("skipped %d vision-tower weights: the model runs as a language model", skipped_vision)

    def split_fused_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """in_proj_qkv into its q, k and v parts; Qwen3-Next's per-key-head-group in_proj_qkvz / in_proj_ba into
        Qwen3.5's separate projections first."""
        c = self.config
        nk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
        rep = c.linear_num_value_heads // nk
        for name, tensor in weights:
            if name.endswith(".in_proj_qkvz.weight"):
                q, k, v, z = tensor.view(nk, 2 * dk + 2 * rep * dv, -1).split([dk, dk, rep * dv, rep * dv], dim=1)
                prefix = name[: -len("qkvz.weight")]
                for part, x in zip("qkvz", (q, k, v, z)):
                    yield f"{prefix}{part}.weight", x.reshape(-1, tensor.shape[-1])
            elif name.endswith(".in_proj_ba.weight"):
                b, a = tensor.view(nk, 2 * rep, -1).split([rep, rep], dim=1)
                prefix = name[: -len("ba.weight")]
                yield prefix + "b.weight", b.reshape(-1, tensor.shape[-1])
                yield prefix + "a.weight", a.reshape(-1, tensor.shape[-1])
            elif name.endswith(".in_proj_qkv.weight"):
                prefix = name[: -len("qkv.weight")]
                for part, x in zip("qkv", tensor.split([nk * dk, nk * dk, nk * rep * dv])):
                    yield f"{prefix}{part}.weight", x
            else:
                yield name, tensor


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 MoE: every layer's MLP is sparse, top-k weights renormalised, with a gated shared expert."""

    moe = True


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: fused DeltaNet projections; sparse layers as Qwen2-MoE decides them (decoder_sparse_step,
    mlp_only_layers), norm_topk_prob from the config."""

    moe = True

    def sparse_layer(self, config: Any, layer_idx: int) -> bool:
        return is_sparse_layer(config, layer_idx)

    def renormalize(self, config: Any) -> bool:
        return bool(config.norm_topk_prob)


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """A Qwen3.5 vision-language checkpoint run as its language model (the config is its text_config)."""

    weight_prefix = "model.language_model."


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    weight_prefix = "model.language_model."


def check_hybrid_config(config: Any) -> None:
    """Refuse, naming the field, what these models do not implement."""
    types = list(getattr(config, "layer_types", None) or [])
    unknown = sorted(set(types) - {LINEAR, FULL})
    if unknown or len(types) != config.num_hidden_layers:
        raise NotImplementedError(
            f"layer_types={types}: expected {config.num_hidden_layers} entries of {LINEAR!r} / {FULL!r}"
        )
    for field in ("sliding_window", "use_sliding_window"):
        if getattr(config, field, None):
            raise NotImplementedError(f"{field}={getattr(config, field)!r} is not supported for Qwen3.5/Qwen3-Next")
    if getattr(config, "attn_output_gate", True) is not True:  # vLLM's name: q_proj without the gate half
        raise NotImplementedError(
            f"attn_output_gate={config.attn_output_gate!r} is not supported (the full-attention layers are gated)"
        )
