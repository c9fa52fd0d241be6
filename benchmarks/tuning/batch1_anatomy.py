"""Where a batch-1 decode step's time goes on a GPU: the device's floor against the engine's step.

    python benchmarks/tuning/batch1_anatomy.py --model random:qwen2.5-0.5b
Times, in one process: (1) replays of the captured batch-1 decode graph alone, back to back (the device's
floor for the transformer stack); (2) replay + logits + greedy argmax, synchronized every step (what the
device does per engine step when nothing overlaps); (3) the engine's batch-1 greedy decode, overlap on and
off; (4) torch.profiler over engine steps: kernels launched and device-busy time per step. If (3) is close to
(2) the step is device-bound; if well above, the host loop is the bound.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.checkpoints import resolve_model  # noqa: E402


def _per_call_ms(fn, n: int) -> float:
    import torch

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def _engine_tok_s(llm, prompt: list[int], n: int) -> float:
    from novainfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--out", "--json", dest="out", default=None, help="write the figures as JSON here")
    ap.add_argument(
        "--kwargs",
        type=json.loads,
        default={},
        help="engine settings for every run, e.g. '{\"gpu_decode_stack\": false}'",
    )
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from novainfer import LLM, SamplingParams

    path = resolve_model(args.model)
    prompt = list(range(100, 132))
    res: dict[str, float] = {}
    for overlap in (True, False):
        llm = LLM(path, device="cuda", async_scheduling=overlap, **args.kwargs)
        res[f"engine_tok_s_overlap_{'on' if overlap else 'off'}"] = _engine_tok_s(llm, prompt, args.output_len)
        if overlap:
            runner = llm.llm_engine.executor.workers[0].model_runner
            graphs, model = runner.graphs, runner.model
            with torch.inference_mode():
                res["graph_replay_ms"] = _per_call_ms(lambda: graphs.replay(1), 500)

                def full() -> None:
                    hidden = graphs.replay(1)
                    model.compute_logits(hidden).float().argmax(-1).item()

                res["replay_logits_argmax_sync_ms"] = _per_call_ms(full, 500)
            params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
            engine = llm.llm_engine
            s0 = engine.step_id
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                torch.cuda.synchronize()
            steps = engine.step_id - s0
            events = [e for e in prof.events() if e.device_type.name == "CUDA"]
            busy = sum(e.device_time for e in events) / 1e3  # us -> ms
            res["profiled_steps"] = steps
            res["kernels_per_step"] = len(events) / steps
            res["device_busy_ms_per_step"] = busy / steps
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
        llm.llm_engine.engine_core.shutdown()
        del llm
        torch.cuda.empty_cache()
    for k in ("engine_tok_s_overlap_on", "engine_tok_s_overlap_off"):
        res[k.replace("tok_s", "ms_per_step")] = 1e3 / res[k]
    print(f"| {args.model} batch-1 | value |\n| --- | --- |")
    for k, v in res.items():
        print(f"| {k} | {v:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "kwargs": args.kwargs, **res}, f, indent=1)


if __name__ == "__main__":
    main()
