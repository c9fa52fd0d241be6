"""One lent-GPU call's work: a named part (checks, then benchmark runs), each run's raw JSON and log under --out,
and one table at the end. The parts are the GPU rows of docs/PERFORMANCE.md and the comparisons behind them.

    python3 benchmarks/gpu_round.py --part table --out $OUT        # PERFORMANCE.md's one-GPU table (0.5B + HF, 7B)
    python3 benchmarks/gpu_round.py --part moe --out $OUT          # the Qwen3-30B-A3B bench shape
    python3 benchmarks/gpu_round.py --part checks-0.5b --out $OUT  # gpu_check, then 0.5B with the overlap on / off
    python3 benchmarks/gpu_round.py --part fp8 --out $OUT          # fp8 against bf16, the fp8 layer in pieces
    python3 benchmarks/gpu_round.py --part speculation --out $OUT --gguf PATH   # n-gram and draft-model speculation
    python3 benchmarks/gpu_round.py --part decode-stack --out $OUT # the batch-1 decode stack: checks, tiles, anatomy

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
    # docs/PERFORMANCE.md's one-GPU table, in one call (HF transformers covers the first 128 prompts)
    "table": [
        (
            "tput 0.5b (+HF)",
            ["benchmarks/throughput.py", "--model", "random:qwen2.5-0.5b", "--compare-hf", "--hf-num-prompts", "128"],
        ),
        (
            "lat 0.5b (+HF)",
            ["benchmarks/latency.py", "--model", "random:qwen2.5-0.5b", "--repeat", "5", "--compare-hf"],
        ),
        ("tput 7b fp8", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--quantization", "fp8"]),
        ("tput 7b bf16", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b"]),
        ("lat 7b", ["benchmarks/latency.py", "--model", "random:qwen2.5-7b", "--repeat", "3"]),
    ],
    "moe": [("tput qwen3-30b-a3b", ["benchmarks/throughput.py", "--model", "random:qwen3-30b-a3b"])],
    # Gemma 4 on the bench shape and batch-1 (issue 36), Gemma-2-9B as the known baseline of the same call
    "gemma4": [
        ("tput gemma-2-9b", ["benchmarks/throughput.py", "--model", "random:gemma-2-9b"]),
        ("tput gemma-4-31b", ["benchmarks/throughput.py", "--model", "random:gemma-4-31b"]),
        ("tput gemma-4-26b-a4b", ["benchmarks/throughput.py", "--model", "random:gemma-4-26b-a4b"]),
        ("lat gemma-2-9b", ["benchmarks/latency.py", "--model", "random:gemma-2-9b", "--repeat", "3"]),
        ("lat gemma-4-31b", ["benchmarks/latency.py", "--model", "random:gemma-4-31b", "--repeat", "3"]),
        ("lat gemma-4-26b-a4b", ["benchmarks/latency.py", "--model", "random:gemma-4-26b-a4b", "--repeat", "3"]),
    ],
    # the overlapped step loop on and off, with the kernel and parity checks first
    "checks-0.5b": [
        ("gpu_check", ["tests/gpu/gpu_check.py"]),
        (
            "tput 0.5b overlap on (+HF)",
            [
                "benchmarks/throughput.py",
                "--model",
                "random:qwen2.5-0.5b",
                "--compare-hf",
                "--hf-num-prompts",
                "128",
                "--async-scheduling",
            ],
        ),
        (
            "tput 0.5b overlap off",
            ["benchmarks/throughput.py", "--model", "random:qwen2.5-0.5b", "--no-async-scheduling"],
        ),
        (
            "lat 0.5b overlap on (+HF)",
            ["benchmarks/latency.py", "--model", "random:qwen2.5-0.5b", "--compare-hf", "--async-scheduling"],
        ),
        ("lat 0.5b overlap off", ["benchmarks/latency.py", "--model", "random:qwen2.5-0.5b", "--no-async-scheduling"]),
    ],
    # quantization="fp8" against bf16; the fp8 checks first, the rest of gpu_check last
    "fp8": [
        ("gpu_check fp8", ["tests/gpu/gpu_check.py", "--only", "fp8"]),
        ("fp8 gemm 7b shapes", ["benchmarks/tuning/fp8_gemm.py"]),
        ("tput 7b bf16", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b"]),
        ("tput 7b fp8", ["benchmarks/throughput.py", "--model", "random:qwen2.5-7b", "--quantization", "fp8"]),
        ("tput 0.5b bf16", ["benchmarks/throughput.py", "--model", "random:qwen2.5-0.5b"]),
        ("tput 0.5b fp8", ["benchmarks/throughput.py", "--model", "random:qwen2.5-0.5b", "--quantization", "fp8"]),
        ("lat 7b bf16", ["benchmarks/latency.py", "--model", "random:qwen2.5-7b"]),
        ("lat 7b fp8", ["benchmarks/latency.py", "--model", "random:qwen2.5-7b", "--quantization", "fp8"]),
        ("gpu_check rest", ["tests/gpu/gpu_check.py", "--skip", "fp8"]),
    ],
    # the default model's n-gram speed-up (its GGUF at --gguf), then a draft-model run
    "speculation": [
        (
            "spec ngram default model b1 b32",
            [
                "benchmarks/speculation.py",
                "--device",
                "cuda",
                "--model",
                "{gguf}",
                "--batch",
                "1",
                "32",
                "--max-tokens",
                "128",
            ],
        ),
        (
            "spec draft 360m-135m b1",
            [
                "benchmarks/speculation.py",
                "--device",
                "cuda",
                "--model",
                "random:smollm2-360m",
                "--max-tokens",
                "64",
                "--speculative-config",
                '{"method": "draft_model", "model": "random:smollm2-135m", "num_speculative_tokens": 4}',
            ],
        ),
    ],
    # the batch-1 decode stack (fused GEMVs and attention): its checks, the tile sweep, where the step goes
    "decode-stack": [
        ("gpu_check decode_stack", ["tests/gpu/gpu_check.py", "--only", "decode_stack"]),
        ("gemv tiles 0.5b", ["benchmarks/tuning/gemv_tiles.py", "--models", "0.5b"]),
        ("anatomy 0.5b", ["benchmarks/tuning/batch1_anatomy.py", "--model", "random:qwen2.5-0.5b"]),
        ("lat 0.5b", ["benchmarks/latency.py", "--model", "random:qwen2.5-0.5b"]),
    ],
}
# a part's default --budget: it must end inside one 600 s device call
BUDGETS = {"table": 570, "fp8": 540, "decode-stack": 570}
# --dry-run: CPU stand-ins (tiny shapes, small workloads; the GPU check's CPU halves)
DRY_MODELS = {"random:qwen2.5-7b": "random:tiny", "random:qwen2.5-0.5b": "random:tiny"}
DRY_ARGS = {
    "benchmarks/throughput.py": ["--device", "cpu", "--num-prompts", "4", "--input-len", "16", "--output-len", "8"],
    "benchmarks/latency.py": [
        "--device",
        "cpu",
        "--prompt-len",
        "16",
        "--output-len",
        "8",
        "--ttft-prompt-len",
        "32",
        "--repeat",
        "1",
    ],
    "benchmarks/tuning/fp8_gemm.py": ["--device", "cpu", "--shapes", "tiny", "--rows", "1", "33", "--iters", "5"],
}
DRY_CHECK = {
    "--only": ["-m", "pytest", "-q", "tests/test_gpu_check_cpu.py", "tests/test_fp8_quant.py"],
    "--skip": ["-m", "pytest", "-q", "tests/test_gpu_check_cpu.py", "-k", "not fp8"],
}


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
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the whole part (see above); default {BUDGETS} for those parts, else none",
    )
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
                rc = subprocess.run(full, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=left).returncode
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
            keys = (
                ("speculative_config", "batch", "tok_s", "acceptance", "mean_accepted_length", "greedy_equal")
                if result and "speculative_config" in result[0]
                else ("shape", "M", "speedup_fp8_layer")
            )
            result = [{k: r.get(k) for k in keys} for r in result]
        summary = json.dumps(result, separators=(",", ":"))[:600] if result else tail[:200]
        print(f"| {name} | {rc} | {secs:.0f} | {summary} |")


if __name__ == "__main__":
    main()
