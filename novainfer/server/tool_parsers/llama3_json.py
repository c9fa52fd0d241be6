"""Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several joined
by `;`. An output is a call only when it starts with one (as vLLM's llama3_json parser)."""

from __future__ import annotations

from novainfer.server.tool_parsers.base import ParsedCall, ToolParser, json_call_list

_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    start_marker = "{"
    needs_special_tokens = True  # <|python_tag|>

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(("{", _TAG)) or _TAG.startswith(stripped):
            return 0  # a call (or possibly one) from the start: no content
        return len(text)

    def extract(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(_TAG):
            body = body[len(_TAG) :].lstrip()
        if not body.startswith("{"):
            return text, []
        calls = json_call_list(body, 0, final, separators=" \n\t;")
        if final and not calls:
            return text, []
        return None, calls
