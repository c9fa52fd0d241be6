"""The state cache of a hybrid model: per linear-attention layer, a conv window [slots, conv_dim, kernel - 1]
(activation dtype) and a recurrent state [slots, v_heads, k_dim, v_dim] (float32); each layer gets views.

Slots are handed out by the engine (engine/state_slots.py); a step's slot per scheduled sequence goes into the
attention metadata (state_slots), where the GatedDeltaNet layers read it. There are max_num_seqs slots, fewer on
the CPU where that many would take more than half of the cache budget; the KV cache gets what they leave.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from novainfer.engine.state_slots import check_hybrid_engine
from novainfer.layers.linear_attention import GatedDeltaNet


class StateCache:
    """The state slots of one model's GatedDeltaNet layers on one device."""

    def __init__(self, layers: list[GatedDeltaNet], dtype: torch.dtype, device: torch.device, num_slots: int):
        self.layers, self.dtype, self.device = layers, dtype, device
        self.num_slots = num_slots
        self.conv: torch.Tensor | None = None
        self.ssm: torch.Tensor | None = None

    @classmethod
    def for_model(cls, model: nn.Module, config: Any, dtype: torch.dtype, device: torch.device,
                  kv_bytes_per_token: int) -> "StateCache | None":
        """The model's state cache (None without linear-attention layers), its slot count fixed here."""
        layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
        if not layers:
            return None
        check_hybrid_engine(config)
        cache = cls(layers, dtype, device, config.scheduler_config.max_num_seqs)
        if device.type != "cuda" and config.cache_config.num_gpu_blocks is None:
            half = config.cache_config.cpu_kv_cache_tokens * kv_bytes_per_token // 2
            cache.num_slots = max(1, min(cache.num_slots, half // cache.bytes_per_slot()))
        return cache

    def bytes_per_slot(self) -> int:
        """One slot's bytes over all layers."""
        total = 0
        for layer in self.layers:
            conv, ssm = layer.state_shapes()
            total += conv[0] * conv[1] * self.dtype.itemsize + ssm[0] * ssm[1] * ssm[2] * 4
        return total

    def nbytes(self) -> int:
        return self.num_slots * self.bytes_per_slot()

    def allocate(self) -> None:
        """The tensors, once (a profiling run allocates them and they stay); each layer gets its views."""
        if self.conv is not None:
            return
        conv, ssm = self.layers[0].state_shapes()
        n = len(self.layers)
        self.conv = torch.zeros((n, self.num_slots, *conv), dtype=self.dtype, device=self.device)
        self.ssm = torch.zeros((n, self.num_slots, *ssm), dtype=torch.float32, device=self.device)
        for i, layer in enumerate(self.layers):
            layer.conv_state, layer.ssm_state = self.conv[i], self.ssm[i]

    def release(self) -> None:
        self.conv = self.ssm = None
        for layer in self.layers:
            layer.conv_state = layer.ssm_state = torch.tensor([])

    @staticmethod
    def slots_of(scheduled: list) -> torch.Tensor:
        """The state slot of each scheduled sequence, in step order (int64, host)."""
        slots = [s.seq.state_slot for s in scheduled]
        if min(slots, default=0) < 0:
            raise RuntimeError("a scheduled sequence of a hybrid model has no state slot")
        return torch.tensor(slots, dtype=torch.long)


def worker_num_state_slots(worker: Any) -> int:
    """A worker's state slots (0: the model has no linear-attention layers); for the executor's collective_rpc."""
    cache = worker.model_runner.state_cache
    return 0 if cache is None else cache.num_slots
