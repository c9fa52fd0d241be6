"""Where a step's time goes on the host: cProfile over the engine loop for a decode-heavy workload.

    python benchmarks/tuning/profile_step.py --model random:qwen2.5-0.5b --num-prompts 256 --output-len 128
Prints the functions with the most own time, and the mean step time split into the runner's stages.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.checkpoints import load_format, resolve_model  # noqa: E402
from benchmarks.throughput import make_workload, sync  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=1, help="profile this many workloads back to back, each fresh")
    ap.add_argument("--sort", nargs="+", default=["tottime"], help="pstats orders to print (tottime, cumulative)")
    ap.add_argument("--torch-profiler", action="store_true", help="torch.profiler (host + device) instead of cProfile")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="fp8: vLLM's dynamic FP8 linear layers")
    args = ap.parse_args()
    from novainfer import LLM, SamplingParams

    llm = LLM(
        resolve_model(args.model),
        device=args.device,
        load_format=load_format(args.model),
        quantization=args.quantization,
    )
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    # one more workload than the rounds: the first warms up; fresh prompts each round (no prefix-cache hits)
    prompts, outs = make_workload(args.num_prompts * (args.rounds + 1), args.input_len, args.output_len, vocab, 0)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    warm, inputs = inputs[: args.num_prompts], inputs[args.num_prompts :]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.output_len)
    llm.generate(warm, params, use_tqdm=False)
    engine = llm.llm_engine
    steps0 = engine.step_id
    sync()
    if args.torch_profiler:
        import torch
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            llm.generate(inputs[: args.num_prompts], params, use_tqdm=False)
            sync()
            elapsed = time.perf_counter() - t0
        steps = engine.step_id - steps0
        print(f"{steps} steps, {elapsed / steps * 1e3:.2f} ms/step under torch.profiler")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
        print(
            prof.key_averages().table(
                sort_by="self_cuda_time_total" if torch.__version__ < "2.4" else "self_device_time_total",
                row_limit=args.top,
                max_name_column_width=60,
            )
        )
        return
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for r in range(args.rounds):
        llm.generate(inputs[r * args.num_prompts : (r + 1) * args.num_prompts], params, use_tqdm=False)
        sync()
    prof.disable()
    sync()
    elapsed = time.perf_counter() - t0
    steps = engine.step_id - steps0
    print(
        f"{steps} steps, {elapsed / steps * 1e3:.2f} ms/step under cProfile, "
        f"{args.rounds * args.num_prompts * args.output_len / elapsed:,.0f} output tok/s"
    )
    for key in args.sort:
        pstats.Stats(prof).sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
