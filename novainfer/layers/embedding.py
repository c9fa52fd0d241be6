"""Token embedding and LM head. Both are replicated on every rank (design doc 000 §7.1)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"weight shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded.shape)}")
        param.data.copy_(loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; only for the rows that need logits."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight)
