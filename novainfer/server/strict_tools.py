"""`strict: true` functions under tool_choice "auto": a lazy grammar (llama.cpp's and vLLM's approach) leaves the
output free text until the model writes its call format's start marker; from there the call is one of the request's
functions in that format, a strict one's arguments following its closed schema (no undeclared property), a
non-strict one's any object. Llama 3's JSON calls (a call only at the output's start) get the same choice
between text and calls. Formats without a grammar here refuse strict functions under "auto" with a 400.

The grammars are llguidance Lark: a marker that is one token of the model's vocabulary (Qwen's `<tool_call>`) is
written as that token, else as text that a lazy lexeme waits for.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from novainfer.sampling_params import StructuredOutputsParams
from novainfer.server.errors import APIError
from novainfer.server.structured_request import closed_schema

# the JSON layout the structured-output backend writes (one space after "," and ":"), as %json's options
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_END_MARKER = "</tool_call>"
_TEXT = "TEXT: /(.|\\n)*/"


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text)


def _json_rule(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_LAYOUT})


def _json_call(name: str, schema: dict | None, key: str = "arguments") -> str:
    """`{"name": NAME, KEY: {...}}` as a Lark expansion."""
    head = _lit(json.dumps({"name": name}, ensure_ascii=False)[:-1] + f', "{key}": ')
    return f'{head} {_json_rule(schema or {"type": "object"})} "}}"'


def _hermes_call(rule: str, name: str, schema: dict | None) -> list[str]:
    """Rule `rule`: the JSON call between the markers, on its own line."""
    return [f'{rule}: "\\n" {_json_call(name, schema)} "\\n"']


def _qwen3_coder_call(rule: str, name: str, schema: dict | None) -> list[str]:
    """`<function=NAME>` and one `<parameter=KEY>` block per declared property, in declared order (required ones
    always); a non-strict function's parameters are any names with text values. Rule `rule` first, then its
    parameters' rules."""
    rules, params = [], []
    if schema is None:
        rules.append(f'{rule}_any: "<parameter=" /[^>\\n]+/ ">\\n" value_text "\\n"')
        params.append(f"{rule}_any*")
    else:
        required = set(schema.get("required") or [])
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        for i, (key, sub) in enumerate((schema.get("properties") or {}).items()):
            rules.append(f'{rule}_p{i}: {_lit(f"<parameter={key}>" + chr(10))} {_qwen3_value(sub, defs)} "\\n"')
            params.append(f"{rule}_p{i}" + ("" if key in required else "?"))
    body = " ".join(params)
    return [f'{rule}: "\\n" {_lit(f"<function={name}>" + chr(10))} {body} "</function>\\n"', *rules]


def _qwen3_value(schema: Any, defs: dict) -> str:
    """A parameter's value as the qwen3_coder parser reads it back: raw text for strings, JSON for the rest."""
    if not isinstance(schema, dict):
        return "value_text"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    enum = schema.get("enum")
    if enum is not None and all(isinstance(e, str) for e in enum):
        return "(" + " | ".join(_lit(e) for e in enum) + ') "\\n</parameter>"'
    if "string" in kinds:
        return "value_text"
    return _json_rule({**schema, **defs}) + ' "\\n</parameter>"'


def _llama3_json_call(rule: str, name: str, schema: dict | None) -> list[str]:
    return [f"{rule}: {_json_call(name, schema, 'parameters')}"]


def _mistral_list_call(rule: str, name: str, schema: dict | None) -> list[str]:
    """Mistral v3 tokenizers: a JSON call inside the `[TOOL_CALLS][...]` list."""
    return [f"{rule}: {_json_call(name, schema)}"]


def _mistral_named_call(rule: str, name: str, schema: dict | None) -> list[str]:
    """Mistral v11+ tokenizers: `NAME[ARGS]{...}` (rule `args_sep` is the [ARGS] token)."""
    return [f"{rule}: {_lit(name)} args_sep {_json_rule(schema or {'type': 'object'})}"]


Build = Callable[[str, str, dict | None], list[str]]
# formats whose calls open with the parser's start marker anywhere in the output (text before and between them)
_MARKED: dict[str, Build] = {"hermes": _hermes_call, "qwen3_coder": _qwen3_coder_call}
_VALUE_TEXT_RULE = 'value_text[lazy]: /(.|\\n)*/ "\\n</parameter>"'
_PYTHON_TAG = "<|python_tag|>"


