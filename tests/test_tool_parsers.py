"""Every tool-call parser and the reasoning split on scripted model outputs: whole extraction, streaming fed one
character at a time (so every split inside a marker or a token is a chunk boundary), unclosed calls, calls after
reasoning, and malformed output that must stay content; plus the parser choice from chat templates."""

import json

import pytest

from novainfer.server.chat_output import ChoiceOutput
from novainfer.server.reasoning_parsers import choose_reasoning_parser, get_reasoning_parser
from novainfer.server.structured_request import closed_schema
from novainfer.server.tool_calling import ToolPlan
from novainfer.server.tool_parsers import choose_tool_parser, get_tool_parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "zip": {"type": "string"},
                    "opts": {"type": "object"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
W = {"city": "Paris", "days": 2}

CASES = [  # parser, output, content, [(name, arguments)]
    (
        "hermes",
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Sure.",
        [("get_weather", W), ("get_time", {})],
    ),
    (
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}',
        None,
        [("get_weather", W)],
    ),  # no closing tag
    ("hermes", "no call here", "no call here", []),
    ("hermes", '<tool_call>{"name": get_weather}</tool_call>', '<tool_call>{"name": get_weather}</tool_call>', []),
    (
        "qwen3_coder",
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "Let me check.",
        [("get_weather", {**W, "zip": "75001"}), ("get_time", {})],
    ),  # zip stays a string: its schema says so
    (
        "qwen3_coder",
        '<tool_call>\n<function=get_weather>\n<parameter=opts>\n{"a": [1, 2]}\n</parameter>\n</function>',
        None,
        [("get_weather", {"opts": {"a": [1, 2]}})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
        '{"name": "get_time", "parameters": {}}',
        None,
        [("get_weather", W), ("get_time", {})],
    ),
    ("llama3_json", 'The answer is {"name": 1}', 'The answer is {"name": 1}', []),
    ("pythonic", '[get_weather(city="Paris", days=2), get_time()]', None, [("get_weather", W), ("get_time", {})]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", days=2)]<|python_end|>', None, [("get_weather", W)]),
    ("pythonic", "[1, 2, 3] is a list", "[1, 2, 3] is a list", []),
    ("pythonic", "[get_weather(city=open('x'))]", "[get_weather(city=open('x'))]", []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
        '{"name": "get_time", "arguments": {}}]',
        None,
        [("get_weather", W), ("get_time", {})],
    ),
    (
        "mistral",
        'Ok [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{}',
        "Ok",
        [("get_weather", W), ("get_time", {})],
    ),
    (
        "gemma4",
        'Checking.<|tool_call>call:get_weather{city:<|"|>Paris, "FR"<|"|>,days:2,opts:{deep:[1,true,'
        '<|"|>x<|"|>],n:null}}<tool_call|><|tool_call>call:get_time{}<tool_call|>',
        "Checking.",
        [
            ("get_weather", {"city": 'Paris, "FR"', "days": 2, "opts": {"deep": [1, True, "x"], "n": None}}),
            ("get_time", {}),
        ],
    ),
]


UNFINISHED = [  # outputs that stop inside their first call: content as written when they end, none when cut
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
    ("mistral", 'Ok [TOOL_CALLS]get_weather[ARGS]{"city": "Pa'),
    ("gemma4", 'Ok <|tool_call>call:get_weather{city:<|"|>Par'),
    ("hermes", 'Ok <tool_call>{"name": "get_weather", "arguments": {"city": "Pa'),
]


def stream(output: ChoiceOutput, text: str, reason: str = "stop") -> tuple[str, str, list[dict], list[dict]]:
    """Feed the output one character at a time; (reasoning, content, calls reassembled, first deltas of calls)."""
    reasoning, content, calls, firsts = "", "", {}, []
    for k in range(1, len(text) + 1):
        for d in output.deltas(text[:k], k == len(text), reason if k == len(text) else None):
            reasoning += d.get("reasoning_content", "")
            assert d.get("reasoning", "") == d.get("reasoning_content", "")
            content += d.get("content") or ""
            for tc in d.get("tool_calls", []):
                if tc["index"] not in calls:
                    firsts.append(tc)
                    calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
                calls[tc["index"]]["arguments"] += tc["function"].get("arguments", "")
    return reasoning, content, [calls[i] for i in sorted(calls)], firsts


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parser_whole_and_streamed_one_character_at_a_time(parser, text, content, calls):
    p = get_tool_parser(parser, TOOLS)
    got_content, got = p.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    plan = ToolPlan("auto", TOOLS, parser=p)
    msg, reason = ChoiceOutput(plan, None).message(text, "stop")
    assert msg["content"] == content and reason == ("tool_calls" if calls else "stop")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])] == calls
    _, s_content, s_calls, firsts = stream(ChoiceOutput(plan, None), text)
    assert [(c["name"], json.loads(c["arguments"])) for c in s_calls] == calls
    assert s_content.strip() == (content or "")
    for first in firsts:  # OpenAI's shape: the first delta of a call names it and has its id
        assert first["id"].startswith("call_") and first["type"] == "function" and first["function"]["name"]
        assert first["function"]["arguments"] == ""


@pytest.mark.parametrize("parser,text,content,calls", [c for c in CASES if c[3]])
def test_a_call_cut_by_max_tokens_never_becomes_content(parser, text, content, calls):
    """Cut at every character: content is never call markup, and the calls kept are complete and correct."""
    plan = ToolPlan("auto", TOOLS, parser=get_tool_parser(parser, TOOLS))
    for k in range(len(text)):
        msg, reason = ChoiceOutput(plan, None).message(text[:k], "length")
        assert reason == "length"
        assert msg["content"] is None or (content or "").startswith(msg["content"]), (k, msg)
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
        assert got == calls[: len(got)], (k, got)


