"""max_num_batched_tokens left unset resolves once to vLLM's offline default for the device: 16384 on one CUDA
GPU of >= 70 GiB other than an A100, else 8192 (the CPU here); a given value is kept."""

import dataclasses
import types

import pytest

from novainfer.config import EngineConfig


def test_unset_on_the_cpu_is_8192_and_a_given_value_is_kept():
    cfg = EngineConfig.from_kwargs("m", device="cpu")
    assert cfg.scheduler_config.max_num_batched_tokens is None
    assert cfg.resolve_token_budget() == 8192
    assert EngineConfig.from_kwargs("m", device="cpu", max_num_batched_tokens=512).resolve_token_budget() == 512
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig.from_kwargs("m", max_num_batched_tokens=0)


@pytest.mark.parametrize(
    "name,gib,tp,want",
    [
        ("NVIDIA H200", 139, 1, 16384),
        ("NVIDIA H100 80GB HBM3", 79, 1, 16384),
        ("NVIDIA A100-SXM4-80GB", 79, 1, 8192),
        ("NVIDIA L4", 22, 1, 8192),
        ("NVIDIA H200", 139, 2, 8192),
    ],
)
def test_on_cuda_it_follows_the_gpu(monkeypatch, name, gib, tp, want):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(name=name, total_memory=gib * 2**30)
    )
    cfg = EngineConfig.from_kwargs(
        "m", device="cuda", tensor_parallel_size=tp, distributed_executor_backend="uni" if tp == 1 else "mp"
    )
    assert cfg.resolve_token_budget() == want
    resolved = cfg.with_token_budget()  # the config is frozen: resolving gives a new one
    assert resolved.scheduler_config.max_num_batched_tokens == want
    assert cfg.scheduler_config.max_num_batched_tokens is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.scheduler_config.max_num_batched_tokens = want


def test_a_runner_built_on_its_own_resolves_it(tiny_qwen2):
    """Outside an engine core (which resolves the budget first), the runner resolves it for its own buffers."""
    from novainfer.engine.llm_engine import load_model_info
    from novainfer.worker.worker import Worker

    config, _, _ = load_model_info(EngineConfig.from_kwargs(tiny_qwen2, dtype="float32", device="cpu"))
    worker = Worker(config, config.model_config.hf_config)
    worker.init_device()
    worker.load_model()
    assert worker.model_runner.config.scheduler_config.max_num_batched_tokens == 8192
