"""The many-row (panel) quantized GEMM of csrc/qgemm_panel_cpu.c: against dequantize-then-matmul, bit-identical
to the few-row kernel (the same int16 activations and the same float operations per output, so a row's bits do
not depend on which kernel its batch picks), row results independent of the batch and the thread count, and
the row count from which the GEMM entry points switch to it. Each GGUF format's accuracy bound at 9 and 17
rows (through this kernel) is in test_quantized_cpu.py. Both kernels' AVX-512 VNNI tiles (csrc/qgemm_avx512.c,
the default where the CPU has them) give the same bits as their AVX2 tiles."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from novainfer.kernels.cpu import library, qgemm
from novainfer.kernels.cpu.repack import repack
from tests.test_quantized_cpu import random_blocks

pytestmark = pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA and a C compiler")


@pytest.fixture
def few_row_kernel():
    """The GEMM entry points without the hand-over to the panel kernel, restored after the test."""
    qgemm.set_panel_min_rows(2**31 - 1)
    yield
    qgemm.set_panel_min_rows(qgemm.PANEL_MIN_ROWS)


# K = 576: 18 groups, past the last multiple of 8 (the scale transposes' tail); K-quants come in 256s
@pytest.mark.parametrize(
    "qtype,k",
    [(T.Q4_1, 512), (T.Q4_1, 576), (T.Q4_0, 576), (T.Q8_0, 512), (T.Q8_0, 576), (T.Q5_K, 512), (T.Q6_K, 512)],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_panel_matches_dequantize_then_matmul_and_the_few_row_kernel_bit_for_bit(qtype, k, few_row_kernel):
    n = 37  # a partial panel of 16 outputs and a partial few-row tile of 8; several groups (Q6_K: groups of 16)
    w = repack(random_blocks(qtype, n, k), qtype, (n, k))
    ref_w = w.dequantize().double()
    for m in (1, 2, 3, 5, 8, 13, 70):  # the few-row tiles' edges (3 rows), the panel's (4 rows) and past them
        x = torch.randn(m, k) * torch.linspace(0.1, 3, k)
        ref = x.double() @ ref_w.T
        panel = qgemm.quant_gemm(x, w, panel=True)
        assert (panel.double() - ref).norm() < 1e-4 * ref.norm()  # int16 activations: ~1e-5 measured
        assert torch.equal(qgemm.quant_gemm(x, w), panel), f"M={m}"


def test_panel_rows_do_not_depend_on_the_batch_or_threads():
    w = repack(random_blocks(T.Q4_1, 100, 256), T.Q4_1, (100, 256))
    m = qgemm.PANEL_MIN_ROWS + 6
    x = torch.randn(m, 256)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = qgemm.quant_gemm(x, w, panel=True)
        torch.set_num_threads(1)
        assert torch.equal(qgemm.quant_gemm(x, w, panel=True), batch)
        for r in (0, 3, m - 1):  # a row alone, as the first row of a tile, as the last
            assert torch.equal(qgemm.quant_gemm(x[r : r + 1], w, panel=True)[0], batch[r])
            s = min(r, 6)  # in PANEL_MIN_ROWS rows, which the entry point hands to the panel kernel
            assert torch.equal(qgemm.quant_gemm(x[s : s + qgemm.PANEL_MIN_ROWS], w)[r - s], batch[r])
    finally:
        torch.set_num_threads(prev)


def test_panel_min_rows_switches_the_kernel_and_rejects_nonsense(few_row_kernel):
    w = repack(random_blocks(T.Q4_1, 48, 256), T.Q4_1, (48, 256))
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32))
    lib = library.library()
    calls = lib.panel_gemm_calls()
    few = qgemm.quant_gemm(x, w)
    assert lib.panel_gemm_calls() == calls
    qgemm.set_panel_min_rows(8)
    assert torch.equal(qgemm.quant_gemm(x, w), few)  # the other kernel, the same bits
    assert lib.panel_gemm_calls() == calls + 1
    with pytest.raises(ValueError, match="panel rows"):
        qgemm.set_panel_min_rows(0)


def _tiles_or_skip(isa: str, missing: str):
    """Skips unless this CPU runs the given tiles; restores the default ("auto") after the test."""
    if qgemm.set_gemm_isa(isa) != isa:
        qgemm.set_gemm_isa("auto")
        pytest.skip(missing)
    yield
    qgemm.set_gemm_isa("auto")


@pytest.fixture
def avx2_and_avx512():
    yield from _tiles_or_skip("avx512", "this CPU has no AVX-512 VNNI")


@pytest.mark.parametrize(
    "qtype,k", [(T.Q4_1, 576), (T.Q4_0, 512), (T.Q8_0, 576), (T.Q6_K, 512)], ids=lambda v: getattr(v, "name", str(v))
)
def test_avx512_tiles_give_the_avx2_tiles_bits(qtype, k, avx2_and_avx512, few_row_kernel):
    n = 37  # a partial last panel (a masked store)
    w = repack(random_blocks(qtype, n, k), qtype, (n, k))
    # panel kernel: 12 rows are one full AVX-512 tile; 1-11 and past 12 partial tiles of 1, 2 and 3 groups of 4
    # rows. Few-row kernel: tiles of 4 rows, partial at 1-3 and 5.
    for m in (1, 3, 4, 5, 9, 12, 13, 16, 27):
        x = torch.randn(m, k) * torch.linspace(0.1, 3, k)
        for panel in (True, False):
            assert qgemm.set_gemm_isa("avx512") == "avx512"
            wide = qgemm.quant_gemm(x, w, panel=panel)
            assert qgemm.set_gemm_isa("avx2") == "avx2"
            assert torch.equal(qgemm.quant_gemm(x, w, panel=panel), wide), f"M={m}, panel={panel}"


@pytest.fixture
def amx():
    yield from _tiles_or_skip("amx", "this CPU has no AMX-INT8 (or Linux does not grant its tile state)")


@pytest.mark.parametrize(
    "qtype,k,n",
    [(T.Q4_K, 512, 37), (T.Q4_1, 576, 300), (T.Q8_0, 576, 37), (T.Q5_K, 256, 37), (T.MXFP4, 512, 37)],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_amx_tiles_give_the_avx512_tiles_bits(qtype, k, n, amx):
    """The AMX tiles split each int16 activation into a high and a low byte; the sums and their scaling must be
    the VNNI tiles' to the bit: on partial tiles of 16 rows, a partial last panel, chunks of several panels (n=300:
    19 panels over two threads) and zero points (Q4_1, Q4_K) or none (Q8_0, MXFP4)."""
    w = repack(random_blocks(qtype, n, k), qtype, (n, k))
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for m in (32, 33, 47, 70):  # from 32 rows the panel kernel takes AMX; 16-row tiles, full and partial
            x = torch.randn(m, k) * torch.linspace(0.1, 3, k)
            x[m // 2, : k // 2] *= 1e4  # rows whose int16 steps differ by far: high bytes in use everywhere
            assert qgemm.set_gemm_isa("amx") == "amx"
            tiles = qgemm.quant_gemm(x, w, panel=True)
            assert qgemm.set_gemm_isa("avx512") == "avx512"
            assert torch.equal(qgemm.quant_gemm(x, w, panel=True), tiles), f"M={m}"
    finally:
        torch.set_num_threads(prev)


def test_panel_isa_rejects_nonsense():
    with pytest.raises(ValueError, match="GEMM ISA"):
        qgemm.set_gemm_isa("sse2")
    assert qgemm.set_gemm_isa("auto") in ("avx2", "avx512", "amx")
