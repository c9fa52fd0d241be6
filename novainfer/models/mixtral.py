"""Mixtral: the Llama decoder with every MLP a block of experts (top-k renormalised); the checkpoint calls
the block block_sparse_moe and an expert's gate, down and up w1, w2 and w3."""

from __future__ import annotations

from typing import Any

from torch import nn

from novainfer.models.moe import MoeForCausalLM, SparseMoeBlock


class MixtralForCausalLM(MoeForCausalLM):
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}
    expert_projections = ("w1", "w2", "w3")

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config, config.intermediate_size, renormalize=True)
