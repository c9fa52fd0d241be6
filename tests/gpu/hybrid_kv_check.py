"""The grouped KV cache on the GPU (worker/kv_layout.py): tiny random Gemma 2 / Gemma 3 (sliding + full layers) and
Mistral (every layer sliding) checkpoints with a window of 7, through the Triton kernels and the decode CUDA graphs
(one block table per KV group), greedy in float32: equal to the whole-context layout, to transformers on the same
device, with prefix caching and under preemption. Prints one PASS/FAIL table.

  python tests/gpu/hybrid_kv_check.py            # CUDA, graphs on
  TRITON_INTERPRET=1 python tests/gpu/hybrid_kv_check.py --tiny   # the same on the CPU, Triton interpreted
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM

from novainfer import LLM, SamplingParams
from novainfer.engine.kv_group_manager import KVGroupBlockManager
from novainfer.worker import model_runner
from tests.gpu.checks import check, rows
from tests.tiny_models import hf_greedy_with, make_tiny_model

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The capital of France is",
    "Hello, my name is",
    "One two three four five six seven eight nine ten eleven twelve",
]


def generate(
    path: str, device: str, grouped: bool, max_tokens: int, prompts: list[str] = PROMPTS, **kw
) -> tuple[list[list[int]], LLM]:
    """Greedy tokens of PROMPTS; grouped False: the whole-context layout (every layer keeps every block)."""
    original = model_runner.kv_layout_of
    if not grouped:
        model_runner.kv_layout_of = lambda layers, block_size: None
    try:
        llm = LLM(path, dtype="float32", device=device, attention_backend="triton", block_size=4, max_num_seqs=8, **kw)
    finally:
        model_runner.kv_layout_of = original
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def family_check(arch: str, device: str, max_tokens: int, root: str) -> None:
    path = make_tiny_model(f"{root}/{arch}", arch, seed=17)
    got, llm = generate(path, device, True, max_tokens)
    grouped = isinstance(llm.llm_engine.block_manager, KVGroupBlockManager)
    graphs = llm.llm_engine.executor.workers[0].model_runner.graphs is not None
    check(f"{arch}: grouped layout", f"KVGroupBlockManager {grouped}, decode graphs {graphs}", grouped)
    tok = llm.get_tokenizer()
    llm.llm_engine.shutdown()
    ref, llm = generate(path, device, False, max_tokens)
    llm.llm_engine.shutdown()
    check(f"{arch}: greedy = whole-context layout", f"{len(PROMPTS)} prompts x {max_tokens} tokens", got == ref)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    hf = [hf_greedy_with(model, tok.encode(p), max_tokens) for p in PROMPTS]
    check(
        f"{arch}: greedy = transformers",
        f"first mismatch prompt {next((i for i, (a, b) in enumerate(zip(got, hf)) if a != b), None)}",
        got == hf,
    )
    del model
    cached, llm = generate(path, device, True, max_tokens, enable_prefix_caching=True)
    again = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    hits = sum(o.num_cached_tokens for o in again)
    same = [o.outputs[0].token_ids for o in again] == cached == got
    llm.llm_engine.shutdown()
    check(f"{arch}: prefix-cache hits exact", f"{hits} cached prompt tokens on the second pass", same and hits > 0)
    blocks = 12 if arch == "mistral" else 40  # chunks of 16 tokens, two of each prompt at once
    small, llm = generate(path, device, True, max_tokens, PROMPTS * 2, num_gpu_blocks=blocks, max_num_batched_tokens=16)
    preempted = llm.llm_engine.scheduler.num_preemptions
    llm.llm_engine.shutdown()
    check(
        f"{arch}: preemption under a tiny cache exact", f"{preempted} preemptions", small == got * 2 and preempted > 0
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="on the CPU (set TRITON_INTERPRET=1), fewer tokens")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    max_tokens = 12 if args.tiny else 40
    torch.set_num_threads(1 if args.tiny else torch.get_num_threads())
    with tempfile.TemporaryDirectory() as root:
        for arch in ("gemma3", "gemma2", "mistral"):
            family_check(arch, device, max_tokens, root)
    print(f"\n{'check':<52} {'result':<6} detail")
    for name, detail, ok in rows:
        print(f"{name:<52} {'PASS' if ok else 'FAIL':<6} {detail}")
    if not all(ok for _, _, ok in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
