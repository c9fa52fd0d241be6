"""Tool calling for chat completions: what the prompt shows of the tools, which constraint tool_choice puts on
the output, and how the output becomes OpenAI `tool_calls` (whole, or as streamed deltas).

tool_choice "none": the tools are left out of the prompt and the output is plain content. "auto" (the default
when tools are given) works out of the box: the model decides, the parser of its own call format (chosen from
its chat template, or `--tool-call-parser`) finds its calls. "required" and a named function are enforced with
guided decoding (a JSON schema built from the tools' parameters, every object closed to undeclared properties),
so their arguments always parse and validate, whatever the model; under "auto", `strict` functions are held to
their closed schemas by a lazy grammar (strict_tools.py) once the model opens a call. A call cut by max_tokens
never leaks into `content`: the message keeps the complete calls only.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from novainfer.sampling_params import StructuredOutputsParams
from novainfer.server.errors import APIError
from novainfer.server.harmony import forced_call_grammar
from novainfer.server.protocol import ChatCompletionRequest
from novainfer.server.strict_tools import strict_auto_constraint
from novainfer.server.structured_request import closed_schema
from novainfer.server.tool_parsers import ParsedCall, ToolParser, get_tool_parser
from novainfer.server.tool_parsers.base import json_call_list

_ANY_OBJECT = {"type": "object"}
HARMONY = "openai"  # the tool-call parser of harmony models (gpt-oss)


@dataclass
class ToolConfig:
    """The server's tool flags: `--enable-auto-tool-choice` (on by default), `--tool-call-parser` (None: the
    model's own format, from its chat template)."""

    enable_auto_tool_choice: bool = True
    tool_call_parser: str | None = None


class _RequiredParser(ToolParser):
    """tool_choice "required": the grammar makes a JSON list of {"name", "parameters"} objects."""

    def extract(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedCall]]:
        body = text.lstrip()
        return None, json_call_list(body, 1, final) if body.startswith("[") else []

    def content_end(self, text: str) -> int:
        return 0


class _NamedParser(ToolParser):
    """A named tool_choice: the grammar makes the function's arguments object itself."""

    def __init__(self, function: str):
        super().__init__()
        self.function = function

    def extract(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedCall]]:
        if not final:
            return None, [ParsedCall(self.function, text, complete=False)]
        try:
            json.loads(text)
        except ValueError:  # cut short: no arguments object
            return None, []
        return None, [ParsedCall(self.function, text)]

    def content_end(self, text: str) -> int:
        return 0


@dataclass
class ToolPlan:
    mode: str | None  # None (no tools), "none", "auto", "required", "named"
    tools: list[dict] = field(default_factory=list)  # as chat templates take them
    function: str | None = None  # the named function
    structured: StructuredOutputsParams | None = None
    parser: ToolParser | None = None


def plan_tools(req: ChatCompletionRequest, config: ToolConfig, model_parser: str, tokenizer: Any) -> ToolPlan:
    """The request's tool mode and its output constraint (model_parser: the served model's call format; tokenizer:
    the served model's, whose vocabulary may hold the call markers); a 400 naming the field for what cannot be
    served."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan(None)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    params = {t.function.name: closed_schema(t.function.parameters or _ANY_OBJECT) for t in req.tools}
    if choice is None or choice == "auto":
        if not config.enable_auto_tool_choice:
            raise APIError(
                400,
                '"auto" tool choice is off on this server (--enable-auto-tool-choice); send '
                'tool_choice "required", "none" or a named function',
                param="tool_choice",
            )
        name = config.tool_call_parser or model_parser
        parser = get_tool_parser(name, tools)
        structured = strict_auto_constraint(req.tools, name, parser.start_marker, tokenizer, req.parallel_tool_calls)
        return ToolPlan("auto", tools, structured=structured, parser=parser)
    if choice == "none":
        return ToolPlan("none")
    if model_parser == HARMONY and choice == "required":
        return _harmony_forced(tools, params, tokenizer, "required")
    if choice == "required":
        items = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": schema},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, schema in params.items()
            ]
        }
        schema = {
            "type": "array",
            "items": items,
            "minItems": 1,
            **({} if req.parallel_tool_calls else {"maxItems": 1}),
        }
        return ToolPlan("required", tools, structured=StructuredOutputsParams(json=schema), parser=_RequiredParser())
    name = choice.function.name
    if name not in params:
        raise APIError(400, f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
    if model_parser == HARMONY:
        return _harmony_forced(tools, {name: params[name]}, tokenizer, "named", name)
    return ToolPlan(
        "named", tools, function=name, structured=StructuredOutputsParams(json=params[name]), parser=_NamedParser(name)
    )


def _harmony_forced(
    tools: list[dict], functions: dict[str, dict], tokenizer: Any, mode: str, name: str | None = None
) -> ToolPlan:
    """A forced call in harmony: a grammar from the output's first token (reasoning first is allowed), so it is
    not gated behind the end of reasoning as other formats' are."""
    grammar = StructuredOutputsParams(grammar=forced_call_grammar(functions, tokenizer), after_tokens=[])
    return ToolPlan(mode, tools, function=name, structured=grammar, parser=get_tool_parser(HARMONY, tools))


