"""The K-quants' compact forms (kernels/cpu/repack.py): scales as int8 multipliers per group of a float16 factor per
256 weights (SCALE_SUPER), Q6_K's codes as 6-bit planes (q6). Every C kernel that reads them (few-row and panel
GEMMs on both ISAs, dequantize, the C decoder stack) gives, to the bit, what it gives with the form the repack
stored before: float32 scales (d * sc and -dmin * m per group, formed in numpy float32), Q6_K in the int8 container."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from novainfer.kernels.cpu import library, qgemm
from novainfer.kernels.cpu.repack import LAYOUT, SCALE_F32, SCALE_SUPER, PackedWeight, _k_scales, merge_rows, repack
from tests.test_quantized_cpu import random_blocks

pytestmark = pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA+F16C and a C compiler")
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]
BITS = {T.Q4_K: 4.625, T.Q5_K: 8.625, T.Q6_K: 6.5625}  # per weight in memory: quants + multipliers + factors
# float16 factors that stress the products: the largest, a subnormal, the smallest subnormal, negative, zero
EDGE_FACTORS = np.array([65504.0, 6.1e-5, 6e-8, -3.5, 0.0], np.float16)


def k_blocks(qtype: T, n: int, k: int, seed: int) -> np.ndarray:
    """Random GGUF blocks whose first super-blocks carry EDGE_FACTORS as d (and dmin)."""
    b = random_blocks(qtype, n, k, np.random.default_rng(seed)).reshape(n, k // 256, -1).copy()
    offsets = [208] if qtype == T.Q6_K else [0, 2]  # d (Q6_K: at the end), else d and dmin
    for i, v in enumerate(EDGE_FACTORS):
        for off in offsets:
            b[i % n, i % (k // 256), off : off + 2] = np.frombuffer(v.tobytes(), np.uint8)
    return b.reshape(n, -1)


def float32_reference(blocks: np.ndarray, qtype: T, w: PackedWeight) -> PackedWeight:
    """w's quants as the repack stored them before SCALE_SUPER and q6 (Q6_K in the int8 container), with the
    float32 scales and zeros of its very formula."""
    n, k = w.shape
    b = blocks.reshape(n, k // 256, -1)

    def f16(at: int) -> np.ndarray:
        return np.ascontiguousarray(b[..., at : at + 2]).view(np.float16).astype(np.float32)  # [n, blocks, 1]

    if qtype == T.Q6_K:
        scales, zeros = (f16(208) * b[..., 192:208].view(np.int8).astype(np.float32)).reshape(n, -1), None
    else:
        sc, mn = (v.astype(np.float32) for v in _k_scales(b[..., 4:16]))
        scales, zeros = (f16(0) * sc).reshape(n, -1), torch.from_numpy((-f16(2) * mn).reshape(n, -1))
    kind, group, _ = LAYOUT[qtype]
    kind = "q8" if kind == "q6" else kind  # (both take int8 rows)
    return PackedWeight.from_rows(kind, w.rows()[0], torch.from_numpy(scales), zeros, group, w.shape)


def old_form(w: PackedWeight) -> PackedWeight:
    """w as the repack stored it before SCALE_SUPER and q6: float32 scales, Q6_K in the int8 container."""
    w32 = w.float32_scales()
    if w.kind != "q6":
        return w32
    q, scales, zeros = w32.rows()
    return PackedWeight.from_rows("q8", q, scales, zeros, w.group, w.shape)


@pytest.fixture(params=["avx2", "avx512"])
def isa(request):
    used = qgemm.set_gemm_isa(request.param)
    if used != request.param:
        pytest.skip(f"this CPU has no {request.param} tiles")
    yield used
    qgemm.set_gemm_isa("auto")


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_compact_scales_are_exact_and_smaller(qtype):
    n, k = 48, 768  # whole panels, 3 super-blocks
    blocks = k_blocks(qtype, n, k, seed=int(qtype))
    w = repack(blocks, qtype, (n, k))
    ref = float32_reference(blocks, qtype, w)
    assert w.scale_format == SCALE_SUPER and ref.scale_format == SCALE_F32
    old = old_form(w)  # the products formed in float32 from the compact store
    assert (old.kind, old.scales.dtype) == (ref.kind, torch.float32) and torch.equal(old.qweight, ref.qweight)
    assert torch.equal(old.scales, ref.scales) and (w.zeros is None or torch.equal(old.zeros, ref.zeros))
    gguf_ref = torch.from_numpy(dequantize(blocks, qtype).reshape(n, k).astype(np.float32))
    assert torch.equal(w.dequantize(), gguf_ref)
    assert w.nbytes() * 8 == BITS[qtype] * n * k


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_every_kernel_gives_the_float32_scales_bits(qtype, isa):
    n, k = 37, 768  # a last panel of 5 rows; 3 super-blocks
    blocks = k_blocks(qtype, n, k, seed=10 + int(qtype))
    w = repack(blocks, qtype, (n, k))
    ref = float32_reference(blocks, qtype, w)
    assert w.scale_format == SCALE_SUPER and (w.kind == "q6") == (qtype == T.Q6_K) and ref.kind != "q6"
    assert torch.equal(qgemm.dequantize(w), qgemm.dequantize(ref))
    picked = torch.tensor([36, 0, 4, 4, 17])  # the embedding lookup's rows
    assert torch.equal(qgemm.dequantize(w, picked), qgemm.dequantize(ref, picked))
    xs = torch.from_numpy(np.random.default_rng(3).standard_normal((40, k)).astype(np.float32))
    dense = ref.dequantize().double()
    for m in (1, 2, 3, 5, 16, 40):  # decode, the few-row tiles and their tails, the panel kernel
        x = xs[:m]
        y = qgemm.quant_gemm(x, w)
        assert torch.equal(y, qgemm.quant_gemm(x, ref)), f"M={m}"
        assert torch.equal(qgemm.quant_gemm(x, w, panel=True), qgemm.quant_gemm(x, ref, panel=True)), f"M={m}"
        want = x.double() @ dense.T
        assert (y.double() - want).norm() <= 1e-3 * want.norm()  # a GEMM, not two equal wrong answers


def test_merged_mixed_k_quants_keep_compact_scales(isa):
    """A Q4_K q/k with a Q6_K v (Q4_K_M's attention): the int8 container, groups of 16, SCALE_SUPER kept."""
    parts = [repack(random_blocks(t, n, 512), t, (n, 512)) for t, n in ((T.Q4_K, 32), (T.Q4_K, 16), (T.Q6_K, 16))]
    merged = merge_rows(parts)
    assert (merged.kind, merged.group, merged.scale_format) == ("q8", 16, SCALE_SUPER)
    ref = merge_rows([old_form(p) for p in parts])
    assert ref.scale_format == SCALE_F32
    assert torch.equal(merged.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert torch.equal(qgemm.dequantize(merged), qgemm.dequantize(ref))
    xs = torch.from_numpy(np.random.default_rng(4).standard_normal((20, 512)).astype(np.float32))
    for m in (1, 4, 20):
        assert torch.equal(qgemm.quant_gemm(xs[:m], merged), qgemm.quant_gemm(xs[:m], ref)), f"M={m}"
    odd = merge_rows([repack(random_blocks(T.Q4_K, 20, 512), T.Q4_K, (20, 512)), parts[2]])  # not whole panels
    assert odd.scale_format == SCALE_F32  # through the row layout: float32 values, still exact
    assert torch.equal(odd.dequantize()[20:], parts[2].dequantize())


def test_decoder_stack_gives_the_float32_scales_bits(tmp_path, monkeypatch):
    from novainfer.layers.quantization import gguf_cpu
    from tests.test_cpu_decoder_stack import PROMPT_LENS, TABLES, forward, load, prefill, step_meta, write_gguf

    path = write_gguf(tmp_path / "tiny.gguf", "llama", 300)  # Q4_K, Q5_K and Q6_K layers among others
    outs = []
    for compact in (True, False):
        if not compact:
            real = gguf_cpu.repack
            monkeypatch.setattr(gguf_cpu, "repack", lambda *a: old_form(real(*a)))
        model = load(path)
        packed = [m.weight.packed for m in model.modules() if getattr(getattr(m, "weight", None), "packed", None)]
        assert any(p.scale_format == SCALE_SUPER for p in packed) == compact
        assert any(p.kind == "q6" for p in packed) == compact
        prefill(model, 300)
        meta, pos = step_meta(TABLES, PROMPT_LENS, [1] * len(PROMPT_LENS))
        outs.append(forward(model, [3, 1, 4, 1], pos, meta, stack=True))
    assert torch.equal(outs[0], outs[1])
