"""The Gated DeltaNet kernels (novainfer/kernels/gated_delta_rule.py): the Triton kernels (TRITON_INTERPRET=1 on the
CPU) and the torch references, both against transformers' Qwen3-Next functions, on tiny shapes: packed varlen
sequences, states in a pool under permuted slots, grouped value heads, chunk boundaries, conv states."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from novainfer.kernels import gated_delta_rule as gdr

HK, HV, K, V = 1, 2, 16, 32  # two value heads share each key head, as in Qwen3.5 / Qwen3-Next
TOL = 1e-4
RECURRENT = {"torch": gdr.fused_recurrent_gated_delta_rule_torch, "triton": gdr.fused_recurrent_gated_delta_rule_triton}
CHUNKED = {"torch": gdr.chunk_gated_delta_rule_torch, "triton": gdr.chunk_gated_delta_rule_triton}
CONV = {"torch": gdr.causal_conv1d_torch, "triton": gdr.causal_conv1d_triton}
CONV_UPDATE = {"torch": gdr.causal_conv1d_update_torch, "triton": gdr.causal_conv1d_update_triton}


def gdn_inputs(seed: int, tokens: int, l2norm: bool):
    """q, k [T, HK, K], v [T, HV, V] (strided views of one packed tensor, as the model's conv output), g <= 0 and
    beta in (0, 1) [T, HV]; q and k pre-normalised when the kernel won't."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(tokens, 2 * HK * K + HV * V, generator=gen).split([HK * K, HK * K, HV * V], dim=1)
    q, k, v = q.view(tokens, HK, K), k.view(tokens, HK, K), v.view(tokens, HV, V)
    if not l2norm:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = -F.softplus(torch.randn(tokens, HV, generator=gen)) * 0.5
    beta = torch.sigmoid(torch.randn(tokens, HV, generator=gen))
    return q, k, v, g, beta


def state_pool(seed: int, slots: int) -> torch.Tensor:
    return torch.randn(slots, HV, K, V, generator=torch.Generator().manual_seed(seed)) * 0.1


def cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens).cumsum(0).int()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=TOL, atol=TOL)


def hf_per_sequence(fn, lens, slots, pool, q, k, v, g, beta, l2norm):
    """transformers' function on each sequence alone (batch 1): outputs packed, final states by slot."""
    outs, finals, start = [], {}, 0
    for n, length in enumerate(lens):
        part = [x[start : start + length][None] for x in (q, k, v, g, beta)]
        o, h = fn(
            *part, initial_state=pool[slots[n]][None].clone(), output_final_state=True, use_qk_l2norm_in_kernel=l2norm
        )
        outs.append(o[0])
        finals[slots[n]] = h[0]
        start += length
    return torch.cat(outs), finals


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("l2norm", [True, False])
def test_recurrent_decode_batch_matches_transformers(impl, l2norm):
    slots = [3, 0, -1, 4]  # slot -1: a padding row (reads a zero state, writes none)
    q, k, v, g, beta = gdn_inputs(0, len(slots), l2norm)
    pool = state_pool(1, 6)
    ours_pool = pool.clone()
    o = RECURRENT[impl](q, k, v, g, beta, ours_pool, torch.tensor(slots, dtype=torch.int32), None, l2norm)
    initial = torch.stack([pool[s] if s >= 0 else torch.zeros_like(pool[0]) for s in slots])
    ref_o, ref_h = torch_recurrent_gated_delta_rule(
        q[:, None],
        k[:, None],
        v[:, None],
        g[:, None],
        beta[:, None],
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2norm,
    )
    assert close(o, ref_o[:, 0])
    for n, s in enumerate(slots):
        if s >= 0:
            assert close(ours_pool[s], ref_h[n])
    for s in (1, 2, 5):
        assert torch.equal(ours_pool[s], pool[s])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_recurrent_varlen_prefill_matches_transformers(impl):
    lens, slots = [3, 1, 6], [2, 0, 1]
    q, k, v, g, beta = gdn_inputs(2, sum(lens), True)
    pool = state_pool(3, 4)
    ours_pool = pool.clone()
    o = RECURRENT[impl](q, k, v, g, beta, ours_pool, torch.tensor(slots, dtype=torch.int32), cu(lens))
    ref_o, finals = hf_per_sequence(torch_recurrent_gated_delta_rule, lens, slots, pool, q, k, v, g, beta, True)
    assert close(o, ref_o)
    assert all(close(ours_pool[s], h) for s, h in finals.items())
    assert torch.equal(ours_pool[3], pool[3])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_chunked_prefill_matches_transformers(impl):
    lens, slots = [1, 64, 70, 131], [3, 0, 2, 4]  # shorter than, equal to and across chunk boundaries
    q, k, v, g, beta = gdn_inputs(4, sum(lens), True)
    pool = state_pool(5, 5)
    ours_pool = pool.clone()
    o = CHUNKED[impl](q, k, v, g, beta, ours_pool, torch.tensor(slots, dtype=torch.int32), cu(lens))
    ref_o, finals = hf_per_sequence(torch_chunk_gated_delta_rule, lens, slots, pool, q, k, v, g, beta, True)
    rec_o, rec_finals = hf_per_sequence(torch_recurrent_gated_delta_rule, lens, slots, pool, q, k, v, g, beta, True)
    assert close(o, ref_o) and close(o, rec_o)
    assert all(close(ours_pool[s], finals[s]) and close(ours_pool[s], rec_finals[s]) for s in slots)
    assert torch.equal(ours_pool[1], pool[1])


