"""Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several joined
by `;`. An output is a call only when it starts with one (as vLLM's llama3_json parser)."""
from __future__ import annotations

import json

from novainfer.server.tool_parsers.base import ParsedCall, ToolParser, call_from_json

_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    start_marker = "{"

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(("{", _TAG)) or _TAG.startswith(stripped):
            return 0  # a call (or possibly one) from the start: no content
        return len(text)

    def extract(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(_TAG):
            body = body[len(_TAG):].lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                break
            call = call_from_json(obj)
            if call is None:
                break
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        if final and (not calls or pos < len(body)):
            return (text, []) if not calls else (None, calls)
        return None, calls
