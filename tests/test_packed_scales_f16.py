"""float16 scales and zeros in PackedWeight (kernels/cpu/repack.py): chosen per tensor only where every
value round-trips exactly (the K-quants' own format: test_packed_scales_super.py), and every C kernel that reads them (few-row GEMM, panel GEMM, dequantize, the decoder
stack) gives the same bits as with the same values in float32."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from novainfer.kernels.cpu import library, qgemm, repack as gguf_repack
from novainfer.kernels.cpu.repack import SCALE_F16, SCALE_F32, PackedWeight, merge_rows, repack
from tests.test_quantized_cpu import random_blocks

pytestmark = pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA+F16C and a C compiler")
RNG = np.random.default_rng(7)


def random_packed(kind: str, group: int, zeros: bool, n: int, k: int) -> PackedWeight:
    """Random quants with float16 scales/zeros of mixed magnitudes (subnormals included)."""
    q = (
        torch.from_numpy(RNG.integers(0, 256, (n, k // 2), dtype=np.uint8))
        if kind == "q4"
        else torch.from_numpy(RNG.integers(-128, 128, (n, k), dtype=np.int8))
    )

    def f16() -> torch.Tensor:
        v = RNG.standard_normal((n, k // group)) * 10.0 ** RNG.integers(-7, 3, (n, k // group))
        return torch.from_numpy(v.astype(np.float16))

    return PackedWeight.from_rows(kind, q, f16(), f16() if zeros else None, group, (n, k))


def _keep_float32(scales: np.ndarray, zeros: np.ndarray | None) -> tuple:
    """repack's scales and zeros as float32, always (the reference the float16 ones must equal)."""
    return scales, zeros


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda v: v.name)
def test_repack_keeps_float16_where_exact(qtype, monkeypatch):
    blocks = random_blocks(qtype, 9, 256)
    w = repack(blocks, qtype, (9, 256))
    monkeypatch.setattr(gguf_repack, "_narrow", _keep_float32)
    w32 = repack(blocks, qtype, (9, 256))
    assert w32.scales.dtype == torch.float32
    assert w.scale_format == SCALE_F16 and w32.scale_format == SCALE_F32
    assert w.zeros is None or w.zeros.dtype == w.scales.dtype
    ref = torch.from_numpy(dequantize(blocks, qtype).reshape(9, 256).astype(np.float32))
    assert torch.equal(w.dequantize(), ref) and torch.equal(qgemm.dequantize(w), w32.dequantize())
    assert w.nbytes() < w32.nbytes()


def test_values_float16_cannot_hold_stay_float32():
    blocks = random_blocks(T.Q4_0, 4, 64).reshape(4, 2, 18).copy()
    blocks[1, 0, 0:2] = np.array([40000.0], np.float16).view(np.uint8)  # -8d = -320000: past float16's range
    w = repack(blocks.reshape(4, -1), T.Q4_0, (4, 64))
    assert w.scales.dtype == w.zeros.dtype == torch.float32
    assert w.rows()[2][1, 0] == -320000.0


def test_merge_rows_promotes_mixed_dtypes_exactly():
    a, b = random_packed("q4", 32, True, 5, 64), random_packed("q4", 32, True, 3, 64).float32_scales()
    merged = merge_rows([a, b])
    assert merged.scales.dtype == merged.zeros.dtype == torch.float32
    assert torch.equal(merged.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    mixed = merge_rows([a, random_packed("q8", 16, False, 4, 64)])  # kinds differ: the int8 container, float16 kept
    assert mixed.scale_format == SCALE_F16 and torch.equal(mixed.dequantize()[:5], a.dequantize())
    with pytest.raises(ValueError, match="dtype"):
        PackedWeight("q4", a.qweight, a.scales, a.zeros.float(), 32, a.shape)


# q4 with zeros; int8 groups of 32 without / with zeros; int8 groups of 16. K = 288: 9 groups of 32 (a tail past 8)
LAYOUTS = [("q4", 32, True), ("q8", 32, False), ("q8", 32, True), ("q8", 16, False)]


@pytest.mark.parametrize("kind, group, zeros", LAYOUTS, ids=lambda v: str(v))
def test_every_kernel_gives_the_float32_scales_bits(kind, group, zeros):
    w16 = random_packed(kind, group, zeros, 37, 288)  # 37 rows: tails past the 4-row tiles and 16-row panels
    w32 = w16.float32_scales()
    assert torch.equal(qgemm.dequantize(w16), qgemm.dequantize(w32))
    assert torch.equal(qgemm.dequantize(w16), w32.dequantize())
    picked = torch.tensor([36, 0, 5, 5])  # the embedding lookup's row selection
    assert torch.equal(qgemm.dequantize(w16, picked), w32.dequantize()[picked])
    with pytest.raises(IndexError, match="row ids"):
        qgemm.dequantize(w16, torch.tensor([37]))
    xs = torch.from_numpy(RNG.standard_normal((70, 288)).astype(np.float32))
    ys = {}
    for m in (1, 2, 3, 5, 64, 70):  # few-row kernel (weights unpacked in registers up to 3 rows) and panel kernel
        x = xs[:m]
        ys[m] = y = qgemm.quant_gemm(x, w16)
        assert torch.equal(y, qgemm.quant_gemm(x, w32)), f"M={m}"
        assert torch.equal(qgemm.quant_gemm(x, w16, panel=True), qgemm.quant_gemm(x, w32, panel=True))
        ref = x.double() @ w32.dequantize().double().T
        assert (y.double() - ref).norm() <= 1e-3 * ref.norm()  # a GEMM, not just two equal wrong answers
    for m in (1, 2, 3):  # the in-register tiles give the unpacked tiles' bits
        assert torch.equal(ys[m], ys[5][:m]), f"M={m}"


def test_decoder_stack_gives_the_float32_scales_bits(tmp_path, monkeypatch):
    from tests.test_cpu_decoder_stack import TABLES, PROMPT_LENS, forward, load, prefill, step_meta, write_gguf

    path = write_gguf(tmp_path / "tiny.gguf", "llama", 300)
    outs = []
    for f16 in (True, False):
        if not f16:
            monkeypatch.setattr(gguf_repack, "_narrow", _keep_float32)
        model = load(path)
        packed = [m.weight.packed for m in model.modules() if getattr(getattr(m, "weight", None), "packed", None)]
        assert any(p.scale_format == SCALE_F16 for p in packed) == f16
        prefill(model, 300)
        meta, pos = step_meta(TABLES, PROMPT_LENS, [1] * len(PROMPT_LENS))
        outs.append(forward(model, [3, 1, 4, 1], pos, meta, stack=True))
    assert torch.equal(outs[0], outs[1])
