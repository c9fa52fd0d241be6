"""Sampling from temperature-scaled logits in one pass over the vocabulary (the Gumbel-max trick).

argmax(logits / T + g) with g = -log(-log u), u ~ U(0, 1), draws a token with probability softmax(logits / T):
the same distribution as the Sampler's exponential race argmax(p / q), q ~ Exp(1), which is the same formula
(-log q is a Gumbel variable), without the softmax, the division and the noise tensor. Greedy rows take the
plain argmax (the first maximal index, as torch.argmax). The Sampler uses it on CUDA when no row needs top-k,
top-p, min-p or its own seeded generator: those keep the torch path.

Each row is split into chunks, one program each (256 rows alone leave most SMs idle while Philox runs), and
each Philox call yields 4 uniforms; the chunks' maxima are reduced on the host side with torch (first chunk
wins a tie, so the first maximal index overall).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _max_update(x, first, best, best_idx):
    """(best, best_idx) after a block x whose entry 0 is vocabulary index `first`."""
    m = tl.max(x, axis=0)
    i = tl.argmax(x, axis=0)  # the first maximal index
    take = m > best  # strictly: an earlier position keeps a tie
    return tl.where(take, m, best), tl.where(take, first + i.to(tl.int64), best_idx)


@triton.jit(do_not_specialize=["seed"])  # a new seed every call: specializing on its value recompiled (~1 s)
def _gumbel_argmax_kernel(
    logits_ptr, stride, temperature_ptr, greedy_ptr, max_ptr, idx_ptr, vocab, chunk, seed, Q: tl.constexpr
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    greedy = tl.load(greedy_ptr + row) != 0
    inv_t = 1.0 / tl.load(temperature_ptr + row)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab)
    base = logits_ptr + row.to(tl.int64) * stride
    q = tl.arange(0, Q)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = lo.to(tl.int64)
    for start in range(lo, hi, 4 * Q):
        o0, o1, o2, o3 = start + q, start + Q + q, start + 2 * Q + q, start + 3 * Q + q
        x0 = tl.load(base + o0, mask=o0 < hi, other=float("-inf")).to(tl.float32)
        x1 = tl.load(base + o1, mask=o1 < hi, other=float("-inf")).to(tl.float32)
        x2 = tl.load(base + o2, mask=o2 < hi, other=float("-inf")).to(tl.float32)
        x3 = tl.load(base + o3, mask=o3 < hi, other=float("-inf")).to(tl.float32)
        if not greedy:  # counters start + q are unique in the row: start moves by 4 Q, q < Q
            u0, u1, u2, u3 = tl.rand4x(seed, row.to(tl.int64) * vocab + start + q)
            x0 = x0 * inv_t - tl.log(-tl.log(tl.minimum(tl.maximum(u0, 1e-10), 1.0 - 1e-7)))
            x1 = x1 * inv_t - tl.log(-tl.log(tl.minimum(tl.maximum(u1, 1e-10), 1.0 - 1e-7)))
            x2 = x2 * inv_t - tl.log(-tl.log(tl.minimum(tl.maximum(u2, 1e-10), 1.0 - 1e-7)))
            x3 = x3 * inv_t - tl.log(-tl.log(tl.minimum(tl.maximum(u3, 1e-10), 1.0 - 1e-7)))
        best, best_idx = _max_update(x0, start + 0 * Q, best, best_idx)
        best, best_idx = _max_update(x1, start + 1 * Q, best, best_idx)
        best, best_idx = _max_update(x2, start + 2 * Q, best, best_idx)
        best, best_idx = _max_update(x3, start + 3 * Q, best, best_idx)
    tl.store(max_ptr + row * nsplit + split, best)
    tl.store(idx_ptr + row * nsplit + split, best_idx)


def gumbel_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    is_greedy: torch.Tensor,
    seed: int | None = None,
    chunk: int = 8192,
    block: int = 512,
) -> torch.Tensor:
    """Token ids [rows] int64: row r's argmax if is_greedy[r], else a draw from softmax(logits[r] / temperature[r]).
    seed: the noise's Philox seed (default: drawn from torch's CPU generator, so torch.manual_seed repeats runs);
    chunk: vocabulary entries per program, read 4 blocks (a power of two) at a time."""
    rows, vocab = logits.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    assert logits.stride(1) == 1
    nsplit = triton.cdiv(vocab, chunk)
    maxima = torch.empty(rows, nsplit, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, nsplit, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(rows, nsplit)](
        logits,
        logits.stride(0),
        temperature.float().contiguous(),
        is_greedy.to(torch.int8).contiguous(),
        maxima,
        idx,
        vocab,
        chunk,
        seed,
        Q=block,
    )
    if nsplit == 1:
        return idx.view(rows)
    return idx.gather(1, maxima.argmax(dim=1, keepdim=True)).view(rows)
