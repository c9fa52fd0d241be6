"""Keeping Python's cyclic garbage collector off the engine's startup heap.

A loaded engine holds about a million tracked objects (torch, transformers, the model, the block pool: 366k
blocks on an H200); a full collection walks them all, 0.2-0.5 s in which no step runs, and one comes every few
hundred steps' worth of surviving allocations. Frozen objects are skipped by collections (they are still freed
by reference counting), as vLLM does once its engine core has started.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


def freeze_startup_heap() -> None:
    """Freeze every object alive now, for good: for a process that lives exactly as long as its engine. (No
    gc.collect() first: it would add ~0.5 s to every start here; startup garbage stays, once, bounded.)"""
    gc.freeze()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the objects alive now for the duration and give them back to the collector after (so an engine
    dropped later is still collected); left alone when something froze the heap already."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
