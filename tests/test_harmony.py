"""Harmony (gpt-oss's format) on the server. The references: openai-harmony's own message classes (the
conversations are built with them, the expected reasoning / content / calls read from them), llama.cpp's built-in
gpt-oss template, the official openai and anthropic clients against a real `novainfer serve` of a tiny random
model whose tokenizer has harmony's special tokens (tests/harmony_model.py), and, when o200k_base.tiktoken is at
hand (TIKTOKEN_ENCODINGS_BASE), openai-harmony's own renderer and parser."""

from __future__ import annotations

import ctypes
import json
import os
import random
import re

import anthropic
import openai
import pytest
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)
from transformers import AutoTokenizer

from novainfer.server.errors import APIError
from novainfer.server.harmony import forced_call_grammar, parse_messages, split_completion
from novainfer.server.harmony_chat import HarmonyChoiceOutput, harmony_template_kwargs
from novainfer.server.protocol import ChatMessage
from novainfer.server.reasoning_parsers import get_reasoning_parser
from novainfer.server.structured_request import closed_schema
from novainfer.server.tool_calling import ToolPlan
from novainfer.server.tool_parsers import get_tool_parser
from tests.harmony_model import make_harmony_model
from tests.server_utils import FLOAT32, RemoteServer

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": TIME_PARAMS}},
]


def _say(text: str, channel: str | None = None, to: str | None = None, ctype: str | None = None) -> Message:
    msg = Message.from_role_and_content(Role.ASSISTANT, text)
    msg = msg.with_channel(channel) if channel else msg
    msg = msg.with_recipient(to) if to else msg
    return msg.with_content_type(ctype) if ctype else msg


# assistant completions as openai-harmony messages, and whether the recipient sits in the role part of the header
COMPLETIONS = [
    ([_say("The user greets. Answer briefly.", "analysis"), _say("Hello! <b>Hi</b> to you.", "final")], False),
    (
        [
            _say("Need the weather.\nCall get_weather.", "analysis"),
            _say('{"city": "Paris <|x"}', "commentary", "functions.get_weather", "<|constrain|> json"),
        ],
        False,
    ),
    (
        [
            _say("First think.", "analysis"),
            _say("Let me check the time.", "commentary"),  # a preamble: shown to the user
            _say("Then more.", "analysis"),
            _say('{"zone": "CET"}', "commentary", "functions.get_time", "json"),
        ],
        True,
    ),
    ([_say("Just an answer, no reasoning.", "final")], False),
]


def _header(msg: Message, first: bool, recipient_in_role: bool) -> str:
    """The format, written out by hand from openai-harmony's message fields (the test's own writer)."""
    to = f" to={msg.recipient}" if msg.recipient else ""
    head = "" if first else "<|start|>assistant"
    head += (to if recipient_in_role else "") + f"<|channel|>{msg.channel}" + ("" if recipient_in_role else to)
    if msg.content_type:
        ctype = msg.content_type.replace("<|constrain|> ", "<|constrain|>")
        head += ctype if ctype.startswith("<|constrain|>") and not recipient_in_role else " " + ctype
    return head + "<|message|>"


def _write(msgs: list[Message], recipient_in_role: bool) -> str:
    """A completion (it continues the prompt's `<|start|>assistant`) ending in <|return|> or <|call|>."""
    out = []
    for i, msg in enumerate(msgs):
        last = i == len(msgs) - 1
        end = "<|end|>" if not last else ("<|call|>" if msg.recipient else "<|return|>")
        out.append(_header(msg, i == 0, recipient_in_role) + msg.content[0].text + end)
    return "".join(out)


def _expected(msgs: list[Message]) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    analysis = [m.content[0].text for m in msgs if m.channel == "analysis"]
    shown = [m.content[0].text for m in msgs if m.channel != "analysis" and not m.recipient]
    calls = [(m.recipient.removeprefix("functions."), m.content[0].text) for m in msgs if m.recipient]
    return ("\n".join(analysis) if analysis else None), ("".join(shown) if shown else None), calls


