"""The C Gated DeltaNet kernels, scalar, AVX2 and AVX-512: the decode step (csrc/gated_delta_cpu.c) against the
layer's torch decode path, for a batch mixing continuing sequences and a one-token prompt that must ignore its slot's
stale state; the prefill (csrc/gated_delta_prefill_cpu.c) against the torch references of kernels/gated_delta_rule.py
(causal_conv1d_torch, chunk_gated_delta_rule_torch) on packed sequences of varied lengths across chunk boundaries,
from carried states; the gated RMSNorm against its torch form. Outputs and the conv / recurrent states left in each
slot equal within 1e-5 relative."""

from __future__ import annotations

import pytest
import torch

from novainfer.kernels import gated_delta_rule as gdr
from novainfer.layers import linear_attention
from novainfer.layers.linear_attention import GatedDeltaNet, GatedRMSNorm
from novainfer.kernels.cpu import gated_delta as gated_delta_cpu
from tests.test_linear_attention import run

pytestmark = pytest.mark.skipif(gated_delta_cpu._lib() is None, reason="needs the CPU kernels (gcc, AVX2)")


class Config:
    hidden_size, rms_norm_eps, hidden_act = 48, 1e-6, "silu"
    linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim = 2, 4, 16, 32
    linear_conv_kernel_dim = 4


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


class WideConfig(Config):
    """1,152 conv channels: the decode conv in two tasks (csrc's CONV_CHANNELS 1,024), the second partial."""

    linear_key_head_dim, linear_value_head_dim = 128, 160


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("config,threads", [(Config, 1), (WideConfig, 2)], ids=["narrow", "wide-2-threads"])
def test_c_decode_step_equals_torch(isa, config, threads, monkeypatch):
    from novainfer.kernels.cpu import library

    if gated_delta_cpu.set_isa(isa) != isa:
        pytest.skip(f"this CPU has no {isa}")
    torch.manual_seed(0)
    layer = GatedDeltaNet(config())
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    conv0 = torch.randn(5, *layer.state_shapes()[0])
    ssm0 = torch.randn(5, *layer.state_shapes()[1]) * 0.3
    x = torch.randn(3, 48)
    library.set_num_threads(threads)
    try:
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
    finally:
        gated_delta_cpu.set_isa("auto")
        library.set_num_threads(None)
    for got, want in zip(results["c"], results["torch"]):
        assert relative(got, want) < 1e-5
    assert torch.equal(results["c"][1][[2, 4]], conv0[[2, 4]])  # other slots untouched


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("lens", [[1, 2, 64, 65, 130], [7]])
def test_c_prefill_equals_torch_reference(isa, lens):
    """dv = 84 runs a 64-column AVX-512 block, a 16-column one and a scalar rest (AVX2: two 32-column blocks, two
    8-column ones and the rest); lengths 1 and 2 keep part of the old conv window; 64, 65 and 130 cross the
    reference's 64-token chunks; slot 5 is never touched."""
    if gated_delta_cpu.set_isa(isa) != isa:
        pytest.skip(f"this CPU has no {isa}")
    gen = torch.Generator().manual_seed(len(lens))
    nk, nv, dk, dv, width = 2, 4, 32, 84, 4
    c = 2 * nk * dk + nv * dv
    total = sum(lens)
    wide = torch.randn(total, c + 5, generator=gen)
    x = wide[:, :c]  # rows strided as a view of a wider projection
    weight = torch.randn(c, 1, width, generator=gen) * 0.5
    g = -torch.rand(total, nv, generator=gen)
    beta = torch.rand(total, nv, generator=gen)
    slots = torch.tensor([4, 0, 3, 1, 2][: len(lens)])
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    conv0 = torch.randn(6, width - 1, c, generator=gen)
    ssm0 = torch.randn(6, nv, dk, dv, generator=gen) * 0.3
    conv_c, ssm_c = conv0.clone(), ssm0.clone()
    out = gated_delta_cpu.prefill(x, conv_c, ssm_c, slots, cu, weight, g, beta, nk, dk)
    gated_delta_cpu.set_isa("auto")
    conv_t, ssm_t = conv0.clone(), ssm0.clone()
    mixed = gdr.causal_conv1d_torch(x.contiguous(), weight[:, 0], None, conv_t, slots, cu)
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    ref = gdr.chunk_gated_delta_rule_torch(
        q.reshape(total, nk, dk), k.reshape(total, nk, dk), v.reshape(total, nv, dv), g, beta, ssm_t, slots, cu
    )
    assert relative(out, ref) < 1e-5
    assert relative(conv_c, conv_t) < 1e-6 and relative(ssm_c, ssm_t) < 1e-5
    for n, length in enumerate(lens):  # each sequence alone, too: no sequence's error hides in the others' norm
        rows = slice(int(cu[n]), int(cu[n + 1]))
        assert relative(out[rows], ref[rows]) < 1e-5, f"sequence {n} of {length} tokens"
        assert relative(ssm_c[slots[n]], ssm_t[slots[n]]) < 1e-5
    assert torch.equal(conv_c[5], conv0[5]) and torch.equal(ssm_c[5], ssm0[5])


def test_c_gated_rms_norm_equals_torch(monkeypatch):
    """130 rows (three tasks, the last one short) of 84 values (eight at a time, then a scalar rest)."""
    gen = torch.Generator().manual_seed(5)
    norm = GatedRMSNorm(84, 1e-6)
    norm.weight.data = torch.randn(84, generator=gen)
    x, z = torch.randn(65, 2, 84, generator=gen) * 3, torch.randn(65, 2, 84, generator=gen) * 4
    got = norm(x, z)
    monkeypatch.setattr(gated_delta_cpu, "gated_rms_norm", lambda *a: None)
    want = norm(x, z)
    assert got.shape == want.shape and relative(got, want) < 1e-6
    assert ((got - want).abs() <= 1e-5 * want.abs() + 1e-6).all()
