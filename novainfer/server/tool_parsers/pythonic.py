"""Pythonic calls, as Llama 3.2 / Llama 4 write them: `[get_weather(city="Paris", days=2), get_time()]`,
optionally between `<|python_start|>` and `<|python_end|>`. Arguments are Python literals."""

from __future__ import annotations

import ast
import json
from typing import Any

from novainfer.server.tool_parsers.base import ParsedCall, ToolParser, arguments_json

_START, _END = "<|python_start|>", "<|python_end|>"


def _literal(node: ast.expr) -> Any:
    value = ast.literal_eval(node)
    if isinstance(value, (set, bytes, complex, tuple)):
        raise ValueError("not a JSON value")
    json.dumps(value)
    return value


def _call(node: ast.expr) -> ParsedCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call with keyword arguments")
    return ParsedCall(node.func.id, arguments_json([(k.arg, _literal(k.value)) for k in node.keywords], True))


class PythonicToolParser(ToolParser):
    start_marker = "["
    needs_special_tokens = True  # <|python_start|>

    def _body(self, text: str) -> str | None:
        body = text.strip()
        if body.startswith(_START):
            body = body[len(_START) :]
        body = body.replace(_END, "").strip()
        return body if body.startswith("[") else None

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("[", _START)) or _START.startswith(stripped):
            return 0
        return len(text)

    def extract(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedCall]]:
        body = self._body(text)
        if body is None:
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List):
                raise ValueError("not a list")
            return None, [_call(e) for e in tree.elts]
        except (SyntaxError, ValueError, TypeError):  # unfinished while streaming (calls come whole), or prose
            return (text, []) if final else (None, [])
