"""Lab (session 21): the Python around each Qwen3.5 layer's C call, from wrappers around the layer forward and the C
entry points. python q35_overhead.py <Qwen3.5 Q4_K_M GGUF>"""

import sys

import labtime as lt

from novainfer import LLM
from novainfer.kernels.cpu import gated_attn_layer, gdn_layer
from novainfer.models import llama, qwen3_5
from novainfer.worker import cpu_hybrid_stack


class LibProxy:
    """A ctypes library whose two layer entry points are timed."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, n):
        f = getattr(self._lib, n)
        return lt.timed(f, "C:" + n) if n in ("gdn_layer_decode", "gated_attn_layer_decode") else f


for mod in (gdn_layer, gated_attn_layer):
    proxy = LibProxy(mod._lib())
    mod._lib = lambda p=proxy: p
cpu_hybrid_stack.CPUHybridStack.forward = lambda self, *a: None  # the one-call-a-layer path it replaced
lt.wrap(qwen3_5.HybridDecoderLayer, "forward", "layer.forward")
lt.wrap(llama.LlamaModel, "forward", "model.forward")
llm = LLM(sys.argv[1])
lt.generate_s(llm, 8)
lt.step_report(llm, 128)