def _replay(output: HarmonyChoiceOutput, prefixes: list[str]) -> tuple[str | None, str | None, list, str | None]:
    """Stream the prefixes (the last one finished) through a choice; reassemble its deltas as a client does."""
    reasoning, content, calls = None, None, {}
    for k, text in enumerate(prefixes):
        finished = k == len(prefixes) - 1
        for delta in output.deltas(text, finished, "stop" if finished else None):
            if "reasoning_content" in delta:
                reasoning = (reasoning or "") + delta["reasoning_content"]
            if "content" in delta:
                content = (content or "") + delta["content"]
            for call in delta.get("tool_calls", []):
                if call["index"] not in calls:
                    calls[call["index"]] = [call["function"]["name"], ""]
                calls[call["index"]][1] += call["function"]["arguments"]
    return reasoning, content, [tuple(c) for c in calls.values()], output.finish_reason("stop")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_harmony_model(str(tmp_path_factory.mktemp("harmony")))


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


@pytest.mark.parametrize("case", range(len(COMPLETIONS)))
def test_a_completion_splits_into_reasoning_content_and_calls_in_any_chunking(case, tokenizer):
    msgs, recipient_in_role = COMPLETIONS[case]
    text = _write(msgs, recipient_in_role)
    want = _expected(msgs)
    plan = ToolPlan("auto", TOOLS, parser=get_tool_parser("openai", TOOLS))
    msg, reason = HarmonyChoiceOutput(plan).message(text, "stop")
    got_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    assert (msg["reasoning_content"], msg["content"], got_calls) == want
    assert reason == ("tool_calls" if want[2] else "stop")
    # the registered parsers agree with the choice output
    assert get_reasoning_parser("openai_gptoss", "").split(text) == want[:2]
    content, calls = plan.parser.extract(text)
    assert (content, [(c.name, c.arguments) for c in calls]) == (want[1], want[2])
    # streamed: cut at random characters (special tokens cut in half too), and token by token as detokenized
    rng = random.Random(case)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), 12)) + [len(text)]
        assert _replay(HarmonyChoiceOutput(plan), [text[:c] for c in cuts]) == (*want, reason)
    ids = tokenizer.encode(text, add_special_tokens=False)
    prefixes = [tokenizer.decode(ids[:k], skip_special_tokens=False) for k in range(1, len(ids) + 1)]
    assert prefixes[-1] == text
    assert _replay(HarmonyChoiceOutput(plan), prefixes) == (*want, reason)
    # the stop token's text left out of the output changes nothing
    trimmed, _ = HarmonyChoiceOutput(plan).message(re.sub(r"<\|(return|call)\|>$", "", text), "stop")
    assert [trimmed.get(k) for k in ("content", "reasoning_content")] == [
        msg.get(k) for k in ("content", "reasoning_content")
    ]
    assert [c["function"] for c in trimmed.get("tool_calls", [])] == [c["function"] for c in msg.get("tool_calls", [])]


def test_a_call_cut_by_max_tokens_is_not_returned_and_no_tools_means_no_calls():
    msgs, _ = COMPLETIONS[1]
    text = _write(msgs, False)
    cut = text[: text.index('"Paris')]
    plan = ToolPlan("auto", TOOLS, parser=get_tool_parser("openai", TOOLS))
    msg, reason = HarmonyChoiceOutput(plan).message(cut, "length")
    assert "tool_calls" not in msg and msg["content"] is None and reason == "length"
    assert msg["reasoning_content"] == msgs[0].content[0].text
    msg, reason = HarmonyChoiceOutput(ToolPlan(None)).message(text, "stop")
    assert "tool_calls" not in msg and reason == "stop"


def test_text_without_harmony_markers_is_content():
    assert split_completion("plain words", final=True).content == "plain words"
    assert split_completion("plain words", final=False).content is None  # may still be a header


def _chat_messages(conv: Conversation) -> tuple[list[dict], list[dict], str]:
    """An openai-harmony conversation as chat-completions messages, tools and reasoning effort."""
    messages, tools, effort = [], [], "medium"
    for msg in conv.messages:
        part = msg.content[0]
        if msg.author.role == Role.SYSTEM:
            effort = part.reasoning_effort.value.lower()
        elif msg.author.role == Role.DEVELOPER:
            messages.append({"role": "developer", "content": part.instructions})
            for t in part.tools["functions"].tools:
                tools.append(
                    {
                        "type": "function",
                        "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
                    }
                )
        elif msg.author.role == Role.TOOL:
            messages.append({"role": "tool", "tool_call_id": "call_1", "content": part.text})
        elif msg.author.role == Role.USER:
            messages.append({"role": "user", "content": part.text})
        elif msg.channel == "analysis":
            messages.append({"role": "assistant", "content": None, "reasoning_content": part.text})
        elif msg.recipient:
            call = {"id": "call_1", "type": "function"}
            call["function"] = {"name": msg.recipient.removeprefix("functions."), "arguments": part.text}
            messages[-1]["tool_calls"] = [call]
        else:
            messages.append({"role": "assistant", "content": part.text})
    return messages, tools, effort


