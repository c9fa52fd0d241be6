"""gpt-oss's calls, in harmony: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`,
after any reasoning; the content is the `final` channel's (harmony.py reads the channels)."""

from __future__ import annotations

from novainfer.server.harmony import CHANNEL, call_name, split_completion
from novainfer.server.tool_parsers.base import ParsedCall, ToolParser


class OpenAIToolParser(ToolParser):
    start_marker = CHANNEL
    needs_special_tokens = True

    def extract(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedCall]]:
        split = split_completion(text, final)
        calls = [ParsedCall(call_name(m), m.content, complete=m.end is not None) for m in split.calls]
        return split.content, [c for c in calls if c.complete or not final]
