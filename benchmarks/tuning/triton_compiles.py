"""Which Triton kernels compile during a benchmark's timed run (a fresh machine's first run of the 7B
bench shape was 7-10% slower than the next, with the same code). Wraps JITFunction._do_compile, which runs on
every in-memory cache miss (a real compile, or a load from Triton's disk cache), and LLM.generate, to tell the
engine's start-up from the timed generate calls. Point TRITON_CACHE_DIR at an empty folder to see a fresh
machine's compiles:

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/tuning/triton_compiles.py -- \
        --model random:qwen2.5-7b --quantization fp8

Everything after `--` goes to benchmarks/throughput.py. Prints one row per compile: when (start-up or generate),
the kernel, its constexprs, and the seconds it took.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from triton.runtime.jit import JITFunction  # noqa: E402

EVENTS: list[tuple[str, str, str, float]] = []
KEYS: list[tuple[str, str, str]] = []  # (phase, kernel, specialization key): what made a variant new
PHASE = ["start-up"]


def _wrap_compile() -> None:
    real = getattr(JITFunction, "_do_compile", None)
    if real is None:
        raise SystemExit("this Triton's JITFunction has no _do_compile to wrap")

    def timed(self, key, signature, device, constexprs, *args, **kwargs):
        t = time.perf_counter()
        out = real(self, key, signature, device, constexprs, *args, **kwargs)
        name = getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "?")
        consts = ", ".join(f"{k}={v}" for k, v in (constexprs.items() if isinstance(constexprs, dict) else []))
        EVENTS.append((PHASE[0], name, consts[:120], time.perf_counter() - t))
        KEYS.append((PHASE[0], name, str(key)))
        return out

    JITFunction._do_compile = timed


def _wrap_generate() -> None:
    from novainfer.entrypoints.llm import LLM

    real = LLM.generate

    def generate(self, *args, **kwargs):
        PHASE[0] = "generate"
        try:
            return real(self, *args, **kwargs)
        finally:
            PHASE[0] = "between"

    LLM.generate = generate


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    _wrap_compile()
    _wrap_generate()
    from benchmarks import throughput

    sys.argv = ["throughput.py", *argv]
    throughput.main()
    print("\n| phase | kernel | constexprs | seconds |\n| --- | --- | --- | --- |")
    for phase, name, consts, s in EVENTS:
        print(f"| {phase} | {name} | {consts} | {s:.3f} |")
    names = {name for phase, name, _ in KEYS if phase == "generate"}
    print("\nspecialization keys of the kernels compiled during generate, at every phase:")
    for phase, name, key in KEYS:
        if name in names:
            print(f"{phase} {name}: {key[:700]}")
    for phase in ("start-up", "generate", "between"):
        sel = [s for p, _, _, s in EVENTS if p == phase]
        print(f"{phase}: {len(sel)} compiles or loads, {sum(sel):.2f} s")


if __name__ == "__main__":
    main()
