"""The benchmark scripts run end to end on the CPU with a tiny random model and write sane JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name: str, *args: str, tmp_path) -> dict:
    out = tmp_path / f"{name}.json"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", name),
        "--model",
        "random:tiny",
        "--device",
        "cpu",
        "--compare-hf",
        "--json",
        str(out),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HF transformers" in proc.stdout
    return json.loads(out.read_text())


def test_throughput_benchmark_runs(tmp_path):
    r = run_script("throughput.py", "--num-prompts", "5", "--input-len", "12", "--output-len", "6", tmp_path=tmp_path)
    assert r["output_tokens"] == 30 and r["hf_output_tokens"] == 30
    assert r["novainfer_tok_s"] > 0 and r["hf_tok_s"] > 0 and r["ratio"] > 0


def test_throughput_default_shape_is_nano_vllm(tmp_path):
    from benchmarks.throughput import make_workload

    prompts, outs = make_workload(256, None, None, 151936, 0)
    assert len(prompts) == 256 and all(100 <= len(p) <= 1024 for p in prompts)
    assert all(100 <= n <= 1024 for n in outs) and len(set(outs)) > 100
    assert make_workload(256, None, None, 151936, 0) == (prompts, outs), "seeded: the same workload every run"


def test_latency_benchmark_runs(tmp_path):
    r = run_script(
        "latency.py",
        "--prompt-len",
        "12",
        "--output-len",
        "24",
        "--ttft-prompt-len",
        "24",
        "--repeat",
        "3",
        tmp_path=tmp_path,
    )
    assert r["decode_tok_s"] > 0 and r["ttft_ms"] > 0 and r["hf_decode_tok_s"] > 0


def test_device_timeline_accounts_for_every_step(tmp_path):
    """The whole-run profile (benchmarks/tuning/device_timeline.py) on the CPU: each step lands in one kind, the
    busy time (a union of intervals) never exceeds the span, and the kinds' kernel time adds up."""
    out = tmp_path / "timeline.json"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "tuning", "device_timeline.py"),
        "--model",
        "random:tiny",
        "--device",
        "cpu",
        "--num-prompts",
        "3",
        "--max-len",
        "8",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert 0 < r["busy_s"] <= r["span_s"] + 1e-9 and r["kernels"] > 0
    assert sum(p["steps"] for p in r["phases"].values()) == r["steps"] >= 8  # one prefill step, then decode
    assert "mixed (prefill tokens in the step)" in r["phases"]
    assert sum(r["gaps"][k][0] for k in r["gaps"]) > 0


def test_union_merges_overlaps():
    from benchmarks.tuning.device_timeline import overlap, union

    merged = union([(5, 9), (0, 3), (2, 4), (9, 10)])
    assert merged == [(0, 4), (5, 10)]
    assert overlap(merged, 3, 6) == 2 and overlap(merged, 20, 30) == 0
