"""MXFP4 experts kept in four bits: the format against transformers' own dequantization (convert_moe_packed_tensors)
and gguf-py's (GGUF type MXFP4), the C kernels against their scalar C reference (bit for bit) and the dequantized
torch product, the Triton kernel (TRITON_INTERPRET=1 on the CPU) against the torch reference, and a FusedMoE layer
with the method against the experts with transformers-dequantized weights."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from novainfer.distributed import TPGroup, set_tp_group
from novainfer.kernels.cpu import library
from novainfer.kernels.cpu.repack import mxfp4_from_hf, repack
from novainfer.layers.activation import SiluAndMul
from novainfer.layers.fused_moe import FusedMoE, fused_experts_torch, select_experts
from novainfer.layers.quantization import building_with
from novainfer.layers.quantization.mxfp4 import Mxfp4Config, dequantize_mxfp4, quantize_mxfp4
from novainfer.loader.gguf_gpt_oss import QUANTIZATION_CONFIG

E, H, INTER, TOP_K = 4, 96, 64, 2  # H: three blocks of 32, so a 64-wide K tile has a masked tail
GPT_OSS_QUANT = QUANTIZATION_CONFIG
needs_c = pytest.mark.skipif(not library.available(), reason="the C kernels do not build here")


def random_mxfp4(*shape: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks uint8 [*shape[:-1], K/32, 16] and scales [*shape[:-1], K/32] (exponents near 2^-4)."""
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    blocks = torch.randint(0, 256, (*lead, k // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(119, 128, (*lead, k // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def transformers_dense(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' dequantization, as [E, out, in] float32."""
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)


def test_quantizer_writes_llama_cpp_bytes_and_round_trips():
    """quantize_mxfp4 (which writes the tests' MXFP4 checkpoints) gives gguf-py's MXFP4 quantizer's bytes, and
    transformers dequantizes them back within e2m1's widest step (2 x the block's scale, at most amax / 2)."""
    from gguf.quants import quantize

    w = torch.randn(E, 40, 128, generator=torch.Generator().manual_seed(1)) * 0.3
    w[0, 0, :32] = 0  # an all-zero block
    blocks, scales = quantize_mxfp4(w)
    assert torch.equal(mxfp4_from_hf(blocks, scales), torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.MXFP4)))
    back = transformers_dense(blocks, scales)
    amax = w.view(E, 40, 4, 32).abs().amax(-1, keepdim=True)
    assert ((back - w).view(E, 40, 4, 32).abs() <= amax / 2).all()
    assert ((back - w).norm() / w.norm()).item() < 0.15


