"""Giving the C heap's free pages back to the system (glibc's malloc_trim).

A prefill step's workspaces (activations of up to max_num_batched_tokens rows, each layer's weight dequantized
for the GEMM) are freed when the step ends, but glibc keeps the freed pages in its heap for reuse: about
180 MB after 8k-token prefill steps of the default model on the CPU. The engine core process trims once it
goes idle (EngineConfig.trim_heap_when_idle), so a quiet server holds its weights, KV cache and libraries,
not its last burst's workspaces; the next burst faults the pages back in, once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

logger = logging.getLogger(__name__)
_UNSET = object()
_trim = _UNSET


def _malloc_trim():
    global _trim
    if _trim is _UNSET:
        try:
            _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
            _trim = None
    return _trim


def trim_malloc_heap() -> bool:
    """Return every malloc arena's free pages to the system; False where the C library has no malloc_trim."""
    trim = _malloc_trim()
    if trim is None:
        return False
    start = time.perf_counter()
    released = trim(0)
    logger.debug(
        "malloc_trim: %s in %.1f ms",
        "released memory" if released else "nothing to release",
        (time.perf_counter() - start) * 1e3,
    )
    return True
