"""Two `novainfer serve` replicas behind an existing router (sglang-router or vllm-router), on loopback.

Sends a multi-turn workload (each turn's prompt is the conversation so far) through the router with each policy,
and once straight to a single server, and reads the replicas' `vllm:prefix_cache_hits/queries` to report the
prefix-cache hit rate per policy. Then kills one replica in the middle of a batch and counts which requests
failed against that replica's in-flight requests at the kill. Routers live in their own venv (docs/DEPLOY.md):
    python -m venv /tmp/router-venv && /tmp/router-venv/bin/pip install sglang-router vllm-router
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.checkpoints import resolve_model  # noqa: E402
from tests.server_utils import free_port  # noqa: E402
from tests.tiny_models import CORPUS, make_tiny_model  # noqa: E402

MODEL = "tiny"
WORDS = sorted({w for text in CORPUS for w in text.split() if w.isalpha()})


def wait_for(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def start_replica(model: str, port: int, log_dir: str, extra: list[str]) -> subprocess.Popen:
    log = open(os.path.join(log_dir, f"replica-{port}.log"), "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "novainfer.entrypoints.cli",
            "serve",
            model,
            "--device",
            "cpu",
            "--port",
            str(port),
            "--served-model-name",
            MODEL,
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    wait_for(f"http://127.0.0.1:{port}/ready", proc)
    return proc


def router_command(kind: str, venv: str, port: int, workers: list[str], policy: str, extra: list[str]) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy]
    if kind == "sglang":
        return [os.path.join(venv, "bin", "python"), "-m", "sglang_router.launch_router", *common, *extra]
    return [os.path.join(venv, "bin", "vllm-router"), *common, *extra]


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    out = dict.fromkeys(
        (
            "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
        ),
        0.0,
    )
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def conversations(n: int, seed: int, system_len: int) -> list[list[str]]:
    """Each conversation's opening: a system text of its own (word-level tokenizer: one word, one token)."""
    rng = random.Random(seed)
    return [[rng.choice(WORDS) for _ in range(system_len)] for _ in range(n)]


