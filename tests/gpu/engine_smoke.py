"""GPU smoke check of the engine's CUDA path (run on a machine with an NVIDIA GPU, not in CI).

Builds a tiny random Qwen2 and Llama, checks greedy parity with transformers on the GPU in float32,
runs bf16 with KV sizing from free memory, seeded sampling and preemption, and prints a short table.
Usage: python tests/gpu/engine_smoke.py
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, ".")
from novainfer import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import hf_greedy_with, make_tiny_model  # noqa: E402


def release() -> None:
    """Free the last engine's KV cache before the next one sizes itself from free memory."""
    gc.collect()
    torch.cuda.empty_cache()


def qwen25_kv_report(path: str) -> str:
    """KV capacity with a real model shape (random weights), and a batch-1 eager decode rate."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from tests.tiny_models import make_tokenizer

    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        architectures=["Qwen2ForCausalLM"],
    )
    with torch.device("cuda"):
        Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    llm = LLM(path, gpu_memory_utilization=0.9)
    runner = llm.llm_engine.executor.workers[0].model_runner
    tokens = runner.num_blocks * runner.block_size
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    t = time.perf_counter()
    llm.generate([list(range(5, 133))], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    rate = 128 / (time.perf_counter() - t)
    return f"{tokens:,} KV tokens; batch-1 decode (eager) {rate:.0f} tok/s"


def main() -> int:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    rows, ok = [], True
    prompts = ["Hello, my name is", "The capital of France is", "def add(a, b):"]
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ["qwen2", "llama", "qwen3"]:
            path = make_tiny_model(f"{tmp}/{arch}", arch)
            llm = LLM(path, dtype="float32", gpu_memory_utilization=0.5)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
            tok = llm.get_tokenizer()
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
            same = all(o.outputs[0].token_ids == hf_greedy_with(hf, tok.encode(p), 32) for p, o in zip(prompts, outs))
            ok &= same
            rows.append((f"{arch} fp32 greedy == HF (cuda)", same))
            del llm, hf
            release()
        path = make_tiny_model(f"{tmp}/bf16", "qwen2")
        llm = LLM(path, gpu_memory_utilization=0.3)
        runner = llm.llm_engine.executor.workers[0].model_runner
        rows.append(("bf16 KV blocks from free memory", f"{runner.num_blocks} blocks, dtype {runner.kv_cache.dtype}"))
        p = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
        a = llm.generate(["Hello"], p, use_tqdm=False)[0].outputs[0].token_ids
        b = (
            llm.generate(
                ["x", "Hello", "y"], [SamplingParams(max_tokens=24), p, SamplingParams(max_tokens=24)], use_tqdm=False
            )[1]
            .outputs[0]
            .token_ids
        )
        ok &= a == b
        rows.append(("seeded sample alone == in batch (cuda)", a == b))
        t = time.perf_counter()
        outs = llm.generate(
            ["Hello"] * 64, SamplingParams(temperature=0.8, max_tokens=128, ignore_eos=True), use_tqdm=False
        )
        dt = time.perf_counter() - t
        rows.append(("64 x 128 tokens, tiny bf16, eager", f"{64 * 128 / dt:.0f} tok/s"))
        del llm, runner
        release()
        llm = LLM(path, dtype="float32", gpu_memory_utilization=0.3)
        small = LLM(path, dtype="float32", num_gpu_blocks=24, block_size=16)
        greedy = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts * 2, greedy, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in small.generate(prompts * 2, greedy, use_tqdm=False)]
        pre = small.llm_engine.scheduler.num_preemptions
        ok &= got == ref and pre > 0
        rows.append(("small cache preempts, same tokens (fp32)", f"{got == ref}, preemptions={pre}"))
        del llm, small
        release()
        rows.append(("Qwen2.5-0.5B config, bf16, util 0.9", qwen25_kv_report(f"{tmp}/q05")))
    print("\n| check | result |\n| --- | --- |")
    for name, res in rows:
        print(f"| {name} | {res} |")
    print("ALL OK" if ok else "FAILURES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
