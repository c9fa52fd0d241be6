"""Tools and reasoning through the official openai client (and LangChain, litellm) against a real `novainfer serve` of a
tiny thinking model started with no tool or reasoning flag: tools without tool_choice answer 200, forced calls
keep to their schemas (jsonschema, extra properties refused), a cut call ends with "length" and no content, and
reasoning_content is the output's text up to `</think>` (the reference: the same prompt through
/v1/completions), whole and streamed, with structured outputs applying after it."""

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.server_utils import RemoteServer
from tests.thinking_model import make_thinking_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["unit", "days"],
        },
    },
}  # no additionalProperties: the server must still refuse undeclared ones
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_thinking_model(str(tmp_path_factory.mktemp("thinking")))


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    """The server, started with no tool or reasoning flag, and an openai client of it (server.client)."""
    srv = RemoteServer(
        [model_path, "--served-model-name", "think", "--dtype", "float32"],
        str(tmp_path_factory.mktemp("tools") / "server.log"),
        timeout=120,
    )
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client


@pytest.fixture(scope="module")
def end_id(model_path):
    return AutoTokenizer.from_pretrained(model_path).convert_tokens_to_ids("</think>")


def _raw(client, model_path, bias: dict, **template_kwargs) -> str:
    """The greedy output's raw text for ASK's chat prompt, through /v1/completions (no parsing)."""
    ids = AutoTokenizer.from_pretrained(model_path).apply_chat_template(
        ASK, add_generation_prompt=True, tokenize=True, **template_kwargs
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return (
        client.completions.create(model="think", prompt=list(ids), max_tokens=16, temperature=0, logit_bias=bias)
        .choices[0]
        .text
    )


@pytest.mark.parametrize("bias", [0.0, 2.0])
def test_reasoning_content_is_the_text_before_the_end_of_thinking(client, model_path, end_id, bias):
    raw = _raw(client, model_path, {str(end_id): bias})
    reasoning, sep, rest = raw.partition("</think>")
    want = (reasoning.lstrip(), rest.lstrip() if sep else None)
    kw = dict(model="think", messages=ASK, max_tokens=16, temperature=0, logit_bias={str(end_id): bias})
    msg = client.chat.completions.create(**kw).choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == want
    assert msg.model_extra["reasoning"] == want[0]
    got_reasoning, got_content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            got_reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            got_content += c.delta.content or ""
    assert (got_reasoning, got_content) == (want[0], want[1] or "")


def test_enable_thinking_false_needs_no_reasoning_parsing(client, model_path):
    raw = _raw(client, model_path, {}, enable_thinking=False)
    msg = (
        client.chat.completions.create(
            model="think",
            messages=ASK,
            max_tokens=16,
            temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        .choices[0]
        .message
    )
    assert msg.model_extra.get("reasoning_content") is None and msg.content == raw


def test_structured_output_applies_after_the_reasoning(client, end_id):
    schema = WEATHER["function"]["parameters"]
    resp = client.chat.completions.create(
        model="think",
        messages=ASK,
        max_tokens=48,
        temperature=0,
        logit_bias={str(end_id): 2.0},
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}},
    )
    msg = resp.choices[0].message
    assert msg.model_extra["reasoning_content"] and resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(msg.content), {**schema, "additionalProperties": False})


def test_tools_without_tool_choice_answer_200_on_a_plain_server(client):
    resp = client.chat.completions.create(model="think", messages=ASK, tools=[WEATHER, TIME], max_tokens=8)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_declare_no_extra_property(client, tool_choice):
    resp = client.chat.completions.create(
        model="think",
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=60,
        tool_choice=tool_choice,
        temperature=0.8,
        seed=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    msg = resp.choices[0].message
    assert msg.tool_calls and msg.content is None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in msg.tool_calls:
        jsonschema.validate(
            json.loads(call.function.arguments), {**schemas[call.function.name], "additionalProperties": False}
        )


def test_a_call_cut_by_max_tokens_ends_with_length_and_no_content(client, server):
    kw = dict(
        model="think",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=4,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None and not choice.message.tool_calls
    body = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=30,
        json={
            "messages": ASK,
            "tools": [WEATHER],
            "tool_choice": "required",
            "max_tokens": 4,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    ).json()
    assert "tool_calls" not in body["choices"][0]["message"]  # absent, not an empty list to index into


def test_langchain_bind_tools_runs_unchanged(server):
    langchain_openai = pytest.importorskip("langchain_openai")

    def get_weather(unit: Literal["celsius", "fahrenheit"], days: Literal[1, 2, 3]) -> str:
        """The weather forecast."""
        return "sunny"

    llm = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1", api_key="unused", model="think", max_tokens=60, temperature=0, max_retries=0
    )
    reply = llm.bind_tools([get_weather]).invoke("Weather?")  # tool_choice left to the server: "auto"
    assert reply.type == "ai"
    forced = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "Weather?", extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert [c["name"] for c in forced.tool_calls] == ["get_weather"]
    assert set(forced.tool_calls[0]["args"]) <= {"unit", "days"}


def test_litellm_completion_runs_unchanged(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price list, not a download at import
    litellm = pytest.importorskip("litellm")
    kw = dict(
        model="openai/think",
        api_base=server.url + "/v1",
        api_key="unused",
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=60,
        temperature=0,
        num_retries=0,
    )
    reply = litellm.completion(**kw)  # tool_choice left to the server: "auto"
    assert reply.choices[0].message.role == "assistant"
    forced = litellm.completion(
        **kw,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    calls = forced.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    jsonschema.validate(
        json.loads(calls[0].function.arguments), {**TIME["function"]["parameters"], "additionalProperties": False}
    )


CALL_REGEX = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'


def test_an_auto_call_written_after_reasoning_is_parsed_whole_and_streamed(client, end_id):
    """A regex makes the random model write a Hermes call once its reasoning ends (the bias ends it): the server
    must return it as tool_calls, and the stream must carry the same call in OpenAI's delta shape."""
    kw = dict(
        model="think",
        messages=ASK,
        tools=[TIME],
        max_tokens=120,
        temperature=0,
        logit_bias={str(end_id): 2.0},
        extra_body={"structured_outputs": {"regex": CALL_REGEX}},
    )
    choice = client.chat.completions.create(**kw).choices[0]
    msg = choice.message
    assert choice.finish_reason == "tool_calls" and msg.content is None and msg.model_extra["reasoning_content"]
    assert [c.function.name for c in msg.tool_calls] == ["get_time"]
    assert json.loads(msg.tool_calls[0].function.arguments)["zone"] in ("UTC", "CET")
    calls, reasoning, reason = {}, "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reason = c.finish_reason or reason
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert reason == "tool_calls" and reasoning == msg.model_extra["reasoning_content"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls
    ]
