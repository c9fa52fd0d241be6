"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens) over the chat completions path:
content blocks become chat messages, the chat turn's pieces become content blocks and Anthropic's SSE events;
errors on these routes take Anthropic's shape."""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from novainfer.server.chat_turn import ChatTurn, Finish, Piece, chat_request
from novainfer.server.errors import APIError
from novainfer.server.protocol import ChatCompletionRequest
from novainfer.server.protocol_anthropic import (
    AnthropicErrorInfo,
    AnthropicErrorResponse,
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    UnsupportedBlock,
)
from novainfer.server.serving_completions import CompletionHandler
from novainfer.server.sse import EventStream
from novainfer.server.tool_calling import plan_tools

PATH_PREFIX = "/v1/messages"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def error_body(status: int, message: str, request_id: str | None) -> dict:
    """Anthropic's error object: {"type": "error", "error": {"type", "message"}, "request_id"}."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    info = AnthropicErrorInfo(type=kind, message=message)
    return AnthropicErrorResponse(error=info, request_id=request_id).model_dump()


def error_response(exc: APIError, request_id: str | None) -> JSONResponse:
    """The APIError as an Anthropic-shaped JSON answer (its status and headers kept)."""
    return JSONResponse(error_body(exc.status, exc.message, request_id), status_code=exc.status, headers=exc.headers)


def _text(blocks: list[TextBlock] | str | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "".join(b.text for b in blocks)


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The system prompt and messages as chat messages: tool_use blocks become the assistant's tool calls,
    tool_result blocks tool messages (before the user's text, as Anthropic orders them)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": _text(req.system)}] if req.system else []
    for i, msg in enumerate(req.messages):
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        text, thinking, calls, results = "", None, [], []
        for j, block in enumerate(msg.content):
            if isinstance(block, UnsupportedBlock):
                raise APIError(
                    400,
                    f"messages[{i}].content[{j}].type: {block.type!r} blocks are not supported "
                    "(text, tool_use and tool_result only)",
                    param=f"messages[{i}].content[{j}].type",
                )
            if isinstance(block, TextBlock):
                text += block.text
            elif isinstance(block, ToolUseBlock):
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": json.dumps(block.input)},
                    }
                )
            elif isinstance(block, ToolResultBlock):
                results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
            elif isinstance(block, ThinkingBlock):  # past thinking: the template decides whether to show it
                thinking = (thinking or "") + block.thinking
        out += results
        reasoning = {"reasoning_content": thinking} if thinking is not None else {}
        if calls:
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls, **reasoning})
        elif text or not results:
            out.append({"role": msg.role, "content": text, **reasoning})
    return out


def _tool_fields(req: CountTokensRequest) -> dict[str, Any]:
    """The chat request's tools, tool_choice and parallel_tool_calls."""
    if not req.tools:
        if req.tool_choice is not None and req.tool_choice.type != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return {}
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.input_schema,
                "strict": t.strict,
            },
        }
        for t in req.tools
    ]
    choice, parallel = req.tool_choice, None
    kind = choice.type if choice is not None else "auto"
    if kind == "tool":
        if not choice.name:
            raise APIError(
                400, "tool_choice.name: a tool choice of type 'tool' needs the tool's name", param="tool_choice.name"
            )
        mapped: Any = {"type": "function", "function": {"name": choice.name}}
    else:
        mapped = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice is not None and choice.disable_parallel_tool_use:
        parallel = False
    return {
        "tools": [{**t, "function": {k: v for k, v in t["function"].items() if v is not None}} for t in tools],
        "tool_choice": mapped,
        "parallel_tool_calls": parallel,
    }


def _chat_request(req: CountTokensRequest, harmony: bool, **fields: Any) -> ChatCompletionRequest:
    """The chat request of a Messages request (harmony: the model takes output_config.effort, a no-op otherwise)."""
    fmt = req.output_config.format if req.output_config else None
    response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}} if fmt else None
    return chat_request(
        {
            "model": req.model,
            "messages": chat_messages(req),
            "response_format": response_format,
            "reasoning_effort": req.output_config.effort if req.output_config and harmony else None,
            **_tool_fields(req),
            **fields,
        }
    )