def strict_auto_constraint(
    tools: list[Any], parser: str, marker: str, tokenizer: Any, parallel: bool
) -> StructuredOutputsParams | None:
    """The lazy grammar for "auto" when some function is strict (None when none is); a 400 naming the first strict
    function's field when the parser's format has no grammar here. tools: the request's ChatTools."""
    strict = [i for i, t in enumerate(tools) if t.function.strict]
    if not strict:
        return None
    layout = _layout(parser, marker, tokenizer, parallel)
    if layout is None:
        raise APIError(
            400,
            f'strict functions under tool_choice "auto" are not enforced for the {parser!r} '
            f"call format (or this vocabulary's markers); drop strict, or force the call with "
            f'tool_choice "required" or a named function',
            param=f"tools[{strict[0]}].function.strict",
        )
    build, top = layout
    fns, rules = [], []
    for i, t in enumerate(tools):
        schema = closed_schema(t.function.parameters or {"type": "object"}) if t.function.strict else None
        rules += build(f"fn_{i}", t.function.name, schema)
        fns.append(f"fn_{i}")
    lines = ["%llguidance {}", *top, "call_body: " + " | ".join(fns), *rules]
    if any("value_text" in r for r in rules):
        lines.append(_VALUE_TEXT_RULE)
    return StructuredOutputsParams(grammar="\n".join(lines) + "\n")


def _layout(parser: str, marker: str, tokenizer: Any, parallel: bool) -> tuple[Build, list[str]] | None:
    """(how one call is written, the grammar's top rules) for the format, or None where none is written here."""
    if parser in _MARKED:
        return _MARKED[parser], _marked_top(tokenizer, marker, parallel)
    if parser == "llama3_json":
        return _llama3_json_call, _llama3_json_top(tokenizer, parallel)
    if parser == "mistral":
        return _mistral_layout(tokenizer, marker, parallel)
    return None


def _mistral_layout(tokenizer: Any, marker: str, parallel: bool) -> tuple[Build, list[str]] | None:
    """Free text, then `[TOOL_CALLS]` and the calls until the end: the v11+ `NAME[ARGS]{...}` form (repeated after
    `[TOOL_CALLS]`) when `[ARGS]` is a token of the vocabulary, else the v3 JSON list. None when `[TOOL_CALLS]`
    is not one token."""
    start, args = _token_or_text(tokenizer, marker), _token_or_text(tokenizer, "[ARGS]")
    if not start.startswith("<["):
        return None
    if args.startswith("<["):
        return _mistral_named_call, [
            "start: TEXT call" + ("*" if parallel else "?"),
            f"call: {start} call_body",
            f"args_sep: {args}",
            _TEXT,
        ]
    more = ' (", " call_body)*' if parallel else ""
    return _mistral_list_call, [f'start: TEXT ({start} "[" call_body{more} "]")?', _TEXT]


def _marked_top(tokenizer: Any, marker: str, parallel: bool) -> list[str]:
    """Free text; at the marker, a call up to the end marker; then text and calls again (parallel) or the end."""
    start, end = _token_or_text(tokenizer, marker), _token_or_text(tokenizer, _END_MARKER)
    if start.startswith("<["):  # a token ends the free text by itself
        trigger = [f"call: TEXT {start} call_body {end}"]
    else:
        trigger = [f"call: call_start call_body {end}", f"call_start[lazy]: TEXT {start}"]
    top = "start: call* TEXT" if parallel else "start: TEXT | call"
    return [top, *trigger, _TEXT]


def _llama3_json_top(tokenizer: Any, parallel: bool) -> list[str]:
    """Llama 3's output is a call only when it starts with one (the parser's rule): either text that does not open
    with `{`, or calls from the first character (after `<|python_tag|>` where it is a token), `;`-separated."""
    tag = _token_or_text(tokenizer, _PYTHON_TAG)
    more = ' (";" " "? call_body)*' if parallel else ""
    return [
        f"start: PROSE? | {tag + '? ' if tag.startswith('<[') else ''}call_body{more}",
        "PROSE: /\\s*[^{\\s](.|\\n)*/",
    ]


def _token_or_text(tokenizer: Any, marker: str) -> str:
    """The marker as one token of the vocabulary (`<[id]>`) when it is one, else as a Lark string."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else _lit(marker)
