"""The tool-parser interface: whole-output extraction, partial extraction for streaming, and the JSON pieces
several formats share."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

_DECODER = json.JSONDecoder()
_JSON_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object; while streaming, a prefix of the final text
    complete: bool = True


def call_from_json(obj: object, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    """A ParsedCall from {"name": ..., "arguments"|"parameters": {...}}, or None if obj is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def json_call_at(text: str, pos: int) -> tuple[ParsedCall | None, int]:
    """The `{"name": ..., "arguments": {...}}` object starting at pos (whitespace skipped) and the position after
    it. Incomplete, it is a partial call (complete=False, arguments as written so far) once its name is known,
    else None; the end is then len(text). Arguments keep the model's own text, so streamed prefixes stay
    prefixes of the final value."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    head = _JSON_HEAD.match(text, pos)
    if head is None:
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None, len(text)
        return call_from_json(obj), end
    name = json.loads(f'"{head.group(1)}"')
    try:
        _, args_end = _DECODER.raw_decode(text, head.end())
    except ValueError:
        return ParsedCall(name, text[head.end() :].rstrip(), complete=False), len(text)
    close = args_end
    while close < len(text) and text[close].isspace():
        close += 1
    if close >= len(text):
        return ParsedCall(name, text[head.end() : args_end], complete=False), len(text)
    if text[close] != "}":
        return None, close
    return ParsedCall(name, text[head.end() : args_end]), close + 1


def json_call_list(text: str, pos: int, final: bool, separators: str = " \n\t,]") -> list[ParsedCall]:
    """The call objects from pos on, between separators (a JSON list's by default); complete ones only when
    final."""
    calls = []
    while pos < len(text):
        call, pos = json_call_at(text, pos)
        if call is None or (final and not call.complete):
            break
        calls.append(call)
        while pos < len(text) and text[pos] in separators:
            pos += 1
    return calls


def arguments_json(items: list[tuple[str, Any]], complete: bool) -> str:
    """The JSON text of an arguments object from (key, value) pairs; without its closing brace until complete,
    so each partial text is a prefix of the final one."""
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in items)
    return "{" + body + ("}" if complete else "")


def partial_tail(text: str, marker: str) -> int:
    """How many characters at text's end may be the beginning of marker (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolParser(ABC):
    # the text that opens the tool-call part of an output; streams hold back what may be its beginning
    start_marker: str = ""
    # the format's markers are special tokens: the output must be detokenized with them
    needs_special_tokens: bool = False

    def __init__(self, tools: list[dict] | None = None):
        """tools: the request's tools (as chat templates take them), for formats that type their values."""
        self.tools = tools or []

    @abstractmethod
    def extract(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedCall]]:
        """(content before the calls or None, the calls). final=False: the output so far, whose last call may be
        partial (complete=False); an output that only looked like calls is content when final."""

    def marked_calls(
        self, text: str, final: bool, read: Callable[[str, int], tuple[ParsedCall | None, int]]
    ) -> tuple[str | None, list[ParsedCall]]:
        """extract() for formats that open every call with start_marker: read(text, pos) reads the call after
        the marker at pos (a partial one as complete=False, or None) and says where it ends."""
        at = text.find(self.start_marker)
        if at < 0:
            return text, []
        calls, pos = [], at
        while pos >= 0:
            call, end = read(text, pos + len(self.start_marker))
            if call is not None and (call.complete or not final):
                calls.append(call)
            if call is None or not call.complete:
                break
            pos = text.find(self.start_marker, end)
        if final and not calls:  # no call parsed: the model only wrote text that looked like one
            return text, []
        return text[:at].strip() or None, calls

    def content_end(self, text: str) -> int:
        """Where content stops in a partial output: at the marker, or before a tail that may begin it."""
        at = text.find(self.start_marker)
        if at >= 0:
            return at
        return len(text) - partial_tail(text, self.start_marker)

    def parameter_schema(self, function: str) -> dict:
        """The JSON schema of a function's parameters among the request's tools ({} when unknown)."""
        for t in self.tools:
            f = t.get("function", t)
            if f.get("name") == function:
                return f.get("parameters") or {}
        return {}
