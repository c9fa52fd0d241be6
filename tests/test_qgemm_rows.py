"""The quantized CPU GEMM at every small row count (the register-blocked tiles' edges: 1-3 activation rows,
1-3 leftover weight rows): each format against dequantize-then-matmul, and each row's result bit-identical
whatever the batch it is computed in (the greedy-identity of speculation and batching rests on that)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from novainfer.kernels.cpu import library, qgemm
from novainfer.kernels.cpu.repack import repack
from tests.test_quantized_cpu import random_blocks

pytestmark = pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA and a C compiler")
ROWS = [1, 2, 3, 4, 5, 7, 8, 16, 17]
# q4 with zeros (Q4_1), q8 groups of 32 without zeros (Q8_0), q8 groups of 16 (Q6_K), q8 with zeros (Q5_K)
FORMATS = [(T.Q4_1, 256), (T.Q8_0, 96), (T.Q6_K, 256), (T.Q5_K, 512)]
N = 75  # odd: leftover weight rows past the 4-row tiles, and uneven chunks over the threads


def _within_bound(x: torch.Tensor, ref_w: torch.Tensor, y: torch.Tensor) -> bool:
    """|y - x @ w^T| within the int16 rounding of x (half a step per block of 32) plus float32 summation."""
    m, k = x.shape
    ref = x.double() @ ref_w.double().T
    step = x.abs().view(m, k // 32, 32).amax(-1).double().repeat_interleave(32, dim=1) / 32767
    tol = (step / 2 * 1.001) @ ref_w.abs().double().T
    tol += 4 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ ref_w.abs().double().T)
    return bool(((y.double() - ref).abs() <= tol + 1e-6).all()) and bool((y.double() - ref).norm() < 1e-4 * ref.norm())


@pytest.mark.parametrize("qtype,k", FORMATS, ids=lambda v: getattr(v, "name", str(v)))
def test_every_small_row_count_matches_dequantize_then_matmul(qtype, k):
    blocks = random_blocks(qtype, N, k)
    w = repack(blocks, qtype, (N, k))
    ref_w = torch.from_numpy(dequantize(blocks, qtype).reshape(N, k).astype(np.float32))
    for m in ROWS:
        x = torch.randn(m, k) * torch.linspace(0.1, 3, k)  # uneven magnitudes: each block its own step
        assert _within_bound(x, ref_w, qgemm.quant_gemm(x, w)), f"M={m}"


@pytest.mark.parametrize("qtype,k", FORMATS[:3], ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_gives_the_same_bits_alone_or_in_any_batch(qtype, k, threads):
    w = repack(random_blocks(qtype, N, k), qtype, (N, k))
    x = torch.randn(max(ROWS), k)
    library.set_num_threads(threads)
    try:
        alone = torch.cat([qgemm.quant_gemm(x[i : i + 1].contiguous(), w) for i in range(len(x))])
        for m in ROWS:
            for start in {0, len(x) - m}:  # each row lands at another place in the 3-row tiles
                assert torch.equal(qgemm.quant_gemm(x[start : start + m].contiguous(), w), alone[start : start + m]), (
                    f"M={m} from row {start}"
                )
    finally:
        library.set_num_threads(None)


@pytest.mark.parametrize("n", [112, 336, 533])  # 3, 10 and 16 chunks on two threads, the last of 34 panels
def test_chunks_dealt_to_two_threads_cover_every_row_once(n):
    """The few-row GEMV deals its chunks so that each thread walks a contiguous run (cpu_pool.h's
    pool_chunk_order), for chunk counts that do and do not divide over the threads: every output row computed,
    once, with the bits of the one-thread run and within the bound of dequantize-then-matmul."""
    qtype, k = T.Q4_1, 256
    blocks = random_blocks(qtype, n, k)
    w = repack(blocks, qtype, (n, k))
    ref_w = torch.from_numpy(dequantize(blocks, qtype).reshape(n, k).astype(np.float32))
    x = torch.randn(1, k)
    library.set_num_threads(1)
    try:
        one = qgemm.quant_gemm(x, w)
        library.set_num_threads(2)
        two = qgemm.quant_gemm(x, w)
    finally:
        library.set_num_threads(None)
    assert torch.equal(one, two) and _within_bound(x, ref_w, two)
