"""load_format="dummy" (vLLM's): a config-only folder runs with weights drawn in place, so the benchmarks can
time shapes too big for the disk; benchmarks/checkpoints.py writes those shapes config-only."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from novainfer import LLM, SamplingParams
from tests.tiny_models import FAMILIES, make_tokenizer


@pytest.fixture()
def config_only(tmp_path):
    config_cls, extra = FAMILIES["qwen3_moe"]
    config = getattr(transformers, config_cls)(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **extra,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(tmp_path)
    make_tokenizer(400).save_pretrained(tmp_path)
    return str(tmp_path)


def test_dummy_weights_run_a_config_only_folder(config_only):
    assert not [f for f in os.listdir(config_only) if f.endswith(".safetensors")]
    llm = LLM(config_only, load_format="dummy", dtype="float32", num_gpu_blocks=32)
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    model = llm.llm_engine.executor.workers[0].model_runner.model
    experts = model.model.layers[0].mlp.experts.w13_weight
    assert abs(experts.std().item() - 0.02) < 0.002 and torch.equal(model.model.norm.weight, torch.ones(64))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LLM(config_only, dtype="float32", num_gpu_blocks=32)
    with pytest.raises(ValueError, match="load_format must be 'auto' or 'dummy', got 'npz'"):
        LLM(config_only, load_format="npz")


def test_benchmark_writes_the_big_moe_shape_config_only(tmp_path):
    from benchmarks.checkpoints import load_format, resolve_model

    path = resolve_model("random:qwen3-30b-a3b", cache_dir=str(tmp_path))
    assert load_format("random:qwen3-30b-a3b") == "dummy" and load_format("random:qwen3-moe-small") == "auto"
    config = transformers.AutoConfig.from_pretrained(path)
    assert (config.architectures, config.num_experts, config.num_experts_per_tok, config.hidden_size) == (
        ["Qwen3MoeForCausalLM"],
        128,
        8,
        2048,
    )
    assert not [f for f in os.listdir(path) if f.endswith(".safetensors")]


def test_benchmark_qwen35_9b_shape_is_the_hybrid_plan(tmp_path):
    """random:qwen3.5-9b is written config-only with the published shape: 24 DeltaNet layers, 8 full attention."""
    from benchmarks.checkpoints import load_format, resolve_model

    config = transformers.AutoConfig.from_pretrained(resolve_model("random:qwen3.5-9b", cache_dir=str(tmp_path)))
    assert load_format("random:qwen3.5-9b") == "dummy" and config.architectures == ["Qwen3_5ForCausalLM"]
    assert config.layer_types.count("linear_attention") == 24 and config.layer_types[3] == "full_attention"
    assert (
        config.hidden_size,
        config.head_dim,
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.vocab_size,
    ) == (4096, 256, 16, 32, 248320)


def test_cli_flag_reaches_the_engine():
    from novainfer.entrypoints.cli import build_parser, engine_kwargs

    assert engine_kwargs(build_parser().parse_args(["serve", "m", "--load-format", "dummy"]))["load_format"] == "dummy"
    assert engine_kwargs(build_parser().parse_args(["serve", "m"]))["load_format"] == "auto"
