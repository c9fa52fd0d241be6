"""The default model's packed weights in the huge-page arena (weight_arena.py, the default) against plain torch
allocations of the same bytes, switched in one process and interleaved round by round: batch-1 decode tok/s
((n - 1) / (t(n tokens) - t(1 token)), a fresh 128-token prompt per run) and a 512-token prefill.

    python benchmarks/cpu_weight_arena_ab.py --rounds 8
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.throughput import make_workload  # noqa: E402


def anon_huge_kib() -> int:
    """AnonHugePages of this process (kB), from /proc/self/smaps_rollup."""
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    from novainfer import LLM, SamplingParams
    from novainfer.kernels.cpu.decoder_stack import CPUDecoderStack
    from novainfer.kernels.cpu.repack import PackedWeight
    from novainfer.loader.model_loader import resolve_model_path
    llm = LLM(resolve_model_path(None))
    packs = list({id(o): o for o in gc.get_objects() if isinstance(o, PackedWeight)}.values())
    stacks = [o for o in gc.get_objects() if isinstance(o, CPUDecoderStack)]
    arena = [(p.qweight, p.scales, p.zeros) for p in packs]
    plain = [tuple(None if t is None else t.clone() for t in ts) for ts in arena]
    print(f"{len(packs)} packed weights, {sum(t.numel() * t.element_size() for ts in arena for t in ts if t is not None) / 1e6:.1f} MB; "
          f"AnonHugePages {anon_huge_kib() / 1024:.0f} MiB (arena and plain copies both resident)")

    def use(tensors) -> None:
        for p, (q, s, z) in zip(packs, tensors):
            p.qweight, p.scales, p.zeros = q, s, z
        for st in stacks:
            st.caches = ()  # the C stack re-gathers its weight pointers
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    seeds = iter(range(100, 100_000))

    def run(n: int, length: int = 128) -> float:
        p = make_workload(1, length, 1, vocab, next(seeds))[0][0]
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t0
    variants = {"huge-page arena (default)": arena, "plain torch tensors": plain}
    res = {k: {"decode": [], "prefill": []} for k in variants}
    for v in variants.values():
        use(v)
        run(4)
    for _ in range(args.rounds):
        for name, v in variants.items():
            use(v)
            one, full = run(1), run(args.output_len)
            res[name]["decode"].append((args.output_len - 1) / (full - one))
            res[name]["prefill"].append(run(1, 512) * 1e3)
    print("\n| weights | decode tok/s per round | median | 512-token prefill ms, median |\n|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {' '.join(f'{x:.1f}' for x in r['decode'])} | {statistics.median(r['decode']):.1f} | "
              f"{statistics.median(r['prefill']):,.0f} |")
    a, b = res.values()
    wins = sum(x > y for x, y in zip(a["decode"], b["decode"]))
    print(f"arena faster in {wins}/{args.rounds} rounds; median ratio "
          f"{statistics.median(x / y for x, y in zip(a['decode'], b['decode'])):.3f}")
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
