"""Tool-call output parsers, chosen per model with `--tool-call-parser` (vLLM's names): each finds the calls a
model wrote in its own format and the plain content around them."""
from __future__ import annotations

from novainfer.server.tool_parsers.base import ParsedCall, ToolParser
from novainfer.server.tool_parsers.hermes import HermesToolParser
from novainfer.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


__all__ = ["ParsedCall", "ToolParser", "TOOL_PARSERS", "get_tool_parser"]
