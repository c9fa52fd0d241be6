"""Pre-quantized checkpoints (layers/quantization/fp8_block.py, compressed_tensors.py, int4.py) on the CPU.

Each format's tiny checkpoint is written here in its on-disk layout: from the format's spec (block FP8, GPTQ,
AWQ) or by compressed-tensors' own compressors (its FP8 and pack-quantized formats). The reference is the
same model with the weights dequantized to float32 (by compressed-tensors' decompressors where they exist),
run by transformers; for the FP8 formats each quantized Linear's input is also quantized as the format says
(a forward pre-hook written here). NovaInfer must agree on >= 99% of teacher-forced top-1 tokens and give the
same greedy continuation. The Triton kernels run under TRITON_INTERPRET=1 against the torch references;
unimplemented combinations are refused at start-up naming the field.
"""

from __future__ import annotations

import json
import os
import re
import random
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from novainfer import LLM, SamplingParams
from novainfer.kernels import fp8_block as fp8_kernels
from novainfer.kernels.fp8_block import fp8_block_gemm, fp8_block_linear, per_token_group_quant
from novainfer.kernels.gemv import gemv
from novainfer.kernels.int4_gemm import DEQUANT_MIN_M, int4_dequantize, int4_gemm, int4_gemv, int4_linear
from novainfer.layers.quantization.fp8_block import block_reference, quantize_groups, weight_only_reference
from novainfer.layers.quantization.int4 import dequantize_int4, pack_int4, unpack_int4
from tests.tiny_models import make_tiny_model

