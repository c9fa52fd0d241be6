"""The start-up kernel warm-up (worker/kernel_warmup.py) on the CPU, the Triton kernels interpreted: it runs the
short-query prefill path (the small tiles a fresh machine otherwise compiled mid-run) into the cache's first
block only, and the engine's greedy tokens afterwards still equal transformers'."""

from __future__ import annotations

import pytest

pytest.importorskip("novainfer.kernels.paged_attention")
from novainfer.kernels import paged_attention  # noqa: E402
from novainfer.worker.kernel_warmup import SHORT_PREFILL, warm_up_kernels  # noqa: E402


def test_warm_up_prefills_short_tiles_into_the_first_blocks_only(tiny_qwen2, monkeypatch):
    from novainfer import LLM, SamplingParams
    from tests.tiny_models import hf_greedy

    llm = LLM(tiny_qwen2, dtype="float32", attention_backend="triton", block_size=4, enforce_eager=True)
    runner = llm.llm_engine.executor.workers[0].model_runner
    before = runner.kv_cache.clone()
    tiles = []
    real = paged_attention.prefill_tiles
    monkeypatch.setattr(paged_attention, "prefill_tiles", lambda hd, q: tiles.append(real(hd, q)) or tiles[-1])
    warm_up_kernels(runner.model, runner.sampler, runner.block_size, runner.device)
    assert tiles and all(t[0] == 16 for t in tiles)  # the short-query tiles, once per layer
    used = SHORT_PREFILL // runner.block_size
    changed = (runner.kv_cache != before).flatten(3).any(-1)  # [2, layers, blocks]
    assert changed[:, :, :used].all() and not changed[:, :, used:].any()
    tok = llm.get_tokenizer()
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_qwen2, tok.encode("Hello there"), 6)
