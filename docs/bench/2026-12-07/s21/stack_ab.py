"""Qwen3.5-0.8B Q4_K_M decode, the C stack on and off in one process, interleaved (lab).
python stack_ab.py <Qwen3.5 Q4_K_M GGUF>"""

import statistics
import sys

import labtime as lt

from novainfer import LLM
from novainfer.worker import cpu_hybrid_stack

llm = LLM(sys.argv[1])
fwd = cpu_hybrid_stack.CPUHybridStack.forward


def ms_per_step():
    return (lt.generate_s(llm, 129) - lt.generate_s(llm, 1)) / 128 * 1e3


lt.generate_s(llm, 8)
res = {"stack": [], "layers": []}
for i in range(6):
    for mode in ("stack", "layers") if i % 2 == 0 else ("layers", "stack"):
        cpu_hybrid_stack.CPUHybridStack.forward = fwd if mode == "stack" else (lambda self, *a: None)
        res[mode].append(ms_per_step())
for k, v in res.items():
    print(
        f"{k:7s} ms/step: "
        + ", ".join(f"{x:.2f}" for x in v)
        + f"  median {statistics.median(v):.2f} -> {1e3 / statistics.median(v):.1f} tok/s"
    )
print(f"ratio (layers / stack, medians): {statistics.median(res['layers']) / statistics.median(res['stack']):.3f}")
