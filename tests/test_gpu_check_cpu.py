"""The CPU halves of the model families' GPU checks (tests/gpu/family_checks.py): the same functions on tiny shapes,
float32, Triton interpreted; every check they record must pass."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import checks


@pytest.fixture()
def ledger():
    checks.rows.clear()
    yield checks.rows
    checks.rows.clear()


def test_moe_and_window_checks_run_on_the_cpu(ledger):
    pytest.importorskip("triton")
    from tests.gpu.family_checks import moe_kernel_checks, window_kernel_checks

    moe_kernel_checks("cpu", torch.float32, shapes=[("tiny", 6, 2, 32, 48)], token_counts=[1, 9], tol=1e-5)
    window_kernel_checks(
        "cpu",
        torch.float32,
        shapes=[("tiny", 4, 2, 16, 6, 2.0), ("tiny-full", 4, 2, 16, 64, None)],
        contexts=[0, 5, 13],
        block_size=4,
        tol=1e-5,
    )
    assert len(ledger) == 2 + 2 * 3 and all(ok for *_, ok in ledger), ledger


def test_fp8_checks_run_on_the_cpu(ledger, tmp_path):
    """The fp8 group's layer check (bf16 and float32) and logits check on tiny shapes; every row must pass."""
    from tests.gpu.fp8_checks import fp8_layer_checks, fp8_logits_check
    from tests.tiny_models import make_tiny_model

    shapes = [("tiny-qkv", 64, 128, True), ("tiny-down", 128, 64, False)]
    fp8_layer_checks("cpu", torch.bfloat16, shapes=shapes, rows=(1, 7, 33))
    fp8_layer_checks("cpu", torch.float32, shapes=shapes, rows=(1, 7, 33), tight=1e-5)
    path = make_tiny_model(str(tmp_path / "qwen2"), "qwen2", seed=3)
    fp8_logits_check(path, "tiny qwen2", device="cpu", dtype=torch.float32, prompts=4, length=24, min_top1=0.75)
    assert len(ledger) == 2 * 2 + 1 and all(ok for *_, ok in ledger), ledger


def test_sampling_kernel_checks_run_on_the_cpu(ledger):
    """The one-pass Gumbel-max sampler (kernels/sampling.py), interpreted: greedy rows equal torch.argmax (ties
    within and across blocks), random rows' draws follow softmax(logits / T); every row must pass."""
    from tests.gpu.sampling_checks import sampling_kernel_checks

    sampling_kernel_checks("cpu")
    assert len(ledger) == 4 and all(ok for *_, ok in ledger), ledger


def test_gpt_oss_kernel_checks_run_on_the_cpu(ledger):
    """gpt-oss's GPU checks (tests/gpu/gpt_oss_checks.py) on tiny shapes: sinks in the Triton decode (one and
    eight splits) and prefill kernels, the MoE kernels with biases and the clamped SwiGLU; every row must pass."""
    pytest.importorskip("triton")
    from tests.gpu.gpt_oss_checks import moe_kernel_checks, sink_kernel_checks

    sink_kernel_checks("cpu", tiny=True)
    moe_kernel_checks("cpu", tiny=True)
    assert len(ledger) == 4 + 2 + 2 and all(ok for *_, ok in ledger), ledger
