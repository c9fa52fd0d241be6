"""One lent-GPU call's work for issue 19: checks, then throughput and latency with the overlapped loop on and
off (and HF transformers in the same run), printing one table. Raw JSON goes to --out.

    python3 benchmarks/gpu_round.py --part checks-0.5b --out $OUT
    python3 benchmarks/gpu_round.py --part 7b-moe --out $OUT
    python3 benchmarks/gpu_round.py --part fp8 --out $OUT          # --budget 540 by default
    python3 benchmarks/gpu_round.py --part round7 --out $OUT       # max_num_batched_tokens 8192 vs 16384 (7B)
    python3 benchmarks/gpu_round.py --part round7-final --out $OUT # checks, then the default token budget
    python3 benchmarks/gpu_round.py --part round7-sampler --out $OUT   # the same after the one-pass sampler

--budget: seconds for the whole part; a run starts only inside it and gets at most what is left (the table is
printed either way). --dry-run: the same steps on the CPU with the tiny random shape and small workloads (the GPU
check replaced by its CPU halves), to try the part where there is no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PARTS = {
    "checks-0.5b": [
        ("gpu_check", ["tests/gpu/gpu_check.py"]),
        ("tput 0.5b overlap on (+HF)", ["benchmarks/throughput.py", "--model", "random:qwen2.5-0.5b",
                                        "--compare-hf", "--hf-num-prompts", "128", "--async-scheduling"]),
        ("tput 0.5b overlap off", ["benchmarks/throughput.py", "--model", "random:qwen2.5-0.5b",
                                   "--no-async-scheduling"]),
        ("lat 0.5b overlap on (+HF)", ["benchmarks/latency.py", "--model", "random:qwen2.5-0.5b", "--compare-hf",
                                       "--async-scheduling"]),
        ("lat 0.5b overlap off", ["benchmarks/latency.py", "--model", "random:qwen2.5-0.5b",
                                  "--no-async-scheduling"]),
    ],
    "7b-moe": [
        ("tput 0.5b overlap on", ["benchmarks/throughput.py", "--model", "random:qwen2.5-0.5b", "--async-scheduling"]),
        ("tput 0.5b overlap off", ["benchmarks/throughput.py", "--model", "random:qwen2.5-0.5b",
                                   "--no-async-scheduling"]),
        ("lat 0.5b overlap on", ["benchmarks/latency.py", "--model", "random:qwen2.5-0.5b", "--async-scheduling"]),
        ("lat 0.5b overlap off", ["benchmarks/latency.py", "--model", "random:qwen2.5-0.5b", "--no-async-scheduling"]),
        ("tput 7b overlap on", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling"]),
        ("tput 7b overlap off", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--no-async-scheduling"]),
        ("lat 7b overlap on", ["benchmarks/latency.py", "--model", "random:qwen2.5-7b", "--async-scheduling"]),
        ("lat 7b overlap off", ["benchmarks/latency.py", "--model", "random:qwen2.5-7b", "--no-async-scheduling"]),
        ("tput qwen3-30b-a3b overlap on", ["benchmarks/throughput.py", "--model", "random:qwen3-30b-a3b",
                                           "--async-scheduling"]),
    ],
    # round 3 (issues 15 and 19), after checks-0.5b: the default model's n-gram speed-up (its GGUF at --gguf; it
    # travels in two halves: see BENCHMARKS.md), a draft run, the 7B
    "round3-b": [
        ("spec ngram default model b1 b32", ["benchmarks/speculation.py", "--device", "cuda", "--model", "{gguf}",
                                             "--batch", "1", "32", "--max-tokens", "128"]),
        ("spec draft 360m-135m b1", ["benchmarks/speculation.py", "--device", "cuda", "--model",
                                     "random:smollm2-360m", "--max-tokens", "64", "--speculative-config",
                                     '{"method": "draft_model", "model": "random:smollm2-135m", '
                                     '"num_speculative_tokens": 4}']),
        ("tput 7b overlap on", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling"]),
        ("tput 7b overlap off", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--no-async-scheduling"]),
        ("lat 7b overlap on", ["benchmarks/latency.py", "--model", "random:qwen2.5-7b", "--async-scheduling"]),
    ],
    # issue 19: vLLM's quantization="fp8" against bf16 (overlap on, the CUDA default); the fp8 checks first, the
    # rest of gpu_check last
    "fp8": [
        ("gpu_check fp8", ["tests/gpu/gpu_check.py", "--only", "fp8"]),
        ("fp8 gemm 7b shapes", ["benchmarks/fp8_gemm.py"]),
        ("tput 7b bf16", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling"]),
        ("tput 7b fp8", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling",
                         "--quantization", "fp8"]),
        ("tput 0.5b bf16", ["benchmarks/throughput.py", "--model", "random:qwen2.5-0.5b", "--async-scheduling"]),
        ("tput 0.5b fp8", ["benchmarks/throughput.py", "--model", "random:qwen2.5-0.5b", "--async-scheduling",
                           "--quantization", "fp8"]),
        ("lat 7b bf16", ["benchmarks/latency.py", "--model", "random:qwen2.5-7b", "--async-scheduling"]),
        ("lat 7b fp8", ["benchmarks/latency.py", "--model", "random:qwen2.5-7b", "--async-scheduling",
                        "--quantization", "fp8"]),
        ("lat 0.5b bf16", ["benchmarks/latency.py", "--model", "random:qwen2.5-0.5b", "--async-scheduling"]),
        ("lat 0.5b fp8", ["benchmarks/latency.py", "--model", "random:qwen2.5-0.5b", "--async-scheduling",
                          "--quantization", "fp8"]),
        ("gpu_check rest", ["tests/gpu/gpu_check.py", "--skip", "fp8"]),
    ],
    # round 7: nano-vllm's bench runs with max_num_batched_tokens=16384 (its default); ours with 8192. The 7B in
    # fp8 and bf16 at both, taking turns (the lent machine moves figures by several percent from run to run)
    "round7": [
        ("tput 7b fp8 8192", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling",
                              "--quantization", "fp8"]),
        ("tput 7b fp8 16384", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling",
                               "--quantization", "fp8", "--max-num-batched-tokens", "16384"]),
        ("tput 7b bf16 16384", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling",
                                "--max-num-batched-tokens", "16384"]),
        ("tput 7b fp8 8192 again", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling",
                                  "--quantization", "fp8"]),
        ("tput 7b fp8 16384 again", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b",
                                   "--async-scheduling", "--quantization", "fp8", "--max-num-batched-tokens",
                                   "16384"]),
        ("tput 7b bf16 8192", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling"]),
    ],
    # round 7, the merged tree: the checks, then the bench shapes with the engine's default token budget
    "round7-final": [
        ("gpu_check", ["tests/gpu/gpu_check.py"]),
        ("tput 7b fp8", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling",
                         "--quantization", "fp8"]),
        ("tput 7b bf16", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling"]),
        ("tput 0.5b bf16", ["benchmarks/throughput.py", "--model", "random:qwen2.5-0.5b", "--async-scheduling"]),
        ("lat 0.5b bf16", ["benchmarks/latency.py", "--model", "random:qwen2.5-0.5b", "--async-scheduling"]),
    ],
    # round 7, after the one-pass sampling kernel: the checks (its group among them) and the bench shapes
    "round7-sampler": [
        ("gpu_check", ["tests/gpu/gpu_check.py"]),
        ("tput 7b fp8", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling",
                         "--quantization", "fp8"]),
        ("tput 7b bf16", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling"]),
        ("tput 0.5b bf16", ["benchmarks/throughput.py", "--model", "random:qwen2.5-0.5b", "--async-scheduling"]),
        ("tput 7b fp8 again", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling",
                               "--quantization", "fp8"]),
    ],
    # the same after the fix of the kernel's recompiles (a new seed every call): its checks and the 7B
    "round7-sampler2": [
        ("gpu_check sampling", ["tests/gpu/gpu_check.py", "--only", "sampling"]),
        ("tput 7b fp8", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling",
                         "--quantization", "fp8"]),
        ("tput 7b bf16", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling"]),
        ("tput 7b fp8 again", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling",
                               "--quantization", "fp8"]),
        ("tput 7b bf16 again", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling"]),
        ("tput 7b fp8 third", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--async-scheduling",
                               "--quantization", "fp8"]),
    ],
    # round 8: the batch-1 decode stack (fused GEMVs and attention): its checks, the tile sweep, then batch 1
    "round8-stack": [
        ("gpu_check decode_stack", ["tests/gpu/gpu_check.py", "--only", "decode_stack"]),
        ("gemv tiles 0.5b", ["benchmarks/gemv_tiles.py", "--models", "0.5b"]),
        ("anatomy 0.5b stack on", ["benchmarks/batch1_anatomy.py", "--model", "random:qwen2.5-0.5b"]),
        ("anatomy 0.5b stack off", ["benchmarks/batch1_anatomy.py", "--model", "random:qwen2.5-0.5b",
                                    "--kwargs", '{"gpu_decode_stack": false}']),
        ("lat 0.5b", ["benchmarks/latency.py", "--model", "random:qwen2.5-0.5b"]),
        ("gemv tiles 7b", ["benchmarks/gemv_tiles.py", "--models", "7b"]),
    ],
}
# a part's default --budget: it must end inside one 600 s device call
BUDGETS = {"fp8": 540, "round7": 540, "round7-final": 570, "round7-sampler": 570, "round7-sampler2": 570,
           "round8-stack": 570}
# --dry-run: CPU stand-ins (tiny shapes, small workloads; the GPU check's CPU halves)
DRY_MODELS = {"random:qwen2.5-7b": "random:tiny", "random:qwen2.5-0.5b": "random:tiny"}
DRY_ARGS = {"benchmarks/throughput.py": ["--device", "cpu", "--num-prompts", "4", "--input-len", "16",
                                         "--output-len", "8"],
            "benchmarks/latency.py": ["--device", "cpu", "--prompt-len", "16", "--output-len", "8",
                                      "--ttft-prompt-len", "32", "--repeat", "1"],
            "benchmarks/fp8_gemm.py": ["--device", "cpu", "--shapes", "tiny", "--rows", "1", "33", "--iters", "5"]}
DRY_CHECK = {"--only": ["-m", "pytest", "-q", "tests/test_gpu_check_cpu.py", "tests/test_fp8_quant.py"],
             "--skip": ["-m", "pytest", "-q", "tests/test_gpu_check_cpu.py", "-k", "not fp8"]}


def dry_run_command(cmd: list[str]) -> list[str]:
    """The CPU stand-in of one step of a part."""
    if cmd[0] == "tests/gpu/gpu_check.py":
        return DRY_CHECK[cmd[1]] if len(cmd) > 1 else DRY_CHECK["--skip"]
    return [DRY_MODELS.get(c, c) for c in cmd] + DRY_ARGS.get(cmd[0], [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=sorted(PARTS), required=True)
    ap.add_argument("--out", default="/tmp/gpu_round")
    ap.add_argument("--gguf", default="/tmp/smol.gguf", help="the default model's GGUF file on this machine")
    ap.add_argument("--timeout", type=float, default=300, help="seconds each run may take")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the whole part (see above); default {BUDGETS} for those parts, else none")
    ap.add_argument("--dry-run", action="store_true", help="CPU stand-ins of the steps (see above)")
    args = ap.parse_args()
    if args.budget is None:
        args.budget = BUDGETS.get(args.part)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    start = time.time()
    for name, cmd in PARTS[args.part]:
        slug = name.split(" (")[0].replace(" ", "_")
        out_json = os.path.join(args.out, slug + ".json")
        cmd = [c.replace("{gguf}", args.gguf) for c in cmd]
        if args.dry_run:
            cmd = dry_run_command(cmd)
        full = [sys.executable, *cmd] + (["--json", out_json] if "benchmarks/" in cmd[0] else [])
        left = args.timeout if args.budget is None else min(args.timeout, args.budget - (time.time() - start))
        if left < 10:
            rows.append((name, "skipped (budget)", 0.0, {}, ""))
            print(f"[{name}] skipped: the part's budget of {args.budget:.0f} s is spent", flush=True)
            continue
        t0 = time.time()
        with open(os.path.join(args.out, slug + ".log"), "w") as log:
            try:
                rc = subprocess.run(full, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=left).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        with open(os.path.join(args.out, slug + ".log")) as f:
            tail = f.read().strip().splitlines()[-1:] or [""]
        result = json.load(open(out_json)) if os.path.exists(out_json) else {}
        rows.append((name, rc, time.time() - t0, result, tail[0]))
        print(f"[{name}] rc={rc} {time.time() - t0:.0f}s {tail[0][:200]}", flush=True)
    print("\n| run | rc | s | result |\n|---|---|---|---|")
    for name, rc, secs, result, tail in rows:
        if isinstance(result, list):  # speculation.py: one row per engine and setting; fp8_gemm.py per shape
            keys = ("speculative_config", "batch", "tok_s", "acceptance", "mean_accepted_length", "greedy_equal") \
                if result and "speculative_config" in result[0] else ("shape", "M", "speedup_fp8_layer")
            result = [{k: r.get(k) for k in keys} for r in result]
        summary = json.dumps(result, separators=(",", ":"))[:600] if result else tail[:200]
        print(f"| {name} | {rc} | {secs:.0f} | {summary} |")


if __name__ == "__main__":
    main()
