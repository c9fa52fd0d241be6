"""A batch-1 decode step on CUDA: each llama-family decoder layer as five fused kernels instead of thirteen.

At one token a step, the GPU time goes to kernel count rather than bytes (measured on an H200:
306 kernels a step for Qwen2.5-0.5B, the small ones 1-3 us each). Here a layer is
1. residual add + input RMSNorm + qkv projection (+ bias): one GEMV with a norm prologue;
2. rotary on q and the new key, the K/V store and split-K attention with its merge: one decode kernel;
3. o_proj: one GEMV;
4. residual add + post-attention RMSNorm + gate_up projection + SiLU-and-multiply: one GEMV with a norm
   prologue and a SiLU epilogue;
5. down projection: one GEMV.
The elementwise steps round as the layer-by-layer kernels do; the projections sum in float32 in their own
order (as cuBLAS's kernels differ between batch sizes). Taken for the batch-1 decode CUDA graph of a model
whose layers are plain llama pieces on one rank with unquantized or pre-quantized block-FP8 weights (Llama, Qwen2,
Mistral; kernels/gemv.py reads the float8 weights with their block scales); every other step and model runs the
layers as before (worker/decode_strategy.py picks it).
"""

from __future__ import annotations

import torch
from torch import nn

from novainfer.attention import triton_backend
from novainfer.attention.metadata import AttentionMetadata, get_attention_metadata
from novainfer.kernels.gemv import gemv
from novainfer.kernels.paged_attention import DecodeRope, decode_attention
from novainfer.layers.quantization.fp8_block import Fp8BlockLinearMethod
from novainfer.models.llama import LlamaModel
from novainfer.worker.cpu_decode_stack import plain_llama_layers


class GPUDecodeStack:
    """Runs a LlamaModel (which supports() it) for a one-token decode step; forward returns None for other steps.

    graphs_only: only in a decode CUDA graph. Launched one by one, a Triton kernel costs more host time than
    the cuBLAS and torch kernels it replaces, so an eager one-token step keeps the layer-by-layer path."""

    def __init__(self, model: LlamaModel, graphs_only: bool = True):
        self.model, self.graphs_only = model, graphs_only

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The final-normed hidden states [1, H] of a one-token decode step, or None for any other step."""
        meta = get_attention_metadata()
        if (
            input_ids.shape[0] != 1
            or not isinstance(meta, AttentionMetadata)
            or meta.max_query_len != 1
            or (self.graphs_only and not meta.cuda_graph)
        ):
            return None
        model = self.model
        hidden_states, residual = model.embed_tokens(input_ids), None
        for layer in model.layers:
            hidden_states, residual = self._layer(layer, meta, positions, hidden_states, residual)
        out, _ = model.norm(hidden_states, residual)
        return out

    @staticmethod
    def _layer(
        layer: nn.Module,
        meta: AttentionMetadata,
        positions: torch.Tensor,
        h: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
        qkv = gemv(
            h,
            **_weights(attn.qkv_proj),
            bias=attn.qkv_proj.bias,
            norm_weight=norm.weight,
            eps=norm.eps,
            residual=residual,
        )
        qkv, residual = qkv if residual is not None else (qkv, h)  # the first layer: its input is the residual
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        a, rope = attn.attn, attn.rotary_emb
        o = decode_attention(
            q.view(1, a.num_heads, a.head_dim),
            a.k_cache,
            a.v_cache,
            meta.block_tables,
            meta.seq_lens,
            a.scale,
            meta.num_splits,
            sliding_window=a.sliding_window,
            logits_soft_cap=a.logits_soft_cap,
            k_scale=a.k_scale,
            v_scale=a.v_scale,
            rope=DecodeRope(
                positions,
                rope.cos_cache,
                rope.sin_cache,
                k.view(1, a.num_kv_heads, a.head_dim),
                v.view(1, a.num_kv_heads, a.head_dim),
                meta.slot_mapping,
            ),
        )
        h = gemv(o.view(1, -1), **_weights(attn.o_proj))  # (supports() leaves o_proj and down_proj biases out)
        norm = layer.post_attention_layernorm
        act, residual = gemv(
            h,
            **_weights(mlp.gate_up_proj),
            bias=mlp.gate_up_proj.bias,
            norm_weight=norm.weight,
            eps=norm.eps,
            residual=residual,
            silu_and_mul=True,
        )
        return gemv(act, **_weights(mlp.down_proj)), residual


def _weights(linear: nn.Module) -> dict:
    """gemv()'s weight arguments for a linear layer: its weight, and a block-FP8 layer's scales and block."""
    method = linear.quant_method
    if method is None:
        return {"weight": linear.weight}
    return {"weight": linear.weight, "weight_scale": linear.weight_scale_inv, "block": method.block}


def _gemv_reads(linear: nn.Module, silu_and_mul: bool = False) -> bool:
    """Whether kernels/gemv.py computes this layer: unquantized, or block FP8 whose row blocks are a power of two
    (a program's rows share one) and, for gate/up, whole blocks per half."""
    method = linear.quant_method
    if method is None:
        return True
    if type(method) is not Fp8BlockLinearMethod:
        return False
    bn = method.block[0]
    return bn & (bn - 1) == 0 and (not silu_and_mul or linear.output_size // 2 % bn == 0)


def supports(model: LlamaModel) -> bool:
    """Whether every layer of a LlamaModel is made of the pieces the stack fuses, unquantized or block FP8, over the
    Triton backend's cache, without o_proj and down_proj biases."""
    if not plain_llama_layers(model):
        return False
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(_gemv_reads(lin) for lin in (attn.qkv_proj, attn.o_proj, mlp.down_proj)) or not _gemv_reads(
            mlp.gate_up_proj, silu_and_mul=True
        ):
            return False
        if attn.attn.backend is not triton_backend or attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
            return False
    return True
