"""One assistant turn run through the chat completions path, as a stream of pieces (reasoning, text, tool-call
arguments) and a finish: what the Responses and Messages APIs translate into their own shapes.

The turn is a ChatCompletionRequest handed to CompletionHandler.chat, so templates, tools, structured outputs,
sampling, limits, metrics and cancellation are the chat path's own; this module only reads back the chat
completion (or its SSE chunks) that the chat path produced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from novainfer.server.errors import APIError
from novainfer.server.protocol import ChatCompletionRequest, StreamOptions
from novainfer.server.serving_completions import CompletionHandler

REASONING_KEYS = ("reasoning_content", "reasoning")  # vLLM's older and newer names for a message's reasoning


@dataclass
class Piece:
    """A delta of the turn: reasoning or text, or a tool call's arguments (its first piece carries id and name)."""

    kind: Literal["reasoning", "text", "call"]
    text: str
    call_index: int = 0
    call_id: str | None = None
    name: str | None = None


@dataclass
class Finish:
    """The end of the turn: the chat finish_reason, the matched stop (string or token id), and the usage."""

    reason: str | None
    stop: int | str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    error: APIError | None = None  # the engine failed mid-stream


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A ChatCompletionRequest from fields the translating API assembled; a 400 when they do not validate."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{loc}: {first.get('msg', 'invalid request')}", param=loc or None) from None


class ChatTurn:
    """A started chat completion: errors before generation (400, 429, 503) are raised by start()."""

    def __init__(self, response: Any, request_id: str):
        self.response, self.request_id = response, request_id

    @classmethod
    async def start(
        cls, handler: CompletionHandler, req: ChatCompletionRequest, request_id: str, raw: Request
    ) -> "ChatTurn":
        """Run req through the chat path (streamed, with usage, when req.stream; the whole completion otherwise)."""
        if req.stream:
            req = req.model_copy(update={"stream_options": StreamOptions(include_usage=True)})
        return cls(await handler.chat(req, request_id, raw), request_id)

    async def events(self) -> AsyncIterator[Piece | Finish]:
        """The turn's pieces in order, then one Finish."""
        if not isinstance(self.response, StreamingResponse):
            for event in _completion_events(json.loads(self.response.body)):
                yield event
            return
        body, finish, usage = self.response.body_iterator, Finish(None), {}
        try:
            async for line in body:
                data = (line if isinstance(line, str) else line.decode())[len("data: ") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    finish.error = APIError(500 if err.get("type") == "internal_error" else 503, err["message"])
                    continue
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    for piece in _delta_pieces(choice["delta"]):
                        yield piece
                    if choice.get("finish_reason"):
                        finish.reason, finish.stop = choice["finish_reason"], choice.get("stop_reason")
        finally:
            await body.aclose()
            await self.close()
        finish.usage = usage
        yield finish

    async def close(self) -> None:
        """Release the generation (idempotent); for a stream whose events were never read."""
        if isinstance(self.response, StreamingResponse) and self.response.background is not None:
            await self.response.background()


def _reasoning(message: dict) -> list[Piece]:
    """The reasoning piece of a message or delta: the chat path writes it under both keys, read it once."""
    text = next((message[k] for k in REASONING_KEYS if message.get(k)), None)
    return [Piece("reasoning", text)] if text else []


def _delta_pieces(delta: dict) -> list[Piece]:
    pieces = _reasoning(delta)
    if delta.get("content"):
        pieces.append(Piece("text", delta["content"]))
    for call in delta.get("tool_calls") or []:
        fn = call.get("function") or {}
        pieces.append(Piece("call", fn.get("arguments") or "", call.get("index", 0), call.get("id"), fn.get("name")))
    return pieces


def _completion_events(body: dict) -> list[Piece | Finish]:
    choice = body["choices"][0]
    message = choice["message"]
    events = _reasoning(message)
    if message.get("content"):
        events.append(Piece("text", message["content"]))
    for i, call in enumerate(message.get("tool_calls") or []):
        events.append(Piece("call", call["function"]["arguments"], i, call["id"], call["function"]["name"]))
    return [*events, Finish(choice["finish_reason"], choice.get("stop_reason"), body["usage"])]
