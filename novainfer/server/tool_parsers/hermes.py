"""Hermes-style calls, as Qwen2.5 and Qwen3 write them: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

from novainfer.server.tool_parsers.base import ParsedCall, ToolParser, json_call_at


class HermesToolParser(ToolParser):
    start_marker = "<tool_call>"

    def extract(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedCall]]:
        return self.marked_calls(text, final, json_call_at)
