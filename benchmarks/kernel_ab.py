"""End to end on a noisy shared CPU: this tree's quantized kernels against an older commit's build, swapped in the
same process and interleaved request by request, so drifting load from other processes hits both alike.

    python benchmarks/kernel_ab.py spec --rounds 3         # n-gram speculation on/off x kernel new/old, 8 prompts
    python benchmarks/kernel_ab.py streams --rounds 3      # 16 streams x kernel new/old, llama.cpp's single stream
    python benchmarks/kernel_ab.py streams --base b44f9c3 --panel-rows 8   # and new with the panel GEMM from 8 rows
    python benchmarks/kernel_ab.py prefill --base 75d6e81 --rounds 6      # 512-token prefills, 2 per kernel a round

spec: benchmarks/speculation.py's prompts and settings (greedy, 128 tokens, batch 1, prefix caching off); per
round the speed-up of speculation over none with each kernel. streams: benchmarks/throughput.py --cpu-streams'
workload (128-token random prompts, 128 greedy tokens each, ignore_eos), then llama.cpp's single stream after
the engine is shut down (its threads would compete). Only the C library changes between "new" and "old"
(cpu_kernels.build_library of --base's sources); the Python engine is this tree's, in both.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.qgemm_rows import build_at  # noqa: E402
from novainfer.attention import cpu_backend  # noqa: E402
from novainfer.layers.quantization import cpu_kernels, gguf_cpu, gguf_repack  # noqa: E402


def use(lib, panel_rows: int | None = None) -> None:
    """Every later kernel call (GEMMs and the decode-step ops) goes to lib, whose GEMMs hand over to the panel
    kernel from panel_rows rows (None: the default); an older build without the panel GEMM or the C prefill
    attention gets the Python paths it had (dequantize + sgemm, torch attention)."""
    cpu_kernels._library = lambda: lib
    if hasattr(lib, "set_panel_min_rows"):
        lib.set_panel_min_rows(panel_rows or cpu_kernels.PANEL_MIN_ROWS)
    cpu_backend.PREFILL_KERNEL = hasattr(lib, "prefill_attention_bf16")
    gguf_cpu.PREFILL_DEQUANT = not hasattr(lib, "q4_gemm_panel")


def timed(llm, prompts: list[list[int]], params) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]


def spec(args, libs) -> dict:
    from benchmarks.speculation import PROMPTS, chat_ids
    from novainfer import LLM, SamplingParams
    cfg = json.loads(args.speculative_config)
    engines = {"off": LLM(enable_prefix_caching=False),
               "on": LLM(enable_prefix_caching=False, speculative_config=cfg)}
    prompts = [chat_ids(engines["off"].get_tokenizer(), p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in engines.values():
        timed(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=16))  # warm-up
    runs = {(k, e): [] for k in libs for e in engines}
    tokens = {}
    for r in range(args.rounds):
        wall = {key: 0.0 for key in runs}
        for i, p in enumerate(prompts):
            order = [(k, e) for k in libs for e in engines]
            for kernel, eng in (order if (r + i) % 2 == 0 else order[::-1]):
                use(*libs[kernel])
                t, toks = timed(engines[eng], [p], params)
                wall[kernel, eng] += t
                tokens.setdefault((kernel, eng, i), toks[0])
        n = sum(len(tokens["new", "off", i]) for i in range(len(prompts)))
        for key in runs:
            runs[key].append(n / wall[key])
        print(f"round {r + 1}: " + ", ".join(f"{k}/{e} {runs[k, e][-1]:.1f} tok/s" for k, e in runs) + " | speed-up "
              + ", ".join(f"{k} {runs[k, 'on'][-1] / runs[k, 'off'][-1]:.2f}x" for k in libs), flush=True)
    equal = all(tokens[k, e, i] == tokens["new", "off", i] for k, e in runs for i in range(len(prompts)))
    return {"spec": cfg, "tok_s": {f"{k}/{e}": v for (k, e), v in runs.items()}, "greedy_equal": equal,
            "speedup": {k: [on / off for on, off in zip(runs[k, "on"], runs[k, "off"])] for k in libs}}


def streams(args, libs) -> dict:
    from benchmarks import llamacpp_baseline
    from benchmarks.throughput import make_workload
    from novainfer import LLM, SamplingParams
    from novainfer.loader.model_loader import resolve_model_path
    llm = LLM()
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    prompts, _ = make_workload(args.streams * args.rounds * len(libs) + 1, 128, 128, vocab, 0)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    timed(llm, [prompts[-1][:16]], SamplingParams(max_tokens=4))
    res = {k: [] for k in libs}
    batches = iter(range(0, len(prompts) - 1, args.streams))
    for r in range(args.rounds):
        for kernel in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
            use(*libs[kernel])
            b = next(batches)  # fresh prompts every run: no prefix-cache help
            t, toks = timed(llm, prompts[b:b + args.streams], params)
            res[kernel].append(sum(map(len, toks)) / t)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in res.items()), flush=True)
    llm.llm_engine.shutdown()  # its threads would compete with llama.cpp's
    del llm
    lc, _ = llamacpp_baseline.load(resolve_model_path(None), cpu_kernels.num_threads())
    llamacpp_baseline.greedy(lc, prompts[-1][:16], 4)
    res["llama.cpp 1 stream"] = []
    for r in range(args.rounds):
        toks, t = llamacpp_baseline.greedy(lc, prompts[r], 128)
        res["llama.cpp 1 stream"].append(len(toks) / t)
    best = max(res["llama.cpp 1 stream"])
    print(f"llama.cpp single stream {res['llama.cpp 1 stream']} tok/s; new / best llama.cpp "
          f"{statistics.median(res['new']) / best:.2f}x (median), old {statistics.median(res['old']) / best:.2f}x")
    return {"streams": args.streams, "tok_s": res}


def prefill(args, libs) -> dict:
    """Fresh 512-token prompts (one output token, greedy), two per kernel each round, kernels taking turns."""
    import numpy as np

    from novainfer import LLM, SamplingParams
    llm = LLM()
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1)
    timed(llm, [rng.integers(100, vocab, 16).tolist()], params)
    res = {k: [] for k in libs}
    for r in range(args.rounds):
        for kernel in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
            use(*libs[kernel])
            for _ in range(2):
                res[kernel].append(timed(llm, [rng.integers(100, vocab, 512).tolist()], params)[0] * 1e3)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-2]:.0f}/{v[-1]:.0f} ms" for k, v in res.items()), flush=True)
    llm.llm_engine.shutdown()
    return {"prefill_ms": res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["spec", "streams", "prefill"])
    ap.add_argument("--base", default="6404181", help="commit whose C kernels are 'old'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--panel-rows", type=int, default=None,
                    help="a third variant: this tree's kernels handing over to the panel GEMM from this many rows")
    ap.add_argument("--base-panel-rows", type=int, default=64,
                    help="the row count from which the base's GEMMs hand over to its panel kernel (its default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    libs = {"new": (cpu_kernels.library(),), "old": (build_at(args.base), args.base_panel_rows)}
    if args.panel_rows:
        libs[f"new, panel from {args.panel_rows} rows"] = (cpu_kernels.library(), args.panel_rows)
    if not libs["old"][0].scale_f16:  # a base before float16 scales: both load float32 ones (one set of weights)
        gguf_repack.FP16_SCALES = False
    out = {"spec": spec, "streams": streams, "prefill": prefill}[args.mode](args, libs)
    for k, v in out.get("speedup", out.get("tok_s", out.get("prefill_ms"))).items():
        print(f"{k}: median {statistics.median(v):.2f}, range {min(v):.2f}-{max(v):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
