"""State slots of hybrid models: each running sequence of a model with linear-attention layers (Qwen3.5,
Qwen3-Next) owns one fixed-size slot of recurrent state (worker/state_cache.py) besides its KV blocks.

HybridBlockManager hands a slot out at admission (a sequence is admitted only when one is free) and takes it
back whenever the blocks go back: finish, abort and preemption (the sequence is recomputed from position 0,
which starts from a zero state). The slot travels to the runner on the Sequence (state_slot). The prefix cache
is off for these models: a hit would need the recurrent state at the hit position, which is not kept.
"""
from __future__ import annotations

import logging
from typing import Any

from novainfer.engine.block_manager import BlockManager
from novainfer.engine.sequence import Sequence

logger = logging.getLogger(__name__)


class HybridBlockManager(BlockManager):
    """KV blocks plus one state slot per admitted sequence."""

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int):
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        if num_state_slots < 1:
            raise ValueError(f"a hybrid model needs at least one state slot, got {num_state_slots}")
        self.num_state_slots = num_state_slots
        self.free_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end: slot 0 first

    def can_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        return bool(self.free_slots) and super().can_admit(seq, cached, num_new_tokens)

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        super().admit(seq, cached)
        seq.state_slot = self.free_slots.pop()

    def free(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = -1
        super().free(seq)


def make_block_manager(config: Any, hf_config: Any, num_blocks: int, num_state_slots: int) -> BlockManager:
    """The engine's block manager: with state slots for a hybrid model (num_state_slots > 0), else the plain one."""
    cc = config.cache_config
    if num_state_slots <= 0:
        return BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
    if cc.enable_prefix_caching:
        logger.info("prefix caching is off: %s has linear-attention layers whose state is not checkpointed",
                    (getattr(hf_config, "architectures", None) or ["the model"])[0])
    return HybridBlockManager(num_blocks, cc.block_size, num_state_slots)


def check_hybrid_engine(config: Any) -> None:
    """Refuse, at start-up, engine features a hybrid model cannot run with, naming the reason."""
    spec = config.speculative_config
    if spec is not None:
        raise ValueError(f"speculative_config (method {spec.method!r}) is not supported for hybrid models with "
                         "linear-attention layers: verifying guesses advances the recurrent state, which a rejected "
                         "guess cannot take back")
    backend = config.parallel_config.distributed_executor_backend
    if backend != "uni":
        raise ValueError(f"distributed_executor_backend={backend!r}: hybrid models with linear-attention layers "
                         "run with 'uni' only (the mp step wire does not carry state slots)")
