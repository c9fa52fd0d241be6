"""The panel layout of the CPU kernels' weights (kernels/cpu/panel_layout.py, csrc/panel_cpu.h): exact
round trips from and to rows, the byte order the C header documents, and fused weights stacked from whole
panels or through rows giving the same weight."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from novainfer.kernels.cpu import library, panel_layout, qgemm
from novainfer.kernels.cpu.repack import merge_rows, repack
from tests.test_quantized_cpu import random_blocks

RNG = np.random.default_rng(3)


@pytest.mark.parametrize("n", [1, 16, 37])
def test_round_trips_and_the_documented_byte_order(n):
    k = 96
    q4 = RNG.integers(0, 256, (n, k // 2), dtype=np.uint8)
    p4 = panel_layout.quants_to_panels("q4", q4, fast=False)
    assert p4.shape == (panel_layout.num_panels(n), 8 * k)
    assert np.array_equal(panel_layout.quants_to_rows("q4", p4, n, k), q4)
    vals = panel_layout.q4_values(q4)
    q8 = RNG.integers(-128, 128, (n, k), dtype=np.int8)
    p8 = panel_layout.quants_to_panels("q8", q8, fast=False)
    assert np.array_equal(panel_layout.quants_to_rows("q8", p8, n, k), q8)
    q6 = RNG.integers(-32, 32, (n, k), dtype=np.int8)
    p6 = panel_layout.quants_to_panels("q6", q6, fast=False)
    assert p6.shape == (panel_layout.num_panels(n), 12 * k) and p6.dtype == np.uint8
    assert np.array_equal(panel_layout.quants_to_rows("q6", p6, n, k), q6)
    for row in range(n):
        panel, r = divmod(row, 16)
        h, i = divmod(r, 8)
        for e in range(k):
            lane = 2 * i + e % 2  # k-pair vector lane of this row and element
            t = 2 * ((e // 2) % 2) + h  # q4: nibble t of the lane's uint16 in the 32 bytes of 4 elements
            u = int(p4[panel].view(np.uint16)[(e // 4) * 16 + lane])
            assert (u >> (4 * t)) & 15 == vals[row, e]
            assert p8[panel][(e // 2) * 32 + 2 * lane + h] == q8[row, e]  # q8: byte h of the lane
            blk, c = p6[panel][(e // 8) * 96 :].astype(int), (e // 4) % 2  # q6: q4's 64 bytes, then 32 of top bits
            low = (blk[32 * c + 2 * lane] | blk[32 * c + 2 * lane + 1] << 8) >> (4 * t) & 15
            top = blk[64 + 16 * c + lane] >> (2 * t) & 3  # signed: 2, 3 are -2, -1
            assert low + 16 * (top - 4 if top >= 2 else top) == q6[row, e]
    s = RNG.standard_normal((n, k // 32)).astype(np.float32)
    assert np.array_equal(panel_layout.groups_to_rows(panel_layout.groups_to_panels(s), n), s)


@pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA and a C compiler")
@pytest.mark.parametrize("n,k", [(1, 32), (37, 96), (48, 64)])
def test_c_repack_equals_the_numpy_reference(n, k):
    q4 = RNG.integers(0, 256, (n, k // 2), dtype=np.uint8)
    q8 = RNG.integers(-128, 128, (n, k), dtype=np.int8)
    q6 = RNG.integers(-32, 32, (n, k), dtype=np.int8)  # (C for the low nibbles, numpy for the high bits)
    for kind, q in (("q4", q4), ("q8", q8), ("q6", q6)):
        fast, ref = panel_layout.quants_to_panels(kind, q), panel_layout.quants_to_panels(kind, q, fast=False)
        assert fast.dtype == ref.dtype and np.array_equal(fast, ref), kind


@pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA and a C compiler")
def test_merged_panels_equal_merged_rows_and_padding_rows_stay_zero():
    aligned = [repack(random_blocks(T.Q4_1, n, 128), T.Q4_1, (n, 128)) for n in (32, 16)]
    odd = [repack(random_blocks(T.Q4_1, n, 128), T.Q4_1, (n, 128)) for n in (20, 13)]
    for parts in (aligned, odd):
        merged = merge_rows(parts)
        assert torch.equal(merged.dequantize(), torch.cat([p.dequantize() for p in parts]))
        assert torch.equal(qgemm.dequantize(merged), merged.dequantize())
    merged = merge_rows(odd)  # 33 rows: the last panel holds one row and 15 zero rows
    assert merged.qweight.shape[0] == 3 and not merged.scales[-1, :].view(-1, 16)[:, 1:].any()
    assert not panel_layout.quants_to_rows("q4", merged.qweight.numpy(), 48, 128)[33:].any()
    x = torch.randn(5, 128)
    assert torch.equal(qgemm.quant_gemm(x, merged)[:, :20], qgemm.quant_gemm(x, odd[0]))
