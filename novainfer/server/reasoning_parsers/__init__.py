"""Reasoning parsers (vLLM's names): split a thinking model's output into `reasoning_content` and `content`.
`choose_reasoning_parser` picks one from the model's chat template; `--reasoning-parser` overrides it."""

from __future__ import annotations

from novainfer.server.reasoning_parsers.harmony import HarmonyReasoningParser
from novainfer.server.reasoning_parsers.think import ThinkReasoningParser

ReasoningParser = ThinkReasoningParser | HarmonyReasoningParser

# Qwen3 / Qwen3.5 / 3.6 and the DeepSeek-R1 distills all write `<think>...</think>`; the templates differ only in
# whether the prompt already opens the block, which the parser reads from the prompt itself
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": ThinkReasoningParser,
    "qwen3": ThinkReasoningParser,
    "openai_gptoss": HarmonyReasoningParser,  # gpt-oss's harmony channels (vLLM's name)
}
HARMONY_PARSERS = frozenset({"openai_gptoss"})


def choose_reasoning_parser(chat_template: str | None) -> str | None:
    """The reasoning parser for a model whose chat template writes `<think>` blocks or harmony channels, else
    None."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return "openai_gptoss"
    return "qwen3" if "<think>" in template and "</think>" in template else None


def get_reasoning_parser(name: str, prompt_tail: str) -> ReasoningParser:
    """A parser for one output; prompt_tail: the end of the rendered prompt (it may open the reasoning)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name](prompt_tail)


__all__ = [
    "HARMONY_PARSERS",
    "REASONING_PARSERS",
    "HarmonyReasoningParser",
    "ReasoningParser",
    "ThinkReasoningParser",
    "choose_reasoning_parser",
    "get_reasoning_parser",
]
