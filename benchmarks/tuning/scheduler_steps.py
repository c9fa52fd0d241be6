"""The scheduler and block manager alone on nano-vllm's bench shape, with an H200-sized block pool.

No model, no tokenizer: the real Scheduler and BlockManager plan every step of the workload
`benchmarks/throughput.py` runs (256 prompts of 100-1024 random tokens, 100-1024 output tokens, seed 0), and
each sampling sequence gets a token as soon as its step is planned (tokens one step late with --overlap, as
with async scheduling). Prints the host CPU time of schedule() per step, for decode steps of all the sequences
and over the whole run (with --split also of the block manager's calls, whose timing adds its own cost). The
default pool is the 366,726 blocks the H200 gives Qwen2.5-0.5B (5,867,616 KV tokens), where per-take costs
that grow with the pool show up.

    python benchmarks/tuning/scheduler_steps.py --num-blocks 366726
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-blocks", type=int, default=366_726)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--overlap", action="store_true", help="append each step's tokens after the next is planned")
    ap.add_argument("--split", action="store_true", help="also time the block manager's calls (adds overhead)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from benchmarks.throughput import make_workload
    from novainfer.config import SchedulerConfig
    from novainfer.engine.block_manager import BlockManager
    from novainfer.engine.scheduler import Scheduler
    from novainfer.sequence import Sequence
    from novainfer.sampling_params import SamplingParams

    prompts, outs = make_workload(args.num_prompts, None, None, 151_936, 0)
    bm = BlockManager(args.num_blocks, args.block_size)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=args.num_prompts, max_num_batched_tokens=args.max_num_batched_tokens), bm
    )
    block_cpu = [0.0]
    for name in (
        ("allocate_slots", "can_append", "free", "find_cached_prefix", "can_admit", "admit") if args.split else ()
    ):

        def timed(*a, _f=getattr(bm, name), **kw):
            c0 = time.thread_time()
            try:
                return _f(*a, **kw)
            finally:
                block_cpu[0] += time.thread_time() - c0

        setattr(bm, name, timed)
    for prompt, n in zip(prompts, outs):
        sched.add(Sequence(prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
    decode, total, block_total, steps = [], 0.0, 0.0, 0
    pending: list = []
    while sched.has_unfinished():
        block_cpu[0] = 0.0
        c0 = time.thread_time()
        out = sched.schedule()
        cpu = time.thread_time() - c0
        steps += 1
        total += cpu
        block_total += block_cpu[0]
        if out.is_pure_decode and len(out.scheduled) == args.num_prompts:
            decode.append((cpu, block_cpu[0]))
        sampled = [s.seq for s in out.scheduled if s.samples]
        ready, pending = (pending, sampled) if args.overlap else (sampled, [])
        for seq in ready:
            if not seq.is_finished and seq.num_pending_tokens:
                seq.append_token(1)
                if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                    sched.finish(seq)
    row = {
        "num_blocks": args.num_blocks,
        "steps": steps,
        "full_decode_steps": len(decode),
        "schedule_ms_per_decode_step": round(1e3 * sum(c for c, _ in decode) / max(1, len(decode)), 4),
        "schedule_ms_per_step": round(1e3 * total / steps, 4),
    }
    if args.split:
        row["block_manager_ms_per_decode_step"] = round(1e3 * sum(b for _, b in decode) / max(1, len(decode)), 4)
        row["block_manager_ms_per_step"] = round(1e3 * block_total / steps, 4)
    print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
