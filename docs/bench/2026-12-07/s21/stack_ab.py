"""Qwen3.5-0.8B Q4_K_M decode, the C stack on and off in one process, interleaved (lab)."""

import os
import random
import sys
import time

import statistics

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
from novainfer import LLM, SamplingParams
from novainfer.worker import cpu_hybrid_stack

llm = LLM(sys.argv[1])
fwd = cpu_hybrid_stack.CPUHybridStack.forward


def run(n):
    p = [random.randrange(1000, 200000) for _ in range(16)]
    t = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False
    )
    return time.perf_counter() - t


def ms_per_step():
    return (run(129) - run(1)) / 128 * 1e3


run(8)
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
