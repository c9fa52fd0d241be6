"""Tool calling for chat completions: what the prompt shows of the tools, which constraint tool_choice puts on
the output, and how the output becomes OpenAI `tool_calls` (whole, or as streamed deltas).

tool_choice "none": the tools are left out of the prompt and the output is plain content. "auto" (the default
when tools are given) needs `--enable-auto-tool-choice` and `--tool-call-parser`, as in vLLM: the model decides,
the parser finds its calls. "required" and a named function are enforced with guided decoding (a JSON schema
built from the tools' parameters), so their arguments always parse and validate, whatever the model.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from novainfer.sampling_params import StructuredOutputsParams
from novainfer.server.errors import APIError
from novainfer.server.protocol import ChatCompletionRequest
from novainfer.server.tool_parsers import ParsedCall, ToolParser, get_tool_parser

_ANY_OBJECT = {"type": "object"}


@dataclass
class ToolConfig:
    """The server's tool flags (`--enable-auto-tool-choice`, `--tool-call-parser`)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


@dataclass
class ToolPlan:
    mode: str | None  # None (no tools), "none", "auto", "required", "named"
    tools: list[dict] = field(default_factory=list)  # as chat templates take them
    function: str | None = None  # the named function
    structured: StructuredOutputsParams | None = None
    parser: ToolParser | None = None


def plan_tools(req: ChatCompletionRequest, config: ToolConfig) -> ToolPlan:
    """The request's tool mode and its output constraint; a 400 naming the field for what cannot be served."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan(None)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    params = {t.function.name: t.function.parameters or _ANY_OBJECT for t in req.tools}
    if choice is None or choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                                'be set; or send tool_choice "required", "none" or a named function', param="tool_choice")
        return ToolPlan("auto", tools, parser=get_tool_parser(config.tool_call_parser))
    if choice == "none":
        return ToolPlan("none")
    if choice == "required":
        items = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                            "required": ["name", "parameters"], "additionalProperties": False}
                           for name, schema in params.items()]}
        schema = {"type": "array", "items": items, "minItems": 1, **({} if req.parallel_tool_calls else {"maxItems": 1})}
        return ToolPlan("required", tools, structured=StructuredOutputsParams(json=schema))
    name = choice.function.name
    if name not in params:
        raise APIError(400, f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
    return ToolPlan("named", tools, function=name, structured=StructuredOutputsParams(json=params[name]))


def template_inputs(tokenizer: Any, messages: list[dict], plan: ToolPlan) -> tuple[list[dict], dict]:
    """(messages, chat-template kwargs): the tools go to the model's own template when it reads them; a template
    without tool support gets them (and earlier calls and results) as Hermes-style text instead."""
    if plan.mode in (None, "none"):
        return [_flatten(m) for m in messages], {}
    if "tools" in (getattr(tokenizer, "chat_template", None) or ""):
        return messages, {"tools": plan.tools}
    described = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in plan.tools)
    system = ("You can call functions. Their signatures, as JSON Schema, are:\n<tools>\n" + described +
              "\n</tools>\nTo call one, answer with <tool_call>{\"name\": <function name>, \"arguments\": "
              "<arguments object>}</tool_call>.")
    out = [_flatten(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, {}


def _flatten(msg: dict) -> dict:
    """A message with tool calls / results as plain text (for templates that only read role and content)."""
    text = msg.get("content") or ""
    for call in msg.get("tool_calls") or []:
        f = call["function"]
        text += "<tool_call>" + json.dumps({"name": f["name"], "arguments": f["arguments"]}, ensure_ascii=False) \
                + "</tool_call>"
    if msg["role"] == "tool":
        text = f"<tool_response>{text}</tool_response>"
    return {"role": msg["role"], "content": text}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_dict(call: ParsedCall, call_id: str | None = None) -> dict:
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def extract_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished output under the plan."""
    if plan.mode == "named":
        return None, [ParsedCall(plan.function, text)]
    if plan.mode == "required":
        try:
            return None, [ParsedCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                          for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):  # cut short (max_tokens): no complete calls
            return text, []
    if plan.mode == "auto":
        return plan.parser.extract(text, final=True)
    return text, []


def finish_reason(plan: ToolPlan, calls: list[ParsedCall], reason: str | None) -> str | None:
    """OpenAI's "tool_calls" when the model chose to call (auto, required); a forced named call keeps "stop"."""
    return "tool_calls" if calls and plan.mode in ("auto", "required") and reason == "stop" else reason


class ToolCallStream:
    """One streamed choice's deltas: content while it is content, then each tool call as it completes (a named
    call streams its arguments as they are generated)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.sent_content = 0  # characters of content streamed
        self.sent_calls = 0  # calls streamed
        self.sent_args = 0  # named mode: argument characters streamed
        self.ids: list[str] = []
        self.called = False

    def deltas(self, text: str, finished: bool) -> list[dict]:
        """Deltas for the output text so far (all of it when finished)."""
        mode = self.plan.mode
        if mode == "named":
            return self._named(text)
        if mode == "required":
            return self._calls(*extract_calls(self.plan, text)) if finished else []
        content_end = len(text) if finished else self.plan.parser.content_end(text)
        if finished:
            content, calls = extract_calls(self.plan, text)
            if not calls:
                return self._content(text)
            return self._content(text[:self.plan.parser.content_end(text)]) + self._calls(content, calls)
        out = self._content(text[:content_end])
        if content_end < len(text):
            out += self._calls(*self.plan.parser.extract(text, final=False))
        return out

    def _content(self, content: str) -> list[dict]:
        if self.called or len(content) <= self.sent_content:
            return []
        piece, self.sent_content = content[self.sent_content:], len(content)
        return [{"content": piece}]

    def _calls(self, _content: str | None, calls: list[ParsedCall]) -> list[dict]:
        out = []
        for i in range(self.sent_calls, len(calls)):
            self.ids.append(new_call_id())
            out.append({"tool_calls": [{"index": i, **call_dict(calls[i], self.ids[i])}]})
        self.sent_calls = max(self.sent_calls, len(calls))
        self.called = self.called or bool(calls)
        return out

    def _named(self, text: str) -> list[dict]:
        if len(text) <= self.sent_args and self.ids:
            return []
        piece, self.sent_args = text[self.sent_args:], len(text)
        if not self.ids:
            self.ids.append(new_call_id())
            self.called, self.sent_calls = True, 1
            return [{"tool_calls": [{"index": 0, "id": self.ids[0], "type": "function",
                                     "function": {"name": self.plan.function, "arguments": piece}}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}]
