"""llama.cpp (through llama-cpp-python, when installed) on the same GGUF file and the same token ids:
the baseline of benchmarks/latency.py --compare-llamacpp and benchmarks/throughput.py --cpu-streams.
Never a dependency of the tests; see README for how to install it."""

from __future__ import annotations

import time


def load(path: str, threads: int, n_ctx: int = 2048):
    """The llama.cpp model with greedy-ready settings, and its package version (prints it)."""
    import llama_cpp

    print(f"llama_cpp (llama-cpp-python) version {llama_cpp.__version__}, {threads} threads")
    return llama_cpp.Llama(
        path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
    ), llama_cpp.__version__


def greedy(llm, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy tokens for a fresh prompt (the context is reset first) and the wall time they took."""
    t0 = time.perf_counter()
    llm.reset()
    out = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
        out.append(tok)
        if len(out) == n:
            break
    return out, time.perf_counter() - t0


def greedy_after_first(llm, prompt: list[int], n: int) -> float:
    """Seconds from llama.cpp's first greedy token for a fresh prompt to its n-th."""
    llm.reset()
    first = last = None
    for i, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True)):
        last = time.perf_counter()
        first = first or last
        if i + 1 == n:
            break
    return last - first
