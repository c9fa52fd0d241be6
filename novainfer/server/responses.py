"""OpenAI's Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}, POST .../cancel) over the chat
completions path: input items become chat messages, the chat turn's pieces become output items and stream events.

A stored response keeps its whole conversation (a SessionStore entry: bounded LRU with a TTL), so a request with
previous_response_id re-renders the same messages and its prompt hits the prefix cache.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from pydantic import ValidationError

from novainfer.server.chat_turn import ChatTurn, Finish, Piece, chat_request
from novainfer.server.errors import APIError
from novainfer.server.protocol_responses import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    UnsupportedItem,
)
from novainfer.server.serving_completions import CompletionHandler
from novainfer.server.sessions import Session, SessionStore
from novainfer.server.sse import EventStream

_ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "call": "fc"}


def _text(content: str | list[ContentPart], where: str) -> str:
    """A message's text; a 400 naming the part that is not text (images, files, refusals)."""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text"):
            raise APIError(
                400,
                f"{where}[{j}].type: content parts of type {part.type!r} are not supported (text only)",
                param=f"{where}[{j}].type",
            )
    return "".join(part.text for part in content)


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as chat messages (function calls join the assistant message before them)."""
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if isinstance(item, UnsupportedItem):
            raise APIError(
                400, f"input[{i}].type: input items of type {item.type!r} are not supported", param=f"input[{i}].type"
            )
        last = messages[-1] if messages else None
        if isinstance(item, MessageItem):
            text = _text(item.content, f"input[{i}].content")
            if item.role == "assistant" and _bare_reasoning(last):
                last["content"] = text  # the answer that followed this turn's reasoning
            else:
                messages.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, f"input[{i}].output")}
            )
        else:
            assert isinstance(item, ReasoningItem)  # past reasoning: the template decides whether to show it
            text = "".join(part.text for part in item.content or [])
            messages.append({"role": "assistant", "content": None, "reasoning_content": text})
    return messages


def _bare_reasoning(msg: dict[str, Any] | None) -> bool:
    """msg is an assistant message with only reasoning so far."""
    return msg is not None and "reasoning_content" in msg and not msg["content"] and "tool_calls" not in msg


def _refuse_unsupported(req: ResponsesRequest) -> None:
    """400 naming a field whose value asks for what this server does not do."""
    if req.background:
        raise APIError(
            400, "background: background responses are not supported; send background false", param="background"
        )
    if req.include:
        raise APIError(
            400, f"include: {req.include[0]!r} is not supported (no extra output data is produced)", param="include"
        )
    if req.top_logprobs:
        raise APIError(400, "top_logprobs: log-probabilities are not served on /v1/responses", param="top_logprobs")


def _chat_tools(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """(chat tools, chat tool_choice); a 400 naming a built-in tool or tool choice."""
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.get("type") != "function":
            raise APIError(
                400,
                f"tools[{i}].type: built-in tool {tool.get('type')!r} is not supported; only function tools",
                param=f"tools[{i}].type",
            )
        try:
            fn = FunctionTool.model_validate(tool)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise APIError(400, f"tools[{i}].{where}: {first['msg']}", param=f"tools[{i}]") from None
        tools.append({"type": "function", "function": fn.model_dump(exclude={"type"}, exclude_none=True)})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or len(choice) != 2:
            raise APIError(
                400,
                f"tool_choice: {choice!r} is not supported; give 'none', 'auto', 'required' or "
                "{'type': 'function', 'name': ...}",
                param="tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools or None, choice


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {
        "name": fmt.name or "response",
        "schema": fmt.schema_,
        "description": fmt.description,
        "strict": fmt.strict,
    }
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class ResponseRun:
    """One response being made: the output items built from the chat turn's pieces, and the stream events."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str, tokenizer: Any):
        self.req, self.id, self.model, self.tokenizer = req, response_id, model, tokenizer
        self.created_at = int(time.time())
        self.items: list[dict] = []
        self.open: tuple[str, int] | None = None  # (piece kind, call index) of the item receiving deltas
        self.status, self.usage, self.error, self.incomplete = "in_progress", None, None, None

    def snapshot(self) -> dict:
        """The Response object as it stands."""
        fmt = self.req.text.format if self.req.text and self.req.text.format else None
        tools = [
            {"type": "function", "parameters": None, "strict": None, **t["function"]}
            for t in (_chat_tools(self.req)[0] or [])
        ]
        choice = self.req.tool_choice if self.req.tool_choice is not None else "auto"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "instructions": self.req.instructions,
            "max_output_tokens": self.req.max_output_tokens,
            "model": self.model,
            "output": list(self.items),
            "parallel_tool_calls": self.req.parallel_tool_calls is not False,
            "previous_response_id": self.req.previous_response_id,
            "temperature": self.req.temperature,
            "top_p": self.req.top_p,
            "tool_choice": choice,
            "tools": tools,
            "store": self.req.store,
            "background": False,
            "truncation": "disabled",
            "metadata": self.req.metadata or {},
            "user": self.req.user,
            "usage": self.usage,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "completed_at": int(time.time()) if self.status == "completed" else None,
        }

    def consume(self, event: Piece | Finish) -> list[dict]:
        """The stream events this piece (or the finish) makes; the items are updated as they go."""
        if isinstance(event, Finish):
            return self._finish(event)
        out: list[dict] = []
        key = (event.kind, event.call_index if event.kind == "call" else 0)
        if self.open != key:
            out += self._close("completed")
            out += self._add(event)
            self.open = key
        item, index = self.items[-1], len(self.items) - 1
        if event.kind == "call":
            item["arguments"] += event.text
            if event.text:
                out.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": item["id"],
                        "output_index": index,
                        "delta": event.text,
                    }
                )
            return out
        item["content"][0]["text"] += event.text
        kind = "output_text" if event.kind == "text" else "reasoning_text"
        delta = {
            "type": f"response.{kind}.delta",
            "item_id": item["id"],
            "output_index": index,
            "content_index": 0,
            "delta": event.text,
        }
        return out + [{**delta, "logprobs": []} if event.kind == "text" else delta]

    def _add(self, piece: Piece) -> list[dict]:
        item_id = f"{_ITEM_PREFIX[piece.kind]}_{uuid.uuid4().hex}"
        if piece.kind == "call":
            item = {
                "id": item_id,
                "type": "function_call",
                "call_id": piece.call_id or f"call_{uuid.uuid4().hex}",
                "name": piece.name or "",
                "arguments": "",
                "status": "in_progress",
            }
        elif piece.kind == "text":
            item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        else:
            item = {"id": item_id, "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
        self.items.append(item)
        index = len(self.items) - 1
        out = [{"type": "response.output_item.added", "output_index": index, "item": json.loads(json.dumps(item))}]
        if piece.kind != "call":
            part = _part(piece.kind, "")
            item["content"].append(dict(part))
            out.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item_id,
                    "output_index": index,
                    "content_index": 0,
                    "part": part,
                }
            )
        return out

    def _close(self, status: str) -> list[dict]:
        if self.open is None:
            return []
        item, index = self.items[-1], len(self.items) - 1
        item["status"], self.open = status, None
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            out = [{"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]}]
        else:
            text = item["content"][0]["text"]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            done = {"type": f"response.{kind}.done", **where, "content_index": 0, "text": text}
            out = [
                {**done, "logprobs": []} if kind == "output_text" else done,
                {"type": "response.content_part.done", **where, "content_index": 0, "part": item["content"][0]},
            ]
        return out + [{"type": "response.output_item.done", "output_index": index, "item": item}]

    def _finish(self, finish: Finish) -> list[dict]:
        out = self._close("incomplete" if finish.reason == "length" else "completed")
        if finish.error is not None:
            self.status, self.error = "failed", {"code": "server_error", "message": finish.error.message}
        elif finish.reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "cancelled" if finish.reason == "abort" else "completed"
        self.usage = self._usage(finish.usage)
        kind = {"failed": "failed", "incomplete": "incomplete", "cancelled": "incomplete"}.get(self.status, "completed")
        return out + [{"type": f"response.{kind}", "response": self.snapshot()}]

    def _usage(self, usage: dict) -> dict | None:
        if not usage:
            return None
        reasoning = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {
                "reasoning_tokens": len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
            },
        }

    def history(self) -> list[dict]:
        """The output as chat messages, for the conversation kept under this response's id."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [
            {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
            for i in self.items
            if i["type"] == "function_call"
        ]
        return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def _part(kind: str, text: str) -> dict:
    return (
        {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        if kind == "text"
        else {"type": "reasoning_text", "text": text}
    )


class ResponsesHandler:
    """The /v1/responses routes: create (whole or streamed), retrieve, delete, cancel."""

    def __init__(self, chat: CompletionHandler, store: SessionStore):
        self.chat, self.store = chat, store
        self.running: dict[str, tuple[ResponseRun, Any, str]] = {}  # id -> (run, engine, engine request id)

    async def create(self, req: ResponsesRequest, request_id: str, raw: Request) -> JSONResponse | StreamingResponse:
        """Run the request as one chat turn; the Response object, or its SSE events with `stream: true`."""
        _refuse_unsupported(req)
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous = self.store.find(req.previous_response_id)
            if previous is None:
                raise APIError(
                    400,
                    f"previous_response_id: no stored response {req.previous_response_id!r} "
                    "(never stored, deleted, or expired)",
                    param="previous_response_id",
                )
            history = previous.messages
        conversation = history + input_messages(req)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        tools, tool_choice = _chat_tools(req)
        model = self.chat.serving.resolve_model(req.model)
        harmony = self.chat.chat_format(model).harmony  # only harmony models take a reasoning effort
        chat_req = chat_request(
            {
                "model": req.model,
                "messages": system + conversation,
                "max_completion_tokens": req.max_output_tokens,
                "temperature": req.temperature,
                "top_p": req.top_p,
                "tools": tools,
                "tool_choice": tool_choice,
                "parallel_tool_calls": req.parallel_tool_calls,
                "response_format": _response_format(req),
                "reasoning_effort": req.reasoning.effort if req.reasoning and harmony else None,
                "stream": req.stream,
                "user": req.user,
            }
        )
        run = ResponseRun(req, f"resp_{request_id}", model.name, model.tokenizer)
        self.running[run.id] = (run, model.engine, request_id)
        try:
            turn = await ChatTurn.start(self.chat, chat_req, request_id, raw)
        except BaseException:
            self.running.pop(run.id, None)
            raise
        if req.stream:
            # the background also runs when the client leaves before the body starts
            return EventStream(self._stream(run, turn, conversation), background=BackgroundTask(self._end, run, turn))
        try:
            async for event in turn.events():
                run.consume(event)
        finally:
            self.running.pop(run.id, None)
        self._remember(run, conversation)
        return JSONResponse(run.snapshot())

    async def _stream(self, run: ResponseRun, turn: ChatTurn, conversation: list[dict]) -> AsyncIterator[str]:
        numbers = itertools.count()

        def sse(event: dict) -> str:
            event["sequence_number"] = next(numbers)
            return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

        try:
            yield sse({"type": "response.created", "response": run.snapshot()})
            yield sse({"type": "response.in_progress", "response": run.snapshot()})
            async for event in turn.events():
                for out in run.consume(event):
                    yield sse(out)
            self._remember(run, conversation)
        finally:
            await self._end(run, turn)

    async def _end(self, run: ResponseRun, turn: ChatTurn) -> None:
        """The response is no longer in progress; its generation is released (idempotent)."""
        self.running.pop(run.id, None)
        await turn.close()

    def _remember(self, run: ResponseRun, conversation: list[dict]) -> None:
        if run.req.store and run.status != "failed":
            session: Session = self.store.get(run.id)
            session.messages, session.record = conversation + run.history(), run.snapshot()

    def retrieve(self, response_id: str) -> dict:
        """A response in progress, or a stored one; 404 otherwise."""
        if response_id in self.running:
            return self.running[response_id][0].snapshot()
        session = self.store.find(response_id)
        if session is None or session.record is None:
            raise APIError(404, f"no stored response {response_id!r}", param="response_id")
        return session.record

    def delete(self, response_id: str) -> dict:
        """Forget a stored response (and its conversation); 404 when there is none."""
        if not self.store.discard(response_id):
            raise APIError(404, f"no stored response {response_id!r}", param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str) -> dict:
        """Abort a response in progress; its status becomes "cancelled"."""
        if response_id not in self.running:
            self.retrieve(response_id)  # 404 when unknown
            raise APIError(
                400,
                f"response {response_id!r} is not in progress; only a response in progress can be cancelled",
                param="response_id",
            )
        run, engine, request_id = self.running[response_id]
        await engine.cancel(request_id)
        return {**run.snapshot(), "status": "cancelled"}