CONVERSATION = Conversation.from_messages(
    [
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(ReasoningEffort.LOW)),
        Message.from_role_and_content(
            Role.DEVELOPER,
            DeveloperContent.new()
            .with_instructions("Answer in one line.")
            .with_function_tools([ToolDescription.new("get_weather", "Weather", parameters=WEATHER_PARAMS)]),
        ),
        Message.from_role_and_content(Role.USER, "Weather in Oslo?"),
        _say("Need the tool.", "analysis"),
        _say('{"city": "Oslo"}', "commentary", "functions.get_weather", "<|constrain|> json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"sunny": true}')
        .with_recipient("assistant")
        .with_channel("commentary"),
        _say("Sunny in Oslo.", "final"),
        Message.from_role_and_content(Role.USER, "Thanks!"),
    ]
)


def test_the_prompt_of_a_library_conversation_parses_back_to_it(tokenizer):
    """The chat messages (through the server's own message model) rendered by the template read back as the
    library's messages: authors, channels, recipients and contents; the effort and tools reach the system and
    developer messages."""
    messages, tools, effort = _chat_messages(CONVERSATION)
    shown = [ChatMessage.model_validate(m).to_template() for m in messages]
    kwargs = harmony_template_kwargs(effort, {})
    prompt = tokenizer.apply_chat_template(shown, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
    assert prompt.endswith("<|start|>assistant")
    parsed = parse_messages(prompt, author=None)
    system, developer, rest = parsed[0], parsed[1], parsed[2:]
    assert (system.author, developer.author) == ("system", "developer")
    assert "Reasoning: low" in system.content and "Answer in one line." in developer.content
    assert "type get_weather" in developer.content
    want = [
        (m.author.name or m.author.role.value, m.channel, m.recipient, m.content[0].text)
        for m in CONVERSATION.messages[2:]
    ]
    assert [(m.author, m.channel, m.recipient, m.content) for m in rest] == want
    assert rest[2].content_type == "json"


def test_prompts_of_llama_cpps_gpt_oss_template_parse_back():
    llama_cpp = pytest.importorskip("llama_cpp")
    turns = [("system", "Be brief."), ("user", "Hi <b>there</b>"), ("assistant", "Hello!"), ("user", "Bye")]
    arr = (llama_cpp.llama_chat_message * len(turns))()
    for i, (role, text) in enumerate(turns):
        arr[i].role, arr[i].content = role.encode(), text.encode()
    buf = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_chat_apply_template(b"gpt-oss", arr, len(turns), True, buf, len(buf))
    assert n > 0
    rendered = buf.raw[:n].decode()
    assert rendered.endswith("<|start|>assistant")
    assert [(m.author, m.content) for m in parse_messages(rendered, author=None)] == turns


@pytest.mark.skipif(
    not os.path.exists(os.path.join(os.environ.get("TIKTOKEN_ENCODINGS_BASE", "/nonexistent"), "o200k_base.tiktoken")),
    reason="openai-harmony's encoding needs o200k_base.tiktoken (TIKTOKEN_ENCODINGS_BASE)",
)
def test_against_openai_harmonys_own_renderer_and_parser():
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)

    def fields(msgs: list) -> list[tuple]:
        return [(m.author.name or m.author.role.value, m.channel, m.recipient, m.content[0].text) for m in msgs]

    for msgs, recipient_in_role in COMPLETIONS:
        text = _write(msgs, recipient_in_role)
        theirs = enc.parse_messages_from_completion_tokens(enc.encode(text, allowed_special="all"), Role.ASSISTANT)
        ours = parse_messages(text)
        assert [(m.author, m.channel, m.recipient, m.content) for m in ours] == fields(theirs) == fields(msgs)
    tokens = enc.render_conversation(CONVERSATION)
    theirs = enc.parse_messages_from_completion_tokens(tokens, None)
    ours = parse_messages(enc.decode_utf8(tokens), author=None)
    assert [(m.author, m.channel, m.recipient, m.content) for m in ours][2:] == fields(theirs)[2:]


