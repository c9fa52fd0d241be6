"""Paged KV-cache bookkeeping: which physical blocks each sequence owns, plus the prefix cache.

A full block is identified by a hash of its tokens chained with the previous block's hash, so equal
prefixes map to equal hash chains. Freed blocks keep their hash (and tokens) until they are handed out
again, so a later request with the same prefix can pick them up. The free list is least-recently-freed
first, which makes eviction LRU.
"""

from __future__ import annotations

import struct
from collections import OrderedDict

import xxhash

from novainfer.engine.kv_events import AllBlocksCleared, KVCacheEvent, removed, stored
from novainfer.sequence import Sequence


def hash_block(token_ids: list[int], prev_hash: int) -> int:
    """Chained hash of one full block of tokens: xxh64 of the previous hash and the tokens as little-endian
    int64s, made a signed 64-bit value."""
    return xxhash.xxh64_intdigest(struct.pack(f"<{len(token_ids) + 1}q", prev_hash, *token_ids)) - (1 << 63)


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []


class BlockManager:
    """Allocates and frees KV blocks for sequences; finds and shares cached prefix blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # ordered set, LRU first. Not a dict: taking from a dict's front leaves holes that next(iter()) scans
        # again on every take, until the dict is rebuilt (30 us a take after 20k takes of 366k blocks)
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0  # tokens
        self.kv_events: list[KVCacheEvent] | None = None  # a list: the prefix cache's changes, for KV events

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(1, self.num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- prefix cache -------------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of seq, leaving at least one token to compute; none for a
        sequence that wants prompt logprobs (its every position is computed for them)."""
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []
        hits: list[int] = []
        prev = -1
        max_blocks = (len(seq) - 1) // self.block_size
        for i in range(max_blocks):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            prev = hash_block(tokens, prev)
            block_id = self.hash_to_block_id.get(prev, -1)
            if block_id < 0 or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def num_cached_tokens(self, cached: list[int]) -> int:
        """Tokens a find_cached_prefix hit covers."""
        return len(cached) * self.block_size

    def can_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Whether the cached prefix plus num_new_tokens more tokens fit in free blocks now."""
        fresh = self.blocks_needed(len(cached) * self.block_size + num_new_tokens) - len(cached)
        reused_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return fresh + reused_free <= self.num_free_blocks

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Give seq the cached prefix blocks (shared, ref-counted) and mark those tokens computed."""
        assert not seq.block_table
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        seq.num_computed_tokens = len(cached) * self.block_size
        self.num_prefix_queries += len(seq)
        self.num_prefix_hits += seq.num_computed_tokens

    # ---- growth --------------------------------------------------------------------------------
    def needs_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether num_tokens more tokens run past seq's blocks (the scheduler's cheap check before can_append)."""
        return len(seq.block_table) * self.block_size < seq.num_computed_tokens + num_tokens

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead_slots: int = 0) -> None:
        """Make room for num_new_tokens more tokens (and lookahead slots a draft model writes past them), then
        register the blocks those tokens fill.

        Hashes are registered when the step is planned: the step writes each layer's K/V before any
        attention reads it, so a sequence admitted later in the same step may already share them.
        A decode step that neither crosses into a new block nor fills one costs two comparisons.
        """
        block_size = self.block_size
        total = seq.num_computed_tokens + num_new_tokens
        table = seq.block_table
        needed = total + num_lookahead_slots
        if needed > len(table) * block_size:
            for _ in range(self.blocks_needed(needed) - len(table)):
                table.append(self._take_free_block())
        if total < (len(seq.block_hashes) + 1) * block_size or not self.enable_prefix_caching:
            return  # no block was filled (the tokens past len(seq) are still to be sampled)
        self._register_full_blocks(seq, min(total, len(seq.token_ids)) // block_size)

    def _register_full_blocks(self, seq: Sequence, num_full: int) -> None:
        """Hash seq's blocks up to num_full and offer each to the prefix cache (first writer wins)."""
        block_size = self.block_size
        hashes = seq.block_hashes
        prev = hashes[-1] if hashes else -1
        for i in range(len(hashes), num_full):
            tokens = seq.token_ids[i * block_size : (i + 1) * block_size]
            prev = hash_block(tokens, prev)
            block = self.blocks[seq.block_table[i]]
            hashes.append(prev)
            if block.hash == -1 and prev not in self.hash_to_block_id:
                block.hash, block.token_ids = prev, tokens
                self.hash_to_block_id[prev] = block.block_id
                if self.kv_events is not None:
                    self.kv_events.append(stored(prev, hashes[i - 1] if i else None, tokens, block_size))

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != -1:  # evict its cached contents
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
                if self.kv_events is not None:
                    self.kv_events.append(removed(block.hash))
            block.hash, block.token_ids = -1, []
        block.ref_count = 1
        return block_id

    # ---- release -------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop seq's references; blocks nobody uses go back to the free list, tail blocks first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (after a failed step the cached contents can't be trusted)."""
        for block in self.blocks:
            block.hash, block.token_ids = -1, []
        if self.kv_events is not None and self.hash_to_block_id:
            self.kv_events.append(AllBlocksCleared())
        self.hash_to_block_id.clear()
