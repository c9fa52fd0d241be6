"""Phi-3: the Llama decoder; the checkpoint fuses qkv_proj and gate_up_proj, rope may be LongRoPE
(layers/rotary.py) and a sliding window may apply to every layer."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from novainfer.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def split_fused_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """qkv_proj -> q/k/v_proj and gate_up_proj -> gate/up_proj, so each part is sharded on its own."""
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        q_size = c.num_attention_heads * head_dim
        kv_size = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                if tensor.shape[0] != q_size + 2 * kv_size:
                    raise ValueError(
                        f"weight shape mismatch: {name} has {tensor.shape[0]} rows, expected "
                        f"q + k + v = {q_size + 2 * kv_size}"
                    )
                for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q_size, kv_size, kv_size])):
                    yield name.replace(".qkv_proj.", f".{part}."), t
            elif ".gate_up_proj." in name:
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor
