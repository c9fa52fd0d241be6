"""Sliding-window attention and logit soft-capping: the torch reference against a brute-force loop, and the
Triton decode/prefill kernels (TRITON_INTERPRET=1 on the CPU) against the torch reference.

Windows shorter and longer than the context, GQA, a cached prefix, split-K decode, and a window edge that
falls inside a prefill block (rows whose first tiles are all masked)."""

from __future__ import annotations

import math

import pytest
import torch

from novainfer.attention import torch_backend
from tests.test_kernels import make_case, rel_err

kernels = pytest.importorskip("novainfer.kernels.paged_attention")


def brute_force(q, k_cache, v_cache, meta, scale, window, cap):
    """Token by token, head by head, in float64: the definition the interface agreed on."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        blocks = meta.block_tables[i, : math.ceil(seq_len / bs)]
        k = k_cache[blocks].reshape(-1, kvh, q.shape[2])[:seq_len].double()
        v = v_cache[blocks].reshape(-1, kvh, q.shape[2])[:seq_len].double()
        for t in range(start, end):
            p = seq_len - (end - t)
            keys = [j for j in range(seq_len) if j <= p and (window is None or p - j < window)]
            for h in range(q.shape[1]):
                s = k[keys, h // group] @ q[t, h].double() * scale
                if cap is not None:
                    s = cap * torch.tanh(s / cap)
                out[t, h] = torch.softmax(s, 0) @ v[keys, h // group]
    return out


CASES = [(None, 30.0), (5, None), (3, 2.0), (64, None)]  # (window, soft cap): 64 is longer than every context


@pytest.mark.parametrize("window,cap", CASES)
def test_torch_reference_matches_brute_force(window, cap):
    q, kc, vc, bt, qsl, sl, meta = make_case(11, [0, 9, 3], [7, 4, 1], 4, 2)
    ref = torch_backend.paged_attention(q, kc, vc, meta, 0.4, window, cap)
    assert rel_err(ref, brute_force(q, kc, vc, meta, 0.4, window, cap).float()) < 1e-5


@pytest.mark.parametrize("window,cap", CASES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_kernel_window_and_soft_cap(window, cap, num_splits):
    ctx = [0, 3, 4, 13, 22]
    q, kc, vc, bt, qsl, sl, meta = make_case(12, ctx, [1] * len(ctx), 6, 2)
    out = kernels.decode_attention(
        q, kc, vc, bt, sl, 0.25, num_splits=num_splits, sliding_window=window, logits_soft_cap=cap
    )
    ref = torch_backend.paged_attention(q, kc, vc, meta, 0.25, window, cap)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("window,cap", CASES)
def test_prefill_kernel_window_and_soft_cap(window, cap):
    # a long fresh prompt (the window edge moves through the 16-row blocks), cached prefixes, a chunk of one
    ctx, qlen = [0, 8, 5, 30], [21, 5, 1, 9]
    q, kc, vc, bt, qsl, sl, meta = make_case(13, ctx, qlen, 4, 2)
    out = torch.full_like(q, float("nan"))
    kernels.prefill_attention(
        q, kc, vc, bt, qsl, sl, max(qlen), 0.3, out=out, sliding_window=window, logits_soft_cap=cap
    )
    assert not out.isnan().any()
    assert rel_err(out, torch_backend.paged_attention(q, kc, vc, meta, 0.3, window, cap)) < 1e-5
