"""Soak the overlapped loop over the mp executor (tp=2, gloo on the CPU) for races the tests' fixed cases miss.

Part 1: for --seconds, random batches (1-7 prompts, 1-30 new tokens, some aborted at a random step, a health
check between two random steps, a KV cache small enough to preempt) run greedily on tp=2 `mp` with async
scheduling and on tp=1 with the synchronous loop; every request that was not aborted must get the same
tokens, and all KV blocks must be free after each batch.
Part 2: --kills times, a fresh tp=2 engine has rank 0 or rank 1 killed (SIGKILL) after a random number of
steps; the next steps must raise naming that rank, quickly, with no process left.

    python -c "from tests.tiny_models import make_tiny_model as m; m('/tmp/tiny-tp2', 'qwen2', num_heads=8, num_kv_heads=4, head_dim=8)"
    python benchmarks/tuning/mp_overlap_soak.py --model /tmp/tiny-tp2 --seconds 180 --kills 8
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. The capital of France is",
    "def add(a, b):",
    "Paged attention stores keys and values in fixed-size blocks",
    "héllo wörld",
    "The capital of France is",
    "numbers 0123456789 and more numbers",
]
ENGINE = dict(block_size=4, max_num_batched_tokens=16, dtype="float32", cpu_kv_cache_tokens=128, device="cpu")
MP = dict(tensor_parallel_size=2, distributed_executor_backend="mp", master_port=0, async_scheduling=True)


def run_batch(engine, requests, abort_at: dict, health_at: int | None = None) -> dict:
    """Step the engine through the requests; the tokens of each one that finished other than by abort."""
    from novainfer import SamplingParams

    for rid, prompt, n in requests:
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    done = {}
    for step in range(400):
        for rid, at in abort_at.items():
            if step == at:
                engine.abort_request(rid)
        if step == health_at:
            engine.executor.check_health()
        for out in engine.step():
            if out.finished and out.outputs[0].finish_reason != "abort":
                done[out.request_id] = out.outputs[0].token_ids
        if not engine.engine_core.has_unfinished_requests():
            break
    assert engine.block_manager.num_free_blocks == engine.engine_core.num_blocks, "KV blocks leaked"
    return done


def soak(args, rng: random.Random) -> int:
    from novainfer import LLM

    tp1 = LLM(args.model, async_scheduling=False, **ENGINE).llm_engine
    mp = LLM(args.model, **MP, **ENGINE).llm_engine
    batches, t0 = 0, time.monotonic()
    try:
        while time.monotonic() - t0 < args.seconds:
            requests = [(f"{batches}-{i}", rng.choice(PROMPTS), rng.randint(1, 30)) for i in range(rng.randint(1, 7))]
            aborts = {rid: rng.randint(0, 15) for rid, _, _ in requests if rng.random() < 0.3}
            want = run_batch(tp1, requests, {})
            got = run_batch(mp, requests, aborts, rng.randint(0, 10))
            assert all(got[rid] == want[rid] for rid in got), f"batch {batches}: tokens differ from tp=1"
            assert not set(want) - set(got) - set(aborts), f"batch {batches}: a request did not finish"
            batches += 1
    finally:
        mp.shutdown()
    return batches


def kill_round(args, rng: random.Random) -> tuple[int, int, float]:
    """(killed rank, rank named, seconds from the kill to the error)."""
    import re

    from novainfer import LLM, SamplingParams

    engine = LLM(args.model, **MP, **ENGINE).llm_engine
    try:
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        for _ in range(rng.randint(0, 12)):
            engine.step()
        victim = rng.choice(engine.executor.procs)
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            for _ in range(100):
                engine.step()
        except RuntimeError as exc:
            named = re.search(r"worker rank=(\d+)", str(exc))
            assert not any(p.is_alive() for p in engine.executor.procs), "a worker outlived the failure"
            return victim.tp_rank, int(named.group(1)) if named else -1, time.monotonic() - t0
        raise AssertionError("killing a rank raised nothing")
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an HF folder whose heads split over 2 ranks")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    print(f"batches token-identical to tp=1: {soak(args, rng)} in {args.seconds:.0f} s", flush=True)
    for k in range(args.kills):
        killed, named, seconds = kill_round(args, rng)
        print(f"kill {k}: killed rank {killed}, error names rank {named}, after {seconds:.2f} s", flush=True)
        assert named == killed, "the error names another rank"


if __name__ == "__main__":
    main()
