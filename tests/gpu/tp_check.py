"""Run on a machine with two NVIDIA GPUs: python3 tests/gpu/tp_check.py   (about 5-8 minutes)

1. Greedy tokens in float32, Qwen2.5-0.5B config with random weights: tp=2 under uni (one process, a
   thread per GPU, eager) and under mp (a process per GPU, NCCL, CUDA graphs) vs tp=1, 4 prompts x 32 tokens.
2. Output throughput, Qwen2.5-7B config with random bf16 weights on the bench shape
   (256 prompts of 100-1024 random tokens, 100-1024 outputs, max_num_batched_tokens 16384,
   max_model_len 4096): tp=1 vs tp=2 (mp), each in a fresh process through benchmarks/throughput.py.
Prints a table (and writes JSON under --out); exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.checkpoints import resolve_model  # noqa: E402
from novainfer import LLM, SamplingParams  # noqa: E402
from tests.gpu.checks import check, rows  # noqa: E402


def greedy_tokens(path: str, prompts: list[list[int]], tp: int, backend: str) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    llm = LLM(
        path,
        dtype="float32",
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
        master_port=0,
        max_model_len=512,
        max_num_seqs=8,
        num_gpu_blocks=256,
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
            use_tqdm=False,
        )
        return [o.outputs[0].token_ids for o in outs], time.perf_counter() - t0
    finally:
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def parity_checks() -> None:
    path = resolve_model("random:qwen2.5-0.5b", cache_dir="/tmp/novainfer-bench-fp32", dtype=torch.float32)
    rng = random.Random(0)
    prompts = [[rng.randint(2, 10000) for _ in range(n)] for n in (7, 23, 41, 64)]
    ref, secs = greedy_tokens(path, prompts, 1, "uni")
    check("tp=1 float32 baseline", f"{sum(map(len, ref))} tokens in {secs:.1f} s", len(ref) == 4)
    for backend in ("uni", "mp"):
        name = f"tp=2 {backend} == tp=1 greedy (Qwen2.5-0.5B, float32)"
        try:
            got, secs = greedy_tokens(path, prompts, 2, backend)
        except Exception:
            traceback.print_exc()
            check(name, "raised (traceback above)", False)
            continue
        same = sum(a == b for x, y in zip(got, ref) for a, b in zip(x, y))
        first = next((i for i, (x, y) in enumerate(zip(got, ref)) if x != y), None)
        check(
            name, f"{same}/{sum(map(len, ref))} tokens equal, first differing prompt {first}, {secs:.1f} s", got == ref
        )


def throughput(tp: int, out_dir: str, timeout: int) -> dict | None:
    out = os.path.join(out_dir, f"throughput_7b_tp{tp}.json")
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "throughput.py"),
        "--model",
        "random:qwen2.5-7b",
        "--max-num-batched-tokens",
        "16384",
        "--max-model-len",
        "4096",
        "--tensor-parallel-size",
        str(tp),
        "--distributed-executor-backend",
        "mp" if tp > 1 else "uni",
        "--json",
        out,
    ]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
    print(proc.stdout[-1500:], proc.stderr[-3000:] if proc.returncode else "", flush=True)
    if proc.returncode:
        check(f"throughput tp={tp}", f"exit code {proc.returncode}", False)
        return None
    with open(out) as f:
        return json.load(f)


def throughput_checks(out_dir: str) -> None:
    r1 = throughput(1, out_dir, timeout=330)  # the first run also writes the 7B checkpoint
    r2 = throughput(2, out_dir, timeout=240)
    if r1 and r2:
        speedup = r2["novainfer_tok_s"] / r1["novainfer_tok_s"]
        print("\n| Qwen2.5-7B bf16 | output tok/s | time (s) | KV cache tokens per rank |\n|---|---|---|---|")
        for r in (r1, r2):
            print(
                f"| tp={r['tensor_parallel_size']} ({r['distributed_executor_backend']}) | "
                f"{r['novainfer_tok_s']:,.0f} | {r['novainfer_s']:.2f} | {r['kv_cache_tokens']:,} |"
            )
        check("tp=2 output throughput > tp=1 (Qwen2.5-7B bench shape)", f"{speedup:.2f}x", speedup > 1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/tp_check", help="JSON results go here")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
        return 2
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    parity_checks()
    if not args.skip_throughput:
        throughput_checks(args.out)
    print("\n| check | result | ok |\n|---|---|---|")
    for name, detail, ok in rows:
        print(f"| {name} | {detail} | {'PASS' if ok else 'FAIL'} |")
    print(
        f"devices: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}; "
        f"torch {torch.__version__}; {time.perf_counter() - t0:.0f} s"
    )
    with open(os.path.join(args.out, "tp_check.json"), "w") as f:
        json.dump([dict(check=n, result=d, ok=o) for n, d, o in rows], f, indent=2)
    return 0 if all(ok for _, _, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