def test_format_matches_transformers_and_gguf():
    blocks, scales = random_mxfp4(E, 40, 128)
    want = transformers_dense(blocks, scales)
    assert torch.equal(dequantize_mxfp4(blocks, scales), want)
    ggml = mxfp4_from_hf(blocks, scales)  # GGUF's block_mxfp4 bytes: the same weights, llama.cpp's layout
    assert ggml.shape == (E, 40, 128 // 32 * 17)
    via_gguf = gguf_dequantize(ggml.numpy(), GGMLQuantizationType.MXFP4)
    assert torch.equal(torch.from_numpy(via_gguf).reshape(E, 40, 128), want)
    packed = repack(ggml[1].numpy(), GGMLQuantizationType.MXFP4, (40, 128))
    assert packed.e2m1 and packed.scales.dtype == torch.float16  # 4 bits a weight + a float16 scale per 32
    assert packed.qweight.nbytes == 48 * 128 // 2  # rows padded to whole panels of 16
    assert torch.equal(packed.dequantize(), want[1])


@needs_c
@pytest.mark.parametrize("rows", [1, 3, 20])  # the few-row kernel's tiles, and the panel kernel
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_cpu_kernel_matches_scalar_reference_and_dequantized_product(rows, isa):
    from novainfer.kernels.cpu import qgemm

    n, k = 40, 160
    blocks, scales = random_mxfp4(1, n, k, seed=rows)
    ggml = mxfp4_from_hf(blocks, scales)[0]
    packed = repack(ggml.numpy(), GGMLQuantizationType.MXFP4, (n, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    used = qgemm.set_gemm_isa(isa)
    try:
        y = qgemm.quant_gemm(x, packed)
        assert torch.equal(y, qgemm.quant_gemm(x, packed, panel=True))
        assert torch.equal(y, qgemm.mxfp4_gemm_ref(x, ggml)), used
        assert torch.equal(qgemm.dequantize(packed), transformers_dense(blocks, scales)[0])
    finally:
        qgemm.set_gemm_isa("auto")
    w = transformers_dense(blocks, scales)[0].double()
    # the kernels' activations: int16 per block of 32, step max|x| / 32767 (round to nearest even)
    amax = x.view(rows, k // 32, 32).abs().amax(-1, keepdim=True)
    step = torch.full_like(amax, 32767.0) / amax  # a true division (32767.0 / amax multiplies by a reciprocal)
    xq = torch.round(x.view(rows, k // 32, 32) * step).double() * (amax / 32767.0).double()
    same_rounding = xq.view(rows, k) @ w.T
    assert ((y.double() - same_rounding).abs() <= 1e-5 * same_rounding.abs() + 1e-6).all()
    exact = x.double() @ w.T
    assert ((y.double() - exact).norm() / exact.norm()).item() < 1e-4  # the int16 rounding alone


def moe_case(tokens: int, seed: int = 0):
    """HF-layout MXFP4 experts (gate_up interleaved), biases, activations and routing."""
    w13 = random_mxfp4(E, 2 * INTER, H, seed=seed)
    w2 = random_mxfp4(E, H, INTER, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    b13, b2 = torch.randn(E, 2 * INTER, generator=g), torch.randn(E, H, generator=g)
    x = torch.randn(tokens, H, generator=g)
    weights, ids = select_experts(torch.randn(tokens, E, generator=g), TOP_K, renormalize=True)
    return w13, w2, b13, b2, x, weights, ids


def dense_reference(w13, w2, b13, b2, x, weights, ids) -> torch.Tensor:
    """transformers-dequantized weights, gate/up de-interleaved to [gate; up], through the torch experts."""
    d13, d2 = transformers_dense(*w13), transformers_dense(*w2)
    d13 = torch.cat([d13[:, 0::2], d13[:, 1::2]], dim=1)
    b13 = torch.cat([b13[:, 0::2], b13[:, 1::2]], dim=1)
    return fused_experts_torch(x.double(), d13.double(), d2.double(), weights, ids, SiluAndMul(), b13, b2).float()


def build_layer(w13, w2, b13, b2) -> FusedMoE:
    with building_with(Mxfp4Config(GPT_OSS_QUANT, torch.device("cpu"))):
        layer = FusedMoE(E, TOP_K, H, INTER, renormalize=True)
    for name, t in zip(("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"), (*w13, *w2)):
        param = getattr(layer, name)
        param.weight_loader(param, t.float())  # the loader casts to the model's dtype: bytes survive
    layer.w13_bias = torch.cat([b13[:, 0::2], b13[:, 1::2]], dim=1)
    layer.w2_bias = b2
    return layer


@pytest.mark.parametrize("tokens", [1, 7])
def test_moe_layer_with_method_matches_dequantized_experts(tokens):
    w13, w2, b13, b2, x, weights, ids = moe_case(tokens)
    want = dense_reference(w13, w2, b13, b2, x, weights, ids)
    layer = build_layer(w13, w2, b13, b2)
    assert layer.w13_blocks.dtype == torch.uint8 and not hasattr(layer, "w13_weight")
    unpacked = layer.apply_routed(x, weights, ids)  # before repacking: the routed experts dequantized in torch
    assert ((unpacked - want).abs().max() / want.abs().max()).item() < 1e-5
    if library.available():
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.mxfp4_packed is not None and layer.w13_blocks.numel() == 0
        out = layer.apply_routed(x, weights, ids)
        assert ((out - want).norm() / want.norm()).item() < 1e-4  # int16 activations


def test_triton_kernel_matches_torch_reference():
    kernels = pytest.importorskip("novainfer.kernels.fused_moe_mxfp4")
    w13, w2, b13, b2, x, weights, ids = moe_case(9, seed=3)
    layer = build_layer(w13, w2, b13, b2)
    want = dense_reference(w13, w2, b13, b2, x, weights, ids)
    args = (layer.w13_blocks.flatten(-2), layer.w13_scales, layer.w2_blocks.flatten(-2), layer.w2_scales)
    out = kernels.fused_experts_mxfp4(x, *args, weights, ids, SiluAndMul(), layer.w13_bias, layer.w2_bias)
    assert ((out - want).norm() / want.norm()).item() < 1e-5


def test_tensor_parallel_shards_sum_to_the_whole():
    """Each rank keeps its slice of gate and of up (taken from the interleaved rows) and the matching blocks of
    down; with the down bias on one rank, the ranks' partial sums add up to the one-rank layer's output."""
    w13, w2, b13, b2, x, weights, ids = moe_case(5, seed=5)
    whole = build_layer(w13, w2, b13, b2).apply_routed(x, weights, ids)
    total = torch.zeros_like(whole)
    try:
        for rank in range(2):
            set_tp_group(TPGroup(rank, 2))
            layer = build_layer(w13, w2, b13, b2)
            gate, up = b13[:, 0::2].chunk(2, dim=1)[rank], b13[:, 1::2].chunk(2, dim=1)[rank]
            layer.w13_bias = torch.cat([gate, up], dim=1)
            layer.w2_bias = b2 if rank == 0 else torch.zeros_like(b2)
            total += layer.apply_routed(x, weights, ids)
    finally:
        set_tp_group(TPGroup())
    assert ((total - whole).abs().max() / whole.abs().max()).item() < 1e-5


def test_unsupported_variants_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="quantization_config.group_size"):
        Mxfp4Config({**GPT_OSS_QUANT, "group_size": 64}, torch.device("cpu"))
    with pytest.raises(ValueError, match="modules_to_not_convert does not name self_attn"):
        Mxfp4Config(
            {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head", "router", "embed_tokens"]},
            torch.device("cpu"),
        )
    for asked in ("fp8", "none"):  # MXFP4 experts stay in four bits: no other quantization, no dequantizing
        with pytest.raises(ValueError, match=f"quantization='{asked}'"):
            Mxfp4Config(GPT_OSS_QUANT, torch.device("cpu"), asked)
    with building_with(Mxfp4Config(GPT_OSS_QUANT, torch.device("cpu"))):
        with pytest.raises(ValueError, match="hidden_size divisible by 32"):
            FusedMoE(E, TOP_K, 48, INTER, renormalize=True)


def test_selector_picks_mxfp4_from_the_checkpoint_config():
    from types import SimpleNamespace

    from novainfer.layers.quantization.selector import get_quant_config

    mc = SimpleNamespace(
        hf_config=SimpleNamespace(quantization_config=dict(GPT_OSS_QUANT)), quantization=None, is_gguf=False, model="m"
    )
    assert isinstance(get_quant_config(mc, torch.device("cpu")), Mxfp4Config)


def test_dummy_load_format_draws_mxfp4_experts():
    from novainfer.loader.model_loader import initialize_dummy_weights

    with building_with(Mxfp4Config(GPT_OSS_QUANT, torch.device("cpu"))):
        layer = FusedMoE(E, TOP_K, H, INTER, renormalize=True)
    initialize_dummy_weights(layer)
    assert layer.w13_blocks.dtype == torch.uint8 and len(torch.unique(layer.w13_blocks)) > 200
    w = dequantize_mxfp4(layer.w2_blocks, layer.w2_scales)
    assert 0.01 < w.std().item() < 0.04 and torch.isfinite(w).all()


def test_gpu_check_script_runs_on_tiny_shapes(capsys):
    """tests/gpu/mxfp4_checks.py end to end on the CPU interpreter (its --tiny run), so it does not rot."""
    pytest.importorskip("novainfer.kernels.fused_moe_mxfp4")
    from tests.gpu.mxfp4_checks import run

    assert run(tiny=True)
    assert "tiny-a" in capsys.readouterr().out


def test_gguf_mxfp4_weights_merge_with_others_exactly():
    """A fused layer (q/k/v, gate/up) of GGUF MXFP4 parts, or of MXFP4 and Q8_0 parts, dequantizes to its parts."""
    import numpy as np
    from gguf.quants import quantize

    from novainfer.kernels.cpu.repack import merge_rows

    a_b, a_s = random_mxfp4(1, 24, 64, seed=1)  # 24 rows: not whole panels of 16, so the rows are re-laid
    b_b, b_s = random_mxfp4(1, 40, 64, seed=2)
    a = repack(mxfp4_from_hf(a_b, a_s)[0].numpy(), GGMLQuantizationType.MXFP4, (24, 64))
    b = repack(mxfp4_from_hf(b_b, b_s)[0].numpy(), GGMLQuantizationType.MXFP4, (40, 64))
    q8 = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    c = repack(quantize(q8, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0, (16, 64))
    want = [transformers_dense(a_b, a_s)[0], transformers_dense(b_b, b_s)[0], c.dequantize()]
    same = merge_rows([a, b])
    assert same.e2m1 and torch.equal(same.dequantize(), torch.cat(want[:2]))
    mixed = merge_rows([a, b, c])
    assert mixed.kind == "q8" and not mixed.e2m1 and torch.equal(mixed.dequantize(), torch.cat(want))
