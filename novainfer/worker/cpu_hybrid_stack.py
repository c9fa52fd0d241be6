"""A CPU decode step's whole Qwen3.5 / Qwen3-Next decoder stack in one C call (kernels/cpu/hybrid_stack.py): the
counterpart of cpu_decode_stack.py for models/qwen3_5.py's hybrid layers. Each layer's kernel is the one its own C
call would run (models/qwen3_5_cpu_decode.py decides and caches it), so the hidden states equal the layer path's to
the bit. Taken where every layer has its kernel and the step is a plain decode step (one new token per sequence,
float32, no prefix-cache state saves or restores); every other step runs the model's layers."""

from __future__ import annotations

import torch
from torch import nn

from novainfer.attention.metadata import AttentionMetadata, get_attention_metadata
from novainfer.kernels.cpu import hybrid_stack
from novainfer.models import qwen3_5_cpu_decode as cpu_decode
from novainfer.models.llama import LlamaModel
from novainfer.models.qwen3_5 import HybridDecoderLayer


def supports(model: nn.Module) -> bool:
    """Whether model is a stack of Qwen3.5 hybrid layers and the C library is built; whether each layer's kernel
    applies is decided per step, once its caches are bound."""
    layers = getattr(model, "layers", None)
    return (
        isinstance(model, LlamaModel)
        and bool(layers)
        and all(type(layer) is HybridDecoderLayer for layer in layers)
        and hybrid_stack.available()
    )


class CPUHybridStack:
    """The C decode path of one hybrid LlamaModel (which supports() it)."""

    def __init__(self, model: LlamaModel):
        self.model = model
        self.layers = list(model.layers)  # (nn.Module attribute reads are slow)
        self.first_linear = next((layer.linear_attn for layer in self.layers if layer.is_linear), None)
        self.kernel: hybrid_stack.HybridStackKernel | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The final-normed hidden states [M, H] of a decode step, or None where this step needs the layers."""
        meta = get_attention_metadata()
        m = input_ids.shape[0]
        if not isinstance(meta, AttentionMetadata) or meta.per_token is not None or meta.groups:
            return None
        if meta.max_query_len != 1 or meta.num_seqs != m or not self._bind():
            return None
        embeds = self.model.embed_tokens(input_ids)
        if embeds.dtype != torch.float32 or embeds.dim() != 2 or not embeds.is_contiguous():
            return None
        step = self.first_linear.cpu_decode_step(embeds) if self.first_linear is not None else None
        if step is None:  # a step that saves or restores prefix-cache states takes the layers
            return None
        h, residual = self.kernel.run(embeds, *step, positions, meta)
        return self.model.norm(h, residual)[0]

    def _bind(self) -> bool:
        """The layers' kernels (rebuilt by models/qwen3_5_cpu_decode.py when the runner binds other caches) in one
        stack; False where a layer has none (the layer path then runs)."""
        kernels = []
        for layer in self.layers:
            k = cpu_decode.gdn_decoder_kernel(layer) if layer.is_linear else cpu_decode.gated_attn_kernel(layer)
            if k is None:
                return False
            kernels.append(k)
        if self.kernel is None or any(a is not b for a, b in zip(kernels, self.kernel.kernels)):
            self.kernel = hybrid_stack.HybridStackKernel(kernels)
        return True
