"""Sampling from temperature-scaled logits in one pass over the vocabulary (the Gumbel-max trick).

argmax(logits / T + g) with g = -log(-log u), u ~ U(0, 1), draws a token with probability softmax(logits / T):
the same distribution as the Sampler's exponential race argmax(p / q), q ~ Exp(1), which is the same formula
(-log q is a Gumbel variable), without the softmax, the division and the noise tensor. Greedy rows take the
plain argmax (the first maximal index, as torch.argmax). The Sampler uses it on CUDA when no row needs top-k,
top-p, min-p or its own seeded generator: those keep the torch path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["seed"])  # a new seed every call: specializing on its value recompiled (~1 s)
def _gumbel_argmax_kernel(logits_ptr, stride, temperature_ptr, greedy_ptr, out_ptr, vocab, seed,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    greedy = tl.load(greedy_ptr + row) != 0
    inv_t = 1.0 / tl.load(temperature_ptr + row)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if not greedy:
            u = tl.rand(seed, row.to(tl.int64) * vocab + offs)
            u = tl.minimum(tl.maximum(u, 1e-10), 1.0 - 1e-7)  # log(0) and log(-log(1)) stay finite
            x = x * inv_t - tl.log(-tl.log(u))
        m = tl.max(x, axis=0)
        i = tl.argmax(x, axis=0)  # the first maximal index
        take = m > best  # strictly: an earlier block keeps a tie
        best_idx = tl.where(take, start + i.to(tl.int64), best_idx)
        best = tl.where(take, m, best)
    tl.store(out_ptr + row, best_idx)


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, is_greedy: torch.Tensor,
                  seed: int | None = None) -> torch.Tensor:
    """Token ids [rows] int64: row r's argmax if is_greedy[r], else a draw from softmax(logits[r] / temperature[r]).
    seed: the noise's Philox seed (default: drawn from torch's CPU generator, so torch.manual_seed repeats runs)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    assert logits.stride(1) == 1
    _gumbel_argmax_kernel[(rows,)](logits, logits.stride(0), temperature.float().contiguous(),
                                   is_greedy.to(torch.int8).contiguous(), out, vocab, seed, BLOCK=4096)
    return out
