"""A decode step's hidden states through a whole-stack fast path with the model's results, where one applies: the
CPU C stack (cpu_decode_stack.py; cpu_gemma4_stack.py for Gemma 4, cpu_hybrid_stack.py for Qwen3.5's hybrid layers)
or the GPU fused stack (gpu_decode_stack.py; gpu_hybrid_decode_stack.py for Qwen3.5's hybrid layers); else the
model's forward."""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch
from torch import nn

from novainfer.attention import cpu_backend, torch_backend
from novainfer.models.llama import LlamaModel
from novainfer.worker import cpu_decode_stack, cpu_gemma4_stack, cpu_hybrid_stack


class DecodeStrategy(Protocol):
    """A whole-stack path: the final-normed hidden states of a step it takes, else None."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None: ...


def select_decode_strategy(
    model: nn.Module, attn_backend: ModuleType, graphs_only: bool = True
) -> DecodeStrategy | None:
    """The fast path that applies to model (a ...ForCausalLM whose .model is a LlamaModel) over attn_backend's
    KV cache, or None; graphs_only: the GPU stack only inside CUDA graphs (see GPUDecodeStack)."""
    inner = getattr(model, "model", None)
    if attn_backend is cpu_backend and cpu_gemma4_stack.supports(inner):
        return cpu_gemma4_stack.CPUGemma4Stack(inner)
    if not isinstance(inner, LlamaModel) or attn_backend is torch_backend:
        return None
    if attn_backend is cpu_backend and cpu_hybrid_stack.supports(inner):
        return cpu_hybrid_stack.CPUHybridStack(inner)
    if attn_backend is cpu_backend:
        return cpu_decode_stack.CPUDecodeStack(inner) if cpu_decode_stack.supports(inner) else None
    from novainfer.worker import gpu_decode_stack, gpu_hybrid_decode_stack  # Triton: where its backend runs

    if gpu_hybrid_decode_stack.supports(inner):
        return gpu_hybrid_decode_stack.GPUHybridDecodeStack(inner, graphs_only)
    return gpu_decode_stack.GPUDecodeStack(inner, graphs_only) if gpu_decode_stack.supports(inner) else None


def decode_forward(
    model: nn.Module, strategy: DecodeStrategy | None, input_ids: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The step's hidden states: the strategy's where it takes the step, else the model's forward."""
    hidden = strategy.forward(input_ids, positions) if strategy is not None else None
    return hidden if hidden is not None else model(input_ids, positions)
