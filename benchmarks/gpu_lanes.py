"""Independent GPU scripts side by side on a multi-GPU machine: one lane per GPU (CUDA_VISIBLE_DEVICES), the lane's
commands one after another, each under its own time limit (SIGINT first, so a Python script prints where it was),
each command's output in OUT/<lane>-<n>.log, and the last lines of every log at the end.

    python3 benchmarks/gpu_lanes.py --out $OUT --lane "300:python3 a.py" "200:python3 b.py" --lane "500:python3 c.py"

A command is "SECONDS:shell command"; lanes beyond the GPU count share GPUs round-robin.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import threading
import time

import torch


def run_lane(index: int, gpu: int, commands: list[str], out: str, tail: int, results: dict) -> None:
    """Run one lane's commands in order on one GPU."""
    for n, spec in enumerate(commands):
        limit, cmd = spec.split(":", 1)
        log = os.path.join(out, f"lane{index}-{n}.log")
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
        t0 = time.time()
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, shell=True, stdout=f, stderr=subprocess.STDOUT, env=env)
            try:
                rc = proc.wait(timeout=float(limit))
            except subprocess.TimeoutExpired:
                proc.send_signal(2)
                try:
                    rc = proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
                rc = f"{rc} (timed out after {limit} s)"
        with open(log, errors="replace") as f:
            lines = f.read().replace("\r", "\n").splitlines()
        results[(index, n)] = (cmd, rc, time.time() - t0, lines[-tail:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lane", nargs="+", action="append", required=True, help='"SECONDS:command" ...')
    ap.add_argument("--out", default="/tmp/gpu_lanes")
    ap.add_argument("--tail", type=int, default=25)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gpus = max(1, torch.cuda.device_count())
    results: dict = {}
    threads = [
        threading.Thread(target=run_lane, args=(i, i % gpus, cmds, args.out, args.tail, results))
        for i, cmds in enumerate(args.lane)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key in sorted(results):
        cmd, rc, secs, lines = results[key]
        print(f"\n==== lane {key[0]} #{key[1]}: rc {rc}, {secs:.0f} s: {cmd}")
        print("\n".join(line[:400] for line in lines))


if __name__ == "__main__":
    main()
