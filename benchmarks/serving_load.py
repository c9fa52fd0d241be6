"""The server under load on one machine, end to end: start `novainfer serve`, measure one client (the baseline),
then a burst of clients all at once against bounded limits, then 64 streams while `GET /health` is probed,
then SIGTERM the server and time its drain.

    python benchmarks/serving_load.py --model random:qwen2.5-0.5b --out /tmp/serving_load
    python benchmarks/serving_load.py --model default --baseline-root /tmp/base   # an older checkout first

Each load runs `benchmarks/serving.py` against the live server, so the figures are its TTFT/TPOT/ITL
percentiles; the table at the end compares the burst with the baseline of the same run. --baseline-root runs
everything twice in the same run, first with the server of another checkout (e.g. a `git worktree` of an older
commit), then with this tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.checkpoints import resolve_model  # noqa: E402
from benchmarks.serving import summarize  # noqa: E402

ROOT = os.path.dirname(HERE)


def start_server(model: str | None, port: int, args: list[str], log: str, root: str = ROOT) -> subprocess.Popen:
    """`novainfer serve` (from the checkout at root) in a subprocess, returned once /health answers 200."""
    cmd = [
        sys.executable,
        "-m",
        "novainfer.entrypoints.cli",
        "serve",
        *([model] if model else []),
        "--served-model-name",
        "bench",
        "--port",
        str(port),
        *args,
    ]
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=root, env=env)
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


def load(
    port: int, out: str, name: str, num_prompts: int, concurrency: int | None, input_len: int, output_len: int
) -> dict:
    """One serving.py run; its JSON report."""
    path = os.path.join(out, f"serving_{name}.json")
    cmd = [
        sys.executable,
        os.path.join(HERE, "serving.py"),
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--num-prompts",
        str(num_prompts),
        "--input-len",
        str(input_len),
        "--output-len",
        str(output_len),
        "--json",
        path,
    ]
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    subprocess.run(cmd, check=True)
    with open(path) as f:
        report = json.load(f)
    if not report["completed"]:
        raise SystemExit(f"{name}: no request completed: {report.get('first_errors')}")
    return report


class HealthProbe:
    """GET /health every `interval` seconds from a thread; the latencies (s) of the answers."""

    def __init__(self, port: int, interval: float = 0.05):
        self.url, self.interval = f"http://127.0.0.1:{port}/health", interval
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                ok = http.get(self.url).status_code == 200
                self.latencies.append(time.perf_counter() - t0)
                self.failures += not ok
                self._stop.wait(self.interval)


def run_variant(label: str, model: str | None, args: argparse.Namespace, server_args: list[str], root: str) -> dict:
    """Start one server, run every load against it, SIGTERM it; the figures of each load."""
    out = os.path.join(args.out, label)
    os.makedirs(out, exist_ok=True)
    t0 = time.monotonic()
    proc = start_server(model, args.port, server_args, os.path.join(out, "server.log"), root)
    print(f"[{label}] server up in {time.monotonic() - t0:.1f} s: {' '.join(server_args)}", flush=True)
    try:
        load(args.port, out, "warmup", 8, 8, args.input_len, 8)
        base = load(args.port, out, "c1", 8, 1, args.input_len, args.output_len)
        burst = load(args.port, out, f"burst{args.clients}", args.clients, None, args.input_len, args.output_len)
        with HealthProbe(args.port) as probe:
            streams = load(
                args.port, out, f"streams{args.streams}", args.streams, args.streams, args.input_len, args.output_len
            )
        health = summarize("health", probe.latencies, (50, 99))
        health.update(
            max_health_ms=1000 * max(probe.latencies),
            health_probes=len(probe.latencies),
            health_failures=probe.failures,
        )
        metrics = httpx.get(f"http://127.0.0.1:{args.port}/metrics").text
        with open(os.path.join(out, "metrics_after.txt"), "w") as f:
            f.write(metrics)
        idle = [
            line
            for line in metrics.splitlines()
            if line.startswith(
                ("novainfer:num_requests_running", "novainfer:num_requests_waiting", "novainfer:kv_cache_usage_perc")
            )
        ]
    finally:
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        drain = time.monotonic() - t_term
    result = {
        "label": label,
        "server_args": server_args,
        "root": root,
        "c1": base,
        "burst": burst,
        "streams": streams,
        "health": health,
        "idle_after": idle,
        "sigterm_exit": code,
        "drain_s": drain,
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def print_tables(results: list[dict], args: argparse.Namespace) -> None:
    print(f"\nmodel {args.model}, server {args.server_args}, {args.input_len} in / {args.output_len} out")
    print(
        "| server | load | completed | 429 | time to 429 p50 / p99 ms | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| output tok/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for res in results:
        for name, r in (
            ("1 client", res["c1"]),
            (f"{args.clients} clients at once", res["burst"]),
            (f"{args.streams} streams", res["streams"]),
        ):
            to429 = (
                f"{r['p50_time_to_429_ms']:.1f} / {r['p99_time_to_429_ms']:.1f}" if r.get("rate_limited_429") else "-"
            )
            print(
                f"| {res['label']} | {name} | {r['completed']} | {r.get('rate_limited_429', 0)} | {to429} | "
                f"{r['p50_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} | {r['p50_tpot_ms']:.2f} / "
                f"{r['p99_tpot_ms']:.2f} | {r['output_throughput_tok_s']:.1f} |"
            )
    print(f"\n| server | GET /health with {args.streams} streams: p50 / p99 / max ms | probes | not 200 |")
    print("| --- | --- | --- | --- |")
    for res in results:
        h = res["health"]
        print(
            f"| {res['label']} | {h['p50_health_ms']:.1f} / {h['p99_health_ms']:.1f} / {h['max_health_ms']:.1f} | "
            f"{h['health_probes']} | {h['health_failures']} |"
        )
    for res in results:
        print(
            f"[{res['label']}] after the loads:",
            "; ".join(res["idle_after"]),
            f"| SIGTERM: exit code {res['sigterm_exit']} after {res['drain_s']:.1f} s",
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        default="random:qwen2.5-0.5b",
        help="a path, random:<config>, or default (the model that ships with the install)",
    )
    p.add_argument("--out", default="/tmp/serving_load")
    p.add_argument("--port", type=int, default=18500)
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--streams", type=int, default=64, help="streams generating while /health is probed")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--server-args",
        default="--max-num-seqs 32 --max-concurrent-requests 64 --max-queue-len 64",
        help="the limits under test",
    )
    p.add_argument(
        "--baseline-root",
        default=None,
        help="first run everything with the server of this checkout (an older commit), then this tree's",
    )
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = None if args.model == "default" else resolve_model(args.model)
    server_args = args.server_args.split()
    variants = [("this_tree", server_args, ROOT)]
    if args.baseline_root:
        variants.insert(0, ("baseline", server_args, args.baseline_root))
    results = [run_variant(label, model, args, sargs, root) for label, sargs, root in variants]
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    print_tables(results, args)


if __name__ == "__main__":
    main()
