"""A Qwen2.5-7B-shape GGUF in llama.cpp's Q4_K_M mix (random weights, benchmarks/gguf_checkpoint.py) loaded
and run by NovaInfer (LLM(path), default settings) and by llama.cpp (llama-cpp-python), each in its own
process, one after the other: load time, peak resident memory, batch-1 greedy decode tok/s and the prefill
time of a 128-token prompt, on the same token ids and the same thread count. Example:
    flock /tmp/novainfer-bench.lock python benchmarks/gguf_7b.py --delete --json out.json

The file (4.7 GB) is written once under --path and reused; --delete removes it at the end. Decode tok/s per
round is (n - 1) / (time for n new tokens - time for 1) on a --prompt-len prompt; every timed run gets a fresh
prompt, so no prefix cache helps either engine. Peak RSS is polled over the engine's process tree by this
(parent) process and read from the child's own VmHWM; a child over --rss-limit-gb is killed, not waited on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.serve_memory import tree_rss_mb  # noqa: E402

DEFAULT_PATH = "/tmp/novainfer-bench/qwen2.5-7b-random-q4_k_m.gguf"


def proc_status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def child(args: argparse.Namespace) -> dict:
    """One engine in this process: load it, then take the timings; returns the figures."""
    from benchmarks.throughput import make_workload
    import torch

    threads = torch.get_num_threads()
    seeds = iter(range(1000, 10_000))
    from benchmarks.gguf_checkpoint import SHAPES

    vocab = SHAPES[args.shape].vocab
    fresh = lambda n: make_workload(1, n, 1, vocab, next(seeds))[0][0]  # noqa: E731  (ids below 10,000)
    t0 = time.perf_counter()
    if args.child == "novainfer":
        from novainfer import LLM, SamplingParams

        llm = LLM(args.path)  # the defaults a user gets

        def run(prompt: list[int], n: int) -> tuple[list[int], float]:
            t = time.perf_counter()
            out = llm.generate(
                [{"prompt_token_ids": prompt}],
                SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                use_tqdm=False,
            )
            return list(out[0].outputs[0].token_ids), time.perf_counter() - t

        name = "NovaInfer (LLM(path), defaults)"

        def top5(ids: list[int]) -> list[list[tuple[int, float]]]:
            out = llm.generate(
                [{"prompt_token_ids": ids}],
                SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5),
                use_tqdm=False,
            )
            return [
                sorted(((t, lp.logprob) for t, lp in d.items()), key=lambda e: -e[1])[:5]
                for d in out[0].prompt_logprobs[1:]
            ]
    else:
        from benchmarks import llamacpp_baseline

        lc, version = llamacpp_baseline.load(args.path, threads)
        run = lambda p, n: llamacpp_baseline.greedy(lc, p, n)  # noqa: E731

        def top5(ids: list[int]) -> list[list[tuple[int, float]]]:
            import llama_cpp
            import numpy as np

            lc.reset()
            out = []
            for tok in ids[:-1]:  # one token at a time: without logits_all only the last row is computed
                lc.eval([tok])
                row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lc.ctx, -1), shape=(lc.n_vocab(),))
                row = row.astype(np.float64)
                lp = row - row.max() - np.log(np.exp(row - row.max()).sum())
                best = np.argsort(-lp)[:5]
                out.append([(int(t), float(lp[t])) for t in best])
            return out

        name = f"llama.cpp (llama-cpp-python {version})"
    r = {
        "engine": name,
        "threads": threads,
        "load_s": time.perf_counter() - t0,
        "rss_after_load_mb": proc_status_mb("VmRSS"),
        "rss_anon_after_load_mb": proc_status_mb("RssAnon"),
        "rss_file_after_load_mb": proc_status_mb("RssFile"),
    }
    r["greedy_tokens"] = run(list(range(100, 100 + args.prompt_len)), args.new_tokens)[0]  # also the warm-up
    one, full, prefill = [], [], []
    for _ in range(args.repeat):
        p = fresh(args.prompt_len)
        one.append(run(p, 1)[1])
        full.append(run(p[:-1] + [p[-1] + 1], args.new_tokens)[1])  # fresh, same length
        prefill.append(run(fresh(args.prefill_len), 1)[1])
    r["teacher_forced_top5"] = top5(make_workload(1, args.agree_len, 1, vocab, 777)[0][0])
    n = args.new_tokens - 1
    r.update(
        decode_tok_s=[n / (f - o) for f, o in zip(full, one)],
        prefill_s=prefill,
        one_s=one,
        full_s=full,
        vm_hwm_mb=proc_status_mb("VmHWM"),
        rss_end_mb=proc_status_mb("VmRSS"),
    )
    return r


def run_child(args: argparse.Namespace, engine: str) -> dict:
    """The engine in a child process; its process tree's RSS polled for the peak, killed over the limit."""
    out = os.path.join(os.path.dirname(os.path.abspath(args.path)), f"{engine}.json")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        engine,
        "--result",
        out,
        *[
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k in ("path", "prompt_len", "new_tokens", "prefill_len", "repeat", "agree_len", "shape")
        ],
    ]
    proc = subprocess.Popen(cmd)
    peak, killed = 0.0, False
    while proc.poll() is None:
        peak = max(peak, tree_rss_mb(proc.pid))
        if peak > args.rss_limit_gb * 1024 and not killed:
            proc.kill()
            killed = True
        time.sleep(0.2)
    if killed or proc.returncode != 0:
        return {
            "engine": engine,
            "error": f"exit {proc.returncode}" + (", killed over the RSS limit" * killed),
            "peak_rss_polled_mb": peak,
        }
    with open(out) as f:
        r = json.load(f)
    os.remove(out)
    r["peak_rss_polled_mb"] = peak
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default=DEFAULT_PATH, help="where the GGUF is (written there when missing)")
    ap.add_argument("--shape", default="qwen2.5-7b", help="a shape of benchmarks/gguf_checkpoint.py's SHAPES")
    ap.add_argument("--engines", default="novainfer,llamacpp", help='comma-separated; "" only writes the file')
    ap.add_argument("--prompt-len", type=int, default=16, help="prompt of the decode runs")
    ap.add_argument("--new-tokens", type=int, default=17, help="tokens generated in a decode run")
    ap.add_argument("--prefill-len", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--agree-len", type=int, default=48, help="teacher-forced positions compared between engines")
    ap.add_argument("--rss-limit-gb", type=float, default=20.0)
    ap.add_argument("--delete", action="store_true", help="remove the GGUF file at the end")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        with open(args.result, "w") as f:
            json.dump(child(args), f)
        return
    from benchmarks.gguf_checkpoint import SHAPES, write_qwen2_q4_k_m

    engines = engine_list(args)
    r = {"path": args.path}
    if not os.path.exists(args.path):
        t0 = time.perf_counter()
        write_qwen2_q4_k_m(args.path, SHAPES[args.shape])
        r["write_s"] = time.perf_counter() - t0
    r["file_gb"] = os.path.getsize(args.path) / 1e9
    try:
        for engine in engines:
            r[engine] = run_child(args, engine)
    finally:
        if args.delete:
            os.remove(args.path)
    report(r, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


def engine_list(args: argparse.Namespace) -> list[str]:
    """The engines to run ("" only writes the file); unknown names are refused."""
    engines = [e for e in args.engines.split(",") if e]
    bad = set(engines) - {"novainfer", "llamacpp"}
    if bad:
        raise SystemExit(f"unknown engine(s) {sorted(bad)}; choose from novainfer, llamacpp")
    return engines


def report(r: dict, args: argparse.Namespace) -> None:
    print(
        f"\n{r['path']}: {r['file_gb']:.2f} GB; {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
        f"{args.prefill_len}-token prefill, greedy, fresh prompt per timed run, {args.repeat} rounds\n"
        f"| engine | load (s) | peak RSS (GiB) | batch-1 decode tok/s | prefill of {args.prefill_len} tokens (s) |\n"
        "|---|---|---|---|---|"
    )
    engines = [e for e in engine_list(args) if "error" not in r[e]]
    for e in engine_list(args):
        x = r[e]
        if "error" in x:
            print(f"| {e} | failed: {x['error']} | {x['peak_rss_polled_mb'] / 1024:.1f} | - | - |")
            continue
        d, p = x["decode_tok_s"], x["prefill_s"]
        print(
            f"| {x['engine']}, {x['threads']} threads | {x['load_s']:.1f} | "
            f"{max(x['peak_rss_polled_mb'], x['vm_hwm_mb']) / 1024:.2f} | {min(d):.2f}-{max(d):.2f} | "
            f"{min(p):.1f}-{max(p):.1f} |"
        )
    if len(engines) == 2:
        a, b = (r[e]["greedy_tokens"] for e in engines)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"greedy tokens on one prompt: the engines agree on the first {same} of {len(a)}")
        r["agreement"] = agreement(*(r[e]["teacher_forced_top5"] for e in engines))
        print(
            "teacher-forced on one {n}-token sequence: top-1 equal at {top1}/{n} positions, each engine's top-1 "
            "in the other's top-5 at {in5}/{n}; where the top-1 agree, |logprob difference| mean {dlp:.3f}, "
            "max {dlp_max:.3f}".format(**r["agreement"])
        )


def agreement(a: list, b: list) -> dict:
    """How two engines' next-token predictions on the same teacher-forced sequence agree."""
    top1 = [x[0][0] == y[0][0] for x, y in zip(a, b)]
    in5 = [x[0][0] in {t for t, _ in y} and y[0][0] in {t for t, _ in x} for x, y in zip(a, b)]
    dlp = [abs(x[0][1] - y[0][1]) for x, y, same in zip(a, b, top1) if same]
    return {
        "n": len(top1),
        "top1": sum(top1),
        "in5": sum(in5),
        "dlp": sum(dlp) / max(1, len(dlp)),
        "dlp_max": max(dlp, default=0.0),
    }


if __name__ == "__main__":
    main()
