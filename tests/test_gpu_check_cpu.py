"""The CPU halves of issue 17's GPU checks (tests/gpu/family_checks.py): the same functions on tiny shapes,
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
    window_kernel_checks("cpu", torch.float32, shapes=[("tiny", 4, 2, 16, 6, 2.0), ("tiny-full", 4, 2, 16, 64, None)],
                         contexts=[0, 5, 13], block_size=4, tol=1e-5)
    assert len(ledger) == 2 + 2 * 3 and all(ok for *_, ok in ledger), ledger