@pytest.mark.parametrize(
    "effort,kwargs,param",
    [("minimal", {}, "reasoning_effort"), (None, {"builtin_tools": ["browser"]}, "chat_template_kwargs.builtin_tools")],
)
def test_harmony_fields_not_served_are_refused_by_name(effort, kwargs, param):
    with pytest.raises(APIError) as err:
        harmony_template_kwargs(effort, kwargs)
    assert err.value.status == 400 and err.value.param == param


# ---- the real server ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    srv = RemoteServer(
        [model_path, "--served-model-name", "oss", *FLOAT32], str(tmp_path_factory.mktemp("hs") / "s.log"), timeout=120
    )
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    try:
        yield srv
    finally:
        srv.stop()


def _forced_raw(
    server, tokenizer, messages: list[dict], names: list[str], bias: dict, max_tokens: int = 120
) -> tuple[str, int]:
    """The greedy output under the forced-call grammar for the same prompt through /v1/completions (no parsing):
    its text and token count."""
    tools = [t for t in TOOLS if t["function"]["name"] in names]
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    grammar = forced_call_grammar(
        {t["function"]["name"]: closed_schema(t["function"]["parameters"]) for t in tools}, tokenizer
    )
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    out = server.client.completions.create(
        model="oss",
        prompt=list(ids),
        max_tokens=max_tokens,
        temperature=0,
        logit_bias=bias,
        extra_body={
            "structured_outputs": {"grammar": grammar},
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "stop_token_ids": stops,
        },
    )
    return out.choices[0].text, out.usage.completion_tokens


FORCED = re.compile(
    r"(?:<\|channel\|>analysis<\|message\|>(?P<reasoning>.*?)<\|end\|><\|start\|>assistant)?"
    r"<\|channel\|>commentary to=functions\.(?P<name>\w+) <\|constrain\|>json<\|message\|>(?P<args>.*?)(?:<\|call\|>)?",
    re.DOTALL,
)


@pytest.mark.parametrize("reasoning", [True, False])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_streamed_is_reassembled_by_the_openai_client(server, tokenizer, tool_choice, reasoning):
    """The random model writes a harmony call under the grammar (after reasoning that <|end|> soon ends, or
    straight away with the commentary channel favoured): the chat answer's reasoning_content and tool_calls are what its raw text holds,
    whole and streamed, and it stops at <|call|>."""
    if reasoning:
        bias = {str(tokenizer.convert_tokens_to_ids("<|end|>")): 6.0}
    else:
        bias = {str(tokenizer.encode("commentary", add_special_tokens=False)[0]): 100.0}
    ask = [{"role": "user", "content": "Time?"}]
    names = ["get_weather", "get_time"] if tool_choice == "required" else ["get_time"]
    raw, n_tokens = _forced_raw(server, tokenizer, ask, names, bias)
    m = FORCED.fullmatch(raw)
    assert m is not None, raw
    want_reasoning, want_call = m.group("reasoning"), (m.group("name"), json.loads(m.group("args")))
    assert (want_reasoning is not None) == reasoning
    kw = dict(
        model="oss",
        messages=ask,
        tools=[t for t in TOOLS if t["function"]["name"] in names],
        tool_choice=tool_choice,
        max_tokens=120,
        temperature=0,
        logit_bias=bias,
    )
    resp = server.client.chat.completions.create(**kw)
    choice = resp.choices[0]
    assert resp.usage.completion_tokens == n_tokens
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    assert choice.message.content is None and choice.message.model_extra["reasoning_content"] == want_reasoning
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [want_call]
    calls, reasoning, reason = {}, None, None
    with server.client.chat.completions.stream(**kw) as stream:
        for event in stream:
            if event.type == "chunk":
                for c in event.chunk.choices:
                    reason = c.finish_reason or reason
                    piece = (c.delta.model_extra or {}).get("reasoning_content")
                    reasoning = (reasoning or "") + piece if piece else reasoning
                    assert not c.delta.content
        final = stream.get_final_completion()
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in final.choices[0].message.tool_calls]
    assert calls == [want_call] and (reasoning or "") == (want_reasoning or "") and reason == choice.finish_reason


