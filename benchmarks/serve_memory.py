"""Resident memory of `novainfer serve` (default model, default settings unless --extra says otherwise), per
process of the server's tree, from /proc/<pid>/smaps (Linux): after one short request, then after enough
distinct random-token requests to write every token slot of the KV cache (the "full cache" figure).

RSS counts a page once in every process that maps it (libtorch's file pages, and the pages a forked child
still shares with its parent); PSS divides each shared page among its sharers (processes outside the tree
included). Both are reported, each process split by category: anonymous memory (Python heap, tensors, the KV
cache), the model file's mapping, shared libraries, other files. With root, the "unique" figure counts the
physical pages the tree maps, each once (from /proc/<pid>/pagemap): what the server holds. Example:
    python benchmarks/serve_memory.py --port 18731 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$")


def tree_pids(pid: int) -> list[int]:
    """pid and all of its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def tree_rss_mb(pid: int) -> float:
    """VmRSS of pid and its descendants in MB: cheap enough to poll for a peak (process_memory reads smaps)."""
    total = 0
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        except (OSError, StopIteration):
            continue
    return total / 1024


def _category(path: str) -> str:
    if not path or path.startswith("[") or path.startswith("/memfd:") or path.startswith("/dev/zero"):
        return "anon"
    if path.endswith(".gguf") or path.endswith(".safetensors"):
        return "model file"
    if ".so" in os.path.basename(path):
        return "libs"
    return "other files"


