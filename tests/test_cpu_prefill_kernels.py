"""The CPU prefill kernels: the panel GEMM's balanced panel chunks and vectorised k-pair
interleave, the prefill attention's 6-row register tiles and the vectorised bf16 KV store, each against an
independent reference (float64 matmul of the dequantized weight, torch SDPA, torch's bfloat16 cast) and bit for
bit where the project needs the same bits (1 vs 2 threads, the few-row kernel, torch's rounding)."""

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from novainfer.attention import cpu_backend
from novainfer.kernels.cpu import library, ops as cpu_ops, qgemm
from novainfer.kernels.cpu.repack import repack
from tests.test_prefill_attention_cpu import BS, make_step
from tests.test_quantized_cpu import random_blocks

pytestmark = pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA and a C compiler")


@pytest.mark.parametrize("n,m", [(600, 70), (40, 130), (16, 64)])
def test_panel_gemm_chunks_give_the_same_bits_on_one_or_two_threads(n, m):
    # 600 outputs: 38 panels (the last partial) in 16 chunks of 2-3; 40: 3 panels; M past 64 rows splits the
    # activation rounding over the pool too, and 70 / 130 rows end in a partial tile of 4 rows
    k = 576
    w = repack(random_blocks(T.Q4_1, n, k), T.Q4_1, (n, k))
    x = torch.randn(m, k) * torch.linspace(0.1, 3, k)
    prev = library._kernel_threads
    try:
        library.set_num_threads(2)
        two = qgemm.quant_gemm(x, w, panel=True)
        library.set_num_threads(1)
        one = qgemm.quant_gemm(x, w, panel=True)
    finally:
        library.set_num_threads(prev)
    assert torch.equal(one, two)
    ref = x.double() @ w.dequantize().double().T
    assert (two.double() - ref).norm() < 1e-4 * ref.norm()
    for r in (0, m - 1):  # a row through the few-row kernel: the same bits
        assert torch.equal(qgemm.quant_gemm(x[r : r + 1], w)[0], two[r])


@pytest.mark.parametrize("nh,nkv,n", [(4, 2, 37), (8, 1, 21), (10, 5, 50), (6, 6, 33)])
def test_prefill_attention_row_tiles_of_any_group_size(nh, nkv, n):
    # rows of a tile = 16 tokens x the GQA group: 32, 128, 32, 16 (and the last tile's rest), so the 6-row
    # register tiles end in every remainder 1-5
    d = 64
    q, k_cache, v_cache, meta = make_step([n], [n], nh, nkv, d, seed=nh + n)
    out = cpu_backend.paged_attention(q, k_cache, v_cache, meta, 0.125)
    blocks = meta.block_tables[0, : (n + BS - 1) // BS]
    k = k_cache[blocks].reshape(-1, nkv, d)[:n].double().transpose(0, 1).repeat_interleave(nh // nkv, 0)
    v = v_cache[blocks].reshape(-1, nkv, d)[:n].double().transpose(0, 1).repeat_interleave(nh // nkv, 0)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1).double(), k, v, is_causal=True, scale=0.125).transpose(0, 1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [12, 64])
def test_store_kv_bf16_rounds_like_torch_bit_for_bit(width):
    # width 12: one vector of 8 and a scalar tail of 4; values: ties to even either way, NaNs, infinities,
    # signed zeros, subnormals, the largest floats (which round to infinity) and random ones
    tie_even = torch.tensor([0x3F808000, 0x3F818000, 0x00008000, 0x7F7F8000], dtype=torch.int32).view(torch.float32)
    special = torch.tensor(
        [
            float("nan"),
            -float("nan"),
            float("inf"),
            -float("inf"),
            0.0,
            -0.0,
            1e-40,
            -1e-45,
            3.4028235e38,
            -3.4028235e38,
            1.0,
            -2.5,
        ]
    )
    vals = torch.cat([tie_even, special, torch.randn(64) * 1e3])
    t = (vals.numel() + width - 1) // width
    kv = torch.cat([vals, torch.randn(t * width - vals.numel())]).view(t, 1, width)
    k_cache = torch.zeros(4, 16, 1, width, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(t) * 3
    cpu_ops.store_kv_bf16(kv, -kv, k_cache, v_cache, slots)
    want = kv.to(torch.bfloat16).view(torch.int16)
    got_k = k_cache.view(-1, 1, width)[slots].view(torch.int16)
    got_v = v_cache.view(-1, 1, width)[slots].view(torch.int16)
    # NaN payloads: torch may keep another quiet NaN's bits; compare NaN-ness there, the bits elsewhere
    nan = torch.isnan(kv)
    assert torch.equal(got_k[~nan], want[~nan])
    assert torch.equal(got_v[~nan], (-kv).to(torch.bfloat16).view(torch.int16)[~nan])
    assert torch.isnan(k_cache.view(-1, 1, width)[slots][nan]).all()
