"""What the engine core asks of a proposer, and which one a SpeculativeConfig picks."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from novainfer.engine.sequence import Sequence

if TYPE_CHECKING:
    from novainfer.config import SpeculativeConfig


class Proposer:
    """Guesses up to num_tokens[i] next tokens for seqs[i], each a running sequence whose KV is computed up to
    its last token. Guesses only change speed: every one is verified by the target model."""

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        raise NotImplementedError

    def on_verified(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """A step checked num_drafted of seq's guesses and accepted the first num_accepted."""

    def remove(self, seq_ids: list[int]) -> None:
        """Forget finished sequences."""


def make_proposer(config: "SpeculativeConfig", executor: Any) -> Proposer:
    """The proposer for config.method; the draft model lives with the workers, reached through the executor."""
    if config.method == "ngram":
        from novainfer.spec_decode.ngram_proposer import NgramProposer
        verify_is_cheap = executor.config.resolve_device().type == "cuda"  # a verify step costs about a decode step
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, scale_by_match=not verify_is_cheap)
    from novainfer.spec_decode.draft_model_proposer import DraftModelProposer
    return DraftModelProposer(executor)
