"""The C prefill attention (csrc/prefill_attention_cpu.c) over a bf16 paged cache against torch: SDPA for a
fresh prompt, the torch reference backend for prompt chunks after a cached prefix, mixed steps, GQA, sliding
windows and soft caps, on scattered cache blocks and odd lengths."""

import pytest
import torch
import torch.nn.functional as F

from novainfer.attention import cpu_backend, torch_backend
from novainfer.attention.metadata import AttentionMetadata
from novainfer.kernels.cpu import library

pytestmark = pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA and a C compiler")
BS = 16


def make_step(q_lens, seq_lens, nh, nkv, d, seed=0):
    """Random bf16 caches whose blocks are scattered, block tables, metadata and queries for one step."""
    g = torch.Generator().manual_seed(seed)
    nblk = sum((n + BS - 1) // BS for n in seq_lens) + 3
    k_cache = torch.randn(nblk, BS, nkv, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(nblk, BS, nkv, d, generator=g).to(torch.bfloat16)
    perm = torch.randperm(nblk, generator=g).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max((n + BS - 1) // BS for n in seq_lens), dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        nb = (n + BS - 1) // BS
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )
    return torch.randn(starts[-1], nh, d, generator=g), k_cache, v_cache, meta


def test_fresh_prompt_matches_sdpa():
    n, nh, nkv, d = 131, 9, 3, 64  # the default model's heads; a length past several tiles, not a multiple of 16
    q, k_cache, v_cache, meta = make_step([n], [n], nh, nkv, d)
    out = cpu_backend.paged_attention(q, k_cache, v_cache, meta, 0.125)
    blocks = meta.block_tables[0, : (n + BS - 1) // BS]
    k = k_cache[blocks].reshape(-1, nkv, d)[:n].float().transpose(0, 1).repeat_interleave(nh // nkv, 0)
    v = v_cache[blocks].reshape(-1, nkv, d)[:n].float().transpose(0, 1).repeat_interleave(nh // nkv, 0)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1).double(), k.double(), v.double(), is_causal=True, scale=0.125
    ).transpose(0, 1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "q_lens,seq_lens,nh,nkv,d,window,cap",
    [
        ([37, 5, 1, 70], [37, 100, 9, 70], 9, 3, 64, None, None),  # fresh, after a prefix, a decode row, fresh
        ([20, 17], [20, 60], 4, 4, 32, None, None),  # multi-head (no GQA), head_dim 32
        ([3], [3], 8, 1, 128, None, None),  # shorter than a tile, one KV head
        ([50, 20], [90, 20], 9, 3, 64, 17, None),  # sliding window
        ([50, 20], [90, 20], 9, 3, 64, None, 5.0),  # logits soft cap
    ],
    ids=["mixed", "mha", "tiny", "window", "softcap"],
)
def test_matches_the_reference_backend(q_lens, seq_lens, nh, nkv, d, window, cap):
    q, k_cache, v_cache, meta = make_step(q_lens, seq_lens, nh, nkv, d)
    ref = torch_backend.paged_attention(q, k_cache, v_cache, meta, 0.1, window, cap)
    out = cpu_backend.paged_attention(q, k_cache, v_cache, meta, 0.1, window, cap)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_head_dim_not_a_multiple_of_16_takes_the_torch_path():
    q, k_cache, v_cache, meta = make_step([9], [9], 2, 1, 24)
    ref = torch_backend.paged_attention(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(cpu_backend.paged_attention(q, k_cache, v_cache, meta, 0.2), ref)
