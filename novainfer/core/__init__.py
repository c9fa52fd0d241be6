"""llama.cpp-style core API: Batch (SoA), Context.decode, output rows, SLOT cache with kv_seq_* ops."""

from novainfer.core.batch import Batch
from novainfer.core.context import Context
from novainfer.core.kv_cache import SlotKvCache, Status

__all__ = ["Batch", "Context", "SlotKvCache", "Status"]
