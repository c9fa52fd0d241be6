"""OpenAI's harmony format (gpt-oss), read without its tokenizer files: a message is
`<|start|>AUTHOR HEADER<|message|>CONTENT<|end|>` (or `<|return|>` / `<|call|>`, which end a completion), the header
naming the channel (`<|channel|>analysis`), a recipient (`to=functions.NAME`, before or after the channel) and a
content type (`json`, or `<|constrain|>json`). A completion continues the prompt's `<|start|>assistant`, so it opens
inside a header.

Prompts are rendered by the checkpoint's own chat template; this module parses what the model writes (and, for
tests and checks, rendered prompts) into messages, splits a completion into reasoning (`analysis`), content
(`final`, and `commentary` without a recipient: preambles) and function calls (`to=functions.NAME`), and builds the
grammar that forces a call (tool_choice "required" or a named function). Everything works on detokenized text with
the special tokens kept, re-read whole at every step, so each streamed piece is a prefix of the final value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
SPECIAL_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
STOP_TOKENS = (RETURN, CALL)  # they end a completion; <|end|> ends a message, after which the model goes on
FUNCTIONS = "functions."  # the namespace of the request's function tools
REASONING_EFFORTS = ("low", "medium", "high")
_LONGEST = max(len(t) for t in SPECIAL_TOKENS)
_BOUNDARY = re.compile("|".join(re.escape(t) for t in (START, MESSAGE, END, RETURN, CALL)))
_RECIPIENT = re.compile(r"\bto=(\S+)")


@dataclass
class HarmonyMessage:
    """One message: its author (a role, or a tool's name such as `functions.get_weather`), header fields and
    content; `end` is the token that closed it, None while it is still being written."""

    author: str | None
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    content: str = ""
    end: str | None = None


@dataclass
class Split:
    """A completion's parts in OpenAI's terms: reasoning and content (None when absent) and the function calls."""

    reasoning: str | None
    content: str | None
    calls: list[HarmonyMessage]


def _header(msg: HarmonyMessage, header: str, with_author: bool) -> None:
    """Fill msg's header fields from the text between the message's start and `<|message|>`."""
    before, sep, after = header.partition(CHANNEL)
    found = _RECIPIENT.search(before)
    if found:
        msg.recipient = found.group(1)
    if with_author:
        msg.author = _RECIPIENT.sub("", before).strip() or None
    if not sep:
        return
    words = after.replace(CONSTRAIN, " " + CONSTRAIN).split()
    if words:
        msg.channel = words.pop(0)
    for word in words:
        if word.startswith("to="):
            msg.recipient = word[3:]
        elif word != CONSTRAIN:
            msg.content_type = word.removeprefix(CONSTRAIN) or msg.content_type


def _without_partial_special(text: str) -> str:
    """text less a tail that may be the beginning of a special token (a stream cut inside one)."""
    for k in range(min(len(text), _LONGEST - 1), 0, -1):
        if any(t.startswith(text[-k:]) for t in SPECIAL_TOKENS):
            return text[:-k]
    return text


def parse_messages(text: str, author: str | None = "assistant", final: bool = True) -> list[HarmonyMessage]:
    """The messages of harmony text. author: the role whose header the text opens in (a completion after the
    prompt's `<|start|>assistant`); None when it opens between messages (a whole prompt). Unfinished (final=False),
    the last message may be open and a tail that may begin a special token is left out. A message whose header
    never reaches `<|message|>` is left out, except that a finished text with no special token at all (a model
    that ignored the format) is one message of unknown channel."""
    if final and not any(t in text for t in SPECIAL_TOKENS):
        return [HarmonyMessage(author, content=text, end=RETURN)] if text else []
    if not final:
        text = _without_partial_special(text)
    messages: list[HarmonyMessage] = []
    current: HarmonyMessage | None = HarmonyMessage(author) if author is not None else None
    with_author, in_content, pos = author is None, False, 0
    for m in _BOUNDARY.finditer(text):
        piece, token = text[pos : m.start()], m.group()
        pos = m.end()
        if token == START:
            current, with_author, in_content = HarmonyMessage(None), True, False
        elif current is None:
            continue  # text outside any message (before the first <|start|>)
        elif token == MESSAGE and not in_content:
            _header(current, piece, with_author)
            in_content = True
        elif token == MESSAGE:
            current.content += piece + token  # a literal marker inside content
        elif in_content:  # <|end|>, <|return|>, <|call|>
            current.content += piece
            current.end = token
            messages.append(current)
            current = None
        else:
            current = None  # a message closed before its header was: nothing to keep
    if current is not None and in_content:
        current.content += text[pos:]
        messages.append(current)
    return messages


def split_completion(text: str, final: bool = True) -> Split:
    """Reasoning (the `analysis` messages), content (`final`, preambles, and a message without a channel) and the
    calls (messages with a recipient other than the user) of a completion, read as far as it is written. Messages
    by another author (a model writing a tool's answer itself) end what is read."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[HarmonyMessage] = []
    for msg in parse_messages(text, "assistant", final):
        if msg.author not in ("assistant", None):
            break
        if msg.recipient not in (None, "all", "user"):
            calls.append(msg)
        elif msg.channel == "analysis":
            reasoning.append(msg.content)
        else:
            content.append(msg.content)
    return Split("\n".join(reasoning) if reasoning else None, "".join(content) if content else None, calls)


def call_name(msg: HarmonyMessage) -> str:
    """The function a call message addresses (`functions.get_weather` -> `get_weather`)."""
    return (msg.recipient or "").removeprefix(FUNCTIONS)


def _literal(text: str) -> str:
    return json.dumps(text)


def _marker(tokenizer: Any, marker: str) -> str:
    """A special token as a Lark item: `<[id]>` when it is one token of the vocabulary, else its text."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else _literal(marker)


def forced_call_grammar(functions: dict[str, dict], tokenizer: Any) -> str:
    """A llguidance Lark grammar for a completion that must call one of functions (name -> closed parameter
    schema): an optional analysis message, then `<|channel|>commentary to=functions.NAME <|constrain|>json
    <|message|>{arguments}<|call|>`."""
    ch, msg, end, start, con, call = (_marker(tokenizer, t) for t in (CHANNEL, MESSAGE, END, START, CONSTRAIN, CALL))
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    lines = [
        "%llguidance {}",
        f"start: analysis? {ch} call",
        f'analysis: {ch} "analysis" {msg} ANALYSIS {end} {start} "assistant"',
        "ANALYSIS: /(.|\\n)*/",
        f"call: {' | '.join(f'fn_{i}' for i in range(len(functions)))}",
    ]
    for i, (name, schema) in enumerate(functions.items()):
        head = _literal(f"commentary to={FUNCTIONS}{name} ")
        args = "%json " + json.dumps({**schema, "x-guidance": layout})
        lines.append(f'fn_{i}: {head} {con} "json" {msg} {args} {call}')
    return "\n".join(lines) + "\n"


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The ids of `<|return|>` and `<|call|>` in the vocabulary (those that are single tokens)."""
    out = []
    for token in STOP_TOKENS:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) == 1:
            out.append(ids[0])
    return out
