"""The C Gated DeltaNet decode step (csrc/gated_delta_cpu.c), scalar and AVX-512, against the layer's torch
decode step: outputs and the conv / recurrent states left in each slot equal within 1e-5 relative, for a batch
mixing continuing sequences and a one-token prompt that must ignore its slot's stale state."""

from __future__ import annotations

import pytest
import torch

from novainfer.layers import linear_attention
from novainfer.layers.linear_attention import GatedDeltaNet
from novainfer.kernels.cpu import gated_delta as gated_delta_cpu
from tests.test_linear_attention import run

pytestmark = pytest.mark.skipif(gated_delta_cpu._lib() is None, reason="needs the CPU kernels (gcc, AVX2)")


class Config:
    hidden_size, rms_norm_eps, hidden_act = 48, 1e-6, "silu"
    linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim = 2, 4, 16, 32
    linear_conv_kernel_dim = 4


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("isa", ["scalar", "avx512"])
def test_c_decode_step_equals_torch(isa, monkeypatch):
    if gated_delta_cpu.set_isa(isa) != isa:
        pytest.skip(f"this CPU has no {isa}")
    torch.manual_seed(0)
    layer = GatedDeltaNet(Config())
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    conv0 = torch.randn(5, *layer.state_shapes()[0])
    ssm0 = torch.randn(5, 4, 16, 32) * 0.3
    x = torch.randn(3, 48)
    # slots 3 and 0 continue (seq_lens > 1); slot 1 starts a one-token prompt over stale state
    args = (x, [1, 1, 1], [9, 1, 4], [3, 1, 0])
    results = {}
    for path in ("c", "torch"):
        layer.conv_state, layer.ssm_state = conv0.clone(), ssm0.clone()
        if path == "torch":
            monkeypatch.setattr(gated_delta_cpu, "usable", lambda *a: False)
        calls: list[int] = []
        real = linear_attention.gated_delta_cpu.decode_step
        monkeypatch.setattr(
            linear_attention.gated_delta_cpu,
            "decode_step",
            lambda *a, calls=calls, real=real: calls.append(1) or real(*a),
        )
        results[path] = (run(layer, *args), layer.conv_state.clone(), layer.ssm_state.clone())
        assert len(calls) == (path == "c")
    gated_delta_cpu.set_isa("auto")
    for got, want in zip(results["c"], results["torch"]):
        assert relative(got, want) < 1e-5
    assert torch.equal(results["c"][1][[2, 4]], conv0[[2, 4]])  # other slots untouched
