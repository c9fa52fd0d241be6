"""End to end on a noisy shared CPU: this tree's quantized kernels against an older commit's build, swapped in the
same process and interleaved request by request, so drifting load from other processes hits both alike.

    python benchmarks/kernel_ab.py spec --rounds 3         # n-gram speculation on/off x kernel new/old, 8 prompts
    python benchmarks/kernel_ab.py streams --rounds 3      # 16 streams x kernel new/old, llama.cpp's single stream
    python benchmarks/kernel_ab.py streams --base b44f9c3 --panel-rows 8   # and new with the panel GEMM from 8 rows
    python benchmarks/kernel_ab.py prefill --base 75d6e81 --rounds 6      # 512-token prefills, 2 per kernel a round
    python benchmarks/kernel_ab.py prefill --base ab590c3 --one-thread    # the same at 1 thread, in CPU time
    python benchmarks/kernel_ab.py decode --base cfab95b --prompt-len 3000 --max-tokens 64  # batch 1, long context
    python benchmarks/kernel_ab.py gemm --base ab590c3 --rounds 9         # a 512-token prefill's 120 GEMMs
    python benchmarks/kernel_ab.py attention --base ab590c3 --rounds 9    # its 30 layers of prefill attention

spec: benchmarks/speculation.py's prompts and settings (greedy, 128 tokens, batch 1, prefix caching off); per
round the speed-up of speculation over none with each kernel. streams: benchmarks/throughput.py --cpu-streams'
workload (128-token random prompts, 128 greedy tokens each, ignore_eos), then llama.cpp's single stream after
the engine is shut down (its threads would compete). gemm / attention: the kernels alone, without the engine:
every decoder GEMM of the default model (its real weights, in layer order, so each is cold as in a prefill) at
--prompt-len rows, or the prefill attention of 30 layers' bf16 caches; one thread in this thread's CPU time,
then two in wall time, both builds taking turns, and whether they give the same bits. Only the C library changes between "new" and "old"
(the kernel builder, kernels/cpu/library.py, on --base's sources); the Python engine is this tree's, in both.
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
from novainfer.kernels.cpu import library, qgemm, repack as gguf_repack  # noqa: E402
from novainfer.layers.quantization import gguf_cpu  # noqa: E402


def use(lib, panel_rows: int | None = None) -> None:
    """Every later kernel call (GEMMs and the decode-step ops) goes to lib, whose GEMMs hand over to the panel
    kernel from panel_rows rows (None: the default); an older build without the panel GEMM or the C prefill
    attention gets the Python paths it had (dequantize + sgemm, torch attention)."""
    library._library = lambda: lib
    if hasattr(lib, "set_panel_min_rows"):
        lib.set_panel_min_rows(panel_rows or qgemm.PANEL_MIN_ROWS)
    cpu_backend.PREFILL_KERNEL = hasattr(lib, "prefill_attention_bf16")
    gguf_cpu.PREFILL_DEQUANT = not hasattr(lib, "q4_gemm_panel")


def timed(llm, prompts: list[list[int]], params, cpu: bool = False) -> tuple[float, list[list[int]]]:
    """Wall seconds of one generate call (cpu: this thread's CPU seconds, where the model runs at one thread:
    blind to the time other processes take the core, not to what they do to its caches)."""
    clock = time.thread_time if cpu else time.perf_counter
    t = clock()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return clock() - t, [list(o.outputs[0].token_ids) for o in outs]


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
    lc, _ = llamacpp_baseline.load(resolve_model_path(None), library.num_threads())
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
    """Fresh 512-token prompts (one output token, greedy), two per kernel each round, kernels taking turns; with
    --one-thread, at one thread and timed in this thread's CPU time (a steadier A/B on a shared machine)."""
    import numpy as np
    import torch

    from novainfer import LLM, SamplingParams
    llm = LLM()
    if args.one_thread:
        library.set_num_threads(1)
        torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1)
    timed(llm, [rng.integers(100, vocab, 16).tolist()], params)
    res = {k: [] for k in libs}
    for r in range(args.rounds):
        for kernel in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
            use(*libs[kernel])
            for _ in range(2):
                prompt = rng.integers(100, vocab, args.prompt_len).tolist()
                res[kernel].append(timed(llm, [prompt], params, args.one_thread)[0] * 1e3)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-2]:.0f}/{v[-1]:.0f} ms" for k, v in res.items()), flush=True)
    llm.llm_engine.shutdown()
    return {"prefill_ms": res, "one_thread_cpu_time": args.one_thread, "prompt_len": args.prompt_len}


def decode(args, libs) -> dict:
    """Batch-1 greedy decode of --max-tokens tokens after one --prompt-len prompt that sits in the prefix cache
    (each run's prefill is a one-block hit), kernels taking turns: what the replies of a long conversation cost.
    tok/s = max_tokens / (time for max_tokens + 1 tokens - time for 1)."""
    import numpy as np

    from novainfer import LLM, SamplingParams
    llm = LLM()
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    prompt = np.random.default_rng(0).integers(100, vocab, args.prompt_len).tolist()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=args.max_tokens + 1, ignore_eos=True)
    timed(llm, [prompt], one)  # fills the prefix cache
    res, tokens = {k: [] for k in libs}, {}
    for r in range(args.rounds):
        for kernel in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
            use(*libs[kernel])
            t1 = timed(llm, [prompt], one)[0]
            tn, toks = timed(llm, [prompt], many)
            res[kernel].append(args.max_tokens / (tn - t1))
            tokens.setdefault(kernel, toks[0])
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in res.items()), flush=True)
    llm.llm_engine.shutdown()
    greedy_equal = all(t == tokens["new"] for t in tokens.values())
    print(f"greedy tokens equal across kernels: {greedy_equal}")
    return {"tok_s": res, "greedy_equal": greedy_equal, "prompt_len": args.prompt_len}


