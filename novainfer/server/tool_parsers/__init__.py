"""Tool-call output parsers (vLLM's names): each finds the calls a model wrote in its own format and the plain
content around them. `choose_tool_parser` picks one from the model's chat template and architecture;
`--tool-call-parser` overrides it."""

from __future__ import annotations

from novainfer.server.tool_parsers.base import ParsedCall, ToolParser
from novainfer.server.tool_parsers.gemma4 import Gemma4ToolParser
from novainfer.server.tool_parsers.hermes import HermesToolParser
from novainfer.server.tool_parsers.llama3_json import Llama3JsonToolParser
from novainfer.server.tool_parsers.mistral import MistralToolParser
from novainfer.server.tool_parsers.openai import OpenAIToolParser
from novainfer.server.tool_parsers.pythonic import PythonicToolParser
from novainfer.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "llama3_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,
    "mistral": MistralToolParser,
    "gemma4": Gemma4ToolParser,
    "openai": OpenAIToolParser,  # gpt-oss's harmony
}

# (parser, what the chat template contains), first match wins: the template shows the model its call format
_TEMPLATE_SIGNS: list[tuple[str, tuple[str, ...]]] = [
    ("openai", ("<|channel|>",)),
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("gemma4", ("<|tool_call>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("hermes", ("<tool_call>",)),
    ("pythonic", ("<|python_start|>",)),
    ("pythonic", ("[func_name1(",)),
    ("llama3_json", ("<|python_tag|>",)),
    ("llama3_json", ('"parameters": dictionary of argument name',)),
]
# (parser, architecture name prefix), when the template says nothing
_ARCH_SIGNS = [
    ("pythonic", "Llama4"),
    ("llama3_json", "Llama"),
    ("mistral", "Mistral"),
    ("gemma4", "Gemma4"),
    ("hermes", "Qwen"),
    ("openai", "GptOss"),
]


def choose_tool_parser(chat_template: str | None, architectures: list[str] | None = None) -> str:
    """The parser for a model's own tool-call format; hermes when nothing names one (such a model is shown the
    tools, and how to call them, in Hermes-style system text)."""
    template = chat_template or ""
    for name, signs in _TEMPLATE_SIGNS:
        if all(s in template for s in signs):
            return name
    if "tools" in template:  # the template reads tools but shows no known format: guess from the architecture
        for name, prefix in _ARCH_SIGNS:
            if any(a.startswith(prefix) for a in architectures or []):
                return name
    return "hermes"


def get_tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """A parser instance for one request (tools: the request's tools, which type some formats' values)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name](tools)


__all__ = ["ParsedCall", "ToolParser", "TOOL_PARSERS", "choose_tool_parser", "get_tool_parser"]
