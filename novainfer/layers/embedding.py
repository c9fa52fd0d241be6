"""Token embedding and LM head. Both are replicated on every rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from novainfer.layers.quantization import current_quant_config
from novainfer.layers.row_invariant import linear


class VocabParallelEmbedding(nn.Module):
    """Token embedding; a quant method (see layers/linear.py) may keep its weight quantized."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        config = current_quant_config()
        self.quant_method = config.get_quant_method(self) if config is not None else None
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        else:
            self.weight = self.quant_method.create_weights(self, num_embeddings, embedding_dim)
            self.weight.weight_loader = self._quant_weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"weight shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded.shape)}")
        param.data.copy_(loaded)

    def _quant_weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        self.quant_method.load_shard(self, param, loaded, shard_id, self.weight_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embedding(self, input_ids)
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; only for the rows that need logits."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden_states)
        return linear(hidden_states, self.weight)
