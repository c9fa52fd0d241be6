"""Attention sinks (gpt-oss: one learned logit per head in every softmax, emitting nothing) on each attention path.

The torch reference against transformers' own gpt-oss eager attention, then the CPU backend's torch decode path,
the C kernels (bf16 cache) and the Triton kernels (TRITON_INTERPRET=1 on the CPU) against that reference: GQA,
a sliding window shorter than the context, split decode contexts, cached prefixes; sinks both far above and
below the scores so each side of the max is taken.
"""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from novainfer.attention import cpu_backend, torch_backend
from novainfer.kernels.cpu import library, ops as cpu_ops
from tests.test_kernels import make_case, rel_err


def sinks_of(num_heads: int, seed: int = 0) -> torch.Tensor:
    """Sink logits from well below to well above typical scores."""
    g = torch.Generator().manual_seed(seed)
    return torch.linspace(-4.0, 4.0, num_heads)[torch.randperm(num_heads, generator=g)]


def test_reference_matches_transformers_eager_attention():
    """A prompt after a cached prefix, GQA, with and without a window: torch_backend as transformers computes it."""
    nh, nkv, d = 6, 2, 16
    q, kc, vc, bt, qsl, sl, meta = make_case(3, [5], [9], nh, nkv, head_dim=d)
    sinks = sinks_of(nh)
    seq_len = 14
    k = kc[bt[0, :4]].reshape(-1, nkv, d)[:seq_len].transpose(0, 1)[None]
    v = vc[bt[0, :4]].reshape(-1, nkv, d)[:seq_len].transpose(0, 1)[None]
    for window in (None, 4):
        pos_q, pos_k = torch.arange(5, 14)[:, None], torch.arange(seq_len)[None, :]
        visible = pos_k <= pos_q if window is None else (pos_k <= pos_q) & (pos_q - pos_k < window)
        mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]
        module = types.SimpleNamespace(num_key_value_groups=nh // nkv, sinks=sinks, training=False)
        want, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k, v, mask, 0.25)
        got = torch_backend.paged_attention(q, kc, vc, meta, 0.25, window, None, sinks)
        torch.testing.assert_close(got, want[0], rtol=1e-6, atol=1e-6)
        assert rel_err(got, torch_backend.paged_attention(q, kc, vc, meta, 0.25, window)) > 1e-2  # sinks matter


@pytest.mark.parametrize("window", [None, 5])
def test_cpu_backend_torch_decode_matches_the_reference(window):
    """The batched torch decode path (a float32 cache, so not the C kernel)."""
    q, kc, vc, bt, qsl, sl, meta = make_case(4, [0, 3, 12], [1, 1, 1], 6, 2)
    sinks = sinks_of(6, 1)
    want = torch_backend.paged_attention(q, kc, vc, meta, 0.25, window, None, sinks)
    got = cpu_backend.decode_attention(q, kc, vc, meta, 0.25, window, None, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


needs_c = pytest.mark.skipif(not library.available(), reason="the C kernels need a compiler and AVX2")


@needs_c
@pytest.mark.parametrize("window,cap", [(None, None), (6, None), (None, 2.0)])
@pytest.mark.parametrize("ctx", [[0, 3, 12], [300, 7, 600]])
def test_c_decode_attention_with_sinks_matches_the_reference(window, cap, ctx):
    """Short contexts (one chunk: the sink in the normalizer) and ones past 256 keys (split chunks: the sink at
    the merge)."""
    nh, nkv, d = 8, 2, 16
    q, kc, vc, bt, qsl, sl, meta = make_case(5, ctx, [1] * len(ctx), nh, nkv, head_dim=d)
    kc, vc = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    sinks = sinks_of(nh, 2)
    want = torch_backend.paged_attention(q, kc.float(), vc.float(), meta, 0.25, window, cap, sinks)
    got = cpu_ops.decode_attention_bf16(q, kc, vc, bt, sl, 0.25, window, cap, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_c
@pytest.mark.parametrize("window", [None, 6])
def test_c_prefill_attention_with_sinks_matches_the_reference(window):
    """Fresh prompts, a prompt after a cached prefix, a chunk of one token; GQA."""
    nh, nkv, d = 6, 2, 16
    q, kc, vc, bt, qsl, sl, meta = make_case(6, [0, 9, 4], [11, 6, 1], nh, nkv, head_dim=d)
    kc, vc = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    sinks = sinks_of(nh, 3).to(torch.bfloat16)  # a bf16 model's parameter: widened for the C code
    want = torch_backend.paged_attention(q, kc.float(), vc.float(), meta, 0.3, window, None, sinks.float())
    got = cpu_ops.prefill_attention_bf16(q, kc, vc, bt, qsl, sl, 0.3, window, None, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


kernels = pytest.importorskip("novainfer.kernels.paged_attention")


@pytest.mark.parametrize("num_splits,window", [(1, None), (4, None), (4, 9)])
def test_triton_decode_with_sinks_matches_the_reference(num_splits, window):
    """One program per KV head (the sink folded at the end) and split contexts (the sink at the merge)."""
    ctx = [0, 3, 15, 40]
    q, kc, vc, bt, qsl, sl, meta = make_case(7, ctx, [1] * len(ctx), 6, 2)
    sinks = sinks_of(6, 4)
    out = kernels.decode_attention(
        q, kc, vc, bt, sl, 0.25, num_splits=num_splits, min_split_keys=8, sliding_window=window, sinks=sinks
    )
    want = torch_backend.paged_attention(q, kc, vc, meta, 0.25, window, None, sinks)
    assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("window", [None, 5])
def test_triton_prefill_with_sinks_matches_the_reference(window):
    ctx, qlen = [0, 8, 5], [7, 5, 21]
    q, kc, vc, bt, qsl, sl, meta = make_case(8, ctx, qlen, 4, 2)
    sinks = sinks_of(4, 5)
    out = kernels.prefill_attention(q, kc, vc, bt, qsl, sl, max(qlen), 0.3, sliding_window=window, sinks=sinks)
    want = torch_backend.paged_attention(q, kc, vc, meta, 0.3, window, None, sinks)
    assert rel_err(out, want) < 1e-5


@pytest.mark.skipif(not library.available(), reason="the CPU kernels did not build")
def test_bf16_query_on_the_cpu_backend_keeps_its_sinks():
    """A bfloat16 model on the CPU: the backend widens the query for the C kernels and must pass the sinks on."""
    nh, nkv, d = 6, 2, 16
    q, kc, vc, bt, qsl, sl, meta = make_case(6, [0, 9, 4], [11, 6, 1], nh, nkv, head_dim=d)
    kc, vc = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    sinks = sinks_of(nh, 3).to(torch.bfloat16)
    got = cpu_backend.paged_attention(q.to(torch.bfloat16), kc, vc, meta, 0.3, None, None, sinks)
    want = torch_backend.paged_attention(
        q.to(torch.bfloat16).float(), kc.float(), vc.float(), meta, 0.3, None, None, sinks.float()
    )
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)
