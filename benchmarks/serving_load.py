"""Issue 8's load on one machine, end to end: start `novainfer serve`, measure one client (the baseline),
then a burst of clients all at once against bounded limits, then SIGTERM the server and time its drain.

    python benchmarks/serving_load.py --model random:qwen2.5-0.5b --out /tmp/serving_load

Each load runs `benchmarks/serving.py` against the live server, so the figures are its TTFT/TPOT/ITL
percentiles; the table at the end compares the burst with the baseline of the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.checkpoints import resolve_model  # noqa: E402


def start_server(model: str, port: int, args: list[str], log: str) -> subprocess.Popen:
    """`novainfer serve` in a subprocess, returned once /health answers 200."""
    cmd = [sys.executable, "-m", "novainfer.entrypoints.cli", "serve", model, "--served-model-name", "bench",
           "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=os.path.dirname(HERE))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server not healthy in 600 s; see {log}")


def load(port: int, out: str, name: str, num_prompts: int, concurrency: int | None, input_len: int,
         output_len: int) -> dict:
    """One serving.py run; its JSON report."""
    path = os.path.join(out, f"serving_{name}.json")
    cmd = [sys.executable, os.path.join(HERE, "serving.py"), "--base-url", f"http://127.0.0.1:{port}",
           "--num-prompts", str(num_prompts), "--input-len", str(input_len), "--output-len", str(output_len),
           "--json", path]
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    subprocess.run(cmd, check=True)
    with open(path) as f:
        report = json.load(f)
    if not report["completed"]:
        raise SystemExit(f"{name}: no request completed: {report.get('first_errors')}")
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:qwen2.5-0.5b")
    p.add_argument("--out", default="/tmp/serving_load")
    p.add_argument("--port", type=int, default=18500)
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--server-args", default="--max-num-seqs 32 --max-concurrent-requests 64 --max-queue-len 64",
                   help="the limits under test")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = resolve_model(args.model)
    t0 = time.monotonic()
    proc = start_server(model, args.port, args.server_args.split(), os.path.join(args.out, "server.log"))
    print(f"server up in {time.monotonic() - t0:.1f} s", flush=True)
    try:
        load(args.port, args.out, "warmup", 8, 8, args.input_len, 8)
        base = load(args.port, args.out, "c1", 8, 1, args.input_len, args.output_len)
        burst = load(args.port, args.out, f"burst{args.clients}", args.clients, None, args.input_len,
                     args.output_len)
        metrics = httpx.get(f"http://127.0.0.1:{args.port}/metrics").text
        with open(os.path.join(args.out, "metrics_after.txt"), "w") as f:
            f.write(metrics)
        idle = [line for line in metrics.splitlines() if line.startswith(
            ("novainfer:num_requests_running", "novainfer:num_requests_waiting", "novainfer:kv_cache_usage_perc"))]
    finally:
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        drain = time.monotonic() - t_term
    rows = [("1 client (baseline)", base), (f"{args.clients} clients at once", burst)]
    print(f"\nmodel {args.model}, server {args.server_args}, {args.input_len} in / {args.output_len} out")
    print("| load | completed | 429 | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p99 ms | output tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, r in rows:
        print(f"| {label} | {r['completed']} | {r.get('rate_limited_429', 0)} | "
              f"{r['p50_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} | {r['p50_tpot_ms']:.2f} / {r['p99_tpot_ms']:.2f} | "
              f"{r['p99_itl_ms']:.2f} | {r['output_throughput_tok_s']:.0f} |")
    print("after the burst:", "; ".join(idle))
    print(f"SIGTERM: exit code {code} after {drain:.1f} s")


if __name__ == "__main__":
    main()
