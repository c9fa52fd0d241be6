"""Hermes-style calls, as Qwen2.5 and Qwen3 write them: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
from __future__ import annotations

import json
import re

from novainfer.server.tool_parsers.base import ParsedCall, ToolParser, call_from_json

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    start_marker = "<tool_call>"

    def extract(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedCall]]:
        at = text.find(self.start_marker)
        if at < 0:
            return text, []
        calls = []
        for m in _CALL.finditer(text, at):
            if not m.group(2) and not final:  # still being written
                break
            try:
                call = call_from_json(json.loads(m.group(1)))
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        if not calls and final:  # no call parsed: the model only wrote text that looked like one
            return text, []
        content = text[:at].strip()
        return content or None, calls
