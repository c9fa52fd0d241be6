"""Mistral's calls after the `[TOOL_CALLS]` token: a JSON list `[{"name": ..., "arguments": {...}}]` (v3
tokenizers) or, from the v11 tokenizers on, `name[ARGS]{...}` repeated after each `[TOOL_CALLS]`."""

from __future__ import annotations

import json

from novainfer.server.tool_parsers.base import ParsedCall, ToolParser, json_call_list

_ARGS = "[ARGS]"
_DECODER = json.JSONDecoder()


class MistralToolParser(ToolParser):
    start_marker = "[TOOL_CALLS]"
    needs_special_tokens = True

    def extract(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedCall]]:
        at = text.find(self.start_marker)
        if at >= 0 and text[at + len(self.start_marker) :].lstrip().startswith("["):  # the v3 JSON list
            calls = json_call_list(text[at + len(self.start_marker) :].lstrip(), 1, final)
            if final and not calls:
                return text, []
            return text[:at].strip() or None, calls
        return self.marked_calls(text, final, _read_named)


def _read_named(text: str, pos: int) -> tuple[ParsedCall | None, int]:
    """The `name[ARGS]{...}` at pos: complete, partial once the name is known, or None."""
    sep = text.find(_ARGS, pos)
    name = text[pos:sep].strip() if sep >= 0 else ""
    if not name or "[" in name:
        return None, pos
    start = sep + len(_ARGS)
    while start < len(text) and text[start].isspace():
        start += 1
    try:
        _, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return ParsedCall(name, text[start:].rstrip(), complete=False), len(text)
    return ParsedCall(name, text[start:end]), end
