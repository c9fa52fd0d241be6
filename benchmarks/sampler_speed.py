"""The CPU sampler as it is (inverse-CDF draw, one uniform a row; top-k/top-p among the 1,024 highest logits;
its torch ops on one thread: Sampler.draw, layers/sampler_candidates.py, sampling_threads) against what it
replaced (an Exp(1) draw per vocabulary entry, a sort of the whole vocabulary, torch's threads), in one process
taking turns.

    python3 benchmarks/sampler_speed.py                  # Sampler.forward on [rows, 49152] logits, ms per call
    python3 benchmarks/sampler_speed.py --generate       # and the default model end to end at temperature 1.0

--generate: LLM() with its defaults, 16 streams (128-token random prompts, 64 tokens each, ignore_eos) and one
stream (128 tokens) at temperature 1.0, then at top_p 0.9 too, the variants swapped in turn (the third: the new
draw and candidates on torch's threads); fresh prompts every run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from novainfer.layers import sampler as sampler_module  # noqa: E402
from novainfer.layers.sampler import Sampler, sampling_threads  # noqa: E402
from novainfer.layers.sampling_metadata import SamplingMetadata, SamplingRow  # noqa: E402
from novainfer.sampling_params import SamplingParams  # noqa: E402
from novainfer.worker import model_runner  # noqa: E402

NEW_DRAW = Sampler.draw.__func__


def race(cls, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The draw before: argmax(p / q), q ~ Exp(1) per entry."""
    return (probs / cls.exponentials(probs, meta)).argmax(dim=-1)


def torch_threads(logits):
    return contextlib.nullcontext()


NEW_TOP_K_TOP_P = sampler_module.sample_top_k_top_p


def full_sort(sampler_cls, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Top-k/top-p before: a sort of each whole row (Sampler.probs)."""
    return sampler_cls.draw(sampler_cls.probs(logits, meta), meta)


VARIANTS = {"this tree": (NEW_DRAW, NEW_TOP_K_TOP_P, sampling_threads),
            "before": (race, full_sort, torch_threads),
            "this tree on torch threads": (NEW_DRAW, NEW_TOP_K_TOP_P, torch_threads)}


def use_variant(name: str) -> None:
    draw, top_k_top_p, threads = VARIANTS[name]
    Sampler.draw = classmethod(draw)
    sampler_module.sample_top_k_top_p = top_k_top_p
    model_runner.sampling_threads = threads


def forward_ms(rows: int, vocab: int, params: SamplingParams, iters: int) -> dict:
    logits = torch.randn(rows, vocab) * 3
    meta = SamplingMetadata.build([SamplingRow(params, [], []) for _ in range(rows)], vocab, "cpu")
    sampler, res = Sampler(), {k: [] for k in VARIANTS}
    for r in range(iters):
        for name in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):
            use_variant(name)
            t = time.perf_counter()
            with model_runner.sampling_threads(logits):  # as the runner calls it
                sampler(logits, meta)
            res[name].append((time.perf_counter() - t) * 1e3)
    use_variant("this tree")
    return {k: statistics.median(v) for k, v in res.items()}


def generate(rounds: int) -> dict:
    from benchmarks.throughput import make_workload
    from novainfer import LLM
    llm = LLM()
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    prompts = iter(make_workload(17 * 2 * len(VARIANTS) * rounds + 1, 128, 1, vocab, 0)[0])
    llm.generate([{"prompt_token_ids": next(prompts)[:16]}], SamplingParams(max_tokens=4), use_tqdm=False)
    settings = {"T 1.0": {}, "T 1.0, top_p 0.9": {"top_p": 0.9}}
    res = {f"{k}, {s}, {n} streams": [] for k in VARIANTS for s in settings for n in (16, 1)}
    for r in range(rounds):
        for name in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):
            use_variant(name)
            for label, extra in settings.items():
                for n, tokens in ((16, 64), (1, 128)):
                    batch = [{"prompt_token_ids": next(prompts)} for _ in range(n)]
                    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, **extra)
                    t = time.perf_counter()
                    llm.generate(batch, params, use_tqdm=False)
                    res[f"{name}, {label}, {n} streams"].append(n * tokens / (time.perf_counter() - t))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in res.items()), flush=True)
    use_variant("this tree")
    llm.llm_engine.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152, help="the default model's")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--generate", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {"threads": torch.get_num_threads(), "forward_ms": []}
    print(f"Sampler.forward, {args.vocab} vocabulary, within the runner's thread setting, median ms a call\n"
          "| rows | parameters | " + " | ".join(VARIANTS) + " |\n|---|---|" + "---|" * len(VARIANTS))
    for rows in (1, 16):
        for label, params in (("temperature 1.0", SamplingParams(temperature=1.0)),
                              ("+ top_p 0.9", SamplingParams(temperature=1.0, top_p=0.9)),
                              ("+ top_k 40", SamplingParams(temperature=1.0, top_k=40))):
            ms = forward_ms(rows, args.vocab, params, args.iters)
            out["forward_ms"].append({"rows": rows, "params": label, **ms})
            print(f"| {rows} | {label} | " + " | ".join(f"{ms[k]:.2f}" for k in VARIANTS) + " |", flush=True)
    if args.generate:
        out["generate_tok_s"] = res = generate(args.rounds)
        for k, v in res.items():
            print(f"{k}: median {statistics.median(v):.1f} tok/s, range {min(v):.1f}-{max(v):.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
