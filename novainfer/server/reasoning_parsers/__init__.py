"""Reasoning parsers (vLLM's names): split a thinking model's output into `reasoning_content` and `content`.
`choose_reasoning_parser` picks one from the model's chat template; `--reasoning-parser` overrides it."""

from __future__ import annotations

from novainfer.server.reasoning_parsers.think import ThinkReasoningParser

# Qwen3 / Qwen3.5 / 3.6 and the DeepSeek-R1 distills all write `<think>...</think>`; the templates differ only in
# whether the prompt already opens the block, which the parser reads from the prompt itself
REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    "deepseek_r1": ThinkReasoningParser,
    "qwen3": ThinkReasoningParser,
}


def choose_reasoning_parser(chat_template: str | None) -> str | None:
    """The reasoning parser for a model whose chat template writes `<think>` blocks, else None."""
    template = chat_template or ""
    return "qwen3" if "<think>" in template and "</think>" in template else None


def get_reasoning_parser(name: str, prompt_tail: str) -> ThinkReasoningParser:
    """A parser for one output; prompt_tail: the end of the rendered prompt (it may open the reasoning)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name](prompt_tail)


__all__ = ["REASONING_PARSERS", "ThinkReasoningParser", "choose_reasoning_parser", "get_reasoning_parser"]
