"""Where a Qwen3.5 / Qwen3-Next decoder layer's CPU decode step runs as one C call (kernels/cpu/gdn_layer.py for the
Gated DeltaNet layers, kernels/cpu/gated_attn_layer.py for the gated-attention ones): the checks of a layer's
pieces (exactly the classes the C calls compute), of the step (a plain decode step over the paged cache), and each
layer's kernel, decided once and rebuilt when the runner binds another state pool or KV cache."""

from __future__ import annotations

import torch
from torch import nn

from novainfer.attention import cpu_backend
from novainfer.attention.metadata import AttentionMetadata, get_attention_metadata
from novainfer.kernels.cpu import gated_attn_layer, gdn_layer
from novainfer.kernels.cpu.decoder_stack import packed_weight
from novainfer.layers.activation import SiluAndMul
from novainfer.layers.layernorm import GemmaRMSNorm
from novainfer.models.llama import LlamaMLP


def _plain_packed(linear: nn.Module) -> bool:
    """Packed weights the C calls read, without a bias, on one rank."""
    return packed_weight(linear) is not None and linear.bias is None and linear.tp_size == 1


def norms_and_mlp_supported(decoder: nn.Module, norms: tuple[nn.Module, ...]) -> bool:
    """float32 offset (Gemma-style) norms on the fused CPU path and a dense SiLU MLP of packed weights without
    biases on one rank: the parts both C calls compute around their token mixer."""
    mlp = decoder.mlp
    if any(type(n) is not GemmaRMSNorm or not n.fused_cpu or n.weight.dtype is not torch.float32 for n in norms):
        return False
    if type(mlp) is not LlamaMLP or type(mlp.act_fn) is not SiluAndMul or not mlp.act_fn.fused_cpu:
        return False
    return all(_plain_packed(lin) for lin in (mlp.gate_up_proj, mlp.down_proj))


def gdn_decoder_kernel(decoder: nn.Module) -> gdn_layer.GDNLayerKernel | None:
    """The DeltaNet decoder layer's whole-layer kernel, or None (its mixer may still run in C alone)."""
    whole = decoder.__dict__.get("_c_whole")
    if whole is None:
        whole = norms_and_mlp_supported(decoder, (decoder.input_layernorm, decoder.post_attention_layernorm))
        decoder.__dict__["_c_whole"] = whole
    return gdn_layer.layer_kernel(decoder.linear_attn, decoder) if whole else None


def gated_attn_supported(decoder: nn.Module) -> bool:
    """Whether the C call computes this gated-attention decoder layer: packed projections, the offset norms (q / k
    too), a dense SiLU MLP, plain full attention over the CPU backend's contiguous bf16 cache."""
    sa = decoder.self_attn
    a, rope = sa.attn, sa.rotary_emb
    norms = (decoder.input_layernorm, decoder.post_attention_layernorm, sa.q_norm, sa.k_norm)
    if not gated_attn_layer.available() or not norms_and_mlp_supported(decoder, norms):
        return False
    if any(not _plain_packed(lin) for lin in (sa.qkv_proj, sa.o_proj)):
        return False
    if a.sliding_window or a.logits_soft_cap or a.sinks is not None or a.kv_source is not None:
        return False
    return (
        a.backend is cpu_backend
        and a.k_cache.dtype == torch.bfloat16
        and a.k_cache.dim() == 4
        and a.k_cache.is_contiguous()
        and a.v_cache.is_contiguous()
        and rope.cos_cache.dtype == torch.float32
        and not rope.cos_cache.is_cuda
    )


def gated_attn_kernel(decoder: nn.Module) -> gated_attn_layer.GatedAttnLayerKernel | None:
    """The gated-attention decoder layer's kernel, or None where the C call does not apply."""
    ptr = decoder.self_attn.attn.k_cache.data_ptr()
    cached = decoder.__dict__.get("_c_decode")
    if cached is not None and cached[0] == ptr:
        return cached[1]
    kernel = gated_attn_layer.GatedAttnLayerKernel(decoder) if gated_attn_supported(decoder) else None
    decoder.__dict__["_c_decode"] = (ptr, kernel)
    return kernel


def decode_meta(hidden_states: torch.Tensor) -> AttentionMetadata | None:
    """The step's attention metadata when it is a plain CPU decode step over one KV group (one token per sequence,
    float32) that the gated-attention C call may take, else None."""
    if hidden_states.is_cuda or hidden_states.dtype is not torch.float32:
        return None
    meta = get_attention_metadata()
    if not isinstance(meta, AttentionMetadata):
        return None
    if meta.max_query_len != 1 or meta.num_seqs != hidden_states.shape[0] or getattr(meta, "groups", None):
        return None
    return meta
