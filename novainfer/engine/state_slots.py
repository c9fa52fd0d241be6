"""State slots of hybrid models: each running sequence of a model with linear-attention layers (Qwen3.5,
Qwen3-Next) owns one fixed-size slot of recurrent state (worker/state_cache.py) besides its KV blocks.

HybridBlockManager hands a slot out at admission (a sequence is admitted only when one is free) and takes it
back whenever the blocks go back: finish, abort and preemption (the sequence is recomputed from position 0,
which starts from a zero state, or from a prefix hit's checkpoint). The slot travels to the runner on the
Sequence (state_slot). A prefix-cache hit needs the recurrent state at the hit position: checkpoints of it are
kept at the last full block of each prompt, and a hit is shortened to the last checkpointed block.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from novainfer.engine.block_manager import BlockManager
from novainfer.engine.kv_group_manager import KVGroupBlockManager
from novainfer.sequence import Sequence

logger = logging.getLogger(__name__)


class HybridBlockManager(BlockManager):
    """KV blocks plus one state slot per admitted sequence, and a bounded LRU pool of state checkpoints.

    A checkpoint holds the state after the last full block of a prompt, keyed by that block's chained hash; it is
    planned on the step whose tokens reach that position (Sequence.state_save) and written by the runner in that
    step. A prefix hit is shortened to the longest cached prefix that ends at a checkpoint, which the runner copies
    into the admitted sequence's slot before its first step (Sequence.state_restore)."""

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int, num_checkpoints: int = 0):
        super().__init__(num_blocks, block_size, enable_prefix_caching=num_checkpoints > 0)
        if num_state_slots < 1:
            raise ValueError(f"a hybrid model needs at least one state slot, got {num_state_slots}")
        self.num_state_slots, self.num_checkpoints = num_state_slots, num_checkpoints
        self.free_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end: slot 0 first
        # checkpoint slots follow the sequences' slots in the worker's state cache
        self.free_checkpoints = list(range(num_state_slots + num_checkpoints - 1, num_state_slots - 1, -1))
        self.checkpoints: OrderedDict[int, int] = OrderedDict()  # block hash -> checkpoint slot, LRU first

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        hits = super().find_cached_prefix(seq)
        while hits and self.blocks[hits[-1]].hash not in self.checkpoints:
            hits.pop()
        return hits

    def can_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        return bool(self.free_slots) and super().can_admit(seq, cached, num_new_tokens)

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        super().admit(seq, cached)
        seq.state_slot = self.free_slots.pop()
        seq.state_restore = None
        if cached:
            block_hash = self.blocks[cached[-1]].hash
            self.checkpoints.move_to_end(block_hash)
            seq.state_restore = (len(cached) * self.block_size, self.checkpoints[block_hash])

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead_slots: int = 0) -> None:
        """Also plan the checkpoint of the prompt's last full block when this step's tokens reach it."""
        start = seq.num_computed_tokens
        super().allocate_slots(seq, num_new_tokens, num_lookahead_slots)
        seq.state_save = None
        pos = seq.num_prompt_tokens // self.block_size * self.block_size
        if not self.enable_prefix_caching or not pos or not start < pos <= start + num_new_tokens:
            return
        block_hash = seq.block_hashes[pos // self.block_size - 1]  # registered by the allocation above
        if block_hash in self.checkpoints:
            self.checkpoints.move_to_end(block_hash)
            return
        slot = self.free_checkpoints.pop() if self.free_checkpoints else self.checkpoints.popitem(last=False)[1]
        self.checkpoints[block_hash] = slot
        seq.state_save = (pos, slot)

    def free(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = -1
        seq.state_restore = seq.state_save = None
        super().free(seq)

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.free_checkpoints += self.checkpoints.values()
        self.checkpoints.clear()


def make_block_manager(
    config: Any, hf_config: Any, num_blocks: int, state_slots: list[tuple[int, int]], kv_layout: Any = None
) -> BlockManager:
    """The engine's block manager: for a hybrid model (each rank reporting (slots, checkpoints) > 0) with state
    slots and checkpoints, the fewest any rank has; for a grouped KV cache (kv_layout, worker/kv_layout.py) one
    block table per KV group; else the plain one."""
    cc = config.cache_config
    num_slots, num_checkpoints = min(n for n, _ in state_slots), min(c for _, c in state_slots)
    if kv_layout is not None:
        if num_slots > 0:
            raise ValueError("a model with both linear-attention and sliding-window layers is not supported")
        return KVGroupBlockManager(num_blocks, cc.block_size, kv_layout.groups, cc.enable_prefix_caching)
    if num_slots <= 0:
        return BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
    if cc.enable_prefix_caching and not num_checkpoints:
        logger.info(
            "prefix caching is off: %s has linear-attention layers and the cache budget leaves no room "
            "for their state checkpoints",
            (getattr(hf_config, "architectures", None) or ["the model"])[0],
        )
    num_checkpoints = num_checkpoints if cc.enable_prefix_caching else 0
    logger.info(
        "linear-attention state: %d sequence slots, %d prefix-cache checkpoint slots", num_slots, num_checkpoints
    )
    return HybridBlockManager(num_blocks, cc.block_size, num_slots, num_checkpoints)
