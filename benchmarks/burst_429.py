"""Time to a 429 under a burst (issue 35, item 8): every slot of `novainfer serve` busy with long generations, then
100 simultaneous requests, each refused; where a refusal's time goes, against a trivial FastAPI/uvicorn server that
answers 429 to everything, on the same machine, in the same run.

Rows (each burst: `--burst` requests opened at once on fresh connections, the time from the start of a request's
connect to its status line; "connect" is the TCP connect alone, the client's own share):
- trivial server, machine idle: the framework's and the client's cost of a refusal;
- trivial server, while novainfer's engine generates for its busy slots: what the engine's share of the cores adds;
- novainfer, busy slots: the real refusals, with the front-end's CPU seconds over the burst (/proc).

    python benchmarks/burst_429.py --model default --slots 16 --burst 100 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.checkpoints import resolve_model  # noqa: E402
from benchmarks.router_replicas import wait_for  # noqa: E402
from tests.server_utils import free_port  # noqa: E402

TRIVIAL = textwrap.dedent(
    """
    import sys, uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    app = FastAPI()
    @app.post("/v1/completions")
    async def refuse():
        return JSONResponse({"error": {"message": "busy", "type": "rate_limit_error"}}, 429, {"Retry-After": "1"})
    @app.get("/health")
    async def health():
        return {}
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
    """
)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (and its threads) in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one(port: int, body: bytes) -> tuple[float, float, int]:
    """(connect seconds, seconds to the status line, status) of one POST on a fresh connection."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t1 = time.perf_counter()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    line = await reader.readline()
    t2 = time.perf_counter()
    writer.close()
    return t1 - t0, t2 - t0, int(line.split()[1]) if line else 0


async def burst(port: int, n: int, body: bytes) -> list[tuple[float, float, int]]:
    return await asyncio.gather(*(one(port, body) for _ in range(n)))


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(name: str, results: list[tuple[float, float, int]], cpu: float | None = None) -> dict:
    conn = [c * 1e3 for c, _, _ in results]
    total = [t * 1e3 for _, t, _ in results]
    return {
        "setup": name,
        "n": len(results),
        "429s": sum(s == 429 for *_, s in results),
        "p50_ms": statistics.median(total),
        "p99_ms": percentile(total, 0.99),
        "max_ms": max(total),
        "connect_p50_ms": statistics.median(conn),
        "connect_p99_ms": percentile(conn, 0.99),
        "frontend_cpu_ms_per_refusal": None if cpu is None else cpu * 1e3 / len(results),
    }


def table_row(r: dict) -> str:
    cpu = "" if r["frontend_cpu_ms_per_refusal"] is None else f"{r['frontend_cpu_ms_per_refusal']:.2f}"
    return (
        f"| {r['setup']} | {r['429s']}/{r['n']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} | "
        f"{r['connect_p50_ms']:.1f} / {r['connect_p99_ms']:.1f} | {cpu} |"
    )


def occupy(port: int, slots: int, max_tokens: int) -> list[subprocess.Popen]:
    """`slots` streaming requests that generate for a long time (curl, so this process's loop stays free)."""
    body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": max_tokens, "ignore_eos": True, "stream": True})
    return [
        subprocess.Popen(
            [
                "curl",
                "-s",
                "-N",
                "-o",
                "/dev/null",
                "-H",
                "Content-Type: application/json",
                "-d",
                body,
                f"http://127.0.0.1:{port}/v1/completions",
            ]
        )
        for _ in range(slots)
    ]


def wait_running(port: int, slots: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        running = sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running")
        )
        if running >= slots:
            return
        time.sleep(0.2)
    raise SystemExit(f"the {slots} busy requests did not all start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--burst", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve-args", default="", help="extra `novainfer serve` flags")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    body = json.dumps({"prompt": "Hello there, how are you today?", "max_tokens": 16}).encode()
    rows: list[dict] = []

    tport = free_port()
    trivial = subprocess.Popen([sys.executable, "-c", TRIVIAL, str(tport)])
    wait_for(f"http://127.0.0.1:{tport}/health", trivial)
    for _ in range(args.rounds):
        rows.append(summary("trivial server, machine idle", asyncio.run(burst(tport, args.burst, body))))

    model = [] if args.model == "default" else [resolve_model(args.model)]
    port = free_port()
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "novainfer.entrypoints.cli",
            "serve",
            *model,
            "--port",
            str(port),
            "--max-concurrent-requests",
            str(args.slots),
            "--max-queue-len",
            "0",
            "--max-model-len",
            "4096",
            *args.serve_args.split(),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    busy: list[subprocess.Popen] = []
    try:
        wait_for(f"http://127.0.0.1:{port}/health", serve, timeout=300)
        busy = occupy(port, args.slots, 3000)
        wait_running(port, args.slots)
        for _ in range(args.rounds):
            rows.append(summary("trivial server, engine busy", asyncio.run(burst(tport, args.burst, body))))
            c0 = cpu_seconds(serve.pid)
            res = asyncio.run(burst(port, args.burst, body))
            rows.append(summary("novainfer, slots busy", res, cpu_seconds(serve.pid) - c0))
    finally:
        for p in busy:
            p.kill()
        serve.terminate()
        trivial.terminate()
        serve.wait(30)
        trivial.wait(30)

    title = f"{args.burst} simultaneous requests, {args.slots} busy slots, {os.cpu_count()} cores, {args.rounds} rounds"
    header = "| setup | 429s | p50 ms | p99 ms | max ms | connect p50 / p99 ms | front-end CPU ms per refusal |"
    print("\n".join(["", title, header, "|---|---|---|---|---|---|---|", *map(table_row, rows)]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
