"""`strict: true` functions under tool_choice "auto": the lazy grammar leaves text free until the call marker, then
holds the call to the closed schema (hermes and qwen3_coder, with the marker as text or as one added token;
llama3_json, whose output is text or calls from its start; mistral's two forms); other
formats refuse with a 400 naming the field; and end to end, a tiny thinking model whose logit_bias pushes the
marker returns a call whose arguments validate with additionalProperties false (jsonschema is the reference)."""

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from novainfer.server.errors import APIError
from novainfer.server.protocol import ChatCompletionRequest
from novainfer.server.tool_calling import ToolConfig, extract_calls, plan_tools
from novainfer.structured_output.guidance_backend import GuidanceBackend
from tests.server_utils import RemoteServer
from tests.thinking_model import CALL_TOKENS, THINK_TOKENS, make_thinking_model
from tests.tiny_models import make_tokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "note": {"type": "string"},
    },
    "required": ["unit", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
]
CLOSED = {**WEATHER, "additionalProperties": False}
# (parser, a strict call with free text before it where the format allows, the same call with an undeclared
# property, a non-strict call)
CALLS = [
    (
        "hermes",
        ('Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius", "days": 2}}\n</tool_call>'),
        '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius", "days": 2, "city": "Paris"}}',
        '<tool_call>\n{"name": "lookup", "arguments": {"q": [1, 2]}}\n</tool_call>',
    ),
    (
        "qwen3_coder",
        (
            "Let me see. <tool_call>\n<function=get_weather>\n<parameter=unit>\ncelsius\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n<parameter=note>\ntwo\nlines\n</parameter>\n</function>\n"
            "</tool_call>"
        ),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n<parameter=city>\n"
        ),
        "<tool_call>\n<function=lookup>\n<parameter=q>\nanything\n</parameter>\n</function>\n</tool_call>",
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"unit": "celsius", "days": 2}}',
        '{"name": "get_weather", "parameters": {"unit": "celsius", "days": 2, "city": "Paris"}}',
        '{"name": "lookup", "parameters": {"q": 1}}',
    ),
]


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, **kw}
    )


def _follows(grammar, tok, text: str) -> bool:
    matcher = grammar.matcher()
    return all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module", params=[False, True], ids=["marker-as-text", "marker-as-token"])
def tok(request):
    return make_tokenizer(extra_tokens=THINK_TOKENS + (CALL_TOKENS if request.param else ()))


@pytest.mark.parametrize("parser, call, extra, loose", CALLS)
def test_strict_calls_under_auto_keep_to_the_closed_schema(tok, parser, call, extra, loose):
    plan = plan_tools(_request(), ToolConfig(tool_call_parser=parser), "hermes", tok)
    grammar = GuidanceBackend(tok, len(tok), {tok.eos_token_id}).compile(plan.structured)
    assert _follows(grammar, tok, "Any text at all, { } <tool_ before a call.")
    assert _follows(grammar, tok, call) and not _follows(grammar, tok, extra)
    assert _follows(grammar, tok, loose)  # a non-strict function's arguments stay open
    content, calls = extract_calls(plan, call)
    assert content == (None if parser == "llama3_json" else "Let me see.")
    assert [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), CLOSED)


MISTRAL = [  # (its added tokens, a strict call after text, with an undeclared property, a non-strict call)
    (
        ("[TOOL_CALLS]", "[ARGS]"),
        'Let me see. [TOOL_CALLS]get_weather[ARGS]{"unit": "celsius", "days": 2}',
        '[TOOL_CALLS]get_weather[ARGS]{"unit": "celsius", "days": 2, "city": "Paris"}',
        '[TOOL_CALLS]get_weather[ARGS]{"unit": "celsius", "days": 2}[TOOL_CALLS]lookup[ARGS]{"q": 1}',
    ),
    (
        ("[TOOL_CALLS]",),
        'Let me see. [TOOL_CALLS][{"name": "get_weather", "arguments": {"unit": "celsius", "days": 2}}]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"unit": "celsius", "days": 2, "city": "Paris"}}]',
        '[TOOL_CALLS][{"name": "lookup", "arguments": {"q": 1}}]',
    ),
]


@pytest.mark.parametrize("tokens, call, extra, loose", MISTRAL, ids=["v11", "v3"])
def test_mistral_strict_calls_keep_to_the_closed_schema_in_either_form(tokens, call, extra, loose):
    tok = make_tokenizer(extra_tokens=tokens)
    plan = plan_tools(_request(), ToolConfig(tool_call_parser="mistral"), "hermes", tok)
    grammar = GuidanceBackend(tok, len(tok), {tok.eos_token_id}).compile(plan.structured)
    assert _follows(grammar, tok, call) and not _follows(grammar, tok, extra) and _follows(grammar, tok, loose)
    content, calls = extract_calls(plan, call)
    assert content == "Let me see." and [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), CLOSED)


def test_no_strict_function_means_no_constraint():
    plan = plan_tools(
        _request(tools=[{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": False}}]),
        ToolConfig(),
        "hermes",
        make_tokenizer(),
    )
    assert plan.mode == "auto" and plan.structured is None


@pytest.mark.parametrize("parser", ["pythonic", "gemma4", "mistral"])  # mistral: [TOOL_CALLS] is no token here
def test_strict_under_auto_is_refused_where_no_grammar_is_written(parser):
    with pytest.raises(APIError) as err:
        plan_tools(
            _request(tools=[TOOLS[1], TOOLS[0]]), ToolConfig(tool_call_parser=parser), "hermes", make_tokenizer()
        )
    assert err.value.status == 400 and err.value.param == "tools[1].function.strict"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_thinking_model(str(tmp_path_factory.mktemp("strict")), call_tokens=True)
    srv = RemoteServer(
        [path, "--served-model-name", "think", "--dtype", "float32"],
        str(tmp_path_factory.mktemp("strict-log") / "server.log"),
        timeout=120,
    )
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.marker = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(CALL_TOKENS[0])
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_pushed_auto_call_of_a_strict_function_validates_closed(server, stream):
    """The bias makes the random model open a call; only the grammar can make what follows a valid call."""
    kw = {
        "model": "think",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": TOOLS[:1],
        "max_tokens": 200,
        "temperature": 0.8,
        "seed": 3,
        "parallel_tool_calls": False,
        "logit_bias": {str(server.marker): 100},
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    if not stream:
        choice = server.client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        reason = choice.finish_reason
    else:
        parts, reason = {}, None
        for chunk in server.client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                reason = c.finish_reason or reason
                for d in c.delta.tool_calls or []:
                    name, args = parts.get(d.index, (d.function.name, ""))
                    parts[d.index] = (name, args + (d.function.arguments or ""))
        calls = list(parts.values())
    assert reason == "tool_calls" and [name for name, _ in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][1]), CLOSED)
