"""The state cache of a hybrid model: per linear-attention layer, a conv window [slots, kernel - 1, conv_dim]
(activation dtype) and a recurrent state [slots, v_heads, k_dim, v_dim] (float32, or bfloat16 under
mamba_ssm_cache_dtype, as vLLM and SGLang offer: half the bytes, the update still in float32); each layer gets
views.

Slots are handed out by the engine (engine/state_slots.py); a step's slot per scheduled sequence goes into the
attention metadata (state_slots), where the GatedDeltaNet layers read it. There are max_num_seqs slots and, with
prefix caching, as many checkpoint slots (states at cached prompt positions), together at most half of the cache
budget (the CPU's cpu_kv_cache_tokens, the GPU's share of its memory; a quarter of a budget that is short goes
to checkpoints). The KV cache gets what they leave.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from novainfer.layers.linear_attention import GatedDeltaNet, StateSlotsMetadata


class StateCache:
    """The state slots of one model's GatedDeltaNet layers on one device."""

    def __init__(
        self,
        layers: list[GatedDeltaNet],
        dtype: torch.dtype,
        device: torch.device,
        num_slots: int,
        num_checkpoints: int = 0,
        ssm_dtype: torch.dtype = torch.float32,
    ):
        self.layers, self.dtype, self.device, self.ssm_dtype = layers, dtype, device, ssm_dtype
        self.num_slots = num_slots  # the sequences' slots, then the prefix cache's checkpoint slots
        self.num_checkpoints = num_checkpoints
        self.conv: torch.Tensor | None = None
        self.ssm: torch.Tensor | None = None

    @classmethod
    def for_model(
        cls, model: nn.Module, config: Any, dtype: torch.dtype, device: torch.device, kv_bytes_per_token: int
    ) -> "StateCache | None":
        """The model's state cache (None without linear-attention layers), its slot count fixed here."""
        layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
        if not layers:
            return None
        check_hybrid_engine(config)
        seqs, cc = config.scheduler_config.max_num_seqs, config.cache_config
        cache = cls(layers, dtype, device, seqs, ssm_dtype=getattr(torch, cc.mamba_ssm_cache_dtype))
        cap = 2 * seqs  # slots, then as many checkpoint slots with prefix caching; at most half the cache budget
        if cc.num_gpu_blocks is None:
            if device.type == "cuda":
                free, total = torch.cuda.mem_get_info(device)
                budget = total * cc.gpu_memory_utilization - (total - free)
            else:
                budget = cc.cpu_kv_cache_tokens * kv_bytes_per_token
            cap = min(cap, int(budget // 2 // cache.bytes_per_slot()))
        if not cc.enable_prefix_caching:
            cache.num_slots = max(1, min(seqs, cap))
        else:  # a quarter of a short budget goes to checkpoints
            cache.num_slots = max(1, min(seqs, cap - cap // 4))
            cache.num_checkpoints = max(0, min(seqs, cap - cache.num_slots))
        return cache

    def bytes_per_slot(self) -> int:
        """One slot's bytes over all layers."""
        total = 0
        for layer in self.layers:
            conv, ssm = layer.state_shapes()
            total += conv[0] * conv[1] * self.dtype.itemsize + ssm[0] * ssm[1] * ssm[2] * self.ssm_dtype.itemsize
        return total

    def nbytes(self) -> int:
        """The whole cache's bytes: every sequence slot and checkpoint slot."""
        return (self.num_slots + self.num_checkpoints) * self.bytes_per_slot()

    def allocate(self) -> None:
        """The tensors, once (a profiling run allocates them and they stay); each layer gets its views."""
        if self.conv is not None:
            return
        conv, ssm = self.layers[0].state_shapes()
        n = len(self.layers)
        total = self.num_slots + self.num_checkpoints
        self.conv = torch.zeros((n, total, *conv), dtype=self.dtype, device=self.device)
        self.ssm = torch.zeros((n, total, *ssm), dtype=self.ssm_dtype, device=self.device)
        for i, layer in enumerate(self.layers):
            layer.conv_state, layer.ssm_state = self.conv[i], self.ssm[i]

    def release(self) -> None:
        """Drop the tensors and the layers' views, so the memory is freed."""
        self.conv = self.ssm = None
        for layer in self.layers:
            layer.conv_state = layer.ssm_state = torch.tensor([])

    @staticmethod
    def step_metadata(scheduled: list) -> StateSlotsMetadata:
        """Each scheduled sequence's slot (host tensor), and the checkpoint copies the engine planned for the step:
        a restore on the step that resumes at the hit position, a save on the step whose tokens reach it."""
        slots, restores, saves, fresh = [], {}, {}, []
        for i, s in enumerate(scheduled):
            seq = s.seq
            if seq.state_slot < 0:
                raise RuntimeError(f"{seq!r} of a hybrid model is scheduled without a state slot")
            slots.append(seq.state_slot)
            if s.start == 0:
                fresh.append(i)
            if seq.state_restore is not None and seq.state_restore[0] == s.start:
                restores[i] = seq.state_restore[1]
            if seq.state_save is not None and s.start < seq.state_save[0] <= s.start + s.num_new_tokens:
                saves[i] = (seq.state_save[0] - s.start, seq.state_save[1])
        return StateSlotsMetadata(torch.tensor(slots, dtype=torch.long), slots, restores, saves, fresh)

    def zero_fresh(self, meta: StateSlotsMetadata) -> None:
        """Zero the slots of the step's sequences that start at position 0, in every layer (before the forward,
        outside any CUDA graph: the kernels read a fresh sequence's slot as its initial state)."""
        if self.conv is not None:
            meta.zero_fresh(self.conv, self.ssm, dim=1)


def worker_num_state_slots(worker: Any) -> tuple[int, int]:
    """A worker's (sequence slots, checkpoint slots); (0, 0) without linear-attention layers. For collective_rpc."""
    cache = worker.model_runner.state_cache
    return (0, 0) if cache is None else (cache.num_slots, cache.num_checkpoints)


def check_hybrid_engine(config: Any) -> None:
    """Refuse, at start-up, engine features a hybrid model cannot run with, naming the reason."""
    spec = config.speculative_config
    if spec is not None:
        raise ValueError(
            f"speculative_config (method {spec.method!r}) is not supported for hybrid models with "
            "linear-attention layers: verifying guesses advances the recurrent state, which a rejected "
            "guess cannot take back"
        )
