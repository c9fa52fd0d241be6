"""Offline throughput: NovaInfer's LLM.generate on a batch of random-token prompts, optionally against
Hugging Face transformers on the same prompts in the same run.

Default workload: nano-vllm's bench shape (256 prompts of 100-1024 random tokens, 100-1024 output tokens
each, ignore_eos, temperature 0.6, seed 0). Example:
    python benchmarks/throughput.py --model random:qwen2.5-0.5b --compare-hf --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.checkpoints import load_format, resolve_model  # noqa: E402
from benchmarks.hf_baseline import hf_generate  # noqa: E402


def make_workload(num_prompts: int, input_len: int | None, output_len: int | None, vocab: int, seed: int):
    """Random prompts as token ids and each prompt's output length (fixed lengths when given, else 100-1024)."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_prompts):
        n = input_len or rng.randint(100, 1024)
        prompts.append([rng.randint(0, min(vocab, 10000) - 1) for _ in range(n)])
        outs.append(output_len or rng.randint(100, 1024))
    return prompts, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen2.5-0.5b", help="a model path, or random:<config>")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=None, help="fixed prompt length (default: 100-1024)")
    ap.add_argument("--output-len", type=int, default=None, help="fixed output length (default: 100-1024)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--distributed-executor-backend", default="uni", choices=["uni", "mp"])
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
        "--mamba-ssm-cache-dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="hybrid models' recurrent state (default: the engine's, float32)",
    )
    ap.add_argument(
        "--quantization",
        default=None,
        choices=["fp8", "gguf", "none"],
        help="fp8: the linear weights to float8 at load (vLLM's dynamic FP8); default: none for HF folders",
    )
    ap.add_argument("--compare-hf", action="store_true", help="also run transformers on the same prompts")
    ap.add_argument("--hf-num-prompts", type=int, default=None, help="HF on the first N prompts only")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--cpu-streams",
        type=int,
        default=0,
        help="CPU many-streams mode: N concurrent greedy streams of the default (or given GGUF) model "
        "with default settings against llama.cpp's single stream on the same file",
    )
    args = ap.parse_args()
    if args.cpu_streams:
        return cpu_streams(args)

    from novainfer import LLM, SamplingParams

    path = resolve_model(args.model)
    llm = LLM(
        path,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        device=args.device,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        master_port=0,
        load_format=load_format(args.model),
        async_scheduling=args.async_scheduling,
        speculative_config=args.speculative_config,
        quantization=args.quantization,
        **({"mamba_ssm_cache_dtype": args.mamba_ssm_cache_dtype} if args.mamba_ssm_cache_dtype else {}),
    )
    engine = llm.llm_engine
    vocab = engine.config.model_config.hf_config.vocab_size
    prompts, out_lens = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n, seed=None) for n in out_lens]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    sync()
    elapsed = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    assert gen == sum(out_lens), "every request must produce exactly its max_tokens (ignore_eos)"
    result = {
        "model": args.model,
        "num_prompts": len(prompts),
        "input_tokens": sum(map(len, prompts)),
        "output_tokens": gen,
        "novainfer_s": elapsed,
        "novainfer_tok_s": gen / elapsed,
        "kv_cache_tokens": engine.block_manager.num_blocks * engine.config.cache_config.block_size,
        "device": device_name(),
        "tensor_parallel_size": args.tensor_parallel_size,
        "quantization": args.quantization,
        "mamba_ssm_cache_dtype": args.mamba_ssm_cache_dtype,
        "distributed_executor_backend": args.distributed_executor_backend,
        "async_scheduling": engine.engine_core.async_scheduling,
    }
    engine.shutdown()
    if args.compare_hf:
        del llm, engine, outs
        n = args.hf_num_prompts or len(prompts)
        hf_s, hf_tokens = hf_generate(path, prompts[:n], out_lens[:n], args.hf_batch_size, args.temperature)
        result.update(
            hf_prompts=n,
            hf_s=hf_s,
            hf_output_tokens=hf_tokens,
            hf_tok_s=hf_tokens / hf_s,
            ratio=result["novainfer_tok_s"] / (hf_tokens / hf_s),
        )
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def cpu_streams(args: argparse.Namespace) -> None:
    """N streams (input-len prompt, output-len tokens each, greedy, ignore_eos) at once in NovaInfer's
    default engine, then one stream of the same shape in llama.cpp, in this process one after the other."""
    import torch

    from benchmarks import llamacpp_baseline
    from novainfer import LLM, SamplingParams
    from novainfer.loader.model_loader import resolve_model_path

    path = resolve_model_path(None if args.model in ("default", "random:qwen2.5-0.5b") else args.model)
    n_in, n_out, threads = args.input_len or 128, args.output_len or 128, torch.get_num_threads()
    llm = LLM(path)
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    prompts, _ = make_workload(args.cpu_streams + 1, n_in, n_out, vocab, args.seed)
    params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[-1][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:-1]], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.llm_engine.shutdown()
    del llm, outs
    lc, version = llamacpp_baseline.load(path, threads)
    llamacpp_baseline.greedy(lc, prompts[-1][:16], 4)
    toks, lc_s = llamacpp_baseline.greedy(lc, prompts[-1], n_out)
    r = {
        "model": path,
        "threads": threads,
        "streams": args.cpu_streams,
        "novainfer_tok_s": gen / elapsed,
        "llamacpp_version": version,
        "llamacpp_single_stream_tok_s": len(toks) / lc_s,
    }
    r["ratio"] = r["novainfer_tok_s"] / r["llamacpp_single_stream_tok_s"]
    print(
        f"\n{n_in}-token prompts, {n_out} greedy tokens each (prefill included), {threads} threads\n"
        f"| engine | streams | output tok/s |\n|---|---|---|\n"
        f"| NovaInfer (defaults) | {args.cpu_streams} | {r['novainfer_tok_s']:.1f} |\n"
        f"| llama.cpp {version} | 1 | {r['llamacpp_single_stream_tok_s']:.1f} |\n"
        f"ratio: {r['ratio']:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def print_table(r: dict) -> None:
    print("\n| engine | prompts | output tokens | time (s) | output tok/s |\n|---|---|---|---|---|")
    print(
        f"| NovaInfer | {r['num_prompts']} | {r['output_tokens']} | {r['novainfer_s']:.2f} | "
        f"{r['novainfer_tok_s']:,.0f} |"
    )
    if "hf_s" in r:
        print(
            f"| HF transformers | {r['hf_prompts']} | {r['hf_output_tokens']} | {r['hf_s']:.2f} | "
            f"{r['hf_tok_s']:,.0f} |"
        )
        print(f"ratio NovaInfer / HF: {r['ratio']:.1f}x")
    print(
        f"device: {r['device']}; tp={r['tensor_parallel_size']} ({r['distributed_executor_backend']}); "
        f"quantization: {r['quantization'] or 'none'}; KV cache per rank: {r['kv_cache_tokens']:,} tokens; "
        f"async scheduling: {'on' if r.get('async_scheduling') else 'off'}"
    )


if __name__ == "__main__":
    main()
