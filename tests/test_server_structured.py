"""Structured outputs, tool calls, echo + prompt logprobs, logit_bias, refused fields and the API key from the
environment, through the official openai client against real `novainfer serve` processes: the default model
for constraints and tools (checked with jsonschema / pydantic / re), a tiny float32 model for log-probabilities
(checked against transformers' log-softmax)."""

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from tests.server_utils import RemoteServer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "active", "tags", "address"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
KEY = "test-key-7f3a9c"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RemoteServer(
        ["--dtype", "float32", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        str(tmp_path_factory.mktemp("structured") / "server.log"),
        timeout=240,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tiny_server(tiny_llama, tmp_path_factory):
    """A tiny float32 model, prefill chunks of 8 tokens, the API key from the environment, DEBUG logs."""
    srv = RemoteServer(
        [tiny_llama, "--served-model-name", "tiny", "--dtype", "float32", "--max-num-batched-tokens", "8"],
        str(tmp_path_factory.mktemp("tiny") / "server.log"),
        timeout=120,
        env={"NOVAINFER_API_KEY": KEY},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tiny(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=KEY, max_retries=0)


class Address(BaseModel):
    city: str = Field(max_length=12)
    zip: int = Field(ge=10000, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    color: Literal["red", "green", "blue"]
    active: bool
    address: Address


def test_parse_returns_the_pydantic_object(client):
    resp = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct",
        response_format=Person,
        max_tokens=150,
        messages=[{"role": "user", "content": "Describe a person."}],
        temperature=0,
    )
    person = resp.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.address, Address)


def test_json_schema_samples_validate_streamed_and_not(client):
    kw = dict(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        n=3,
        temperature=1.0,
        seed=11,
        max_tokens=150,
    )
    texts = [c.message.content for c in client.chat.completions.create(**kw).choices]
    parts = [""] * 3
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
    for text in texts + parts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_parses_and_streaming_equals_non_streaming(client):
    """Every json_object output that ends (finish_reason stop) parses; streamed equals whole under greedy. (The
    135M model can also loop inside an unbounded object until max_tokens: a schema with bounds is the cure.)"""
    kw = dict(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": 'Return {"ok": true} as JSON.'}],
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_object"},
    )
    whole = client.chat.completions.create(**kw).choices[0]
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices
    )
    assert whole.finish_reason == "stop" and isinstance(json.loads(whole.message.content), dict)
    assert streamed == whole.message.content
    sampled = client.chat.completions.create(**{**kw, "temperature": 1.0, "n": 4, "seed": 3}).choices
    assert any(c.finish_reason == "stop" for c in sampled)
    for c in sampled:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)


def test_regex_and_choice_hold_on_both_endpoints(client):
    phone = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="My phone number is",
        n=4,
        seed=1,
        temperature=1.0,
        max_tokens=20,
        extra_body={"guided_regex": r"\d{3}-\d{4}"},
    )
    assert all(re.fullmatch(r"\d{3}-\d{4}", c.text) for c in phone.choices)
    mood = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        n=6,
        seed=2,
        temperature=1.0,
        max_tokens=5,
        messages=[{"role": "user", "content": "How do you feel?"}],
        extra_body={"structured_outputs": {"choice": ["happy", "sad"]}},
    )
    assert {c.message.content for c in mood.choices} <= {"happy", "sad"}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call_round_trip(client, tool_choice):
    tools = [WEATHER, TIME]
    first = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, tools=tools, tool_choice=tool_choice, temperature=0, max_tokens=100
    )
    msg = first.choices[0].message
    assert msg.tool_calls and msg.content is None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in msg.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if tool_choice != "required":
        assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    assert first.choices[0].finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    results = [{"role": "tool", "tool_call_id": c.id, "content": "21 degrees and sunny"} for c in msg.tool_calls]
    final = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        tools=tools,
        tool_choice="none",
        messages=ASK + [msg.model_dump(exclude_none=True)] + results,
        temperature=0,
        max_tokens=20,
    )
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_deltas_reassemble(client, tool_choice):
    kw = dict(
        model="SmolLM2-135M-Instruct",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=100,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    reason = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reason = c.finish_reason or reason
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert all(c["id"] for c in calls.values()) and reason == whole.finish_reason


def test_echo_logprobs_equal_transformers(tiny, tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The quick brown fox jumps over the lazy dog"
    ids = AutoTokenizer.from_pretrained(tiny_llama).encode(prompt)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for _ in range(2):  # the second time the prompt sits in the prefix cache
        resp = tiny.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
        lp = resp.choices[0].logprobs
        assert resp.choices[0].text.startswith(prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids) + 1
        for pos in range(1, len(ids)):
            assert abs(lp.token_logprobs[pos] - ref[pos - 1, ids[pos]].item()) < 1e-4
        assert "".join(lp.tokens[: len(ids)]) == prompt and lp.text_offset[len(ids)] == len(prompt)


def test_logit_bias_bans_and_forces(tiny, tiny_server):
    kw = dict(model="tiny", prompt="Hello", temperature=0, max_tokens=5, logprobs=0, extra_body={"ignore_eos": True})
    first = tiny.completions.create(**kw).choices[0].logprobs.tokens[0]
    ids = httpx.post(
        tiny_server.url + "/tokenize",
        json={"prompt": first, "add_special_tokens": False},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=10,
    ).json()["tokens"]
    assert len(ids) == 1
    banned = tiny.completions.create(logit_bias={str(ids[0]): -100}, **kw).choices[0].logprobs.tokens
    assert first not in banned
    forced = tiny.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=1.0,
        logit_bias={"17": 100},
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    assert len(forced.choices[0].logprobs.content) == 4
    tokens = [t.token for t in forced.choices[0].logprobs.content]
    assert len(set(tokens)) == 1


@pytest.mark.parametrize(
    "path,field,value",
    [
        ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
        ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
        ("/v1/chat/completions", "web_search_options", {}),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
        ("/v1/chat/completions", "reasoning_effort", "high"),
        ("/v1/chat/completions", "some_future_knob", 1),
        ("/v1/completions", "suffix", "end"),
        ("/v1/completions", "best_of", 2),
    ],
)
def test_unsupported_fields_are_refused_by_name(tiny_server, path, field, value):
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    r = httpx.post(tiny_server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_modalities_audio_is_refused_and_auto_tools_work_without_flags(tiny_server):
    headers = {"Authorization": f"Bearer {KEY}"}
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(
        tiny_server.url + "/v1/chat/completions",
        headers=headers,
        timeout=30,
        json={"messages": msgs, "modalities": ["text", "audio"]},
    )
    assert r.status_code == 400 and "modalities" in r.json()["error"]["param"]
    r = httpx.post(
        tiny_server.url + "/v1/chat/completions",
        headers=headers,
        timeout=30,
        json={"messages": msgs, "tools": [WEATHER], "max_tokens": 4},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_api_key_from_the_environment_works_and_stays_out_of_the_logs(tiny_server, tiny):
    assert httpx.get(tiny_server.url + "/v1/models", timeout=10).status_code == 401
    assert (
        httpx.get(tiny_server.url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code
        == 401
    )
    assert tiny.models.list().data[0].id == "tiny"
    assert KEY not in tiny_server.log()
    assert all(KEY not in arg for arg in tiny_server.proc.args)
