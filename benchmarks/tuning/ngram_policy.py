"""Replays n-gram draft rules on the speculation benchmark's greedy outputs: steps, tokens per step and a modelled
speed-up for a verify step costing 1 + r * (drafted tokens) one-token steps, without timing anything.

    python benchmarks/tuning/ngram_policy.py                 # the default model on benchmarks/speculation.py's prompts
    python benchmarks/tuning/ngram_policy.py --r 0 0.1 0.2 0.3

Greedy output does not depend on the guesses, so one run without speculation gives every rule's exact step count
(it matches benchmarks/speculation.py's "steps"). r is the machine's: the extra cost of one more row in a verify
step relative to a one-token decode step (about 0 on a GPU, 0.2-0.3 on the 2-core CPU).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from benchmarks.speculation import PROMPTS, chat_ids  # noqa: E402
from novainfer.spec_decode.ngram_proposer import propose_ngram  # noqa: E402


def replay(
    prompts: list[list[int]], outputs: list[list[int]], k: int, min_n: int, max_n: int, scaled: bool, max_tokens: int
) -> tuple[list[int], list[int]]:
    """Per prompt: engine steps after the prefill, and drafted tokens, for greedy outputs `outputs`."""
    steps, drafted = [], []
    for prompt, out in zip(prompts, outputs):
        i, s, d = 1, 0, 0  # the prefill gave token 0
        while i < len(out):
            room = min(k, max_tokens - i - 1)
            guesses = propose_ngram(np.array(prompt + out[:i]), min_n, max_n, room, scaled) if room > 0 else []
            a = 0
            while a < len(guesses) and i + a < len(out) and guesses[a] == out[i + a]:
                a += 1
            i, s, d = i + a + 1, s + 1, d + len(guesses)
        steps.append(s)
        drafted.append(d)
    return steps, drafted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--r", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3])
    args = ap.parse_args()
    from novainfer import LLM, SamplingParams

    llm = LLM(enable_prefix_caching=False)
    prompts = [chat_ids(llm.get_tokenizer(), p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    total = sum(len(o) for o in outputs)
    print(f"{total} output tokens; without speculation {total - len(outputs)} decode steps")
    print("| rule | steps | tokens/step per prompt | " + " | ".join(f"r={r}" for r in args.r) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in args.r) + " |")
    for k in (2, 3, 4, 6, 8):
        for min_n, max_n, scaled in ((1, 3, False), (2, 3, False), (1, 3, True), (1, 4, True)):
            steps, drafted = replay(prompts, outputs, k, min_n, max_n, scaled, args.max_tokens)
            per = " ".join(f"{(len(o) - 1) / max(s, 1):.2f}" for o, s in zip(outputs, steps))
            speed = [(total - len(outputs)) / (sum(steps) + r * sum(drafted)) for r in args.r]
            rule = f"k={k} min {min_n} max {max_n}" + (" scaled 2^(n-1)" if scaled else "")
            print(f"| {rule} | {sum(steps)} | {per} | " + " | ".join(f"{v:.2f}x" for v in speed) + " |")


if __name__ == "__main__":
    main()