def _turns(fns: dict, rounds: int, clock) -> dict:
    """ms of each fn per round, the order alternating round by round."""
    res = {k: [] for k in fns}
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t = clock()
            fns[k]()
            res[k].append((clock() - t) * 1e3)
    return res


def _kernel_runs(args, make_fns, same: bool) -> dict:
    out = {"same_bits": same}
    for threads, clock, what in ((1, time.thread_time, "1 thread, CPU ms"), (2, time.perf_counter, "2 threads, wall ms")):
        library.set_num_threads(threads)
        res = _turns(make_fns(), args.rounds, clock)
        ratio = sorted(n / o for n, o in zip(res["new"], res["old"]))
        print(f"{what}: old median {statistics.median(res['old']):.1f} (min {min(res['old']):.1f}), new "
              f"{statistics.median(res['new']):.1f} (min {min(res['new']):.1f}); new/old per round "
              f"{ratio[0]:.3f}-{ratio[-1]:.3f} (median {statistics.median(ratio):.3f}); same bits: {same}", flush=True)
        out[f"{threads}_thread_ms"] = res
    library.set_num_threads(None)
    return out


def gemm(args, libs) -> dict:
    """A prefill's decoder GEMMs (the default model's weights in layer order) at --prompt-len rows."""
    import torch

    from benchmarks.qgemm_rows import step_weights
    weights = step_weights()[:-1]  # a prefill's lm_head sees one row
    xs = [torch.randn(args.prompt_len, w.shape[1]) for w in weights]
    same = all(torch.equal(qgemm.quant_gemm(x, w, libs["new"][0]), qgemm.quant_gemm(x, w, libs["old"][0]))
               for x, w in zip(xs[:4], weights[:4]))

    def run(lib) -> None:
        for x, w in zip(xs, weights):  # each output freed before the next: no heap growth to page in
            qgemm.quant_gemm(x, w, lib)

    def make_fns():
        return {k: (lambda lib=lib[0]: run(lib)) for k, lib in libs.items()}
    return _kernel_runs(args, make_fns, same)


def attention(args, libs) -> dict:
    """30 layers of the default model's prefill attention (9 heads, 3 KV heads, head_dim 64) over --prompt-len
    fresh tokens, each layer its own bf16 cache."""
    import torch

    from novainfer.kernels.cpu import ops as cpu_ops
    n, nh, nkv, d, bs = args.prompt_len, 9, 3, 64, 16
    nb = (n + bs - 1) // bs
    caches = [(torch.randn(nb, bs, nkv, d).to(torch.bfloat16), torch.randn(nb, bs, nkv, d).to(torch.bfloat16))
              for _ in range(30)]
    q = torch.randn(n, nh, d)
    tables, starts, lens = torch.randperm(nb).to(torch.int32)[None], torch.tensor([0, n]), torch.tensor([n])

    def run(lib):
        use(lib)
        return [cpu_ops.prefill_attention_bf16(q, k, v, tables, starts, lens, 0.125, None, None) for k, v in caches]
    same = all(torch.equal(a, b) for a, b in zip(run(libs["new"][0])[:2], run(libs["old"][0])[:2]))

    def make_fns():
        return {k: (lambda lib=lib[0]: run(lib)) for k, lib in libs.items()}
    return _kernel_runs(args, make_fns, same)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["spec", "streams", "prefill", "decode", "gemm", "attention"])
    ap.add_argument("--base", default="6404181", help="commit whose C kernels are 'old'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--panel-rows", type=int, default=None,
                    help="a third variant: this tree's kernels handing over to the panel GEMM from this many rows")
    ap.add_argument("--base-panel-rows", type=int, default=64,
                    help="the row count from which the base's GEMMs hand over to its panel kernel (its default)")
    ap.add_argument("--one-thread", action="store_true", help="prefill: one thread, this thread's CPU time")
    ap.add_argument("--prompt-len", type=int, default=512, help="prefill, decode: tokens a prompt")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    libs = {"new": (library.library(),), "old": (build_at(args.base), args.base_panel_rows)}
    if args.panel_rows:
        libs[f"new, panel from {args.panel_rows} rows"] = (library.library(), args.panel_rows)
    if not libs["old"][0].panel_layout and args.mode != "attention":
        raise SystemExit(f"{args.base}'s kernels read weights in rows, not this tree's panels: compare whole trees in "
                         "separate processes instead (benchmarks/tree_ab.py)")
    if not libs["old"][0].scale_f16:  # a base before float16 scales: both load float32 ones (one set of weights)
        gguf_repack.FP16_SCALES = False
    out = {"spec": spec, "streams": streams, "prefill": prefill, "decode": decode, "gemm": gemm,
           "attention": attention}[args.mode](args, libs)
    for k, v in out.get("speedup", out.get("tok_s", out.get("prefill_ms", {}))).items():
        print(f"{k}: median {statistics.median(v):.2f}, range {min(v):.2f}-{max(v):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
