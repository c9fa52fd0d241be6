"""The many-row (panel) quantized GEMM of csrc/qgemm_panel_cpu.c: against dequantize-then-matmul and the
few-row kernel (the same int16 activations), row results independent of the batch and the thread count, and
the row count from which the GEMM entry points switch to it. Each GGUF format's accuracy bound at 9 and 17
rows (through this kernel) is in test_quantized_cpu.py."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from novainfer.layers.quantization import cpu_kernels
from novainfer.layers.quantization.gguf_repack import repack
from tests.test_quantized_cpu import random_blocks

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs AVX2+FMA and a C compiler")


@pytest.fixture
def few_row_kernel():
    """The GEMM entry points without the hand-over to the panel kernel, restored after the test."""
    cpu_kernels.set_panel_min_rows(2**31 - 1)
    yield
    cpu_kernels.set_panel_min_rows(cpu_kernels.PANEL_MIN_ROWS)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_0, T.Q8_0, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_panel_matches_dequantize_then_matmul_and_the_few_row_kernel(qtype, few_row_kernel):
    n, k = 37, 512  # a partial panel of 16 outputs; several groups (Q6_K: groups of 16)
    w = repack(random_blocks(qtype, n, k), qtype, (n, k))
    ref_w = w.dequantize().double()
    for m in (1, 5, 70):  # below, at and past a tile of 4 rows
        x = torch.randn(m, k)
        ref = x.double() @ ref_w.T
        panel = cpu_kernels.quant_gemm(x, w, panel=True).double()
        few = cpu_kernels.quant_gemm(x, w).double()
        assert (panel - ref).norm() < 1e-4 * ref.norm()  # int16 activations: ~1e-5 measured
        # the same integer products, summed in float in another order: far closer to each other than to ref
        assert (panel - few).abs().max() < 1e-5 * ref.abs().max()


def test_panel_rows_do_not_depend_on_the_batch_or_threads():
    w = repack(random_blocks(T.Q4_1, 100, 256), T.Q4_1, (100, 256))
    m = cpu_kernels.PANEL_MIN_ROWS + 6
    x = torch.randn(m, 256)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = cpu_kernels.quant_gemm(x, w, panel=True)
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels.quant_gemm(x, w, panel=True), batch)
        for r in (0, 3, m - 1):  # a row alone, as the first row of a tile, as the last
            assert torch.equal(cpu_kernels.quant_gemm(x[r:r + 1], w, panel=True)[0], batch[r])
            s = min(r, 6)  # in PANEL_MIN_ROWS rows, which the entry point hands to the panel kernel
            assert torch.equal(cpu_kernels.quant_gemm(x[s:s + cpu_kernels.PANEL_MIN_ROWS], w)[r - s], batch[r])
    finally:
        torch.set_num_threads(prev)


def test_panel_min_rows_switches_the_kernel_and_rejects_nonsense(few_row_kernel):
    w = repack(random_blocks(T.Q4_1, 48, 256), T.Q4_1, (48, 256))
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32))
    few = cpu_kernels.quant_gemm(x, w)
    cpu_kernels.set_panel_min_rows(8)
    assert torch.equal(cpu_kernels.quant_gemm(x, w), cpu_kernels.quant_gemm(x, w, panel=True))
    assert not torch.equal(cpu_kernels.quant_gemm(x, w), few)  # float sums in another order
    with pytest.raises(ValueError, match="panel rows"):
        cpu_kernels.set_panel_min_rows(0)
