"""Anthropic's Messages API on a real `novainfer serve` (tiny random float32 model, an API key), driven by the
official anthropic client, unchanged: every answer is parsed into the client's own pydantic types.

The reference is the chat completions path of the same server: a message must carry the text, usage and tool
calls that /v1/chat/completions gives for the equivalent messages under greedy decoding.
"""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server_utils import FLOAT32, RemoteServer

MODEL = "tiny"
KEY = "test-key-anthropic"
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": CITY}
CHAT_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city", "parameters": CITY},
}
GREEDY = {"temperature": 0}  # the current anthropic client no longer names temperature; older ones send it


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = RemoteServer(
        [tiny_llama, "--served-model-name", MODEL, *FLOAT32],
        str(tmp_path_factory.mktemp("anthropic") / "server.log"),
        env={"NOVAINFER_API_KEY": KEY},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)  # sends x-api-key


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def test_text_message_matches_the_chat_path(client, chat):
    msg = client.messages.create(
        model=MODEL,
        max_tokens=6,
        system="Be brief.",
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Hello there"}],
    )
    ref = chat.chat.completions.create(
        model=MODEL,
        max_tokens=6,
        temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == ref.choices[0].message.content
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    assert msg.usage.output_tokens == ref.usage.completion_tokens
    assert msg.stop_reason == ("max_tokens" if ref.choices[0].finish_reason == "length" else "end_turn")


def test_system_blocks_equal_a_system_string(client):
    kw = dict(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=[{"role": "user", "content": "Hi"}])
    as_string = client.messages.create(system="Be brief. Be kind.", **kw)
    as_blocks = client.messages.create(
        system=[{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Be kind."}], **kw
    )
    assert as_blocks.content[0].text == as_string.content[0].text


def test_stop_sequence(client, chat):
    ask = [{"role": "user", "content": "Hello"}]
    ref = chat.chat.completions.create(
        model=MODEL, max_tokens=30, temperature=0, messages=ask, stop=["a", "e", "o", "i"]
    )
    msg = client.messages.create(
        model=MODEL, max_tokens=30, messages=ask, stop_sequences=["a", "e", "o", "i"], extra_body=GREEDY
    )
    assert msg.content[0].text == ref.choices[0].message.content
    assert ref.choices[0].finish_reason == "stop"  # 30 tokens of this model always meet a vowel
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == ref.choices[0].model_extra["stop_reason"]


def test_stream_events_and_final_message(client, server):
    kw = dict(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Hi"}])
    whole = client.messages.create(**kw, extra_body=GREEDY)
    with client.messages.stream(**kw, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [
        e
        for e in events
        if e.type
        in (
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        )
    ]
    assert [e.type for e in raw[:2]] == ["message_start", "content_block_start"]
    assert [e.type for e in raw[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert {e.delta.type for e in raw if e.type == "content_block_delta"} == {"text_delta"}
    assert "".join(e.delta.text for e in raw if e.type == "content_block_delta") == whole.content[0].text
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the wire: a ping follows message_start, and every event names itself
    body = httpx.post(
        server.url + "/v1/messages",
        json={**kw, **GREEDY, "max_tokens": 3, "stream": True},
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
    ).text
    names = [line[len("event: ") :] for line in body.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"


def test_forced_tool_use_and_tool_result_round_trip(client, chat):
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    msg = client.messages.create(
        model=MODEL, max_tokens=30, messages=ask, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}
    )
    use = msg.content[0]
    assert msg.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, CITY)
    turn = [
        *ask,
        {"role": "assistant", "content": msg.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]
    answer = client.messages.create(model=MODEL, max_tokens=5, messages=turn, extra_body=GREEDY)
    ref = chat.chat.completions.create(
        model=MODEL,
        max_tokens=5,
        temperature=0,
        messages=[
            *ask,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {"name": use.name, "arguments": json.dumps(use.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": "sunny"},
        ],
    )
    assert answer.content[0].text == ref.choices[0].message.content
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == ref.usage.prompt_tokens


def test_streamed_tool_use_with_any(client):
    with client.messages.stream(
        model=MODEL,
        max_tokens=60,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as s:
        events = list(s)
        final = s.get_final_message()
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert final.stop_reason == "tool_use" and final.content[0].input == json.loads(partial)
    jsonschema.validate(final.content[0].input, CITY)


def test_count_tokens_equals_the_prompt_that_runs(client):
    kw = dict(
        model=MODEL,
        system="Be brief.",
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    counted = client.messages.count_tokens(**kw)
    ran = client.messages.create(max_tokens=30, **kw)
    assert counted.input_tokens == ran.usage.input_tokens + ran.usage.cache_read_input_tokens > 0


def test_thinking_is_accepted(client):
    msg = client.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=[{"role": "user", "content": "Hi"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert [b.type for b in msg.content] == ["text"]  # the tiny model has no reasoning to show


@pytest.mark.parametrize(
    "kw, named",
    [
        (
            dict(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                            }
                        ],
                    }
                ]
            ),
            "messages[0].content[0].type",
        ),
        (dict(extra_body={"mcp_servers": []}), "mcp_servers"),
        (dict(tool_choice={"type": "any"}), "tool_choice"),
    ],
)
def test_unsupported_fields_are_a_400_in_anthropic_shape(client, kw, named):
    kw = {"messages": [{"role": "user", "content": "Hi"}], **kw}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=2, **kw)
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert named in body["error"]["message"]


def test_api_key_headers_and_error_shape(server):
    ask = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)  # Authorization: Bearer
    assert bearer.messages.create(**ask).usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(**ask)
    assert err.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json={**ask, "max_tokens": None})
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(
        server.url + "/v1/chat/completions", headers={"x-api-key": KEY}, json={"model": MODEL, "messages": []}
    )
    assert r.status_code == 400 and "error" in r.json() and "type" not in r.json()  # OpenAI's shape there


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens", "/v1/responses"])
def test_a_block_type_that_is_not_a_string_is_a_400(server, path):
    """The fuzzer's find: a content block (or input item) whose `type` is a list made the union's tag lookup raise
    (unhashable), a 500; it is a 400 naming the field."""
    if path == "/v1/responses":
        body = {"model": MODEL, "input": [{"type": [], "role": "user", "content": "Hi"}]}
    else:
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": []}]}]}
    r = httpx.post(server.url + path, headers={"x-api-key": KEY, "Authorization": f"Bearer {KEY}"}, json=body)
    assert r.status_code == 400, r.text
    assert "type" in r.text
