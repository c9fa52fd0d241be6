"""Speculation counters of one engine core (vLLM's names): drafts are sequence-steps that verified guesses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # sequence-steps that verified at least one guess
    num_draft_tokens: int = 0  # guesses verified
    num_accepted_tokens: int = 0  # guesses accepted
    num_emitted_tokens: int = 0  # tokens those steps appended (accepted guesses plus the sampled one, cut at a stop)

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += emitted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verified sequence-step (1.0: no guess ever accepted)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
