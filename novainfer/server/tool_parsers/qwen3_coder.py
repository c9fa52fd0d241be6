"""Qwen3-Coder's XML calls (also Qwen3.5 / 3.6): `<tool_call>\\n<function=name>\\n<parameter=p>\\nvalue\\n</parameter>
\\n</function>\\n</tool_call>`. Values are raw text, typed by the function's schema (a string stays a string)."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from novainfer.server.tool_parsers.base import ParsedCall, ToolParser, arguments_json

_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?=</parameter>|<parameter=|</function>)", re.DOTALL)
_FUNCTION_END = "</function>"


def typed_value(raw: str, schema: dict) -> Any:
    """A parameter's raw text as its schema's type says (strings stay as written); untyped text becomes JSON
    when it parses as JSON."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds or (kind is None and "enum" in schema and all(isinstance(e, str) for e in schema["enum"])):
        return raw
    if raw.strip() == "null" and (kind is None or "null" in kinds):
        return None
    try:
        return json.loads(raw)
    except ValueError:
        pass
    if kinds[0] in ("object", "array"):
        try:
            return ast.literal_eval(raw)  # Python-style literals ('a', True) as some models write them
        except (ValueError, SyntaxError):
            pass
    return raw


class Qwen3CoderToolParser(ToolParser):
    start_marker = "<tool_call>"

    def extract(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedCall]]:
        at = text.find(self.start_marker)
        if at < 0:
            at = text.find("<function=")  # some outputs drop the outer tag
            if at < 0:
                return text, []
        calls = []
        for m in _FUNCTION.finditer(text, at):
            name = m.group(1).strip()
            end = text.find(_FUNCTION_END, m.end())
            body = text[m.end() :] if end < 0 else text[m.end() : end]
            props = self.parameter_schema(name).get("properties") or {}
            items = []
            for p in _PARAM.finditer(body if end >= 0 else body + "</function>"):
                closed = end >= 0 or body.find("</parameter>", p.start()) >= 0 or body.find("<parameter=", p.end()) >= 0
                if not closed:
                    break
                key = p.group(1).strip()
                items.append((key, typed_value(p.group(2), props.get(key) or {})))
            if end < 0:
                if not final:
                    calls.append(ParsedCall(name, arguments_json(items, False), complete=False))
                break
            calls.append(ParsedCall(name, arguments_json(items, True)))
        if final and not calls:
            return text, []
        return text[:at].strip() or None, calls
