"""Where a hybrid model's GPU time goes: the step anatomy of random:qwen3.5-9b beside random:qwen2.5-7b.

For each model (its own subprocess, dummy weights, bf16): a bench-shape run (N prompts x (IN + OUT) tokens) timed
as a whole and split into prefill-carrying and decode-only steps (wall time per step kind from the engine's step
loop), then a torch.profiler pass over a short slice of the same workload (prefill steps and decode steps) that
prints the top CUDA kernels and the top host ops by total time, and a batch-1 decode step profiled eagerly.

    python3 benchmarks/hybrid_profile.py                  # on the GPU machine
    python3 benchmarks/hybrid_profile.py --dry-run        # the CPU, tiny random hybrid checkpoint, tiny workload
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def step_anatomy(llm) -> dict:
    """Wrap the engine's step to record each step's wall time and whether it carried prefill tokens."""
    engine = llm.llm_engine
    records: list[tuple[bool, float, int]] = []
    sched = engine.scheduler
    inner = engine.step

    def timed_step(*a, **kw):
        running = list(getattr(sched, "running", []))
        prefill = bool(getattr(sched, "waiting", None)) or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in running
        )
        t = time.perf_counter()
        if not records and os.environ.get("HYBRID_PROFILE_CPROFILE"):
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            out = prof.runcall(inner, *a, **kw)
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
            print(buf.getvalue()[-9000:], file=sys.stderr, flush=True)
        else:
            out = inner(*a, **kw)
        records.append((prefill, time.perf_counter() - t, len(running)))
        return out

    engine.step = timed_step
    return {"records": records, "restore": lambda: setattr(engine, "step", inner)}


def bench_setup(model: str, dev: str, n: int, inp: int) -> tuple:
    """The bench-shape LLM (bf16 on the GPU, fp32 on the CPU; dummy weights for random: shapes), n random prompts of
    inp tokens, warmed up on two of them."""
    from benchmarks.checkpoints import load_format, resolve_model
    from novainfer import LLM, SamplingParams

    path = resolve_model(model)
    kw = {"dtype": "bfloat16", "gpu_memory_utilization": 0.9} if dev == "cuda" else {"dtype": "float32"}
    llm = LLM(path, load_format=load_format(model), max_model_len=4096 if dev == "cuda" else 256, **kw)
    rng = random.Random(0)
    top = min(llm.llm_engine.processor.vocab_size, 10000) - 1
    prompts = [{"prompt_token_ids": [rng.randint(2, top) for _ in range(inp)]} for _ in range(n)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    return llm, prompts


def batch1_decode_ms(llm, prompt: list[int], steps: int) -> float:
    """Milliseconds per decode step of one greedy request (best of two, less the prompt's own time)."""
    from novainfer import SamplingParams

    def timed(k: int) -> float:
        t = time.perf_counter()
        llm.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True), use_tqdm=False
        )
        return time.perf_counter() - t

    timed(8)
    return (min(timed(steps + 1) for _ in range(2)) - min(timed(1) for _ in range(2))) / steps * 1e3


def run_one(model: str, dev: str, n: int, inp: int, out: int, profile_steps: int) -> dict:
    """Build the model, time the workload, profile a slice, return the numbers."""
    from torch.profiler import ProfilerActivity, profile

    from novainfer import SamplingParams

    llm, prompts = bench_setup(model, dev, n, inp)
    params = SamplingParams(temperature=0.6, max_tokens=out, ignore_eos=True, seed=0)
    anat = step_anatomy(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    anat["restore"]()
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    recs = anat["records"]
    pre = [d for p, d, _ in recs if p]
    dec = [d for p, d, _ in recs if not p]
    result = {
        "model": model,
        "tok_s": gen / elapsed,
        "seconds": elapsed,
        "steps": len(recs),
        "prefill_steps": len(pre),
        "prefill_s": sum(pre),
        "decode_steps": len(dec),
        "decode_s": sum(dec),
        "decode_ms_median": sorted(dec)[len(dec) // 2] * 1e3 if dec else 0.0,
        "first_steps": [(p, round(d * 1e3, 1), r) for p, d, r in recs[:14]],
    }
    one = prompts[0]["prompt_token_ids"][:128]
    result["batch1_ms"] = batch1_decode_ms(llm, one, 128 if dev == "cuda" else 8)
    if not profile_steps:
        return result
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    slice_n = min(n, 64)
    with profile(activities=acts) as prof:
        llm.generate(
            prompts[:slice_n], SamplingParams(max_tokens=profile_steps, ignore_eos=True, temperature=0), use_tqdm=False
        )
    sort = "cuda_time_total" if dev == "cuda" else "cpu_time_total"
    result["profile_slice"] = f"{slice_n} prompts x ({inp} + {profile_steps})"
    result["top_kernels"] = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70)
    result["top_host"] = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70
    )
    # batch-1 decode, 32 steps after a 128-token prompt, profiled
    with profile(activities=acts) as prof1:
        llm.generate(
            [{"prompt_token_ids": one}], SamplingParams(temperature=0, max_tokens=33, ignore_eos=True), use_tqdm=False
        )
    result["batch1_kernels"] = prof1.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--models", nargs="*", default=["random:qwen3.5-9b", "random:qwen2.5-7b"])
    ap.add_argument("--shape", default="256,512,256", help="N,IN,OUT")
    ap.add_argument("--profile-steps", type=int, default=16, help="0: no profiler passes")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    n, inp, out = map(int, args.shape.split(","))
    if args.one:
        if dev == "cuda":
            from tests.gpu.gdn_check import add_fla_wheels

            add_fla_wheels()
        with open(args.out, "w") as f:
            json.dump(run_one(args.one, dev, n, inp, out, args.profile_steps), f)
        return
    models = args.models
    if args.dry_run and models == ap.get_default("models"):
        from tests.tiny_hybrid import build

        models = [build(os.path.join(tempfile.mkdtemp(), "qwen3_5"), "qwen3_5"), "random:tiny"]
        n, inp, out = 4, 32, 8
    rows = []
    for model in models:
        path = tempfile.mktemp(suffix=".json")
        cmd = [sys.executable, os.path.abspath(__file__), "--one", model, "--out", path, "--shape", f"{n},{inp},{out}"]
        cmd += ["--profile-steps", str(args.profile_steps)] + (["--dry-run"] if args.dry_run else [])
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if os.environ.get("HYBRID_PROFILE_CPROFILE"):
            print(proc.stderr[-9500:])
        if proc.returncode or not os.path.exists(path):
            print(f"== {model}: failed rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}")
            continue
        with open(path) as f:
            r = json.load(f)
        rows.append(r)
        print(f"{model}: first steps (prefill?, ms, running before): {r['first_steps']}")
        if "top_kernels" not in r:
            continue
        print(f"\n===== {model}: profile slice {r['profile_slice']} =====\n{r['top_kernels']}")
        print(f"----- {model}: host ops by self time -----\n{r['top_host']}")
        print(f"----- {model}: batch-1 decode (128-token prompt, 33 tokens) -----\n{r['batch1_kernels']}")
    print(
        f"\n| model | tok/s ({n} x {inp}+{out}) | s | steps | prefill steps / s | decode steps / s | decode ms (median) "
        "| batch-1 ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['model']} | {r['tok_s']:.0f} | {r['seconds']:.1f} | {r['steps']} | {r['prefill_steps']} / "
            f"{r['prefill_s']:.1f} | {r['decode_steps']} / {r['decode_s']:.1f} | {r['decode_ms_median']:.1f} | {r['batch1_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
