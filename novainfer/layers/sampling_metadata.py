"""What the sampler takes and gives: each row's parameters (SamplingRow), the batch's tensors
(SamplingMetadata) and the sampled tokens (SamplerOutput); apart from sampler.py so its helpers can read them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from novainfer.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row of logits to sample, with what its parameters need to know about its history."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    blocked_token_ids: list[int] = field(default_factory=list)  # e.g. eos while under min_tokens


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [rows]; 1.0 for greedy rows (they take the argmax anyway)
    is_greedy: torch.Tensor  # [rows] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [rows] int64, vocab size = off; None when no row uses it
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    repetition_penalty: torch.Tensor | None  # [rows, 1]
    frequency_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    output_counts: torch.Tensor | None  # [rows, vocab] occurrences of each token in the output
    seen_mask: torch.Tensor | None  # [rows, vocab] token occurs in prompt or output
    blocked: tuple[torch.Tensor, torch.Tensor] | None  # (row indices, token ids) to set to -inf
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row indices, token ids, biases)
    generators: list[torch.Generator | None]
    max_num_logprobs: int  # -1: no row wants logprobs

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> "SamplingMetadata":
        ps = [r.params for r in rows]
        f32 = dict(dtype=torch.float32, device=device)
        greedy = [p.is_greedy for p in ps]

        def column(values: list, dtype=torch.float32, unsqueeze: bool = False) -> torch.Tensor:
            t = torch.tensor(values, dtype=dtype, device=device)
            return t.unsqueeze(1) if unsqueeze else t

        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in ps]
        use_rep = any(p.repetition_penalty != 1.0 for p in ps)
        use_freq_pres = any(p.frequency_penalty or p.presence_penalty for p in ps)
        counts = seen = None
        if use_rep or use_freq_pres:
            counts = _token_counts([r.output_token_ids for r in rows], vocab_size, device)
        if use_rep:
            seen = (_token_counts([r.prompt_token_ids for r in rows], vocab_size, device) > 0) | (counts > 0)
        blocked_pairs = [(i, t) for i, r in enumerate(rows) for t in r.blocked_token_ids if t < vocab_size]
        bias = [(i, t, b) for i, p in enumerate(ps) for t, b in (p.logit_bias or {}).items() if t < vocab_size]
        logit_bias = None
        if bias:
            logit_bias = (
                column([b[0] for b in bias], torch.long),
                column([b[1] for b in bias], torch.long),
                column([b[2] for b in bias]),
            )
        blocked = None
        if blocked_pairs:
            idx = torch.tensor(blocked_pairs, dtype=torch.long, device=device)
            blocked = (idx[:, 0], idx[:, 1])
        return cls(
            temperature=torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, ps)], **f32),
            is_greedy=column(greedy, torch.bool),
            all_greedy=all(greedy),
            top_k=column(top_k, torch.long) if any(k < vocab_size for k in top_k) else None,
            top_p=column([p.top_p for p in ps]) if any(p.top_p < 1.0 for p in ps) else None,
            min_p=column([p.min_p for p in ps]) if any(p.min_p > 0 for p in ps) else None,
            repetition_penalty=column([p.repetition_penalty for p in ps], unsqueeze=True) if use_rep else None,
            frequency_penalty=column([p.frequency_penalty for p in ps], unsqueeze=True) if use_freq_pres else None,
            presence_penalty=column([p.presence_penalty for p in ps], unsqueeze=True) if use_freq_pres else None,
            output_counts=counts,
            seen_mask=seen,
            blocked=blocked,
            logit_bias=logit_bias,
            generators=[r.generator for r in rows],
            max_num_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [rows] int64
    logprob_token_ids: torch.Tensor | None = None  # [rows, 1 + N]: the sampled token, then the top N
    logprobs: torch.Tensor | None = None  # [rows, 1 + N] float32
    sampled_token_ranks: torch.Tensor | None = None  # [rows], 1 = most likely


def _token_counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[rows, vocab] count of each token id in each row's list, built with one scatter."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    if width:
        padded = torch.tensor([t + [vocab_size] * (width - len(t)) for t in token_lists], device=device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]
