"""Moves a model's packed CPU weights into one anonymous mapping advised for transparent huge pages.

A decode step streams every packed weight once (~100 MB for the default model). With 4 KiB pages that is
~25k TLB misses a token, and the hardware prefetchers stop at every page edge; with 2 MiB pages the stream
runs through. Linux gives an anonymous mapping huge pages when THP is "always", or "madvise" and the range is
advised (the common default), so the arena advises itself; where THP is off the copy is harmless. Weights go
in the order the model reads them, each 64-byte aligned; the arena lives as long as its tensors do
(torch.frombuffer keeps the mapping referenced).
"""

from __future__ import annotations

import logging
import mmap

import torch

from novainfer.kernels.cpu.repack import PackedWeight

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64


def _tensors(p: PackedWeight) -> list[torch.Tensor]:
    return [t for t in (p.qweight, p.scales, p.zeros) if t is not None]


def move_to_arena(packs: list[PackedWeight]) -> int:
    """Copy every tensor of `packs` (in order; a weight listed twice moves once) into one huge-page-advised
    mapping and point the PackedWeights at the copies. Returns the arena's size in bytes (0: not done)."""
    unique = list({id(p): p for p in packs}.values())
    sizes = [t.numel() * t.element_size() for p in unique for t in _tensors(p)]
    total = sum(-(-s // ALIGN) * ALIGN for s in sizes)
    if not total or not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    length = -(-total // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a huge-page boundary
    arena = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        arena.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # THP compiled out: plain pages, still one sequential stream
        logger.debug("MADV_HUGEPAGE refused: %s", exc)
    raw = torch.frombuffer(arena, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE

    def place(t: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal offset
        if t is None:
            return None
        n = t.numel() * t.element_size()
        out = raw[offset : offset + n].view(t.dtype).view(t.shape)
        out.copy_(t)
        offset += -(-n // ALIGN) * ALIGN
        return out

    for p in unique:
        p.qweight, p.scales, p.zeros = (
            place(p.qweight.contiguous()),
            place(p.scales.contiguous()),
            place(None if p.zeros is None else p.zeros.contiguous()),
        )
    return total