def process_memory(pid: int) -> dict:
    """RSS and PSS of one process in MB, in total and per category (see _category); its resident ranges."""
    cats: dict[str, dict[str, float]] = {}
    cur, ranges = None, []
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = _HEADER.match(line)
            if m:
                cur = cats.setdefault(_category(m.group(1)), {"rss": 0.0, "pss": 0.0})
                start, end = line.split(" ", 1)[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
                continue
            key, _, value = line.partition(":")
            if key in ("Rss", "Pss") and cur is not None:
                cur[key.lower()] += int(value.split()[0]) / 1024
                if key == "Rss" and value.split()[0] == "0":
                    ranges.pop()
    with open(f"/proc/{pid}/cmdline") as f:
        cmd = f.read().replace("\0", " ").strip()
    with open(f"/proc/{pid}/comm") as f:
        comm = f.read().strip()
    return {
        "pid": pid,
        "comm": comm,
        "cmd": cmd[:120],
        "ranges": ranges,
        "rss": sum(c["rss"] for c in cats.values()),
        "pss": sum(c["pss"] for c in cats.values()),
        "categories": {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in sorted(cats.items())},
    }


def physical_pages(pid: int, ranges: list[tuple[int, int]]) -> np.ndarray | None:
    """Page frame numbers of the present pages in ranges (None without the right to read them: not root)."""
    page = os.sysconf("SC_PAGE_SIZE")
    frames = []
    with open(f"/proc/{pid}/pagemap", "rb") as f:
        for start, end in ranges:
            f.seek(start // page * 8)
            entries = np.frombuffer(f.read((end - start) // page * 8), dtype=np.uint64)
            frames.append(entries[(entries >> np.uint64(63)) == 1] & np.uint64((1 << 55) - 1))
    pfns = np.concatenate(frames) if frames else np.zeros(0, np.uint64)
    return None if pfns.size and not pfns.any() else pfns


def tree_memory(pid: int) -> dict:
    procs, frames = [], []
    for p in tree_pids(pid):
        try:
            procs.append(process_memory(p))
            frames.append(physical_pages(p, procs[-1].pop("ranges")))
        except OSError:  # the process ended between the listing and the read
            continue
    unique = None
    if frames and all(f is not None for f in frames):
        unique = round(np.unique(np.concatenate(frames)).size * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    return {
        "rss_mb": round(sum(p["rss"] for p in procs), 1),
        "pss_mb": round(sum(p["pss"] for p in procs), 1),
        "unique_mb": unique,
        "processes": procs,
    }


def report(label: str, mem: dict) -> None:
    unique = "n/a (needs root)" if mem["unique_mb"] is None else f"{mem['unique_mb']:,.0f} MB"
    print(f"{label}: tree RSS {mem['rss_mb']:,.0f} MB, PSS {mem['pss_mb']:,.0f} MB, unique pages {unique}")
    for p in mem["processes"]:
        cats = ", ".join(f"{k} {v['rss']:,.0f}/{v['pss']:,.0f}" for k, v in p["categories"].items())
        print(f"  pid {p['pid']} ({p['comm']}): RSS {p['rss']:,.0f} PSS {p['pss']:,.0f}  [RSS/PSS: {cats}]")


def _post(base: str, body: dict, timeout: float = 1800) -> dict:
    req = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(req, timeout=timeout).read())


def fill_cache(
    base: str, model: str, tokens: int, prompt_len: int, output_len: int, vocab: int, concurrency: int
) -> int:
    """Distinct random-token prompts (no prefix-cache hits) until `tokens` KV slots have been written; the
    block manager hands out least-recently-freed blocks first, so every block gets written. Returns the
    tokens the server reported (prompt + completion)."""
    rng = random.Random(0)
    n = -(-tokens // (prompt_len + output_len))
    prompts = [[rng.randrange(1000, vocab) for _ in range(prompt_len)] for _ in range(n)]
    body = {"model": model, "max_tokens": output_len, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda p: _post(base, {**body, "prompt": p}), prompts))
    return sum(o["usage"]["total_tokens"] for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=18731)
    ap.add_argument("--extra", nargs="*", default=[], help="extra serve flags (e.g. --dtype float32)")
    ap.add_argument("--env", nargs="*", default=[], help="extra environment for the server, KEY=VALUE")
    ap.add_argument(
        "--fill-tokens",
        type=int,
        default=32768,
        help="KV slots to write for the full-cache figure (the default CPU capacity); 0 skips it",
    )
    ap.add_argument("--prompt-len", type=int, default=2040)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=49152, help="random prompt ids are drawn below it")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "novainfer.entrypoints.cli", "serve", "--port", str(args.port), *args.extra]
    env = {**os.environ, **dict(kv.split("=", 1) for kv in args.env)}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{args.port}"
    result: dict = {"flags": args.extra, "env": args.env}
    try:
        while True:
            try:
                models = json.loads(urllib.request.urlopen(f"{base}/v1/models", timeout=2).read())
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"the server exited with code {proc.returncode}")
                if time.monotonic() - t0 > 600:
                    raise SystemExit("the server was not ready within 600 s")
                time.sleep(0.1)
        result["startup_s"] = round(time.monotonic() - t0, 2)
        model = models["data"][0]["id"]
        result["idle"] = tree_memory(proc.pid)
        t1 = time.monotonic()
        _post(base, {"model": model, "prompt": "The sea is", "max_tokens": 16})
        result["first_request_s"] = round(time.monotonic() - t1, 3)
        result["one_request"] = tree_memory(proc.pid)
        if args.fill_tokens:
            t1 = time.monotonic()
            result["filled_tokens"] = fill_cache(
                base, model, args.fill_tokens, args.prompt_len, args.output_len, args.vocab_size, args.concurrency
            )
            result["fill_s"] = round(time.monotonic() - t1, 1)
            result["full_cache"] = tree_memory(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    flags = " ".join(args.extra + args.env) or "(defaults)"
    print(
        f"novainfer serve {flags}: ready in {result['startup_s']} s, first request (16 tokens) "
        f"{result['first_request_s']} s"
    )
    report("idle", result["idle"])
    report("after one request", result["one_request"])
    if "full_cache" in result:
        report(f"full cache ({result['filled_tokens']:,} tokens written in {result['fill_s']} s)", result["full_cache"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
