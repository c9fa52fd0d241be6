"""The memory profile's forward (worker/kv_cache.profile_step: the GPU sizes its KV cache from this step's peak; it
runs the same on the CPU): it holds the whole max_num_batched_tokens budget, as several prompts of at most
max_model_len tokens where the budget is longer, each prompt apart from the others (its positions from 0, its
hidden states those of the prompt alone). A profile of one max_model_len prompt left a Qwen3.5-9B shape on an
80 GB H100 out of memory on its first 16,384-token step (max_model_len 4,096)."""

from __future__ import annotations

import pytest
import torch

from novainfer import LLM
from novainfer.attention.metadata import attention_metadata, get_attention_metadata
from novainfer.worker.kernel_warmup import packed_prefill_metadata
from novainfer.worker.kv_cache import profile_blocks, profile_lens, release_kv_cache
from tests.tiny_hybrid import build


def test_profile_lens_fill_the_budget_in_prompts_of_at_most_max_model_len():
    assert profile_lens(64, 24, 256) == [24, 24, 16]
    assert profile_lens(48, 24, 256) == [24, 24]
    assert profile_lens(16, 24, 256) == [16]
    assert profile_lens(64, 24, 2) == [24, 24]  # no step holds more than max_num_seqs prompts
    assert profile_blocks([24, 24, 16], 16) == 2 + 2 + 1


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("qwen3_5")), "qwen3_5", False)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5"])
def test_profile_forward_holds_the_budget_as_separate_prompts(arch, tiny_qwen2, hybrid_path):
    path = tiny_qwen2 if arch == "qwen2" else hybrid_path
    llm = LLM(path, dtype="float32", block_size=16, max_model_len=24, max_num_batched_tokens=64)
    runner = llm.llm_engine.engine_core.executor.workers[0].model_runner
    seen = []
    handle = runner.model.register_forward_hook(lambda m, args, out: seen.append((*args, get_attention_metadata())))
    try:
        runner.profile_run()
    finally:
        handle.remove()
    assert runner.kv_cache is None  # the scratch cache is given back
    ((ids, positions, meta),) = seen
    assert ids.numel() == 64 and meta.seq_lens_cpu == [24, 24, 16] and meta.query_start_loc_cpu == [0, 24, 48, 64]
    assert positions.tolist() == list(range(24)) * 2 + list(range(16))
    # the step's metadata keeps the prompts apart: other tokens through it give each prompt the hidden states it
    # has alone (attention, the conv window and the recurrent state start at the prompt's own first token)
    tokens = torch.randint(3, 100, (64,), generator=torch.Generator().manual_seed(0))
    runner.allocate_kv_cache(profile_blocks(meta.seq_lens_cpu, 16))
    try:
        with torch.inference_mode():
            with attention_metadata(meta):
                packed = runner.model(tokens, positions)
            for s, e in [(0, 24), (24, 48), (48, 64)]:
                with attention_metadata(packed_prefill_metadata([e - s], 16, torch.device("cpu"))):
                    alone = runner.model(tokens[s:e], torch.arange(e - s))
                torch.testing.assert_close(packed[s:e], alone, rtol=1e-5, atol=1e-5)
    finally:
        runner.kv_cache = None
        release_kv_cache(runner.attention_layers())