def test_generation_stops_at_return_and_effort_and_past_reasoning_reach_the_prompt(server, tokenizer):
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"sunny": true}'},
    ]
    ret = tokenizer.convert_tokens_to_ids("<|return|>")
    for effort in ("low", "high"):
        resp = server.client.chat.completions.create(
            model="oss",
            messages=history,
            tools=TOOLS[:1],
            reasoning_effort=effort,
            max_tokens=20,
            temperature=0,
            logit_bias={str(ret): 100},
        )
        shown = [ChatMessage.model_validate(m).to_template() for m in history]
        ids = tokenizer.apply_chat_template(
            shown, tools=TOOLS[:1], add_generation_prompt=True, tokenize=False, reasoning_effort=effort
        )
        assert f"Reasoning: {effort}" in ids and "<|channel|>analysis<|message|>Need the tool.<|end|>" in ids
        assert resp.usage.prompt_tokens == len(tokenizer.encode(ids, add_special_tokens=False))
        choice = resp.choices[0]
        assert resp.usage.completion_tokens == 1 and choice.finish_reason == "stop"
        assert choice.message.content is None and choice.message.tool_calls is None


def test_unserved_harmony_fields_get_a_400_naming_them(server):
    with pytest.raises(openai.BadRequestError) as err:
        server.client.chat.completions.create(
            model="oss", messages=[{"role": "user", "content": "x"}], reasoning_effort="minimal", max_tokens=2
        )
    assert "reasoning_effort" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        server.client.chat.completions.create(
            model="oss",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"builtin_tools": ["python"]}},
        )
    assert "chat_template_kwargs.builtin_tools" in str(err.value)


def test_messages_api_count_tokens_shows_effort_and_past_thinking(server, tokenizer):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Need the tool.", "signature": ""}]},
    ]
    counted = client.messages.count_tokens(
        model="oss",
        messages=messages + [{"role": "user", "content": "Go on"}],
        extra_body={"output_config": {"effort": "high"}},
    )
    shown = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "thinking": "Need the tool."},
        {"role": "user", "content": "Go on"},
    ]
    text = tokenizer.apply_chat_template(shown, add_generation_prompt=True, tokenize=False, reasoning_effort="high")
    assert "Reasoning: high" in text and "analysis<|message|>Need the tool." in text
    assert counted.input_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_responses_api_reads_harmony_reasoning_and_sends_past_reasoning_back(server, tokenizer):
    """A forced call whose reasoning the output limit cuts: the reasoning item holds the analysis text the raw
    output holds, and no call is made; past reasoning and calls given as input items reach the prompt."""
    raw, _ = _forced_raw(server, tokenizer, [{"role": "user", "content": "Time?"}], ["get_time"], {}, max_tokens=12)
    head = "<|channel|>analysis<|message|>"
    assert raw.startswith(head) and "<|end|>" not in raw, raw
    tool = {"type": "function", "name": "get_time", "description": "Time", "parameters": TIME_PARAMS}
    kw = dict(model="oss", tools=[tool], tool_choice="required", temperature=0, reasoning={"effort": "medium"})
    resp = server.client.responses.create(input="Time?", max_output_tokens=12, **kw)
    assert [(i.type, i.content[0].text) for i in resp.output] == [("reasoning", raw[len(head) :])]
    assert resp.status == "incomplete"
    past = [
        {"role": "user", "content": "Time?"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Need the tool."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": '{"zone": "UTC"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
    ]
    resp = server.client.responses.create(input=past, max_output_tokens=1, **kw)
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}
    shown = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "thinking": "Need the tool.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    chat_tool = {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
    text = tokenizer.apply_chat_template(shown, tools=[chat_tool], add_generation_prompt=True, tokenize=False)
    assert "analysis<|message|>Need the tool.<|end|>" in text
    assert resp.usage.input_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_a_session_keeps_the_harmony_reply_as_a_message_the_template_renders(server, tokenizer):
    """A session stores the parsed reply (call and reasoning), not its raw markup: the next turn's prompt is the
    template's rendering of the whole conversation with that call in it."""
    bias = {str(tokenizer.encode("commentary", add_special_tokens=False)[0]): 100.0}
    ask = [{"role": "user", "content": "Time?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(model="oss", tools=TOOLS[1:], temperature=0, logit_bias=bias, extra_body={"session_id": "harmony-s1"})
    first = server.client.chat.completions.create(messages=ask, tool_choice=named, max_tokens=60, **kw)
    call = first.choices[0].message.tool_calls[0]
    answer = {"role": "tool", "tool_call_id": call.id, "content": "12:00"}
    second = server.client.chat.completions.create(messages=[answer], max_tokens=1, **kw)
    reply = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_time", "arguments": call.function.arguments}}],
    }
    text = tokenizer.apply_chat_template(
        [*ask, reply, answer], tools=TOOLS[1:], add_generation_prompt=True, tokenize=False
    )
    assert second.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
