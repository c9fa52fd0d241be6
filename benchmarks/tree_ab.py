"""A benchmark script run from this tree and from an older commit's tree (git archive into a temporary folder), in
separate processes taking turns, so a drifting load on a shared machine hits both alike. Use it for any change
whose effect is smaller than the machine's drift: a kernel, a weight layout, a scheduler change.

    python benchmarks/tree_ab.py --base 92df2f0 --rounds 3 --key novainfer_tok_s --key ratio -- \
        benchmarks/throughput.py --cpu-streams 16 --input-len 128 --output-len 128

Each run gets `--json <file>`; the given keys of every run's JSON are printed per tree (all values, median).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def export_tree(commit: str) -> str:
    """A temporary folder holding `commit`'s tracked files."""
    out = tempfile.mkdtemp(prefix=f"tree-{commit}-")
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    return out


def run_in(tree: str, script: list[str], out_json: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)}
    subprocess.run(
        [sys.executable, *script, "--json", out_json],
        cwd=tree,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with open(out_json) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--base",
        required=True,
        help="the older commit, or a folder holding its files (where there is "
        "no git history: a lent machine gets the working tree only)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--key", action="append", required=True, help="a top-level key of the script's JSON")
    ap.add_argument("--json", default=None, help="write every run's results here")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- then the script and its arguments")
    args = ap.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    given = os.path.isdir(args.base)
    base = os.path.abspath(args.base) if given else export_tree(args.base)
    trees = {"this tree": ROOT, args.base: base}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                for name, tree in trees.items():
                    runs[name].append(run_in(tree, script, os.path.join(tmp, "out.json")))
                    print(
                        f"round {r + 1} {name}: " + ", ".join(f"{k} {runs[name][-1].get(k)}" for k in args.key),
                        flush=True,
                    )
    finally:
        if not given:
            shutil.rmtree(base, ignore_errors=True)
    for name, results in runs.items():
        for key in args.key:
            vals = [x[key] for x in results if isinstance(x.get(key), (int, float))]
            if vals:
                print(f"{name}: {key} {', '.join(f'{v:.2f}' for v in vals)} (median {statistics.median(vals):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"base": args.base, "script": script, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