@pytest.mark.parametrize(
    "prompt_tail,text,reasoning,content",
    [
        ("<|im_start|>assistant\n", "<think>\nLet me see.\n</think>\n\nIt is 4.", "Let me see.\n", "It is 4."),
        ("<|im_start|>assistant\n<think>\n", "Let me see.</think>It is 4.", "Let me see.", "It is 4."),
        ("<|im_start|>assistant\n<think>\n", "Still thinking", "Still thinking", None),  # cut: no end tag
        ("<|im_start|>assistant\n", "Plain answer.", None, "Plain answer."),
        ("<think>\n\n</think>\n\n", "Plain answer.", None, "Plain answer."),  # enable_thinking false in the prompt
    ],
)
def test_reasoning_split_whole_and_streamed(prompt_tail, text, reasoning, content):
    rp = get_reasoning_parser("qwen3", prompt_tail)
    msg, _ = ChoiceOutput(ToolPlan(None), rp).message(text, "stop")
    assert (msg["reasoning_content"], msg["content"]) == (reasoning, content) and msg["reasoning"] == reasoning
    s_reasoning, s_content, _, _ = stream(ChoiceOutput(ToolPlan(None), rp), text)
    assert s_reasoning == (reasoning or "") and s_content == (content or "")


@pytest.mark.parametrize(
    "parser,call",
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'),
        (
            "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n"
            "2\n</parameter>\n</function>\n</tool_call>",
        ),
    ],
)
def test_tool_call_after_reasoning_is_parsed(parser, call):
    plan = ToolPlan("auto", TOOLS, parser=get_tool_parser(parser, TOOLS))
    rp = get_reasoning_parser("qwen3", "assistant\n<think>\n")
    text = "I should call <tool_call> get_weather.</think>\n\n" + call
    msg, reason = ChoiceOutput(plan, rp).message(text, "stop")
    assert msg["reasoning_content"] == "I should call <tool_call> get_weather." and msg["content"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == W and reason == "tool_calls"
    s_reasoning, s_content, s_calls, _ = stream(ChoiceOutput(plan, rp), text)
    assert s_reasoning == msg["reasoning_content"] and s_content == ""
    assert [json.loads(c["arguments"]) for c in s_calls] == [W]


@pytest.mark.parametrize(
    "template,arch,tool,reasoning",
    [
        ("{{'<tool_call>'}}{% if tools %}{% endif %}<think></think>", [], "hermes", "qwen3"),
        (
            "{% if tools %}<tool_call>\n<function=x>\n<parameter=y>{% endif %}<think>\n</think>",
            [],
            "qwen3_coder",
            "qwen3",
        ),
        ("{% for t in tools %}[TOOL_CALLS]{% endfor %}", [], "mistral", None),
        ("{% if tools %}<|tool_call>call:{% endif %}", [], "gemma4", None),
        ("{% if tools %}<|python_start|>{% endif %}", [], "pythonic", None),
        ('{% if tools %}"parameters": dictionary of argument name{% endif %}<|python_tag|>', [], "llama3_json", None),
        ("<|channel|>{{ tools }}", [], "openai", "openai_gptoss"),
        ("{{ tools }}", ["LlamaForCausalLM"], "llama3_json", None),
        ("{{ messages }}", [], "hermes", None),  # no tool format: the tools go in as Hermes-style system text
    ],
)
def test_parser_is_chosen_from_the_chat_template(template, arch, tool, reasoning):
    assert choose_tool_parser(template, arch) == tool
    assert choose_reasoning_parser(template) == reasoning


def test_closed_schema_closes_every_object_unless_it_allows_extras():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "free": {"type": "object", "additionalProperties": True},
            "list": {"type": "array", "items": {"properties": {}}},
        },
        "$defs": {"d": {"type": "object"}},
        "anyOf": [{"type": "object"}, {"type": "string"}],
    }
    got = closed_schema(schema)
    assert got["additionalProperties"] is False and got["properties"]["a"]["additionalProperties"] is False
    assert got["properties"]["free"]["additionalProperties"] is True
    assert got["properties"]["list"]["items"]["additionalProperties"] is False
    assert got["$defs"]["d"]["additionalProperties"] is False and got["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is left alone


@pytest.mark.parametrize("parser,text", UNFINISHED)
def test_an_unfinished_call_is_content_when_it_stops_and_dropped_when_cut(parser, text):
    plan = ToolPlan("auto", TOOLS, parser=get_tool_parser(parser, TOOLS))
    msg, reason = ChoiceOutput(plan, None).message(text, "stop")
    assert msg["content"] == text and "tool_calls" not in msg and reason == "stop"
    msg, reason = ChoiceOutput(plan, None).message(text, "length")
    before = text[: text.index(plan.parser.start_marker)].strip() or None
    assert msg["content"] == before and "tool_calls" not in msg and reason == "length"
    _, s_content, s_calls, _ = stream(ChoiceOutput(plan, None), text, "length")
    assert s_content.strip() == (before or "")  # the call began streaming: its text never becomes content
    assert [c["name"] for c in s_calls] == ["get_weather"]


def test_trailing_special_tokens_are_not_content_when_markers_are_kept():
    plan = ToolPlan("auto", TOOLS, parser=get_tool_parser("pythonic", TOOLS))
    output = ChoiceOutput(plan, None, trim=("<|eom|>", "<|eot|>"))
    msg, reason = output.message("<|python_start|>[get_time()]<|python_end|><|eom|><|eot|>", "stop")
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "get_time"
    msg, _ = ChoiceOutput(ToolPlan(None), None, trim=("<|eot|>",)).message("Hello.<|eot|>", "stop")
    assert msg["content"] == "Hello."
