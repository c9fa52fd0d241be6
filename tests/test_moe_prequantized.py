"""Pre-quantized MoE experts (layers/quantization/prequantized_moe.py, kernels/fused_moe_quant.py) on the CPU.

Tiny Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral checkpoints are written in each format's on-disk layout, every
expert projection (and every dense projection) quantized as the format's tools store it, the routers left dense;
the reference is transformers running the same model with the weights dequantized to float32 (the dense FP8
projections' inputs also quantized per token group, as the format does at run time: the experts on the CPU are
weight-only). NovaInfer must agree on >= 99% of teacher-forced top-1 tokens and give the same greedy continuation
(writers and reference: tests/test_quant_formats.py). The Triton grouped GEMMs run under TRITON_INTERPRET=1
against the torch references (dequantize, then the experts in torch); what is not implemented is refused at
start-up naming the field.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from novainfer import LLM, SamplingParams
from novainfer.layers.fused_moe.moe_torch import fused_experts_torch
from novainfer.layers.activation import get_act_and_mul
from novainfer.layers.quantization.fp8_block import dequantize_fp8_block_experts, fused_experts_fp8_block_reference
from novainfer.layers.quantization.int4 import dequantize_int4_experts, fused_experts_int4_reference
from tests.test_quant_formats import (
    FORMATS,
    _format,
    assert_agrees,
    hf_reference,
    hf_top1,
    prompts,
    top1,
    with_quant_config,
    write_pair,
)
from tests.tiny_models import make_tiny_model

F8 = torch.float8_e4m3fn
MOE_FORMATS = [
    "fp8-block",
    "ct-fp8-block",
    "ct-fp8-dynamic",
    "gptq-sym",
    "awq",
    "ct-w4a16-sym-g32",
    "ct-w4a16-asym-g64",
]
FAMILIES = {  # every projection a multiple of 128 wide (block FP8's blocks)
    "qwen3_moe": dict(head_dim=32, moe_intermediate_size=128),
    "qwen2_moe": dict(moe_intermediate_size=128, shared_expert_intermediate_size=128),
    "mixtral": dict(intermediate_size=128),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moeq")
    return {
        arch: make_tiny_model(
            str(root / arch), arch, seed=11, num_heads=4, num_kv_heads=4, head_dim=32, overrides=overrides
        )
        for arch, overrides in FAMILIES.items()
    }


def experts_of(llm: LLM):
    return llm.llm_engine.executor.workers[0].model_runner.model.model.layers[0].mlp.experts


@pytest.mark.parametrize(
    "arch,name",
    [("qwen3_moe", n) for n in MOE_FORMATS]
    + [("qwen2_moe", "fp8-block"), ("qwen2_moe", "awq"), ("mixtral", "gptq-sym")],
)
def test_moe_checkpoint_matches_its_dequantized_model(bases, tmp_path, arch, name):
    quantize, qconfig, act = _format(name)
    qdir, ddir = write_pair(bases[arch], str(tmp_path / name), quantize, qconfig)
    llm = LLM(qdir, device="cpu", dtype="float32")
    experts = experts_of(llm)
    stored = {n: p for n, p in experts.named_parameters()}
    if "w13_qweight" in stored:  # kept 4-bit: [E, 2I, H/8] int32 words
        assert stored["w13_qweight"].dtype == torch.int32 and stored["w13_qweight"].shape == (
            6 - (arch == "mixtral"),
            256,
            16,
        )
        assert stored["w2_qweight"].shape[1:] == (128, 16)
    else:  # kept float8 with [E, N/128, K/128] block scales, or [E, N, 1] per channel
        scales = (256, 1) if name == "ct-fp8-dynamic" else (2, 1)
        assert stored["w13_weight"].dtype == F8 and stored["w13_weight_scale"].shape[1:] == scales
    assert_agrees(llm, hf_reference(ddir, act), prompts(5, 32, seed=3), 6)


@pytest.mark.parametrize("name", ["fp8-block", "gptq-sym"])
def test_moe_dummy_load_draws_quantized_experts(bases, tmp_path, name):
    _, qconfig, _ = _format(name)
    folder = with_quant_config(bases["qwen3_moe"], str(tmp_path / "cfg"), qconfig, weights=False)
    llm = LLM(folder, device="cpu", dtype="float32", load_format="dummy")
    experts = experts_of(llm)
    w13 = experts.w13_weight if name == "fp8-block" else experts.w13_qweight
    assert w13.dtype == (F8 if name == "fp8-block" else torch.int32) and w13.shape[0] == 6
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3


def test_moe_refusals_name_the_field(bases, tmp_path):
    src = bases["qwen3_moe"]
    _, act_order, _ = _format("gptq-asym-act-order")
    _, ct_static, _ = _format("ct-fp8-static")
    cases = [
        (act_order, "desc_act=true .gptq.: act-order"),
        (ct_static, r"input_activations.dynamic=False .compressed-tensors.: static FP8 input scales on MoE"),
        ({**FORMATS["fp8-block"][1], "modules_to_not_convert": ["model.layers.0.mlp.experts"]}, "modules_to_not_conv"),
    ]
    for i, (qconfig, match) in enumerate(cases):
        folder = with_quant_config(src, str(tmp_path / f"m{i}"), qconfig)
        with pytest.raises(ValueError, match=match):
            LLM(folder, device="cpu", dtype="float32", load_format="dummy")
    # block FP8 experts need whole 128-blocks: a 96-wide expert is refused
    odd = make_tiny_model(
        str(tmp_path / "odd"),
        "qwen3_moe",
        num_heads=4,
        num_kv_heads=4,
        head_dim=32,
        overrides=dict(head_dim=32, moe_intermediate_size=96),
    )
    folder = with_quant_config(odd, str(tmp_path / "odd-q"), FORMATS["fp8-block"][1], weights=False)
    with pytest.raises(ValueError, match=r"weight_block_size=\[128, 128\] does not divide the experts'"):
        LLM(folder, device="cpu", dtype="float32", load_format="dummy")


def test_routers_listed_unquantized_are_accepted(bases, tmp_path):
    """Qwen's FP8 MoE checkpoints name their routers in modules_to_not_convert: they stay dense here anyway."""
    qconfig = {**FORMATS["fp8-block"][1], "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}
    folder = with_quant_config(bases["qwen3_moe"], str(tmp_path / "m"), qconfig, weights=False)
    llm = LLM(folder, device="cpu", dtype="float32", load_format="dummy")
    gate = llm.llm_engine.executor.workers[0].model_runner.model.model.layers[0].mlp.gate
    assert gate.quant_method is None and gate.weight.dtype == torch.float32


# ---- the grouped GEMMs under the interpreter ------------------------------------------------------------------
def _routing(tokens: int, experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(k, -1)
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_fp8_block_moe_kernel_matches_the_torch_reference(tokens):
    from novainfer.kernels.fused_moe_quant import fused_experts_fp8_block

    g = torch.Generator().manual_seed(tokens)
    e, hidden, inter, block = 4, 256, 128, (128, 128)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) * 40).clamp(-440, 440).to(F8)
    w2 = (torch.randn(e, hidden, inter, generator=g) * 40).clamp(-440, 440).to(F8)
    s13 = torch.rand(e, 2, 2, generator=g) * 1e-3 + 1e-4
    s2 = torch.rand(e, 2, 1, generator=g) * 1e-3 + 1e-4
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = _routing(tokens, e, 2, tokens)
    act = get_act_and_mul("silu")
    d13 = dequantize_fp8_block_experts(w13, s13, block)
    assert torch.equal(d13[1, 130, 5], w13[1, 130, 5].float() * s13[1, 1, 0])  # block (row 1, column 0)
    for quantized in (False, True):  # weight-only; per-token-group FP8 activations (quantized alike by the reference)
        want = fused_experts_fp8_block_reference(x, w13, s13, w2, s2, block, weights, ids, act, quantized)
        got = fused_experts_fp8_block(x, w13, s13, w2, s2, block, weights, ids, act, quantize_activations=quantized)
        torch.testing.assert_close(got, want, rtol=2e-3 if quantized else 1e-4, atol=2e-3 if quantized else 1e-4)
    want_q, want = want, fused_experts_torch(x, d13, dequantize_fp8_block_experts(w2, s2, block), weights, ids, act)
    assert (want_q - want).norm() > 1e-3 * want.norm()  # the two paths do differ


