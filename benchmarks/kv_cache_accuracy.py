"""What a KV-cache dtype costs in accuracy on a trained model: teacher-forced top-1 agreement and mean KL of the
next-token distributions with `--kv-cache-dtype fp8` (or another dtype) against a float32 KV cache (or
`--reference bfloat16`, issue 38's measure), on real text (the repository's docs), the default model (SmolLM2-135M)
unless --model says otherwise.

    python benchmarks/kv_cache_accuracy.py                          # CPU: the torch attention backend
    python benchmarks/kv_cache_accuracy.py --device cuda --model M   # GPU: the Triton kernels

Random-weight checkpoints say little here: their activations are small, so a scale of 1.0 (vLLM's default when the
checkpoint carries none) leaves many K/V values in e4m3's subnormal range, and the net amplifies any perturbation.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def text_windows(tokenizer, n: int, length: int) -> list[list[int]]:
    """n windows of `length` tokens of the docs' prose."""
    text = "\n".join(open(p).read() for p in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))))
    ids = tokenizer.encode(text)
    step = max(length, (len(ids) - length) // n)
    return [ids[i : i + length] for i in range(0, step * n, step)][:n]


def distributions(llm, seqs: list[list[int]], top: int) -> list[dict[int, float]]:
    """Each position's top-`top` logprobs (teacher-forced, prompt logprobs)."""
    from novainfer import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": s} for s in seqs],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top),
        use_tqdm=False,
    )
    return [{t: lp.logprob for t, lp in d.items()} for o in outs for d in o.prompt_logprobs[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the default model's GGUF")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--reference", default="float32", help="the KV cache dtype compared against")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    from novainfer import LLM
    from novainfer.loader.default_model import default_model_path

    args.model = args.model or default_model_path()
    kw = dict(device=args.device, dtype="float32", enable_prefix_caching=False)
    if args.device == "cpu":
        kw["attention_backend"] = "torch"
    runs = {}
    seqs = None
    for kv in (args.reference, args.kv_cache_dtype):
        llm = LLM(args.model, kv_cache_dtype=kv, **kw)
        seqs = seqs or text_windows(llm.get_tokenizer(), args.windows, args.length)
        runs[kv] = distributions(llm, seqs, args.top)
        llm.llm_engine.shutdown()
        del llm
    ref, got = runs[args.reference], runs[args.kv_cache_dtype]
    agree = sum(max(a, key=a.get) == max(b, key=b.get) for a, b in zip(ref, got)) / len(ref)
    # KL over the reference's top tokens (the rest of the mass is below both top-k lists' floor)
    kl = sum(
        sum(math.exp(lp) * (lp - b.get(t, min(b.values()))) for t, lp in a.items()) for a, b in zip(ref, got)
    ) / len(ref)
    print(f"model {args.model}, {len(seqs)} windows x {args.length} tokens of docs/*.md, {len(ref)} positions")
    vs = f"kv {args.kv_cache_dtype} vs {args.reference} KV"
    print(f"{vs}: top-1 agreement {agree:.2%}, mean KL (top-{args.top}) {kl:.5f}")


if __name__ == "__main__":
    main()
