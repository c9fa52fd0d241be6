"""SpeculativeConfig: vLLM's `speculative_config` (a proposer guesses, one target forward checks)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): a proposer guesses up to num_speculative_tokens
    tokens per sequence and one target forward checks them all (spec_decode/)."""

    method: str = "ngram"  # "ngram" (prompt lookup, no extra model) or "draft_model"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1  # ngram: shortest suffix n-gram matched
    prompt_lookup_max: int = 3  # ngram: longest suffix n-gram tried first
    model: str | None = None  # draft_model: the draft checkpoint (same tokenizer/vocabulary as the target)
    disable_by_batch_size: int | None = None  # no guesses while this many sequences or more are running

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a dict (or a JSON string from the command line); unknown keys are refused by name."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"speculative_config has unknown field(s) {unknown}; known: {sorted(cls.__dataclass_fields__)}"
            )
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Reject values that can never work, naming the field."""
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config.method must be 'ngram' or 'draft_model', got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model (the draft checkpoint) is required for method 'draft_model'")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config.disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config.model is only used by method 'draft_model'")

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past a step's tokens that the proposer writes (a draft model's guesses), per sequence."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0
