"""A batch-1 decode step on CUDA for the hybrid models (Qwen3.5, Qwen3-Next: Gated DeltaNet and gated-attention
layers), as gpu_decode_stack.py does for llama layers: each input norm (Gemma's 1 + w form) runs as its
projections' GEMV prologue with the residual add, and a dense MLP is two GEMVs (gate/up with the norm prologue and
SiLU-and-multiply epilogue, then down). A DeltaNet layer is then one GEMV for its four input projections (adjacent
rows of one weight, layers/linear.py's adjacent_weights), the gating, conv, recurrence and gated-norm kernels, and
out_proj; a gated-attention layer the qkv GEMV, the q/k norms and rotary (one kernel), attention, and o_proj with
the output gate's sigmoid-and-multiply in its prologue. The layer-by-layer path launched about 610 kernels a step
for Qwen3.5-9B, most of them small. An MoE block keeps its own kernels behind the post-attention norm. Taken for the batch-1 decode CUDA graph of an
unquantized model on one rank; every other step runs the layers (worker/decode_strategy.py picks it)."""

from __future__ import annotations

import torch
from torch import nn

from novainfer.attention import triton_backend
from novainfer.attention.metadata import AttentionMetadata
from novainfer.kernels.gemv import gemv
from novainfer.layers.activation import SiluAndMul
from novainfer.layers.layernorm import GemmaRMSNorm
from novainfer.models.llama import LlamaMLP, LlamaModel
from novainfer.models.qwen3_5 import HybridDecoderLayer
from novainfer.worker.gpu_decode_stack import GPUDecodeStack


class GPUHybridDecodeStack(GPUDecodeStack):
    """Runs a hybrid LlamaModel (which supports() it) for a one-token decode step (GPUDecodeStack.forward)."""

    def __init__(self, model: LlamaModel, graphs_only: bool = True):
        super().__init__(model, graphs_only)
        # the GEMV prologue multiplies by its norm weight in float32: Gemma's norms scale by 1 + w
        self.scales = {
            norm: 1.0 + norm.weight.float()
            for layer in model.layers
            for norm in (layer.input_layernorm, layer.post_attention_layernorm)
        }

    def _layer(
        self,
        layer: nn.Module,
        meta: AttentionMetadata,
        positions: torch.Tensor,
        h: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm = layer.input_layernorm
        if layer.is_linear:
            mixer = layer.linear_attn
            weight, bias, out_proj = mixer.in_proj, None, mixer.out_proj
        else:
            mixer = layer.self_attn
            weight, bias, out_proj = mixer.qkv_proj.weight, mixer.qkv_proj.bias, mixer.o_proj
        y = gemv(h, weight, bias, norm_weight=self.scales[norm], eps=norm.eps, residual=residual)
        y, residual = y if residual is not None else (y, h)  # the first layer: its input is the residual
        gate = None
        if layer.is_linear:
            mixed = mixer.mix_projected(*y.split(mixer.in_proj_sizes, dim=-1), meta)
        else:
            mixed, gate = mixer.attend_ungated(positions, y)
        h = gemv(mixed, out_proj.weight, out_proj.bias, gate=gate)
        post, mlp = layer.post_attention_layernorm, layer.mlp
        if type(mlp) is not LlamaMLP:  # an MoE block: its own kernels
            h, residual = post(h, residual)
            return mlp(h), residual
        act, residual = gemv(
            h,
            mlp.gate_up_proj.weight,
            norm_weight=self.scales[post],
            eps=post.eps,
            residual=residual,
            silu_and_mul=True,
        )
        return gemv(act, mlp.down_proj.weight), residual


def supports(model: nn.Module) -> bool:
    """Whether model is a hybrid LlamaModel on one rank whose projections are unquantized (the DeltaNet input
    projections adjacent in one weight), over the Triton backend's cache, its dense MLPs SiLU ones."""
    if not isinstance(model, LlamaModel) or model.embed_scale is not None or not len(model.layers):
        return False
    for layer in model.layers:
        if type(layer) is not HybridDecoderLayer or any(
            type(n) is not GemmaRMSNorm for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ):
            return False
        if layer.is_linear:
            mixer = layer.linear_attn
            linears = [mixer.out_proj]
            if mixer.in_proj is None:
                return False
        else:
            mixer = layer.self_attn
            linears = [mixer.qkv_proj, mixer.o_proj]
            if mixer.attn.backend is not triton_backend:
                return False
        mlp = layer.mlp
        if type(mlp) is LlamaMLP:
            if type(mlp.act_fn) is not SiluAndMul:
                return False
            linears += [mlp.gate_up_proj, mlp.down_proj]
        if any(lin.quant_method is not None or lin.tp_size != 1 for lin in linears):
            return False
    return True
