"""Gemma 4's calls: `<|tool_call>call:name{key:<|"|>text<|"|>,n:3,flag:true,xs:[1,2],o:{k:v}}<tool_call|>`.
Keys are bare, strings sit between `<|"|>` tokens (unescaped), everything else is written as in JSON."""

from __future__ import annotations

import json
import re
from typing import Any

from novainfer.server.tool_parsers.base import ParsedCall, ToolParser, arguments_json

_QUOTE = '<|"|>'
_NAME = re.compile(r"\s*call:([^{\s]+)\{")
_KEY = re.compile(r"\s*([^:{}\[\],\s]+|<\|\"\|>.*?<\|\"\|>)\s*:", re.DOTALL)
_SCALAR = re.compile(r"\s*([^,}\]\s]+)")


class _Incomplete(Exception):
    """The text ends inside a value."""


class _Values:
    """A recursive reader of Gemma 4's argument syntax."""

    def __init__(self, text: str):
        self.text = text

    def skip(self, pos: int) -> int:
        while pos < len(self.text) and self.text[pos].isspace():
            pos += 1
        if pos >= len(self.text):
            raise _Incomplete
        return pos

    def pairs(self, pos: int, out: list[tuple[str, Any]]) -> int:
        """Read `k:v,...}` from pos into out (as far as it is complete); the position after the `}`."""
        while True:
            pos = self.skip(pos)
            if self.text[pos] == "}":
                return pos + 1
            m = _KEY.match(self.text, pos)
            if m is None:
                if ":" not in self.text[pos:] and _QUOTE not in self.text[pos:]:
                    raise _Incomplete
                raise ValueError(f"no key at {pos}")
            key = m.group(1)
            key = key[len(_QUOTE) : -len(_QUOTE)] if key.startswith(_QUOTE) else key
            value, pos = self.value(m.end())
            out.append((key, value))
            pos = self.skip(pos)
            if self.text[pos] == ",":
                pos += 1

    def value(self, pos: int) -> tuple[Any, int]:
        pos = self.skip(pos)
        if self.text.startswith(_QUOTE, pos):
            end = self.text.find(_QUOTE, pos + len(_QUOTE))
            if end < 0:
                raise _Incomplete
            return self.text[pos + len(_QUOTE) : end], end + len(_QUOTE)
        if _QUOTE.startswith(self.text[pos:]):
            raise _Incomplete
        ch = self.text[pos]
        if ch == "{":
            items: list[tuple[str, Any]] = []
            end = self.pairs(pos + 1, items)
            return dict(items), end
        if ch == "[":
            values, pos = [], pos + 1
            while True:
                pos = self.skip(pos)
                if self.text[pos] == "]":
                    return values, pos + 1
                v, pos = self.value(pos)
                values.append(v)
                pos = self.skip(pos)
                if self.text[pos] == ",":
                    pos += 1
        m = _SCALAR.match(self.text, pos)
        if m.end() >= len(self.text):
            raise _Incomplete  # a number may still grow
        try:
            return json.loads(m.group(1)), m.end()
        except ValueError:
            return m.group(1), m.end()  # a bare word: text


class Gemma4ToolParser(ToolParser):
    start_marker = "<|tool_call>"
    needs_special_tokens = True

    def extract(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedCall]]:
        return self.marked_calls(text, final, _read_call)


def _read_call(text: str, pos: int) -> tuple[ParsedCall | None, int]:
    """The `call:name{...}` at pos: complete, partial (its complete top-level arguments), or None."""
    m = _NAME.match(text, pos)
    if m is None:
        return None, pos
    items: list[tuple[str, Any]] = []
    try:
        end = _Values(text).pairs(m.end(), items)
    except _Incomplete:
        return ParsedCall(m.group(1), arguments_json(items, False), complete=False), len(text)
    except ValueError:
        return None, pos
    return ParsedCall(m.group(1), arguments_json(items, True)), end