@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_moe_kernel_matches_the_torch_reference(tokens, group):
    from novainfer.kernels.fused_moe_quant import fused_experts_int4
    from novainfer.layers.quantization.int4 import dequantize_int4, pack_int4

    g = torch.Generator().manual_seed(tokens + group)
    e, hidden, inter = 5, 256, 128

    def packed(n: int, k: int):
        codes = torch.randint(0, 16, (e * n, k), generator=g, dtype=torch.uint8)
        scales = torch.rand(e, n, k // group, generator=g) * 0.05
        zeros = torch.randint(0, 16, (e, n, k // group), generator=g, dtype=torch.uint8)
        return pack_int4(codes).view(e, n, k // 8), scales, zeros

    q13, s13, z13 = packed(2 * inter, hidden)
    q2, s2, z2 = packed(hidden, inter)
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = _routing(tokens, e, 2, tokens + 1)
    act = get_act_and_mul("silu")
    d13 = dequantize_int4_experts(q13, s13, z13, group)
    torch.testing.assert_close(d13[3], dequantize_int4(q13[3], s13[3], z13[3], group).T)  # the dense layout's
    want = fused_experts_int4_reference(x, q13, s13, z13, q2, s2, z2, group, weights, ids, act)
    got = fused_experts_int4(x, q13, s13, z13, q2, s2, z2, group, weights, ids, act)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if tokens == 7:  # a sweep's tiles (benchmarks/quant_gpu.py): BLOCK_K capped at the group
        tiles = ((16, 32, 256, 4, 1), (16, 64, 64, 4, 1))
        got = fused_experts_int4(x, q13, s13, z13, q2, s2, z2, group, weights, ids, act, tiles=tiles)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _int4_experts(e: int, hidden: int, inter: int, group: int, g: torch.Generator, scale: float = 0.05):
    """Random INT4 experts (w13, w2 as (codes, scales, zero points)), zero points anywhere in 0..15 (asymmetric)."""

    def packed(n: int, k: int):
        from novainfer.layers.quantization.int4 import pack_int4

        codes = torch.randint(0, 16, (e * n, k), generator=g, dtype=torch.uint8)
        scales = torch.rand(e, n, k // group, generator=g) * scale
        zeros = torch.randint(0, 16, (e, n, k // group), generator=g, dtype=torch.uint8)
        return pack_int4(codes).view(e, n, k // 8), scales, zeros

    return packed(2 * inter, hidden), packed(hidden, inter)


@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_moe_gemv_matches_the_torch_reference(tokens, group, monkeypatch):
    """Up to moe_gemv.MAX_TOKENS tokens fused_experts_int4 takes one GEMV per (token, expert) pair: the reference's
    output with the interpreter's tiles and with tiles that leave partial row tiles (N = 192, 224, 384) and K steps
    past K (224 in steps of 128) or a group over several steps (128 in steps of 64); and the grouped GEMMs' output."""
    from novainfer.kernels import moe_gemv
    from novainfer.kernels.fused_moe import experts_gemv
    from novainfer.kernels.fused_moe_quant import fused_experts_int4

    g = torch.Generator().manual_seed(100 * tokens + group)
    hidden, inter = {32: (224, 96), 128: (384, 128)}[group]
    (q13, s13, z13), (q2, s2, z2) = _int4_experts(6, hidden, inter, group, g)
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = _routing(tokens, 6, 3, tokens)
    act = get_act_and_mul("silu")
    want = fused_experts_int4_reference(x, q13, s13, z13, q2, s2, z2, group, weights, ids, act)
    tol = dict(rtol=1e-4, atol=1e-5 * want.abs().max().item())
    launches = []
    launch = moe_gemv._int4_moe_gemv
    monkeypatch.setattr(moe_gemv, "_int4_moe_gemv", lambda *a: launches.append(a[-1]) or launch(*a))
    got = fused_experts_int4(x, q13, s13, z13, q2, s2, z2, group, weights, ids, act)
    assert launches == [None, None]  # gate/up and down, each one GEMV launch with the default tiles
    torch.testing.assert_close(got, want, **tol)
    tiles = {32: (128, 128, 4), 128: (256, 64, 4)}[group]
    w = (q13, q2, weights, ids, act, s13, s2)
    got_tiled = experts_gemv(x, *w, tiles=tiles, w13_zeros=z13, w2_zeros=z2, group=group)
    torch.testing.assert_close(got_tiled, want, **tol)
    assert launches[2:] == [tiles, tiles]
    grouped = fused_experts_int4(
        x, q13, s13, z13, q2, s2, z2, group, weights, ids, act, tiles=((16, 64, 64, 4, 1),) * 2
    )
    assert len(launches) == 4  # explicit tiles: the grouped GEMMs, no GEMV
    bf16 = 2.0**-8
    torch.testing.assert_close(got, grouped, rtol=bf16, atol=bf16 * grouped.abs().max().item())


def test_int4_moe_gemv_in_half_precision():
    """float16 activations and scales (GPTQ's): the GEMV's output rounds as the reference's product does."""
    from novainfer.kernels.fused_moe_quant import fused_experts_int4

    g = torch.Generator().manual_seed(7)
    (q13, s13, z13), (q2, s2, z2) = _int4_experts(4, 256, 128, 64, g, scale=0.01)
    s13, s2 = s13.half(), s2.half()
    x = torch.randn(2, 256, generator=g).half()
    weights, ids = _routing(2, 4, 2, 3)
    act = get_act_and_mul("silu")
    want = fused_experts_int4_reference(x, q13, s13, z13, q2, s2, z2, 64, weights, ids, act)
    got = fused_experts_int4(x, q13, s13, z13, q2, s2, z2, 64, weights, ids, act)
    assert got.dtype == torch.float16
    assert ((got.float() - want).norm() / want.norm()).item() < 5e-3  # the float16 gate/up and activation


def test_moe_kernels_compile_for_hopper_on_wgmma():
    """What the interpreter cannot show: the grouped GEMMs compile for sm_90 (tests/sm90_moe_ptx.py, in a process
    without the interpreter), on wgmma, the quantized-activation FP8 path as a float8 e4m3 product; the INT4 GEMV
    compiles too, reading its codes in 16-byte vectors."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "tests", "sm90_moe_ptx.py")], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = json.loads(proc.stdout.splitlines()[-1])
    gemv = ptx.pop("int4_moe_gemv")  # the INT4 GEMV: codes in 16-byte loads, no int-to-float conversion a weight
    assert "ld.global.L1::evict_first.L2::cache_hint.v4.b32" in gemv and "cvt.rn.f32.s32" not in gemv
    assert all("wgmma.mma_async" in p for p in ptx.values()), [k for k, p in ptx.items() if "wgmma" not in p]
    assert ".e4m3.e4m3" in ptx["fp8_moe_quantized"] and ".bf16.bf16" in ptx["fp8_moe_weight_only"]


def test_int4_experts_split_by_tensor_parallelism(bases, tmp_path):
    """tp=2 (uni): each rank takes its half of every expert's gate/up rows and down columns; same top-1."""
    quantize, qconfig, act = _format("gptq-sym")
    qdir, ddir = write_pair(bases["qwen3_moe"], str(tmp_path / "tp"), quantize, qconfig)
    llm = LLM(qdir, device="cpu", dtype="float32", tensor_parallel_size=2)
    experts = llm.llm_engine.executor.workers[1].model_runner.model.model.layers[0].mlp.experts
    assert experts.w13_qweight.shape == (6, 2 * 64, 128 // 8) and experts.w2_qweight.shape == (6, 128, 64 // 8)
    ids = prompts(3, 24, seed=4)
    got, want = top1(llm, ids), hf_top1(hf_reference(ddir, act), ids)
    assert sum(a == b for a, b in zip(got, want)) / len(want) >= 0.99


def test_start_up_probe_of_the_moe_kernels():
    """The CUDA start-up probe (here under the interpreter, float32) passes the kernels and refuses wrong ones."""
    from novainfer.layers.quantization.int4 import Int4Format, Int4LinearMethod
    from novainfer.layers.quantization.compressed_tensors import CtFp8MoEMethod
    from novainfer.layers.quantization.fp8 import Fp8Options, quantize_rows
    from novainfer.layers.quantization.fp8_block import Fp8BlockMoEMethod
    from novainfer.layers.quantization.int4 import Int4MoEMethod
    from novainfer.layers.quantization.prequantized_moe import check_moe_kernels

    cpu = torch.device("cpu")
    check_moe_kernels(Fp8BlockMoEMethod((128, 128), "weight_scale_inv"), cpu, torch.float32)
    check_moe_kernels(CtFp8MoEMethod(Fp8Options(quantize=quantize_rows)), cpu, torch.float32)
    int4 = Int4MoEMethod(Int4LinearMethod(Int4Format("awq", 64, symmetric=False)))
    check_moe_kernels(int4, cpu, torch.float32)
    int4.apply_cuda = lambda layer, x, w, ids: Int4MoEMethod.apply_cuda(int4, layer, x, w, ids.flip(1))  # swapped
    with pytest.raises(ValueError, match=r"Int4MoEMethod \(fused MoE\): the GPU kernels give wrong results"):
        check_moe_kernels(int4, cpu, torch.float32)
