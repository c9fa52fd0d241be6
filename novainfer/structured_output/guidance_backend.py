"""The llguidance backend (the grammar engine measured and chosen in docs/ARCHITECTURE.md).

JSON is compiled with fixed separators (", " and ": ") and no other whitespace, so a constrained output can
never spend its tokens on whitespace. Grammars are Lark (llguidance's format, as vLLM's guidance backend);
GBNF is converted.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf

from novainfer.sampling_params import StructuredOutputsParams
from novainfer.structured_output.backend import CompiledGrammar, GrammarMatcher, StructuredOutputBackend

if TYPE_CHECKING:  # compiling needs no torch (the server's front-end compiles); filling bitmasks (the core) does
    import torch

# llguidance builds a regex's lexer lazily: nested bounded repeats past this fail mid-generation ("too many
# expressions constructed") after seconds of work, so they are refused when the request arrives
MAX_REGEX_EXPANSION = 100_000
# bounded whitespace: exactly one space after "," and ":", none elsewhere
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher):
        self.m = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.m.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.m, bitmask, row)

    def is_terminated(self) -> bool:
        return self.m.is_stopped()

    def reset(self) -> None:
        self.m.reset()


class GuidanceGrammar(CompiledGrammar):
    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str):
        self.tokenizer, self.grammar = tokenizer, grammar

    def matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0))


class GuidanceBackend(StructuredOutputBackend):
    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: set[int]):
        # the grammar's end is allowed as any of the model's eos ids (the first one is llguidance's "eos")
        eos = sorted(eos_token_ids)
        if hf_tokenizer.eos_token_id in eos:
            eos.remove(hf_tokenizer.eos_token_id)
            eos.insert(0, hf_tokenizer.eos_token_id)
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos or None)

    def compile(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        grammar = self._grammar_text(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"invalid structured output constraint: {messages[0]}")
        return GuidanceGrammar(self.tokenizer, grammar)

    @staticmethod
    def _grammar_text(p: StructuredOutputsParams) -> str:
        if p.json is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(p.json, overrides=JSON_OPTIONS)
        if p.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if p.regex is not None:
            expansion = regex_expansion(p.regex)
            if expansion is not None and expansion > MAX_REGEX_EXPANSION:
                raise ValueError(
                    f"invalid structured output constraint: the regex's bounded repeats expand to "
                    f"{expansion} positions; at most {MAX_REGEX_EXPANSION} are allowed"
                )
            return llguidance.LLMatcher.grammar_from_regex(p.regex)
        if p.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(p.choice))
        try:
            return llguidance.grammar_from("grammar", p.grammar)
        except ValueError as exc:
            raise ValueError(f"invalid structured output grammar: {exc}") from None


def regex_expansion(pattern: str) -> int | None:
    """How many positions the regex spells out once its bounded repeats are unrolled (an unbounded repeat counts
    once); None when Python's parser does not read it (llguidance then judges it alone)."""
    import re._constants as c
    import re._parser as sre_parse

    try:
        tree = sre_parse.parse(pattern)
    except Exception:  # another dialect's syntax
        return None

    def size(items) -> int:
        total = 0
        for op, av in items:
            if op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
                lo, hi, sub = av
                total += max(1, lo if hi == c.MAXREPEAT else hi) * size(sub)
            elif op is c.SUBPATTERN:
                total += size(av[-1])
            elif op is c.ATOMIC_GROUP:
                total += size(av)
            elif op is c.BRANCH:
                total += sum(size(branch) for branch in av[1])
            elif op in (c.ASSERT, c.ASSERT_NOT):
                total += size(av[1])
            else:
                total += 1
        return total

    return size(tree)
