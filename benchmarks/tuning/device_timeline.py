"""Where a whole bench-shape run's device time goes: every kernel of one `generate` under torch.profiler (CUDA
activity only, so the host loop is barely slowed), split by kind of kernel and by kind of step.

    python3 benchmarks/tuning/device_timeline.py --model random:qwen2.5-7b --json out.json     # GPU
    python3 benchmarks/tuning/device_timeline.py --model random:qwen2.5-0.5b --num-prompts 4 --max-len 64 --device cpu

First the bench shape runs once unprofiled (seed 0, throughput.py's workload), then once profiled (seed 1, fresh
prompts, so no prefix-cache hit). Prints: device busy time (the union of kernel intervals) against the wall
time, the idle gaps by size, each kernel kind's time, and per kind of step (mixed prefill, decode by batch size)
the host interval, the device busy and idle time inside it and each kernel kind's share. A step's interval runs
from its schedule() to the next one's; with the overlapped loop a step's kernels run in the next interval, which
the per-kind averages absorb.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.checkpoints import load_format, resolve_model  # noqa: E402
from benchmarks.throughput import make_workload, sync  # noqa: E402

# kernel kind by a name fragment, first match wins
KINDS = [
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "splitk", "_scaled_mm", "gemv")),
    ("gdn_decode", ("_recurrent_kernel", "_conv_update_kernel", "fused_recurrent")),
    (
        "gdn_prefill",
        ("_chunk_", "_conv_kernel", "_conv_state_kernel", "chunk_", "l2norm", "solve_tril", "recompute_w_u"),
    ),
    ("gdn_state", ("state",)),
    ("prefill_attn", ("_prefill_kernel",)),
    ("decode_attn", ("_decode_kernel",)),
    ("moe", ("moe",)),
    ("norm", ("rms_norm",)),
    ("silu_mul", ("silu",)),
    ("rotary", ("rotary",)),
    ("kv_store", ("store_kv", "kv_store", "reshape_and_cache")),
    ("fp8_quant", ("fp8",)),
    ("sampler", ("gumbel", "sampl", "argmax", "softmax", "exponential", "topk", "sort")),
    ("memcpy", ("memcpy",)),
    ("memset", ("memset",)),
]
BATCH_BINS = [
    (192, "decode, batch >= 192"),
    (128, "decode, batch 128-191"),
    (64, "decode, batch 64-127"),
    (0, "decode, batch < 64"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, frags in KINDS if any(f in low for f in frags)), "other")


def union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merged, sorted intervals."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def overlap(merged: list[tuple[int, int]], lo: int, hi: int) -> int:
    """ns of the merged (sorted, disjoint) intervals inside [lo, hi)."""
    total = 0
    for s, e in itertools.islice(merged, bisect.bisect_right(merged, lo, key=lambda iv: iv[1]), None):
        if s >= hi:
            break
        total += min(e, hi) - max(s, lo)
    return total


def step_kind(num_seqs: int, prefill_tokens: int) -> str:
    if prefill_tokens:
        return "mixed (prefill tokens in the step)"
    return next(label for lo, label in BATCH_BINS if num_seqs >= lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=None, help="fixed prompt and output length (dry runs)")
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("--top", type=int, default=20, help="kernels listed by time")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from novainfer import LLM, SamplingParams

    llm = LLM(
        resolve_model(args.model),
        device=args.device,
        load_format=load_format(args.model),
        quantization=args.quantization,
    )
    core = llm.llm_engine.engine_core
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=4), use_tqdm=False)

    stop_ns = [0]

    def run(seed: int) -> tuple[float, int]:
        prompts, outs = make_workload(args.num_prompts, args.max_len, args.max_len, vocab, seed)
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in outs]
        sync()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        sync()
        stop_ns[0] = time.time_ns()
        return time.perf_counter() - t0, sum(outs)

    plain_s, plain_tokens = run(0)
    steps: list[tuple[int, int, int]] = []  # (time_ns, sequences, prefill tokens) at each schedule()
    schedule = core.schedule

    def logged_schedule():
        sched = schedule()
        if not sched.is_empty:
            prefill = sum(s.num_new_tokens for s in sched.scheduled if s.start < s.seq.num_prompt_tokens)
            steps.append((time.time_ns(), len(sched.scheduled), prefill))
        return sched

    core.schedule = logged_schedule
    cuda = torch.cuda.is_available() and args.device != "cpu"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        prof_s, prof_tokens = run(1)
    core.schedule = schedule
    end_ns = stop_ns[0]  # the last step's interval ends with the run, not with the profiler's trace processing
    want = "CUDA" if cuda else "CPU"
    raw = [
        e
        for e in prof.profiler.kineto_results.events()
        if str(e.device_type()).endswith(want) and e.end_ns() > e.start_ns() and (cuda or e.name().startswith("aten::"))
    ]
    by_name: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in raw:
        by_name[e.name()][0] += e.end_ns() - e.start_ns()
        by_name[e.name()][1] += 1
    events = sorted((e.start_ns(), e.end_ns(), kind_of(e.name())) for e in raw)
    merged = union([(s, e) for s, e, _ in events])
    busy = sum(e - s for s, e in merged)
    span = merged[-1][1] - merged[0][0] if merged else 0
    gaps = [b[0] - a[1] for a, b in zip(merged, merged[1:])]
    gap_bins = [
        (0, 10_000, "< 10 us"),
        (10_000, 100_000, "10-100 us"),
        (100_000, 1_000_000, "0.1-1 ms"),
        (1_000_000, 1 << 62, ">= 1 ms"),
    ]
    by_kind: dict[str, int] = defaultdict(int)
    for s, e, kind in events:
        by_kind[kind] += e - s
    kernel_sum = sum(by_kind.values())

    # per kind of step: the host interval from its schedule() to the next, and the device work inside it
    phase = defaultdict(lambda: defaultdict(float))
    j = 0
    for i, (t, nseq, pre) in enumerate(steps):
        hi = steps[i + 1][0] if i + 1 < len(steps) else end_ns
        p = phase[step_kind(nseq, pre)]
        p["steps"] += 1
        p["host_ns"] += hi - t
        p["busy_ns"] += overlap(merged, t, hi)
        p["seqs"] += nseq
        while j < len(events) and events[j][0] < t:
            j += 1
        k = j
        while k < len(events) and events[k][0] < hi:
            p[events[k][2]] += events[k][1] - events[k][0]
            k += 1

    print(
        f"\n{args.model} ({args.quantization or 'bf16'}), {args.num_prompts} prompts; device "
        f"{torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}"
    )
    print(f"unprofiled run (seed 0): {plain_s:.2f} s, {plain_tokens / plain_s:,.0f} output tok/s")
    print(f"profiled run (seed 1):   {prof_s:.2f} s, {prof_tokens / prof_s:,.0f} output tok/s, {len(steps)} steps")
    print(
        f"device: first-to-last kernel {span / 1e9:.3f} s, busy (union) {busy / 1e9:.3f} s "
        f"({busy / max(span, 1):.1%}), idle {(span - busy) / 1e9:.3f} s; {len(events):,} kernels"
    )
    print("\n| idle gap | count | total ms |\n|---|---|---|")
    for lo, hi, label in gap_bins:
        sel = [g for g in gaps if lo <= g < hi]
        print(f"| {label} | {len(sel):,} | {sum(sel) / 1e6:,.1f} |")
    print("\n| kernel kind | total ms | share of kernel time |\n|---|---|---|")
    for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v / 1e6:,.1f} | {v / max(kernel_sum, 1):.1%} |")
    print(f"\n| kernel (top {args.top} by time) | calls | total ms | share |\n|---|---|---|---|")
    for name, (ns, calls) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"| {name[:90]} | {calls:,} | {ns / 1e6:,.1f} | {ns / max(kernel_sum, 1):.1%} |")
    kinds = [k for k, _ in sorted(by_kind.items(), key=lambda kv: -kv[1])][:6]
    print(
        "\n| step kind | steps | mean batch | host ms/step | device busy ms/step | idle ms/step | "
        + " | ".join(f"{k} ms/step" for k in kinds)
        + " |\n"
        + "|---" * (6 + len(kinds))
        + "|"
    )
    for label, p in sorted(phase.items()):
        n = p["steps"]
        print(
            f"| {label} | {n:.0f} | {p['seqs'] / n:.0f} | {p['host_ns'] / n / 1e6:.2f} | "
            f"{p['busy_ns'] / n / 1e6:.2f} | {(p['host_ns'] - p['busy_ns']) / n / 1e6:.2f} | "
            + " | ".join(f"{p[k] / n / 1e6:.2f}" for k in kinds)
            + " |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "quantization": args.quantization,
                    "plain_s": plain_s,
                    "plain_tok_s": plain_tokens / plain_s,
                    "profiled_s": prof_s,
                    "steps": len(steps),
                    "span_s": span / 1e9,
                    "busy_s": busy / 1e9,
                    "kernels": len(events),
                    "by_kind_ms": {k: v / 1e6 for k, v in by_kind.items()},
                    "gaps": {
                        label: [len([g for g in gaps if lo <= g < hi]), sum(g for g in gaps if lo <= g < hi) / 1e6]
                        for lo, hi, label in gap_bins
                    },
                    "phases": {label: dict(p) for label, p in phase.items()},
                },
                f,
                indent=1,
            )
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
