"""Hermes-style calls, as Qwen2.5 and Qwen3 write them: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
from __future__ import annotations

from novainfer.server.tool_parsers.base import ParsedCall, ToolParser, json_call_at

_END = "</tool_call>"


class HermesToolParser(ToolParser):
    start_marker = "<tool_call>"

    def extract(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedCall]]:
        at = text.find(self.start_marker)
        if at < 0:
            return text, []
        calls, pos = [], at
        while pos >= 0:
            call, end = json_call_at(text, pos + len(self.start_marker))
            if call is not None and (call.complete or not final):
                calls.append(call)
            if call is None or not call.complete:
                break
            pos = text.find(self.start_marker, end)
        if final and not calls:  # no call parsed: the model only wrote text that looked like one
            return text, []
        return text[:at].strip() or None, calls
