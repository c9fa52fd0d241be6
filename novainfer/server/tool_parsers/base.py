"""The tool-parser interface: whole-output extraction, plus the pieces streaming needs."""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


def call_from_json(obj: object, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    """A ParsedCall from {"name": ..., "arguments"|"parameters": {...}}, or None if obj is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class ToolParser(ABC):
    # the text that opens the tool-call part of an output; streams hold back what may be its beginning
    start_marker: str = ""

    @abstractmethod
    def extract(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedCall]]:
        """(content before the calls or None, the calls). With final=False only calls that are complete count."""

    def content_end(self, text: str) -> int:
        """Where content stops in a partial output: at the marker, or before a tail that may begin it."""
        at = text.find(self.start_marker)
        if at >= 0:
            return at
        for k in range(min(len(self.start_marker) - 1, len(text)), 0, -1):
            if self.start_marker.startswith(text[-k:]):
                return len(text) - k
        return len(text)
