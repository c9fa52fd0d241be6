"""The command line's flags are the config fields: the same names (vLLM's), defaults and help as LLM(...) and
ServerConfig, declared once."""

import contextlib
import dataclasses
import io

import pytest

from novainfer.config import EngineConfig, ServerConfig
from novainfer.entrypoints.cli import build_parser, engine_kwargs


def help_text(*argv: str) -> str:
    """--help's text, its lines joined."""
    with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
        build_parser().parse_args([*argv, "--help"])
    return " ".join(out.getvalue().split())


def test_the_cli_and_llm_share_one_default():
    """The CLI's flags are the config's fields: parsing no flag gives LLM()'s defaults, budget included."""
    for argv in (["serve", "m"], ["generate", "--model", "m", "hi"], ["chat", "--model", "m"]):
        assert EngineConfig.from_kwargs(
            "m", **engine_kwargs(build_parser().parse_args(argv))
        ) == EngineConfig.from_kwargs("m")
    assert EngineConfig.from_kwargs("m").scheduler_config.max_num_batched_tokens is None
    assert (
        "--max-num-batched-tokens MAX_NUM_BATCHED_TOKENS tokens one engine step may carry (auto: vLLM's "
        "offline default, 16384" in help_text("serve")
    )


def test_every_engine_setting_is_a_flag_and_reaches_the_config():
    argv = [
        "serve",
        "m",
        "--max-num-seqs",
        "7",
        "--max-num-batched-tokens",
        "64",
        "--no-enable-prefix-caching",
        "--num-gpu-blocks-override",
        "9",
        "--kv-cache-dtype",
        "float32",
        "-tp",
        "2",
        "--dtype",
        "float16",
        "--tensor-parallel-device-ids",
        "0,1",
        "--enforce-eager",
        "--no-trim-heap-when-idle",
        "--speculative-config",
        '{"num_speculative_tokens": 3}',
    ]
    cfg = EngineConfig.from_kwargs("m", **engine_kwargs(build_parser().parse_args(argv)))
    assert (cfg.scheduler_config.max_num_seqs, cfg.scheduler_config.max_num_batched_tokens) == (7, 64)
    assert not cfg.cache_config.enable_prefix_caching and cfg.cache_config.num_gpu_blocks == 9
    assert cfg.cache_config.cache_dtype == "float32" and cfg.model_config.dtype == "float16"
    assert cfg.parallel_config.tensor_parallel_size == 2 and cfg.parallel_config.tensor_parallel_device_ids == [0, 1]
    assert cfg.enforce_eager and not cfg.trim_heap_when_idle and cfg.speculative_config.num_speculative_tokens == 3
    text = help_text("serve")
    for f in dataclasses.fields(EngineConfig.__dataclass_fields__["cache_config"].default_factory()):
        assert f.metadata["help"] in text  # each field's help is the flag's
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.enforce_eager = False


def test_server_flags_are_server_config_fields():
    from novainfer.entrypoints.engine_args import field_values

    args = build_parser().parse_args(["serve", "m"])
    assert ServerConfig(**field_values(ServerConfig, args)) == ServerConfig()
    args = build_parser().parse_args(
        [
            "serve",
            "m",
            "--allowed-origins",
            "http://a",
            "*",
            "--max-queue-len",
            "3",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ]
    )
    cfg = ServerConfig(**field_values(ServerConfig, args))
    assert cfg.allowed_origins == ["http://a", "*"] and cfg.max_queue_len == 3 and cfg.enable_auto_tool_choice
    assert (
        "--max-queue-len MAX_QUEUE_LEN requests allowed to wait for a slot; past it the server answers 429 "
        "(default: 512)" in help_text("serve")
    )