F8 = torch.float8_e4m3fn
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")  # w*: Mixtral
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# ---- writers: each format's tensors from its spec --------------------------------------------------------------
def to_int32(v: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> int32 (two's complement)."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def group_codes(w: torch.Tensor, groups: torch.Tensor, n_groups: int, sym: bool):
    """w [N, K], the group of each column -> codes [N, K] (0..15), scales and zeros [N, n_groups]."""
    scales, zeros = torch.empty(w.shape[0], n_groups), torch.empty(w.shape[0], n_groups)
    for g in range(n_groups):
        cols = w[:, groups == g]
        if sym:
            s, z = cols.abs().amax(1) / 7, torch.full((w.shape[0],), 8.0)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / 15
            z = (-lo / s).round().clamp(0, 15)
        scales[:, g], zeros[:, g] = s.half().float(), z
    s_full, z_full = scales[:, groups], zeros[:, groups]
    codes = (w / s_full).round().add(z_full).clamp(0, 15)
    return codes.long(), scales, zeros, (codes - z_full) * s_full


def pack_along(codes: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """codes (0..15) -> int32 words of eight along dim; nibble j holds element order[j] of the eight."""
    c = codes.movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], -1, 8)[..., list(order)]
    words = (c.long() << torch.arange(0, 32, 4)).sum(-1)
    return to_int32(words).movedim(-1, dim).contiguous()


def gptq(w: torch.Tensor, g: int, sym: bool, desc_act: bool, seed: int):
    k = w.shape[1]
    if desc_act:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // g).to(torch.int32)
    codes, s, z, deq = group_codes(w, g_idx.long(), k // g, sym)
    tensors = {
        "qweight": pack_along(codes.T, 0),  # [K/8, N]
        "qzeros": pack_along(((z.long() - 1) & 0xF).T, 1),  # v1: zero - 1, [K/G, N/8]
        "scales": s.T.half().contiguous(),
        "g_idx": g_idx,
    }
    return tensors, deq


def awq(w: torch.Tensor, g: int, seed: int):
    groups = torch.arange(w.shape[1]) // g
    codes, s, z, deq = group_codes(w, groups, w.shape[1] // g, sym=False)
    tensors = {
        "qweight": pack_along(codes.T, 1, AWQ_ORDER),  # [K, N/8]
        "qzeros": pack_along(z.long().T, 1, AWQ_ORDER),
        "scales": s.T.half().contiguous(),
    }
    return tensors, deq


def fp8_block(w: torch.Tensor, block=(128, 128)):
    n, k = w.shape
    blocks = w.view(n // block[0], block[0], k // block[1], block[1])
    s = blocks.abs().amax(dim=(1, 3)) / 448
    full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    q = (w / full).to(F8)
    return {"weight": q, "weight_scale_inv": s}, q.float() * full


def ct_scheme(preset: str):
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(preset, ["Linear"])


def ct_compress(w: torch.Tensor, preset: str, fmt: str, x_amax: float):
    """compressed-tensors' own compressor of `fmt` -> (the module's tensors, its decompressed weight)."""
    from compressed_tensors.compressors import BaseCompressor

    scheme = ct_scheme(preset)
    wa = scheme.weights
    state = {"weight": w}
    if wa.type == "float":
        if wa.strategy == "block":
            bn, bk = wa.block_structure
            amax = w.view(w.shape[0] // bn, bn, w.shape[1] // bk, bk).abs().amax(dim=(1, 3))
        else:
            amax = w.abs().amax(1, keepdim=True) if wa.strategy == "channel" else w.abs().amax().view(1)
        state["weight_scale"] = amax / 448
        if scheme.input_activations is not None and not scheme.input_activations.dynamic:
            state["input_scale"] = torch.tensor([x_amax / 448])
    compressor = BaseCompressor.load_from_registry(fmt)
    packed = compressor.compress(dict(state), scheme)
    deq = compressor.decompress(dict(packed), scheme)["weight"].float()
    return dict(packed), deq


# ---- checkpoints ---------------------------------------------------------------------------------------------
def with_quant_config(src: str, folder: str, qconfig: dict | None, weights: bool = True) -> str:
    """A copy of the model at src whose config.json carries qconfig (without its weights: load_format dummy)."""
    shutil.copytree(src, folder)
    if not weights:
        os.remove(os.path.join(folder, "model.safetensors"))
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qconfig
    with open(path, "w") as f:
        json.dump(cfg, f)
    return folder


def write_pair(base: str, out: str, quantize, qconfig: dict) -> tuple[str, str]:
    """(quantized folder, its float32 dequantized twin) from the dense tiny model at base: every projection (an MoE's
    experts' too) quantized, the rest (routers among them) as they are."""
    qdir = with_quant_config(base, out + "-q", qconfig, weights=False)
    ddir = shutil.copytree(base, out + "-deq", ignore=shutil.ignore_patterns("*.safetensors"))
    dense = load_file(os.path.join(base, "model.safetensors"))
    qt, dt = {}, {}
    for name, t in sorted(dense.items()):
        mod = name.rsplit(".", 2)
        if len(mod) == 3 and mod[1] in PROJ and mod[2] == "weight":
            # one act order per input (GPTQ's order comes from the input's Hessian: q/k/v share it, gate/up too)
            seed = sum(map(ord, mod[0])) + PROJ.index(
                mod[1].replace("k_", "q_").replace("v_", "q_").replace("up", "gate")
            )
            tensors, deq = quantize(t.float(), seed)
            qt.update({f"{mod[0]}.{mod[1]}.{k}": v for k, v in tensors.items()})
            dt[name] = deq.float().contiguous()
        else:
            qt[name] = dt[name] = t
    save_file(qt, os.path.join(qdir, "model.safetensors"))
    save_file(dt, os.path.join(ddir, "model.safetensors"))
    return qdir, ddir


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A tiny Qwen2 whose every projection is a multiple of 128 wide (block FP8's blocks)."""
    return make_tiny_model(
        str(tmp_path_factory.mktemp("qf") / "qwen2"), "qwen2", seed=7, num_heads=4, num_kv_heads=4, head_dim=32
    )


def ct_config(preset: str, fmt: str) -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    cfg = QuantizationConfig(
        config_groups={"group_0": ct_scheme(preset)}, format=fmt, ignore=["lm_head"], quantization_status="compressed"
    )
    return cfg.model_dump(mode="json", exclude_none=True)


X_AMAX = 6.0  # the static input scale's range (RMS-normed tiny-model activations)
FORMATS = {
    "fp8-block": (
        lambda w, i: fp8_block(w),
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        "group128",
    ),
    "ct-fp8-dynamic": (
        lambda w, i: ct_compress(w, "FP8_DYNAMIC", "float-quantized", X_AMAX),
        ct_config("FP8_DYNAMIC", "float-quantized"),
        "token",
    ),
    "ct-fp8-static": (
        lambda w, i: ct_compress(w, "FP8", "float-quantized", X_AMAX),
        ct_config("FP8", "float-quantized"),
        "static",
    ),
    "ct-fp8-block": (
        lambda w, i: ct_compress(w, "FP8_BLOCK", "float-quantized", X_AMAX),
        ct_config("FP8_BLOCK", "float-quantized"),
        "group128",
    ),
    "gptq-sym": (
        lambda w, i: gptq(w, 32, True, False, i),
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
        None,
    ),
    "gptq-asym-act-order": (
        lambda w, i: gptq(w, 64, False, True, i),
        {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False, "desc_act": True},
        None,
    ),
    "awq": (
        lambda w, i: awq(w, 128, i),
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
        None,
    ),
    "ct-w4a16-sym-g32": (
        lambda w, i: ct_compress(w, "W4A16", "pack-quantized", 0),
        {**ct_config("W4A16", "pack-quantized")},
        None,
    ),
    "ct-w4a16-asym-g64": (lambda w, i: ct_compress(w, "W4A16_ASYM", "pack-quantized", 0), None, None),
}


def _ct_group(cfg: dict, group: int) -> dict:
    cfg = json.loads(json.dumps(cfg))
    cfg["config_groups"]["group_0"]["weights"]["group_size"] = group
    return cfg


def _format(name: str):
    quantize, qconfig, act = FORMATS[name]
    if name == "ct-w4a16-sym-g32":
        qconfig = _ct_group(qconfig, 32)
        scheme = ct_scheme("W4A16")
        scheme.weights.group_size = 32
        quantize = lambda w, i: _ct_compress_scheme(w, scheme)  # noqa: E731
    if name == "ct-w4a16-asym-g64":
        scheme = ct_scheme("W4A16_ASYM")
        scheme.weights.group_size = 64
        qconfig = _ct_group(ct_config("W4A16_ASYM", "pack-quantized"), 64)
        quantize = lambda w, i: _ct_compress_scheme(w, scheme)  # noqa: E731
    return quantize, qconfig, act


def _ct_compress_scheme(w: torch.Tensor, scheme):
    from compressed_tensors.compressors import BaseCompressor

    wa = scheme.weights
    gw = w.view(w.shape[0], -1, wa.group_size)
    if wa.symmetric:
        state = {"weight": w, "weight_scale": gw.abs().amax(-1) / 7}
    else:
        lo, hi = gw.amin(-1).clamp(max=0), gw.amax(-1).clamp(min=0)
        s = (hi - lo) / 15
        state = {
            "weight": w,
            "weight_scale": s,
            "weight_zero_point": ((-lo / s).round() - 8).clamp(-8, 7).to(torch.int8),
        }
    compressor = BaseCompressor.load_from_registry("pack-quantized")
    packed = compressor.compress(dict(state), scheme)
    return dict(packed), compressor.decompress(dict(packed), scheme)["weight"].float()


# ---- the reference --------------------------------------------------------------------------------------------
def fake_quant_input(kind: str, static_scale: float):
    """A forward pre-hook quantizing a Linear's input to float8 as the format does at run time."""

    def hook(module, args):
        (x,) = args
        xf = x.float().reshape(-1, x.shape[-1])
        if kind == "static":
            s = torch.tensor(static_scale)
            q = (xf / s).clamp(-448, 448).to(F8).float() * s
        else:
            width = 128 if kind == "group128" else xf.shape[1]
            xg = xf.view(xf.shape[0], -1, width)
            s = (xg.abs().amax(-1, keepdim=True) / 448).clamp(min=1 / (448 * 512))
            q = ((xg / s).clamp(-448, 448).to(F8).float() * s).view_as(xf)
        return (q.view_as(x).to(x.dtype),)

    return hook


def hf_reference(ddir: str, act: str | None):
    model = AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    if act is not None:
        for name, mod in model.named_modules():
            if name.rsplit(".", 1)[-1] in PROJ:
                mod.register_forward_pre_hook(fake_quant_input(act, X_AMAX / 448))
    return model


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(length)] for _ in range(n)]


def top1(llm: LLM, ids: list[list[int]]) -> list[int]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in ids],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    return [max(d.items(), key=lambda kv: kv[1].logprob)[0] for o in outs for d in o.prompt_logprobs if d]


@torch.no_grad()
def hf_top1(model, ids: list[list[int]]) -> list[int]:
    return [t for p in ids for t in model(torch.tensor([p])).logits[0, :-1].argmax(-1).tolist()]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", list(FORMATS))
def test_checkpoint_matches_its_dequantized_model(base, tmp_path, name):
    quantize, qconfig, act = _format(name)
    qdir, ddir = write_pair(base, str(tmp_path / name), quantize, qconfig)
    ref = hf_reference(ddir, act)
    llm = LLM(qdir, device="cpu", dtype="float32")
    layer = llm.llm_engine.executor.workers[0].model_runner.model.model.layers[0]
    stored = {n for n, _ in layer.mlp.down_proj.named_parameters()}
    assert stored & {"qweight", "weight", "weight_scale_inv", "weight_scale"}, stored  # kept quantized
    if "qweight" in stored:
        assert layer.mlp.down_proj.qweight.dtype == torch.int32
    else:
        assert layer.mlp.down_proj.weight.dtype == F8
    assert_agrees(llm, ref, prompts(6, 40, seed=1), 8)


def assert_agrees(llm: LLM, ref, ids: list[list[int]], new_tokens: int) -> None:
    """>= 99% teacher-forced top-1 agreement with the transformers reference over ids, and the same greedy
    continuation of the first two prompts."""
    got, want = top1(llm, ids), hf_top1(ref, ids)
    agree = sum(a == b for a, b in zip(got, want)) / len(want)
    assert len(want) == sum(len(p) - 1 for p in ids) and agree >= 0.99, agree
    out = llm.generate(
        [{"prompt_token_ids": p} for p in ids[:2]],
        SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
        use_tqdm=False,
    )
    want_greedy = [hf_greedy(ref, p, new_tokens) for p in ids[:2]]
    assert [list(o.outputs[0].token_ids) for o in out] == want_greedy


def test_int4_tensor_parallel_splits_on_group_boundaries(base, tmp_path):
    """tp=2 (uni): each rank unpacks, slices and repacks its rows / columns; same top-1 as the reference."""
    quantize, qconfig, act = _format("gptq-sym")
    qdir, ddir = write_pair(base, str(tmp_path / "tp"), quantize, qconfig)
    llm = LLM(qdir, device="cpu", dtype="float32", tensor_parallel_size=2)
    down = llm.llm_engine.executor.workers[1].model_runner.model.model.layers[0].mlp.down_proj
    assert down.qweight.shape == (128, 64 // 8) and down.scales.shape == (128, 64 // 32)  # [N, K/8], [N, K/G]
    ids = prompts(3, 24, seed=2)
    got, want = top1(llm, ids), hf_top1(hf_reference(ddir, act), ids)
    assert sum(a == b for a, b in zip(got, want)) / len(want) >= 0.99


@pytest.mark.parametrize("name", ["fp8-block", "gptq-sym", "ct-fp8-static"])
def test_dummy_load_draws_and_packs(base, tmp_path, name):
    _, qconfig, _ = _format(name)
    folder = with_quant_config(base, str(tmp_path / "cfg"), qconfig, weights=False)
    llm = LLM(folder, device="cpu", dtype="float32", load_format="dummy")
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4


# ---- refusals -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "qconfig,match",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not implemented"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group_size=16"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "modules_to_not_convert": ["visual"]}, "not_convert"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "lm_head=True .gptq.: a quant"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size is missing"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme"),
        ({"quant_method": "fp8", "weight_block_size": [96, 96]}, "weight_block_size=.96, 96."),
    ],
)
def test_unimplemented_configs_are_refused_naming_the_field(base, tmp_path, qconfig, match):
    folder = with_quant_config(base, str(tmp_path / "m"), qconfig)
    with pytest.raises(ValueError, match=match):
        LLM(folder, device="cpu", dtype="float32")


def test_compressed_tensors_refusals(base, tmp_path):
    cases = [
        (ct_config("W8A8", "int-quantized"), "format='int-quantized'"),
        (
            {**ct_config("FP8_DYNAMIC", "float-quantized"), "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]},
            "ignore",
        ),
        (_ct_group(ct_config("W4A16", "pack-quantized"), 256), "group_size=256"),
    ]
    for i, (qconfig, match) in enumerate(cases):
        folder = with_quant_config(base, str(tmp_path / f"m{i}"), qconfig)
        with pytest.raises(ValueError, match=match):
            LLM(folder, device="cpu", dtype="float32")


def test_tp_split_off_group_boundary_is_refused(base, tmp_path):
    _, qconfig, _ = _format("awq")  # group 128: o_proj's 128 input columns cannot split in two
    folder = with_quant_config(base, str(tmp_path / "awq"), qconfig)
    with pytest.raises(ValueError, match="group_size=128 does not divide"):
        LLM(folder, device="cpu", dtype="float32", load_format="dummy", tensor_parallel_size=2)


# ---- kernels under the interpreter ------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 3, 24])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_kernels_match_the_torch_reference(m, group):
    g = torch.Generator().manual_seed(m + group)
    k, n = (224 if group == 32 else 384), 100  # N not a multiple of the tiles: the edge tiles clamp their loads
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.1
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    qweight = pack_int4(codes)
    assert torch.equal(unpack_int4(qweight), codes)
    assert int(qweight[5, 9] >> 8 & 0xF) == int(codes[5, 32 * 2 + 4 * 2 + 1]), "input 4j + w in nibble j of word w"
    w = dequantize_int4(qweight, scales, zeros, group)
    torch.testing.assert_close(
        w, ((codes.float() - zeros.float().repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)).T
    )
    x = torch.randn(m, k, generator=g)
    want = x @ w
    torch.testing.assert_close(int4_gemm(x, qweight, scales, zeros, group), want, rtol=1e-4, atol=1e-4)
    # split over K (as for few rows on a GPU): float32 partial sums added atomically
    torch.testing.assert_close(int4_gemm(x, qweight, scales, zeros, group, split=3), want, rtol=1e-4, atol=1e-4)
    if m <= 4:
        torch.testing.assert_close(int4_gemv(x, qweight, scales, zeros, group), want, rtol=1e-4, atol=1e-4)
        # K steps longer than K's last one (the GPU's long steps): the tail step masks its chunks
        got = int4_gemv(x, qweight, scales, zeros, group, tiles=(8, 256, 4, 1))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(int4_linear(x, qweight, scales, zeros, group), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_dequantize_kernel_and_the_prefill_path(group):
    """int4_dequantize (the scratch weight of prefill-sized products) equals the torch reference bit for bit, and
    int4_linear from DEQUANT_MIN_M rows (dequantize, then a dense product) gives x @ w."""
    g = torch.Generator().manual_seed(group)
    k, n = 1152, 24  # K not a multiple of the kernel's 1024-wide step: the tail program masks its loads and stores
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.1).half()
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    qweight = pack_int4(codes)
    w = dequantize_int4(qweight, scales.float(), zeros, group)
    assert torch.equal(int4_dequantize(qweight, scales, zeros, group, torch.float32), w.T)
    x = torch.randn(DEQUANT_MIN_M, k, generator=g)
    torch.testing.assert_close(int4_linear(x, qweight, scales, zeros, group), x @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [1, 2, 8, 20])
def test_fp8_block_kernels_match_the_torch_reference(m):
    g = torch.Generator().manual_seed(m)
    k, n = 256, 192  # N not a multiple of the 128-row block: the last block row is partial
    w = (torch.randn(n, k, generator=g) * 40).clamp(-440, 440).to(F8)
    ws = torch.rand(2, 2, generator=g) * 0.01 + 1e-3
    # x exactly representable after its group scaling (each group's amax lands on 448): the interpreter's float8
    # cast truncates where CUDA rounds, so only exact quotients compare bit-for-bit with torch's cast
    x = (torch.randn(m, k, generator=g) * 60).clamp(-440, 440).to(F8).float()
    x[:, 0], x[:, 128] = 448.0, -448.0
    x = x / 32
    q, s = quantize_groups(x, 128)
    qt, st = per_token_group_quant(x, 128, out_dtype=torch.float32)
    assert torch.equal(st, s) and torch.equal(qt.to(F8).float(), q.float())
    qm, sm = per_token_group_quant(x, 128, out_dtype=torch.float32, m_major=True)  # cuBLAS's scale layout
    assert sm.stride(0) == 1 and torch.equal(sm, s) and torch.equal(qm, qt)
    want = block_reference(x, w, ws, (128, 128))
    torch.testing.assert_close(fp8_block_gemm(q, s, w, ws, (128, 128), torch.float32), want, rtol=1e-5, atol=1e-5)
    # K split in two: float32 partials per split, summed in split order by the second kernel
    y_split = fp8_block_gemm(q, s, w, ws, (128, 128), torch.float32, split=2)
    torch.testing.assert_close(y_split, want, rtol=1e-5, atol=1e-5)
    # few rows: weight-only, x unquantized (the GEMV at one row, the GEMM's bf16 path above)
    xr = torch.randn(m, k, generator=g)
    want_wo = weight_only_reference(xr, w, ws, (128, 128))
    assert (want_wo - block_reference(xr, w, ws, (128, 128))).norm() > 1e-3 * want_wo.norm()  # they do differ
    y_wo = fp8_block_gemm(xr, None, w, ws, (128, 128), torch.float32)
    torch.testing.assert_close(y_wo, want_wo, rtol=1e-5, atol=1e-5)
    if m == 1:
        torch.testing.assert_close(gemv(xr, w, weight_scale=ws), want_wo, rtol=1e-5, atol=1e-5)
        got = gemv(xr, w, weight_scale=ws, tiles=(8, 512, 4, 1))  # one masked step longer than K
        torch.testing.assert_close(got, want_wo, rtol=1e-5, atol=1e-5)
    if m <= fp8_kernels.WEIGHT_ONLY_MAX_M:
        torch.testing.assert_close(fp8_block_linear(xr, w, ws, (128, 128)), want_wo, rtol=1e-5, atol=1e-5)
    if m == 1:  # from DEQUANT_MIN_M rows: the weight dequantized by the kernel, then a dense product
        wd = fp8_kernels.fp8_block_dequantize(w, ws, (128, 128), torch.float32)
        assert torch.equal(wd, w.float() * ws.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k])
        xl = torch.randn(fp8_kernels.DEQUANT_MIN_M, k, generator=g)
        want_l = weight_only_reference(xl, w, ws, (128, 128))
        torch.testing.assert_close(fp8_block_linear(xl, w, ws, (128, 128)), want_l, rtol=1e-5, atol=1e-5)


def test_cli_refusal_is_one_line(base, tmp_path):
    from tests.test_cli_errors import cli, error_lines

    folder = with_quant_config(base, str(tmp_path / "m"), {"quant_method": "gptq", "bits": 3, "group_size": 128})
    proc = cli("generate", "--model", folder, "hi")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert error_lines(proc) == [
        "novainfer generate: error: quantization_config.bits=3 (gptq): only 4-bit weights are implemented"
    ], proc.stderr


def test_start_up_probe_refuses_wrong_kernels():
    """The CUDA start-up probe (here its INT4 half under the interpreter) passes right kernels, refuses wrong ones."""
    from novainfer.layers.quantization.int4 import check_int4_kernels
    from novainfer.layers.quantization.prequantized import probe_kernels

    check_int4_kernels(torch.device("cpu"), 32, torch.float32)
    want = torch.randn(4, 8)
    probe_kernels("INT4", [(want + 1e-4 * torch.randn(4, 8), want)], 2e-2)
    with pytest.raises(ValueError, match="INT4: the GPU kernels give wrong results on this device"):
        probe_kernels("INT4", [(want.flip(0), want)], 2e-2)
    with pytest.raises(ValueError, match="wrong results"):
        probe_kernels("INT4", [(torch.full((4, 8), float("nan")), want)], 2e-2)


def test_gpu_kernels_compile_for_hopper_with_vector_weight_loads():
    """What the CPU interpreter cannot show: the kernels compile for sm_90 (tests/sm90_ptx.py, in a process without
    the interpreter), the GEMVs read their weights in 16-byte vectors and unpack INT4 without int-to-float
    conversions, the GEMM runs on wgmma with the dequantized weight as its register operand (out^T = W x^T) and its
    split-K adds atomically."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "tests", "sm90_ptx.py")], env=env, capture_output=True, text=True, cwd=root
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = json.loads(proc.stdout.splitlines()[-1])
    assert "v4.b32" in ptx["int4_gemv"] and "cvt.rn.f32.s32" not in ptx["int4_gemv"]
    assert "ld.global.L1::evict_first.L2::cache_hint.v4.b32" in ptx["fp8_gemv"]
    gemm = ptx["int4_gemm_split"]
    assert "wgmma.mma_async" in gemm and ("red.global" in gemm or "atom.global" in gemm)
    assert re.search(r"wgmma\.mma_async\S* \{[^}]*\}, \{%r", gemm)  # A from registers, not a shared-memory descriptor
    fp8 = ptx["fp8_gemm_split"]  # float8 wgmma; the split's partials are plain stores (summed by a second kernel)
    assert "wgmma.mma_async.sync.aligned" in fp8 and ".e4m3.e4m3" in fp8 and "atom.global" not in fp8
