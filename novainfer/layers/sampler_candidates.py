"""Top-k and top-p on the CPU without sorting the vocabulary.

Sorting every row of [rows, vocab] logits for top-k / top-p cost the default model 4 ms a token at batch 1
and 65 ms a step at 16 rows on one core (benchmarks/sampler_speed.py): more than the step itself. Here each row
keeps its CANDIDATES highest logits (torch.topk), and the masks are applied to those alone. That is exact for
a row whose kept set lies among them: its top-k is at most CANDIDATES, or its top-p nucleus closes within them
(measured against the whole vocabulary's softmax). Any other row takes the full sort (Sampler.probs).
"""

from __future__ import annotations

import dataclasses
import torch

from novainfer.layers.sampling_metadata import SamplingMetadata

CANDIDATES = 1024


def outside_nucleus(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which of each row's descending probabilities fall outside its top-p nucleus: those whose mass before them
    reaches p. The first always stays, even where p is 0 (a top_p below float32's range, e.g. 5e-324, reads as 0
    and masked every token: the draw then took an arbitrary one, outside a structured-output grammar)."""
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p.unsqueeze(1)
    outside[:, 0] = False
    return outside


def candidate_probs(
    scaled: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For logits already divided by temperature: each row's distribution over its candidates (top-k, top-p
    and min-p applied as Sampler.probs applies them), the candidates' token ids, and which rows it is exact for."""
    rows, vocab = scaled.shape
    k = min(CANDIDATES, vocab)
    vals, ids = scaled.topk(k, dim=-1)  # descending
    in_candidates = top_k <= k if top_k is not None else torch.zeros(rows, dtype=torch.bool)
    resolved = in_candidates | (k == vocab)
    if top_k is not None:
        vals = vals.masked_fill(torch.arange(k).unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        # the nucleus of the top-k set's distribution, or of the whole vocabulary's where top-k is off
        top_k_off = top_k >= vocab if top_k is not None else torch.ones(rows, dtype=torch.bool)
        lse = torch.where(in_candidates, vals.logsumexp(dim=-1), scaled.logsumexp(dim=-1))
        probs = (vals - lse.unsqueeze(1)).exp()
        outside = outside_nucleus(probs, top_p)
        vals = vals.masked_fill(outside, float("-inf"))
        resolved |= top_k_off & outside[:, -1]  # the last candidate is out: so is every other token
    probs = torch.softmax(vals, dim=-1)
    if min_p is not None:
        threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs, ids, resolved


def rows_of(meta: SamplingMetadata, rows: torch.Tensor) -> SamplingMetadata:
    """The sampling parameters of some rows (what Sampler.probs and Sampler.draw read)."""
    pick = rows.tolist()
    return dataclasses.replace(
        meta,
        temperature=meta.temperature[rows],
        is_greedy=meta.is_greedy[rows],
        top_k=None if meta.top_k is None else meta.top_k[rows],
        top_p=None if meta.top_p is None else meta.top_p[rows],
        min_p=None if meta.min_p is None else meta.min_p[rows],
        generators=[meta.generators[i] for i in pick],
    )


def sample_top_k_top_p(sampler_cls: type, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """One token per row (CPU; sampler_cls: the Sampler, whose probs and draw it calls): drawn among the
    candidates where that is exact, from the full sort elsewhere."""
    probs, ids, resolved = candidate_probs(logits / meta.temperature.unsqueeze(1), meta.top_k, meta.top_p, meta.min_p)
    out = torch.empty(logits.shape[0], dtype=torch.long)
    fast, slow = resolved.nonzero().squeeze(1), (~resolved).nonzero().squeeze(1)
    if fast.numel():
        pick = sampler_cls.draw(probs[fast], rows_of(meta, fast))
        out[fast] = ids[fast].gather(1, pick.unsqueeze(1)).squeeze(1)
    if slow.numel():
        sub = rows_of(meta, slow)
        out[slow] = sampler_cls.draw(sampler_cls.probs(logits[slow], sub), sub)
    return out
