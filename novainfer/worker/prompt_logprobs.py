"""Log-probabilities of prompt tokens (SamplingParams.prompt_logprobs), computed from a step's hidden states.

A prefill chunk covering prompt positions [start, start + n) yields the logprob of each next prompt token
token_ids[p + 1] for p < num_prompt_tokens - 1 (the last prompt position predicts the first output token,
which the sampler handles). Chunked prefill thus produces them chunk by chunk; a request that asks for them
does not read the prefix cache (engine/block_manager.py), so every position is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SLICE = 256  # rows per logits pass: [rows, vocab] float32 at a time, not the whole prompt's


@dataclass
class PromptLogprobRows:
    """One sequence's prompt positions in a step: packed hidden rows, the tokens they predict, top-k wanted."""

    seq_id: int
    start: int  # prompt position of the first row; its logprob is that of token start + 1
    rows: list[int]
    targets: list[int]
    k: int


def plan_prompt_logprobs(seq, start: int, num_new: int, first_row: int) -> PromptLogprobRows | None:
    """The rows of this chunk whose next-token logprobs are prompt logprobs, or None if it has none."""
    k = seq.sampling_params.prompt_logprobs
    end = min(start + num_new, seq.num_prompt_tokens - 1)
    if k is None or seq.index != 0 or end <= start:
        return None
    return PromptLogprobRows(
        seq.seq_id, start, list(range(first_row, first_row + end - start)), seq.token_ids[start + 1 : end + 1], k
    )


def compute_prompt_logprobs(
    model, hidden: torch.Tensor, plans: list[PromptLogprobRows]
) -> dict[int, tuple[int, list[list[tuple[int, float, int]]]]]:
    """seq_id -> (start, one entry per row: [(target, logprob, rank), then the top k as (id, logprob, rank)])."""
    out = {}
    for plan in plans:
        entries: list[list[tuple[int, float, int]]] = []
        for s in range(0, len(plan.rows), _SLICE):
            idx = torch.tensor(plan.rows[s : s + _SLICE], device=hidden.device)
            targets = torch.tensor(plan.targets[s : s + _SLICE], device=hidden.device).unsqueeze(1)
            logprobs = torch.log_softmax(model.compute_logits(hidden[idx]).float(), dim=-1)
            chosen = logprobs.gather(1, targets)
            ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
            top = logprobs.topk(plan.k, dim=-1) if plan.k > 0 else None
            top_ids, top_lps = (top.indices.tolist(), top.values.tolist()) if top is not None else ([], [])
            for r, (t, lp) in enumerate(zip(targets.squeeze(1).tolist(), chosen.squeeze(1).tolist())):
                row = [(t, lp, ranks[r])]
                if top is not None:
                    row += [(top_ids[r][j], top_lps[r][j], j + 1) for j in range(plan.k)]
                entries.append(row)
        out[plan.seq_id] = (plan.start, entries)
    return out
