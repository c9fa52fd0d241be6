"""Latency: batch-1 decode speed (128-token prompt, 256 new tokens) and time to first token (512-token prompt).

Decode tok/s = 255 / (time for 256 new tokens - time for 1), so prefill is left out. Example:
    python benchmarks/latency.py --model random:qwen2.5-0.5b --compare-hf --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.checkpoints import load_format, resolve_model  # noqa: E402
from benchmarks.throughput import device_name, make_workload, sync  # noqa: E402


def timed(fn, repeat: int) -> float:
    """Median wall time of fn over repeat runs, after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--ttft-prompt-len", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="plan step N+1 while step N runs (default: on with CUDA, off on the CPU)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--compare-hf", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from novainfer import LLM, SamplingParams
    path = resolve_model(args.model)
    llm = LLM(path, enforce_eager=args.enforce_eager, device=args.device, enable_prefix_caching=False,
              gpu_memory_utilization=args.gpu_memory_utilization, load_format=load_format(args.model),
              async_scheduling=args.async_scheduling)
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    (prompt,), _ = make_workload(1, args.prompt_len, 1, vocab, 0)
    (long_prompt,), _ = make_workload(1, args.ttft_prompt_len, 1, vocab, 1)

    def gen(p: list[int], n: int):
        return lambda: llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=n,
                                                                              ignore_eos=True), use_tqdm=False)
    t_full = timed(gen(prompt, args.output_len), args.repeat)
    t_one = timed(gen(prompt, 1), args.repeat)
    ttft = timed(gen(long_prompt, 1), args.repeat)
    r = {"model": args.model, "device": device_name(), "decode_tok_s": (args.output_len - 1) / (t_full - t_one),
         "ttft_ms": ttft * 1e3, "enforce_eager": args.enforce_eager}
    if args.compare_hf:
        del llm
        r.update(hf_latency(path, prompt, long_prompt, args.output_len, args.repeat))
        r["decode_ratio"] = r["decode_tok_s"] / r["hf_decode_tok_s"]
    print(f"\n| engine | batch-1 decode tok/s | TTFT {args.ttft_prompt_len}-token prompt (ms) |\n|---|---|---|")
    print(f"| NovaInfer | {r['decode_tok_s']:,.0f} | {r['ttft_ms']:.1f} |")
    if args.compare_hf:
        print(f"| HF transformers | {r['hf_decode_tok_s']:,.0f} | {r['hf_ttft_ms']:.1f} |")
        print(f"decode ratio NovaInfer / HF: {r['decode_ratio']:.1f}x")
    print(f"device: {r['device']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


def hf_latency(path: str, prompt: list[int], long_prompt: list[int], n: int, repeat: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.hf_baseline import run
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16 if device == "cuda" else torch.float32).to(device).eval()
    t_full = timed(lambda: run(model, [prompt], [n], 0.0, 0, device), repeat)
    t_one = timed(lambda: run(model, [prompt], [1], 0.0, 0, device), repeat)
    ttft = timed(lambda: run(model, [long_prompt], [1], 0.0, 0, device), repeat)
    return {"hf_decode_tok_s": (n - 1) / (t_full - t_one), "hf_ttft_ms": ttft * 1e3}


if __name__ == "__main__":
    main()
