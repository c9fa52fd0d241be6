"""A chat choice's output as OpenAI's message: reasoning split out (`reasoning_content`, and vLLM's newer
`reasoning`), tool calls parsed, whole or as stream deltas. The model's formats are found once per served
model (ChatFormat), the parsers are made per request."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from novainfer.server.reasoning_parsers import HARMONY_PARSERS, ThinkReasoningParser, choose_reasoning_parser
from novainfer.server.tool_calling import HARMONY, ToolCallStream, ToolPlan, call_dict, extract_calls, finish_reason
from novainfer.server.tool_parsers import choose_tool_parser

logger = logging.getLogger(__name__)
_TOOL_MODES = ("auto", "required", "named")


def _architectures(path: str) -> list[str]:
    """The `architectures` of a model's config.json (local folder or the Hugging Face cache), [] if unknown."""
    config = os.path.join(path, "config.json")
    if not os.path.exists(config):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
        except Exception:  # not a repo id
            cached = None
        if not isinstance(cached, str):
            return []
        config = cached
    try:
        with open(config, encoding="utf-8") as f:
            return list(json.load(f).get("architectures") or [])
    except (OSError, ValueError):
        return []


@dataclass
class ChatFormat:
    """One served model's tool-call and reasoning formats (flags override what the chat template implies)."""

    tool_parser: str
    reasoning_parser: str | None

    @property
    def harmony(self) -> bool:
        """The model writes OpenAI's harmony channels (gpt-oss): its output is read by harmony_chat."""
        return self.tool_parser == HARMONY or self.reasoning_parser in HARMONY_PARSERS

    @classmethod
    def of(cls, tokenizer: Any, path: str, tool_flag: str | None, reasoning_flag: str | None) -> "ChatFormat":
        template = getattr(tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else json.dumps(template or "")
        fmt = cls(
            tool_flag or choose_tool_parser(template, _architectures(path)),
            reasoning_flag or choose_reasoning_parser(template),
        )
        logger.info(
            "chat format of %s: tool-call parser %s, reasoning parser %s", path, fmt.tool_parser, fmt.reasoning_parser
        )
        return fmt


class ChoiceOutput:
    """One chat choice's parsing state: the reasoning split first, then content and tool calls in what follows."""

    def __init__(self, plan: ToolPlan, reasoning: ThinkReasoningParser | None, trim: tuple[str, ...] = ()):
        self.plan, self.reasoning, self.trim = plan, reasoning, trim
        self.tools = ToolCallStream(plan) if plan.mode in _TOOL_MODES else None
        self.sent_reasoning = 0
        self.sent_content = 0

    def _text(self, text: str, finished: bool) -> str:
        """The output without trailing special tokens' text (end of turn, end of message: present when special
        tokens are kept for the call markers)."""
        while finished:
            end = next((t for t in self.trim if text.endswith(t)), None)
            if end is None:
                return text
            text = text[: -len(end)]
        return text

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """(the whole message, finish_reason) of a finished output."""
        text = self._text(text, True)
        reasoning, rest = self.reasoning.split(text, final=True) if self.reasoning else (None, text)
        calls = []
        if rest is None:
            content = None
        elif self.tools is not None:
            content, calls = extract_calls(self.plan, rest, cut=reason == "length")
        else:
            content = rest
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        if calls:
            msg["tool_calls"] = [call_dict(c) for c in calls]
        return msg, finish_reason(self.plan, bool(calls), reason)

    def deltas(self, text: str, finished: bool, reason: str | None) -> list[dict]:
        """The deltas that bring the streamed message up to the output so far."""
        text = self._text(text, finished)
        reasoning, rest = self.reasoning.split(text, final=finished) if self.reasoning else (None, text)
        out = []
        if reasoning is not None and len(reasoning) > self.sent_reasoning:
            piece = reasoning[self.sent_reasoning :]
            out.append({"reasoning_content": piece, "reasoning": piece})
            self.sent_reasoning = len(reasoning)
        if rest is None:
            return out
        if self.tools is not None:
            return out + self.tools.deltas(rest, finished, cut=reason == "length")
        if len(rest) > self.sent_content:
            out.append({"content": rest[self.sent_content :]})
            self.sent_content = len(rest)
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(self.plan, bool(self.tools and self.tools.ids), reason)