class MessageRun:
    """One message being made: content blocks built from the chat turn's pieces, and the stream events."""

    def __init__(self, req: MessagesRequest, message_id: str, model: str):
        self.req, self.id, self.model = req, message_id, model
        self.show_thinking = req.thinking is not None and req.thinking.type != "disabled"
        self.blocks: list[dict] = []
        self.arguments: list[str] = []  # per block: a tool_use block's input JSON as streamed
        self.open: tuple[str, int] | None = None
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, int] = {"input_tokens": 0, "output_tokens": 0}

    def message(self) -> dict:
        """The Message object as it stands."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": list(self.blocks),
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage,
        }

    def consume(self, event: Piece | Finish) -> list[tuple[str, dict]]:
        """(event name, data) for this piece (or the finish); the blocks are updated as they go."""
        if isinstance(event, Finish):
            return self._finish(event)
        if event.kind == "reasoning" and not self.show_thinking:
            return []
        out: list[tuple[str, dict]] = []
        key = (event.kind, event.call_index if event.kind == "call" else 0)
        if self.open != key:
            out += self._close()
            out += self._start(event)
            self.open = key
        index, block = len(self.blocks) - 1, self.blocks[-1]
        if event.kind == "call":
            self.arguments[index] += event.text
            delta = {"type": "input_json_delta", "partial_json": event.text}
        elif event.kind == "text":
            block["text"] += event.text
            delta = {"type": "text_delta", "text": event.text}
        else:
            block["thinking"] += event.text
            delta = {"type": "thinking_delta", "thinking": event.text}
        return out + [("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})]

    def _start(self, piece: Piece) -> list[tuple[str, dict]]:
        if piece.kind == "call":
            block = {
                "type": "tool_use",
                "id": piece.call_id or f"toolu_{uuid.uuid4().hex}",
                "name": piece.name or "",
                "input": {},
            }
        elif piece.kind == "text":
            block = {"type": "text", "text": ""}
        else:
            block = {"type": "thinking", "thinking": "", "signature": ""}
        self.blocks.append(block)
        self.arguments.append("")
        return [
            (
                "content_block_start",
                {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)},
            )
        ]

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        index, block = len(self.blocks) - 1, self.blocks[-1]
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads(self.arguments[index] or "{}")
            except ValueError:  # cut short by max_tokens: the arguments never completed
                block["input"] = {}
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _finish(self, finish: Finish) -> list[tuple[str, dict]]:
        out = self._close()
        if finish.error is not None:
            return out + [("error", error_body(finish.error.status, finish.error.message, None))]
        stop = finish.stop if isinstance(finish.stop, str) and finish.stop in (self.req.stop_sequences or []) else None
        if any(b["type"] == "tool_use" for b in self.blocks) and finish.reason in ("stop", "tool_calls"):
            self.stop_reason = "tool_use"
        elif stop is not None:
            self.stop_reason, self.stop_sequence = "stop_sequence", stop
        else:
            self.stop_reason = _STOP_REASONS.get(finish.reason or "", "end_turn")
        cached = (finish.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        self.usage = {
            "input_tokens": finish.usage.get("prompt_tokens", 0) - cached,
            "output_tokens": finish.usage.get("completion_tokens", 0),
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        }
        return out + [
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "usage": self.usage,
                    "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]


class MessagesHandler:
    """The /v1/messages routes: create (whole or streamed) and count_tokens."""

    def __init__(self, chat: CompletionHandler):
        self.chat = chat

    async def create(self, req: MessagesRequest, request_id: str, raw: Request) -> JSONResponse | StreamingResponse:
        """Run the request as one chat turn; the Message object, or Anthropic's SSE events with `stream: true`."""
        model = self.chat.serving.resolve_model(req.model)
        chat_req = _chat_request(
            req,
            self.chat.chat_format(model).harmony,
            max_completion_tokens=req.max_tokens,
            stop=req.stop_sequences,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stream=req.stream,
        )
        run = MessageRun(req, f"msg_{request_id}", model.name)
        turn = await ChatTurn.start(self.chat, chat_req, request_id, raw)
        if req.stream:
            # the background also runs when the client leaves before the body starts
            return EventStream(self._stream(run, turn), background=BackgroundTask(turn.close))
        async for event in turn.events():
            run.consume(event)
        return JSONResponse(run.message())

    @staticmethod
    async def _stream(run: MessageRun, turn: ChatTurn) -> AsyncIterator[str]:
        def sse(name: str, data: dict) -> str:
            return f"event: {name}\ndata: {json.dumps(data)}\n\n"

        try:
            yield sse("message_start", {"type": "message_start", "message": run.message()})
            yield sse("ping", {"type": "ping"})
            async for event in turn.events():
                for name, data in run.consume(event):
                    yield sse(name, data)
        finally:
            await turn.close()

    async def count_tokens(self, req: CountTokensRequest) -> dict:
        """The prompt's length as /v1/messages would render it (tools included), through the chat path's render."""
        model = self.chat.serving.resolve_model(req.model)
        fmt = self.chat.chat_format(model)
        chat_req = _chat_request(req, fmt.harmony)
        plan = plan_tools(chat_req, self.chat.tools, fmt.tool_parser, model.tokenizer)
        kwargs = self.chat.template_kwargs(chat_req, fmt)
        ids = await self.chat.render_prompt(model, [m.to_template() for m in chat_req.messages], plan, True, kwargs)
        return {"input_tokens": len(ids)}
