"""The grammar-engine interface: compile a constraint once, then follow one sequence's tokens with a matcher."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from novainfer.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # grammars compile in the server's front-end, which never imports torch; bitmasks are the core's
    import torch


class GrammarMatcher(ABC):
    """One sequence's position in a compiled grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens (one bit per token id, int32 words) into bitmask[row]."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and only an end-of-sequence token may follow."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the grammar's start, as if no token had been accepted."""


class CompiledGrammar(ABC):
    """A constraint compiled for one tokenizer; shared by every sequence that uses it."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""


class StructuredOutputBackend(ABC):
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile the constraint; ValueError (naming what is wrong) for an invalid one."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32
