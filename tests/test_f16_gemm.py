"""GGUF F16 and BF16 weights kept as stored on the CPU (kernels/cpu/repack.py kinds f16 / bf16, csrc/f16gemm_cpu.c):
the values are the file's own (gguf's dequantization, to the bit); the AVX-512 and AVX2 kernels give the scalar C
reference's bits at every row count, tile edge and thread count; both are the float32 product to summation order;
16-bit weights stack only with their own kind, and a layer that mixes them with quantized shards loads dense."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from novainfer.kernels.cpu import library, qgemm
from novainfer.kernels.cpu.repack import merge_rows, mergeable, repack
from novainfer.layers.linear import MergedColumnParallelLinear
from novainfer.layers.quantization import building_with
from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig, GGUFCPULinearMethod, GGUFQuantTensor
from tests.test_quantized_cpu import random_blocks

pytestmark = pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA+F16C and a C compiler")
TYPES = {T.F16: torch.float16, T.BF16: torch.bfloat16}
ROWS = [1, 2, 3, 4, 5, 7, 9, 17]  # the 4-row (AVX-512) and 2-row (AVX2) tiles' edges
N = 75  # leftover weight rows past the tiles, uneven chunks over the threads


def raw_rows(qtype: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF bytes [n, 2k] of random 16-bit weights of mixed magnitudes (F16 subnormals, zeros, -0 included)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 10.0 ** torch.randint(-6, 3, (n, k), generator=g)
    w = w.to(TYPES[qtype])
    w[0, :3] = torch.tensor([0.0, -0.0, 1e-7]).to(TYPES[qtype])
    return w.view(torch.int16).numpy().view(np.uint8).reshape(n, 2 * k)


@pytest.mark.parametrize("qtype", list(TYPES), ids=lambda t: t.name)
def test_values_and_embedding_rows_are_the_files(qtype):
    n, k = 20, 40
    raw = raw_rows(qtype, n, k)
    w = repack(raw, qtype, (n, k))
    assert w.kind == {T.F16: "f16", T.BF16: "bf16"}[qtype] and w.nbytes() == raw.nbytes
    want = torch.from_numpy(dequantize(raw, qtype).reshape(n, k).astype(np.float32))
    assert torch.equal(w.dequantize(), want)
    ids = torch.tensor([[3, 0], [19, 3]])
    assert torch.equal(qgemm.dequantize(w, ids), want[ids.reshape(-1)])


@pytest.mark.parametrize("qtype", list(TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("k", [64, 100, 7])  # whole 16-lane steps, a tail, a tail alone
def test_kernels_give_the_scalar_references_bits_and_the_float32_product(qtype, k):
    w = repack(raw_rows(qtype, N, k), qtype, (N, k))
    wf = w.dequantize().double()
    x = torch.randn(max(ROWS), k) * torch.linspace(0.1, 3, k)
    for m in ROWS:
        xm = x[:m].contiguous()
        ref = qgemm.f16_gemm(xm, w, reference=True)
        exact = xm.double() @ wf.T
        bound = 2 * k * torch.finfo(torch.float32).eps * (xm.abs().double() @ wf.abs().T)
        assert ((ref.double() - exact).abs() <= bound).all(), f"M={m}"
        for isa in ("avx2", "avx512"):
            try:
                qgemm.set_gemm_isa(isa)
                assert torch.equal(qgemm.quant_gemm(xm, w), ref), f"{isa} M={m}"
            finally:
                qgemm.set_gemm_isa("auto")


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_gives_the_same_bits_alone_or_in_any_batch(threads):
    w = repack(raw_rows(T.F16, N, 96), T.F16, (N, 96))
    x = torch.randn(max(ROWS), 96)
    library.set_num_threads(threads)
    try:
        alone = torch.cat([qgemm.quant_gemm(x[i : i + 1].contiguous(), w) for i in range(len(x))])
        for m in ROWS:
            for start in {0, len(x) - m}:
                assert torch.equal(qgemm.quant_gemm(x[start : start + m].contiguous(), w), alone[start : start + m])
    finally:
        library.set_num_threads(None)


def _layer(shards: dict, sizes: list[int], k: int) -> MergedColumnParallelLinear:
    """A fused linear of the GGUF CPU method loaded from GGUFQuantTensor shards (shard id -> (qtype, raw))."""
    with building_with(GGUFCPUConfig()):
        layer = MergedColumnParallelLinear(k, sizes, bias=False)
    for shard_id, (qtype, raw) in shards.items():
        t = GGUFQuantTensor(f"s{shard_id}", raw, qtype, (sizes[shard_id], k))
        layer.weight.weight_loader(layer.weight, t, shard_id)
    return layer


def test_16_bit_shards_stack_with_their_own_kind_only():
    k = 64
    f16 = [(T.F16, raw_rows(T.F16, 16, k, seed)) for seed in (1, 2)]
    layer = _layer(dict(enumerate(f16)), [16, 16], k)
    packed = layer.weight.packed
    assert packed.kind == "f16" and packed.shape == (32, k)
    want = torch.cat([repack(r, t, (16, k)).dequantize() for t, r in f16])
    assert torch.equal(packed.dequantize(), want)
    assert mergeable([T.Q8_0, T.Q4_K]) and not mergeable([T.F16, T.Q8_0]) and not mergeable([T.F16, T.BF16])
    with pytest.raises(ValueError):
        merge_rows([repack(f16[0][1], T.F16, (16, k)), repack(raw_rows(T.BF16, 16, k), T.BF16, (16, k))])
    # an F16 shard beside a Q8_0 one: no exact common kind, so the layer loads dense (as it did before)
    q8 = random_blocks(T.Q8_0, 16, k)
    mixed = _layer({0: f16[0], 1: (T.Q8_0, q8)}, [16, 16], k)
    assert mixed.weight.packed is None
    want = torch.cat([want[:16], torch.from_numpy(dequantize(q8, T.Q8_0).reshape(16, k).astype(np.float32))])
    assert torch.equal(mixed.weight.data, want)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    wf = packed.dequantize().double()
    # the float32 product to summation order: the weights span 1e-6..1e3, so outputs may cancel far below their terms
    bound = 2 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ wf.abs().T)
    assert ((layer(x).double() - x.double() @ wf.T).abs() <= bound).all()
    assert isinstance(layer.quant_method, GGUFCPULinearMethod)
