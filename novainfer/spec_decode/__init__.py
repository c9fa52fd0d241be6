"""Speculative decoding: a proposer guesses the next tokens of each sequence, one target forward checks them.

proposer.py             the interface the engine core calls after each step (make_proposer, here, picks one)
ngram_proposer.py       prompt lookup: the tokens that followed the last earlier match of the suffix
draft_model_proposer.py a small model with the same vocabulary, run by the worker (worker/draft_model_runner.py)
rejection_sampler.py    acceptance that keeps the target model's distribution (greedy: argmax match)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from novainfer.config import SpeculativeConfig
    from novainfer.spec_decode.proposer import Proposer


def make_proposer(config: SpeculativeConfig, executor: Any) -> Proposer:
    """The proposer for config.method; the draft model lives with the workers, reached through the executor."""
    if config.method == "ngram":
        from novainfer.spec_decode.ngram_proposer import NgramProposer

        verify_is_cheap = executor.config.resolve_device().type == "cuda"  # a verify step costs about a decode step
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, scale_by_match=not verify_is_cheap)
    from novainfer.spec_decode.draft_model_proposer import DraftModelProposer

    return DraftModelProposer(executor)
