"""Verification of guessed tokens that keeps the target model's output distribution (Leviathan et al. 2023;
Chen et al. 2023).

Each logits row of a verify step is the target's distribution p at one position; a row that checks a guess
d accepts it with probability p(d), otherwise it samples from p with d removed (renormalised). Our proposers
guess one token for sure (q is one-hot), for which this is the general rule min(1, p/q) with the residual
max(0, p - q): every token x comes out with probability p(x). The row after a sequence's last guess samples
the bonus token from p. Greedy rows accept while the guess is the argmax. p is the distribution the Sampler
samples from (logit_bias, penalties, temperature, top-k, top-p, min-p), so every parameter keeps its meaning.
A sequence's emitted tokens are its rows' tokens up to and including the first rejected row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from novainfer.layers.sampler import Sampler, uniforms
from novainfer.layers.sampling_metadata import SamplerOutput, SamplingMetadata
from novainfer.step_types import ModelRunnerOutput


@dataclass
class VerifiedOutput(SamplerOutput):
    """Per logits row: the token it emits (the guess, if accepted) and whether it accepted its guess."""

    accepted: torch.Tensor | None = None  # [rows] bool; False for rows without a guess


def rejection_sample(
    sampler: Sampler,
    logits: torch.Tensor,
    meta: SamplingMetadata,
    draft_ids: torch.Tensor,
    token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> VerifiedOutput:
    """logits [rows, vocab]; draft_ids [rows]: the guess each row checks, -1 for a row that just samples."""
    logits, raw_logprobs = sampler.process_logits(logits, meta, token_bitmask)
    has_draft = draft_ids >= 0
    draft = draft_ids.clamp(min=0).unsqueeze(1)
    tokens = logits.argmax(dim=-1)
    accepted = has_draft & (tokens == draft_ids)
    if not meta.all_greedy:
        probs = sampler.probs(logits, meta)
        u = uniforms(meta, probs.device)
        random_accepted = has_draft & (u < probs.gather(1, draft).squeeze(1))
        residual = torch.where(has_draft.unsqueeze(1), probs.scatter(1, draft, 0.0), probs)
        residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, probs)  # p(d) = 1: never used
        random_tokens = torch.where(random_accepted, draft_ids, sampler.draw(residual, meta))
        tokens = torch.where(meta.is_greedy, tokens, random_tokens)
        accepted = torch.where(meta.is_greedy, accepted, random_accepted)
    out = VerifiedOutput(sampled_token_ids=tokens, accepted=accepted)
    if raw_logprobs is not None:
        sampler.gather_logprobs(raw_logprobs, tokens, meta.max_num_logprobs, out)
    return out


def emitted_rows(accepted: list[bool], first_row: int, num_drafts: int) -> int:
    """How many of a sequence's rows (first_row .. first_row + num_drafts) it emits: the accepted guesses
    and the row after them (a replacement for the first rejected guess, or the bonus token)."""
    n = 0
    while n < num_drafts and accepted[first_row + n]:
        n += 1
    return n + 1


def split_verified(out: ModelRunnerOutput, num_drafts: list[int], accepted: list[bool]) -> None:
    """Rows of a verify step -> per sequence: the accepted guesses, then the one sampled token after them."""
    tokens, logprobs = out.sampled_token_ids, out.logprobs
    out.sampled_token_ids, out.spec_accepted_token_ids = [], []
    out.logprobs = [] if logprobs is not None else None
    out.spec_logprobs = [] if logprobs is not None else None
    first = 0
    for d in num_drafts:
        n = emitted_rows(accepted, first, d)
        out.spec_accepted_token_ids.append(tokens[first : first + n - 1])
        out.sampled_token_ids.append(tokens[first + n - 1])
        if logprobs is not None:
            out.spec_logprobs.append(logprobs[first : first + n - 1])
            out.logprobs.append(logprobs[first + n - 1])
        first += d + 1
