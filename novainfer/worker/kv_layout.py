"""The KV cache layout that follows the architecture: layers grouped by attention kind, one shared block pool.

A model whose layers mix sliding-window and full attention (Gemma 2/3/4, gpt-oss) or slide on every layer
(Mistral) stores its K/V in KV groups: the layers of one kind (window and per-token size) are cut into groups of
`num_slots` layers each, and every group has its own block table. A pool block is one block of `num_slots` layers
(in `num_slots` tensor slots); a group's layer j lives in slot j, so a block id means the same bytes in whichever
group holds it. A sliding group lets go of the blocks all its layers have slid past, so a 5:1 model needs a full
group's blocks for its whole context and only a window's worth for the other five.

A kind with a smaller per-token size (Gemma 4's full layers: 4 heads of 512 against 16 of 256) takes more tokens a
block (its group's block_size), so every slot's block has the same bytes and each layer's view stays contiguous.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
import torch

logger = logging.getLogger(__name__)

# pool block 0 is never handed out: a sliding group's table points the blocks it let go of at it
NULL_BLOCK = 0


@dataclass(frozen=True)
class KVGroup:
    """One KV group: its layers' window (None: full attention) and tokens a block."""

    sliding_window: int | None
    block_size: int


@dataclass(frozen=True)
class KVLayout:
    """Groups (full-attention ones first), the tensor slots each block spans, the K elements a token of one slot
    takes (V the same), and each cache-owning layer's (group, slot)."""

    groups: tuple[KVGroup, ...]
    num_slots: int
    slot_elems: int
    places: tuple[tuple[int, int], ...]

    def bytes_per_block(self, block_size: int, itemsize: int) -> int:
        """Bytes of one pool block (K and V of every slot)."""
        return 2 * self.num_slots * self.slot_elems * block_size * itemsize

    def blocks_for(self, num_tokens: int) -> int:
        """Pool blocks one sequence of num_tokens holds at most once its context passed them (the sliding groups
        keep their window plus the block it starts in; the token being written may open one more)."""
        total = 0
        for g in self.groups:
            n = -(-num_tokens // g.block_size)
            if g.sliding_window is not None:
                n = min(n, -(-(g.sliding_window - 1) // g.block_size) + 2)
            total += n
        return total

    def tokens_held(self, num_blocks: int, seq_len: int) -> int:
        """Tokens that sequences of seq_len tokens each hold together in num_blocks pool blocks."""
        return (num_blocks - 1) // self.blocks_for(seq_len) * seq_len

    def max_context(self, num_blocks: int) -> int | None:
        """The longest context one sequence can hold in num_blocks pool blocks; None where every group slides
        (any length fits once the first window does)."""
        usable = num_blocks - 1
        if self.blocks_for(1) > usable:
            return 0
        if all(g.sliding_window is not None for g in self.groups):
            longest = max(g.sliding_window + 2 * g.block_size for g in self.groups)
            return None if self.blocks_for(longest) <= usable else self._longest(usable, longest)
        hi = max(g.block_size for g in self.groups)
        while self.blocks_for(hi) <= usable:
            hi *= 2
        return self._longest(usable, hi)

    def _longest(self, usable: int, hi: int) -> int:
        """The largest n < hi with blocks_for(n) <= usable (blocks_for(1) fits, blocks_for(hi) does not)."""
        lo = 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.blocks_for(mid) <= usable else (lo, mid)
        return lo


def plan_kv_layout(layers: list[tuple[int | None, int]], block_size: int) -> KVLayout | None:
    """The grouped layout of cache-owning layers given as (sliding_window, K elements a token), or None where the
    whole-context layout is kept: no layer slides, or the kinds' per-token sizes do not divide the largest."""
    if not layers or all(w is None for w, _ in layers):
        return None
    kinds: dict[tuple[int | None, int], list[int]] = {}
    for i, key in enumerate(layers):
        kinds.setdefault(key, []).append(i)
    slot_elems = max(e for _, e in kinds)
    if any(slot_elems % e for _, e in kinds):
        return None
    # full-attention kinds first: group 0 keeps every block of the context
    order = sorted(kinds, key=lambda k: (k[0] is not None, k[0] or 0, -k[1]))
    num_slots = min(len(v) for v in kinds.values())
    groups: list[KVGroup] = []
    places: list[tuple[int, int]] = [(0, 0)] * len(layers)
    for window, elems in order:
        idxs = kinds[(window, elems)]
        for start in range(0, len(idxs), num_slots):
            for slot, i in enumerate(idxs[start : start + num_slots]):
                places[i] = (len(groups), slot)
            groups.append(KVGroup(window, block_size * slot_elems // elems))
    return KVLayout(tuple(groups), num_slots, slot_elems, tuple(places))


def allocate_grouped(
    layers: list, layout: KVLayout, num_blocks: int, block_size: int, kv_dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One tensor [2, slots, blocks * block_size * slot_elems]; each cache-owning layer (in order) gets K/V views
    [blocks, its group's block_size, kv_heads, head_dim] of its slot and its group's index (Attention.kv_group)."""
    numel = 2 * layout.num_slots * num_blocks * block_size * layout.slot_elems
    lazy = device.type == "cpu" and numel * kv_dtype.itemsize >= 64 << 20  # zero pages from mmap: see kv_cache.py
    shape = (2, layout.num_slots, numel // (2 * layout.num_slots))
    kv = (torch.empty if lazy else torch.zeros)(shape, dtype=kv_dtype, device=device)
    for layer, (group, slot) in zip(layers, layout.places):
        view = (num_blocks, layout.groups[group].block_size, layer.num_kv_heads, layer.head_dim)
        layer.k_cache, layer.v_cache = kv[0, slot].view(view), kv[1, slot].view(view)
        layer.kv_group = group
    return kv


def worker_kv_layout(worker: Any) -> KVLayout | None:
    """A worker's grouped KV layout, or None for the whole-context one. For collective_rpc."""
    return worker.model_runner.kv_layout


def describe_groups(layout: KVLayout) -> str:
    """The groups in words: how many of each window, e.g. '1 full (16 tokens a block) + 5 sliding 1024'."""
    counts: dict[KVGroup, int] = {}
    for g in layout.groups:
        counts[g] = counts.get(g, 0) + 1
    return " + ".join(
        f"{n} {'full' if g.sliding_window is None else f'sliding {g.sliding_window}'} ({g.block_size} tokens a block)"
        for g, n in counts.items()
    )


def log_kv_layout(layout: KVLayout, num_blocks: int, whole_blocks: int, block_size: int) -> None:
    """Log the grouped cache's capacity at start-up, beside what the same memory holds with every layer keeping
    the whole context (whole_blocks blocks of block_size tokens)."""
    longest = layout.max_context(num_blocks)
    logger.info(
        "KV cache: %d blocks of %d layers in KV groups %s: one sequence's context up to %s tokens (%d with every "
        "layer keeping the whole context)",
        num_blocks,
        layout.num_slots,
        describe_groups(layout),
        "any number of" if longest is None else longest,
        whole_blocks * block_size,
    )
