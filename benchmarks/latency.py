"""Latency: batch-1 decode speed (128-token prompt, 256 new tokens) and time to first token (512-token prompt).

Decode tok/s = 255 / (time for 256 new tokens - time for 1), so prefill is left out. Example:
    python benchmarks/latency.py --model random:qwen2.5-0.5b --compare-hf --json out.json

--compare-llamacpp (a GGUF model; `--model default`, here as without it, is the default model) runs llama.cpp on the same file,
the same prompt token ids, greedy, the same thread count, and gives every timed run a fresh prompt (so
neither engine serves a repeat from a prefix cache); NovaInfer runs with its default settings.
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


def decode_rate(n: int, t_full: float, t_one: float) -> float:
    """Decode tok/s from the time of n tokens and of one: (n - 1) / (t_full - t_one); refused when the runs' noise
    exceeds the decode time (too few tokens or repeats), rather than reported as a negative or huge rate."""
    if t_full <= t_one:
        raise SystemExit(
            f"decode time not resolved: {n} tokens took {t_full:.4f} s, one {t_one:.4f} s; raise --output-len"
        )
    return (n - 1) / (t_full - t_one)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--ttft-prompt-len", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan step N+1 while step N runs (default: on with CUDA, off on the CPU)",
    )
    ap.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--quantization",
        default=None,
        choices=["fp8", "gguf", "none"],
        help="fp8: the linear weights to float8 at load (vLLM's dynamic FP8); default: none for HF folders",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--compare-hf", action="store_true", help="with --compare-llamacpp too: a third row")
    ap.add_argument("--compare-llamacpp", action="store_true", help="llama.cpp on the same GGUF (see module doc)")
    ap.add_argument(
        "--compare-kwargs",
        type=json.loads,
        default=None,
        help="with --compare-llamacpp: one more NovaInfer row built with these LLM arguments, taking "
        "turns too (an A/B of one setting), e.g. '{\"enable_prefix_caching\": false}'",
    )
    ap.add_argument(
        "--decode-after-first-token",
        action="store_true",
        help="with --compare-llamacpp: decode tok/s from one run per round, (n - 1) / (time of the last "
        "token - time of the first), not the difference of two runs (whose prefill noise swamps "
        "the decode time of a long prompt)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    if args.compare_llamacpp:
        return compare_llamacpp(args)
    from novainfer import LLM, SamplingParams
    from novainfer.loader.model_loader import resolve_model_path

    path = resolve_model_path(None) if args.model == "default" else resolve_model(args.model)
    llm = LLM(
        path,
        enforce_eager=args.enforce_eager,
        device=args.device,
        enable_prefix_caching=False,
        gpu_memory_utilization=args.gpu_memory_utilization,
        load_format=load_format(args.model),
        async_scheduling=args.async_scheduling,
        speculative_config=args.speculative_config,
        quantization=args.quantization,
    )
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    (prompt,), _ = make_workload(1, args.prompt_len, 1, vocab, 0)
    (long_prompt,), _ = make_workload(1, args.ttft_prompt_len, 1, vocab, 1)

    def gen(p: list[int], n: int):
        return lambda: llm.generate(
            [{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False
        )

    t_full = timed(gen(prompt, args.output_len), args.repeat)
    t_one = timed(gen(prompt, 1), args.repeat)
    ttft = timed(gen(long_prompt, 1), args.repeat)
    r = {
        "model": args.model,
        "device": device_name(),
        "decode_tok_s": decode_rate(args.output_len, t_full, t_one),
        "ttft_ms": ttft * 1e3,
        "enforce_eager": args.enforce_eager,
        "quantization": args.quantization,
    }
    if args.compare_hf:
        del llm
        r.update(hf_latency(path, prompt, long_prompt, args.output_len, args.repeat))
        r["decode_ratio"] = r["decode_tok_s"] / r["hf_decode_tok_s"]
    print(f"\n| engine | batch-1 decode tok/s | TTFT {args.ttft_prompt_len}-token prompt (ms) |\n|---|---|---|")
    print(f"| NovaInfer | {r['decode_tok_s']:,.0f} | {r['ttft_ms']:.1f} |")
    if args.compare_hf:
        print(f"| HF transformers | {r['hf_decode_tok_s']:,.0f} | {r['hf_ttft_ms']:.1f} |")
        print(f"decode ratio NovaInfer / HF: {r['decode_ratio']:.1f}x")
    print(f"device: {r['device']}; quantization: {r['quantization'] or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


def compare_llamacpp(args: argparse.Namespace) -> None:
    """The engines side by side in this process, taking turns every round (a load that comes and goes on a
    shared machine then hits all of them alike), a fresh prompt for every timed run. Decode tok/s per round
    is (n - 1) / (time for n tokens - time for 1); "best" uses the fastest of each over the rounds."""
    import torch

    from benchmarks import llamacpp_baseline
    from novainfer import LLM, SamplingParams
    from novainfer.loader.model_loader import resolve_model_path

    path = resolve_model_path(None if args.model == "default" else args.model)
    threads = torch.get_num_threads()
    llm = LLM(path)  # the defaults a user gets
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    seeds = iter(range(100, 10_000))

    def fresh(n: int) -> list[int]:
        return make_workload(1, n, 1, vocab, next(seeds))[0][0]

    def runner(engine: LLM):
        def nova(prompt: list[int], n: int) -> tuple[list[int], float]:
            t0 = time.perf_counter()
            out = engine.generate(
                [{"prompt_token_ids": prompt}],
                SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                use_tqdm=False,
            )
            return out[0].outputs[0].token_ids, time.perf_counter() - t0

        return nova

    nova = runner(llm)

    n_ctx = max(2048, max(args.prompt_len, args.ttft_prompt_len) + args.output_len + 16)  # long-context runs
    lc, version = llamacpp_baseline.load(path, threads, n_ctx=n_ctx)
    r = {"model": path, "threads": threads, "llamacpp_version": version}
    engines = {"novainfer": nova, "llamacpp": lambda p, n: llamacpp_baseline.greedy(lc, p, n)}
    names = {"novainfer": "NovaInfer (defaults)", "llamacpp": f"llama.cpp {version}"}
    if args.compare_kwargs:
        other = LLM(path, **args.compare_kwargs)
        engines["novainfer_b"], names["novainfer_b"] = runner(other), f"NovaInfer {json.dumps(args.compare_kwargs)}"
        r["compare_kwargs"] = args.compare_kwargs
    if args.compare_hf:  # transformers' own GGUF loading (dequantized to float32), greedy, the same prompts
        import transformers
        from transformers import AutoModelForCausalLM

        from benchmarks.hf_baseline import run

        hf = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        ).eval()

        def hf_run(p: list[int], n: int) -> tuple[None, float]:
            t0 = time.perf_counter()
            with torch.inference_mode():
                run(hf, [p], [n], 0.0, 0, "cpu")
            return None, time.perf_counter() - t0

        engines["hf"], names["hf"] = hf_run, f"HF transformers {transformers.__version__} (float32)"
    streamed = {
        "novainfer": lambda p, n: nova_after_first(llm, p, n),
        "llamacpp": lambda p, n: llamacpp_baseline.greedy_after_first(lc, p, n),
    }
    if args.decode_after_first_token and set(engines) - set(streamed):
        raise SystemExit("--decode-after-first-token times NovaInfer's defaults and llama.cpp only")
    times = {k: {"one": [], "full": [], "prefill": []} for k in engines}
    for run_engine in engines.values():
        run_engine(fresh(16), 4)  # warm-up
    for _ in range(args.repeat):
        for key, run_engine in engines.items():
            p = fresh(args.prompt_len)
            if args.decode_after_first_token:  # "one": the first token's time, "full": the last one's, one run
                times[key]["one"].append(0.0)
                times[key]["full"].append(streamed[key](p, args.output_len))
            else:
                times[key]["one"].append(run_engine(p, 1)[1])
                # another fresh prompt of the same length: changing only its last token left 7 of its 8 blocks in
                # NovaInfer's prefix cache, so this run's prefill was shorter than the one-token run's (llama.cpp's
                # reset() reuses nothing) and the decode figure came out too high
                times[key]["full"].append(run_engine(fresh(args.prompt_len), args.output_len)[1])
            times[key]["prefill"].append(run_engine(fresh(args.ttft_prompt_len), 1)[1] * 1e3)
    n = args.output_len - 1
    for key, t in times.items():
        r[key] = {
            "decode_tok_s": [n / (f - o) for f, o in zip(t["full"], t["one"])],
            "decode_tok_s_best": n / (min(t["full"]) - min(t["one"])),
            "prefill_ms": t["prefill"],
            **t,
        }
    r["decode_method"] = "after first token" if args.decode_after_first_token else "two runs"
    same = fresh(args.prompt_len)
    ours, theirs = nova(same, 32)[0], llamacpp_baseline.greedy(lc, same, 32)[0]
    r["greedy_tokens_agree"] = sum(a == b for a, b in zip(ours, theirs))
    llm.llm_engine.shutdown()
    if args.compare_kwargs:
        other.llm_engine.shutdown()
    method = (
        "from the first token to the last of one run"
        if args.decode_after_first_token
        else "as an n-token run less a 1-token run"
    )
    print(
        f"\n{args.prompt_len}-token prompts, {args.output_len} new tokens, {args.ttft_prompt_len}-token prefill, "
        f"{threads} threads, fresh prompt per run, engines taking turns; ranges over {args.repeat} rounds; "
        f"decode timed {method}\n"
        f"| engine | batch-1 decode tok/s (best) | prefill of a {args.ttft_prompt_len}-token prompt (ms) |\n"
        "|---|---|---|"
    )
    for key in engines:
        d, p = r[key]["decode_tok_s"], r[key]["prefill_ms"]
        print(
            f"| {names[key]} | {min(d):.1f}-{max(d):.1f} ({r[key]['decode_tok_s_best']:.1f}) | "
            f"{min(p):,.0f}-{max(p):,.0f} |"
        )
    nv, lcr = r["novainfer"], r["llamacpp"]
    ratio = [a / b for a, b in zip(nv["decode_tok_s"], lcr["decode_tok_s"])]
    pre = [b / a for a, b in zip(nv["prefill_ms"], lcr["prefill_ms"])]
    print(
        f"per round, NovaInfer / llama.cpp: decode {min(ratio):.2f}-{max(ratio):.2f}x (best "
        f"{nv['decode_tok_s_best'] / lcr['decode_tok_s_best']:.2f}x); prefill speed-up {min(pre):.2f}-"
        f"{max(pre):.2f}x (best {min(lcr['prefill_ms']) / min(nv['prefill_ms']):.2f}x); "
        f"greedy tokens equal to llama.cpp's: {r['greedy_tokens_agree']}/32"
    )
    if args.compare_kwargs:
        b = r["novainfer_b"]["decode_tok_s"]
        ratio = [x / y for x, y in zip(nv["decode_tok_s"], b)]
        print(
            f"per round, NovaInfer defaults / {names['novainfer_b']}: decode {min(ratio):.2f}-{max(ratio):.2f}x "
            f"(best {nv['decode_tok_s_best'] / r['novainfer_b']['decode_tok_s_best']:.2f}x)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


def nova_after_first(llm, prompt: list[int], n: int) -> float:
    """Seconds from NovaInfer's first generated token to its n-th (greedy, one request, stepped by hand)."""
    from novainfer import SamplingParams

    engine = llm.llm_engine
    engine.add_request(
        f"latency-{time.monotonic_ns()}",
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
    )
    first = last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids:
                last = time.perf_counter()
                first = first or last
    return last - first


def hf_latency(path: str, prompt: list[int], long_prompt: list[int], n: int, repeat: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.hf_baseline import run

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = (
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        .to(device)
        .eval()
    )
    t_full = timed(lambda: run(model, [prompt], [n], 0.0, 0, device), repeat)
    t_one = timed(lambda: run(model, [prompt], [1], 0.0, 0, device), repeat)
    ttft = timed(lambda: run(model, [long_prompt], [1], 0.0, 0, device), repeat)
    return {"hf_decode_tok_s": decode_rate(n, t_full, t_one), "hf_ttft_ms": ttft * 1e3}


if __name__ == "__main__":
    main()
