"""Block bookkeeping of a grouped KV cache (worker/kv_layout.py): one pool of blocks, a block table per KV group.

Every group's table covers the sequence's positions in its own blocks (group 0's is Sequence.block_table, the
others Sequence.group_tables). A sliding-window group gives its blocks back once every query still to come is past
them: a step starting at position p reads keys from p - window + 1 on, so the blocks wholly below it go back to the
pool (still prefix-cached until taken) and their table entries point at the null block, which is never handed out.
Full-attention groups keep every block, as the plain BlockManager does.

Prefix caching runs per group over the same chained hashes (salted by group, so one hash names one block a group):
a hit needs every block of a full group and, of a sliding group, only the blocks its window reaches from the hit's
end; it ends on a block boundary of every group. Growth, preemption and release are the plain manager's, per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm

from novainfer.engine.block_manager import BlockManager, hash_block
from novainfer.engine.kv_events import stored
from novainfer.sequence import Sequence
from novainfer.worker.kv_layout import NULL_BLOCK, KVGroup


@dataclass
class GroupPrefixHit:
    """A cached prefix of num_tokens tokens: each group's block ids (the null block below a sliding window) and
    chained hashes of its blocks up to there."""

    num_tokens: int
    block_ids: list[list[int]]
    hashes: list[list[int]]


class KVGroupBlockManager(BlockManager):
    """Allocates each sequence a block table per KV group from one pool; sliding groups keep only their window."""

    def __init__(self, num_blocks: int, block_size: int, groups: tuple[KVGroup, ...], enable_prefix_caching: bool):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        if num_blocks < 2:
            raise ValueError(f"a grouped KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.groups = groups
        # a 64-bit salt a group (0 for group 0): keys of one chained hash differ between groups
        self._salts = [0] + [hash_block([g], 0) for g in range(1, len(groups))]
        self.align = lcm(*(g.block_size for g in groups))  # a prefix hit ends on every group's block boundary
        del self.free_block_ids[NULL_BLOCK]
        self.blocks[NULL_BLOCK].ref_count = 1  # never freed, never evicted
        self.block_group = [0] * num_blocks  # the group whose prefix cache names each block
        # seq_id -> (tokens its tables hold, the fill that registers a block): below both a step neither allocates
        # nor registers, and allocate_slots returns at once; windows then slide with the next step that does (at
        # least once a block: a block is given back at most one block late)
        self._quiet: dict[int, tuple[int, int]] = {}

    def group_usage(self, seq: Sequence) -> list[int]:
        """Blocks seq holds in each group (its null entries not counted)."""
        return [sum(b != NULL_BLOCK for b in t) for t in self._tables(seq)]

    def _tables(self, seq: Sequence) -> list[list[int]]:
        return [seq.block_table, *seq.group_tables]

    def _key(self, group: int, block_hash: int) -> int:
        """The prefix cache's key of a group's block: group 0's is its chained hash, the others' salted by group."""
        return block_hash ^ self._salts[group]

    def _first_needed(self, group: KVGroup, start: int) -> int:
        """The first block of group a query at position start or later still reads."""
        return 0 if group.sliding_window is None else max(0, start - group.sliding_window + 1) // group.block_size

    def num_cached_tokens(self, cached: GroupPrefixHit) -> int:
        return cached.num_tokens

    def needs_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        total = seq.num_computed_tokens + num_tokens
        quiet = self._quiet.get(seq.seq_id)
        if quiet is not None and total <= quiet[0]:
            return False
        return any(len(t) * g.block_size < total for t, g in zip(self._tables(seq), self.groups))

    # ---- prefix cache -------------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> GroupPrefixHit:
        """The longest prefix (leaving a token to compute) every group has cached as its attention reads it."""
        groups = self.groups
        empty = GroupPrefixHit(0, [[] for _ in groups], [[] for _ in groups])
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return empty
        limit = (len(seq) - 1) // self.align * self.align
        chains: dict[int, list[tuple[list[int], int]]] = {}  # block size -> each block's tokens and chained hash
        ids: list[list[int]] = []
        hit = limit
        for g, group in enumerate(groups):
            bs = group.block_size
            chain = chains.get(bs)
            if chain is None:
                chain, prev = [], -1
                for i in range(limit // bs):
                    tokens = seq.token_ids[i * bs : (i + 1) * bs]
                    prev = hash_block(tokens, prev)
                    chain.append((tokens, prev))
                chains[bs] = chain
            found = []
            for tokens, block_hash in chain:
                block_id = self.hash_to_block_id.get(self._key(g, block_hash), -1)
                if block_id >= 0 and self.blocks[block_id].token_ids != tokens:
                    block_id = -1
                if block_id < 0 and group.sliding_window is None:
                    break
                found.append(block_id)
            if group.sliding_window is None:
                hit = min(hit, len(found) * bs // self.align * self.align)
            ids.append(found)
        while hit > 0 and not all(
            -1 not in ids[g][self._first_needed(group, hit) : hit // group.block_size] for g, group in enumerate(groups)
        ):
            hit -= self.align
        if not hit:
            return empty
        return GroupPrefixHit(
            hit,
            [
                [NULL_BLOCK] * (lo := self._first_needed(group, hit)) + ids[g][lo : hit // group.block_size]
                for g, group in enumerate(groups)
            ],
            [[h for _, h in chains[group.block_size][: hit // group.block_size]] for group in groups],
        )

    def can_admit(self, seq: Sequence, cached: GroupPrefixHit, num_new_tokens: int) -> bool:
        total = cached.num_tokens + num_new_tokens
        need = 0
        for group, ids in zip(self.groups, cached.block_ids):
            need += -(-total // group.block_size) - len(ids)
            need += sum(1 for b in ids if b != NULL_BLOCK and self.blocks[b].ref_count == 0)
        return need <= self.num_free_blocks

    def admit(self, seq: Sequence, cached: GroupPrefixHit) -> None:
        assert not seq.block_table
        self._quiet.pop(seq.seq_id, None)
        tables: list[list[int]] = []
        for ids in cached.block_ids:
            for block_id in ids:
                if block_id == NULL_BLOCK:
                    continue
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_block_ids[block_id]
                block.ref_count += 1
            tables.append(list(ids))
        seq.block_table, *seq.group_tables = tables
        seq.block_hashes, *seq.group_hashes = (list(h) for h in cached.hashes)
        seq.num_computed_tokens = cached.num_tokens
        self.num_prefix_queries += len(seq)
        self.num_prefix_hits += seq.num_computed_tokens

    # ---- growth --------------------------------------------------------------------------------
    def _slide(self, seq: Sequence) -> None:
        """Give back the blocks each sliding group's window has passed (no query from num_computed_tokens on
        reads them); a table's released entries are a prefix, so the walk stops at the first null block."""
        start = seq.num_computed_tokens
        for group, table in zip(self.groups, self._tables(seq)):
            if group.sliding_window is None:
                continue
            i = min(self._first_needed(group, start), len(table)) - 1
            while i >= 0 and table[i] != NULL_BLOCK:
                self._release(table[i])
                table[i] = NULL_BLOCK
                i -= 1

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        self._slide(seq)
        needed = seq.num_computed_tokens + num_new_tokens
        want = sum(max(0, -(-needed // g.block_size) - len(t)) for g, t in zip(self.groups, self._tables(seq)))
        return want <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead_slots: int = 0) -> None:
        """Slide the windows, then as the plain manager: room for the new tokens (and lookahead slots) in every
        group, and each group's newly filled blocks offered to the prefix cache."""
        start = seq.num_computed_tokens
        total = start + num_new_tokens
        needed = total + num_lookahead_slots
        filled = min(total, len(seq.token_ids))
        quiet = self._quiet.get(seq.seq_id)
        if quiet is not None and needed <= quiet[0] and filled < quiet[1]:
            return
        if not seq.group_tables:
            seq.group_tables = [[] for _ in self.groups[1:]]
            seq.group_hashes = [[] for _ in self.groups[1:]]
        self._slide(seq)
        done: dict[int, list[int]] = {}
        for g, (group, table, hashes) in enumerate(
            zip(self.groups, self._tables(seq), [seq.block_hashes, *seq.group_hashes])
        ):
            bs = group.block_size
            for _ in range(-(-needed // bs) - len(table)):
                table.append(self._take_free_block())
            if self.enable_prefix_caching and len(hashes) < filled // bs:
                self._register(seq, g, table, hashes, filled // bs, done)
        self._quiet[seq.seq_id] = self._quiet_bounds(seq)

    def _quiet_bounds(self, seq: Sequence) -> tuple[int, int]:
        """Where seq's next allocation and registration happen (see _quiet)."""
        held = fill = 1 << 62
        hashes = [seq.block_hashes, *seq.group_hashes]
        for group, table, group_hashes in zip(self.groups, self._tables(seq), hashes):
            held = min(held, len(table) * group.block_size)
            if self.enable_prefix_caching:
                fill = min(fill, (len(group_hashes) + 1) * group.block_size)
        return held, fill

    def _register(
        self, seq: Sequence, g: int, table: list[int], hashes: list[int], num_full: int, done: dict[int, list[int]]
    ) -> None:
        """Hash group g's blocks up to num_full and offer each to the prefix cache (first writer wins); done: the
        hash lists this step already extended, by block size (groups of one block size share their chain)."""
        bs = self.groups[g].block_size
        known = done.get(bs, hashes)
        prev = hashes[-1] if hashes else -1
        for i in range(len(hashes), num_full):
            if i < len(known):
                prev = known[i]
            else:
                prev = hash_block(seq.token_ids[i * bs : (i + 1) * bs], prev)
            hashes.append(prev)
            block, key = self.blocks[table[i]], self._key(g, prev)
            if table[i] == NULL_BLOCK or block.hash != -1 or key in self.hash_to_block_id:
                continue
            block.hash, block.token_ids = key, seq.token_ids[i * bs : (i + 1) * bs]
            self.hash_to_block_id[key] = block.block_id
            self.block_group[block.block_id] = g
            if self.kv_events is not None and not g:  # events name group 0's blocks, as a plain cache's
                self.kv_events.append(stored(prev, hashes[i - 1] if i else None, block.token_ids, bs))
        done.setdefault(bs, hashes)

    def _take_free_block(self) -> int:
        """The plain manager's, except that evicting another group's block sends no KV event (none was stored)."""
        block_id = next(iter(self.free_block_ids))
        block = self.blocks[block_id]
        if self.block_group[block_id] and block.hash != -1:
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = -1, []
        return super()._take_free_block()

    # ---- release -------------------------------------------------------------------------------
    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None

    def free(self, seq: Sequence) -> None:
        self._quiet.pop(seq.seq_id, None)
        for table in self._tables(seq):
            for block_id in reversed(table):
                if block_id != NULL_BLOCK:
                    self._release(block_id)
        seq.block_table, seq.block_hashes = [], []
        seq.group_tables = [[] for _ in self.groups[1:]]
        seq.group_hashes = [[] for _ in self.groups[1:]]
        seq.num_computed_tokens = 0
