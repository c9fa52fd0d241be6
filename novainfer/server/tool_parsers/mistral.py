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
        if at < 0:
            return text, []
        rest = text[at + len(self.start_marker):].lstrip()
        calls = json_call_list(rest, 1, final) if rest.startswith("[") else self._named(rest, final)
        if final and not calls:
            return text, []
        return text[:at].strip() or None, calls

    def _named(self, rest: str, final: bool) -> list[ParsedCall]:
        calls = []
        for part in rest.split(self.start_marker):
            name, sep, args = part.partition(_ARGS)
            if not sep:
                break
            args = args.strip()
            try:
                _, end = _DECODER.raw_decode(args)
            except ValueError:
                if not final and name.strip():
                    calls.append(ParsedCall(name.strip(), args, complete=False))
                break
            calls.append(ParsedCall(name.strip(), args[:end]))
        return calls
