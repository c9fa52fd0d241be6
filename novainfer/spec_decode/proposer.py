"""What the engine core asks of a proposer (spec_decode/__init__.py picks one for a SpeculativeConfig)."""

from __future__ import annotations

from novainfer.sequence import Sequence


class Proposer:
    """Guesses up to num_tokens[i] next tokens for seqs[i], each a running sequence whose KV is computed up to
    its last token. Guesses only change speed: every one is verified by the target model."""

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        raise NotImplementedError

    def on_verified(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """A step checked num_drafted of seq's guesses and accepted the first num_accepted."""

    def remove(self, seq_ids: list[int]) -> None:
        """Forget finished sequences."""
