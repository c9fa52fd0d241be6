"""Speculative decoding on input-grounded prompts: output tok/s with and without it, in the same run, at batch 1
(and optionally a larger batch), plus llama.cpp's prompt lookup on the same prompts and token ids.

    python benchmarks/speculation.py                         # default model, n-gram k=4, batch 1
    python benchmarks/speculation.py --compare-llamacpp      # + llama_cpp's LlamaPromptLookupDecoding
    python benchmarks/speculation.py --model random:smollm2-360m --max-tokens 64 --speculative-config \
        '{"method": "draft_model", "model": "random:smollm2-135m", "num_speculative_tokens": 4}'  # a draft run

The prompts (PROMPTS below, 8 of them) ask the model to repeat or edit a text or code it is given, which is
where prompt lookup pays: the answer copies spans of the prompt. Greedy, the chat template applied, prefix
caching off (every timed run computes its prompt). tok/s counts output tokens over the whole request.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

CODE = """def moving_average(values, window):
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
"""
TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. Members may borrow up to "
    "five books at a time for three weeks. Late returns cost ten cents per day per book. The reading room "
    "on the second floor is quiet, and laptops are welcome at the long tables near the windows."
)
PROMPTS = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Copy this Python function exactly as it is:\n\n{CODE}",
    f"Rewrite this Python function, renaming the variable `total` to `running_sum`. Change nothing else:\n\n{CODE}",
    f"Add a docstring to this Python function and return the whole function:\n\n{CODE}",
    f"Rewrite the text below, replacing 'library' with 'museum' everywhere:\n\n{TEXT}",
    f"Repeat this text, but in all capital letters:\n\n{TEXT}",
    "Repeat this list exactly, one item per line:\napples\nbananas\ncherries\ndates\nelderberries\nfigs\n"
    "grapes\nhoneydew\nkiwis\nlemons\nmangoes\nnectarines",
    "Fix the spelling mistakes in this text and return the corrected text: The quick brwn fox jumpd over the "
    "lazzy dog. The dog was not amused, and it barkd loudly at the fox untill the fox ran away into the forrest.",
]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def run_novainfer(
    model: str | None, spec: dict | None, prompts: list[list[int]], max_tokens: int, batch: int, engine_kw: dict
) -> dict:
    """Greedy over every prompt (batch at a time), timed after one warm-up request."""
    from novainfer import LLM, SamplingParams

    llm = LLM(model, speculative_config=spec, enable_prefix_caching=False, **engine_kw)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    # warm-up on a whole prompt: the kernels' variants for prompt-length reads are compiled outside the timing
    llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    before = llm.get_metrics()
    steps_before = llm.llm_engine.step_id
    outputs, t0, decode_s = [], time.perf_counter(), 0.0
    for i in range(0, len(prompts), batch):
        outputs += llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        # after the first token: the part speculation speeds up (the output processor stamps it on this clock)
        decode_s += time.monotonic() - min(o.metrics["first_token_time"] for o in outputs[-batch:])
    wall = time.perf_counter() - t0
    after = llm.get_metrics()
    tokens = [o.outputs[0].token_ids for o in outputs]
    n = sum(len(t) for t in tokens)
    diff = {k: after[k] - before.get(k, 0) for k in after if k.startswith("spec_num")}
    row = {
        "engine": "novainfer",
        "speculative_config": spec,
        "batch": batch,
        "output_tokens": n,
        "wall_s": wall,
        "tok_s": n / wall,
        "decode_tok_s": (n - len(tokens)) / decode_s,
        "steps": llm.llm_engine.step_id - steps_before,
        "tokens": tokens,
    }
    if diff.get("spec_num_drafts"):
        row.update(
            acceptance=diff["spec_num_accepted_tokens"] / diff["spec_num_draft_tokens"],
            mean_accepted_length=diff["spec_num_emitted_tokens"] / diff["spec_num_drafts"],
            **diff,
        )
    llm.llm_engine.shutdown()
    del llm
    gc.collect()  # the engine's reference cycles would keep its KV cache on the GPU while the next one sizes its own
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def run_llamacpp(path: str, prompts: list[list[int]], max_tokens: int, k: int | None, threads: int) -> dict:
    """llama.cpp greedy on the same token ids, with LlamaPromptLookupDecoding(num_pred_tokens=k) or without."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None
    llm = llama_cpp.Llama(
        path, n_ctx=4096, n_batch=512, n_threads=threads, n_threads_batch=threads, draft_model=draft, verbose=False
    )
    llm.create_completion(prompts[0][:16], max_tokens=8, temperature=0.0)  # warm-up
    tokens, t0 = [], time.perf_counter()
    for p in prompts:
        llm.reset()
        out = llm.create_completion(
            p, max_tokens=max_tokens, temperature=0.0, top_k=1, repeat_penalty=1.0, logprobs=None
        )
        tokens.append(llm.tokenize(out["choices"][0]["text"].encode(), add_bos=False, special=True))
    wall = time.perf_counter() - t0
    n = sum(len(t) for t in tokens)
    return {
        "engine": f"llama.cpp {llama_cpp.__version__}",
        "prompt_lookup_k": k,
        "batch": 1,
        "output_tokens": n,
        "wall_s": wall,
        "tok_s": n / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="default", help="'default', a path, or random:<shape> (benchmarks/checkpoints.py)"
    )
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--compare-llamacpp", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from benchmarks.checkpoints import load_format, resolve_model
    from novainfer.loader.default_model import default_model_path
    from novainfer.loader.model_loader import load_tokenizer

    model = None if args.model == "default" else resolve_model(args.model)
    spec = json.loads(args.speculative_config)
    if spec.get("model"):
        spec["model"] = default_model_path() if spec["model"] == "default" else resolve_model(spec["model"])
    tokenizer = load_tokenizer(model or default_model_path())
    if tokenizer.chat_template:
        prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    else:  # a random checkpoint (its word-level tokenizer knows no English): a block of ids, then it again
        import random

        rng = random.Random(0)
        blocks = [[rng.randrange(10, len(tokenizer)) for _ in range(48)] for _ in PROMPTS]
        prompts = [b + b[:24] for b in blocks]
    kw = dict(device=args.device, dtype=args.dtype, load_format=load_format(args.model))
    rows = []
    for batch in args.batch:
        batch_prompts = (prompts * -(-batch // len(prompts)))[: max(batch, len(prompts))]  # a full batch of copies
        off = run_novainfer(model, None, batch_prompts, args.max_tokens, batch, kw)
        on = run_novainfer(model, spec, batch_prompts, args.max_tokens, batch, kw)
        on["speedup"] = on["tok_s"] / off["tok_s"]
        on["decode_speedup"] = on["decode_tok_s"] / off["decode_tok_s"]
        on["greedy_equal"] = on["tokens"] == off["tokens"]
        rows += [off, on]
    if args.compare_llamacpp and model is None:
        k = spec.get("num_speculative_tokens", 4)
        base = run_llamacpp(default_model_path(), prompts, args.max_tokens, None, args.threads)
        lookup = run_llamacpp(default_model_path(), prompts, args.max_tokens, k, args.threads)
        lookup["speedup"] = lookup["tok_s"] / base["tok_s"]
        rows += [base, lookup]
    print(
        "| engine | speculation | batch | output tokens | steps | acceptance | mean accepted length | tok/s | "
        "speed-up | decode tok/s (after the first token) | decode speed-up | greedy equal |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        sc = r.get("speculative_config")
        what = (
            f"{sc['method']} k={sc['num_speculative_tokens']}"
            if sc
            else f"prompt lookup k={r['prompt_lookup_k']}"
            if r.get("prompt_lookup_k")
            else "off"
        )
        print(
            f"| {r['engine']} | {what} | {r['batch']} | {r['output_tokens']} | {r.get('steps', '-')} | "
            f"{r.get('acceptance', float('nan')):.2f} | {r.get('mean_accepted_length', float('nan')):.2f} | "
            f"{r['tok_s']:.1f} | {r.get('speedup', 1.0):.2f}x | {r.get('decode_tok_s', float('nan')):.1f} | "
            f"{r.get('decode_speedup', 1.0) if 'decode_tok_s' in r else float('nan'):.2f}x | "
            f"{r.get('greedy_equal', '-')} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "tokens"} for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