def template_inputs(tokenizer: Any, messages: list[dict], plan: ToolPlan) -> tuple[list[dict], dict]:
    """(messages, chat-template kwargs): the tools go to the model's own template when it reads them; a template
    without tool support gets them (and earlier calls and results) as Hermes-style text instead."""
    if plan.mode in (None, "none"):
        return [_flatten(m) for m in messages], {}
    if "tools" in (getattr(tokenizer, "chat_template", None) or ""):
        return messages, {"tools": plan.tools}
    described = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in plan.tools)
    system = (
        "You can call functions. Their signatures, as JSON Schema, are:\n<tools>\n"
        + described
        + '\n</tools>\nTo call one, answer with <tool_call>{"name": <function name>, "arguments": '
        "<arguments object>}</tool_call>."
    )
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
        text += (
            "<tool_call>"
            + json.dumps({"name": f["name"], "arguments": f["arguments"]}, ensure_ascii=False)
            + "</tool_call>"
        )
    if msg["role"] == "tool":
        text = f"<tool_response>{text}</tool_response>"
    reasoning = {k: msg[k] for k in ("reasoning_content", "thinking") if k in msg}  # past reasoning stays
    return {"role": msg["role"], "content": text, **reasoning}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_dict(call: ParsedCall, call_id: str | None = None) -> dict:
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def extract_calls(plan: ToolPlan, text: str, cut: bool = False) -> tuple[str | None, list[ParsedCall]]:
    """(content, complete calls) of a finished output under the plan; cut (max_tokens): the text from where a
    call began is neither content nor a call."""
    if plan.mode not in ("auto", "required", "named"):
        return text, []
    content, calls = plan.parser.extract(text, final=True)
    if cut:
        content = text[: plan.parser.content_end(text)].strip() or None
        calls = [c for c in plan.parser.extract(text, final=False)[1] if c.complete]
    return content, calls


def finish_reason(plan: ToolPlan, called: bool, reason: str | None) -> str | None:
    """OpenAI's "tool_calls" when the model chose to call (auto, required); a forced named call keeps "stop"."""
    return "tool_calls" if called and plan.mode in ("auto", "required") and reason == "stop" else reason


class ToolCallStream:
    """One streamed choice's deltas, in OpenAI's shape: content while it is content; then per call a first delta
    with its index, id, type and name, and argument deltas as the arguments are written."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.sent_content = 0  # characters of content streamed
        self.ids: list[str] = []  # the calls begun
        self.sent_args: list[str] = []  # their arguments streamed so far

    def deltas(self, text: str, finished: bool, cut: bool = False) -> list[dict]:
        """Deltas for the output text so far (all of it when finished; cut: it ended at max_tokens)."""
        parser = self.plan.parser
        if finished:
            content, calls = extract_calls(self.plan, text, cut)
            shown = text if content == text else text[: parser.content_end(text)]
        else:
            shown = text[: parser.content_end(text)]
            calls = parser.extract(text, final=False)[1] if len(shown) < len(text) else []
        out = []
        if not self.ids and len(shown) > self.sent_content:
            out.append({"content": shown[self.sent_content :]})
            self.sent_content = len(shown)
        return out + self.call_deltas(calls)

    def call_deltas(self, calls: list[ParsedCall]) -> list[dict]:
        """The tool_calls deltas for the calls as parsed so far (each one's arguments a prefix of its final ones)."""
        out = []
        for i, call in enumerate(calls):
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append("")
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": i,
                                "id": self.ids[i],
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""},
                            }
                        ]
                    }
                )
            sent = self.sent_args[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments[len(sent) :]}}]})
                self.sent_args[i] = call.arguments
        return out