async def complete(http: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> tuple[bool, str]:
    try:
        r = await http.post(
            base + "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        )
        return r.status_code == 200, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:200]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return False, repr(exc)


async def multi_turn(base: str, args: argparse.Namespace, seed: int) -> dict:
    """args.conversations conversations x args.turns turns; a turn's requests go out together, in a shuffled order."""
    rng = random.Random(seed)
    histories = [" ".join(c) for c in conversations(args.conversations, seed, args.system_len)]
    failed = 0
    async with httpx.AsyncClient(timeout=120) as http:
        for _ in range(args.turns):
            order = list(range(len(histories)))
            rng.shuffle(order)
            for i in order:
                histories[i] += " " + " ".join(rng.choice(WORDS) for _ in range(args.user_len))
            results = await asyncio.gather(*(complete(http, base, histories[i], args.output_len) for i in order))
            for i, (ok, text) in zip(order, results):
                failed += not ok
                histories[i] += " " + text.strip() if ok else ""
    return {"failed": failed}


def hit_rate(before: list[dict], after: list[dict]) -> tuple[float, list[float]]:
    q = [a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"] for a, b in zip(after, before)]
    h = [a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"] for a, b in zip(after, before)]
    return sum(h) / max(1.0, sum(q)), q


async def kill_mid_batch(base: str, replicas: list[str], victim: subprocess.Popen, args: argparse.Namespace) -> dict:
    """Send a batch of long requests, SIGKILL the second replica while they run; then a batch after the kill."""
    prompts = [" ".join(c) for c in conversations(args.conversations, 999, args.system_len)]
    async with httpx.AsyncClient(timeout=120) as http:
        tasks = [asyncio.create_task(complete(http, base, p, args.kill_output_len)) for p in prompts]
        await asyncio.sleep(args.kill_after)
        c = counters(replicas[1])
        in_flight = int(c["vllm:num_requests_running"] + c["vllm:num_requests_waiting"])
        victim.send_signal(signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        await asyncio.sleep(args.after_kill_wait)
        after = await asyncio.gather(*(complete(http, base, p, 8) for p in prompts))
    return {
        "sent": len(prompts),
        "in_flight_on_killed": in_flight,
        "failed": sum(not ok for ok, _ in results),
        "errors": sorted({t[:120] for ok, t in results if not ok}),
        "after_kill_ok": sum(ok for ok, _ in after),
        "after_kill_sent": len(after),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: a tiny random model with a BPE tokenizer (tests')")
    p.add_argument("--router", default="vllm", choices=["sglang", "vllm"])
    p.add_argument("--router-venv", default="/tmp/router-venv")
    p.add_argument("--policies", default="round_robin,cache_aware")
    p.add_argument("--router-args", default="", help="extra router flags, space-separated")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=48)
    p.add_argument("--user-len", type=int, default=12)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--kill-output-len", type=int, default=300)
    p.add_argument("--kill-after", type=float, default=1.0)
    p.add_argument("--after-kill-wait", type=float, default=3.0)
    p.add_argument("--log-dir", default="/tmp/novainfer-router-bench")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    model = resolve_model(args.model) if args.model else make_tiny_model(os.path.join(args.log_dir, "model"))
    ports = [free_port(), free_port()]
    replicas = [f"http://127.0.0.1:{port}" for port in ports]
    events = [(free_port(), free_port()) for _ in ports]  # KV events (PUB, replay) per replica, for kv_aware
    kv_args = [
        [
            "--kv-events-config",
            json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{e}", "replay_endpoint": f"tcp://*:{r}"}),
        ]
        for e, r in events
    ]
    with_events = "kv_aware" in args.policies
    procs = [start_replica(model, port, args.log_dir, kv if with_events else []) for port, kv in zip(ports, kv_args)]
    kv_router_args = [
        a
        for u, (e, r) in zip(replicas, events)
        for a in (
            "--kv-event-source",
            f"{u}=tcp://127.0.0.1:{e}",
            "--kv-event-replay-source",
            f"{u}=tcp://127.0.0.1:{r}",
        )
    ]
    kv_router_args += ["--kv-event-block-size", "16", "--kv-event-model", model]
    router = None
    report: dict = {"router": args.router, "policies": {}}
    try:
        before = [counters(u) for u in replicas]
        res = asyncio.run(multi_turn(replicas[0], args, seed=0))
        rate, q = hit_rate(before, [counters(u) for u in replicas])
        report["policies"]["single server"] = {"hit_rate": rate, "queries_per_replica": q, **res}
        for i, policy in enumerate(args.policies.split(",")):
            port = free_port()
            log = open(os.path.join(args.log_dir, f"router-{policy}.log"), "w")
            router = subprocess.Popen(
                router_command(
                    args.router,
                    args.router_venv,
                    port,
                    replicas,
                    policy,
                    args.router_args.split() + (kv_router_args if policy == "kv_aware" else []),
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            base = f"http://127.0.0.1:{port}"
            wait_for(base + "/v1/models", router, 60)
            before = [counters(u) for u in replicas]
            t0 = time.monotonic()
            res = asyncio.run(multi_turn(base, args, seed=i + 1))
            rate, q = hit_rate(before, [counters(u) for u in replicas])
            report["policies"][policy] = {
                "hit_rate": rate,
                "queries_per_replica": q,
                "seconds": time.monotonic() - t0,
                **res,
            }
            if i < len(args.policies.split(",")) - 1:
                router.terminate()
                router.wait(10)
        report["kill"] = asyncio.run(kill_mid_batch(base, replicas, procs[1], args))
    finally:
        for proc in ([router] if router else []) + procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print(f"router: {args.router}   workload: {args.conversations} conversations x {args.turns} turns")
    print(f"{'policy':16s} {'prefix hit rate':>16s} {'queries/replica':>22s} {'failed':>7s}")
    for name, r in report["policies"].items():
        print(
            f"{name:16s} {r['hit_rate']:16.3f} {str([int(x) for x in r['queries_per_replica']]):>22s} {r['failed']:7d}"
        )
    k = report["kill"]
    print(
        f"kill replica 2 mid-batch: {k['failed']}/{k['sent']} failed, {k['in_flight_on_killed']} were in flight "
        f"on it; after the kill {k['after_kill_ok']}/{k['after_kill_sent']} succeeded"
    )
    for e in k["errors"]:
        print("  error:", e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
