"""The default model's 512-token prefill through LLM() (defaults, fresh prompt per run): this tree's CPU prefill
path against the one before issue 18's round 5 (dequantize + BLAS sgemm, torch SDPA attention), switched by
module flags in one process and interleaved run by run; optionally llama.cpp's prefill in the same rounds, and
a cProfile table (own time per function) of one prefill per path.

    python benchmarks/cpu_prefill_ab.py --rounds 7 --llamacpp --profile
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.throughput import make_workload  # noqa: E402
from novainfer.attention import cpu_backend  # noqa: E402
from novainfer.kernels.cpu import qgemm  # noqa: E402
from novainfer.layers.quantization import gguf_cpu  # noqa: E402


@contextlib.contextmanager
def old_path():
    """Dequantize + sgemm from PREFILL_ROWS rows on, the few-row kernel below, torch SDPA attention."""
    flags = gguf_cpu.PREFILL_DEQUANT, cpu_backend.PREFILL_KERNEL
    gguf_cpu.PREFILL_DEQUANT, cpu_backend.PREFILL_KERNEL = True, False
    qgemm.set_panel_min_rows(2**31 - 1)
    try:
        yield
    finally:
        gguf_cpu.PREFILL_DEQUANT, cpu_backend.PREFILL_KERNEL = flags
        qgemm.set_panel_min_rows(qgemm.PANEL_MIN_ROWS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--llamacpp", action="store_true", help="llama.cpp's prefill of the same file in each round")
    ap.add_argument("--profile", action="store_true", help="cProfile's top functions of one prefill per path")
    args = ap.parse_args()
    import torch

    from novainfer import LLM, SamplingParams
    from novainfer.loader.model_loader import resolve_model_path
    path = resolve_model_path(None)
    llm = LLM(path)
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    seeds = iter(range(1000, 100_000))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def fresh() -> list[int]:
        return make_workload(1, args.prompt_len, 1, vocab, next(seeds))[0][0]

    def nova(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - t0

    paths = {"before (dequant+sgemm, SDPA)": old_path, "after (defaults)": contextlib.nullcontext}
    runs = {k: (lambda ctx: lambda p: _within(ctx, nova, p))(ctx) for k, ctx in paths.items()}
    if args.llamacpp:
        from benchmarks import llamacpp_baseline
        lc, version = llamacpp_baseline.load(path, torch.get_num_threads())
        runs[f"llama.cpp {version}"] = lambda p: llamacpp_baseline.greedy(lc, p, 1)[1]
    times = {k: [] for k in runs}
    for run in runs.values():
        run(fresh())  # warm-up
    for _ in range(args.rounds):
        for key, run in runs.items():
            times[key].append(run(fresh()) * 1e3)
    print(f"\n{args.prompt_len}-token prefill, {torch.get_num_threads()} threads, fresh prompt per run, "
          f"{args.rounds} interleaved rounds\n| path | median ms | range ms |\n|---|---|---|")
    for key, t in times.items():
        print(f"| {key} | {statistics.median(t):,.0f} | {min(t):,.0f}-{max(t):,.0f} |")
    if args.llamacpp:
        lc_key = list(times)[-1]
        for key in paths:
            ratio = [b / a for a, b in zip(times[key], times[lc_key])]
            print(f"{key}: speed-up over llama.cpp per round {min(ratio):.2f}-{max(ratio):.2f}x, "
                  f"best vs best {min(times[lc_key]) / min(times[key]):.2f}x")
    if args.profile:  # cProfile: the C kernels' ctypes calls show as their Python wrappers' own time
        import cProfile
        import pstats
        for key, ctx in paths.items():
            prof = cProfile.Profile()
            with ctx():
                prof.runcall(nova, fresh())
            print(f"\n{key}:")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    llm.llm_engine.shutdown()


def _within(ctx, fn, prompt):
    with ctx():
        return fn(prompt)


if __name__ == "__main__":
    main()
