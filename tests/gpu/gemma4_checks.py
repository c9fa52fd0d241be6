"""Gemma 4 on the GPU in float32 (issue 36): the tiny dense (per-layer embeddings, KV-shared layers, a window shorter
than the prompts) and MoE checkpoints of tests/test_gemma4.py through the Triton kernels and the decode CUDA graphs,
greedy tokens equal to transformers' (float32, CPU), with prefix caching on and off, a mixed batch and each prompt
alone, and under preemption. Prints one PASS/FAIL table.

  python tests/gpu/gemma4_checks.py                                  # CUDA, graphs on
  TRITON_INTERPRET=1 python tests/gpu/gemma4_checks.py --tiny        # the same on the CPU, Triton interpreted
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transformers import AutoTokenizer, Gemma4ForCausalLM  # noqa: E402

from novainfer import LLM, SamplingParams  # noqa: E402
from tests.gpu.checks import check, rows  # noqa: E402
from tests.test_gemma4 import PROMPTS, save_tiny  # noqa: E402
from tests.tiny_models import hf_greedy_logprobs  # noqa: E402


def model_check(which: str, path: str, device: str, n: int, prefix_modes: tuple[bool, ...] = (True, False)) -> None:
    """Engine greedy on `device` == transformers' (float32 on the CPU, the exact reference); logprobs within 1e-3;
    cache on/off; alone; preempted."""
    hf = Gemma4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    refs = hf_greedy_logprobs(hf, ids, n)  # once: every engine below is compared with it
    kw = dict(dtype="float32", device=device, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)
    for prefix in prefix_modes:
        llm = LLM(path, enable_prefix_caching=prefix, attention_backend="triton", **kw)
        batch = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
        alone = [llm.generate([{"prompt_token_ids": i}], params, use_tqdm=False)[0] for i in ids]
        for label, outs in (("batch", batch), ("alone", alone)):
            same = all(o.outputs[0].token_ids == r[0] for o, r in zip(outs, refs))
            err = max(
                abs(o.outputs[0].logprobs[j][t].logprob - lp)
                for o, (toks, lps) in zip(outs, refs)
                for j, (t, lp) in enumerate(zip(o.outputs[0].token_ids, lps))
            )
            hits = sum(o.num_cached_tokens or 0 for o in outs)
            check(
                f"{which}: {label}, prefix cache {'on' if prefix else 'off'} == HF",
                f"{len(ids)} prompts x {n} tokens, max |dlogprob| {err:.1e}, {hits} cached tokens",
                same and err < 1e-3,
            )
        graphs = llm.llm_engine.executor.workers[0].model_runner.graphs is not None
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
    check(f"{which}: decode CUDA graphs", str(graphs), graphs or device == "cpu")
    llm = LLM(path, attention_backend="triton", num_gpu_blocks=24, **kw)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids * 2], params, use_tqdm=False)
    pre = llm.llm_engine.scheduler.num_preemptions
    same = all(o.outputs[0].token_ids == r[0] for o, r in zip(outs, refs * 2))
    check(f"{which}: preemption under a tiny cache == HF", f"{pre} preemptions", same and pre > 0)
    llm.llm_engine.shutdown()
    del llm, hf
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="on the CPU (set TRITON_INTERPRET=1), fewer tokens")
    parser.add_argument("--models", default="dense,moe", help="which tiny checkpoints: dense, moe or both")
    parser.add_argument("--prefix-on-only", action="store_true", help="skip the prefix-cache-off engines")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    n = 8 if args.tiny else 24
    with tempfile.TemporaryDirectory() as root:
        for which in args.models.split(","):
            path = save_tiny(os.path.join(root, which), moe=which == "moe")
            model_check(which, path, device, n, (True,) if args.prefix_on_only else (True, False))
    print(f"\n{'check':<52} {'result':<6} detail")
    for name, detail, ok in rows:
        print(f"{name:<52} {'PASS' if ok else 'FAIL':<6} {detail}")
    if not all(ok for _, _, ok in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
