"""OpenAI's Responses API on a real `novainfer serve` (tiny random float32 model), driven by the official openai
client and the openai-agents SDK, unchanged: every answer is parsed into the client's own pydantic types.

The reference is the chat completions path of the same server: a response must carry the text, usage and tool
calls that /v1/chat/completions gives for the equivalent messages under greedy decoding.
"""

import asyncio
import json
from typing import Literal

import agents
import httpx
import jsonschema
import openai
import pytest

from tests.server_utils import FLOAT32, RemoteServer

MODEL = "tiny"
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": CITY}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
FORCED = {"type": "function", "name": "get_weather"}
LONG = (
    "Paged attention stores keys and values in fixed-size blocks of the cache, so a second turn that "
    "starts with the first one reuses its blocks. Tell me more about the cache."
)


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = RemoteServer(
        [tiny_llama, "--served-model-name", MODEL, *FLOAT32], str(tmp_path_factory.mktemp("responses") / "server.log")
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_text_response_matches_the_chat_path(client):
    resp = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Hello there", temperature=0, max_output_tokens=6
    )
    chat = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=6,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
    )
    assert resp.object == "response" and resp.model == MODEL and resp.instructions == "Be brief."
    assert resp.output_text == chat.choices[0].message.content
    assert resp.output[0].type == "message" and resp.output[0].content[0].type == "output_text"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens == 6
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    if chat.choices[0].finish_reason == "length":  # a random model rarely stops by itself
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed"


def test_streamed_json_schema_response_follows_the_documented_events(client):
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "n": {"enum": [1, 2]}},
        "required": ["color", "n"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}}
    with client.responses.stream(model=MODEL, input="Pick one", text=fmt, max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == final.output_text
    jsonschema.validate(json.loads(final.output_text), schema)
    assert final.status == "completed" and final.text.format.type == "json_schema"
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_forced_function_call_then_its_output_continues_the_stored_conversation(client):
    first = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice=FORCED, max_output_tokens=30
    )
    call = first.output[0]
    assert first.status == "completed" and len(first.output) == 1
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), CITY)
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=5,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert second.previous_response_id == first.id
    # the same conversation through chat completions: the stored turn was re-rendered, not dropped
    chat = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=5,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
        ],
    )
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content


def test_previous_response_id_hits_the_prefix_cache(client):
    first = client.responses.create(model=MODEL, input=LONG, temperature=0, max_output_tokens=4)
    second = client.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, temperature=0, max_output_tokens=4
    )
    chat = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=4,
        messages=[
            {"role": "user", "content": LONG},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
    )
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2 > 0
    assert second.output_text == chat.choices[0].message.content


def test_streamed_function_call_arguments(client):
    with client.responses.stream(
        model=MODEL, input="Weather?", tools=[WEATHER], tool_choice=FORCED, max_output_tokens=30
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert pieces == events[-3].arguments == final.output[0].arguments
    jsonschema.validate(json.loads(pieces), CITY)


def test_retrieve_delete_and_store_false(client):
    made = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, metadata={"k": "v"}, user="u1")
    got = client.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text and got.metadata == {"k": "v"}
    assert got.user == "u1"
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="x", previous_response_id=made.id, max_output_tokens=2)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError, match="not in progress"):
        client.responses.cancel(client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).id)


def test_cancel_a_streaming_response(server, client):
    # greedy: this prompt runs to max_output_tokens (a sampled token could end the turn first)
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 480, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/responses", json=body, headers={"X-Request-Id": "stop-me"}) as resp:
            cancelled = client.responses.cancel("resp_stop-me")  # as soon as the generation is submitted
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    assert cancelled.status == "cancelled" and cancelled.id == "resp_stop-me"
    last = events[-1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "cancelled"
    assert last["response"]["usage"]["output_tokens"] < 480
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


@pytest.mark.parametrize(
    "kw, named",
    [
        (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
        (dict(background=True), "background"),
        (dict(conversation="conv_1"), "conversation"),
        (
            dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
            "input[0].content[0].type",
        ),
        (dict(include=["reasoning.encrypted_content"]), "include"),
        (dict(tool_choice={"type": "web_search_preview"}, tools=[WEATHER]), "tool_choice"),
    ],
)
def test_unsupported_fields_are_a_400_naming_them(client, kw, named):
    kw = {"input": "Hi", **kw}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, max_output_tokens=2, **kw)
    assert named in err.value.body["message"] and err.value.body["type"] == "invalid_request_error"


def test_agents_sdk_runs_a_function_tool_to_completion(server):
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def run() -> object:
        model = agents.OpenAIResponsesModel(
            model=MODEL, openai_client=openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        )
        agent = agents.Agent(
            name="weather",
            instructions="Use the tool.",
            tools=[get_weather],
            model=model,
            model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=40),
            tool_use_behavior="stop_on_first_tool",
        )
        return await agents.Runner.run(agent, "Weather in Paris?")

    result = asyncio.run(run())
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome")
    assert result.final_output == f"sunny in {calls[0]}"
    assert [i.type for i in result.new_items] == ["tool_call_item", "tool_call_output_item"]


def test_error_shape_and_validation(server):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "x", "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL})
    assert r.status_code == 400 and "input" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 400, "stream": True, "temperature": 0}),
        (
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 400,
                "stream": True,
                "temperature": 0,
                "messages": [{"role": "user", "content": "Hi"}],
            },
        ),
    ],
)
def test_client_leaving_a_stream_aborts_its_generation(server, path, body):
    aborts = server.metric("novainfer:request_success_total", finished_reason="abort")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", path, json=body) as resp:
            lines = resp.iter_lines()
            for _ in range(12):
                next(lines)
        # leaving the block closes the connection mid-stream
    assert server.wait_idle() == 0.0
    assert server.metric("novainfer:request_success_total", finished_reason="abort") == aborts + 1
