"""One Sampler for every request's parameters, run as a batched pass on the logits' device.

Order: logit_bias, repetition / frequency / presence penalties, min_tokens blocking, the grammar's token
bitmask (structured outputs; constrained and free rows mix in one batch), then greedy rows take
the argmax; the rest are divided by temperature, filtered by top-k, top-p and min-p, and sampled: on CUDA with
the exponential race argmax(p / q), q ~ Exp(1), on the CPU by the inverse CDF with one uniform a row
(Sampler.draw). A seeded row draws from its own generator, so its tokens depend only on its seed, never
on what else is in the batch. Logprobs are the raw model's. On CUDA,
when no row uses top-k, top-p, min-p or a seed, one Triton pass samples every row (the same distribution by
the Gumbel-max trick: kernels/sampling.py) instead of ~7 passes over the [rows, vocab] logits.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from novainfer.layers.sampler_candidates import outside_nucleus, sample_top_k_top_p
from novainfer.layers.sampling_metadata import SamplerOutput, SamplingMetadata


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,
        meta: SamplingMetadata,
        token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """token_bitmask: (row indices, int32 bitmask rows on the logits' device) of the grammar-constrained rows."""
        logits, raw_logprobs = self.process_logits(logits, meta, token_bitmask)
        if meta.all_greedy:
            sampled = logits.argmax(dim=-1)
        elif logits.is_cuda and self.plain_temperature(meta):
            from novainfer.kernels.sampling import gumbel_sample  # Triton: imported where CUDA runs it

            sampled = gumbel_sample(logits, meta.temperature, meta.is_greedy)
        else:
            sampled = torch.where(meta.is_greedy, logits.argmax(dim=-1), self.sample_random(logits, meta))
        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            self.gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs, out)
        return out

    def process_logits(
        self,
        logits: torch.Tensor,
        meta: SamplingMetadata,
        token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits after logit_bias, min_tokens blocking, penalties and the grammar's bitmask (greedy rows take
        their argmax), and the raw model's logprobs when a row wants logprobs."""
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs >= 0 else None
        penalised = (
            meta.logit_bias is not None
            or meta.blocked is not None
            or meta.repetition_penalty is not None
            or meta.frequency_penalty is not None
        )
        if penalised:
            logits = self.apply_penalties(logits.clone(), meta)
        if token_bitmask is not None:
            logits = apply_token_bitmask(logits, *token_bitmask)
        if penalised:
            logits = keep_only_infinite(logits)
        return logits, raw_logprobs

    @staticmethod
    def plain_temperature(meta: SamplingMetadata) -> bool:
        """No row filters its distribution (top-k, top-p, min-p) or draws from its own seeded generator."""
        return (
            meta.top_k is None and meta.top_p is None and meta.min_p is None and all(g is None for g in meta.generators)
        )

    @staticmethod
    def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.logit_bias is not None:
            rows, tokens, values = meta.logit_bias
            logits.index_put_((rows, tokens), values, accumulate=True)
        if meta.repetition_penalty is not None:
            penalised = torch.where(logits > 0, logits / meta.repetition_penalty, logits * meta.repetition_penalty)
            logits = torch.where(meta.seen_mask, penalised, logits)
        if meta.frequency_penalty is not None:
            counts = meta.output_counts
            logits = logits - meta.frequency_penalty * counts - meta.presence_penalty * (counts > 0).float()
        if meta.blocked is not None:  # last: a penalty of ~0 (float32 underflow) would turn -inf into NaN
            logits[meta.blocked] = float("-inf")
        return logits

    @staticmethod
    def probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution a random row samples from: temperature, then top-k, top-p and min-p."""
        logits = logits / meta.temperature.unsqueeze(1)
        if meta.top_k is not None or meta.top_p is not None:
            logits = _top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = torch.softmax(logits, dim=-1)
        if meta.min_p is not None:
            threshold = meta.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    @staticmethod
    def exponentials(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """q ~ Exp(1) per entry; a seeded row draws from its own generator."""
        q = torch.empty_like(probs).exponential_()
        for i, gen in enumerate(meta.generators):
            if gen is not None:
                q[i].exponential_(generator=gen)
        return q

    @classmethod
    def draw(cls, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """One token per row from probs [rows, vocab] (non-negative, a row's sum need not be 1).

        On CUDA the exponential race argmax(p / q), q ~ Exp(1), which needs no host sync. On the CPU the
        inverse CDF with one uniform a row: drawing an exponential per vocabulary entry cost 17 ms a step for
        16 rows of the default model's 49k vocabulary (benchmarks/sampler_speed.py), the cumulative sum 0.5."""
        if probs.is_cuda:
            return (probs / cls.exponentials(probs, meta)).argmax(dim=-1)
        cdf = probs.double().cumsum(dim=-1)  # float64: the tail's mass is not lost to rounding
        target = uniforms(meta, probs.device).double().unsqueeze(1) * cdf[:, -1:]  # u < 1, so below the total
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)

    @classmethod
    def sample_random(cls, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if not logits.is_cuda and (meta.top_k is not None or meta.top_p is not None):
            return sample_top_k_top_p(cls, logits, meta)
        return cls.draw(cls.probs(logits, meta), meta)

    @staticmethod
    def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, k: int, out: SamplerOutput) -> None:
        chosen = logprobs.gather(1, sampled.unsqueeze(1))
        out.sampled_token_ranks = (logprobs > chosen).sum(dim=-1) + 1
        if k > 0:
            top = logprobs.topk(k, dim=-1)
            out.logprob_token_ids = torch.cat([sampled.unsqueeze(1), top.indices], dim=1)
            out.logprobs = torch.cat([chosen, top.values], dim=1)
        else:
            out.logprob_token_ids, out.logprobs = sampled.unsqueeze(1), chosen


ONE_THREAD_MAX_LOGITS = 1 << 19  # past this many logits (10 rows of a 49k vocabulary) a sort pays for the threads


@contextmanager
def sampling_threads(logits: torch.Tensor) -> Iterator[None]:
    """On the CPU, a few rows' sampling on one torch thread (then back). The C kernels' pool holds every core,
    and libgomp's workers spin for a while after each parallel torch op, taking cores from it: batch-1 decode of
    the default model at temperature 1.0 ran at 77-81 tok/s against 118-125 with this (sampler_speed.py)."""
    n = torch.get_num_threads()
    if logits.is_cuda or n == 1 or logits.numel() > ONE_THREAD_MAX_LOGITS:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def uniforms(meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """One U[0, 1) draw per row; a seeded row draws from its own generator."""
    u = torch.rand(len(meta.generators), device=device)
    for i, gen in enumerate(meta.generators):
        if gen is not None:
            u[i] = torch.rand((), generator=gen, device=gen.device)
    return u


def keep_only_infinite(logits: torch.Tensor) -> torch.Tensor:
    """A row with +inf logits (a tiny repetition penalty divides a positive logit into infinity) samples
    uniformly among those tokens, the distribution's limit; softmax would give NaN and draw an arbitrary token."""
    infinite = torch.isposinf(logits)
    return torch.where(infinite.any(dim=-1, keepdim=True), torch.where(infinite, 0.0, float("-inf")), logits)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf for every token whose bit is clear in its row's bitmask (bit t % 32 of word t // 32); ids past the
    bitmask's width (a padded vocabulary) are disallowed too. Unconstrained rows are untouched."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1).bool()
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask everything outside each row's top-k and its smallest top-p nucleus (at least one token kept)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        sorted_logits = sorted_logits.masked_fill(outside_nucleus(probs, top_p), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
