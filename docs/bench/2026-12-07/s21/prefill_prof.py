"""Lab (session 21): a Qwen3.5-0.8B Q4_K_M 512-token prefill split into the linear layers, the DeltaNet C prefill, the
gated norm and attention (wrappers around each entry point). python prefill_prof.py <Qwen3.5 Q4_K_M GGUF>"""

import sys

import labtime as lt

from novainfer import LLM
from novainfer.kernels.cpu import gated_delta, ops
from novainfer.layers.quantization import gguf_cpu

lt.wrap(gated_delta, "prefill", "gdn prefill (conv+rule)")
lt.wrap(gated_delta, "gated_rms_norm", "gated_rms_norm")
lt.wrap(gguf_cpu.GGUFCPULinearMethod, "apply", "linear apply")
for n in dir(ops):
    if n.startswith("prefill_attention"):
        lt.wrap(ops, n, "attn " + n)
llm = LLM(sys.argv[1])
lt.generate_s(llm, 1, 512)
lt.reset()
T = lt.generate_s(llm, 1, 512)
print(f"prefill 512: {T * 1e3:.0f} ms")
lt.report(1, 1, 30)
