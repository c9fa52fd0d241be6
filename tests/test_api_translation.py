"""The Responses and Messages translators on a chat turn with reasoning, text and a tool call (which the tiny
random models never produce): every event and final object must validate against the official clients' types,
and the chat path's `reasoning_content` must become a reasoning item / a thinking block."""

import asyncio
import json

import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types.responses import Response, ResponseStreamEvent

from novainfer.server.anthropic import MessageRun
from novainfer.server.chat_turn import ChatTurn, Finish, Piece
from novainfer.server.protocol_anthropic import MessagesRequest
from novainfer.server.protocol_responses import ResponsesRequest
from novainfer.server.responses import ResponseRun
from tests.tiny_models import make_tokenizer

USAGE = {
    "prompt_tokens": 20,
    "completion_tokens": 9,
    "total_tokens": 29,
    "prompt_tokens_details": {"cached_tokens": 16},
}
CHUNKS = [  # what /v1/chat/completions streams for such a turn (a reasoning parser and a named tool call)
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "The user wants "}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "the weather."}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": "Let me look."}, "finish_reason": None}]},
    {
        "choices": [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": '},
                        }
                    ]
                },
                "finish_reason": None,
            }
        ]
    },
    {
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
                "finish_reason": None,
            }
        ]
    },
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls", "stop_reason": None}]},
    {"choices": [], "usage": USAGE},
]
WHOLE = {
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "stop_reason": None,
            "message": {
                "role": "assistant",
                "reasoning_content": "The user wants the weather.",
                "content": "Let me look.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
        }
    ],
    "usage": USAGE,
}


def turn_events(streamed: bool) -> list:
    """The pieces ChatTurn reads from the chat path's answer, streamed (SSE chunks) or whole."""
    if streamed:

        async def body():
            for chunk in CHUNKS:
                yield "data: " + json.dumps(chunk) + "\n\n"
            yield "data: [DONE]\n\n"

        response = StreamingResponse(body())
    else:
        response = JSONResponse(WHOLE)

    async def collect() -> list:
        return [e async for e in ChatTurn(response, "r1").events()]

    return asyncio.run(collect())


@pytest.mark.parametrize("streamed", [True, False])
def test_chat_turn_reads_reasoning_text_and_calls(streamed):
    events = turn_events(streamed)
    assert (
        "".join(e.text for e in events if isinstance(e, Piece) and e.kind == "reasoning")
        == "The user wants the weather."
    )
    assert "".join(e.text for e in events if isinstance(e, Piece) and e.kind == "text") == "Let me look."
    calls = [e for e in events if isinstance(e, Piece) and e.kind == "call"]
    assert calls[0].call_id == "call_1" and calls[0].name == "get_weather"
    assert "".join(c.text for c in calls) == '{"city": "Paris"}'
    assert events[-1] == Finish("tool_calls", None, USAGE)


def test_responses_items_and_events_validate_against_openai_types():
    req = ResponsesRequest.model_validate(
        {"input": "Weather?", "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]}
    )
    run = ResponseRun(req, "resp_1", "m", make_tokenizer())
    events = [e for piece in turn_events(True) for e in run.consume(piece)]
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for i, event in enumerate(events):
        adapter.validate_python({**event, "sequence_number": i})
    assert [e["type"] for e in events if e["type"].endswith(".added")] == [
        "response.output_item.added",
        "response.content_part.added",
    ] * 2 + ["response.output_item.added"]
    final = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == "response.completed" and final.status == "completed"
    reasoning, message, call = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "The user wants the weather."
    assert message.content[0].text == "Let me look." and call.arguments == '{"city": "Paris"}'
    assert final.usage.output_tokens_details.reasoning_tokens > 0
    assert final.usage.input_tokens_details.cached_tokens == 16


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 2048}, None])
def test_messages_blocks_and_events_validate_against_anthropic_types(thinking):
    req = MessagesRequest.model_validate(
        {
            "max_tokens": 50,
            "messages": [{"role": "user", "content": "Weather?"}],
            **({"thinking": thinking} if thinking else {}),
        }
    )
    run = MessageRun(req, "msg_1", "m")
    events = [("message_start", {"type": "message_start", "message": run.message()})]
    events += [e for piece in turn_events(False) for e in run.consume(piece)]
    adapter = pydantic.TypeAdapter(RawMessageStreamEvent)
    for name, data in events:
        assert adapter.validate_python(data).type == name
    final = Message.model_validate(run.message())
    kinds = [b.type for b in final.content]
    assert kinds == (["thinking", "text", "tool_use"] if thinking else ["text", "tool_use"])
    if thinking:
        assert final.content[0].thinking == "The user wants the weather."
    assert final.content[-1].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    assert final.usage.input_tokens == 4 and final.usage.cache_read_input_tokens == 16
