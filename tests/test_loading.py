"""Loading errors name what is wrong; n > 1 shares the prompt's blocks; aborts free everything."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from novainfer import LLM, SamplingParams


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_unsupported_architecture_lists_supported(tiny_qwen2, tmp_path):
    path = copy_model(tiny_qwen2, tmp_path / "m")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = ["MambaForCausalLM"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(
        ValueError,
        match="MambaForCausalLM.*supported: Gemma2ForCausalLM, Gemma3ForCausalLM, "
        "Gemma4ForCausalLM, Gemma4ForConditionalGeneration, GptOssForCausalLM, LlamaForCausalLM, MistralForCausalLM, "
        "MixtralForCausalLM, Phi3ForCausalLM, "
        "Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM",
    ):
        LLM(path)


def test_missing_weight_fails_with_its_name(tiny_qwen2, tmp_path):
    path = copy_model(tiny_qwen2, tmp_path / "m")
    st = os.path.join(path, "model.safetensors")
    weights = load_file(st)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, st)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(path)


def test_missing_model_path_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model")


def test_n_samples_share_the_prompt_blocks(tiny_qwen2):
    llm = LLM(tiny_qwen2, block_size=4)
    engine = llm.llm_engine
    prompt = "Paged attention stores keys and values in fixed-size blocks of the cache."
    engine.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True))
    engine.step()
    seqs = engine.requests["r"].seqs
    full_blocks = (len(seqs[0].prompt_token_ids) - 1) // 4
    assert full_blocks > 2
    for other in seqs[1:]:
        assert other.block_table[:full_blocks] == seqs[0].block_table[:full_blocks]
        assert other.num_cached_tokens == full_blocks * 4
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_frees_blocks_and_reports_abort(tiny_qwen2):
    llm = LLM(tiny_qwen2, block_size=4)
    engine = llm.llm_engine
    engine.add_request("a", "Hello, my name is", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", "The quick brown fox", SamplingParams(max_tokens=5, ignore_eos=True, temperature=0))
    engine.step()
    engine.step()
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
    assert [o.request_id for o in done if o.finished] == ["b"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bf16_dtype_runs(tiny_qwen2):
    llm = LLM(tiny_qwen2, dtype="bfloat16")
    assert llm.llm_engine.executor.workers[0].model_runner.kv_cache.dtype == torch.bfloat16
    assert (
        len(
            llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
        == 4
    )
