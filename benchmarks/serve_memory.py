"""Resident memory of `novainfer serve` with the default model and default settings, after it has answered
one request: the RSS of the server process and its children, from /proc (Linux). Example:
    python benchmarks/serve_memory.py --port 18731
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request


def tree_rss_mb(pid: int) -> float:
    """VmRSS of pid and all of its descendants, in MB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            continue
    return total / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=18731)
    ap.add_argument("--extra", nargs="*", default=[], help="extra serve flags (e.g. --dtype float32)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "novainfer.entrypoints.cli", "serve", "--port", str(args.port), *args.extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{base}/v1/models", timeout=2)
                break
            except OSError:
                time.sleep(1)
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "The sea is", "max_tokens": 16}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=120).read()
        rss = tree_rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"novainfer serve {' '.join(args.extra) or '(defaults)'}: RSS {rss:,.0f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"flags": args.extra, "rss_mb": rss}, f)


if __name__ == "__main__":
    main()