def test_chunked_prefill_without_l2norm_and_strong_decay_matches_recurrent():
    """Pre-normalised keys, and decays down to exp(-8) a token: exp(cumsum) underflows inside a chunk."""
    lens, slots = [100], [1]
    q, k, v, g, beta = gdn_inputs(6, sum(lens), False)
    g = g * 16
    pool = state_pool(7, 2)
    ours_pool = pool.clone()
    o = gdr.chunk_gated_delta_rule_triton(
        q, k, v, g, beta, ours_pool, torch.tensor(slots, dtype=torch.int32), cu(lens), use_qk_l2norm=False
    )
    ref_o, finals = hf_per_sequence(torch_recurrent_gated_delta_rule, lens, slots, pool, q, k, v, g, beta, False)
    assert torch.isfinite(o).all() and close(o, ref_o) and close(ours_pool[1], finals[1])


@pytest.mark.parametrize("kernel", ["recurrent", "chunked"])
def test_bf16_activations_keep_an_fp32_state(kernel):
    """bf16 q/k/v/beta (the models' dtype): the state math stays fp32 (the pool agrees to 1e-4), the output is
    rounded once to bf16."""
    lens, slots = [66, 3], [0, 2]
    q, k, v, g, beta = gdn_inputs(15, sum(lens), True)
    q, k, v, beta = (x.bfloat16() for x in (q, k, v, beta))
    pool = state_pool(16, 3)
    ours_pool, ref_pool = pool.clone(), pool.clone()
    fn = {"recurrent": RECURRENT, "chunked": CHUNKED}[kernel]
    s, c = torch.tensor(slots, dtype=torch.int32), cu(lens)
    o = fn["triton"](q, k, v, g, beta, ours_pool, s, c)
    ref = gdr.chunk_gated_delta_rule_torch(q, k, v, g, beta, ref_pool, s, c)
    assert o.dtype == torch.bfloat16 and ref.dtype == torch.bfloat16
    assert ((o.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 1e-2
    assert close(ours_pool, ref_pool)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("kernel", ["recurrent", "chunked", "decode"])
def test_a_bf16_state_pool_is_updated_in_float32_and_rounded_once(impl, kernel):
    """mamba_ssm_cache_dtype=bfloat16: the kernels widen the slot's state, run the whole call in float32 and round
    the final state once as they store it. So the outputs equal a float32 pool's holding the same values (1e-4),
    and the pool is that run's final state rounded to bfloat16."""
    lens, slots = ([1, 1, 1], [2, 0, -1]) if kernel == "decode" else ([66, 3], [0, 2])
    q, k, v, g, beta = gdn_inputs(21, sum(lens), True)
    pool = state_pool(22, 3).bfloat16()
    ours, ref = pool.clone(), pool.float()
    fn = CHUNKED if kernel == "chunked" else RECURRENT
    s = torch.tensor(slots, dtype=torch.int32)
    c = None if kernel == "decode" else cu(lens)
    o = fn[impl](q, k, v, g, beta, ours, s, c)
    ref_o = gdr.fused_recurrent_gated_delta_rule_torch(q, k, v, g, beta, ref, s, c)
    assert ours.dtype == torch.bfloat16 and close(o, ref_o)
    assert torch.equal(ours, ref.bfloat16()) or torch.allclose(ours.float(), ref, rtol=2**-7, atol=1e-6)
    assert not torch.equal(ours, pool)  # the state moved


def test_public_entry_points_run_the_reference_on_cpu_and_chunked_equals_recurrent():
    lens, slots = [5, 67], [1, 0]
    q, k, v, g, beta = gdn_inputs(8, sum(lens), True)
    pool_a, pool_b = state_pool(9, 2), state_pool(9, 2)
    s, c = torch.tensor(slots, dtype=torch.int32), cu(lens)
    o_chunk = gdr.chunk_gated_delta_rule(q, k, v, g, beta, pool_a, s, c)
    o_rec = gdr.fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool_b, s, c)
    assert close(o_chunk, o_rec) and close(pool_a, pool_b)


D, W = 24, 4  # a channel count that is no power of two; Qwen's conv width


def conv_inputs(seed: int, tokens: int, slots: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D, generator=gen)
    weight = torch.randn(D, W, generator=gen) * 0.5
    b = torch.randn(D, generator=gen) if bias else None
    return x, weight, b, torch.randn(slots, W - 1, D, generator=gen)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("bias", [False, True])
def test_causal_conv1d_varlen_matches_transformers(impl, bias):
    lens, slots = [1, 2, 9, 5], [4, 1, 0, 2]  # sequences shorter than W - 1 keep part of their old state
    x, weight, b, states = conv_inputs(10, sum(lens), 5, bias)
    ours = states.clone()
    out = CONV[impl](x, weight, b, ours, torch.tensor(slots, dtype=torch.int32), cu(lens))
    start = 0
    for n, length in enumerate(lens):
        hf_state = states[slots[n]].t()[None].clone()  # transformers' layout: [B, D, W - 1]
        ref = causal_conv1d_update(x[start : start + length].t()[None], hf_state, weight, b, "silu")
        assert close(out[start : start + length], ref[0].t())
        assert torch.equal(ours[slots[n]], hf_state[0].t())
        start += length
    assert torch.equal(ours[3], states[3])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_causal_conv1d_fresh_state_matches_transformers_prefill(impl):
    x, weight, b, _ = conv_inputs(11, 7, 1, True)
    out = CONV[impl](x, weight, b, torch.zeros(1, W - 1, D), torch.zeros(1, dtype=torch.int32), cu([7]), None)
    assert close(out, causal_conv1d_fn(x.t()[None], weight, b, activation=None)[0].t())


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_causal_conv1d_update_matches_transformers(impl):
    slots = [2, -1, 0]
    x, weight, b, states = conv_inputs(12, len(slots), 4, True)
    ours = states.clone()
    out = CONV_UPDATE[impl](x, weight, b, ours, torch.tensor(slots, dtype=torch.int32))
    initial = torch.stack([states[s] if s >= 0 else torch.zeros(W - 1, D) for s in slots])
    hf_state = initial.transpose(1, 2).clone()
    ref = causal_conv1d_update(x[:, :, None], hf_state, weight, b, "silu")[:, :, 0]
    assert close(out, ref)
    assert torch.equal(ours[2], hf_state[0].t()) and torch.equal(ours[0], hf_state[2].t())
    assert torch.equal(ours[1], states[1]) and torch.equal(ours[3], states[3])


def test_unsupported_activation_and_bad_shapes_are_refused():
    x, weight, b, states = conv_inputs(13, 2, 1, False)
    with pytest.raises(ValueError, match="gelu"):
        gdr.causal_conv1d_update(x, weight, b, states, torch.zeros(2, dtype=torch.int32), "gelu")
    q, k, v, g, beta = gdn_inputs(14, 2, True)
    with pytest.raises(ValueError, match="state"):
        gdr.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, torch.zeros(1, HV, K, V, dtype=torch.float64), torch.zeros(2, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="contiguous"):  # a strided view would be updated in a copy
        gdr.chunk_gated_delta_rule(
            q, k, v, g, beta, torch.zeros(1, HV, V, K).transpose(2, 3), torch.zeros(1, dtype=torch.int32), cu([2])
        )


def test_gpu_check_script_smoke_runs_on_the_cpu(monkeypatch, capsys):
    """tests/gpu/gdn_check.py --smoke: the device script's checks on tiny shapes, every row must pass."""
    from tests.gpu import gdn_check

    monkeypatch.setattr("sys.argv", ["gdn_check.py", "--smoke"])
    for name in ("HK", "HV", "K", "V", "DEV"):
        monkeypatch.setattr(gdn_check, name, getattr(gdn_check, name))
    monkeypatch.setattr(gdn_check, "rows", [])
    with pytest.raises(SystemExit) as exit_info:
        gdn_check.main()
    assert exit_info.value.code == 0 and len(gdn_check.rows) == 5, capsys.readouterr().out


def test_recurrent_kernel_gates_raw_a_and_b_as_the_gating_kernel_does():
    """gating=(A_log, dt_bias): the decode kernel takes the input projection's raw a and b (strided column ranges)
    and gives the bits of fused_ops.gdn_gating's g and beta fed to it (a + dt_bias crossing softplus's 20)."""
    from novainfer.kernels.fused_ops import gdn_gating

    slots = torch.tensor([3, 0, -1, 4], dtype=torch.int32)
    q, k, v, _, _ = gdn_inputs(5, 4, True)
    gen = torch.Generator().manual_seed(6)
    ba = torch.randn(4, 3 * HV, generator=gen) * 8  # b then a, beside other columns
    b, a = ba[:, :HV], ba[:, HV : 2 * HV]
    a_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen) * 10
    pool = state_pool(7, 6)
    fused_pool, split_pool = pool.clone(), pool.clone()
    fused = gdr.fused_recurrent_gated_delta_rule_triton(q, k, v, a, b, fused_pool, slots, gating=(a_log, dt_bias))
    g, beta = gdn_gating(a, b, a_log, dt_bias)
    split = gdr.fused_recurrent_gated_delta_rule_triton(q, k, v, g, beta, split_pool, slots)
    assert torch.equal(fused, split) and torch.equal(fused_pool, split_pool)
    assert not torch.equal(fused_pool, pool)
