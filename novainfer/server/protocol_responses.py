"""Pydantic schemas of OpenAI's Responses API requests (POST /v1/responses): the fields this server serves;
any other field is a 400 naming it, as on the chat routes."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag

from novainfer.server.protocol import OpenAIModel, _bounded

_STATUS = Literal["in_progress", "completed", "incomplete"]


def by_type(members: dict[str, Any], other: Any, missing: str | None = None) -> Any:
    """A union of models chosen by the value's `type` (`missing` when it has none); any other type is `other`,
    a catch-all model that lets the handler answer a 400 naming the unsupported type."""

    def tag(value: Any) -> str:
        kind = value.get("type", missing) if isinstance(value, dict) else getattr(value, "type", missing)
        return kind if isinstance(kind, str) and kind in members else "other"  # a list or object: "other", a 400

    options = [Annotated[model, Tag(name)] for name, model in members.items()] + [Annotated[other, Tag("other")]]
    return Annotated[Union[tuple(options)], Discriminator(tag)]


def not_one_of(known: tuple[str, ...]) -> Any:
    """A catch-all's `type` field: its published schema excludes the known types, so a oneOf has one match."""
    return Field(..., json_schema_extra={"not": {"enum": list(known)}})


_KNOWN_PARTS = ("input_text", "output_text")
_KNOWN_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


class InputText(OpenAIModel):
    type: Literal["input_text"]
    text: str


class OutputText(OpenAIModel):
    """An earlier assistant message's text, sent back as input."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class UnsupportedPart(OpenAIModel):
    """input_image / input_file / refusal parts: accepted by the schema so the 400 can name them."""

    model_config = {"extra": "allow"}
    type: str = not_one_of(_KNOWN_PARTS)


ContentPart = by_type({"input_text": InputText, "output_text": OutputText}, UnsupportedPart)


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: _STATUS | None = None
    phase: str | None = None


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: _STATUS | None = None


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: _STATUS | None = None


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(OpenAIModel):
    """An earlier turn's reasoning: the assistant message's reasoning_content (templates that keep past reasoning,
    such as gpt-oss's before a tool call, show it)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: _STATUS | None = None


class UnsupportedItem(OpenAIModel):
    """Any other item type (item_reference, built-in tool calls): accepted by the schema so the 400 names it."""

    model_config = {"extra": "allow"}
    type: str = not_one_of(_KNOWN_ITEMS)


InputItem = by_type(
    {
        "message": MessageItem,
        "function_call": FunctionCallItem,
        "function_call_output": FunctionCallOutputItem,
        "reasoning": ReasoningItem,
    },
    UnsupportedItem,
    missing="message",
)


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a no-op: the model decides its length


class ReasoningConfig(OpenAIModel):
    """effort goes to the chat template of a harmony model (low, medium, high), a no-op for others; reasoning items
    appear when the model reasons."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(OpenAIModel):
    include_obfuscation: bool | None = None  # a no-op: events are not padded


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # function tools; a built-in tool is a 400 naming it
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = _bounded("max_tokens")
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    background: bool | None = None  # only false: there is no background queue
    truncation: Literal["disabled"] | None = None  # "auto" (dropping old items) is not done
    include: list[str] | None = None  # only empty: no extra output data is produced
    reasoning: ReasoningConfig | None = None
    top_logprobs: int | None = None  # only 0: log-probabilities are not served here
    # documented no-ops: they cannot change the output
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
